"""Results against the independent float64 reference, over the official test shapes."""

import numpy as np
import pytest

import nsa_numba
from nsa_numba import reference as ref
from conftest import (DTYPES, DTYPE_IDS, assert_forward_accurate, assert_grad_accurate,
                      random_problem)

# (T, N, D, l, d, actual_seq_len) from the operator's published tests
GRAD_SHAPES = {
    "seed": (272, 64, 128, 32, 16, [0, 128, 272]),
    "grad-unit": (272, 128, 192, 32, 16, [0, 120, 140, 272]),
    "torch-npu-grad": (49, 128, 192, 32, 16, [0, 5, 49]),
}
FORWARD_SHAPES = dict(GRAD_SHAPES, **{
    "48x100-n4-d128": (4800, 4, 128, 16, 16, list(range(0, 4801, 100))),
    "48x100-n4-d192": (4800, 4, 192, 16, 16, list(range(0, 4801, 100))),
    "48x100-n6-d256": (4800, 6, 256, 16, 16, list(range(0, 4801, 100))),
    "empty-and-length-1": (2576, 4, 128, 32, 16, [0, 1, 1000, 2576]),
    "d1024": (200, 2, 1024, 32, 16, None),
})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(FORWARD_SHAPES))
def test_forward_official_shapes(name, dtype):
    T, N, D, block, stride, seq = FORWARD_SHAPES[name]
    x, w, _ = random_problem(T, N, D, block, stride, seq, dtype)
    out = nsa_numba.nsa_compress(x, w, block, stride, actual_seq_len=seq)
    assert_forward_accurate(out, x, w, block, stride, seq)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(GRAD_SHAPES) + ["empty-and-length-1", "d1024"])
def test_grad_official_shapes(name, dtype):
    T, N, D, block, stride, seq = FORWARD_SHAPES[name]
    x, w, g = random_problem(T, N, D, block, stride, seq, dtype)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, block, stride, actual_seq_len=seq)
    assert_grad_accurate(dx, dw, g, x, w, block, stride, seq)


@pytest.mark.parametrize("block,stride", [(32, 16), (48, 16), (64, 16), (32, 32), (128, 16)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_window_overlaps(block, stride, dtype):
    # one to eight windows cover each token: every kernel path (one, two, more)
    T, N, D = 700, 3, 32
    seq = [0, 300, 301, 700]
    x, w, g = random_problem(T, N, D, block, stride, seq, dtype, seed=block + stride)
    out = nsa_numba.nsa_compress(x, w, block, stride, actual_seq_len=seq)
    assert_forward_accurate(out, x, w, block, stride, seq)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, block, stride, actual_seq_len=seq)
    assert_grad_accurate(dx, dw, g, x, w, block, stride, seq)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grad_with_windows_that_do_not_overlap(block, dtype):
    # l == d, as in MindSpore's NPU gradient tests (16/16 and 32/32): strict mode
    # accepts it in the backward as the NPU does; every token is in one window or none
    T, N, D = 4800, 4, 128
    seq = list(range(0, T + 1, 100))
    x, w, g = random_problem(T, N, D, block, block, seq, dtype, seed=block)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, block, block, actual_seq_len=seq)
    assert_grad_accurate(dx, dw, g, x, w, block, block, seq)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_small_integers_are_exact(dtype):
    # Small integer data makes every product and partial sum exact in float32, so
    # the result must equal the reference bit for bit: any indexing slip shows.
    T, N, D, block, stride = 600, 5, 48, 48, 16
    seq = [0, 17, 17, 250, 600]
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, (T, N, D)).astype(dtype)
    w = rng.integers(-3, 4, (block, N)).astype(dtype)
    out = nsa_numba.nsa_compress(x, w, block, stride, actual_seq_len=seq)
    assert_bitwise(out, ref.compress(x, w, block, stride, seq).astype(dtype))
    g = rng.integers(-3, 4, out.shape).astype(dtype)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, block, stride, actual_seq_len=seq)
    exact_dx, exact_dw = ref.compress_grad(g, x, w, block, stride, seq)
    assert_bitwise(dx, exact_dx.astype(dtype))
    assert_bitwise(dw, exact_dw.astype(dtype))   # the exact sum, rounded once


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))
