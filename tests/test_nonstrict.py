"""strict=False: only what the maths needs; degenerate problems give empty or zero results."""

import numpy as np
import pytest

import nsa_numba
from nsa_numba import NsaError
from conftest import assert_forward_accurate, assert_grad_accurate, random_problem


@pytest.mark.parametrize("T,N,D,block,stride,seq", [
    (100, 3, 10, 5, 3, [0, 40, 100]),      # nothing a multiple of 16
    (50, 2, 7, 1, 1, None),                 # every token its own window
    (90, 2, 16, 16, 16, [0, 45, 90]),       # l == d: allowed for the grad here
    (200, 2, 16, 8, 20, [0, 100, 200]),     # d > l: gaps between windows
    (37, 1, 1, 37, 5, None),                # one window, D = 1
])
def test_any_positive_window(T, N, D, block, stride, seq, dtype):
    x, w, g = random_problem(T, N, D, block, stride, seq, dtype)
    out = nsa_numba.nsa_compress(x, w, block, stride, actual_seq_len=seq, strict=False)
    assert_forward_accurate(out, x, w, block, stride, seq)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, block, stride, actual_seq_len=seq,
                                         strict=False)
    assert_grad_accurate(dx, dw, g, x, w, block, stride, seq)


def test_gaps_between_windows_are_never_read():
    x, w, g = random_problem(200, 2, 16, 8, 20, None, np.float32)
    covered = np.zeros(200, bool)
    for s in range(0, 193, 20):
        covered[s:s + 8] = True
    x[~covered] = np.nan
    out = nsa_numba.nsa_compress(x, w, 8, 20, strict=False)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, 8, 20, strict=False)
    assert np.isfinite(out).all() and np.isfinite(dw).all()
    assert np.all(dx[~covered] == 0) and np.isfinite(dx[covered]).all()


@pytest.mark.parametrize("shape,seq", [
    ((0, 3, 16), None),      # no tokens
    ((40, 0, 16), None),     # no heads
    ((40, 3, 0), None),      # no head dim
    ((20, 3, 16), None),     # shorter than the window: no windows
    ((40, 3, 16), [0, 0, 20, 40]),
])
def test_empty_problems(shape, seq, dtype):
    T, N, D = shape
    block, stride = 32, 16
    x, w, g = random_problem(T, N, D, block, stride, seq, dtype)
    out = nsa_numba.nsa_compress(x, w, block, stride, actual_seq_len=seq, strict=False)
    assert out.dtype == x.dtype
    assert_forward_accurate(out, x, w, block, stride, seq)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, block, stride, actual_seq_len=seq,
                                         strict=False)
    assert_grad_accurate(dx, dw, g, x, w, block, stride, seq)
    if g.shape[0] == 0:
        assert np.all(dx.astype(np.float64) == 0) and np.all(dw.astype(np.float64) == 0)


@pytest.mark.parametrize("change,fragment", [
    (dict(block=0), "compress_block_size must be >= 1, got 0"),
    (dict(stride=-1), "compress_stride must be >= 1, got -1"),
    (dict(weight=np.zeros((5, 3), np.float32)), "weight must have shape"),
    (dict(seq=[0, 10]), "must end at T = 40"),
])
def test_the_maths_rules_still_hold(change, fragment):
    args = dict(x=np.zeros((40, 3, 4), np.float32), weight=np.zeros((4, 3), np.float32),
                block=4, stride=2, seq=None)
    args.update(change)
    with pytest.raises(NsaError, match=fragment) as info:
        nsa_numba.nsa_compress(args["x"], args["weight"], args["block"], args["stride"],
                               actual_seq_len=args["seq"], strict=False)
    assert info.value.status == 161002
