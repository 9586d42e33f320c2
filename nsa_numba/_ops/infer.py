"""Validation and planning of the with-cache (decoding) operator.

``aclnnNsaCompressWithCache`` / ``npu_nsa_compress_infer``: at a decoding step,
every sequence whose length ``s`` sits on a window boundary (``s >= l`` and
``(s - l) % d == 0``) compresses its newest window, tokens ``s - l .. s - 1``,
into one row of a compressed-KV cache::

    cache[slot_mapping[b], n, :] = sum_{j < l} weight[j, n] * x_b[s - l + j, n, :]

Token ``p`` of sequence ``b`` is ``input[block_table[b, p // P], p % P]`` with a
paged input ``[block_num, P, N, D]`` (``P = page_block_size``), or token
``start_b + p`` of a packed input ``[T, N, D]`` (layout TND, no block table), the
sequences back to back from token 0. Every other cache row is left as it was.

:func:`plan_infer` checks everything and works out, in one compiled pass
(:func:`_writer_tables`), which sequences write, their cache rows and where each of
their window's tokens lives, so the kernel (``_kernels.compress.compress_infer``) gathers
through no table of its own. Nothing is written before a plan exists.

Status codes: 161001 for a required array that is None; 561002 for what the NPU's
tiling rejects (the strict limits on l, d, page size, N and D, a weight whose heads
do not match, a layout other than TND, ``actSeqLenType`` other than 1); 161002 for
everything else, including the slot and block indices the NPU does not check (out
of range there is memory corruption; here an error before anything is written).

Repeated cache rows among the sequences that write: strict mode rejects them (the
NPU calls the result unstable); non-strict mode writes the last such sequence's row
(highest ``b``), so the result is defined and deterministic.
"""

from dataclasses import dataclass

import numpy as np

from .._core.errors import invalid, missing, tiling
from .._core.jit import BOUNDSCHECK, jit
from . import seqlens as _seqlens
from .checks import (
    ACCUMULATOR,
    STORAGE,
    WORKSPACE_ALIGN,
    Rules,
    check_int,
    check_no_overlap,
    kind_of,
    scratch_slots,
)
from .checks import check_array as _array
from .compress import TILE_ELEMENTS
from .layouts import c_carrier

PY_NAMES = {
    "input": "input", "weight": "weight", "slot_mapping": "slot_mapping",
    "block": "compress_block_size", "stride": "compress_stride",
    "page": "page_block_size", "block_table": "block_table",
    "actual_seq_len": "actual_seq_len", "layout": "layout", "cache": "cache",
    "actual_seq_len_type": "actual_seq_len_type", "strict": "strict",
}

#: the NPU's documented limits (strict mode)
MAX_BLOCK = 64
STRIDES = (16, 32, 48, 64)
PAGE_SIZES = (64, 128)
MAX_D = 256
MAX_N = 64
EVEN_N_ABOVE = 50


def infer_rules(op, **options):
    """The :class:`~nsa_numba._ops.checks.Rules` of an entry point of this operator, with
    its NumPy API's parameter names unless ``options`` gives others."""
    options.setdefault("names", dict(PY_NAMES))
    return Rules(op, **options)


@dataclass(frozen=True, kw_only=True)
class InferPlan:
    """A validated decoding step, ready to run (``_ops.dispatch.run_infer``): what the
    pipeline reads of a plan (``compress.Plan``), and the writers' gather table."""
    dtype: np.dtype
    N: int
    D: int
    block: int
    writers: int                   # sequences that write a cache row
    slots: np.ndarray              # [writers] int64: their cache rows
    source: np.ndarray             # [writers, l, 2] int64: (page, row) of each token
    scratch_slots: int
    scratch_elements: int
    arrays: dict                   # the caller's arrays, by role
    op: str = "infer"

    def allocate(self):
        """Nothing to allocate: the cache is the one output, and the caller's."""

    def summary(self):
        """The step in a few words (``aclOpExecutor``'s repr)."""
        return f"{self.op} writers={self.writers} N={self.N} D={self.D}"

    @property
    def accumulator(self):
        return ACCUMULATOR[kind_of(self.dtype)]

    @property
    def scratch_bytes(self):
        return self.scratch_slots * self.scratch_elements * self.accumulator.itemsize

    @property
    def workspace_bytes(self):
        used = self.scratch_bytes if self.writers else 0
        return used + WORKSPACE_ALIGN - 1 if used else 0

    @property
    def threads_useful(self):
        """One thread per writing sequence and per TILE_ELEMENTS it reads."""
        work = -(-self.writers * self.block * self.N * self.D // TILE_ELEMENTS)
        return max(1, min(self.writers, work))

    def storage(self, role):
        """``input`` as ``[pages, P, N, D]`` (TND: ``[1, T, N, D]``) or ``cache`` as
        ``[1, rows, N, D]``, in the storage dtype (a padded C-contiguous carrier
        where the memory allows, except in the bounds-checked build)."""
        a = self.arrays[role]
        view = (a if a.ndim == 4 else a[None]).view(STORAGE[kind_of(self.dtype)])
        return view if BOUNDSCHECK else c_carrier(view)


# -- argument checks -------------------------------------------------------------------

def _indices(rules, key, values, ndim):
    """slot_mapping / block_table as int64, or NsaError: an integer array of ``ndim``
    dimensions of the rules' index dtype (the NumPy API also takes lists)."""
    name = rules.names[key]
    if values is None:
        raise missing(rules.op, name)
    if rules.index_dtype is not None:
        if not isinstance(values, np.ndarray):
            raise invalid(rules.op, f"{name} must be a numpy.ndarray of "
                                    f"{np.dtype(rules.index_dtype)}, got "
                                    f"{type(values).__name__}")
        if values.dtype != rules.index_dtype:
            raise invalid(rules.op, f"{name} dtype must be {np.dtype(rules.index_dtype)}, "
                                    f"got {values.dtype}")
    elif not isinstance(values, np.ndarray):
        if not isinstance(values, (list, tuple)):
            raise invalid(rules.op, f"{name} must be an integer array, a list or a tuple, "
                                    f"got {type(values).__name__}")
        if ndim == 1:
            return _seqlens.as_int_vector(rules.op, name, values)
        values = np.asarray(values)
    if values.ndim != ndim:
        raise invalid(rules.op, f"{name} must be {ndim}-D, got shape {values.shape}")
    if values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.integer):
        raise invalid(rules.op, f"{name} must hold integers, got dtype {values.dtype}")
    if values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
        raise invalid(rules.op, f"{name} values must fit in int64, got {int(values.max())}")
    return values.astype(np.int64)


def _check_window(rules, block, stride, page):
    names, op = rules.names, rules.op
    if not rules.strict:
        for key, value in (("block", block), ("stride", stride), ("page", page)):
            if value < 1:
                raise invalid(op, f"{names[key]} must be >= 1, got {value}")
        return
    for key, value in (("block", block), ("stride", stride)):
        if value <= 0 or value % 16:
            raise tiling(op, f"{names[key]} must be a positive multiple of 16, got {value}")
    if block > MAX_BLOCK:
        raise tiling(op, f"{names['block']} must be <= {MAX_BLOCK}, got {block}")
    if stride not in STRIDES:
        raise tiling(op, f"{names['stride']} must be one of {', '.join(map(str, STRIDES))}, "
                         f"got {stride}")
    if block < stride:
        raise tiling(op, f"{names['block']} must be >= {names['stride']}, got "
                         f"{names['block']}={block} and {names['stride']}={stride}")
    if page not in PAGE_SIZES:
        raise tiling(op, f"{names['page']} must be 64 or 128, got {page}")


def _check_heads(rules, N, D):
    op, name = rules.op, rules.names["input"]
    if not rules.strict:
        return
    if D % 16 or D > MAX_D:
        raise tiling(op, f"{name} head dim D must be a multiple of 16 and <= {MAX_D}, got {D}")
    if N > MAX_N or (N > EVEN_N_ABOVE and N % 2):
        raise tiling(op, f"{name} head count N must be <= {MAX_N}, and even above "
                         f"{EVEN_N_ABOVE}, got {N}")


def _check_layout(rules, layout):
    if layout is None or (isinstance(layout, str) and layout == "TND"):
        return
    layout_name = rules.names.get("layout", "layout")
    raise tiling(rules.op, f"{layout_name} must be 'TND' (or None) without a "
                           f"{rules.names['block_table']}, got {layout!r}")


# -- the writers' table (compiled) -------------------------------------------------------

#: error codes of _writer_tables
_OK, _NEGATIVE, _CAPACITY, _PAST_T, _SLOT, _PAGE, _REPEATED = range(7)


@jit
def _writer_tables(lengths, slots, table, paged, page, block, stride, rows, pages, total,
                   unique):
    """(code, at, other, writer slots [W], sources [W, l, 2]) of a decoding step.

    ``code`` is _OK or the first error found, ``at`` the sequence (or, for _PAGE,
    ``b * l + j``) it concerns, ``other`` a second value for the message. Sources are
    (page, row) per token: through ``table`` when ``paged``, else page 0 and the
    packed row. ``unique``: repeated slots are an error; else the last writer of a
    slot (highest b) is the one kept.
    """
    B = lengths.size
    starts = np.zeros(B, np.int64)
    writers = 0
    acc = 0
    for b in range(B):
        s = lengths[b]
        if s < 0:
            return _NEGATIVE, b, s, np.zeros(0, np.int64), np.zeros((0, block, 2), np.int64)
        if paged:
            if s > table.shape[1] * page:
                return (_CAPACITY, b, s, np.zeros(0, np.int64),
                        np.zeros((0, block, 2), np.int64))
        else:
            starts[b] = acc
            acc += s
            if acc > total:
                return _PAST_T, b, acc, np.zeros(0, np.int64), np.zeros((0, block, 2), np.int64)
        if s >= block and (s - block) % stride == 0:
            writers += 1
    who = np.zeros(writers, np.int64)
    w = 0
    for b in range(B):
        s = lengths[b]
        if s >= block and (s - block) % stride == 0:
            if slots[b] < 0 or slots[b] >= rows:
                return _SLOT, b, slots[b], np.zeros(0, np.int64), np.zeros((0, block, 2), np.int64)
            who[w] = b
            w += 1
    # repeated rows: sort the writers by slot (stable: b order within a slot)
    order = np.argsort(slots[who], kind="mergesort")
    keep = np.ones(writers, np.bool_)
    for k in range(1, writers):
        if slots[who[order[k]]] == slots[who[order[k - 1]]]:
            if unique:
                return (_REPEATED, who[order[k]], who[order[k - 1]], np.zeros(0, np.int64),
                        np.zeros((0, block, 2), np.int64))
            keep[order[k - 1]] = False
    kept = who[keep]
    source = np.empty((kept.size, block, 2), np.int64)
    for i in range(kept.size):
        b = kept[i]
        first = lengths[b] - block
        for j in range(block):
            p = first + j
            if paged:
                q = table[b, p // page]
                if q < 0 or q >= pages:
                    return (_PAGE, b * block + j, q, np.zeros(0, np.int64),
                            np.zeros((0, block, 2), np.int64))
                source[i, j, 0] = q
                source[i, j, 1] = p % page
            else:
                source[i, j, 0] = 0
                source[i, j, 1] = starts[b] + p
    return _OK, 0, 0, slots[kept], source


def _raise_for(rules, code, at, other, block, lengths, slots, table, page, total, rows, pages):
    names, op = rules.names, rules.op
    seq, slot_name, table_name = names["actual_seq_len"], names["slot_mapping"], \
        names["block_table"]
    if code == _NEGATIVE:
        raise invalid(op, f"{seq} values must be >= 0, got {other} at index {at}")
    if code == _CAPACITY:
        raise invalid(op, f"{seq}[{at}] = {other} exceeds what {table_name} row {at} holds: "
                          f"{table.shape[1]} page(s) of {names['page']} = {page} tokens = "
                          f"{table.shape[1] * page}")
    if code == _PAST_T:
        raise invalid(op, f"{seq} (per-sequence lengths, packed back to back) must sum to at "
                          f"most T = {total} ({names['input']}.shape[0]), got {other} after "
                          f"index {at}: {_seqlens._show(lengths)}")
    if code == _SLOT:
        raise invalid(op, f"{slot_name}[{at}] = {other} is outside the {rows} rows of "
                          f"{names['cache']} (sequence {at} writes: {seq}[{at}] = "
                          f"{lengths[at]} is on a window boundary)")
    if code == _PAGE:
        b, j = divmod(at, block)
        p = lengths[b] - block + j
        raise invalid(op, f"{table_name}[{b}, {p // page}] = {other} is outside the {pages} "
                          f"pages of {names['input']} [0, {pages}) (sequence {b} reads its "
                          f"token {p} there)")
    if code == _REPEATED:
        raise invalid(op, f"{slot_name} gives cache row {slots[at]} to sequences {other} and "
                          f"{at}, which both write at this step; rows must not repeat among "
                          f"writing sequences (the NPU's result is then unstable"
                          f"{'; strict=False keeps the last' if 'strict' in names else ''})")
    raise AssertionError(f"unknown writer-table code {code}")


# -- the planner -------------------------------------------------------------------------

def plan_infer(rules, x, weight, slot_mapping, block, stride, page, block_table,
               actual_seq_len, seq_type, layout, cache):
    """Check a decoding step and plan it (:class:`InferPlan`); NsaError if invalid."""
    names, op = rules.names, rules.op
    for key, a in (("input", x), ("weight", weight), ("slot_mapping", slot_mapping),
                   ("cache", cache)):
        if a is None:
            raise missing(op, names[key])
    if actual_seq_len is None:
        raise missing(op, names["actual_seq_len"])
    block, stride, page = check_int(rules, "block", block), check_int(rules, "stride", stride), \
        check_int(rules, "page", page)
    seq_type = check_int(rules, "actual_seq_len_type", seq_type)
    if seq_type != _seqlens.LENGTHS:
        type_name = names.get("actual_seq_len_type", "actual_seq_len_type")
        raise tiling(op, f"{type_name} must be 1 (per-sequence lengths, "
                         f"the only kind this operator takes), got {seq_type}")
    _check_window(rules, block, stride, page)
    paged = block_table is not None
    x = _array(rules, "input", x, 4 if paged else 3,
               f"[block_num, {names['page']}, N, D] (with a {names['block_table']})"
               if paged else f"[T, N, D] (without a {names['block_table']})")
    if not paged:
        _check_layout(rules, layout)
    N, D = x.shape[-2:]
    if paged and x.shape[1] != page:
        raise invalid(op, f"{names['input']}.shape[1] must equal {names['page']} = {page} "
                          f"(input [block_num, {names['page']}, N, D]), got shape {x.shape}")
    weight = _array(rules, "weight", weight, 2, f"[{names['block']}, N]")
    if weight.dtype != x.dtype:
        raise invalid(op, f"{names['weight']} dtype must equal {names['input']} dtype "
                          f"{x.dtype}, got {weight.dtype}")
    if weight.shape[1] != N:
        raise tiling(op, f"{names['weight']} heads weight.shape[1] = {weight.shape[1]} must "
                         f"equal {names['input']} heads N = {N}")
    if weight.shape[0] != block:
        raise invalid(op, f"{names['weight']} must have shape ({names['block']}, N) = "
                          f"({block}, {N}), got {weight.shape}")
    _check_heads(rules, N, D)
    cache = _array(rules, "cache", cache, 3, "[rows, N, D]")
    if cache.dtype != x.dtype:
        raise invalid(op, f"{names['cache']} dtype must equal {names['input']} dtype "
                          f"{x.dtype}, got {cache.dtype}")
    if cache.shape[1:] != (N, D):
        raise invalid(op, f"{names['cache']} must have shape (rows, N, D) = (rows, {N}, {D}), "
                          f"got {cache.shape}")
    if not cache.flags.writeable:
        raise invalid(op, f"{names['cache']} must be writable, got a read-only array")
    pages = x.shape[0] if paged else 1
    if rules.strict and paged and cache.shape[0] * stride <= pages * page - block:
        bound = (pages * page - block) / stride
        raise tiling(op, f"{names['cache']} must have more than (block_num * {names['page']} "
                         f"- {names['block']}) / {names['stride']} = ({pages} * {page} - "
                         f"{block}) / {stride} = {bound:g} rows (at least "
                         f"{(pages * page - block) // stride + 1}), got {cache.shape[0]}")
    slots = _indices(rules, "slot_mapping", slot_mapping, 1)
    if rules.strict and slots.size == 0:
        raise invalid(op, f"{names['slot_mapping']} must not be empty (one cache row per "
                          f"sequence), got none")
    lengths = _seqlens.as_int_vector(op, names["actual_seq_len"], actual_seq_len)
    if lengths.size != slots.size:
        raise invalid(op, f"{names['actual_seq_len']} and {names['slot_mapping']} must have "
                          f"one value per sequence, got {lengths.size} and {slots.size}")
    if paged:
        table = _indices(rules, "block_table", block_table, 2)
        if table.shape[0] != slots.size:
            raise invalid(op, f"{names['block_table']} must have one row per sequence "
                              f"({slots.size}), got shape {table.shape}")
    else:
        table = np.zeros((0, 0), np.int64)
    total = x.shape[0] if not paged else 0
    code, at, other, writer_slots, source = _writer_tables(
        lengths, slots, table, paged, page, block, stride, cache.shape[0], pages, total,
        rules.strict)
    if code != _OK:
        _raise_for(rules, code, int(at), int(other), block, lengths, slots, table, page, total,
                   cache.shape[0], pages)
    arrays = {"input": x, "weight": weight, "cache": cache}
    for key, a in (("slot_mapping", slot_mapping), ("block_table", block_table)):
        if isinstance(a, np.ndarray):
            arrays[key] = a
    check_no_overlap(rules, {"cache": cache}, {k: a for k, a in arrays.items() if k != "cache"})
    elements = -(-N * D // 16) * 16
    return InferPlan(dtype=x.dtype, N=N, D=D, block=block, writers=int(writer_slots.size),
                     slots=writer_slots, source=source, scratch_slots=scratch_slots(),
                     scratch_elements=elements, arrays=arrays)
