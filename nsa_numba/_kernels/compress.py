"""The compiled kernels. They take only preallocated arrays and integers.

Arrays arrive as storage views (see ``_kernels.halfprec``): ``x``, ``g`` and the outputs as
``[B, S, N, D]`` views (``_ops.layouts``) in their storage dtype with any strides,
``w`` as the weight ``[l, N]`` (each kernel first widens it into ``wt``, ``[N, l]``
in the accumulator dtype: ``weight_table``), ``tiles`` as the table from
``_ops.compress.tile_schedule``. N comes from ``wt`` and D is an argument,
never an array's shape: an array may arrive as a C-contiguous carrier padded beyond
its own extent (``_ops.layouts.c_carrier``), of which the kernels index only
``[:, :, :N, :D]``. An input read at a step of elements may arrive as words
(``_ops.layouts.word_view``); ``widen`` takes its element from each word. (The training
kernels at the end of the file also take C-contiguous arrays of other shapes, which
they reshape to those views themselves.)

Each kernel takes tiles (``_core.launch.claim``); a unit is one tile with all its heads, so
it reads its block of ``[T, N, D]`` in memory order (per-head rows at a stride of
N*D elements run at a fraction of the memory bandwidth). A unit writes only the
output rows its tile owns and its own slot of the partials. All sums run in an
order fixed by the problem, not by how tiles land on threads:

* out[k]: over the window's tokens in order;
* input_grad[t]: over the windows covering ``t`` in order;
* weight_grad[j, n]: per tile, per element over the tile's tokens in order, then
  the D element sums by a fixed halving fold (``_fold_rows``), then
  (``reduce_weight_grad``) over tiles in order.

The inner loops run over D, so LLVM vectorises them; every stored element is
converted once, in registers. (``_forward_simd`` instead keeps its window
sums in explicit vectors, ``_kernels.simd``, and loops over tokens.) The kernels index the
arrays in place (``x[b, t, n, e]``), never through row views (``x[b, t, n]``):
Numba counts references to every view it makes with an atomic add on the parent
array's shared counter, and with all threads bumping the same counter once per
token and head that cost about half of the forward's time on short rows.
"""

import numpy as np
from numba import types
from numba.extending import overload

from .._core.jit import OVERLOAD_OPTIONS, jit
from .._core.launch import ALONE, FINISH, claim, next_unit
from .halfprec import narrow, widen
from .prefetch import AHEAD_BYTES, LINE_BYTES, prefetch_row
from .simd import (
    SHORT_WIDTH,
    WIDTH,
    check_row,
    check_span,
    vload,
    vload_row_short,
    vload_row_split,
    vload_short,
    vmul_add,
    vstore,
    vstore_row,
    vstore_row_split,
    vzeros,
    vzeros_short,
)
from .tiles import BATCH, G0, G1, I0, I1, KW0, S0, TOK_HI, TOK_LO, ring_slots

# The compile cache is keyed on this file's text only. These digests tie it to
# the helper modules the kernels inline (and _target, whose choices shape them);
# tests/test_cache_keys.py keeps them true.
CACHE_DEPENDS = {
    "halfprec.py": "f53894f44485c238",
    "../_core/jit.py": "a6f517ee95725b3e",
    "../_core/launch.py": "21843c4d967f4840",
    "prefetch.py": "4919cebb64fefdaf",
    "simd.py": "6e9373be71901506",
    "target.py": "03997255e397a5e2",
    "tiles.py": "f333676925716b80",
}

#: tokens per pass over D in _forward_grouped's common paths
GROUP = 4
#: token rows (N * D elements) shorter than this never use _forward_grouped (the kernel
#: each problem gets: _dispatch.forward_kernel)
GROUPED_MIN_ROW = 2048


def _table_for(w):
    """An empty ``[N, l]`` array in the accumulator dtype of weight storage ``w``."""
    return np.empty((w.shape[1], w.shape[0]),
                    np.float64 if w.dtype == np.float64 else np.float32)


@overload(_table_for, jit_options=OVERLOAD_OPTIONS)
def _table_for_typed(w):
    accumulator = np.float64 if w.dtype == types.float64 else np.float32

    def table(w):
        return np.empty((w.shape[1], w.shape[0]), accumulator)
    return table


@jit
def weight_table(w):
    """The weight's storage ``w`` ``[l, N]`` as the ``[N, l]`` accumulator table the
    kernels read. Each kernel builds it first: one small pass in compiled code, where
    NumPy's ``astype`` of a bfloat16 array and a transposed copy cost a call tens of
    microseconds after a cache flush (docs/performance.md, "Figures behind the code's
    choices"). Every storage format widens exactly, so the table is the weight's
    values."""
    wt = _table_for(w)
    for j in range(w.shape[0]):
        for n in range(w.shape[1]):
            wt[n, j] = widen(w[j, n])
    return wt



@jit
def _decode_token(x, b, t, n, dst):
    """dst[:] = x[b, t, n, :] widened (indexed in place: see the module docstring)."""
    for e in range(dst.shape[0]):
        dst[e] = widen(x[b, t, n, e])


@jit
def _zero_slot(ring, slot):
    for n in range(ring.shape[1]):
        for e in range(ring.shape[2]):
            ring[slot, n, e] = 0


@jit
def _covering(rel, block, stride, lo, hi):
    """Numbers of the windows (clipped to lo..hi) that contain sequence position rel."""
    return max(lo, (rel - block) // stride + 1), min(hi, rel // stride)


@jit
def _forward_scratch(mine, ring_size, N, D):
    """A thread's scratch row as the ring of open window sums and a decoded row."""
    ring = mine[:ring_size * N * D].reshape((ring_size, N, D))
    return ring, mine[ring_size * N * D:ring_size * N * D + D]


@jit
def _emit_window(ring, slot, out, b, row):
    """Round one closed window's sums ``ring[slot]`` ``[N, D]`` into ``out[b, row]``."""
    for n in range(ring.shape[1]):
        for e in range(ring.shape[2]):
            out[b, row, n, e] = narrow(ring[slot, n, e], out)


@jit(inline="always")
def _add_token(ring, xf, x, b, s0, q, n, wt, lo, hi, stride):
    """Add head n of the token at sequence position q into windows lo..hi, in order
    (the forward's path for a token in more than two windows)."""
    _decode_token(x, b, s0 + q, n, xf)
    for i in range(lo, hi + 1):
        si = i % ring.shape[0]
        w = wt[n, q - i * stride]
        for e in range(xf.shape[0]):
            ring[si, n, e] += w * xf[e]


@jit(inline="always")
def _forward_tile(tiles, tile, block, stride):
    """(b, s0, i0, i1, row0, rel, rel_end) of a forward tile: its batch row, sequence
    start, windows i0..i1, first output row, and the sequence positions it reads."""
    i0 = tiles[tile, I0]
    i1 = tiles[tile, I1]
    rel = i0 * stride
    rel_end = (i1 - 1) * stride + block if i1 > i0 else rel
    return tiles[tile, BATCH], tiles[tile, S0], i0, i1, tiles[tile, KW0], rel, rel_end


@jit(inline="always")
def _open_segment(ring, rel, rel_end, i0, i1, block, stride):
    """(lo, hi, nxt) of the forward segment starting at ``rel``: windows lo..hi cover
    positions rel..nxt - 1 (none when lo > hi). Clears window hi's ring slot when it
    opens at ``rel``."""
    lo, hi = _covering(rel, block, stride, i0, i1 - 1)
    nxt = _segment_end(rel, lo, hi, i1 - 1, block, stride, rel_end)
    if lo <= hi and rel == hi * stride:
        _zero_slot(ring, hi % ring.shape[0])
    return lo, hi, nxt


@jit
def _segment_end(rel, lo, hi, last, block, stride, end):
    """First position after ``rel`` where the set of covering windows changes.

    Windows open at multiples of ``stride`` and close ``block`` later; ``lo..hi``
    cover ``rel`` (``lo > hi``: none does), ``last`` is the last window of interest.
    """
    nxt = (hi + 1) * stride if hi < last else end
    if lo <= hi:
        nxt = min(nxt, lo * stride + block)
    return min(nxt, end)


@jit
def _forward_grouped(x, wt, out, tiles, tile, stride, D, row):
    """out[kw0 + i, n] = sum_j wt[n, j] * x[s0 + i*stride + j, n] for each tile's windows.

    A unit is one tile, all heads: it streams the tile's tokens in memory order and
    keeps the windows open at the current token in a ring of ceil(l / d) slots. The
    tokens are walked in segments over which the covering windows do not change,
    GROUP tokens per pass over D: each window sum still adds its terms one token
    at a time, in order. This is tile ``tile`` of the table; ``row`` is the calling
    thread's scratch row (``forward_scratch_elements``).
    """
    N = wt.shape[0]
    block = wt.shape[1]
    ring_size = ring_slots(block, stride)
    b, s0, i0, i1, row0, rel, rel_end = _forward_tile(tiles, tile, block, stride)
    ring, xf = _forward_scratch(row, ring_size, N, D)
    while rel < rel_end:
        lo, hi, nxt = _open_segment(ring, rel, rel_end, i0, i1, block, stride)
        if lo > hi:           # between windows (d > l): never read
            rel = nxt
            continue
        sa = lo % ring_size
        sb = hi % ring_size
        for r in range(rel, nxt, GROUP):
            t = s0 + r
            ja = r - lo * stride
            full = r + GROUP <= nxt
            for n in range(N):
                if full and lo == hi:
                    a0, a1, a2, a3 = wt[n, ja], wt[n, ja + 1], wt[n, ja + 2], wt[n, ja + 3]
                    for e in range(D):
                        ring[sa, n, e] = ((((ring[sa, n, e] + a0 * widen(x[b, t, n, e]))
                                            + a1 * widen(x[b, t + 1, n, e]))
                                           + a2 * widen(x[b, t + 2, n, e]))
                                          + a3 * widen(x[b, t + 3, n, e]))
                elif full and lo + 1 == hi:  # the common case l <= 2d
                    jb = ja - stride
                    a0, a1, a2, a3 = wt[n, ja], wt[n, ja + 1], wt[n, ja + 2], wt[n, ja + 3]
                    b0, b1, b2, b3 = wt[n, jb], wt[n, jb + 1], wt[n, jb + 2], wt[n, jb + 3]
                    for e in range(D):
                        v0 = widen(x[b, t, n, e])
                        v1 = widen(x[b, t + 1, n, e])
                        v2 = widen(x[b, t + 2, n, e])
                        v3 = widen(x[b, t + 3, n, e])
                        ring[sa, n, e] = (((ring[sa, n, e] + a0 * v0) + a1 * v1)
                                          + a2 * v2) + a3 * v3
                        ring[sb, n, e] = (((ring[sb, n, e] + b0 * v0) + b1 * v1)
                                          + b2 * v2) + b3 * v3
                else:                 # a short group, or more than two windows
                    for q in range(r, min(r + GROUP, nxt)):
                        _add_token(ring, xf, x, b, s0, q, n, wt, lo, hi, stride)
        if nxt == lo * stride + block:  # window lo closed at nxt - 1
            _emit_window(ring, sa, out, b, row0 + lo)
        rel = nxt


@jit
def _forward_rows(x, wt, out, tiles, tile, stride, D, row):
    """``_forward_grouped`` one token per pass over D: faster for short token rows.

    Same arguments, same segments, same sums in the same order, so the same bits;
    ``_ops.dispatch`` picks it when N * D < GROUPED_MIN_ROW (on short rows the four-row
    passes stall on loads, while one row at a time reads memory in order). The two
    kernels share their segment walk but not their inner passes: one kernel with the
    group size as an argument was slower on short rows (docs/performance.md,
    "Figures behind the code's choices").

    Each token asks for the row AHEAD_BYTES further on (software prefetch): short
    rows are too short for the hardware prefetchers to run far ahead, least of all
    when they are slices of longer rows.
    """
    N = wt.shape[0]
    block = wt.shape[1]
    ring_size = ring_slots(block, stride)
    # the bytes of a token row the kernel reads, and how many rows ahead to prefetch
    row_bytes = ((N - 1) * x.shape[3] + D) * x.itemsize if N > 0 else 0
    ahead = max(1, AHEAD_BYTES // max(row_bytes, 1))
    b, s0, i0, i1, row0, rel, rel_end = _forward_tile(tiles, tile, block, stride)
    ring, xf = _forward_scratch(row, ring_size, N, D)
    while rel < rel_end:
        lo, hi, nxt = _open_segment(ring, rel, rel_end, i0, i1, block, stride)
        if lo > hi:           # between windows (d > l): never read
            rel = nxt
            continue
        sa = lo % ring_size
        sb = hi % ring_size
        for r in range(rel, nxt):
            t = s0 + r
            if t + ahead < x.shape[1]:
                for offset in range(0, row_bytes, LINE_BYTES):
                    prefetch_row(x, b, t + ahead, offset)
            ja = r - lo * stride
            for n in range(N):
                wa = wt[n, ja]
                if lo == hi:
                    for e in range(D):
                        ring[sa, n, e] += wa * widen(x[b, t, n, e])
                elif lo + 1 == hi:  # the common case l <= 2d: one pass for both
                    wb = wt[n, ja - stride]
                    for e in range(D):
                        v = widen(x[b, t, n, e])
                        ring[sa, n, e] += wa * v
                        ring[sb, n, e] += wb * v
                else:
                    _add_token(ring, xf, x, b, s0, r, n, wt, lo, hi, stride)
        if nxt == lo * stride + block:  # window lo closed at nxt - 1
            _emit_window(ring, sa, out, b, row0 + lo)
        rel = nxt


@jit(inline="always")
def _token_step(x, b, t, n, e0, fetch, t0, at, stop, row_stride, row_bytes):
    """(``x[b, t, n, e0:e0 + WIDTH]`` widened to a vector, at, stop): one token step of
    a ``_forward_simd`` pass, first prefetching the next line after row t0
    when ``fetch`` (see ``_prefetch_line``)."""
    if fetch:
        at, stop = _prefetch_line(x, b, t0, at, stop, row_stride, row_bytes)
    check_row(x, b, t, n, e0)
    return vload_row_split(x, b, t, n, e0), at, stop


@jit(inline="always")
def _prefetch_line(x, b, t0, at, stop, row_stride, row_bytes):
    """Prefetch the line at byte ``at`` after ``x[b, t0, 0, 0]`` and return the next
    (at, stop): the next line of the row that ends at byte ``stop``, else the start
    of the next row (rows ``row_stride`` bytes apart, ``row_bytes`` of them read)."""
    prefetch_row(x, b, t0, at)
    at += LINE_BYTES
    if at >= stop:
        at = stop - row_bytes + row_stride
        stop = at + row_bytes
    return at, stop


@jit(inline="always")
def _park(ring, p, out, b, row, n, e0, acc, closes):
    """A window's sums ``acc`` at the end of a segment: rounded into
    ``out[b, row, n, e0:]`` when the window closed there, else back to ``ring[p:]``."""
    if closes:
        check_row(out, b, row, n, e0)
        vstore_row_split(out, b, row, n, e0, acc)
    else:
        vstore(ring, p, acc)


@jit(inline="always")
def _forward_simd(work, slot, x, w, out, tiles, stride, D, scratch):
    """``_forward_rows`` with the window sums in registers: faster on short rows
    and on rows of up to ``_ops.dispatch.SIMD_ROW_BYTES``.

    Same arguments, same segments, same sums in the same order, so the same bits.
    Each segment of tokens is read in passes, one per head and per WIDTH elements of
    D: the sums of the (at most two) open windows stay in ``_kernels.simd`` vectors over the
    segment's tokens and visit the ring once per segment, not once per token.
    ``_ops.dispatch`` picks it only where it applies (``_ops.dispatch.simd_fits``): l <= 2d,
    D a multiple of WIDTH, C-contiguous rows in a dtype of ``_kernels.simd.STORAGE``.

    A pass reads WIDTH elements of every token row at the row stride, which the
    hardware prefetchers follow badly. So while it reads one segment, the kernel asks
    for the next one in memory order (software prefetch, the rows after this
    segment, as many as it has): every line of those rows' used bytes, spread evenly
    over the segment's token steps, so the requests stream like a plain read instead
    of arriving in bursts.
    """
    wt = weight_table(w)
    N = wt.shape[0]
    block = wt.shape[1]
    ring_size = ring_slots(block, stride)
    # the bytes of a token row the kernel reads, the lines that holds (from the row's
    # first byte: a row that does not start on a line also touches the next line's
    # start, which the prefetch leaves to the load), and the rows' stride in bytes
    row_bytes = ((N - 1) * x.shape[3] + D) * x.itemsize if N > 0 else 0
    row_lines = (row_bytes + LINE_BYTES - 1) // LINE_BYTES
    row_stride = x.shape[2] * x.shape[3] * x.itemsize
    passes = N * (D // WIDTH)
    ring = scratch[slot]
    unit, end = claim(work, tiles.shape[0])
    while unit < end:
        b, s0, i0, i1, row0, rel, rel_end = _forward_tile(tiles, np.int64(unit), block,
                                                          stride)
        while rel < rel_end:
            lo, hi = _covering(rel, block, stride, i0, i1 - 1)
            nxt = _segment_end(rel, lo, hi, i1 - 1, block, stride, rel_end)
            if lo > hi:           # between windows (d > l): never read
                rel = nxt
                continue
            opens = rel == hi * stride          # window hi starts here: from zero
            closes = nxt == lo * stride + block  # window lo ends at nxt - 1
            ja = rel - lo * stride
            jb = rel - hi * stride
            # the prefetch of the next `ahead` rows: `lines` lines over the segment's
            # passes, `share` per pass, one per token step and the rest at its start;
            # the cursor `at` (bytes after row s0 + nxt) advances through row data only
            ahead = max(0, min(nxt - rel, x.shape[1] - (s0 + nxt)))
            share = (ahead * row_lines + passes - 1) // max(passes, 1)
            left = ahead * row_lines
            at = 0
            stop = row_bytes
            for n in range(N):
                for e0 in range(0, D, WIDTH):
                    pa = ((lo % ring_size) * N + n) * D + e0
                    pb = ((hi % ring_size) * N + n) * D + e0
                    check_span(ring, pa)
                    check_span(ring, pb)
                    steps = min(share, left)
                    left -= steps
                    for _ in range(nxt - rel, steps):
                        at, stop = _prefetch_line(x, b, s0 + nxt, at, stop, row_stride,
                                                  row_bytes)
                    if lo == hi:
                        acc = vzeros() if opens else vload(ring, pa)
                        for r in range(rel, nxt):
                            v, at, stop = _token_step(x, b, s0 + r, n, e0, r - rel < steps,
                                                      s0 + nxt, at, stop, row_stride,
                                                      row_bytes)
                            acc = vmul_add(acc, wt[n, np.uint64(ja + r - rel)], v)
                        _park(ring, pa, out, b, row0 + lo, n, e0, acc, closes)
                    else:                 # two windows: lo opened earlier, hi may open
                        acc = vload(ring, pa)
                        acc_hi = vzeros() if opens else vload(ring, pb)
                        for r in range(rel, nxt):
                            v, at, stop = _token_step(x, b, s0 + r, n, e0, r - rel < steps,
                                                      s0 + nxt, at, stop, row_stride,
                                                      row_bytes)
                            acc = vmul_add(acc, wt[n, np.uint64(ja + r - rel)], v)
                            acc_hi = vmul_add(acc_hi, wt[n, np.uint64(jb + r - rel)], v)
                        _park(ring, pa, out, b, row0 + lo, n, e0, acc, closes)
                        vstore(ring, pb, acc_hi)
            rel = nxt
        unit, end = next_unit(work, unit, end, tiles.shape[0])


@jit(inline="always")
def _backward_token(x, wt, ig, gring, lanes, xf, ia, b, t, rel, lo, hi, stride, D):
    """Both gradients' terms of one token at sequence position ``rel``, covered by
    windows lo..hi (none when lo > hi), whose gradient rows are in ``gring``."""
    zero = lanes.dtype.type(0)  # sums start at +0, as in a zeroed buffer
    ring_size = gring.shape[0]
    if lo > hi:  # no window covers t
        for n in range(wt.shape[0]):
            for e in range(D):
                ig[b, t, n, e] = narrow(zero, ig)
        return
    ja = rel - lo * stride
    jb = ja - stride
    sa = lo % ring_size
    sb = hi % ring_size
    for n in range(wt.shape[0]):
        wa = wt[n, ja]
        if lo == hi:
            for e in range(D):
                v = widen(x[b, t, n, e])
                p = gring[sa, n, e]
                ig[b, t, n, e] = narrow(zero + wa * p, ig)
                lanes[ja, n, e] += p * v
        elif lo + 1 == hi:
            wb = wt[n, jb]
            for e in range(D):
                v = widen(x[b, t, n, e])
                p = gring[sa, n, e]
                q = gring[sb, n, e]
                ig[b, t, n, e] = narrow((zero + wa * p) + wb * q, ig)
                lanes[ja, n, e] += p * v
                lanes[jb, n, e] += q * v
        else:
            _decode_token(x, b, t, n, xf)
            for e in range(D):
                p = gring[sa, n, e]
                ia[e] = zero + wa * p
                lanes[ja, n, e] += p * xf[e]
            for i in range(lo + 1, hi + 1):
                j = rel - i * stride
                w = wt[n, j]
                si = i % ring_size
                for e in range(D):
                    p = gring[si, n, e]
                    ia[e] += w * p
                    lanes[j, n, e] += p * xf[e]
            for e in range(D):
                ig[b, t, n, e] = narrow(ia[e], ig)


@jit(inline="always")
def _pair_tokens(x, wt, ig, gring, lanes, mine, lanes_at, b, t, ja, sa, sb, sc, stride, D):
    """The terms of tokens t and t + d (see ``_backward_tiles``): t at offset ``ja``
    of the window whose gradient row is in ring slot ``sa`` and at ``ja - d`` of the
    next one (slot ``sb``), t + d likewise of the windows in slots sb and sc.

    ``gring`` and ``lanes`` are views of ``mine``, the ring at its start and the
    lanes ``lanes_at`` elements on. ``_pair_tokens_vector`` runs the same sums in
    ``_kernels.simd`` vectors: same operations in the same order, same bits.
    """
    zero = lanes.dtype.type(0)
    jb = ja - stride
    for n in range(wt.shape[0]):
        wa = wt[n, ja]
        wb = wt[n, jb]
        for e in range(D):
            v = widen(x[b, t, n, e])
            vu = widen(x[b, t + stride, n, e])
            p = gring[sa, n, e]
            q = gring[sb, n, e]
            s = gring[sc, n, e]
            ig[b, t, n, e] = narrow((zero + wa * p) + wb * q, ig)
            ig[b, t + stride, n, e] = narrow((zero + wa * q) + wb * s, ig)
            lanes[ja, n, e] = (lanes[ja, n, e] + p * v) + q * vu
            lanes[jb, n, e] = (lanes[jb, n, e] + q * v) + s * vu


@jit(inline="always")
def _pair_tokens_vector(x, wt, ig, gring, lanes, mine, lanes_at, b, t, ja, sa, sb, sc, stride,
                        D):
    """``_pair_tokens`` over ``SHORT_WIDTH`` elements at a time of ``mine`` (not through
    its views ``gring`` and ``lanes``); D a multiple of SHORT_WIDTH, ``x`` and ``ig`` of
    one storage dtype that ``_kernels.simd`` converts."""
    N = wt.shape[0]
    jb = ja - stride
    u = t + stride
    for n in range(N):
        wa = wt[n, ja]
        wb = wt[n, jb]
        pa = (sa * N + n) * D
        pb = (sb * N + n) * D
        pc = (sc * N + n) * D
        la = lanes_at + (ja * N + n) * D
        lb = lanes_at + (jb * N + n) * D
        for e0 in range(0, D, SHORT_WIDTH):
            for tok in (t, u):
                check_row(x, b, tok, n, e0, SHORT_WIDTH)
                check_row(ig, b, tok, n, e0, SHORT_WIDTH)
            for i in (pa, pb, pc, la, lb):
                check_span(mine, i + e0, SHORT_WIDTH)
            v = vload_row_short(x, b, t, n, e0)
            vu = vload_row_short(x, b, u, n, e0)
            p = vload_short(mine, pa + e0)
            q = vload_short(mine, pb + e0)
            s = vload_short(mine, pc + e0)
            vstore_row(ig, b, t, n, e0, vmul_add(vmul_add(vzeros_short(), wa, p), wb, q))
            vstore_row(ig, b, u, n, e0, vmul_add(vmul_add(vzeros_short(), wa, q), wb, s))
            vstore(mine, la + e0, vmul_add(vmul_add(vload_short(mine, la + e0), p, v), q, vu))
            vstore(mine, lb + e0, vmul_add(vmul_add(vload_short(mine, lb + e0), q, v), s, vu))


def _backward_with(pair_tokens, name):
    """The backward's body, with ``pair_tokens`` for its token pairs: a body per
    kernel, each compiling only its own pair loop (both in one kernel, chosen at run
    time, cost a second of compile time)."""

    def backward_tile(g, x, wt, ig, partials, tiles, tile, stride, D, mine):
        """Both gradients in one pass over ``x``; a unit is one tile, all heads.

        ig[t, n] = sum over windows i covering t, in order, of wt[n, t - start_i] * g[i, n]
        (0 where no window covers t).

        partials[tile, n, j] = this tile's share of sum_i dot(g[i, n], x[start_i + j, n]):
        per element e, the products over the tile's tokens in order (``lanes[j, n, e]``),
        then those D sums folded by ``_fold_rows``.

        The tokens go in pairs of blocks of d (``stride``) tokens from a window start:
        tokens r and r + d are the only ones of the pair that add to the same lanes
        (r through window i, r + d through window i + 1, for each window i covering
        r), and r's term comes first in the token order. So when both are covered by two
        windows (the common case l <= 2d, away from sequence and tile edges), one pass
        over D does both: it reads three gradient rows instead of four and each lane
        once instead of twice, with the same sums in the same order. Other tokens go
        one at a time (``_backward_token``).

        Gradient rows are decoded into a ring of ceil(l / d) + 1 slots as their windows
        open. This is tile ``tile``; ``mine`` is the calling thread's scratch row
        (``backward_scratch_elements``).
        The pairs go through ``pair_tokens``: ``_pair_tokens``, or in
        ``compress_backward_simd`` ``_pair_tokens_vector`` (``_ops.dispatch.backward_vector``
        says when it can).
        """
        N = wt.shape[0]
        block = wt.shape[1]
        ring_size = ring_slots(block, stride) + 1
        b = tiles[tile, BATCH]
        s0 = tiles[tile, S0]
        rel = tiles[tile, TOK_LO] - s0
        rel_hi = tiles[tile, TOK_HI] - s0
        first = tiles[tile, G0]             # windows first..last touch the owned tokens
        last = tiles[tile, G1] - 1
        row0 = tiles[tile, KW0]
        at = ring_size * N * D
        gring = mine[:at].reshape((ring_size, N, D))
        lanes = mine[at:at + block * N * D].reshape((block, N, D))
        lanes_at = at
        at += block * N * D
        xf = mine[at:at + D]
        ia = mine[at + D:at + 2 * D]
        lanes[:] = 0
        zero = lanes.dtype.type(0)
        next_window = first         # the next window to decode into the ring
        while rel < rel_hi:         # rel: a window start (or the sequence start)
            end = min(rel + 2 * stride, rel_hi)
            newest = min(last, (end - 1) // stride)
            while next_window <= newest:
                slot = next_window % ring_size
                for n in range(N):
                    for e in range(D):
                        gring[slot, n, e] = widen(g[b, row0 + next_window, n, e])
                next_window += 1
            for r in range(rel, min(rel + stride, end)):
                t = s0 + r
                u = r + stride
                lo, hi = _covering(r, block, stride, first, last)
                lo_u, hi_u = _covering(u, block, stride, first, last)
                if u < end and lo + 1 == hi and lo_u == hi and hi_u == hi + 1:
                    pair_tokens(x, wt, ig, gring, lanes, mine, lanes_at, b, t,
                                r - lo * stride, lo % ring_size, hi % ring_size,
                                hi_u % ring_size, stride, D)
                else:
                    # r, then r + d if the tile has it; a loop rather than two calls, as
                    # the helper is inlined (two copies cost seconds of compile time)
                    for rr in range(r, end, stride):
                        lo_r, hi_r = _covering(rr, block, stride, first, last)
                        _backward_token(x, wt, ig, gring, lanes, xf, ia, b, s0 + rr, rr, lo_r,
                                        hi_r, stride, D)
            rel = end
        _fold_rows(lanes)
        for n in range(N):
            for j in range(block):
                partials[tile, n, j] = zero + lanes[j, n, 0] if D > 0 else zero

    backward_tile.__name__ = backward_tile.__qualname__ = name     # its own cache entry
    return jit(backward_tile)


_backward_tile = _backward_with(_pair_tokens, "_backward_tile")
_backward_tile_simd = _backward_with(_pair_tokens_vector, "_backward_tile_simd")


@jit
def _fold_rows(rows):
    """Sum each row of ``rows[..., :D]`` into element 0 in a fixed, vectorisable order.

    Halving: the upper half of the live width is added onto the lower half (the
    middle element of an odd width waits a round), until one element is left.
    """
    width = rows.shape[-1]
    while width > 1:
        half = width // 2
        keep = width - half
        for a in range(rows.shape[0]):
            for b in range(rows.shape[1]):
                for e in range(half):
                    rows[a, b, e] += rows[a, b, keep + e]
        width = keep


@jit
def reduce_weight_grad(partials, wg):
    """wg[j, n] = sum over tiles, in tile order, of partials[tile, n, j]; uses partials[0]."""
    n_tiles, N, block = partials.shape
    for j in range(block):
        for n in range(N):
            if n_tiles == 0:
                wg[j, n] = narrow(partials.dtype.type(0), wg)
                continue
            for tile in range(1, n_tiles):
                partials[0, n, j] += partials[tile, n, j]
            wg[j, n] = narrow(partials[0, n, j], wg)


# -- the training kernels ----------------------------------------------------------
# What the dispatcher launches: one compiled function per kernel, which both a
# first call and a prepared call that comes again (``_ops.dispatch.Prepared``) run, so
# each compiles once per dtype and layout. A first call passes the caller's arrays
# in their storage dtype and own shape where they are C-contiguous (as a prepared
# call always does), else ``[B, S, N, D]`` storage views; ``dims`` holds the
# ``[B, S, N, D]`` of each array a kernel reshapes (``_as_rows``). With ``check``,
# as a prepared call asks, a kernel first checks that the outputs share no byte
# with the inputs and returns False, writing nothing, when they may (the caller then
# goes the full path, which says why); a first call has checked that already and
# passes False. Each runs its per-tile function above over the tiles (the register
# forward's body, with its own tile loop, is inlined instead).

def _as_rows(a, dims, i):
    """``a`` as the kernels' ``[B, S, N, D]``: as it is when it has four axes (a
    storage view, any strides), else a C-contiguous ``a`` reshaped to ``dims[i]``."""
    return a if a.ndim == 4 else a.reshape(tuple(int(d) for d in dims[i]))


@overload(_as_rows, inline="always", jit_options=OVERLOAD_OPTIONS)
def _as_rows_typed(a, dims, i):
    if a.ndim == 4:
        return lambda a, dims, i: a
    return lambda a, dims, i: a.reshape((dims[i, 0], dims[i, 1], dims[i, 2], dims[i, 3]))


@jit(inline="always")
def _apart(a, b):
    """Whether C-contiguous arrays ``a`` and ``b`` share no byte (their extents)."""
    start_a = a.ctypes.data
    start_b = b.ctypes.data
    return (a.size == 0 or b.size == 0 or start_a + a.size * a.itemsize <= start_b
            or start_b + b.size * b.itemsize <= start_a)


@jit(inline="always")
def _forward_apart(x, w, out):
    """Whether the forward's output shares no byte with its inputs."""
    return _apart(out, x) and _apart(out, w)


@jit
def compress_forward(work, slot, x, w, out, rows, dims, tiles, stride, D, check):
    """The forward, GROUP tokens per pass over D (``_forward_grouped``); see above."""
    if check and not _forward_apart(x, w, out):
        return False
    x4, out4, wt = _as_rows(x, dims, 0), _as_rows(out, dims, 1), weight_table(w)
    unit, end = claim(work, tiles.shape[0])
    while unit < end:
        _forward_grouped(x4, wt, out4, tiles, unit, stride, D, rows[slot])
        unit, end = next_unit(work, unit, end, tiles.shape[0])
    return True


@jit
def compress_forward_rows(work, slot, x, w, out, rows, dims, tiles, stride, D, check):
    """The forward, one token per pass over D (``_forward_rows``); see above."""
    if check and not _forward_apart(x, w, out):
        return False
    x4, out4, wt = _as_rows(x, dims, 0), _as_rows(out, dims, 1), weight_table(w)
    unit, end = claim(work, tiles.shape[0])
    while unit < end:
        _forward_rows(x4, wt, out4, tiles, unit, stride, D, rows[slot])
        unit, end = next_unit(work, unit, end, tiles.shape[0])
    return True


@jit
def compress_forward_simd(work, slot, x, w, out, rows, dims, tiles, stride, D, check):
    """The forward, window sums in registers (``_forward_simd``); see above."""
    if check and not _forward_apart(x, w, out):
        return False
    _forward_simd(work, slot, _as_rows(x, dims, 0), w, _as_rows(out, dims, 1), tiles, stride,
                  D, rows)
    return True


@jit(inline="always")
def _backward_apart(g, x, w, ig, wg):
    """Whether the backward's outputs share no byte with its inputs or each other."""
    return (_apart(ig, g) and _apart(ig, x) and _apart(ig, w) and _apart(wg, g)
            and _apart(wg, x) and _apart(wg, w) and _apart(wg, ig))


@jit(inline="always")
def _backward_views(g, x, w, ig, dims):
    """(g, x, input_grad as ``[B, S, N, D]``, the weight table)."""
    return _as_rows(g, dims, 0), _as_rows(x, dims, 1), _as_rows(ig, dims, 2), weight_table(w)


# The two backward kernels are written out: a closure over its tile function, made
# by a factory as the tile functions are, would compile again in every process
# (Numba cannot match a closure over a compiled function to its cache entry), and
# unlike the tile functions the kernels are what a process loads from the cache.

@jit
def compress_backward(work, slot, g, x, w, ig, wg, partials, rows, dims, tiles, stride, D,
                      check):
    """Both gradients' tiles (``_backward_tile``), the weight gradient's partial sums
    in ``partials``, then ``reduce_weight_grad`` (see above): at the end of the call
    that ran every tile (``work[2] == ALONE``), else in a call of its own with ``slot``
    FINISH once the launch's threads are done (``_core.launch.run``)."""
    if slot == FINISH:
        reduce_weight_grad(partials, wg)
        return True
    if check and not _backward_apart(g, x, w, ig, wg):
        return False
    g4, x4, ig4, wt = _backward_views(g, x, w, ig, dims)
    unit, end = claim(work, tiles.shape[0])
    while unit < end:
        _backward_tile(g4, x4, wt, ig4, partials, tiles, unit, stride, D, rows[slot])
        unit, end = next_unit(work, unit, end, tiles.shape[0])
    if work[2] == ALONE:
        reduce_weight_grad(partials, wg)
    return True


@jit
def compress_backward_simd(work, slot, g, x, w, ig, wg, partials, rows, dims, tiles, stride,
                           D, check):
    """``compress_backward`` with the token pairs in ``_kernels.simd`` vectors."""
    if slot == FINISH:
        reduce_weight_grad(partials, wg)
        return True
    if check and not _backward_apart(g, x, w, ig, wg):
        return False
    g4, x4, ig4, wt = _backward_views(g, x, w, ig, dims)
    unit, end = claim(work, tiles.shape[0])
    while unit < end:
        _backward_tile_simd(g4, x4, wt, ig4, partials, tiles, unit, stride, D, rows[slot])
        unit, end = next_unit(work, unit, end, tiles.shape[0])
    if work[2] == ALONE:
        reduce_weight_grad(partials, wg)
    return True


@jit
def _infer_writer(x, wt, cache, slots, source, D, i, row):
    """Writer i of compress_infer, its ``[N, D]`` sums in scratch ``row``."""
    N = wt.shape[0]
    block = wt.shape[1]
    acc = row[:N * D].reshape((N, D))
    zero = acc.dtype.type(0)
    for n in range(N):
        for e in range(D):
            acc[n, e] = zero
    for j in range(0, block - GROUP + 1, GROUP):
        p0, r0 = source[i, j, 0], source[i, j, 1]
        p1, r1 = source[i, j + 1, 0], source[i, j + 1, 1]
        p2, r2 = source[i, j + 2, 0], source[i, j + 2, 1]
        p3, r3 = source[i, j + 3, 0], source[i, j + 3, 1]
        for n in range(N):
            a0, a1, a2, a3 = wt[n, j], wt[n, j + 1], wt[n, j + 2], wt[n, j + 3]
            for e in range(D):
                acc[n, e] = ((((acc[n, e] + a0 * widen(x[p0, r0, n, e]))
                               + a1 * widen(x[p1, r1, n, e]))
                              + a2 * widen(x[p2, r2, n, e]))
                             + a3 * widen(x[p3, r3, n, e]))
    for j in range(block - block % GROUP, block):
        page = source[i, j, 0]
        tok = source[i, j, 1]
        for n in range(N):
            w = wt[n, j]
            for e in range(D):
                acc[n, e] += w * widen(x[page, tok, n, e])
    slot = slots[i]
    for n in range(N):
        for e in range(D):
            cache[0, slot, n, e] = narrow(acc[n, e], cache)


@jit
def compress_infer(work, slot, x, w, cache, slots, source, D, scratch):
    """cache[0, slots[i], n] = sum_j wt[n, j] * x[page, row, n] over the (page, row) pairs
    ``source[i, j]`` of writer i's window, j in order: the with-cache operator
    (``_ops.infer``). A unit is one writer, all heads: it reads its window's token rows
    in full, GROUP at a time, into ``[N, D]`` sums in its thread's scratch row,
    starting from +0 as the training forward's do and adding one token at a time in
    window order, so a window gives the same bits here as there.
    """
    wt = weight_table(w)
    unit, end = claim(work, slots.shape[0])
    while unit < end:
        _infer_writer(x, wt, cache, slots, source, D, unit, scratch[slot])
        unit, end = next_unit(work, unit, end, slots.shape[0])
