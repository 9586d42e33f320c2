"""Selected attention (``aclnnNsaSelectedAttention`` / ``...Grad``, torch_npu's
``npu_nsa_select_attention`` / ``_grad``): rules, planners and launch.

Query token ``t`` (position ``s`` of sequence ``b``), head ``h``, reads KV head ``j =
h // G`` (``G = N1 / N2``): for each index ``idx`` of ``topk_indices[t, j, :c]``, in
list order, the ``l'`` keys and values from row ``kv_start_b + idx * l'`` (a block
counted from its sequence's first key; a repeated index is read twice)::

    S = scale * q[t, h] . K_sel^T,  masked scores replaced by -FLT_MAX
    out[t, h] = softmax(S) V_sel;  softmax_max = max S;  softmax_sum = sum exp(S - max)

With ``atten_mask`` given (its contents are never read) the mask is derived from the
indices: a block after the query's own (``idx > s // l'``) is masked whole, and in
the query's own block the keys after position ``s``. A row with every key masked
gets equal weights: the mean of its values, max -FLT_MAX, sum K. The statistics are
``[T1, N1, 8]`` (the value in all 8 lanes), float32 (float64 for float64 inputs).

The gradient is the exact gradient of that forward as called (docs/reference.md
says where the NPU's differs): ``dS = P (dO V^T - delta)`` with ``delta = sum dO *
O`` from the given output and P from the given statistics; ``dq = scale dS K``;
``dk`` and ``dv`` sum over every (token, slot) that selected a key, computed by
the owner of each key block (``_kernels.attention``), so they are deterministic.

Checks: :func:`plan_select` and :func:`plan_select_grad` check every argument and
the contents of ``topk_indices`` (each index must name a whole block of its
sequence's keys) before anything is allocated or written. Status 161001 for a
required array that is None, 561002 for the NPU's tiling limits (strict mode),
161002 for everything else.

Workspace: the staged blocks (``_kernels.attention.select_stage``) in the input's storage
dtype, one accumulator scratch row and one int64 index row per thread, and for the
gradient the owners' inverted index; each region starts on a WORKSPACE_ALIGN-byte
boundary.
"""

from dataclasses import dataclass, field

import numpy as np

from .._core import launch as _launch
from .._core import pool as _pool
from .._core.errors import invalid, missing, tiling
from .._core.jit import jit
from .._kernels import attention as _attention
from . import seqlens as _seqlens
from .checks import (
    ACCUMULATOR,
    STORAGE,
    WORKSPACE_ALIGN,
    Rules,
    check_array,
    check_int,
    check_no_overlap,
    check_same_dtype,
    kind_of,
    round16,
    scratch_slots,
)

PY_NAMES = {
    "query": "query", "key": "key", "value": "value", "topk": "topk_indices",
    "scale": "scale_value", "head_num": "head_num", "block": "select_block_size",
    "count": "select_block_count", "atten_mask": "atten_mask",
    "seq_q": "actual_seq_qlen", "seq_kv": "actual_seq_kvlen",
    "grad": "grad", "attention_out": "attention_out", "softmax_max": "softmax_max",
    "softmax_sum": "softmax_sum", "dq": "dq", "dk": "dk", "dv": "dv", "strict": "strict",
}

#: the NPU's documented limits (strict mode)
MAX_HEADS = 128
MAX_GROUP = 32
FORWARD_DIMS = ((192,), (128,))          # (D allowed, Dv allowed)
GRAD_DIMS = ((128, 192), (128,))
MAX_BLOCK = 128
MAX_COUNT = 32
MAX_BATCH = 1024
MAX_SEQUENCE = 128 * 1024
MAX_GRAD_TOKENS = 2 * 1024 * 1024
#: lanes of the softmax statistics
STAT_LANES = 8


def select_rules(op, **options):
    """The :class:`~nsa_numba._ops.checks.Rules` of an entry point of selected attention,
    with the NumPy API's parameter names unless ``options`` gives others."""
    options.setdefault("names", dict(PY_NAMES))
    return Rules(op, **options)


class AttentionPlan:
    """What an attention operator's plan shares (``SelectPlan``, the compressed
    attention's plan): the dataclass fields ``op``, ``dtype``, ``T1``, ``N2``, ``G``,
    ``arrays``, ``pending``, and a ``layout()`` of its workspace regions, from which the
    rest follows."""

    def allocate(self):
        """Allocate the outputs the caller left (from the output pool)."""
        for role, (shape, dtype) in self.pending.items():
            if self.arrays[role] is None:
                self.arrays[role] = _pool.empty(shape, dtype)

    @property
    def accumulator(self):
        return ACCUMULATOR[kind_of(self.dtype)]

    @property
    def units(self):
        return self.T1 * self.N2

    @property
    def threads_useful(self):
        return max(1, min(self.units, scratch_slots()))

    @property
    def workspace_bytes(self):
        used = sum(_region_bytes(n, dt) for _, n, dt in self.layout())
        return used + WORKSPACE_ALIGN - 1 if used else 0

    def carve(self, workspace):
        """The regions of ``layout`` in a uint8 workspace (None: new memory), the per-thread
        ``scratch`` and ``index`` as ``[slots, ...]``."""
        if workspace is None:
            workspace = np.empty(self.workspace_bytes, np.uint8)
        at = -workspace.ctypes.data % WORKSPACE_ALIGN
        regions = {}
        for name, n, dtype in self.layout():
            regions[name] = workspace[at:at + n * dtype.itemsize].view(dtype)
            at += _region_bytes(n, dtype)
        slots = scratch_slots()
        regions["scratch"] = regions["scratch"].reshape(slots, -1)
        regions["index"] = regions["index"].reshape(slots, -1)
        return regions

    def storage(self, role):
        """``role``'s array as the kernels take it (half precision as integers)."""
        a = self.arrays[role]
        kind = kind_of(a.dtype)
        return a.view(STORAGE[kind]) if kind is not None else a


@dataclass(frozen=True, kw_only=True)
class SelectPlan(AttentionPlan):
    """A checked selected-attention call (forward or gradient), ready to launch
    (``run_select``); what the pipeline reads of a plan (``compress.Plan``)."""
    op: str                         # "select" or "select_grad"
    dtype: np.dtype
    T1: int
    N2: int
    G: int
    D: int
    Dv: int
    block: int                      # l'
    padded: int                     # l' rounded up to _attention.KEY_ALIGN
    count: int
    scale: float
    causal: bool
    q_starts: np.ndarray            # [B + 1] int64
    blk_starts: np.ndarray          # [B + 1] int64: first global block of each sequence
    block_row: np.ndarray           # [GB] int64: first key row of each global block
    tails: np.ndarray               # [P, 2] int64: key rows in no whole block
    topk: np.ndarray                # int32 [T1, N2, c], C-contiguous
    arrays: dict
    pending: dict = field(default_factory=dict)     # role -> (shape, dtype)

    def summary(self):
        return (f"{self.op} T1={self.T1} N1={self.N2 * self.G} N2={self.N2} D={self.D} "
                f"Dv={self.Dv} block={self.block} count={self.count}")

    @property
    def blocks(self):
        return self.block_row.size

    def layout(self):
        """(name, elements, dtype) of each workspace region, in order."""
        G4 = -(-self.G // 4) * 4
        l4 = -(-self.block // 4) * 4
        D, Dv, lp, l, c = self.D, self.Dv, self.padded, self.block, self.count
        staged = self.blocks * self.N2
        lds = c * l + lp
        slots = scratch_slots()
        R = G4 * max(1, _attention.PAIR_ROWS // G4)       # _attention.owner_batch rows
        # an index row: the visible slots, then the row offsets of one product
        index = c + max(D, Dv, c * l, R if self.op == "select_grad" else G4)
        acc = self.accumulator
        st = STORAGE[kind_of(self.dtype)]       # staged blocks keep the input's bits
        if self.op == "select":
            floats = G4 * (D + lds + Dv)
            return [("kt", staged * D * lp, st), ("vrow", staged * l * Dv, st),
                    ("scratch", slots * round16(floats), acc),
                    ("index", slots * round16(index), np.dtype(np.int64))]
        dq_floats = G4 * (D + Dv) + 2 * G4 * lds + G4 * D + 3 * G4
        owner_floats = (R * (D + Dv) + 2 * R * (lp + _attention.KEY_ALIGN)
                        + l4 * (D + Dv) + 3 * R)
        floats = max(dq_floats, owner_floats)
        return [("kt", staged * D * lp, st), ("krow", staged * l * D, st),
                ("vt", staged * Dv * lp, st),
                ("scratch", slots * round16(floats), acc),
                ("index", slots * round16(index), np.dtype(np.int64)),
                ("offsets", staged + 1, np.dtype(np.int64)),
                ("entries", self.T1 * self.N2 * c, np.dtype(np.int64)),
                ("order", staged, np.dtype(np.int64))]



def _region_bytes(n, dtype):
    return -(-n * dtype.itemsize // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


# -- argument checks --------------------------------------------------------------------


def _scale(rules, value):
    return _seqlens.as_real(rules.op, rules.names["scale"], value)


def _array(rules, key, a, dims):
    return check_array(rules, key, a, 3, dims)


def _topk(rules, topk, shape):
    """``topk_indices`` as C-contiguous int32 (a copy only when it is not already), its
    shape and integer dtype checked."""
    name, op = rules.names["topk"], rules.op
    if topk is None:
        raise missing(op, name)
    if not isinstance(topk, np.ndarray):
        raise invalid(op, f"{name} must be a numpy.ndarray of integers, got "
                          f"{type(topk).__name__}")
    if rules.index_dtype is not None and topk.dtype != rules.index_dtype:
        raise invalid(op, f"{name} dtype must be {np.dtype(rules.index_dtype)}, got "
                          f"{topk.dtype}")
    if topk.dtype == np.bool_ or not np.issubdtype(topk.dtype, np.integer):
        raise invalid(op, f"{name} must hold integers, got dtype {topk.dtype}")
    if topk.shape != shape:
        raise invalid(op, f"{name} must have shape [T1, N2, {rules.names['count']}] = "
                          f"{shape}, got {topk.shape}")
    if rules.strict and topk.size == 0:
        raise invalid(op, f"{name} must not be empty, got shape {topk.shape}")
    if topk.dtype == np.int32 and topk.flags.c_contiguous:
        return topk
    if topk.size and (topk.min() < np.iinfo(np.int32).min
                      or topk.max() > np.iinfo(np.int32).max):
        bad = topk.min() if topk.min() < np.iinfo(np.int32).min else topk.max()
        raise invalid(op, f"{name} values must be block indices (int32), got {int(bad)}")
    return np.ascontiguousarray(topk, dtype=np.int32)


def _starts(rules, key, values, total):
    """Prefix sums without the leading 0 (``[128, 272]``: lengths 128 and 144) as
    ``[B + 1]`` starts; None: one sequence of ``total``."""
    name, op = rules.names[key], rules.op
    if values is None:
        return np.array([0, total], np.int64)
    ends = _seqlens.as_int_vector(op, name, values)
    if ends.size == 0:
        raise invalid(op, f"{name} must hold at least one sequence end, got none")
    starts = np.concatenate(([0], ends))
    steps = np.diff(starts)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0))
        raise invalid(op, f"{name} must be non-decreasing prefix sums (cumulative sequence "
                          f"ends without a leading 0), got {_seqlens._show(ends)}: "
                          f"{starts[at + 1]} after {starts[at]} at index {at}")
    if ends[-1] != total:
        raise invalid(op, f"{name} must end at the token count {total}, got "
                          f"{_seqlens._show(ends)} (last {int(ends[-1])})")
    return starts


def paired_starts(rules, seq_q, seq_kv, T1, T2):
    """The ``[B + 1]`` starts of the query and key sequences from their prefix sums,
    both given (with one value per sequence each) or neither (one sequence)."""
    op, names = rules.op, rules.names
    if (seq_q is None) != (seq_kv is None):
        given, absent = ("seq_q", "seq_kv") if seq_kv is None else ("seq_kv", "seq_q")
        raise invalid(op, f"{names[given]} and {names[absent]} go together: "
                          f"{names[given]} was given and {names[absent]} was not")
    q_starts = _starts(rules, "seq_q", seq_q, T1)
    kv_starts = _starts(rules, "seq_kv", seq_kv, T2)
    if q_starts.size != kv_starts.size:
        raise invalid(op, f"{names['seq_q']} and {names['seq_kv']} must have one value per "
                          f"sequence each, got {q_starts.size - 1} and {kv_starts.size - 1}")
    return q_starts, kv_starts


def _check_limits(rules, N1, N2, D, Dv, block, count, q_starts, kv_starts, dims, grad):
    """The NPU's tiling limits (strict mode): 561002."""
    op, names = rules.op, rules.names
    if N1 > MAX_HEADS:
        raise tiling(op, f"{names['query']} head count N1 must be <= {MAX_HEADS}, got {N1}")
    if N1 // N2 > MAX_GROUP:
        raise tiling(op, f"the group N1 / N2 = {N1} / {N2} = {N1 // N2} must be <= "
                         f"{MAX_GROUP}")
    allowed_d, allowed_dv = dims
    if D not in allowed_d:
        raise tiling(op, f"{names['query']} and {names['key']} head dim D must be "
                         f"{' or '.join(map(str, allowed_d))}, got {D}")
    if Dv not in allowed_dv:
        raise tiling(op, f"{names['value']} head dim Dv must be "
                         f"{' or '.join(map(str, allowed_dv))}, got {Dv}")
    if block % 16 or not 16 <= block <= MAX_BLOCK:
        raise tiling(op, f"{names['block']} must be a multiple of 16 from 16 to "
                         f"{MAX_BLOCK}, got {block}")
    if count > MAX_COUNT:
        raise tiling(op, f"{names['count']} must be <= {MAX_COUNT}, got {count}")
    B = q_starts.size - 1
    if B > MAX_BATCH:
        raise tiling(op, f"{names['seq_q']} must hold at most {MAX_BATCH} sequences, got {B}")
    if grad and q_starts[-1] > MAX_GRAD_TOKENS:
        raise tiling(op, f"{names['query']} token count T1 must be <= {MAX_GRAD_TOKENS}, "
                         f"got {q_starts[-1]}")
    for key, starts in (("seq_q", q_starts), ("seq_kv", kv_starts)):
        lengths = np.diff(starts)
        if lengths.size and lengths.max() > MAX_SEQUENCE:
            b = int(np.argmax(lengths))
            raise tiling(op, f"sequence {b} of {names[key]} has {lengths[b]} tokens, more "
                             f"than {MAX_SEQUENCE}")
    kv = np.diff(kv_starts)
    for b, n in enumerate(kv.tolist()):
        if n < count * block or n % block:
            raise tiling(op, f"key sequence {b} has {n} tokens ({names['seq_kv']}); each "
                             f"must be a multiple of {names['block']} = {block} and at "
                             f"least {names['count']} * {names['block']} = "
                             f"{count * block}")


@jit
def _first_bad_index(topk, q_starts, kv_blocks):
    """(t, j, i) of the first index outside ``[0, kv_blocks[b])`` for token t's
    sequence b, or (-1, 0, 0)."""
    T1, N2, count = topk.shape
    b = 0
    for t in range(T1):
        while q_starts[b + 1] <= t:
            b += 1
        for j in range(N2):
            for i in range(count):
                idx = topk[t, j, i]
                if idx < 0 or idx >= kv_blocks[b]:
                    return t, j, i
    return -1, 0, 0


def _check_indices(rules, topk, q_starts, kv_starts, block):
    kv_blocks = np.diff(kv_starts) // block
    t, j, i = _first_bad_index(topk, q_starts, kv_blocks)
    if t < 0:
        return kv_blocks
    b = int(np.searchsorted(q_starts, t, side="right") - 1)
    n = int(kv_starts[b + 1] - kv_starts[b])
    names = rules.names
    raise invalid(rules.op, f"{names['topk']}[{t}, {j}, {i}] = {int(topk[t, j, i])} is not a "
                            f"block of token {t}'s key sequence {b}: {n} keys hold "
                            f"{n // block} whole blocks of {names['block']} = {block}, so "
                            f"indices must be in [0, {n // block})")


def _output(rules, key, a, shape, dtype):
    """A caller's output, checked; None stays None (allocated after every check)."""
    if a is None and rules.allocate_outputs:
        return None
    name = rules.names[key]
    if a is None:
        raise missing(rules.op, name)
    if not isinstance(a, np.ndarray):
        raise invalid(rules.op, f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.shape != tuple(shape):
        raise invalid(rules.op, f"{name} must have shape {tuple(shape)}, got {a.shape}")
    if a.dtype != dtype:
        raise invalid(rules.op, f"{name} dtype must be {dtype}, got {a.dtype}")
    if not a.flags.writeable:
        raise invalid(rules.op, f"{name} must be writable, got a read-only array")
    return a


def _stat_dtype(dtype):
    return np.dtype(np.float64) if kind_of(dtype) == "float64" else np.dtype(np.float32)


def check_heads(rules, query, key, value, head_num, keys):
    """The checks every attention operator makes of its query ``[T1, N1, D]``, keys
    ``[<keys>, N2, D]``, values ``[<keys>, N2, Dv]`` and ``head_num``: present, 3-D, one
    dtype, matching shapes, N1 a multiple of N2. Returns the three arrays."""
    op, names = rules.op, rules.names
    for k, a in (("query", query), ("key", key), ("value", value)):
        if a is None:
            raise missing(op, names[k])
    query = _array(rules, "query", query, "[T1, N1, D]")
    key = _array(rules, "key", key, f"[{keys}, N2, D]")
    value = _array(rules, "value", value, f"[{keys}, N2, Dv]")
    check_same_dtype(rules, "key", key, "query", query.dtype)
    check_same_dtype(rules, "value", value, "query", query.dtype)
    head_num = check_int(rules, "head_num", head_num)
    T1, N1, D = query.shape
    T2, N2, Dk = key.shape
    if head_num != N1:
        raise invalid(op, f"{names['head_num']} must equal the query's head count "
                          f"{names['query']}.shape[1] = {N1}, got {head_num}")
    if Dk != D:
        raise invalid(op, f"{names['key']} head dim must equal {names['query']}'s D = {D}, "
                          f"got {names['key']} of shape {key.shape}")
    if value.shape[:2] != (T2, N2):
        raise invalid(op, f"{names['value']} must have shape [{keys}, N2, Dv] with {keys}, "
                          f"N2 = {T2}, {N2} ({names['key']}'s), got {value.shape}")
    if N2 < 1 or N1 % N2:
        raise invalid(op, f"the query head count N1 = {N1} must be a multiple of the key "
                          f"head count N2 = {N2} ({names['key']}.shape[1])")
    return query, key, value


def _common(rules, query, key, value, topk, scale, head_num, block, count, atten_mask,
            seq_q, seq_kv, grad):
    """Every check the forward and the gradient share; returns the plan's fields."""
    op, names = rules.op, rules.names
    query, key, value = check_heads(rules, query, key, value, head_num, "T2")
    dtype = query.dtype
    scale = _scale(rules, scale)
    block = check_int(rules, "block", block)
    count = check_int(rules, "count", count)
    T1, N1, D = query.shape
    T2, N2, _ = key.shape
    Dv = value.shape[2]
    if block < 1:
        raise invalid(op, f"{names['block']} must be >= 1, got {block}")
    if count < 1:
        raise invalid(op, f"{names['count']} must be >= 1, got {count}")
    if atten_mask is not None and not _is_array(atten_mask):
        raise invalid(op, f"{names['atten_mask']} must be None or an array (only whether "
                          f"it is given matters), got {type(atten_mask).__name__}")
    given_topk = topk
    topk = _topk(rules, topk, (T1, N2, count))
    q_starts, kv_starts = paired_starts(rules, seq_q, seq_kv, T1, T2)
    if rules.strict:
        _check_limits(rules, N1, N2, D, Dv, block, count, q_starts, kv_starts,
                      GRAD_DIMS if grad else FORWARD_DIMS, grad)
    kv_blocks = _check_indices(rules, topk, q_starts, kv_starts, block)
    blk_starts = np.concatenate(([0], np.cumsum(kv_blocks)))
    seq = np.repeat(np.arange(kv_blocks.size), kv_blocks)       # each block's sequence
    block_row = kv_starts[seq] + block * (np.arange(seq.size) - blk_starts[seq])
    tails = np.stack([kv_starts[:-1] + block * kv_blocks, kv_starts[1:]], axis=1)
    tails = tails[tails[:, 0] < tails[:, 1]]
    fields = dict(dtype=dtype, T1=T1, N2=N2, G=N1 // N2, D=D, Dv=Dv, block=block,
                  padded=-(-block // _attention.KEY_ALIGN) * _attention.KEY_ALIGN,
                  count=count, scale=scale, causal=atten_mask is not None,
                  q_starts=q_starts, blk_starts=blk_starts.astype(np.int64),
                  block_row=block_row, tails=tails.astype(np.int64), topk=topk)
    # the caller's indices join the overlap checks (the kernels read them, or their copy)
    return fields, {"query": query, "key": key, "value": value, "topk": given_topk}


def check_saved(rules, arrays, grad, attention_out, softmax_max, softmax_sum, shape, dtype):
    """The checks of an attention gradient's saved forward: ``grad`` and
    ``attention_out`` of ``shape`` ``(T1, N1, Dv)`` and ``dtype``, the statistics
    ``[T1, N1, 8]`` float32 (float64 for float64); each added to ``arrays``."""
    op, names = rules.op, rules.names
    for k, a in (("grad", grad), ("attention_out", attention_out),
                 ("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if a is None:
            raise missing(op, names[k])
    for k, a in (("grad", grad), ("attention_out", attention_out)):
        a = _array(rules, k, a, "[T1, N1, Dv]")
        check_same_dtype(rules, k, a, "query", dtype)
        if a.shape != shape:
            raise invalid(op, f"{names[k]} must have shape [T1, N1, Dv] = {shape}, got "
                              f"{a.shape}")
        arrays[k] = a
    stat = _stat_dtype(dtype)
    for k, a in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if not isinstance(a, np.ndarray):
            raise invalid(op, f"{names[k]} must be a numpy.ndarray, got {type(a).__name__}")
        if a.dtype != stat:
            raise invalid(op, f"{names[k]} dtype must be {stat} (the forward's statistics), "
                              f"got {a.dtype}")
        if a.ndim != 3 or a.shape[:2] != shape[:2] or a.shape[2] < 1:
            raise invalid(op, f"{names[k]} must have shape [T1, N1, {STAT_LANES}] = "
                              f"{(*shape[:2], STAT_LANES)}, got {a.shape}")
        arrays[k] = a


def _is_array(a):
    return isinstance(a, np.ndarray) or hasattr(a, "__array__") or hasattr(a, "shape")


def plan_select(rules, query, key, value, topk, scale, head_num, block, count, atten_mask,
                seq_q, seq_kv, attention_out, softmax_max, softmax_sum):
    """Check a selected-attention forward and plan it (:class:`SelectPlan`)."""
    fields, arrays = _common(rules, query, key, value, topk, scale, head_num, block, count,
                             atten_mask, seq_q, seq_kv, grad=False)
    T1, N1, Dv = fields["T1"], fields["N2"] * fields["G"], fields["Dv"]
    stat = _stat_dtype(fields["dtype"])
    shapes = {"attention_out": ((T1, N1, Dv), fields["dtype"]),
              "softmax_max": ((T1, N1, STAT_LANES), stat),
              "softmax_sum": ((T1, N1, STAT_LANES), stat)}
    given = {"attention_out": attention_out, "softmax_max": softmax_max,
             "softmax_sum": softmax_sum}
    outputs = {k: _output(rules, k, a, *shapes[k]) for k, a in given.items()}
    check_no_overlap(rules, outputs, arrays)
    arrays.update(outputs)
    return SelectPlan(op="select", arrays=arrays,
                      pending={k: shapes[k] for k, a in outputs.items() if a is None},
                      **fields)


def plan_select_grad(rules, grad, query, key, value, attention_out, softmax_max, softmax_sum,
                     topk, scale, head_num, block, count, atten_mask, seq_q, seq_kv,
                     dq, dk, dv):
    """Check a selected-attention gradient and plan it (:class:`SelectPlan`)."""
    op, names = rules.op, rules.names
    for k, a in (("grad", grad), ("attention_out", attention_out),
                 ("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if a is None:
            raise missing(op, names[k])
    fields, arrays = _common(rules, query, key, value, topk, scale, head_num, block, count,
                             atten_mask, seq_q, seq_kv, grad=True)
    dtype = fields["dtype"]
    check_saved(rules, arrays, grad, attention_out, softmax_max, softmax_sum,
                (fields["T1"], fields["N2"] * fields["G"], fields["Dv"]), dtype)
    shapes = {"dq": (arrays["query"].shape, dtype), "dk": (arrays["key"].shape, dtype),
              "dv": (arrays["value"].shape, dtype)}
    outputs = {k: _output(rules, k, a, *shapes[k]) for k, a in (("dq", dq), ("dk", dk),
                                                               ("dv", dv))}
    check_no_overlap(rules, outputs, arrays)
    arrays.update(outputs)
    return SelectPlan(op="select_grad", arrays=arrays,
                      pending={k: shapes[k] for k, a in outputs.items() if a is None},
                      **fields)


# -- launch ----------------------------------------------------------------------------

#: units a thread takes at a time: tokens cost about the same (a few differ near the
#: start of a causal sequence); owners differ widely, so one at a time, largest first
TOKEN_CHUNK = 4


def run_select(plan, workspace=None, threads=None):
    """Launch a planned call (the pipeline's ``launch`` for both operators)."""
    for _, step in select_steps(plan, workspace, threads):
        step()


def select_steps(plan, workspace=None, threads=None):
    """A planned call's launches in order, as ``(name, function of no arguments)``:
    the forward's "stage" and "forward"; the gradient's "stage", "dq", "index" (the
    owners') and "dk dv" (``bench --select --split`` times them one by one)."""
    if plan.units == 0 and plan.op == "select":
        return []
    w = plan.carve(workspace)
    useful = plan.threads_useful if threads is None else min(threads, plan.threads_useful)
    scale = plan.accumulator.type(plan.scale)
    empty = np.zeros(0, STORAGE[kind_of(plan.dtype)])
    st = plan.storage
    staged = (w["kt"], empty, w["vrow"], empty) if plan.op == "select" else \
        (w["kt"], w["krow"], empty, w["vt"])
    steps = [("stage", lambda: _launch.any_layout(
        _attention.select_stage, useful, 1, st("key"), st("value"), plan.block_row, plan.block,
        plan.padded, *staged))]
    if plan.op == "select":
        steps.append(("forward", lambda: _launch.any_layout(
            _attention.select_forward, useful, TOKEN_CHUNK, st("query"), plan.topk,
            plan.q_starts, plan.blk_starts, w["kt"], w["vrow"], st("attention_out"),
            plan.arrays["softmax_max"], plan.arrays["softmax_sum"], w["scratch"],
            w["index"], plan.G, plan.block, plan.padded, scale, plan.causal)))
        return steps
    common = (st("query"), st("grad"), st("attention_out"), plan.arrays["softmax_max"],
              plan.arrays["softmax_sum"], plan.topk, plan.q_starts, plan.blk_starts)
    if plan.units:
        steps.append(("dq", lambda: _launch.any_layout(
            _attention.select_grad_dq, useful, TOKEN_CHUNK, *common, w["kt"], w["krow"],
            w["vt"], st("dq"), w["scratch"], w["index"], plan.G, plan.block, plan.padded,
            scale, plan.causal)))

    def index():
        _attention.select_owners(plan.topk, plan.q_starts, plan.blk_starts, plan.blocks,
                                 w["offsets"], w["entries"])
        # the threads take the owners with the most entries first (ties by index)
        w["order"][:] = np.argsort(-np.diff(w["offsets"]), kind="stable")

    steps.append(("index", index))
    steps.append(("dk dv", lambda: _launch.any_layout(
        _attention.select_grad_dkdv, useful, 1, *common, plan.block_row, plan.tails,
        w["offsets"], w["entries"], w["order"], w["kt"], w["vt"], st("dk"), st("dv"),
        w["scratch"], w["index"], plan.G, plan.block, plan.padded, scale, plan.causal)))
    return steps
