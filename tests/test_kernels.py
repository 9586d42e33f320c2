"""The forward kernels (one token per pass, GROUP tokens per pass, window sums in
registers) agree bit for bit, so do the backward's scalar and vector token pairs,
and the dispatcher picks what applies."""

import numpy as np
import pytest

from nsa_numba._ops import checks as _checks, dispatch as _dispatch
from nsa_numba._kernels import compress as _kernels, simd as _simd
from nsa_numba._core import launch as launcher
from nsa_numba.api import nsa_compress
from nsa_numba._ops.checks import Rules
from nsa_numba._ops.compress import plan_forward, plan_grad
from conftest import DTYPE_IDS, DTYPES, assert_forward_accurate, random_problem


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
    plan.allocate()
    _, scratch = _dispatch.carve(plan, _dispatch.new_workspace(plan))
    results = []
    for kernel in (_kernels.compress_forward, _kernels.compress_forward_rows):
        results.append(_run_forward(kernel, plan, scratch))
    assert np.array_equal(results[0], results[1])


def _specials(a, dtype):
    """Values that round to infinity, NaN, infinities and zeros, spread over ``a``."""
    flat = a.reshape(-1)
    flat[::97] = np.array(np.inf, dtype)
    flat[5::131] = np.array(-np.inf, dtype)
    flat[7::173] = np.array(np.nan, dtype)
    flat[11::59] = np.array(np.finfo(dtype).max, dtype)
    flat[13::61] = 0


def _launch(kernel, plan, scratch, partials=None):
    """``kernel`` run on the arrays a first call gives it (``_ops.dispatch.kernel_arrays``:
    the variant the API and ``warmup`` compile), its outputs zeroed first; returns the
    plan's storage views."""
    views = _dispatch.storage_views(plan)
    for role, view in zip(_dispatch.ROLES[plan.op], views):
        if role in _dispatch.OUTPUT_ROLES:
            view[...] = 0
    arrays, _ = _dispatch.kernel_arrays(plan, views)
    dims = np.array([v.shape for v in views if v.ndim == 4], np.int64)
    extra = (scratch,) if partials is None else (partials, scratch)
    args = (*arrays, *extra, dims, plan.tiles, plan.stride, plan.D, False)
    assert launcher.run(kernel, 1, 1, *args, closing=partials is not None)
    return views


def _run_forward(kernel, plan, scratch):
    """``kernel``'s output for the plan, run as a first call does."""
    return _launch(kernel, plan, scratch)[2].copy()


def _assert_same_bits(a, b, dtype):
    """a and b hold the same bits, except that a NaN's sign and payload are not
    promised (LLVM may swap the operands of an add, and x86 keeps the first operand's
    NaN); returns whether any NaN was compared."""
    both_nan = np.isnan(a.view(dtype)) & np.isnan(b.view(dtype))
    assert np.array_equal(np.where(both_nan, 0, a), np.where(both_nan, 0, b))
    return both_nan.any()


def _simd_matches(kernel, plan, dtype):
    """The dispatcher picks compress_forward_simd for ``plan``, and it gives ``kernel``'s
    bits; returns whether NaNs were among them."""
    assert _dispatch.forward_kernel(plan, plan.storage("input"), plan.storage("out")) \
        is _kernels.compress_forward_simd
    _, scratch = _dispatch.carve(plan, _dispatch.new_workspace(plan))
    return _assert_same_bits(_run_forward(kernel, plan, scratch),
                             _run_forward(_kernels.compress_forward_simd, plan, scratch), dtype)


#: the dtypes compress_forward_simd takes on this machine (float16 only with hardware half
#: conversions)
SIMD_DTYPES = [t for t in DTYPES if _checks.STORAGE[_checks.kind_of(t)] in _simd.STORAGE]


@pytest.mark.parametrize("N,D,block,stride,seq", [
    (4, 128, 32, 16, [0, 37, 100, 101, 400]),   # two windows per token (l = 2d)
    (1, 128, 16, 16, [0, 250]),                 # one window per token (l = d)
    (3, 256, 24, 16, [0, 37, 300]),             # one or two windows; several vectors
    (2, 3 * _simd.WIDTH, 32, 16, [0, 77, 200]),  # 3 vectors per head
    (2, 128, 8, 20, [0, 150, 300]),             # gaps between windows (d > l)
    (5, 128, 30, 17, [0, 31, 300]),             # odd l and d
    (2, 128, 5, 3, [0, 2, 61]),                 # a sequence shorter than a window
])
@pytest.mark.parametrize("dtype", SIMD_DTYPES, ids=str)
def test_simd_forward_matches_rows_kernel(N, D, block, stride, seq, dtype):
    x, w, _ = random_problem(seq[-1], N, D, block, stride, seq, dtype, seed=N * D + block)
    _specials(x, dtype)
    plan = plan_forward(Rules("test", strict=False), x, w, block, stride, seq, 0, "TND",
                        None)
    plan.allocate()
    assert _simd_matches(_kernels.compress_forward_rows, plan, dtype)


HALF_SIMD_DTYPES = [t for t in SIMD_DTYPES if t.itemsize == 2]


@pytest.mark.parametrize("dtype", HALF_SIMD_DTYPES, ids=str)
def test_simd_forward_on_long_rows_matches_grouped_kernel(dtype):
    # rows of 4 KiB (N * D = 2048 16-bit elements): long enough for GROUP tokens per
    # pass, and short enough for the register-held kernel, which the dispatcher picks
    N, D, block, stride, seq = 16, 128, 64, 32, [0, 45, 190, 300]
    x, w, _ = random_problem(seq[-1], N, D, block, stride, seq, dtype, seed=16)
    _specials(x, dtype)
    plan = plan_forward(Rules("test"), x, w, block, stride, seq, 0, "TND", None)
    plan.allocate()
    assert _simd_matches(_kernels.compress_forward, plan, dtype)
    x_finite, _, _ = random_problem(seq[-1], N, D, block, stride, seq, dtype, seed=17)
    out = nsa_compress(x_finite, w, block, stride, actual_seq_len=seq)
    assert_forward_accurate(out, x_finite, w, block, stride, seq)


@pytest.mark.parametrize("view", ["heads", "tokens"])
def test_simd_forward_on_a_padded_carrier(view):
    # a slice of heads or every other token arrives as a C-order carrier whose rows are
    # longer than the bytes read: the prefetch walks each row's used bytes only
    seq = [0, 90, 300]
    big, w, _ = random_problem(600, 6, 128, 32, 16, [0, 600], np.float32, seed=8)
    x = big[:300, 1:5] if view == "heads" else big[::2, 1:5]
    plan = plan_forward(Rules("test"), x, w[:, 1:5], 32, 16, seq, 0, "TND", None)
    plan.allocate()
    assert _dispatch.forward_kernel(plan, plan.storage("input"), plan.storage("out")) \
        is _kernels.compress_forward_simd
    assert plan.storage("input").shape[2] > 4       # rows padded beyond the 4 heads read
    _, scratch = _dispatch.carve(plan, _dispatch.new_workspace(plan))
    rows = _run_forward(_kernels.compress_forward_rows, plan, scratch)
    assert np.array_equal(rows, _run_forward(_kernels.compress_forward_simd, plan, scratch))
    assert_forward_accurate(rows.reshape(-1, 4, 128), x, w[:, 1:5], 32, 16, seq)


@pytest.mark.parametrize("dtype", SIMD_DTYPES, ids=str)
def test_simd_forward_accurate(dtype):
    seq = [0, 100, 333, 600]
    x, w, _ = random_problem(seq[-1], 2, 128, 32, 16, seq, dtype, seed=3)
    out = nsa_compress(x, w, 32, 16, actual_seq_len=seq, strict=False)
    assert_forward_accurate(out, x, w, 32, 16, seq)


def test_dispatch_picks_by_row_length():
    def kernel(x, w, block=32, stride=16):
        plan = plan_forward(Rules("t"), x, w, block, stride, None, 0, "TND", None)
        plan.allocate()
        return _dispatch.forward_kernel(plan, plan.storage("input"), plan.storage("out"))

    f32 = np.float32
    half_more = _simd.WIDTH * 3 // 2
    assert kernel(np.zeros((64, 4, half_more), f32), np.zeros((32, 4), f32)) \
        is _kernels.compress_forward_rows                       # D not a multiple of WIDTH
    assert kernel(np.zeros((4, 64, 128), f32).transpose(1, 0, 2), np.zeros((32, 4), f32)) \
        is _kernels.compress_forward_rows                       # rows not in C order
    assert kernel(np.zeros((128, 4, 128), f32)[::2], np.zeros((32, 4), f32)) \
        is _kernels.compress_forward_simd                       # a padded C-order carrier
    assert kernel(np.zeros((64, 4, 128), f32), np.zeros((32, 4), f32)) \
        is _kernels.compress_forward_simd
    assert kernel(np.zeros((64, 4, 128), f32), np.zeros((48, 4), f32), 48, 16) \
        is _kernels.compress_forward_rows                       # three windows per token
    assert kernel(np.zeros((64, 4, 256), f32)[:, :, ::2], np.zeros((32, 4), f32)) \
        is _kernels.compress_forward_rows                       # rows with a step
    assert kernel(np.zeros((64, 4, 128), np.float64), np.zeros((32, 4), np.float64)) \
        is _kernels.compress_forward_rows                       # float64 sums
    bf16 = np.dtype("bfloat16")
    assert kernel(np.zeros((64, 16, 128), bf16), np.zeros((32, 16), bf16)) \
        is _kernels.compress_forward_simd                       # long rows of 4 KiB
    assert kernel(np.zeros((64, 32, 128), bf16), np.zeros((32, 32), bf16)) \
        is _kernels.compress_forward                            # long rows of 8 KiB
    assert kernel(np.zeros((64, 16, 128), f32), np.zeros((32, 16), f32)) \
        is _kernels.compress_forward                            # 8 KiB of float32


def _run_backward(plan, vector):
    """(input_grad, the float32 per-tile weight-gradient sums, tile 0 holding their
    total) of the scalar or the vector backward kernel."""
    partials, scratch = _dispatch.carve(plan, _dispatch.new_workspace(plan))
    kernel = _kernels.compress_backward_simd if vector else _kernels.compress_backward
    views = _launch(kernel, plan, scratch, partials)
    return views[3].copy(), partials.copy()


@pytest.mark.parametrize("N,D,block,stride,seq", [
    (4, 128, 32, 16, [0, 37, 100, 101, 400]),   # pairs (l = 2d) and edge tokens
    (3, 24, 64, 32, [0, 300, 700]),             # 3 vectors per head
    (2, 8, 20, 10, [0, 33, 301]),               # one vector per head
    (2, 64, 48, 16, [0, 300]),                  # three windows per token: no pairs
])
@pytest.mark.parametrize("dtype", SIMD_DTYPES, ids=str)
def test_backward_vector_pairs_match_scalar(N, D, block, stride, seq, dtype):
    x, w, g = random_problem(seq[-1], N, D, block, stride, seq, dtype, seed=N * D + block)
    _specials(x, dtype)
    _specials(g, dtype)
    plan = plan_grad(Rules("test", strict=False), g, x, w, block, stride, seq, 0, "TND",
                     None, None)
    plan.allocate()
    assert _dispatch.backward_vector(plan, plan.storage("input"), plan.storage("input_grad"))
    scalar_ig, scalar_wg = _run_backward(plan, False)
    vector_ig, vector_wg = _run_backward(plan, True)
    assert _assert_same_bits(scalar_ig, vector_ig, dtype)
    assert _assert_same_bits(scalar_wg, vector_wg, np.float32)


def test_dispatch_picks_backward_vectors():
    def vector(x, dtype=np.float32, block=32, stride=16):
        x = x.astype(dtype) if x.dtype != dtype else x
        w = np.zeros((block, x.shape[1]), dtype)
        g = np.zeros(((x.shape[0] - block) // stride + 1,) + x.shape[1:], dtype)
        plan = plan_grad(Rules("t", strict=False), g, x, w, block, stride, None, 0, "TND",
                         None, None)
        plan.allocate()
        return _dispatch.backward_vector(plan, plan.storage("input"),
                                         plan.storage("input_grad"))

    f32 = np.float32
    assert vector(np.zeros((64, 4, 128), f32))
    assert vector(np.zeros((64, 4, 24), f32))
    assert not vector(np.zeros((64, 4, 20), f32))                # D not a multiple of 8
    assert not vector(np.zeros((64, 4, 256), f32)[:, :, ::2])    # rows with a step
    assert not vector(np.zeros((64, 4, 128), np.float64), np.float64)   # float64 sums
    assert vector(np.zeros((128, 4, 128), f32)[::2])             # token stride: rows intact
