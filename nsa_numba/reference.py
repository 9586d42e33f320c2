"""A plain float64 NumPy reference, independent of the kernels and the planner.

Written from the operator's definition alone (a Python loop over windows), for the
tests, the demo and anyone who wants to check results. It assumes valid arguments.
"""

import ml_dtypes
import numpy as np


def sequence_starts_and_lengths(T, actual_seq_len=None, actual_seq_len_type=0):
    """(start, length) of each packed sequence."""
    if actual_seq_len is None:
        return [(0, T)]
    values = [int(v) for v in actual_seq_len]
    if actual_seq_len_type == 1:
        lengths = values
    else:
        lengths = [b - a for a, b in zip([0] + values[:-1], values)]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(int)
    return list(zip(starts.tolist(), lengths))


def window_starts(T, block, stride, actual_seq_len=None, actual_seq_len_type=0):
    """Token index where each output window starts, in output order."""
    starts = []
    for s, length in sequence_starts_and_lengths(T, actual_seq_len, actual_seq_len_type):
        pos = 0
        while pos + block <= length:
            starts.append(s + pos)
            pos += stride
    return np.array(starts, dtype=np.int64)


def compress(x, w, block, stride, actual_seq_len=None, actual_seq_len_type=0):
    """Forward in float64: returns ``[T', N, D]``."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    starts = window_starts(x.shape[0], block, stride, actual_seq_len, actual_seq_len_type)
    out = np.zeros((starts.size,) + x.shape[1:])
    for k, s in enumerate(starts):
        out[k] = np.einsum("jn,jnd->nd", w, x[s:s + block])
    return out


def compress_grad(g, x, w, block, stride, actual_seq_len=None, actual_seq_len_type=0):
    """Backward in float64: returns ``(input_grad [T, N, D], weight_grad [l, N])``."""
    g = np.asarray(g, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    starts = window_starts(x.shape[0], block, stride, actual_seq_len, actual_seq_len_type)
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    for k, s in enumerate(starts):
        dx[s:s + block] += w[:, :, None] * g[k][None]
        dw += np.einsum("nd,jnd->jn", g[k], x[s:s + block])
    return dx, dw


def sequence_tokens(input, b, lengths, page_block_size, block_table=None):
    """Sequence ``b``'s tokens ``[s, N, D]`` in float64: gathered page by page through
    ``block_table`` from a paged input, or sliced from a packed one (TND)."""
    x = np.asarray(input, np.float64)
    s = int(lengths[b])
    if block_table is None:
        start = int(sum(int(v) for v in lengths[:b]))
        return x[start:start + s]
    rows = [x[int(block_table[b][p // page_block_size]), p % page_block_size] for p in range(s)]
    return np.array(rows).reshape((s,) + x.shape[2:])


def compress_infer(input, weight, slot_mapping, block, stride, page_block_size, lengths,
                   cache, block_table=None):
    """The with-cache operator in float64: a copy of ``cache`` (as float64) with the
    writing sequences' rows replaced, in sequence order (a later writer of the same
    row wins), and the rows written."""
    out = np.array(cache, np.float64)
    w = np.asarray(weight, np.float64)
    written = []
    for b, s in enumerate(int(v) for v in lengths):
        if s >= block and (s - block) % stride == 0:
            tokens = sequence_tokens(input, b, lengths, page_block_size, block_table)
            out[int(slot_mapping[b])] = np.einsum("jn,jnd->nd", w, tokens[s - block:s])
            written.append(int(slot_mapping[b]))
    return out, sorted(set(written))


def abs_terms_forward(x, w, block, stride, actual_seq_len=None, actual_seq_len_type=0):
    """sum_j |w x| per output element: scales the float32 accumulation error bound."""
    return compress(np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64)),
                    block, stride, actual_seq_len, actual_seq_len_type)


def abs_terms_grad(g, x, w, block, stride, actual_seq_len=None, actual_seq_len_type=0):
    """The same for the two gradients."""
    return compress_grad(np.abs(np.asarray(g, np.float64)), np.abs(np.asarray(x, np.float64)),
                         np.abs(np.asarray(w, np.float64)), block, stride, actual_seq_len,
                         actual_seq_len_type)


def ulp(values, dtype):
    """Spacing of ``dtype`` at ``|values|`` (float64 array), subnormals included."""
    info = ml_dtypes.finfo(dtype)
    tiny = float(info.smallest_normal)
    mant = info.nmant
    mag = np.maximum(np.abs(np.asarray(values, np.float64)), tiny)
    exponent = np.floor(np.log2(mag))
    return np.ldexp(1.0, (exponent - mant).astype(int))


def ulp_error(result, exact, dtype):
    """|result - exact| in ulps of ``dtype`` at the exact value (NaN-aware: both NaN = 0)."""
    r = np.asarray(result, np.float64)
    e = np.asarray(exact, np.float64)
    with np.errstate(invalid="ignore"):
        err = np.abs(r - e) / ulp(e, dtype)
    both_nan = np.isnan(r) & np.isnan(e)
    same_inf = np.isinf(r) & (r == e)
    return np.where(both_nan | same_inf, 0.0, err)


def accumulation_bound(abs_terms, depth, accumulator=np.float32):
    """Worst-case error of summing in ``accumulator`` along chains of ``depth`` roundings.

    The classic bound gamma_n * sum|terms|, gamma_n = n u / (1 - n u), u = eps / 2.
    """
    u = float(ml_dtypes.finfo(accumulator).eps) / 2
    gamma = depth * u / (1 - depth * u)
    return gamma * np.asarray(abs_terms, np.float64)


def check_accuracy(result, exact, abs_terms, dtype, depth, accumulator=np.float32):
    """Compare a result with the float64 reference.

    The promise: every element lies within 1 ulp (of ``dtype``) of the exact value
    plus the float32 accumulation bound. Returns a dict with ``max_ulp`` (largest
    plain error in ulps), ``max_excess_ulp`` (largest error beyond the accumulation
    bound, in ulps: the promise is that it is <= 1) and ``ok``.
    """
    r = np.asarray(result, np.float64)
    e = np.asarray(exact, np.float64)
    bound = accumulation_bound(abs_terms, depth, accumulator)
    with np.errstate(invalid="ignore"):
        excess = np.maximum(np.abs(r - e) - bound, 0.0) / ulp(np.abs(e) + bound, dtype)
    same = (np.isnan(r) & np.isnan(e)) | (np.isinf(r) & (r == e))
    excess = np.where(same, 0.0, excess)
    plain = ulp_error(r, e, dtype)
    return {
        "max_ulp": float(np.max(plain, initial=0.0)),
        "max_excess_ulp": float(np.max(excess, initial=0.0)),
        "ok": bool(np.all(excess <= 1.0)),
    }


def depths(T_windows, D, block, stride, n_sequences):
    """Rounding-chain lengths of the kernels' sums: forward, input_grad, weight_grad.

    A float32 input adds one rounding per product; the weight gradient sums per
    element over windows, then over D, then over tiles (at most T' + sequences).
    """
    forward = block + 1
    input_grad = -(-block // stride) + 1
    weight_grad = 2 * T_windows + D + n_sequences + 2
    return forward, input_grad, weight_grad
