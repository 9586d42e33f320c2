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


#: the score a masked key gets: the NPU replaces it with -FLT_MAX (float32), never
#: -inf, so a fully masked row has equal scores and attends to its keys uniformly
MASKED_SCORE = -float(np.finfo(np.float32).max)


def _sequence_bounds(total, ends):
    """(start, end) of each sequence from prefix sums without a leading 0 (the
    attention operators' ``actual_seq_qlen`` / ``actual_seq_kvlen``); one sequence
    of ``total`` rows when None."""
    if ends is None:
        return [(0, total)]
    ends = [int(e) for e in ends]
    return list(zip([0] + ends[:-1], ends))


def _selected_rows(t, s, kv_start, j, topk, block, count, causal):
    """The key rows query token ``t`` (position ``s`` of its sequence) reads for KV
    head ``j``, in list order (a repeated block twice), and which are masked: with
    ``causal``, a block after the query's own (``s // block``) is masked whole and in
    the query's own block the keys after position ``s``."""
    rows, masked = [], []
    for idx in (int(i) for i in topk[t, j, :count]):
        for r in range(block):
            rows.append(kv_start + idx * block + r)
            masked.append(causal and idx * block + r > s)
    return np.array(rows, np.int64), np.array(masked, bool)


def _score_rows(q, k, topk, scale, block, count, causal, actual_seq_qlen, actual_seq_kvlen):
    """For each query token t and head h, in order: ``(t, h, j, rows, masked, scores)``,
    the KV head, the key rows read (``_selected_rows``), which are masked, and the
    scaled scores with the masked ones replaced by ``MASKED_SCORE``."""
    group = q.shape[1] // k.shape[1]
    kv_bounds = _sequence_bounds(k.shape[0], actual_seq_kvlen)
    for b, (q0, q1) in enumerate(_sequence_bounds(q.shape[0], actual_seq_qlen)):
        for t in range(q0, q1):
            for h in range(q.shape[1]):
                j = h // group
                rows, masked = _selected_rows(t, t - q0, kv_bounds[b][0], j, topk, block,
                                              count, causal)
                scores = np.where(masked, MASKED_SCORE, scale * (k[rows, j] @ q[t, h]))
                yield t, h, j, rows, masked, scores


def select_attention(query, key, value, topk_indices, scale, head_num, block, count,
                     causal=False, actual_seq_qlen=None, actual_seq_kvlen=None):
    """Selected attention (``npu_nsa_select_attention``, layout TND) in float64:
    ``(out [T1, N1, Dv], softmax_max [T1, N1], softmax_sum [T1, N1])``.

    Query token t of sequence b, head h, reads KV head j = h // G (G = N1 / N2): the
    ``block`` rows from ``kv_start_b + idx * block`` of ``key`` and ``value`` for each
    ``idx`` of ``topk_indices[t, j, :count]``, in list order. Scores are ``scale *
    <q, k>``, a masked one replaced by ``MASKED_SCORE`` (``causal``: the mask the NPU
    derives from the indices when ``atten_mask`` is given); softmax_max is the row's
    largest score and softmax_sum ``sum exp(score - max)`` (not a log-sum-exp)."""
    q = np.asarray(query, np.float64)
    k = np.asarray(key, np.float64)
    v = np.asarray(value, np.float64)
    out = np.zeros(q.shape[:2] + v.shape[2:])
    row_max = np.zeros(q.shape[:2])
    row_sum = np.zeros(q.shape[:2])
    for t, h, j, rows, _, scores in _score_rows(q, k, topk_indices, scale, block, count,
                                                causal, actual_seq_qlen, actual_seq_kvlen):
        row_max[t, h] = scores.max()
        e = np.exp(scores - row_max[t, h])
        row_sum[t, h] = e.sum()
        out[t, h] = (e / row_sum[t, h]) @ v[rows, j]
    return out, row_max, row_sum


def select_attention_grad(grad, query, key, value, topk_indices, scale, head_num, block,
                          count, causal=False, actual_seq_qlen=None, actual_seq_kvlen=None):
    """The exact gradient of ``select_attention`` as called, in float64: ``(dq, dk,
    dv)`` for the output gradient ``grad``. A masked score is a constant, so it passes
    no gradient to q or k; a fully masked row's uniform weights give ``dv += grad /
    K`` on each of its K keys and nothing else. A key selected twice gets both
    terms; keys no query selects get 0."""
    q = np.asarray(query, np.float64)
    k = np.asarray(key, np.float64)
    v = np.asarray(value, np.float64)
    g = np.asarray(grad, np.float64)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for t, h, j, rows, masked, scores in _score_rows(q, k, topk_indices, scale, block, count,
                                                     causal, actual_seq_qlen,
                                                     actual_seq_kvlen):
        e = np.exp(scores - scores.max())
        p = e / e.sum()
        dp = v[rows, j] @ g[t, h]
        ds = np.where(masked, 0.0, p * (dp - p @ dp))
        dq[t, h] = scale * (ds @ k[rows, j])
        np.add.at(dk[:, j], rows, scale * ds[:, None] * q[t, h])
        np.add.at(dv[:, j], rows, p[:, None] * g[t, h])
    return dq, dk, dv


def importance_weights(compressed, block, stride, select_block):
    """``[blocks, compressed]`` float64: the weight compressed token ``k`` gives block
    ``b'`` of raw keys in compressed attention's importance score (the NPU's rule,
    docs/reference.md): tokens ``m (b' + 1) - i`` for ``i = 0 .. m + n - 2`` with weight
    ``min(i + 1, n, m + n - 1 - i)`` (``m = l' / d``, ``n = l / d``; tokens outside
    ``[0, compressed)`` left out). ``blocks = ceil(compressed / m)``."""
    m, n = select_block // stride, block // stride
    blocks = -(-compressed // m)
    weights = np.zeros((blocks, compressed))
    for b in range(blocks):
        for i in range(m + n - 1):
            token = m * (b + 1) - i
            if 0 <= token < compressed:
                weights[b, token] += min(i + 1, n, m + n - 1 - i)
    return weights


def compress_attention(query, key, value, scale, head_num, block, stride, select_block,
                       count, topk_mask=None, atten_mask=None, actual_seq_qlen=None,
                       actual_cmp_seq_kvlen=None, actual_sel_seq_kvlen=None):
    """Compressed attention with top-k block selection (``npu_nsa_compress_attention``,
    layout TND) in float64: ``(out [T1, N1, Dv], topk [T1, N2, count] int32, max [T1,
    N1], sum [T1, N1], score [T1, N2, blocks])``.

    Query token t (position s of sequence b), head h, attends over the compressed keys
    of its sequence, KV head j = h // G; a key k with ``atten_mask[s, k]`` (the mask's
    top-left corner for each sequence) scores ``MASKED_SCORE``. The importance of raw
    key block b' for KV head j sums the group's attention weights through
    ``importance_weights``; ``topk_mask[s, b']`` forces the block (+inf). The indices
    are the stable descending order (forced blocks first, ascending; ties to the lower
    block) cut at ``count``; ``score`` is returned for tests of ties, with ``-inf``
    past a sequence's ``blocks`` (``actual_sel_seq_kvlen``; by default ceil(Tc / m))."""
    q = np.asarray(query, np.float64)
    k = np.asarray(key, np.float64)
    v = np.asarray(value, np.float64)
    T1, N1, _ = q.shape
    N2 = k.shape[1]
    group = N1 // N2
    m = select_block // stride
    q_bounds = _sequence_bounds(T1, actual_seq_qlen)
    kv_bounds = _sequence_bounds(k.shape[0], actual_cmp_seq_kvlen)
    sel = [-(-(e - s) // m) for s, e in kv_bounds] if actual_sel_seq_kvlen is None else \
        [e - s for s, e in _sequence_bounds(None, actual_sel_seq_kvlen)]
    width = max(sel + [0])
    out = np.zeros((T1, N1, v.shape[2]))
    row_max = np.zeros((T1, N1))
    row_sum = np.zeros((T1, N1))
    score = np.full((T1, N2, width), -np.inf)
    topk = np.zeros((T1, N2, count), np.int32)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(q_bounds, kv_bounds)):
        weights = importance_weights(k1 - k0, block, stride, select_block)[:sel[b]]
        for t in range(q0, q1):
            s = t - q0
            masked = np.zeros(k1 - k0, bool) if atten_mask is None else \
                np.asarray(atten_mask)[s, :k1 - k0].astype(bool)
            for j in range(N2):
                total = np.zeros(sel[b])
                for h in range(j * group, (j + 1) * group):
                    scores = np.where(masked, MASKED_SCORE, scale * (k[k0:k1, j] @ q[t, h]))
                    row_max[t, h] = scores.max()
                    e = np.exp(scores - row_max[t, h])
                    row_sum[t, h] = e.sum()
                    p = e / row_sum[t, h]
                    out[t, h] = p @ v[k0:k1, j]
                    total += weights @ p
                if topk_mask is not None:
                    forced = np.asarray(topk_mask)[s, :sel[b]].astype(bool)
                    total = np.where(forced, np.inf, total)
                score[t, j, :sel[b]] = total
                topk[t, j] = np.argsort(-score[t, j], kind="stable")[:count]
    return out, topk, row_max, row_sum, score


def attention_grad(grad, query, key, value, scale, atten_mask=None, actual_seq_qlen=None,
                   actual_seq_kvlen=None):
    """The exact gradient of attention over each sequence's keys (compressed attention's
    backward, which the NPU runs as its generic fusion-attention gradient), masked by
    replacement as ``compress_attention`` masks: ``(dq, dk, dv)`` in float64. A masked
    score is a constant: no gradient to q or k; a fully masked row's uniform weights
    give each of its keys ``dv += grad / K``."""
    q = np.asarray(query, np.float64)
    k = np.asarray(key, np.float64)
    v = np.asarray(value, np.float64)
    g = np.asarray(grad, np.float64)
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    q_bounds = _sequence_bounds(q.shape[0], actual_seq_qlen)
    kv_bounds = _sequence_bounds(k.shape[0], actual_seq_kvlen)
    for (q0, q1), (k0, k1) in zip(q_bounds, kv_bounds):
        for t in range(q0, q1):
            masked = np.zeros(k1 - k0, bool) if atten_mask is None else \
                np.asarray(atten_mask)[t - q0, :k1 - k0].astype(bool)
            for h in range(q.shape[1]):
                j = h // group
                scores = np.where(masked, MASKED_SCORE, scale * (k[k0:k1, j] @ q[t, h]))
                e = np.exp(scores - scores.max())
                p = e / e.sum()
                dp = v[k0:k1, j] @ g[t, h]
                ds = np.where(masked, 0.0, p * (dp - p @ dp))
                dq[t, h] = scale * (ds @ k[k0:k1, j])
                dk[k0:k1, j] += scale * ds[:, None] * q[t, h]
                dv[k0:k1, j] += p[:, None] * g[t, h]
    return dq, dk, dv


def _rows_of(x, layout, heads):
    """An operator array of ``layout`` as float64 ``[B, S, N, X]``."""
    x = np.asarray(x, np.float64)
    if layout == "TND":
        return x[None]
    if layout == "BNSD":
        return x.transpose(0, 2, 1, 3)
    if layout == "BSH":
        return x.reshape(x.shape[0], x.shape[1], heads, -1)
    if layout == "SBH":
        return x.transpose(1, 0, 2).reshape(x.shape[1], x.shape[0], heads, -1)
    return x


def _layout_of(y, layout):
    """``_rows_of``'s inverse."""
    B, S, N, X = y.shape
    if layout == "TND":
        return y[0]
    if layout == "BNSD":
        return y.transpose(0, 2, 1, 3)
    if layout == "BSH":
        return y.reshape(B, S, N * X)
    if layout == "SBH":
        return y.reshape(B, S, N * X).transpose(1, 0, 2)
    return y


def fusion_visibility(sparse_mode, Sq, Skv, pre_tockens, next_tockens, masked):
    """``(visible, admitted)`` ``[Sq, Skv]`` booleans of one sequence and head of fusion
    attention: the keys a row sees, and those its band admits (over which a row whose
    keys the mask hides all takes equal weights). ``masked``: the mask's ``[Sq, Skv]``
    block (True = masked), or None for no mask (every key visible)."""
    if masked is None:
        every = np.ones((Sq, Skv), bool)
        return every, every
    i = np.arange(Sq)[:, None]
    j = np.arange(Skv)[None, :]
    off = Skv - Sq
    if sparse_mode == 0:
        band = (j >= i - pre_tockens) & (j <= i + next_tockens)
        return band & ~masked, band
    if sparse_mode == 1:
        return ~masked, np.ones((Sq, Skv), bool)
    band = {2: j <= i, 3: j <= i + off,
            4: (j >= i + off - pre_tockens) & (j <= i + off + next_tockens)}[sparse_mode]
    band = np.broadcast_to(band, (Sq, Skv))
    return band, band


def _fusion_blocks(q, k, layout, atten_mask, actual_seq_qlen, actual_seq_kvlen,
                   sparse_mode):
    """Per sequence ``(a, q0, q1, k0, k1, masks)``: its rows of the ``[B, S, N, X]``
    arrays and a function of the head giving its mask block (None: no mask)."""
    B, N1 = q.shape[0], q.shape[2]
    if atten_mask is not None and sparse_mode >= 2:     # the mode's band, not the mask
        atten_mask = np.zeros((q.shape[1], k.shape[1]), bool)
        if layout != "TND":
            atten_mask = atten_mask[None, None]
    if layout == "TND":
        qs, ks = [int(x) for x in actual_seq_qlen], [int(x) for x in actual_seq_kvlen]
        while len(qs) > 1 and qs[-1] == 0 and ks[-1] == 0:     # dropped batches
            qs, ks = qs[:-1], ks[:-1]
        qb = _sequence_bounds(q.shape[1], qs)
        kb = _sequence_bounds(k.shape[1], ks)
        most = (max(b - a for a, b in qb), max(b - a for a, b in kb))
        m = None if atten_mask is None else np.asarray(atten_mask).astype(bool)
        for (q0, q1), (k0, k1) in zip(qb, kb):
            if m is None:
                block = None
            elif m.shape == most or sparse_mode >= 2:
                block = m[:q1 - q0, :k1 - k0]
            else:
                block = m[q0:q1, k0:k1]
            yield 0, q0, q1, k0, k1, (lambda h, block=block: block)
        return
    Sq, Skv = q.shape[1], k.shape[1]
    m = None
    if atten_mask is not None:
        m = np.asarray(atten_mask).astype(bool)
        m = np.broadcast_to(m if m.ndim == 4 else m[None, None], (B, N1, Sq, Skv))
    for a in range(B):
        yield a, 0, Sq, 0, Skv, (lambda h, a=a: None if m is None else m[a, h])


def _fusion_rows(query, key, value, head_num, input_layout, atten_mask, scale, pre_tockens,
                 next_tockens, inner_precise, actual_seq_qlen, actual_seq_kvlen, sparse_mode):
    """For each sequence and query head: ``(a, q0, k0, h, j, P, rows, uniform)``, P the
    float64 weights ``[Sq, Skv]``, ``rows`` the states (0 sees keys, 1 equal weights,
    2 none) and the layout's arrays as ``[B, S, N, X]``."""
    layout = input_layout.upper()
    q = _rows_of(query, layout, head_num)
    k = _rows_of(key, layout, None if layout not in ("BSH", "SBH") else
                 np.asarray(key).shape[2] // q.shape[3])
    v = _rows_of(value, layout, k.shape[2])
    group = q.shape[2] // k.shape[2]
    out = []
    for a, q0, q1, k0, k1, masks in _fusion_blocks(q, k, layout, atten_mask, actual_seq_qlen,
                                                   actual_seq_kvlen, sparse_mode):
        for h in range(q.shape[2]):
            j = h // group
            visible, admitted = fusion_visibility(sparse_mode, q1 - q0, k1 - k0, pre_tockens,
                                                  next_tockens, masks(h))
            s = scale * (q[a, q0:q1, h] @ k[a, k0:k1, j].T)
            s = np.where(visible, s, MASKED_SCORE)
            state = np.where(visible.any(1), 0, np.where(admitted.any(1), 1, 2))
            if inner_precise >= 2:
                state[state == 1] = 2
            top = np.where(state[:, None] == 0, s, -np.inf).max(1, initial=-np.inf)
            e = np.where(visible, np.exp(s - np.where(state == 0, top, 0)[:, None]), 0.0)
            e[state == 1] = admitted[state == 1]
            e[state == 2] = 0
            total = e.sum(1)
            p = e / np.where(total > 0, total, 1)[:, None]
            out.append((a, q0, k0, h, j, p, state, total, top))
    return q, k, v, out


def fusion_attention(query, key, value, head_num, input_layout, atten_mask=None, scale=1.0,
                     pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                     actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0):
    """torch_npu's ``npu_fusion_attention`` (modes 0 to 4) in float64: ``(out,
    softmax_max, softmax_sum)``, the output in the layout, the statistics ``[T1, N1]``
    (TND) or ``[B, N1, Sq]`` (one lane). A row whose keys the mask hides all: equal
    weights over the keys its band admits (max -FLT_MAX, sum their count), or with
    ``inner_precise`` 2 or 3 zeros; a row its band leaves no key: zeros, max
    -FLT_MAX, sum FLT_MAX."""
    q, k, v, rows = _fusion_rows(query, key, value, head_num, input_layout, atten_mask,
                                 scale, pre_tockens, next_tockens, inner_precise,
                                 actual_seq_qlen, actual_seq_kvlen, sparse_mode)
    B, S, N1 = q.shape[:3]
    out = np.zeros((B, S, N1, v.shape[3]))
    smax = np.zeros((B, S, N1))
    ssum = np.zeros((B, S, N1))
    biggest = float(np.finfo(np.float32).max)
    for a, q0, k0, h, j, p, state, total, top in rows:
        n = p.shape[0]
        out[a, q0:q0 + n, h] = p @ v[a, k0:k0 + p.shape[1], j]
        smax[a, q0:q0 + n, h] = np.where(state == 0, top, MASKED_SCORE)
        ssum[a, q0:q0 + n, h] = np.where(state == 2, biggest, total)
    layout = input_layout.upper()
    stats = (smax[0], ssum[0]) if layout == "TND" else (smax.transpose(0, 2, 1),
                                                         ssum.transpose(0, 2, 1))
    return (_layout_of(out, layout), *stats)


def fusion_attention_grad(dy, query, key, value, head_num, input_layout, atten_mask=None,
                          scale=1.0, pre_tockens=2147483647, next_tockens=2147483647,
                          inner_precise=0, actual_seq_qlen=None, actual_seq_kvlen=None,
                          sparse_mode=0):
    """The exact float64 gradient of :func:`fusion_attention`: ``(dq, dk, dv)`` in the
    layout. Masked scores are constants; a row of equal weights passes ``dy / count``
    to its values only; a row without keys passes nothing."""
    q, k, v, rows = _fusion_rows(query, key, value, head_num, input_layout, atten_mask,
                                 scale, pre_tockens, next_tockens, inner_precise,
                                 actual_seq_qlen, actual_seq_kvlen, sparse_mode)
    layout = input_layout.upper()
    g = _rows_of(dy, layout, q.shape[2])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for a, q0, k0, h, j, p, state, total, top in rows:
        n, m = p.shape
        kk, vv, gg = k[a, k0:k0 + m, j], v[a, k0:k0 + m, j], g[a, q0:q0 + n, h]
        dp = gg @ vv.T
        ds = p * (dp - (p * dp).sum(1, keepdims=True))
        ds[state != 0] = 0
        dq[a, q0:q0 + n, h] = scale * ds @ kk
        dk[a, k0:k0 + m, j] += scale * ds.T @ q[a, q0:q0 + n, h]
        dv[a, k0:k0 + m, j] += p.T @ gg
    return tuple(_layout_of(x, layout) for x in (dq, dk, dv))


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
