"""Non-contiguous inputs and outputs: any strides in, exactly the given elements out."""

import numpy as np
import pytest

import nsa_numba
from conftest import DTYPE_IDS, DTYPES, random_problem

L, S = 32, 16
SEQ = [0, 100, 260]


def _same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(f"u{a.itemsize}"),
                                                 b.view(f"u{b.itemsize}"))


#: the default run checks views in a 2-byte and a 4-byte dtype (the word reads differ
#: by element size); float16 and float64 are in the slow run CI makes
@pytest.fixture(params=[pytest.param(t, marks=() if t.name in ("bfloat16", "float32")
                                     else pytest.mark.slow) for t in DTYPES],
                ids=DTYPE_IDS)
def dtype(request):
    return request.param


def _contiguous_results(dtype):
    x, w, g = random_problem(260, 4, 32, L, S, SEQ, dtype, seed=11)
    out = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=SEQ)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    return x, w, g, out, dx, dw


VIEWS = {
    "every-other-d": lambda a, pad: np.repeat(a, 2, axis=-1)[..., ::2],
    "reversed-t": lambda a, pad: np.ascontiguousarray(a[::-1])[::-1],
    "transposed-storage": lambda a, pad: np.ascontiguousarray(np.moveaxis(a, 0, -1))
    .transpose((a.ndim - 1,) + tuple(range(a.ndim - 1))),
    "fortran": lambda a, pad: np.asfortranarray(a),
    "padded": lambda a, pad: _padded(a, pad),
}


def _padded(a, pad):
    big = np.full(tuple(s + 2 for s in a.shape), pad, dtype=a.dtype)
    view = big[tuple(slice(1, -1) for _ in a.shape)]
    view[...] = a
    return view


@pytest.mark.parametrize("view", list(VIEWS))
def test_strided_inputs(view, dtype):
    x, w, g, out, dx, dw = _contiguous_results(dtype)
    xs, ws, gs = (VIEWS[view](a, 0) for a in (x, w, g))
    assert np.array_equal(xs.astype(np.float64), x.astype(np.float64))
    assert not xs.flags.c_contiguous
    assert _same_bits(nsa_numba.nsa_compress(xs, ws, L, S, actual_seq_len=SEQ), out)
    sdx, sdw = nsa_numba.nsa_compress_grad(gs, xs, ws, L, S, actual_seq_len=SEQ)
    assert _same_bits(sdx, dx) and _same_bits(sdw, dw)


@pytest.mark.parametrize("view", ["every-other-d", "reversed-t", "transposed-storage",
                                  "padded"])
def test_strided_outputs_touch_only_their_elements(view, dtype):
    x, w, g, out, dx, dw = _contiguous_results(dtype)
    sentinel = np.array(7.0).astype(dtype)
    targets = []
    for a in (out, dx, dw):
        backing = np.full(tuple(s + 2 for s in a.shape[:-1]) + (2 * a.shape[-1] + 2,),
                          sentinel, dtype=dtype)
        if view == "padded":
            v = backing[tuple(slice(1, -1) for _ in a.shape[:-1]) + (slice(1, 1 + a.shape[-1]),)]
        elif view == "every-other-d":
            v = backing[tuple(slice(1, -1) for _ in a.shape[:-1]) + (slice(1, -1, 2),)]
        elif view == "reversed-t":
            v = backing[(slice(-2, 0, -1),) + tuple(slice(1, -1) for _ in a.shape[1:-1])
                        + (slice(1, 1 + a.shape[-1]),)]
        else:
            v = np.moveaxis(backing[..., 1:1 + a.shape[-1]][tuple(
                slice(1, -1) for _ in a.shape[:-1])], 0, -1)
            v = np.moveaxis(v, -1, 0)[:, ...]
        assert v.shape == a.shape
        targets.append((backing, v))
    (ob, ov), (xb, xv), (wb, wv) = targets
    before = [b.copy() for b, _ in targets]
    r = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=SEQ, out=ov)
    assert r is ov and _same_bits(ov, out)
    r1, r2 = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ, input_grad=xv,
                                         weight_grad=wv)
    assert r1 is xv and r2 is wv
    assert _same_bits(xv, dx) and _same_bits(wv, dw)
    for (b, v), old in zip(targets, before):
        mask = np.ones(b.shape, bool)
        mask.flat[_view_index(b, v)] = False   # everything outside the view
        assert mask.sum() == b.size - v.size
        assert np.array_equal(b.view(np.uint8).reshape(b.shape + (-1,))[mask],
                              old.view(np.uint8).reshape(b.shape + (-1,))[mask])


def _view_index(base, view):
    """Flat indices into ``base`` of the elements of ``view``."""
    offsets = np.zeros(view.shape, np.int64)
    start = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0])
    offsets += start
    for axis, (n, st) in enumerate(zip(view.shape, view.strides)):
        shape = [1] * view.ndim
        shape[axis] = n
        offsets = offsets + (np.arange(n) * st).reshape(shape)
    return (offsets // base.itemsize).ravel()


# -- inputs read as words (_layouts.word_view) ---------------------------------------

def _input_storage(x, w):
    """The array the forward kernel reads ``x`` through."""
    from nsa_numba._ops.checks import Rules
    from nsa_numba._ops.compress import plan_forward
    out = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=SEQ)
    return plan_forward(Rules("test"), x, w, L, S, SEQ, 0, "TND", out).storage("input")


def _every(a, k, gap_value=9.0):
    """``a`` as every k-th element of a buffer k times as wide (the gaps hold
    ``gap_value``, which must not reach any result)."""
    wide = np.full(a.shape[:-1] + (k * a.shape[-1],), gap_value).astype(a.dtype)
    view = wide[..., ::k]
    view[...] = a
    return view


@pytest.mark.parametrize("k", [2, 4])
def test_inputs_at_a_step_are_read_as_words(k, dtype):
    x, w, g, out, dx, dw = _contiguous_results(dtype)
    if k == 4 and np.dtype(dtype).itemsize != 2:
        assert _input_storage(_every(x, k), w).dtype == x.dtype   # not a word type
        return
    xs, gs = _every(x, k), _every(g, k, gap_value=-3.0)
    word = _input_storage(xs, w)
    assert word.dtype.itemsize == k * x.itemsize and word.flags.c_contiguous
    assert _same_bits(nsa_numba.nsa_compress(xs, w, L, S, actual_seq_len=SEQ), out)
    sdx, sdw = nsa_numba.nsa_compress_grad(gs, xs, w, L, S, actual_seq_len=SEQ)
    assert _same_bits(sdx, dx) and _same_bits(sdw, dw)


def test_no_word_reads_past_the_buffer(dtype):
    """The last element of a [..., ::2] view of an odd-width buffer is the buffer's
    last element: its word would read past the end, so the plain strided path runs."""
    x, w, g, out, dx, dw = _contiguous_results(dtype)
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1] - 1,), dtype)
    xs = wide[..., ::2]
    xs[...] = x
    assert _input_storage(xs, w).itemsize == x.itemsize
    assert _same_bits(nsa_numba.nsa_compress(xs, w, L, S, actual_seq_len=SEQ), out)
    sdx, sdw = nsa_numba.nsa_compress_grad(g, xs, w, L, S, actual_seq_len=SEQ)
    assert _same_bits(sdx, dx) and _same_bits(sdw, dw)


def test_no_word_reads_of_output_elements(dtype):
    """input and input_grad interleaved in one buffer: the input's words would hold
    input_grad elements the kernel writes, so the input is read element by element."""
    from nsa_numba._ops.checks import Rules
    from nsa_numba._ops.compress import plan_grad
    x, w, g, out, dx, dw = _contiguous_results(dtype)
    both = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype)
    xs, igs = both[..., 0::2], both[..., 1::2]
    xs[...] = x
    wg = np.empty_like(w)
    plan = plan_grad(Rules("test"), g, xs, w, L, S, SEQ, 0, "TND", igs, wg)
    assert plan.storage("input").itemsize == x.itemsize
    nsa_numba.nsa_compress_grad(g, xs, w, L, S, actual_seq_len=SEQ, input_grad=igs,
                                weight_grad=wg)
    assert _same_bits(igs, dx) and _same_bits(wg, dw) and _same_bits(xs, x)


def test_no_unaligned_words():
    """A view starting 2 bytes into a 4-byte word is read element by element."""
    x, w, g, out, dx, dw = _contiguous_results(np.float16)
    raw = np.zeros(x.size * 2 + 2, np.float16)[1:-1].reshape(x.shape[:-1] + (-1,))
    xs = raw[..., ::2]
    xs[...] = x
    assert xs.ctypes.data % 4 == 2
    assert _input_storage(xs, w).dtype == np.uint16
    assert _same_bits(nsa_numba.nsa_compress(xs, w, L, S, actual_seq_len=SEQ), out)
