"""The attention kernels: selected attention (planned by ``_ops.select``) and dense
attention, the keys of a sequence its band and mask leave visible (fusion and
compressed attention, planned by ``_ops.dense`` through ``_ops.fusion`` and
``_ops.compress_attention``), each a forward and a backward in two passes; the planners
document the operators. Here the arithmetic, told for selected attention:

* **staging** (:func:`select_stage`): each block of ``l'`` keys of each KV head, as
  the input stores it (16 bits for half precision; the tile widens as it loads), in
  the layouts the products read: keys transposed (``[D, Lp]``, ``Lp`` = ``l'`` rounded
  up to 16, zero padded), for the scores; values as rows (``[l', Dv]``), for the
  forward's weighted sum; and for the backward the keys as rows and the values
  transposed. A block is staged once per call however many queries select it.
* **forward** (:func:`select_forward`), one unit per query token and KV head: the
  scores of the group's G heads over every selected block (``_mm``, 4 heads by 64
  keys at a time), scaled and masked, the softmax statistics, then the values'
  weighted sum divided by the row sum, rounded once into the output.
* **backward, dq** (:func:`select_grad_dq`), one unit per query token and KV head:
  scores and ``dP = dO V^T`` again, ``dS = P (dP - delta)`` with the saved statistics,
  ``dq = scale dS K``.
* **backward, dk and dv** (:func:`select_grad_dkdv`), one unit per key block and KV
  head, the *owner* of its rows: it visits the (token, slot) pairs that selected it in
  token order (``select_owners``' inverted index) and adds their terms into its own
  float32 sums, then rounds them once. No two units write the same row, so no atomics
  and no order that depends on the threads: the result is the same bits for any
  thread count.

Dense attention has the same shape (``dense_stage``, ``dense_forward``,
``dense_grad_dq``, ``dense_grad_dkdv``), with keys in chunks of CHUNK staged as
float32, units of several tokens, and each query row computing only the chunks its
visible range meets (``dense_ranges``); compressed attention's forward
(``cmp_forward``) adds the importance of each block of raw keys and the top-k.

All products go through :func:`_mm`, one register tile whose per-element sum runs
over its depth in order with fused multiply-adds (``_kernels.lanes``); float64 problems take
its scalar form (the same order). Scratch comes from the workspace, one slot per
thread of the launch (``slot``, ``_core.launch``); nothing in a slot reaches a result except
through those fixed-order sums.
"""

import math

import numpy as np
from numba import types
from numba.extending import overload

from .._core.jit import BOUNDSCHECK, OVERLOAD_OPTIONS, jit
from .._core.launch import claim, next_unit
from .halfprec import HARDWARE_HALF, narrow, widen
from .lanes import (
    check_lanes,
    exp32,
    fma,
    ladd,
    ldiv,
    lexp,
    lfma,
    lload,
    lload_wide,
    lload_wide_at,
    lmax,
    lmax_of,
    lmul,
    lstore,
    lstore_narrow_at,
    lsub,
    lsum,
    lzeros,
)

# The compile cache is keyed on this file's text only. These digests tie it to the
# helper modules the kernels inline; tests/test_cache_keys.py keeps them true.
CACHE_DEPENDS = {
    "halfprec.py": "f53894f44485c238",
    "../_core/jit.py": "a6f517ee95725b3e",
    "../_core/launch.py": "21843c4d967f4840",
    "lanes.py": "f4a057aad7d37f0a",
    "target.py": "03997255e397a5e2",
}

#: the score a masked key gets (float32's lowest finite value, as the NPU writes)
MASKED = np.float32(-3.4028234663852886e38)
#: key lanes per staged row are padded to a multiple of this
KEY_ALIGN = 16


# -- the register tile ---------------------------------------------------------------

def _mm(w, wb, sm, sk, nk, rows, b, e0, e1, out, ob, so, add):
    """For the four rows ``m`` and the lanes ``e0 <= e < e1``::

        out[ob + m*so + e] (+)= sum over k < nk of w[wb + m*sm + k*sk] * b[rows[k] + e]

    summed in k order, each step one fused multiply-add (``add``: starting from what
    ``out`` holds, else from 0)."""
    raise NotImplementedError      # compiled code only (the overload below)


@jit
def _mm64(w, wb, sm, sk, nk, rows, b, e, out, ob, so, add):
    o0 = ob + e
    o1 = o0 + so
    o2 = o1 + so
    o3 = o2 + so
    check_lanes(out, o0, 64)
    check_lanes(out, o3, 64)
    if add:
        a00, a01, a02, a03 = lload(out, o0), lload(out, o0 + 16), lload(out, o0 + 32), \
            lload(out, o0 + 48)
        a10, a11, a12, a13 = lload(out, o1), lload(out, o1 + 16), lload(out, o1 + 32), \
            lload(out, o1 + 48)
        a20, a21, a22, a23 = lload(out, o2), lload(out, o2 + 16), lload(out, o2 + 32), \
            lload(out, o2 + 48)
        a30, a31, a32, a33 = lload(out, o3), lload(out, o3 + 16), lload(out, o3 + 32), \
            lload(out, o3 + 48)
    else:
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = lzeros()
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = lzeros()
    for k in range(nk):
        p = rows[k] + e
        check_lanes(b, p, 64)
        b0, b1, b2, b3 = lload_wide(b, p), lload_wide(b, p + 16), lload_wide(b, p + 32), \
            lload_wide(b, p + 48)
        i = wb + k * sk
        w0, w1, w2, w3 = w[i], w[i + sm], w[i + 2 * sm], w[i + 3 * sm]
        a00, a01, a02, a03 = lfma(a00, w0, b0), lfma(a01, w0, b1), lfma(a02, w0, b2), \
            lfma(a03, w0, b3)
        a10, a11, a12, a13 = lfma(a10, w1, b0), lfma(a11, w1, b1), lfma(a12, w1, b2), \
            lfma(a13, w1, b3)
        a20, a21, a22, a23 = lfma(a20, w2, b0), lfma(a21, w2, b1), lfma(a22, w2, b2), \
            lfma(a23, w2, b3)
        a30, a31, a32, a33 = lfma(a30, w3, b0), lfma(a31, w3, b1), lfma(a32, w3, b2), \
            lfma(a33, w3, b3)
    lstore(out, o0, a00), lstore(out, o0 + 16, a01), lstore(out, o0 + 32, a02)
    lstore(out, o0 + 48, a03)
    lstore(out, o1, a10), lstore(out, o1 + 16, a11), lstore(out, o1 + 32, a12)
    lstore(out, o1 + 48, a13)
    lstore(out, o2, a20), lstore(out, o2 + 16, a21), lstore(out, o2 + 32, a22)
    lstore(out, o2 + 48, a23)
    lstore(out, o3, a30), lstore(out, o3 + 16, a31), lstore(out, o3 + 32, a32)
    lstore(out, o3 + 48, a33)


@jit
def _mm16(w, wb, sm, sk, nk, rows, b, e, out, ob, so, add):
    o0 = ob + e
    o1 = o0 + so
    o2 = o1 + so
    o3 = o2 + so
    check_lanes(out, o0)
    check_lanes(out, o3)
    if add:
        a0, a1, a2, a3 = lload(out, o0), lload(out, o1), lload(out, o2), lload(out, o3)
    else:
        a0 = a1 = a2 = a3 = lzeros()
    for k in range(nk):
        p = rows[k] + e
        check_lanes(b, p)
        v = lload_wide(b, p)
        i = wb + k * sk
        a0, a1 = lfma(a0, w[i], v), lfma(a1, w[i + sm], v)
        a2, a3 = lfma(a2, w[i + 2 * sm], v), lfma(a3, w[i + 3 * sm], v)
    lstore(out, o0, a0), lstore(out, o1, a1), lstore(out, o2, a2), lstore(out, o3, a3)


@jit
def _mm32(w, wb, sm, sk, nk, rows, b, e, out, ob, so, add):
    o0 = ob + e
    o1 = o0 + so
    o2 = o1 + so
    o3 = o2 + so
    check_lanes(out, o0, 32)
    check_lanes(out, o3, 32)
    if add:
        a00, a01, a10, a11 = lload(out, o0), lload(out, o0 + 16), lload(out, o1), \
            lload(out, o1 + 16)
        a20, a21, a30, a31 = lload(out, o2), lload(out, o2 + 16), lload(out, o3), \
            lload(out, o3 + 16)
    else:
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = lzeros()
    for k in range(nk):
        p = rows[k] + e
        check_lanes(b, p, 32)
        b0, b1 = lload_wide(b, p), lload_wide(b, p + 16)
        i = wb + k * sk
        w0, w1, w2, w3 = w[i], w[i + sm], w[i + 2 * sm], w[i + 3 * sm]
        a00, a01, a10, a11 = lfma(a00, w0, b0), lfma(a01, w0, b1), lfma(a10, w1, b0), \
            lfma(a11, w1, b1)
        a20, a21, a30, a31 = lfma(a20, w2, b0), lfma(a21, w2, b1), lfma(a30, w3, b0), \
            lfma(a31, w3, b1)
    lstore(out, o0, a00), lstore(out, o0 + 16, a01), lstore(out, o1, a10)
    lstore(out, o1 + 16, a11), lstore(out, o2, a20), lstore(out, o2 + 16, a21)
    lstore(out, o3, a30), lstore(out, o3 + 16, a31)


@jit
def _mm_scalar(w, wb, sm, sk, nk, rows, b, e0, e1, out, ob, so, add):
    for m in range(4):
        for e in range(e0, e1):
            o = ob + m * so + e
            acc = out[o] if add else out.dtype.type(0)
            for k in range(nk):
                acc = fma(w[wb + m * sm + k * sk], widen(b[rows[k] + e]), acc)
            out[o] = acc


@jit
def _mm_seen(w, wb, sm, sk, nk, rows, b, e0, e1, out, ob, so, add, gate):
    """``_mm`` one lane at a time, leaving out the terms whose ``gate`` (at the weight's
    index: the weight P, or P for a weight dS) is exactly 0: the same sums in the same
    order where every value is finite (a sum that starts from +0 never holds -0, so a
    zero term adds nothing to it), and a value that no weight reaches (a key a row does
    not see, or a row that does not see the key, NaN or infinite) stays out."""
    for m in range(4):
        for e in range(e0, e1):
            o = ob + m * so + e
            acc = out[o] if add else out.dtype.type(0)
            for k in range(nk):
                i = wb + m * sm + k * sk
                if gate[i] != 0:
                    acc = fma(w[i], widen(b[rows[k] + e]), acc)
            out[o] = acc


@jit
def _finite(a, o, n):
    """Whether ``a[o:o + n]`` holds no NaN and no infinity."""
    for i in range(o, o + n):
        if not math.isfinite(a[i]):
            return False
    return True


@jit
def _products_seen(w, gate, lds, n, rows, b, width, out, R, R4):
    """``out`` = the weights ``w`` (``R4`` rows of ``lds``, ``n`` keys) times the rows of
    ``b`` at ``rows``, four rows at a time; where one of the first ``R`` results is not
    finite, every row again with the keys whose ``gate`` (P) is 0 left out
    (``_mm_seen``), so that a NaN or infinity reaches exactly the rows that see its
    key, whatever the unit's other rows see. The values' sum (``w`` = ``gate`` = P) and
    dq (``w`` = scale dS)."""
    for g in range(0, R4, 4):
        _mm(w, g * lds, lds, 1, n, rows, b, 0, width, out, g * width, width, False)
    if not _finite(out, 0, R * width):
        for g in range(0, R4, 4):
            _mm_seen(w, g * lds, lds, 1, n, rows, b, 0, width, out, g * width, width,
                     False, gate)


@overload(_mm, jit_options=OVERLOAD_OPTIONS)
def _mm_typed(w, wb, sm, sk, nk, rows, b, e0, e1, out, ob, so, add):
    if b.dtype == types.float64:
        def scalar(w, wb, sm, sk, nk, rows, b, e0, e1, out, ob, so, add):
            _mm_scalar(w, wb, sm, sk, nk, rows, b, e0, e1, out, ob, so, add)
        return scalar

    def lanes(w, wb, sm, sk, nk, rows, b, e0, e1, out, ob, so, add):
        e = e0
        while e + 64 <= e1:
            _mm64(w, wb, sm, sk, nk, rows, b, e, out, ob, so, add)
            e += 64
        if e + 32 <= e1:            # a broadcast weight serves two vectors, not one
            _mm32(w, wb, sm, sk, nk, rows, b, e, out, ob, so, add)
            e += 32
        while e + 16 <= e1:
            _mm16(w, wb, sm, sk, nk, rows, b, e, out, ob, so, add)
            e += 16
        if e < e1:
            _mm_scalar(w, wb, sm, sk, nk, rows, b, e, e1, out, ob, so, add)
    return lanes


# -- rows of the operators' arrays ----------------------------------------------------
#
# Row ``x[t, h]`` of an operator's array, addressed by its indices (a view of it would
# count a reference on ``x``: an atomic operation on memory every thread shares). The
# array is ``[T, N, X]`` (3 axes), or ``[B, S, N, X]`` (4 axes: the padded layouts'
# batches, or ``[1, T, N, X]``), where token ``t`` is ``x[t // S, t % S]``. Where the
# row's elements are adjacent (the last axis of stride one element, the usual case)
# these go 16 at a time, else one by one; the results are the same either way.

def _split(x, t):
    """Token ``t`` of ``x`` as its leading indices ``(a, s)``: ``(t, 0)`` for 3 axes,
    ``divmod(t, S)`` for 4."""
    raise NotImplementedError


@overload(_split, jit_options=OVERLOAD_OPTIONS)
def _split_typed(x, t):
    if x.ndim == 4:
        def four(x, t):
            if x.shape[0] == 1:             # TND: no division
                return t - t, t
            return t // x.shape[1], t % x.shape[1]
        return four
    return lambda x, t: (t, t - t)


def _item(x, a, s, h, e):
    """``x[a, h, e]`` (3 axes) or ``x[a, s, h, e]`` (4 axes)."""
    raise NotImplementedError


@overload(_item, jit_options=OVERLOAD_OPTIONS)
def _item_typed(x, a, s, h, e):
    if x.ndim == 4:
        return lambda x, a, s, h, e: x[a, s, h, e]
    return lambda x, a, s, h, e: x[a, h, e]


def _put(x, a, s, h, e, v):
    """``_item``'s element = ``v``."""
    raise NotImplementedError


@overload(_put, jit_options=OVERLOAD_OPTIONS)
def _put_typed(x, a, s, h, e, v):
    if x.ndim == 4:
        def four(x, a, s, h, e, v):
            x[a, s, h, e] = v
        return four

    def three(x, a, s, h, e, v):
        x[a, h, e] = v
    return three


@jit
def _stat(x, t, h):
    """Head ``h``'s statistic of token ``t`` (its first lane)."""
    a, s = _split(x, t)
    return _item(x, a, s, h, 0)


@jit
def _set_stats(smax, ssum, t, h, top, total):
    """Every lane of head ``h``'s statistics of token ``t``."""
    a, s = _split(smax, t)
    for i in range(smax.shape[-1]):
        _put(smax, a, s, h, i, top)
        _put(ssum, a, s, h, i, total)


@jit
def _zero_row(x, t, h):
    """Row ``x[t, h]`` = 0."""
    a, s = _split(x, t)
    for e in range(x.shape[-1]):
        _put(x, a, s, h, e, narrow(0.0, x))


def _widen_row(x, t, h, dst, o):
    """``dst[o:o + n]`` = row ``x[t, h]`` (n elements) widened to the accumulator type."""
    raise NotImplementedError


@overload(_widen_row, jit_options=OVERLOAD_OPTIONS)
def _widen_row_typed(x, t, h, dst, o):
    if dst.dtype == types.float64:
        def scalar(x, t, h, dst, o):
            a, s = _split(x, t)
            for e in range(x.shape[-1]):
                dst[o + e] = widen(_item(x, a, s, h, e))
        return scalar

    def lanes(x, t, h, dst, o):
        a, s = _split(x, t)
        n = x.shape[-1]
        full = n - n % 16 if x.strides[-1] == x.itemsize else 0
        check_lanes(dst, o, n)
        for e in range(0, full, 16):
            check_row(x, a, s, h, e)
            lstore(dst, o + e, lload_wide_at(x, a, s, h, e))
        for e in range(full, n):
            dst[o + e] = widen(_item(x, a, s, h, e))
    return lanes


def _dot_row(a, o, x, t, h):
    """``sum_e a[o + e] * x[t, h, e]`` (widened): in 16 lanes (element ``e`` in lane
    ``e % 16``, each a chain of fused multiply-adds) added in lane order, then the tail
    of ``n % 16`` in order; or, when the row's elements are not adjacent, and for
    float64, one chain in order."""
    raise NotImplementedError


@overload(_dot_row, jit_options=OVERLOAD_OPTIONS)
def _dot_row_typed(a, o, x, t, h):
    if a.dtype == types.float64:
        def scalar(a, o, x, t, h):
            i, s = _split(x, t)
            acc = 0.0
            for e in range(x.shape[-1]):
                acc = fma(a[o + e], widen(_item(x, i, s, h, e)), acc)
            return acc
        return scalar

    def lanes(a, o, x, t, h):
        i, s = _split(x, t)
        n = x.shape[-1]
        full = n - n % 16 if x.strides[-1] == x.itemsize else 0
        check_lanes(a, o, n)
        acc = lzeros()
        for e in range(0, full, 16):
            check_row(x, i, s, h, e)
            acc = lfma(acc, lload(a, o + e), lload_wide_at(x, i, s, h, e))
        total = lsum(acc) if full else np.float32(0)
        for e in range(full, n):
            total = fma(a[o + e], widen(_item(x, i, s, h, e)), total)
        return total
    return lanes


def _narrow_row(src, o, x, t, h):
    """Row ``x[t, h]`` = ``src[o:o + n]`` rounded once to ``x``'s storage."""
    raise NotImplementedError


@overload(_narrow_row, jit_options=OVERLOAD_OPTIONS)
def _narrow_row_typed(src, o, x, t, h):
    vector = src.dtype == types.float32 and (
        x.dtype in (types.float32, types.int16)
        or (x.dtype == types.uint16 and HARDWARE_HALF))
    if not vector:
        def scalar(src, o, x, t, h):
            a, s = _split(x, t)
            for e in range(x.shape[-1]):
                _put(x, a, s, h, e, narrow(src[o + e], x))
        return scalar

    def lanes(src, o, x, t, h):
        a, s = _split(x, t)
        n = x.shape[-1]
        full = n - n % 16 if x.strides[-1] == x.itemsize else 0
        check_lanes(src, o, n)
        for e in range(0, full, 16):
            check_row(x, a, s, h, e)
            lstore_narrow_at(x, a, s, h, e, lload(src, o + e))
        for e in range(full, n):
            _put(x, a, s, h, e, narrow(src[o + e], x))
    return lanes


@jit
def check_row(x, a, s, h, e):
    """``check_lanes`` for the 16 elements of ``_item(x, a, s, h, e)`` on."""
    if BOUNDSCHECK:
        return _item(x, a, s, h, e) == _item(x, a, s, h, e + 15)
    return True


# -- softmax pieces ------------------------------------------------------------------

def _exp(x):
    """exp in the accumulator dtype: ``_kernels.lanes.exp32`` for float32, the C library's for
    float64."""
    return np.exp(x)


@overload(_exp, jit_options=OVERLOAD_OPTIONS)
def _exp_typed(x):
    if x == types.float32:
        return lambda x: exp32(x)
    return lambda x: np.exp(x)


def _row_softmax(s, o, n):
    """Row ``s[o:o + n]`` of scores to ``exp(score - max)`` in place; returns ``(max,
    sum)``, the sum over 16 lanes (element ``i`` in lane ``i % 16``) folded in lane
    order, then the tail of ``n % 16`` in order."""
    raise NotImplementedError


@overload(_row_softmax, jit_options=OVERLOAD_OPTIONS)
def _row_softmax_typed(s, o, n):
    if s.dtype == types.float64:
        def scalar(s, o, n):
            top = s[o]
            for i in range(1, n):
                if s[o + i] > top:
                    top = s[o + i]
            total = 0.0
            for i in range(n):
                s[o + i] = np.exp(s[o + i] - top)
                total += s[o + i]
            return top, total
        return scalar

    def lanes(s, o, n):
        check_lanes(s, o, n)
        full = n - n % 16
        top = MASKED
        if full:
            best = lload(s, o)
            for i in range(16, full, 16):
                best = lmax(lload(s, o + i), best)
            top = lmax_of(best)
        for i in range(full, n):
            if s[o + i] > top:
                top = s[o + i]
        total = lzeros()
        for i in range(0, full, 16):
            x = lexp(lsub(lload(s, o + i), top))
            lstore(s, o + i, x)
            total = ladd(total, x)
        tail = lsum(total)
        for i in range(full, n):
            x = exp32(s[o + i] - top)
            s[o + i] = x
            tail += x
        return top, tail
    return lanes


def _scale_mask(s, o, n, scale, keep):
    """``s[o:o + n] *= scale``, then the elements from ``keep`` on set to MASKED."""
    raise NotImplementedError


@overload(_scale_mask, jit_options=OVERLOAD_OPTIONS)
def _scale_mask_typed(s, o, n, scale, keep):
    if s.dtype == types.float64:
        def scalar(s, o, n, scale, keep):
            for i in range(n):
                s[o + i] = s[o + i] * scale if i < keep else MASKED
        return scalar

    def lanes(s, o, n, scale, keep):
        check_lanes(s, o, n)
        full = n - n % 16
        for i in range(0, full, 16):
            lstore(s, o + i, lmul(lload(s, o + i), scale))
        for i in range(full, n):
            s[o + i] = s[o + i] * scale
        for i in range(keep, n):
            s[o + i] = MASKED
    return lanes


def _ds_row(s, dp, o, n, top, total, delta, scale, keep):
    """From scaled, masked scores ``s[o:o + n]`` and ``dp`` (same offsets): ``s`` becomes
    ``P = exp(s - top) / total`` and ``dp`` becomes ``scale * P * (dp - delta)``, 0 from
    ``keep`` on (masked keys pass no gradient)."""
    raise NotImplementedError


@jit
def _ds_unseen(s, dp, o, n, top, total, delta, scale, keep):
    """``_ds_row`` for a row whose statistics are not finite (it sees a NaN or an
    infinity): the keys it does not see (masked scores) keep P = 0, so that nothing of
    the row reaches their gradients (``_mm_seen``)."""
    for i in range(n):
        x = s[o + i]
        p = s.dtype.type(0) if x == MASKED else _exp(x - top) / total
        s[o + i] = p
        dp[o + i] = scale * (p * (dp[o + i] - delta)) if i < keep else 0


@overload(_ds_row, jit_options=OVERLOAD_OPTIONS)
def _ds_row_typed(s, dp, o, n, top, total, delta, scale, keep):
    if s.dtype == types.float64:
        def scalar(s, dp, o, n, top, total, delta, scale, keep):
            if not (math.isfinite(top) and math.isfinite(total)):
                _ds_unseen(s, dp, o, n, top, total, delta, scale, keep)
                return
            for i in range(n):
                p = np.exp(s[o + i] - top) / total
                s[o + i] = p
                dp[o + i] = scale * (p * (dp[o + i] - delta)) if i < keep else 0.0
        return scalar

    def lanes(s, dp, o, n, top, total, delta, scale, keep):
        check_lanes(s, o, n)
        check_lanes(dp, o, n)
        if not (math.isfinite(top) and math.isfinite(total)):
            _ds_unseen(s, dp, o, n, top, total, delta, scale, keep)
            return
        full = n - n % 16
        for i in range(0, full, 16):
            p = ldiv(lexp(lsub(lload(s, o + i), top)), total)
            lstore(s, o + i, p)
            lstore(dp, o + i, lmul(lmul(p, lsub(lload(dp, o + i), delta)), scale))
        for i in range(full, n):
            p = exp32(s[o + i] - top) / total
            s[o + i] = p
            dp[o + i] = scale * (p * (dp[o + i] - delta))
        for i in range(keep, n):
            dp[o + i] = 0
    return lanes


# -- staging --------------------------------------------------------------------------

def _as_staged(x, a, b):
    """Stored element ``x`` as the staged arrays ``a``, ``b`` (one dtype) hold it: as
    stored, or widened where they are float32 (exact)."""
    return x


@overload(_as_staged, jit_options=OVERLOAD_OPTIONS)
def _as_staged_typed(x, a, b):
    if a.dtype == types.float32 and x in (types.int16, types.uint16):
        return lambda x, a, b: widen(x)
    return lambda x, a, b: x


@jit
def _stage_block(k, v, row0, n, j, l, lp, kt, krow, vrow, vt, base_k, base_v):
    """Rows ``row0 .. row0 + n`` of KV head ``j`` into the staged layouts at block
    ``base_k`` / ``base_v`` (in units of D and Dv), zero padded to ``l`` rows (the row
    layouts) and ``lp`` lanes (the transposed ones)."""
    D = k.shape[-1]
    Dv = v.shape[-1]
    for r in range(n):
        a, p = _split(k, row0 + r)
        for d in range(D):
            x = _as_staged(_item(k, a, p, j, d), kt, krow)
            if kt.size:
                kt[base_k * lp + d * lp + r] = x
            if krow.size:
                krow[base_k * l + r * D + d] = x
        for e in range(Dv):
            x = _as_staged(_item(v, a, p, j, e), vrow, vt)
            if vrow.size:
                vrow[base_v * l + r * Dv + e] = x
            if vt.size:
                vt[base_v * lp + e * lp + r] = x
    for r in range(n, l):
        if krow.size:
            for d in range(D):
                krow[base_k * l + r * D + d] = 0
        if vrow.size:
            for e in range(Dv):
                vrow[base_v * l + r * Dv + e] = 0
    for r in range(n, lp):
        if kt.size:
            for d in range(D):
                kt[base_k * lp + d * lp + r] = 0
        if vt.size:
            for e in range(Dv):
                vt[base_v * lp + e * lp + r] = 0


@jit
def select_stage(work, slot, k, v, block_row, l, lp, kt, krow, vrow, vt):
    """Stage every block (``block_row[gb]``: its first key row) of every KV head into
    the arrays that are not empty: ``kt`` ``[GB, N2, D, lp]``, ``krow`` ``[GB, N2, l,
    D]``, ``vrow`` ``[GB, N2, l, Dv]``, ``vt`` ``[GB, N2, Dv, lp]``, all flat."""
    N2, D, Dv = k.shape[1], k.shape[2], v.shape[2]
    unit, end = claim(work, block_row.size * N2)
    while unit < end:
        u = np.int64(unit)
        gb, j = u // N2, u % N2
        _stage_block(k, v, block_row[gb], l, j, l, lp, kt, krow, vrow, vt, u * D, u * Dv)
        unit, end = next_unit(work, unit, end, block_row.size * N2)


# -- shared per-unit pieces -----------------------------------------------------------

@jit
def _sequence(starts, t):
    """(batch, position) of token ``t`` given batch starts ``starts`` [B + 1]."""
    b = np.searchsorted(starts, t, side="right") - 1
    return b, t - starts[b]


@jit
def _visible(topk, t, j, count, diag, causal, vis):
    """The slots a unit computes, in slot order, into ``vis``: every slot, or with
    ``causal`` those whose block is not after the query's own. Returns (how many,
    whether the whole row is masked: then every slot, for the uniform weights)."""
    n = 0
    for i in range(count):
        if not causal or topk[t, j, i] <= diag:
            vis[n] = i
            n += 1
    if n == 0:
        for i in range(count):
            vis[i] = i
        return count, True
    return n, False


@jit
def _widen_heads(x, t, h0, G, G4, width, dst):
    """``x[t, h0:h0 + G, :]`` widened into ``dst[:G4 * width]`` (rows past G zero)."""
    for g in range(G):
        _widen_row(x, t, h0 + g, dst, g * width)
    for i in range(G * width, G4 * width):
        dst[i] = 0


@jit
def _block_scores(a, depth, staged, base, lp, e0, e1, rows, s, ob, lds, G4):
    """``s[g * lds + ob + r] = sum_d a[g * depth + d] * staged[base + d * lp + r]`` for
    ``e0 <= r < e1`` (a transposed staged block of ``lp`` lanes), four rows at a time."""
    for d in range(depth):
        rows[d] = base + d * lp
    for g in range(0, G4, 4):
        _mm(a, g * depth, depth, 1, depth, rows, staged, e0, e1, s, ob + g * lds, lds, False)


# -- forward ---------------------------------------------------------------------------

@jit
def _forward_unit(t, j, q, topk, q_starts, blk_starts, kt, vrow, out, smax, ssum, f, rows,
                  vis, G, l, lp, count, scale, causal):
    D, Dv = q.shape[2], out.shape[2]
    N2 = topk.shape[1]
    G4 = (G + 3) & ~3
    lds = count * l + lp
    qs = f[:G4 * D]
    s = f[G4 * D:G4 * (D + lds)]
    o = f[G4 * (D + lds):G4 * (D + lds + Dv)]
    b, pos = _sequence(q_starts, t)
    diag = pos // l
    nvis, full = _visible(topk, t, j, count, diag, causal, vis)
    _widen_heads(q, t, j * G, G, G4, D, qs)
    for v in range(nvis):
        idx = topk[t, j, vis[v]]
        gb = blk_starts[b] + idx
        if full:
            for g in range(G4):
                for r in range(l):
                    s[g * lds + v * l + r] = MASKED
            continue
        _block_scores(qs, D, kt, (gb * N2 + j) * D * lp, lp, 0, lp, rows, s, v * l, lds, G4)
        keep = pos % l + 1 if causal and idx == diag else l
        for g in range(G):
            _scale_mask(s, g * lds + v * l, l, scale, keep)
    n = nvis * l
    for g in range(G):
        top, total = _row_softmax(s, g * lds, n)
        h = j * G + g
        for i in range(smax.shape[2]):
            smax[t, h, i] = top
            ssum[t, h, i] = total
    for v in range(nvis):
        gb = blk_starts[b] + topk[t, j, vis[v]]
        for r in range(l):
            rows[v * l + r] = ((gb * N2 + j) * l + r) * Dv
    _products_seen(s, s, lds, n, rows, vrow, Dv, o, G, G4)
    for g in range(G):
        _divide(o, g * Dv, Dv, ssum[t, j * G + g, 0])
        _narrow_row(o, g * Dv, out, t, j * G + g)


@jit
def select_forward(work, slot, q, topk, q_starts, blk_starts, kt, vrow, out, smax, ssum, scratch,
                   index, G, l, lp, scale, causal):
    """Selected attention: ``out``, ``smax``, ``ssum`` for every query token and head
    (``scratch`` / ``index``: one float / int64 row per thread)."""
    T1, N2, count = topk.shape
    unit, end = claim(work, T1 * N2)
    while unit < end:
        t, j = np.int64(unit) // N2, np.int64(unit) % N2
        rows = index[slot]
        _forward_unit(t, j, q, topk, q_starts, blk_starts, kt, vrow, out, smax, ssum,
                      scratch[slot], rows[count:], rows[:count], G, l, lp, count, scale,
                      causal)
        unit, end = next_unit(work, unit, end, T1 * N2)


# -- backward: dq ----------------------------------------------------------------------

@jit
def _row_terms(q, grad, out_fwd, smax, ssum, t, h0, G, G4, qs, dos, stats):
    """The query rows and output-gradient rows of heads ``h0 .. h0 + G`` widened
    (``qs``, ``dos``), and per head ``stats[g]`` = (max, sum, delta = sum_e dO * O,
    ``_dot_row``)."""
    D, Dv = q.shape[-1], grad.shape[-1]
    _widen_heads(q, t, h0, G, G4, D, qs)
    _widen_heads(grad, t, h0, G, G4, Dv, dos)
    for g in range(G):
        h = h0 + g
        delta = _dot_row(dos, g * Dv, out_fwd, t, h)
        stats[3 * g] = _stat(smax, t, h)
        stats[3 * g + 1] = _stat(ssum, t, h)
        stats[3 * g + 2] = delta


@jit
def _grad_scratch(f, G4, D, Dv, lds):
    """A backward unit's scratch row cut into (query rows, output-gradient rows,
    scores, dP, statistics, the rest)."""
    at = G4 * (D + Dv)
    s = f[at:at + G4 * lds]
    dp = f[at + G4 * lds:at + 2 * G4 * lds]
    at += 2 * G4 * lds
    return (f[:G4 * D], f[G4 * D:G4 * (D + Dv)], s, dp, f[at:at + 3 * G4],
            f[at + 3 * G4:])


@jit
def _mask_keys(s, o, n, mask, row, mc, col0, lo, hi, holes):
    """Scores ``s[o:o + n]`` of keys ``col0 ..`` set to MASKED where the key is outside
    ``[lo, hi)``, and with ``holes`` where ``mask[row, mc + key]`` is set."""
    end = col0 + n
    for k in range(col0, min(lo, end)):
        s[o + k - col0] = MASKED
    for k in range(max(hi, col0), end):
        s[o + k - col0] = MASKED
    if holes:
        for k in range(max(lo, col0), min(hi, end)):
            if mask[row, mc + k] != 0:
                s[o + k - col0] = MASKED


#: the mask argument of a unit that has none
NO_MASK = np.zeros((0, 0), np.uint8)


@jit
def _block_ds(qs, dos, kt, vt, base_k, base_v, D, Dv, lp, e0, e1, rows, s, dp, ob, lds, G,
              G4, stats, scale, keep, l, mask, row, mc, col0, lo, hi, holes):
    """Scores and dP of keys ``e0 <= r < min(e1, l)`` of one block (``e0``, ``e1``:
    multiples of 16) for the unit's heads into ``s`` / ``dp`` at ``ob + r``; then ``s``
    holds P and ``dp`` holds ``scale * dS`` (``_ds_row``). Keys from ``keep`` on are
    masked, and those ``_mask_keys`` masks (the block's first key is key ``col0``; its
    mask row ``row`` from column ``mc``)."""
    _block_scores(qs, D, kt, base_k, lp, e0, e1, rows, s, ob, lds, G4)
    _block_scores(dos, Dv, vt, base_v, lp, e0, e1, rows, dp, ob, lds, G4)
    n = min(e1, l) - e0
    for g in range(G):
        o = g * lds + ob + e0
        _scale_mask(s, o, n, scale, keep - e0)
        _mask_keys(s, o, min(keep, e1) - e0, mask, row, mc, col0 + e0, lo, hi, holes)
        _ds_row(s, dp, o, n, stats[3 * g], stats[3 * g + 1], stats[3 * g + 2], scale,
                keep - e0)


@jit
def _dq_unit(t, j, q, grad, out_fwd, smax, ssum, topk, q_starts, blk_starts, kt,
             krow, vt, dq, f, rows, vis, G, l, lp, count, scale, causal):
    D, Dv = q.shape[2], grad.shape[2]
    N2 = topk.shape[1]
    G4 = (G + 3) & ~3
    lds = count * l + lp
    qs, dos, s, dp, stats, rest = _grad_scratch(f, G4, D, Dv, lds)
    acc = rest[:G4 * D]
    b, pos = _sequence(q_starts, t)
    diag = pos // l
    nvis, full = _visible(topk, t, j, count, diag, causal, vis)
    if full:                    # uniform weights over masked keys: no gradient to q
        for g in range(G):
            for d in range(D):
                dq[t, j * G + g, d] = narrow(0.0, dq)
        return
    _row_terms(q, grad, out_fwd, smax, ssum, t, j * G, G, G4, qs, dos, stats)
    for v in range(nvis):
        idx = topk[t, j, vis[v]]
        u = (blk_starts[b] + idx) * N2 + j
        keep = pos % l + 1 if causal and idx == diag else l
        _block_ds(qs, dos, kt, vt, u * D * lp, u * Dv * lp, D, Dv, lp, 0, lp, rows, s, dp,
                  v * l, lds, G, G4, stats, scale, keep, l, NO_MASK, 0, 0, 0, 0, l, False)
    for g in range(G, G4):
        for i in range(nvis * l):
            dp[g * lds + i] = 0
    n = nvis * l
    for v in range(nvis):
        u = (blk_starts[b] + topk[t, j, vis[v]]) * N2 + j
        for r in range(l):
            rows[v * l + r] = (u * l + r) * D
    _products_seen(dp, s, lds, n, rows, krow, D, acc, G, G4)
    for g in range(G):
        _narrow_row(acc, g * D, dq, t, j * G + g)


@jit
def select_grad_dq(work, slot, q, grad, out_fwd, smax, ssum, topk, q_starts, blk_starts, kt, krow,
                   vt, dq, scratch, index, G, l, lp, scale, causal):
    """The query gradient of selected attention, one unit per token and KV head."""
    T1, N2, count = topk.shape
    unit, end = claim(work, T1 * N2)
    while unit < end:
        t, j = np.int64(unit) // N2, np.int64(unit) % N2
        rows = index[slot]
        _dq_unit(t, j, q, grad, out_fwd, smax, ssum, topk, q_starts, blk_starts, kt,
                 krow, vt, dq, scratch[slot], rows[count:], rows[:count], G, l, lp, count,
                 scale, causal)
        unit, end = next_unit(work, unit, end, T1 * N2)


# -- backward: dk, dv (owner computes) --------------------------------------------------

@jit
def select_owners(topk, q_starts, blk_starts, blocks, offsets, entries):
    """The inverted index: for owner ``u = gb * N2 + j``, ``entries[offsets[u]:
    offsets[u + 1]]`` are the ``t * count + i`` whose slot ``i`` of token ``t`` selects
    block ``gb`` for KV head ``j``, in increasing order."""
    T1, N2, count = topk.shape
    offsets[:] = 0
    b = 0
    for t in range(T1):
        while q_starts[b + 1] <= t:
            b += 1
        for j in range(N2):
            for i in range(count):
                offsets[(blk_starts[b] + topk[t, j, i]) * N2 + j + 1] += 1
    for u in range(blocks * N2):
        offsets[u + 1] += offsets[u]
    fill = offsets[:-1].copy()
    b = 0
    for t in range(T1):
        while q_starts[b + 1] <= t:
            b += 1
        for j in range(N2):
            for i in range(count):
                u = (blk_starts[b] + topk[t, j, i]) * N2 + j
                entries[fill[u]] = t * count + i
                fill[u] += 1


#: (token, slot) pairs an owner takes at a time: enough query heads (``PAIR_ROWS``
#: rows) that its dk and dv sums stay in registers over several pairs
PAIR_ROWS = 16


@jit
def owner_batch(G):
    """Pairs an owner batches: ``PAIR_ROWS`` rows of query heads (groups rounded up
    to 4), at least one pair."""
    return max(1, PAIR_ROWS // ((G + 3) & ~3))


@jit
def _owner_scratch(f, rows, D, Dv, lds, keys):
    """An owner's scratch: ``_grad_scratch``'s for ``rows`` head rows, then its dk and dv
    sums for ``keys`` keys, zeroed."""
    qs, dos, s, dp, stats, rest = _grad_scratch(f, rows, D, Dv, lds)
    dkb = rest[:keys * D]
    dvb = rest[keys * D:keys * (D + Dv)]
    dkb[:] = 0
    dvb[:] = 0
    return qs, dos, s, dp, stats, dkb, dvb


@jit
def _masked_pair(grad, smax, ssum, t, h0, G, G4, D, o, qs, dos, s, dp, lds, width, r0, r1):
    """An owner's pair (heads ``h0 .. h0 + G``) whose keys are all masked: P =
    exp(MASKED - max) / sum, zero unless the whole row is masked (then 1 / K, and dv
    gets dO / K), for keys ``r0 <= r < r1`` of ``width``; dS = 0. Fills the pair's rows
    (from row ``o``) and returns whether any weight is not zero (else the pair adds
    nothing)."""
    Dv = grad.shape[-1]
    weight = False
    for g in range(G4):
        p = s.dtype.type(0)
        if g < G:
            h = h0 + g
            p = _exp(s.dtype.type(MASKED) - _stat(smax, t, h)) / _stat(ssum, t, h)
        for r in range(width):
            s[(o + g) * lds + r] = p if r0 <= r < r1 else 0
            dp[(o + g) * lds + r] = 0
        weight = weight or p != 0
    if weight:
        _widen_heads(grad, t, h0, G, G4, Dv, dos[o * Dv:])
        qs[o * D:(o + G4) * D] = 0
    return weight


@jit
def _owner_unit(u, q, grad, out_fwd, smax, ssum, topk, q_starts, blk_starts, block_row,
                offsets, entries, kt, vt, dk, dv, f, rows, G, l, lp, scale, causal, seen):
    """dk and dv of key block ``u // N2``, KV head ``u % N2``; False, writing nothing,
    where a sum is not finite and ``seen`` is not set (the caller then asks again with
    it: the terms of rows that do not see a key left out)."""
    N2, count = topk.shape[1], topk.shape[2]
    D, Dv = q.shape[2], grad.shape[2]
    gb, j = u // N2, u % N2
    G4 = (G + 3) & ~3
    l4 = (l + 3) & ~3
    lds = lp + KEY_ALIGN
    batch = owner_batch(G)
    qs, dos, s, dp, stats, dkb, dvb = _owner_scratch(f, batch * G4, D, Dv, lds, l4)
    n = 0                   # pairs in the batch; pair p's heads are rows p*G4 .. p*G4 + G4
    for e in range(offsets[u], offsets[u + 1]):
        t, i = divmod(entries[e], count)
        b, pos = _sequence(q_starts, t)
        diag = pos // l
        idx = topk[t, j, i]
        o = n * G4
        if causal and idx > diag:
            if not _masked_pair(grad, smax, ssum, t, j * G, G, G4, D, o, qs, dos, s, dp, lds,
                                l4, 0, l4):
                continue
        else:
            _row_terms(q, grad, out_fwd, smax, ssum, t, j * G, G, G4, qs[o * D:],
                       dos[o * Dv:], stats[3 * o:])
            keep = pos % l + 1 if causal and idx == diag else l
            _block_ds(qs[o * D:], dos[o * Dv:], kt, vt, u * D * lp, u * Dv * lp, D, Dv, lp,
                      0, lp, rows, s, dp, o * lds, lds, G, G4, stats[3 * o:], scale, keep, l,
                      NO_MASK, 0, 0, 0, 0, l, False)
        n += 1
        if n == batch:
            _owner_sums(s, dp, qs, dos, n * G4, lds, 0, l4, D, Dv, rows, dkb, dvb, seen)
            n = 0
    if n:
        _owner_sums(s, dp, qs, dos, n * G4, lds, 0, l4, D, Dv, rows, dkb, dvb, seen)
    if not seen and not (_finite(dkb, 0, l * D) and _finite(dvb, 0, l * Dv)):
        return False
    row0 = block_row[gb]
    for r in range(l):
        _narrow_row(dkb, r * D, dk, row0 + r, j)
        _narrow_row(dvb, r * Dv, dv, row0 + r, j)
    return True


@jit
def _owner_sums(s, dp, qs, dos, heads, lds, r_lo, r_hi, D, Dv, rows, dkb, dvb, seen):
    """A batch's terms added to the owner's sums for its keys ``r_lo <= r < r_hi``
    (multiples of 4), four keys at a time, over its query heads in order (pairs in
    entry order, heads in order within a pair: the order one pair at a time gives):
    ``dvb[r] += sum P[h, r] dO[h]``, ``dkb[r] += sum (scale dS)[h, r] q[h]`` (heads
    past G are zero rows); ``seen``: the terms of P = 0 left out (``_mm_seen``)."""
    for h in range(heads):
        rows[h] = h * Dv
    for r0 in range(r_lo, r_hi, 4):
        if seen:
            _mm_seen(s, r0, 1, lds, heads, rows, dos, 0, Dv, dvb, r0 * Dv, Dv, True, s)
        else:
            _mm(s, r0, 1, lds, heads, rows, dos, 0, Dv, dvb, r0 * Dv, Dv, True)
    for h in range(heads):
        rows[h] = h * D
    for r0 in range(r_lo, r_hi, 4):
        if seen:
            _mm_seen(dp, r0, 1, lds, heads, rows, qs, 0, D, dkb, r0 * D, D, True, s)
        else:
            _mm(dp, r0, 1, lds, heads, rows, qs, 0, D, dkb, r0 * D, D, True)


@jit
def select_grad_dkdv(work, slot, q, grad, out_fwd, smax, ssum, topk, q_starts, blk_starts,
                     block_row, tails, offsets, entries, order, kt, vt, dk, dv, scratch, index, G,
                     l, lp, scale, causal):
    """The key and value gradients, one unit per key block and KV head (in ``order``);
    the rows ``tails`` lists (``[start, end)`` pairs: keys in no whole block) get 0."""
    N2 = topk.shape[1]
    for p in range(tails.shape[0] if slot == 0 else 0):     # on the caller's thread
        for r in range(tails[p, 0], tails[p, 1]):
            for j in range(N2):
                for d in range(dk.shape[2]):
                    dk[r, j, d] = narrow(0.0, dk)
                for e in range(dv.shape[2]):
                    dv[r, j, e] = narrow(0.0, dv)
    unit, end = claim(work, order.size)
    while unit < end:
        u = order[np.int64(unit)]
        for seen in (False, True):
            if _owner_unit(u, q, grad, out_fwd, smax, ssum, topk, q_starts, blk_starts,
                           block_row, offsets, entries, kt, vt, dk, dv, scratch[slot],
                           index[slot], G, l, lp, scale, causal, seen):
                break
        unit, end = next_unit(work, unit, end, order.size)


# -- dense attention: every key of a sequence, masked --------------------------------
#
# Fusion attention (``_ops.fusion``) and compressed attention (``_ops.compress_attention``).
# A query row sees the keys of its sequence in ``[lo, hi)`` that its sequence's
# geometry (the sparse mode's band) admits and its mask row, when there is one, leaves
# visible: ``ranges[t, r]`` (``r``: the mask's head, 0 unless the mask has one per
# head). A row whose keys the mask hides all takes equal weights over the keys the
# geometry admits (ALL_MASKED); a row the geometry leaves no key, or with ``zero_rows``
# a row the mask hides entirely, gets zeros (NO_KEYS). Keys are staged in chunks of
# CHUNK; a unit computes only the chunks that meet its row's range, which leaves every
# sum as it was (a key outside the range has P = 0 exactly).
#
# A unit is a block of consecutive query tokens of one sequence (``blocks``) and
# ``Gu`` heads ``h0 = u * Gu ..`` of KV head ``j = h0 // G``: the whole group (``Gu =
# G``), or one head when the mask has one per head. Its rows (tokens times heads)
# share each key chunk it loads; the owners of dk and dv batch rows the same way.

#: keys per staged chunk
CHUNK = 64
#: units a parallel iteration runs in a row (one thread-id lookup and one scratch
#: row for all of them)
UNIT_RUN = 8
#: query rows (tokens times heads) a dense forward or dq unit computes together: it
#: takes ``max(1, UNIT_ROWS // Gu)`` consecutive tokens (``_ops.dense.DensePlan.tokens``)
UNIT_ROWS = 16
#: a bound no position reaches: a sequence's geometry without a band
UNBOUNDED = 1 << 40
#: ``ranges[t, r, 2]``: the row sees keys; the mask hides every key; no key
SEES, ALL_MASKED, NO_KEYS = 0, 1, 2
#: ``softmax_sum`` of a row without keys (float32's largest finite value)
NO_KEYS_SUM = np.float32(3.4028234663852886e38)


@jit
def dense_stage(work, slot, k, v, chunk_row, chunk_len, kt, krow, vrow, vt):
    """Stage every chunk (``chunk_row[c]``: its first key row, ``chunk_len[c]`` keys)
    of every KV head as :func:`select_stage` stages a block of CHUNK keys, zero padded."""
    N2, D, Dv = k.shape[-2], k.shape[-1], v.shape[-1]
    unit, end = claim(work, chunk_row.size * N2)
    while unit < end:
        u = np.int64(unit)
        c, j = u // N2, u % N2
        _stage_block(k, v, chunk_row[c], chunk_len[c], j, CHUNK, CHUNK, kt, krow, vrow, vt,
                     u * D, u * Dv)
        unit, end = next_unit(work, unit, end, chunk_row.size * N2)


@jit
def dense_ranges(work, slot, mask, q_starts, kv_starts, geo, mstep, zero_rows, ranges):
    """``ranges[t, r] = (lo, hi, state, holes)`` per query token ``t`` and mask head
    ``r``. Position ``i`` of sequence ``b`` (K keys) may see keys ``max(0, i + geo[b,
    0]) <= k < min(K, i + geo[b, 1])``; the mask, when not empty, hides key ``k``
    where ``mask[geo[b, 2] + r * mstep + i, geo[b, 3] + k]`` is set. SEES: ``[lo,
    hi)`` from the first to one past the last visible key, ``holes`` whether the mask
    hides any between; ALL_MASKED: ``[lo, hi)`` the geometry's keys; NO_KEYS: ``lo =
    hi = 0``."""
    R = ranges.shape[1]
    unit, end = claim(work, ranges.shape[0])
    while unit < end:
        t = np.int64(unit)
        b, pos = _sequence(q_starts, t)
        nk = kv_starts[b + 1] - kv_starts[b]
        glo, ghi = max(0, pos + geo[b, 0]), min(nk, pos + geo[b, 1])
        for r in range(R):
            lo, hi, holes = glo, ghi, 0
            if mask.shape[0] > 0:
                row, mc = geo[b, 2] + r * mstep + pos, geo[b, 3]
                while lo < hi and mask[row, mc + lo] != 0:
                    lo += 1
                while hi > lo and mask[row, mc + hi - 1] != 0:
                    hi -= 1
                for k in range(lo, hi):
                    if mask[row, mc + k] != 0:
                        holes = 1
                        break
            state = SEES
            if glo >= ghi or (lo >= hi and zero_rows):
                state, lo, hi = NO_KEYS, 0, 0
            elif lo >= hi:
                state, lo, hi = ALL_MASKED, glo, ghi
            ranges[t, r, 0] = lo
            ranges[t, r, 1] = hi
            ranges[t, r, 2] = state
            ranges[t, r, 3] = holes
        unit, end = next_unit(work, unit, end, ranges.shape[0])


@jit
def _unit_heads(u, Gu, G, ranges):
    """Unit ``u``'s first head, KV head and ``ranges`` column."""
    h0 = u * Gu
    return h0, h0 // G, u if ranges.shape[1] > 1 else 0


@jit
def _lanes_of(c, first, end):
    """Lanes ``[e0, e1)`` of chunk ``c`` that hold keys ``[first, end)``, widened to
    multiples of 16."""
    return max(first - c * CHUNK, 0), min(((end + 15) & ~15) - c * CHUNK, CHUNK)


@jit
def _chunk_rows(rows, base, n, first, N2, j, width):
    """``rows[i]`` = where key ``first + i`` (of the sequence whose first chunk is
    ``base``) starts in a staged row layout of ``width`` per key, ``i < n``."""
    for i in range(n):
        c, r = divmod(first + i, CHUNK)
        rows[i] = (((base + c) * N2 + j) * CHUNK + r) * width


@jit
def _unit_span(ranges, t0, nt, r, nk, sees_only):
    """The keys a unit computes: the union of its tokens' ranges (those that see keys
    with ``sees_only``, else every one with keys) widened to multiples of 16, at most
    ``nk``; ``(0, 0)`` for none."""
    first, end = nk, 0
    for m in range(nt):
        state = ranges[t0 + m, r, 2]
        if state == SEES or (state == ALL_MASKED and not sees_only):
            first = min(first, ranges[t0 + m, r, 0])
            end = max(end, ranges[t0 + m, r, 1])
    if first >= end:
        return 0, 0
    return first & ~15, min((end + 15) & ~15, nk)


@jit
def _attend(t0, nt, u, q, q_starts, kv_starts, chunk_starts, ranges, kt, vrow, mask, geo,
            mstep, out, smax, ssum, f, rows, G, Gu, lds, scale):
    """Unit ``u`` of the ``nt`` tokens from ``t0`` (one sequence): row ``m * Gu + g`` is
    token ``t0 + m``, head ``h0 + g``. The scores over the union of the rows' ranges
    (each row masked to its own range and mask row), the softmax statistics, the
    values' weighted sum divided by the row sum, rounded once into ``out``. Leaves
    the rows' weights in the scratch's score rows (``exp(score - max)``; 1 over the
    band for a row whose keys are all masked; 0 for a row without keys) and returns
    the keys they cover, ``(first, span)``."""
    N2 = q.shape[-2] // G
    D, Dv = q.shape[-1], out.shape[-1]
    R = nt * Gu
    R4 = (R + 3) & ~3
    h0, j, r = _unit_heads(u, Gu, G, ranges)
    b, pos0 = _sequence(q_starts, t0)
    nk = kv_starts[b + 1] - kv_starts[b]
    qs = f[:R4 * D]
    s = f[R4 * D:R4 * (D + lds)]
    o = f[R4 * (D + lds):R4 * (D + lds + Dv)]
    first, end = _unit_span(ranges, t0, nt, r, nk, False)
    span = end - first
    if _unit_span(ranges, t0, nt, r, nk, True)[1] > 0:      # a row sees keys: scores
        for m in range(nt):
            for g in range(Gu):
                _widen_row(q, t0 + m, h0 + g, qs, (m * Gu + g) * D)
        qs[R * D:R4 * D] = 0
        for c in range(first // CHUNK, (end + CHUNK - 1) // CHUNK):
            w = (chunk_starts[b] + c) * N2 + j
            e0, e1 = _lanes_of(c, first, end)
            _block_scores(qs, D, kt, w * D * CHUNK, CHUNK, e0, e1, rows, s,
                          c * CHUNK - first, lds, R4)
    for m in range(nt):
        t = t0 + m
        lo, hi, state = ranges[t, r, 0], ranges[t, r, 1], ranges[t, r, 2]
        row = geo[b, 2] + h0 * mstep + pos0 + m
        for g in range(Gu):
            at = (m * Gu + g) * lds
            if state == SEES:
                _scale_mask(s, at, span, scale, span)
                _mask_keys(s, at, span, mask, row, geo[b, 3], first, lo, hi, ranges[t, r, 3])
                top, total = _row_softmax(s, at, span)
            else:           # equal weights over the band's keys, or none
                for i in range(span):
                    s[at + i] = 1 if state == ALL_MASKED and lo <= first + i < hi else 0
                top = s.dtype.type(MASKED)
                total = s.dtype.type(hi - lo if state == ALL_MASKED else NO_KEYS_SUM)
            _set_stats(smax, ssum, t, h0 + g, top, total)
    if span:
        _chunk_rows(rows, chunk_starts[b], span, first, N2, j, Dv)
        _products_seen(s, s, lds, span, rows, vrow, Dv, o, R, R4)
    for m in range(nt):
        for g in range(Gu):
            t, h = t0 + m, h0 + g
            if ranges[t, r, 2] == NO_KEYS:
                _zero_row(out, t, h)
            else:
                _divide(o, (m * Gu + g) * Dv, Dv, _stat(ssum, t, h))
                _narrow_row(o, (m * Gu + g) * Dv, out, t, h)
    return first, span


@jit
def dense_forward(work, slot, q, q_starts, kv_starts, chunk_starts, blocks, ranges, kt, vrow, mask,
                  geo, mstep, out, smax, ssum, scratch, index, G, Gu, lds, scale):
    """Dense attention's forward, one unit per block of tokens (``blocks[i]``: its
    first token and count) and ``Gu`` heads."""
    nb = blocks.shape[0]
    units = nb * (q.shape[-2] // Gu)
    run, end = claim(work, (units + UNIT_RUN - 1) // UNIT_RUN)
    while run < end:
        f, rows = scratch[slot], index[slot]
        for unit in range(run * UNIT_RUN, min(units, (run + 1) * UNIT_RUN)):
            u, i = unit // nb, unit % nb          # head by head: its keys stay in cache
            _attend(blocks[i, 0], blocks[i, 1], u, q, q_starts, kv_starts, chunk_starts,
                    ranges, kt, vrow, mask, geo, mstep, out, smax, ssum, f, rows, G, Gu, lds,
                    scale)
        run, end = next_unit(work, run, end, (units + UNIT_RUN - 1) // UNIT_RUN)


@jit
def _cmp_unit(t0, nt, j, q, q_starts, kv_starts, chunk_starts, sel_starts, ranges, kt, vrow,
              atten_mask, geo, topk_mask, out, topk, smax, ssum, f, rows, G, lds, scale, m,
              n):
    """The ``nt`` tokens from ``t0`` and KV head ``j`` of compressed attention:
    ``_attend`` over the sequence's compressed keys, then per token the importance of
    each block of raw keys (the group's weights summed head by head, then through
    the NPU's window of ``m + n - 1`` tokens), forced blocks first, then the largest,
    ties to the lower block."""
    count = topk.shape[2]
    D, Dv = q.shape[-1], out.shape[-1]
    R4 = (nt * G + 3) & ~3
    b, pos0 = _sequence(q_starts, t0)
    nk = kv_starts[b + 1] - kv_starts[b]
    sel = sel_starts[b + 1] - sel_starts[b]
    first, span = _attend(t0, nt, j, q, q_starts, kv_starts, chunk_starts, ranges, kt, vrow,
                          atten_mask, geo, 0, out, smax, ssum, f, rows, G, G, lds, scale)
    s = f[R4 * D:R4 * (D + lds)]
    at = R4 * (D + lds + Dv)
    psum = f[at:at + lds]
    score = f[at + lds:at + 2 * lds]
    taken = rows[max(D, CHUNK):]
    for i in range(nt):
        t = t0 + i
        psum[:nk] = 0
        for g in range(G):
            _add_quotient(psum, first, s, (i * G + g) * lds, span, _stat(ssum, t, j * G + g))
        _importance(psum, nk, first, first + span, m, n, score, sel)
        if topk_mask.shape[0] > 0:
            for c in range(sel):
                if topk_mask[pos0 + i, c]:
                    score[c] = np.inf
        _top(score, sel, count, taken)
        for k in range(count):
            topk[t, j, k] = taken[k]


@jit
def _importance(psum, nk, first, end, m, n, score, sel):
    """``score[c] = sum_i w_i psum[m (c + 1) - i]`` for the ``sel`` blocks, ``i < m + n -
    1``, ``w_i = min(i + 1, n, m + n - 1 - i)``, keys outside ``[0, nk)`` left out, in
    ``i`` order; ``psum`` is zero outside ``[first, end)``, so the blocks whose keys all
    lie outside score 0 without a sum."""
    lo = max(0, (first - 1) // m)
    hi = min(sel, (end + n - 3) // m + 1)
    score[:lo] = 0
    score[hi:sel] = 0
    zero = score.dtype.type(0)
    for c in range(lo, hi):
        acc = zero
        for i in range(m + n - 1):
            k = m * (c + 1) - i
            if 0 <= k < nk:
                acc = fma(score.dtype.type(min(i + 1, n, m + n - 1 - i)), psum[k], acc)
        score[c] = acc


@jit
def _top(score, n, count, best):
    """``best[:count]``: the indices of the ``count`` largest of ``score[:n]``, largest
    first, ties to the lower index (one pass, kept sorted by insertion)."""
    kept = 0
    for c in range(n):
        x = score[c]
        if kept == count and not x > score[best[kept - 1]]:
            continue
        i = kept if kept < count else count - 1
        while i > 0 and x > score[best[i - 1]]:
            best[i] = best[i - 1]
            i -= 1
        best[i] = c
        kept = min(kept + 1, count)


def _divide(a, o, n, d):
    """``a[o + i] /= d`` for ``i < n``."""
    raise NotImplementedError


@overload(_divide, jit_options=OVERLOAD_OPTIONS)
def _divide_typed(a, o, n, d):
    if a.dtype == types.float64:
        def scalar(a, o, n, d):
            for i in range(n):
                a[o + i] /= d
        return scalar

    def lanes(a, o, n, d):
        check_lanes(a, o, n)
        full = n - n % 16
        for i in range(0, full, 16):
            lstore(a, o + i, ldiv(lload(a, o + i), d))
        for i in range(full, n):
            a[o + i] /= d
    return lanes


def _add_quotient(a, oa, b, ob, n, d):
    """``a[oa + i] += b[ob + i] / d`` for ``i < n``."""
    raise NotImplementedError


@overload(_add_quotient, jit_options=OVERLOAD_OPTIONS)
def _add_quotient_typed(a, oa, b, ob, n, d):
    if a.dtype == types.float64:
        def scalar(a, oa, b, ob, n, d):
            for i in range(n):
                a[oa + i] += b[ob + i] / d
        return scalar

    def lanes(a, oa, b, ob, n, d):
        check_lanes(a, oa, n)
        check_lanes(b, ob, n)
        full = n - n % 16
        for i in range(0, full, 16):
            lstore(a, oa + i, ladd(lload(a, oa + i), ldiv(lload(b, ob + i), d)))
        for i in range(full, n):
            a[oa + i] += b[ob + i] / d
    return lanes


@jit
def cmp_forward(work, slot, q, q_starts, kv_starts, chunk_starts, sel_starts, blocks, ranges, kt,
                vrow, atten_mask, geo, topk_mask, out, topk, smax, ssum, scratch, index, G, lds,
                scale, m, n):
    """Compressed attention with top-k selection, one unit per block of tokens and KV
    head."""
    nb, N2 = blocks.shape[0], topk.shape[1]
    units = nb * N2
    run, end = claim(work, (units + UNIT_RUN - 1) // UNIT_RUN)
    while run < end:
        f, rows = scratch[slot], index[slot]
        for unit in range(run * UNIT_RUN, min(units, (run + 1) * UNIT_RUN)):
            j, i = unit // nb, unit % nb          # KV head by KV head: its keys stay in cache
            _cmp_unit(blocks[i, 0], blocks[i, 1], j, q, q_starts, kv_starts, chunk_starts,
                      sel_starts, ranges, kt, vrow, atten_mask, geo, topk_mask, out, topk,
                      smax, ssum, f, rows, G, lds, scale, m, n)
        run, end = next_unit(work, run, end, (units + UNIT_RUN - 1) // UNIT_RUN)


# -- dense attention backward -----------------------------------------------------------

@jit
def _dense_dq_unit(t0, nt, u, q, grad, out_fwd, smax, ssum, q_starts, kv_starts,
                   chunk_starts, ranges, kt, krow, vt, mask, geo, mstep, dq, f, rows, G, Gu,
                   lds, scale):
    """dq of ``_attend``'s unit: the scores and ``dP = dO V^T`` again over the union of
    the ranges of its rows that see keys, ``dS`` with the saved statistics, ``dq =
    scale dS K``; rows with equal weights or no keys get 0."""
    N2 = q.shape[-2] // G
    D, Dv = q.shape[-1], grad.shape[-1]
    R = nt * Gu
    R4 = (R + 3) & ~3
    h0, j, r = _unit_heads(u, Gu, G, ranges)
    qs, dos, s, dp, stats, rest = _grad_scratch(f, R4, D, Dv, lds)
    acc = rest[:R4 * D]
    for m in range(nt):
        if ranges[t0 + m, r, 2] != SEES:
            for g in range(Gu):
                _zero_row(dq, t0 + m, h0 + g)
    b, pos0 = _sequence(q_starts, t0)
    nk = kv_starts[b + 1] - kv_starts[b]
    first, end = _unit_span(ranges, t0, nt, r, nk, True)
    span = end - first
    if span == 0:
        return
    for m in range(nt):
        _row_terms(q, grad, out_fwd, smax, ssum, t0 + m, h0, Gu, Gu, qs[m * Gu * D:],
                   dos[m * Gu * Dv:], stats[3 * m * Gu:])
    qs[R * D:R4 * D] = 0
    dos[R * Dv:R4 * Dv] = 0
    for c in range(first // CHUNK, (end + CHUNK - 1) // CHUNK):
        w = (chunk_starts[b] + c) * N2 + j
        e0, e1 = _lanes_of(c, first, end)
        _block_scores(qs, D, kt, w * D * CHUNK, CHUNK, e0, e1, rows, s, c * CHUNK - first,
                      lds, R4)
        _block_scores(dos, Dv, vt, w * Dv * CHUNK, CHUNK, e0, e1, rows, dp,
                      c * CHUNK - first, lds, R4)
    for m in range(nt):
        t = t0 + m
        lo, hi, state = ranges[t, r, 0], ranges[t, r, 1], ranges[t, r, 2]
        row = geo[b, 2] + h0 * mstep + pos0 + m
        for g in range(Gu):
            i = m * Gu + g
            at = i * lds
            if state != SEES:
                dp[at:at + span] = 0
                continue
            _scale_mask(s, at, span, scale, span)
            _mask_keys(s, at, span, mask, row, geo[b, 3], first, lo, hi, ranges[t, r, 3])
            _ds_row(s, dp, at, span, stats[3 * i], stats[3 * i + 1], stats[3 * i + 2], scale,
                    span)
    _chunk_rows(rows, chunk_starts[b], span, first, N2, j, D)
    _products_seen(dp, s, lds, span, rows, krow, D, acc, R, R4)
    for m in range(nt):
        if ranges[t0 + m, r, 2] == SEES:
            for g in range(Gu):
                _narrow_row(acc, (m * Gu + g) * D, dq, t0 + m, h0 + g)


@jit
def dense_grad_dq(work, slot, q, grad, out_fwd, smax, ssum, q_starts, kv_starts, chunk_starts,
                  blocks, ranges, kt, krow, vt, mask, geo, mstep, dq, scratch, index, G, Gu, lds,
                  scale):
    """The query gradient of dense attention, one unit per block of tokens and ``Gu``
    heads."""
    nb = blocks.shape[0]
    units = nb * (q.shape[-2] // Gu)
    run, end = claim(work, (units + UNIT_RUN - 1) // UNIT_RUN)
    while run < end:
        f, rows = scratch[slot], index[slot]
        for unit in range(run * UNIT_RUN, min(units, (run + 1) * UNIT_RUN)):
            u, i = unit // nb, unit % nb          # head by head: its keys stay in cache
            _dense_dq_unit(blocks[i, 0], blocks[i, 1], u, q, grad, out_fwd, smax, ssum,
                           q_starts, kv_starts, chunk_starts, ranges, kt, krow, vt, mask, geo,
                           mstep, dq, f, rows, G, Gu, lds, scale)
        run, end = next_unit(work, run, end, (units + UNIT_RUN - 1) // UNIT_RUN)


@jit
def _dense_owner(w, q, grad, out_fwd, smax, ssum, q_starts, kv_starts, chunk_starts, ranges,
                 kt, vt, mask, geo, mstep, dk, dv, f, rows, G, Gu, scale, seen):
    """dk and dv of chunk ``w // N2``'s keys for KV head ``w % N2``: the terms of every
    query row of its sequence whose range meets the chunk, in token order, the group's
    units in head order within a token. False, writing nothing, where a sum is not
    finite and ``seen`` is not set (as ``_owner_unit``)."""
    N2 = dk.shape[-2]
    D, Dv = q.shape[-1], grad.shape[-1]
    gc, j = w // N2, w % N2
    b = np.searchsorted(chunk_starts, gc, side="right") - 1
    first = (gc - chunk_starts[b]) * CHUNK
    nk = kv_starts[b + 1] - kv_starts[b]
    valid = min(CHUNK, nk - first)
    G4 = (Gu + 3) & ~3
    lds = CHUNK + KEY_ALIGN
    batch = owner_batch(Gu)
    qs, dos, s, dp, stats, dkb, dvb = _owner_scratch(f, batch * G4, D, Dv, lds, CHUNK)
    n = 0                   # units in the batch; unit p's heads are rows p*G4 .. p*G4 + G4
    r_lo, r_hi = CHUNK, 0   # the keys the batch's rows see, in multiples of 16
    for t in range(q_starts[b], q_starts[b + 1]):
        for sub in range(G // Gu):
            h0, _, r = _unit_heads(j * (G // Gu) + sub, Gu, G, ranges)
            lo, hi = ranges[t, r, 0], ranges[t, r, 1]
            if hi <= first or lo >= first + valid:
                continue
            o = n * G4
            if ranges[t, r, 2] == ALL_MASKED:
                if not _masked_pair(grad, smax, ssum, t, h0, Gu, G4, D, o, qs, dos, s, dp,
                                    lds, CHUNK, max(lo - first, 0), min(hi - first, valid)):
                    continue
                e0, e1 = 0, CHUNK
            else:
                e0, e1 = _lanes_of(0, (max(lo, first) - first) & ~15, min(hi, nk) - first)
                _row_terms(q, grad, out_fwd, smax, ssum, t, h0, Gu, G4, qs[o * D:],
                           dos[o * Dv:], stats[3 * o:])
                pos = t - q_starts[b]
                _block_ds(qs[o * D:], dos[o * Dv:], kt, vt, w * D * CHUNK, w * Dv * CHUNK, D,
                          Dv, CHUNK, e0, e1, rows, s, dp, o * lds, lds, Gu, G4, stats[3 * o:],
                          scale, valid, CHUNK, mask, geo[b, 2] + h0 * mstep + pos, geo[b, 3],
                          first, lo, hi, ranges[t, r, 3])
                for g in range(G4):       # what the batch's other rows see, this one does not
                    for k in range(0, e0):
                        s[(o + g) * lds + k] = 0
                        dp[(o + g) * lds + k] = 0
                    for k in range(e1, CHUNK):
                        s[(o + g) * lds + k] = 0
                        dp[(o + g) * lds + k] = 0
            r_lo, r_hi = min(r_lo, e0), max(r_hi, e1)
            n += 1
            if n == batch:
                _owner_sums(s, dp, qs, dos, n * G4, lds, r_lo, r_hi, D, Dv, rows, dkb, dvb,
                            seen)
                n, r_lo, r_hi = 0, CHUNK, 0
    if n:
        _owner_sums(s, dp, qs, dos, n * G4, lds, r_lo, r_hi, D, Dv, rows, dkb, dvb, seen)
    if not seen and not (_finite(dkb, 0, valid * D) and _finite(dvb, 0, valid * Dv)):
        return False
    row0 = kv_starts[b] + first
    for k in range(valid):
        _narrow_row(dkb, k * D, dk, row0 + k, j)
        _narrow_row(dvb, k * Dv, dv, row0 + k, j)
    return True


@jit
def dense_grad_dkdv(work, slot, q, grad, out_fwd, smax, ssum, q_starts, kv_starts, chunk_starts,
                    ranges, order, kt, vt, mask, geo, mstep, dk, dv, scratch, index, G, Gu, scale):
    """The key and value gradients of dense attention, one unit per key chunk and KV
    head (in ``order``), each the owner of its rows."""
    unit, end = claim(work, order.size)
    while unit < end:
        w = order[np.int64(unit)]
        for seen in (False, True):
            if _dense_owner(w, q, grad, out_fwd, smax, ssum, q_starts, kv_starts,
                            chunk_starts, ranges, kt, vt, mask, geo, mstep, dk, dv,
                            scratch[slot], index[slot], G, Gu, scale, seen):
                break
        unit, end = next_unit(work, unit, end, order.size)


@jit
def chunk_work(ranges, q_starts, chunk_starts, work):
    """``work[c]``: the query rows whose range meets chunk ``c`` (``work`` has one
    element more than there are chunks)."""
    work[:] = 0
    b = 0
    for t in range(ranges.shape[0]):
        while q_starts[b + 1] <= t:
            b += 1
        for r in range(ranges.shape[1]):
            if ranges[t, r, 1] > ranges[t, r, 0]:
                work[chunk_starts[b] + ranges[t, r, 0] // CHUNK] += 1
                work[chunk_starts[b] + (ranges[t, r, 1] + CHUNK - 1) // CHUNK] -= 1
    for c in range(1, work.size):
        work[c] += work[c - 1]
