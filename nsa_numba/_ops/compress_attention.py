"""Compressed attention with top-k block selection (``aclnnNsaCompressAttention``,
torch_npu's ``npu_nsa_compress_attention``): rules, planner and launch of the forward.

Query token ``t`` (position ``s`` of sequence ``b``), head ``h``, attends over the
``Tc_b`` compressed keys and values of its sequence (``npu_nsa_compress``'s output),
KV head ``j = h // G``; a key ``k`` with ``atten_mask[s, k]`` set (the mask's top-left
corner for each sequence) scores -FLT_MAX. Then the importance of block ``b'`` of raw
keys (``l'`` tokens, ``m = l' / d`` compressed tokens) for KV head ``j``::

    score[b'] = sum over the group's heads g, sum_{i < m + n - 1} w_i P_g[m (b' + 1) - i]
    w_i = min(i + 1, n, m + n - 1 - i),  n = l / d;   tokens outside [0, Tc_b) left out

``topk_mask[s, b']`` forces a block; ``topk_indices[t, j]`` lists the forced blocks
(ascending), then the highest scores, ties to the lower block, ``c`` in all, counted
from the sequence's first block. Statistics ``[T1, N1, 8]`` token-major (the reading
docs/reference.md adopts), as selected attention's. The whole row of a unit's
weights lives in its thread's scratch only: nothing of size ``T1 x N1 x Tc`` is
written.

Status 161001 for a required array that is None, 561002 for the NPU's tiling limits
(strict mode), 161002 for everything else.
"""

from dataclasses import dataclass

import numpy as np

from .._core import launch as _launch
from .._core.errors import invalid, tiling
from .._kernels import attention as _attention
from . import seqlens as _seqlens
from .checks import Rules, check_int, check_no_overlap
from .dense import DensePlan, chunks, unbounded
from .select import (
    STAT_LANES,
    _output,
    _scale,
    _starts,
    _stat_dtype,
    check_heads,
    check_saved,
    paired_starts,
)

PY_NAMES = {
    "query": "query", "key": "key", "value": "value", "scale": "scale_value",
    "head_num": "head_num", "block": "compress_block_size", "stride": "compress_stride",
    "select_block": "select_block_size", "count": "select_block_count",
    "topk_mask": "topk_mask", "atten_mask": "atten_mask", "seq_q": "actual_seq_qlen",
    "seq_kv": "actual_cmp_seq_kvlen", "seq_sel": "actual_sel_seq_kvlen",
    "attention_out": "attention_out", "topk": "topk_indices", "softmax_max": "softmax_max",
    "softmax_sum": "softmax_sum", "strict": "strict", "grad": "grad", "dq": "dq",
    "dk": "dk", "dv": "dv",
}

#: the NPU's documented limits (strict mode)
MAX_BLOCK = 128
MAX_STRIDE = 64
MAX_SELECT_BLOCK = 128
MAX_COUNT = 32
MAX_COMPRESSED = 14000
GROUP_DIVIDES = 128
#: the limits of the NPU's generic attention gradient, which computes this one
MAX_GRAD_HEADS = 256
MAX_GRAD_DIM = 768


def compress_attention_rules(op, **options):
    """The :class:`~nsa_numba._ops.checks.Rules` of an entry point of compressed attention."""
    options.setdefault("names", dict(PY_NAMES))
    return Rules(op, **options)


@dataclass(frozen=True, kw_only=True)
class CompressAttentionPlan(DensePlan):
    """A checked compressed-attention forward, ready to launch: dense attention
    over the compressed keys (mode 1: every key its mask row leaves visible), then
    the top-k."""
    count: int
    m: int                          # compressed tokens per block of raw keys
    n: int                          # compressed tokens per window
    sel_starts: np.ndarray          # [B + 1] blocks of raw keys
    topk_mask: np.ndarray           # uint8 [rows, cols], or [0, 0] for none

    def summary(self):
        return f"{super().summary()} count={self.count}"

    def _part_fields(self, b0, b1):
        return {"sel_starts": self.sel_starts[b0:b1 + 1] - self.sel_starts[b0]}

    def forward_step(self, w, useful, ranges, blocks):
        topk = self.arrays["topk"]
        if self.cut is not None:
            topk = self.clip(topk[None])[0]
        _launch.any_layout(
            _attention.cmp_forward, useful, 4, self.rows("query"), self.q_starts,
            self.kv_starts, self.chunk_starts, self.sel_starts, blocks, ranges, w["kt"],
            w["vrow"], self.mask, self.geo, self.topk_mask, self.rows("attention_out"), topk,
            self.rows("softmax_max"), self.rows("softmax_sum"), w["scratch"], w["index"],
            self.G, self.row, self.accumulator.type(self.scale), self.m, self.n)


def _dense_fields(dtype, T1, N2, G, D, Dv, scale, q_starts, kv_starts, mask):
    """A compressed-attention plan's dense fields: TND, every key of the sequence
    under ``mask``."""
    return dict(dtype=dtype, T1=T1, N2=N2, G=G, Gu=G, D=D, Dv=Dv, scale=scale,
                q_starts=q_starts, kv_starts=kv_starts, **chunks(kv_starts),
                geo=unbounded(q_starts.size - 1), mask=mask, mstep=0, mask_heads=1,
                zero_rows=False, input_layout="TND")


def _mask(rules, key, mask, rows, cols, what):
    """A mask as uint8 (a view), its shape at least ``[rows, cols]``; an empty one for
    None."""
    if mask is None:
        return np.zeros((0, 0), np.uint8)
    name, op = rules.names[key], rules.op
    if not isinstance(mask, np.ndarray):
        raise invalid(op, f"{name} must be None or a numpy.ndarray of bool or uint8, got "
                          f"{type(mask).__name__}")
    if mask.dtype not in (np.bool_, np.uint8):
        raise invalid(op, f"{name} dtype must be bool or uint8, got {mask.dtype}")
    if mask.ndim != 2 or mask.shape[0] < rows or mask.shape[1] < cols:
        raise invalid(op, f"{name} must be 2-D and cover [{rows}, {cols}] ({what}), got "
                          f"shape {mask.shape}")
    return mask.view(np.uint8)                  # any strides: the kernels index it


def _check_window(rules, block, stride, select_block, count):
    op, names = rules.op, rules.names
    for key, value in (("block", block), ("stride", stride), ("select_block", select_block),
                       ("count", count)):
        if value < 1:
            raise invalid(op, f"{names[key]} must be >= 1, got {value}")
    for key, value in (("block", block), ("select_block", select_block)):
        if value % stride:
            raise invalid(op, f"{names[key]} must be a multiple of {names['stride']} = "
                              f"{stride} (whole compressed tokens), got {value}")
    if not rules.strict:
        return
    for key, value, top in (("block", block, MAX_BLOCK), ("stride", stride, MAX_STRIDE),
                            ("select_block", select_block, MAX_SELECT_BLOCK)):
        if value % 16 or value > top:
            raise tiling(op, f"{names[key]} must be a multiple of 16 and <= {top}, got "
                             f"{value}")
    if not stride <= block <= select_block:
        raise tiling(op, f"{names['stride']} <= {names['block']} <= {names['select_block']} "
                         f"must hold, got {stride}, {block}, {select_block}")
    if count > MAX_COUNT:
        raise tiling(op, f"{names['count']} must be <= {MAX_COUNT}, got {count}")


def plan_compress_attention(rules, query, key, value, scale, head_num, block, stride,
                            select_block, count, topk_mask, atten_mask, seq_q, seq_kv,
                            seq_sel, attention_out, topk, softmax_max, softmax_sum):
    """Check a compressed-attention forward and plan it; NsaError if invalid."""
    op, names = rules.op, rules.names
    query, key, value = check_heads(rules, query, key, value, head_num, "Tc")
    dtype = query.dtype
    scale = _scale(rules, scale)
    block, stride = check_int(rules, "block", block), check_int(rules, "stride", stride)
    select_block = check_int(rules, "select_block", select_block)
    count = check_int(rules, "count", count)
    T1, N1, D = query.shape
    Tc, N2, _ = key.shape
    Dv = value.shape[2]
    _check_window(rules, block, stride, select_block, count)
    G = N1 // N2
    if rules.strict:
        if G >= GROUP_DIVIDES or GROUP_DIVIDES % G:
            raise tiling(op, f"the group N1 / N2 = {G} must divide {GROUP_DIVIDES} and be "
                             f"smaller than it")
        if Dv > D:
            raise tiling(op, f"{names['value']} head dim Dv = {Dv} must be <= D = {D}")
    given = [seq_q is None, seq_kv is None, seq_sel is None]
    if any(given) and not all(given):
        raise invalid(op, f"{names['seq_q']}, {names['seq_kv']} and {names['seq_sel']} go "
                          f"together: give all three or none")
    m, n = select_block // stride, block // stride
    q_starts = _starts(rules, "seq_q", seq_q, T1)
    kv_starts = _starts(rules, "seq_kv", seq_kv, Tc)
    compressed = np.diff(kv_starts)
    blocks = -(-compressed // m)
    if seq_sel is None:
        sel_starts = np.concatenate(([0], np.cumsum(blocks)))
    else:                       # prefix sums whose total is theirs to say
        ends = _seqlens.as_int_vector(op, names["seq_sel"], seq_sel)
        sel_starts = _starts(rules, "seq_sel", ends, int(ends[-1]) if ends.size else 0)
    if not q_starts.size == kv_starts.size == sel_starts.size:
        raise invalid(op, f"{names['seq_q']}, {names['seq_kv']} and {names['seq_sel']} must "
                          f"have one value per sequence each, got {q_starts.size - 1}, "
                          f"{kv_starts.size - 1} and {sel_starts.size - 1}")
    queries, sel = np.diff(q_starts), np.diff(sel_starts)
    broken = (sel != blocks) | ((queries > 0) & (count > sel))
    if rules.strict:
        broken |= compressed > MAX_COMPRESSED
    for b in np.flatnonzero(broken)[:1].tolist():       # the first sequence that breaks one
        if sel[b] != blocks[b]:
            raise invalid(op, f"{names['seq_sel']}: sequence {b} has {compressed[b]} "
                              f"compressed tokens, so ceil({compressed[b]} / {m}) = "
                              f"{blocks[b]} blocks of {names['select_block']}, got {sel[b]}")
        if queries[b] and count > sel[b]:
            raise invalid(op, f"{names['count']} = {count} is more than the {sel[b]} blocks "
                              f"sequence {b} has ({compressed[b]} compressed tokens)")
        if rules.strict and compressed[b] > MAX_COMPRESSED:
            raise tiling(op, f"sequence {b} has {compressed[b]} compressed tokens, more than "
                             f"{MAX_COMPRESSED}")
    most_q = int(queries.max(initial=0))
    mask = _mask(rules, "atten_mask", atten_mask, most_q, int(compressed.max(initial=0)),
                 "the longest query and compressed sequences")
    forced = _mask(rules, "topk_mask", topk_mask, most_q, int(sel.max(initial=0)),
                   "the longest query sequence and block count")
    stat = _stat_dtype(dtype)
    shapes = {"attention_out": ((T1, N1, Dv), dtype), "topk": ((T1, N2, count),
                                                               np.dtype(np.int32)),
              "softmax_max": ((T1, N1, STAT_LANES), stat),
              "softmax_sum": ((T1, N1, STAT_LANES), stat)}
    outputs = {k: _output(rules, k, a, *shapes[k]) for k, a in (
        ("attention_out", attention_out), ("topk", topk), ("softmax_max", softmax_max),
        ("softmax_sum", softmax_sum))}
    inputs = {"query": query, "key": key, "value": value}
    for k, a in (("atten_mask", atten_mask), ("topk_mask", topk_mask)):
        if isinstance(a, np.ndarray):
            inputs[k] = a
    check_no_overlap(rules, outputs, inputs)
    arrays = {"query": query, "key": key, "value": value, **outputs}
    return CompressAttentionPlan(
        op="compress_attention",
        **_dense_fields(dtype, T1, N2, G, D, Dv, scale, q_starts, kv_starts, mask),
        count=count, m=m, n=n, sel_starts=sel_starts.astype(np.int64), topk_mask=forced,
        arrays=arrays, pending={k: shapes[k] for k, a in outputs.items() if a is None})


def plan_compress_attention_grad(rules, grad, query, key, value, attention_out, softmax_max,
                                 softmax_sum, scale, head_num, atten_mask, seq_q, seq_kv,
                                 dq, dk, dv):
    """Check the gradient of compressed attention (attention over every compressed key
    of the sequence, masked by ``atten_mask``) and plan it; NsaError if invalid."""
    op, names = rules.op, rules.names
    query, key, value = check_heads(rules, query, key, value, head_num, "Tc")
    dtype = query.dtype
    scale = _scale(rules, scale)
    T1, N1, D = query.shape
    Tc, N2, _ = key.shape
    Dv = value.shape[2]
    if rules.strict:
        if N1 > MAX_GRAD_HEADS:
            raise tiling(op, f"{names['query']} head count N1 must be <= {MAX_GRAD_HEADS}, "
                             f"got {N1}")
        if D > MAX_GRAD_DIM:
            raise tiling(op, f"{names['query']} head dim D must be <= {MAX_GRAD_DIM}, got {D}")
        if Dv > D:
            raise tiling(op, f"{names['value']} head dim Dv = {Dv} must be <= D = {D}")
    arrays = {"query": query, "key": key, "value": value}
    check_saved(rules, arrays, grad, attention_out, softmax_max, softmax_sum, (T1, N1, Dv),
                dtype)
    q_starts, kv_starts = paired_starts(rules, seq_q, seq_kv, T1, Tc)
    queries, compressed = np.diff(q_starts), np.diff(kv_starts)
    for b in np.flatnonzero((queries > 0) & (compressed == 0))[:1].tolist():
        if queries[b] and not compressed[b]:
            raise invalid(op, f"sequence {b} has {queries[b]} queries and no compressed "
                              f"keys ({names['seq_kv']}): its rows would attend to nothing")
    mask = _mask(rules, "atten_mask", atten_mask, int(queries.max(initial=0)),
                 int(compressed.max(initial=0)), "the longest query and compressed sequences")
    if isinstance(atten_mask, np.ndarray):
        arrays["atten_mask"] = atten_mask
    shapes = {"dq": (query.shape, dtype), "dk": (key.shape, dtype), "dv": (value.shape, dtype)}
    outputs = {k: _output(rules, k, a, *shapes[k]) for k, a in (("dq", dq), ("dk", dk),
                                                               ("dv", dv))}
    check_no_overlap(rules, outputs, arrays)
    arrays.pop("atten_mask", None)
    arrays.update(outputs)
    return DensePlan(op="compress_attention_grad",
                     **_dense_fields(dtype, T1, N2, N1 // N2, D, Dv, scale, q_starts,
                                     kv_starts, mask),
                     arrays=arrays,
                     pending={k: shapes[k] for k, a in outputs.items() if a is None})
