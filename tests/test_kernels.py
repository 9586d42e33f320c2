"""The two forward kernels (one token per pass, GROUP tokens per pass) agree bit for bit."""

import numpy as np
import pytest

from nsa_numba import _dispatch, _kernels
from nsa_numba._plan import Rules, plan_forward
from conftest import DTYPE_IDS, DTYPES, random_problem


@pytest.mark.parametrize("N,D,block,stride,seq", [
    (4, 32, 32, 16, [0, 100, 101, 400]),      # one or two windows per token
    (3, 48, 64, 16, [0, 37, 300]),            # up to four windows per token
    (2, 16, 8, 20, [0, 150, 300]),            # gaps between windows (d > l)
    (2, 16, 5, 3, [0, 31, 300]),              # segments not a multiple of the group
])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_kernels_agree(N, D, block, stride, seq, dtype):
    x, w, _ = random_problem(seq[-1], N, D, block, stride, seq, dtype, seed=N + D)
    x = np.repeat(x, 2, axis=1)[:, ::2]       # strided input too
    plan = plan_forward(Rules("test", strict=False), x, w, block, stride, seq, 0, "TND",
                        None)
    _, scratch = _dispatch.carve(plan, _dispatch.new_workspace(plan))
    wt = _dispatch._weight_table(plan)
    results = []
    for kernel in (_kernels.compress_forward, _kernels.compress_forward_rows):
        out = plan.storage("out")
        out[...] = 0
        kernel(plan.storage("input"), wt, out, plan.tiles, plan.stride, plan.D, scratch)
        results.append(out.copy())
    assert np.array_equal(results[0], results[1])


def test_dispatch_picks_by_row_length():
    small = plan_forward(Rules("t"), np.zeros((64, 4, 32), np.float32),
                         np.zeros((32, 4), np.float32), 32, 16, None, 0, "TND", None)
    large = plan_forward(Rules("t"), np.zeros((64, 16, 128), np.float32),
                         np.zeros((32, 16), np.float32), 32, 16, None, 0, "TND", None)
    assert _dispatch.forward_kernel(small) is _kernels.compress_forward_rows
    assert _dispatch.forward_kernel(large) is _kernels.compress_forward
