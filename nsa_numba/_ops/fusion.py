"""Fusion attention (torch_npu's ``npu_fusion_attention`` / ``_grad``, the NPU's
generic attention, which an NSA layer's sliding-window branch calls): rules and
planners. The arithmetic is dense attention's (``_ops.dense``, ``_kernels.attention``).

Per sequence (query row ``i`` of ``Sq``, key ``j`` of ``Skv``, ``off = Skv - Sq``)
the sparse mode says which keys a row sees:

====  ===============================================  =====================
mode  visible when                                      atten_mask
====  ===============================================  =====================
0     ``!M[i, j]`` and ``i - pre <= j <= i + next``     read
1     ``!M[i, j]``                                      read
2     ``j <= i``                                        2048 x 2048, not read
3     ``j <= i + off``                                  2048 x 2048, not read
4     ``i + off - pre <= j <= i + off + next``          2048 x 2048, not read
====  ===============================================  =====================

Without ``atten_mask`` every key is visible (the mode and the tockens are then
ignored, as on the NPU). A masked score is replaced by -FLT_MAX. A row whose keys
the mask hides all takes equal weights over the keys the band admits (out = their
mean value, softmax_max -FLT_MAX, softmax_sum their count), unless ``inner_precise``
is 2 or 3; a row the band leaves no key (or, with those, the mask hides entirely)
gets zeros, softmax_max -FLT_MAX and softmax_sum FLT_MAX. The gradient gives such
rows' queries nothing, and their values ``dy / count`` for equal weights.

Layouts TND (prefix-sum lengths), BSND, BNSD, BSH, SBH; softmax statistics
``[T1, N1, 8]`` token-major for TND, ``[B, N1, Sq, 8]`` otherwise, float32
(float64 for float64 inputs). Dropout, ``pse``, ``prefix``, ``padding_mask`` and
modes 5 to 8 raise NotImplementedError; everything invalid raises NsaError: 161001
for a required array that is None, 561002 for what the NPU's tiling rejects (strict
mode), 161002 for the rest.
"""

import numpy as np

from .._core.errors import invalid, missing, tiling
from .._kernels import attention as _attention
from . import seqlens as _seqlens
from .checks import Rules, check_array, check_int, check_no_overlap
from .dense import DensePlan, chunks, unbounded
from .select import STAT_LANES, _output, _scale, _starts, _stat_dtype

FORWARD_NAMES = {
    "query": "query", "key": "key", "value": "value", "head_num": "head_num",
    "layout": "input_layout", "pse": "pse", "padding_mask": "padding_mask",
    "atten_mask": "atten_mask", "scale": "scale", "keep_prob": "keep_prob",
    "pre": "pre_tockens", "next": "next_tockens", "inner_precise": "inner_precise",
    "prefix": "prefix", "seq_q": "actual_seq_qlen", "seq_kv": "actual_seq_kvlen",
    "sparse_mode": "sparse_mode", "softmax_layout": "softmax_layout",
    "attention_out": "attention_out", "softmax_max": "softmax_max",
    "softmax_sum": "softmax_sum", "strict": "strict",
}
GRAD_NAMES = dict(FORWARD_NAMES, scale="scale_value", grad="dy", attention_out="attention_in",
                  softmax_in="softmax_in", dq="dq", dk="dk", dv="dv")

LAYOUTS = ("TND", "BSND", "BNSD", "BSH", "SBH")
#: the modes computed; 5 to 8 (prefix and the band-compressed TND modes) are not
SPARSE_MODES = (0, 1, 2, 3, 4)
NOT_IMPLEMENTED_MODES = (5, 6, 7, 8)
#: the shape of the mask modes 2 to 4 take (its contents are the upper triangle)
COMPRESSED_MASK = 2048
#: the NPU's documented limits (strict mode)
MAX_HEADS = 256
MAX_DIM = 768
MAX_BATCH = 2 * 1024 * 1024
MAX_TND_BATCH = 2048
MAX_TOKENS = 1024 * 1024
#: the tockens' default: no bound
NO_BOUND = 2147483647


def fusion_rules(op, grad=False, **options):
    """The Rules of an entry point of fusion attention (forward, or ``grad``)."""
    options.setdefault("names", dict(GRAD_NAMES if grad else FORWARD_NAMES))
    return Rules(op, **options)


def _layout(rules, layout):
    name = rules.names["layout"]
    if not isinstance(layout, str):
        raise invalid(rules.op, f"{name} must be a str, one of {', '.join(LAYOUTS)}, got "
                                f"{layout!r} ({type(layout).__name__})")
    if layout.upper() not in LAYOUTS:
        raise invalid(rules.op, f"{name} must be one of {', '.join(LAYOUTS)} (any case), got "
                                f"{layout!r}")
    return layout.upper()


def _not_implemented(rules, pse, padding_mask, prefix, keep_prob, sparse_mode,
                     softmax_layout):
    """NotImplementedError for what the NPU computes and this library does not."""
    op, names = rules.op, rules.names
    for key, value in (("pse", pse), ("padding_mask", padding_mask), ("prefix", prefix)):
        if value is not None:
            raise NotImplementedError(f"{op}: {names[key]} is not supported (it must be None)")
    if 0 < keep_prob < 1:
        raise NotImplementedError(f"{op}: {names['keep_prob']} < 1 (dropout) is not supported, "
                                  f"got {keep_prob}")
    if sparse_mode in NOT_IMPLEMENTED_MODES:
        raise NotImplementedError(f"{op}: {names['sparse_mode']} {sparse_mode} (prefix and "
                                  f"compressed band modes) is not supported; modes 0 to 4 are")
    if softmax_layout not in ("", "TND"):
        raise NotImplementedError(f"{op}: {names['softmax_layout']} must be '' or 'TND' (both "
                                  f"write the statistics token-major), got {softmax_layout!r}")


def _keep_prob(rules, value):
    name = rules.names["keep_prob"]
    value = _seqlens.as_real(rules.op, name, value)
    if not 0 < value <= 1:
        raise invalid(rules.op, f"{name} must be in (0, 1], got {value}")
    return value


def _dims(rules, layout, query, key, value, head_num):
    """``(B, Sq, Skv, N1, N2, D, Dv)`` of the three arrays in ``layout``, checked."""
    op, names = rules.op, rules.names
    ndim = 4 if layout in ("BSND", "BNSD") else 3
    shape = {"TND": "[T, N, D]", "BSND": "[B, S, N, D]", "BNSD": "[B, N, S, D]",
             "BSH": "[B, S, H]", "SBH": "[S, B, H]"}[layout]
    arrays = [check_array(rules, k, a, ndim, shape) for k, a in
              (("query", query), ("key", key), ("value", value))]
    for k, a in zip(("key", "value"), arrays[1:]):
        if a.dtype != arrays[0].dtype:
            raise invalid(op, f"{names[k]} dtype must equal {names['query']} dtype "
                              f"{arrays[0].dtype}, got {a.dtype}")
    q, k, v = (a.shape for a in arrays)
    N1 = head_num
    if layout in ("BSH", "SBH"):
        s, b = (1, 0) if layout == "BSH" else (0, 1)
        B, Sq, Skv = q[b], q[s], k[s]
        if q[2] % N1:
            raise invalid(op, f"{names['query']} hidden size H = {q[2]} must be a multiple "
                              f"of {names['head_num']} = {N1}")
        D = q[2] // N1
        if k[2] % D or k[2] == 0:
            raise invalid(op, f"{names['key']} hidden size {k[2]} must be a positive multiple "
                              f"of the head dim D = {D} (H / {names['head_num']})")
        N2 = k[2] // D
        if v[2] % N2:
            raise invalid(op, f"{names['value']} hidden size {v[2]} must be a multiple of "
                              f"the key head count N2 = {N2}")
        Dv = v[2] // N2
        kb, vb, vs = k[b], v[b], v[s]
    else:
        if layout == "TND":
            (Sq, n1, D), (Skv, N2, dk), (vs, n2v, Dv) = q, k, v
            B = kb = vb = 1
        elif layout == "BSND":
            (B, Sq, n1, D), (kb, Skv, N2, dk), (vb, vs, n2v, Dv) = q, k, v
        else:
            (B, n1, Sq, D), (kb, N2, Skv, dk), (vb, n2v, vs, Dv) = q, k, v
        if n1 != N1:
            raise invalid(op, f"{names['head_num']} must equal the query's head count N1 = "
                              f"{n1} ({names['query']} {shape}), got {N1}")
        if dk != D:
            raise invalid(op, f"{names['key']} head dim must equal {names['query']}'s D = "
                              f"{D}, got shape {k}")
        if n2v != N2:
            raise invalid(op, f"{names['value']} head count must equal {names['key']}'s N2 = "
                              f"{N2}, got shape {v}")
    if (kb, vb) != (B, B):
        raise invalid(op, f"{names['key']} and {names['value']} must have {names['query']}'s "
                          f"batch size {B}, got shapes {k} and {v}")
    if vs != Skv:
        raise invalid(op, f"{names['value']} must have {names['key']}'s key count {Skv}, got "
                          f"shape {v}")
    if N2 < 1 or N1 % N2:
        raise invalid(op, f"the query head count N1 = {N1} must be a multiple of the key head "
                          f"count N2 = {N2}")
    if D < 1 or Dv < 1:
        raise invalid(op, f"head dims must be >= 1, got D = {D}, Dv = {Dv}")
    return arrays, (B, Sq, Skv, N1, N2, D, Dv)


def _tnd_ends(rules, key, values):
    """A TND length list (prefix sums without the leading 0) as int64, its trailing
    zeros (dropped batches) removed."""
    name, op = rules.names[key], rules.op
    if values is None:
        raise invalid(op, f"{name} is required with input_layout TND (prefix sums of the "
                          f"sequence lengths, without a leading 0)")
    ends = _seqlens.as_int_vector(op, name, values)
    if ends.size == 0:
        raise invalid(op, f"{name} must hold at least one sequence end, got none")
    n = ends.size
    while n > 1 and ends[n - 1] == 0:
        n -= 1
    return ends, ends[:n]


def _tnd_starts(rules, seq_q, seq_kv, T1, T2):
    op, names = rules.op, rules.names
    raw_q, ends_q = _tnd_ends(rules, "seq_q", seq_q)
    raw_kv, ends_kv = _tnd_ends(rules, "seq_kv", seq_kv)
    if raw_q.size != raw_kv.size:
        raise invalid(op, f"{names['seq_q']} and {names['seq_kv']} must have the same length, "
                          f"got {raw_q.size} and {raw_kv.size}")
    if ends_q.size != ends_kv.size:
        raise invalid(op, f"{names['seq_q']} and {names['seq_kv']} must drop the same trailing "
                          f"batches (trailing zeros), got {_seqlens._show(raw_q)} and "
                          f"{_seqlens._show(raw_kv)}")
    return _starts(rules, "seq_q", ends_q, T1), _starts(rules, "seq_kv", ends_kv, T2)


def _mask(rules, mask, layout, mode, B, N1, Sq, Skv, q_starts, kv_starts):
    """``(mask 2-D uint8, mstep, mask_heads, row/column bases [B, 2])`` for the kernels,
    the mask checked against the shapes the layout and mode accept."""
    op, name = rules.op, rules.names["atten_mask"]
    nb = q_starts.size - 1
    bases = np.zeros((nb, 2), np.int64)
    if not isinstance(mask, np.ndarray):
        raise invalid(op, f"{name} must be None or a numpy.ndarray of bool or uint8, got "
                          f"{type(mask).__name__}")
    if mask.dtype not in (np.bool_, np.uint8):
        raise invalid(op, f"{name} dtype must be bool or uint8, got {mask.dtype}")
    if mode >= 2:
        if mask.shape != (COMPRESSED_MASK, COMPRESSED_MASK):
            raise tiling(op, f"{name} must be the {COMPRESSED_MASK} x {COMPRESSED_MASK} upper "
                             f"triangle with {rules.names['sparse_mode']} {mode}, got shape "
                             f"{mask.shape}")
        return np.zeros((0, 0), np.uint8), 0, 1, bases
    if layout == "TND":
        most_q = int(np.diff(q_starts).max(initial=0))
        most_kv = int(np.diff(kv_starts).max(initial=0))
        if mask.shape == (most_q, most_kv):
            pass                                        # each batch its top-left corner
        elif mask.shape == (int(q_starts[-1]), int(kv_starts[-1])):
            bases[:, 0], bases[:, 1] = q_starts[:-1], kv_starts[:-1]    # diagonal blocks
        else:
            raise invalid(op, f"{name} must have shape [max Sq, max Skv] = "
                              f"{(most_q, most_kv)} or [T1, T2] = "
                              f"{(int(q_starts[-1]), int(kv_starts[-1]))} with input_layout "
                              f"TND, got {mask.shape}")
        return mask.view(np.uint8), 0, 1, bases                 # any strides
    accepted = [(B, N1, Sq, Skv), (B, 1, Sq, Skv), (1, 1, Sq, Skv), (Sq, Skv)]
    if mask.shape not in accepted:
        raise invalid(op, f"{name} must have one of the shapes [B, N1, Sq, Skv], [B, 1, Sq, "
                          f"Skv], [1, 1, Sq, Skv], [Sq, Skv] = "
                          f"{', '.join(str(s) for s in accepted)}, got {mask.shape}")
    # a view unless the leading axes cannot be merged (a broadcast mask, say): then a copy
    flat = mask.view(np.uint8).reshape(-1, Skv)
    heads = mask.shape[1] if mask.ndim == 4 else 1
    batches = mask.shape[0] if mask.ndim == 4 else 1
    if batches > 1:
        bases[:, 0] = np.arange(nb) * heads * Sq
    if heads > 1:
        return flat, Sq, N1, bases
    return flat, 0, 1, bases


def _geometry(mode, pre, nxt, q_starts, kv_starts):
    """``[B, 2]``: the offsets ``dlo``, ``dhi`` that let row ``i`` see keys ``i + dlo <=
    j < i + dhi`` (before clipping to the sequence)."""
    U = _attention.UNBOUNDED
    nb = q_starts.size - 1
    off = np.diff(kv_starts) - np.diff(q_starts)
    pre, nxt = max(-U, min(U, pre)), max(-U, min(U, nxt))
    lo, hi = np.full(nb, -U, np.int64), np.full(nb, U, np.int64)
    if mode == 0:
        lo[:], hi[:] = -pre, nxt + 1
    elif mode == 2:
        hi[:] = 1
    elif mode == 3:
        hi = off + 1
    elif mode == 4:
        lo, hi = off - pre, off + nxt + 1
    return np.stack([lo, hi], axis=1).astype(np.int64)


def _check_rows(rules, layout, mode, pre, nxt, q_starts, kv_starts, geo):
    """The NPU's tiling rejections of rows without keys (strict mode): TND per
    sequence; the padded layouts when no row of the band meets a key."""
    op, names = rules.op, rules.names
    queries, keys = np.diff(q_starts), np.diff(kv_starts)
    if layout == "TND":
        for b in range(queries.size):
            Sq, Skv = int(queries[b]), int(keys[b])
            if not Sq:
                continue
            bad = {0: nxt < 0 or Skv + pre < Sq, 3: Sq > Skv,
                   4: pre < 0 or (nxt < 0 and pre + nxt < 0) or Sq - nxt > Skv}.get(mode, False)
            if mode in (1, 2) and Skv == 0:
                bad = True
            if bad:
                raise tiling(op, f"sequence {b} ({Sq} queries, {Skv} keys) has query rows "
                                 f"that see no key with {names['sparse_mode']} {mode}, "
                                 f"{names['pre']} {pre}, {names['next']} {nxt}; TND does not "
                                 f"take such rows")
        return
    Sq, Skv = int(queries[0]), int(keys[0])
    i = np.arange(Sq)
    if not (np.minimum(Skv, i + geo[0, 1]) > np.maximum(0, i + geo[0, 0])).any():
        raise tiling(op, f"no query row sees a key: the band of {names['sparse_mode']} "
                         f"{mode}, {names['pre']} {pre}, {names['next']} {nxt} does not meet "
                         f"the {Sq} x {Skv} scores")


def _stats_shape(layout, B, Sq, N1, T1):
    return (T1, N1, STAT_LANES) if layout == "TND" else (B, N1, Sq, STAT_LANES)


def _out_shape(layout, B, Sq, N, X):
    return {"TND": (Sq, N, X), "BSND": (B, Sq, N, X), "BNSD": (B, N, Sq, X),
            "BSH": (B, Sq, N * X), "SBH": (Sq, B, N * X)}[layout]


def _problem(rules, query, key, value, head_num, layout, pse, padding_mask, atten_mask,
             scale, keep_prob, pre, nxt, inner_precise, prefix, seq_q, seq_kv, sparse_mode,
             softmax_layout):
    """Every check the forward and the gradient share; returns the plan's fields, the
    inputs and the dimensions."""
    op, names = rules.op, rules.names
    for k, a in (("query", query), ("key", key), ("value", value)):
        if a is None:
            raise missing(op, names[k])
    layout = _layout(rules, layout)
    head_num = check_int(rules, "head_num", head_num)
    if head_num < 1:
        raise invalid(op, f"{names['head_num']} must be >= 1, got {head_num}")
    scale = _scale(rules, scale)
    keep_prob = _keep_prob(rules, keep_prob)
    sparse_mode = check_int(rules, "sparse_mode", sparse_mode)
    pre, nxt = check_int(rules, "pre", pre), check_int(rules, "next", nxt)
    inner_precise = check_int(rules, "inner_precise", inner_precise)
    _not_implemented(rules, pse, padding_mask, prefix, keep_prob, sparse_mode, softmax_layout)
    if sparse_mode not in SPARSE_MODES:
        raise invalid(op, f"{names['sparse_mode']} must be one of 0 to 8 (0 to 4 computed), "
                          f"got {sparse_mode}")
    if inner_precise not in (0, 1, 2, 3):
        raise invalid(op, f"{names['inner_precise']} must be 0, 1, 2 or 3, got {inner_precise}")
    (query, key, value), (B, Sq, Skv, N1, N2, D, Dv) = _dims(rules, layout, query, key, value,
                                                             head_num)
    if layout == "TND":
        q_starts, kv_starts = _tnd_starts(rules, seq_q, seq_kv, Sq, Skv)
    else:
        for k, s in (("seq_q", seq_q), ("seq_kv", seq_kv)):
            if s is not None:
                raise invalid(op, f"{names[k]} is for input_layout TND only; {layout} has one "
                                  f"sequence per batch row (it must be None)")
        q_starts = np.arange(B + 1, dtype=np.int64) * Sq
        kv_starts = np.arange(B + 1, dtype=np.int64) * Skv
    if rules.strict:
        if N1 > MAX_HEADS:
            raise tiling(op, f"{names['head_num']} N1 must be <= {MAX_HEADS}, got {N1}")
        if D > MAX_DIM:
            raise tiling(op, f"the head dim D must be <= {MAX_DIM}, got {D}")
        if Dv > D:
            raise tiling(op, f"the value head dim Dv = {Dv} must be <= D = {D}")
        batches = q_starts.size - 1
        if batches > (MAX_TND_BATCH if layout == "TND" else MAX_BATCH):
            raise tiling(op, f"at most {MAX_TND_BATCH if layout == 'TND' else MAX_BATCH} "
                             f"sequences, got {batches}")
        longest = max(int(np.diff(q_starts).max(initial=0)),
                      int(np.diff(kv_starts).max(initial=0)))
        if longest > MAX_TOKENS:
            raise tiling(op, f"sequences must be at most {MAX_TOKENS} tokens, got {longest}")
    nb = q_starts.size - 1
    if atten_mask is None:
        geo = unbounded(nb)
        mask, mstep, heads = np.zeros((0, 0), np.uint8), 0, 1
    else:
        mask, mstep, heads, bases = _mask(rules, atten_mask, layout, sparse_mode, B, N1, Sq,
                                          Skv, q_starts, kv_starts)
        geo = np.concatenate([_geometry(sparse_mode, pre, nxt, q_starts, kv_starts), bases],
                             axis=1)
        if rules.strict:
            _check_rows(rules, layout, sparse_mode, pre, nxt, q_starts, kv_starts, geo)
    G = N1 // N2
    fields = dict(dtype=query.dtype, T1=int(q_starts[-1]), N2=N2, G=G,
                  Gu=1 if heads > 1 else G, D=D, Dv=Dv, scale=scale, q_starts=q_starts,
                  kv_starts=kv_starts, **chunks(kv_starts), geo=geo, mask=mask, mstep=mstep,
                  mask_heads=heads, zero_rows=inner_precise >= 2, input_layout=layout)
    inputs = {"query": query, "key": key, "value": value}
    if isinstance(atten_mask, np.ndarray):
        inputs["atten_mask"] = atten_mask
    return fields, inputs, (B, Sq, Skv, N1, N2, D, Dv)


def plan_fusion(rules, query, key, value, head_num, layout, pse, padding_mask, atten_mask,
                scale, keep_prob, pre, nxt, inner_precise, prefix, seq_q, seq_kv, sparse_mode,
                softmax_layout, attention_out, softmax_max, softmax_sum):
    """Check a fusion-attention forward and plan it; NsaError if invalid."""
    fields, inputs, (B, Sq, Skv, N1, N2, D, Dv) = _problem(
        rules, query, key, value, head_num, layout, pse, padding_mask, atten_mask, scale,
        keep_prob, pre, nxt, inner_precise, prefix, seq_q, seq_kv, sparse_mode, softmax_layout)
    layout, dtype = fields["input_layout"], fields["dtype"]
    stat = _stat_dtype(dtype)
    shapes = {"attention_out": (_out_shape(layout, B, Sq, N1, Dv), dtype),
              "softmax_max": (_stats_shape(layout, B, Sq, N1, fields["T1"]), stat),
              "softmax_sum": (_stats_shape(layout, B, Sq, N1, fields["T1"]), stat)}
    outputs = {k: _output(rules, k, a, *shapes[k]) for k, a in (
        ("attention_out", attention_out), ("softmax_max", softmax_max),
        ("softmax_sum", softmax_sum))}
    check_no_overlap(rules, outputs, inputs)
    inputs.pop("atten_mask", None)
    return DensePlan(op="fusion_attention", **fields, arrays={**inputs, **outputs},
                     pending={k: shapes[k] for k, a in outputs.items() if a is None})


def plan_fusion_grad(rules, query, key, value, dy, head_num, layout, pse, padding_mask,
                     atten_mask, softmax_max, softmax_sum, attention_in, scale, keep_prob, pre,
                     nxt, inner_precise, prefix, seq_q, seq_kv, sparse_mode, softmax_layout,
                     dq, dk, dv):
    """Check a fusion-attention gradient and plan it; NsaError if invalid."""
    op, names = rules.op, rules.names
    fields, inputs, (B, Sq, Skv, N1, N2, D, Dv) = _problem(
        rules, query, key, value, head_num, layout, pse, padding_mask, atten_mask, scale,
        keep_prob, pre, nxt, inner_precise, prefix, seq_q, seq_kv, sparse_mode, softmax_layout)
    layout, dtype = fields["input_layout"], fields["dtype"]
    out_shape = _out_shape(layout, B, Sq, N1, Dv)
    stats = _stats_shape(layout, B, Sq, N1, fields["T1"])
    stat = _stat_dtype(dtype)
    for k, a in (("grad", dy), ("attention_out", attention_in), ("softmax_max", softmax_max),
                 ("softmax_sum", softmax_sum)):
        if a is None:
            raise missing(op, names[k])
        if not isinstance(a, np.ndarray):
            raise invalid(op, f"{names[k]} must be a numpy.ndarray, got {type(a).__name__}")
        rows = k in ("grad", "attention_out")
        want, shape = (dtype, out_shape) if rows else (stat, stats)
        if a.dtype != want:
            raise invalid(op, f"{names[k]} dtype must be {want}, got {a.dtype}")
        same = a.shape == shape if rows else (a.ndim == len(shape) and a.shape[-1] >= 1
                                              and a.shape[:-1] == shape[:-1])
        if not same:
            raise invalid(op, f"{names[k]} must have shape {shape} (the forward's), got "
                              f"{a.shape}")
        inputs[k] = a
    shapes = {"dq": (query.shape, dtype), "dk": (key.shape, dtype), "dv": (value.shape, dtype)}
    outputs = {k: _output(rules, k, a, *shapes[k]) for k, a in (("dq", dq), ("dk", dk),
                                                               ("dv", dv))}
    check_no_overlap(rules, outputs, inputs)
    inputs.pop("atten_mask", None)
    return DensePlan(op="fusion_attention_grad", **fields, arrays={**inputs, **outputs},
                     pending={k: shapes[k] for k, a in outputs.items() if a is None})


def numels(plan):
    """What the NPU reports as ``numels``: ``N1 * sum_b Sq_b * Skv_b``."""
    return int(plan.N2 * plan.G * (np.diff(plan.q_starts) * np.diff(plan.kv_starts)).sum())
