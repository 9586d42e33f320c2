"""Validation and planning of the training compress operators: their rules and
planners (``_ops.operators`` registers them with the pipeline).

``plan_forward`` and ``plan_grad`` check every argument, work out the sequence
geometry and the tile schedule, and return a :class:`Plan`. Nothing is written or
allocated before a plan exists, so a rejected call leaves every output untouched.
(A call that comes again with everything these checks read unchanged, its
signature, runs the prepared call of the first, ``_ops.pipeline``; the checks it skips
would have given the same answers.) The Python API (``nsa_numba.nsa_compress``...),
torch and the aclnn mirror differ only in the :class:`Rules` they pass: parameter
names, the dtypes allowed, whether missing outputs are allocated, and strictness.

Tiles
-----
Sequences are the packed ones of TND or the batch rows of a padded layout (all
viewed as ``[B, S, N, D]``, see ``_ops.layouts``). Windows of each sequence are cut into
runs of ``W`` windows (``windows_per_tile``). A tile is one run, all heads; the
kernels take one tile at a time (``_core.launch``).
``W`` depends on the problem only, never on the thread count, which is what makes
the weight-gradient reduction (serial over tiles, in tile order) deterministic.

* forward: a tile owns output rows of its windows;
* backward: a tile owns the input-gradient rows of the tokens from its first
  window's start up to the next tile's first window start (the first tile of a
  sequence from the sequence start, the last up to the sequence end, so tokens no
  window covers get their zeros too). A sequence with tokens but no window gets one
  window-less tile for those zeros.

Each tile also owns its float32 weight-gradient partial ``[N, l]`` in the workspace.

Workspace
---------
The run phase keeps all its scratch in one caller-provided byte buffer (the aclnn
protocol), in accumulator-dtype elements (4 bytes; 8 for float64):

* backward: ``n_tiles * N * l`` weight-gradient partials, rounded up to 16 elements;
* one scratch slot per thread Numba may run (``NUMBA_NUM_THREADS``): the forward's
  ring of open windows (``ceil(l/d) * N * D + D``), or the backward's ring of
  decoded gradient rows and per-element weight-gradient sums
  (``(ceil(l/d) + 1 + l) * N * D + 2 * D``), each rounded up to 16 elements.

Slots are the launch's threads (``_core.launch``); what a slot holds never reaches a result
through anything but the fixed-order sums above.
"""

from dataclasses import dataclass, field

import numpy as np

from .._core import pool as _pool
from .._core.cache import BoundedCache
from .._core.errors import invalid, missing
from .._core.jit import BOUNDSCHECK, jit
from .._kernels.tiles import (
    BATCH,
    G0,
    G1,
    I0,
    I1,
    KW0,
    N_TILE_COLUMNS,
    NW,
    S0,
    TOK_HI,
    TOK_LO,
    backward_scratch_elements,
    forward_scratch_elements,
)
from . import seqlens as _seqlens
from .checks import (
    ACCUMULATOR,
    STORAGE,
    WORKSPACE_ALIGN,
    check_array,
    check_int,
    check_no_overlap,
    check_output,
    check_same_dtype,
    kind_of,
    round16,
    scratch_slots,
)
from .layouts import LAYOUTS, c_carrier, word_view

#: target input elements per tile (all heads): big enough to amortise the window
#: overlap at tile edges and the per-tile setup, small enough to spread work over
#: the cores and keep a tile's decoded gradient rows in cache
TILE_ELEMENTS = 1 << 16
#: and at least this many window lengths of tokens per tile: forward, backward. A
#: backward tile also zeroes and folds ``l * N * D`` weight-gradient sums, which costs
#: about 2/TILE_BLOCKS of its input streaming; the forward has no such cost and was
#: slower with longer tiles (docs/performance.md, "Figures behind the code's choices")
TILE_BLOCKS = {"forward": 8, "grad": 32}


#: roles the kernels only read, and roles they write
INPUT_ROLES = ("input", "grad")
OUTPUT_ROLES = ("out", "input_grad", "weight_grad")
#: outputs the kernels take as [B, S, N, D] views
VIEWED_OUTPUTS = ("out", "input_grad")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated training problem (either compress operator), ready to run.

    ``arrays`` maps role names (``input``, ``weight``, ``grad``, ``out``,
    ``input_grad``, ``weight_grad``) to the caller's arrays, ``views`` the big ones to
    their ``[B, S, N, D]`` views; ``storage(role)`` gives what the kernels take.
    ``pending``: the outputs the caller left to be allocated, role -> shape
    (``allocate`` fills them in).

    What the pipeline reads of every operator's plan (``_ops.pipeline``): ``op``,
    ``dtype``, ``arrays``, ``allocate()``, ``workspace_bytes``, ``threads_useful``
    and ``summary()``.
    """
    op: str
    dtype: np.dtype
    layout: str
    B: int
    S: int                         # tokens per batch row (T for TND)
    N: int
    D: int
    block: int
    stride: int
    out_rows: int                  # windows per batch row (T' for TND)
    tiles: np.ndarray              # [n_tiles, N_TILE_COLUMNS] int64, columns BATCH ... G1
    partial_elements: int          # weight-gradient partials at the workspace start
    scratch_slots: int             # per-thread scratch rows after them
    scratch_elements: int          # elements per row
    arrays: dict
    views: dict
    pending: dict = field(default_factory=dict)

    def allocate(self):
        """Allocate the pending outputs (from the output pool), once every check has
        passed."""
        for role, shape in self.pending.items():
            if self.arrays[role] is None:
                a = self.arrays[role] = _pool.empty(shape, self.dtype)
                if role in VIEWED_OUTPUTS:
                    self.views[role] = LAYOUTS[self.layout].view4(a, self.N)

    def summary(self):
        """The problem in a few words (``aclOpExecutor``'s repr)."""
        return f"{self.op} {self.layout} B={self.B} S={self.S} N={self.N} D={self.D}"

    @property
    def scratch_bytes(self):
        """Bytes of the partials and the per-thread scratch rows."""
        count = self.partial_elements + self.scratch_slots * self.scratch_elements
        return count * self.accumulator.itemsize

    @property
    def workspace_bytes(self):
        """Bytes a caller allocates: ``scratch_bytes``, and room to start them at a
        WORKSPACE_ALIGN-byte boundary of a buffer at any address."""
        used = self.scratch_bytes
        return used + WORKSPACE_ALIGN - 1 if used else 0

    @property
    def threads_useful(self):
        """Most threads worth waking for this plan: one per tile, and no more than
        one per TILE_ELEMENTS of input (many short sequences make many small
        tiles; waking a thread costs about as much as reading 100 KiB)."""
        work = -(-self.B * self.S * self.N * self.D // TILE_ELEMENTS)
        return max(1, min(self.tiles.shape[0], work))

    @property
    def accumulator(self):
        return ACCUMULATOR[kind_of(self.dtype)]

    def storage(self, role, workspace=None):
        """What the kernels take for ``role``: its ``[B, S, N, D]`` view (as a padded
        C-contiguous carrier when possible, except in the bounds-checked build, which
        must check against the array's own extent) or its array, in the storage dtype;
        an input read at a step of 2 or 4 elements as words (``_ops.layouts.word_view``)
        when their gap bytes are not written by the run (outputs, ``workspace``)."""
        storage = STORAGE[kind_of(self.dtype)]
        if role == "weight":
            return weight_storage(self.arrays[role], storage)
        if role not in self.views:
            return self.arrays[role].view(storage)
        view = self.views[role].view(storage)
        if role in INPUT_ROLES:
            written = [self.arrays[k] for k in OUTPUT_ROLES if k in self.arrays]
            if workspace is not None:
                written.append(workspace)
            words = word_view(view, storage, avoid=written)
            if words is not None:
                view = words
        return view if BOUNDSCHECK else c_carrier(view)


def weight_storage(weight, storage):
    """The weight as the kernels take it: in ``storage``, C-contiguous and writable
    (a copy of its l * N elements when it is not), so that any weight array runs the
    kernels compiled for that one variant."""
    w = weight.view(storage)
    return w if w.flags.c_contiguous and w.flags.writeable else w.copy()


# -- argument checks -------------------------------------------------------------


def _check_window(rules, block, stride):
    lname, dname = rules.names["block"], rules.names["stride"]
    block = check_int(rules, "block", block)
    stride = check_int(rules, "stride", stride)
    if rules.strict:
        for name, value in ((lname, block), (dname, stride)):
            if value <= 0 or value % 16:
                raise invalid(rules.op, f"{name} must be a positive multiple of 16, "
                                        f"got {value}")
        # both operators: the grad documentation says l > d, but the NPU's grad
        # tiling checks only multiples of 16 and its kernel has a path for windows
        # that do not overlap (l == d), which MindSpore's NPU tests exercise
        if block < stride:
            raise invalid(rules.op, f"{lname} must be >= {dname}, got {lname}={block} "
                                    f"and {dname}={stride}")
    else:
        for name, value in ((lname, block), (dname, stride)):
            if value < 1:
                raise invalid(rules.op, f"{name} must be >= 1, got {value}")
    return block, stride


def _check_layout(rules, layout):
    name = rules.names.get("layout", "layout")
    if layout is None:
        return LAYOUTS["TND"]
    if not isinstance(layout, str):
        raise invalid(rules.op, f"{name} must be a string or None, got {layout!r} "
                                f"({type(layout).__name__})")
    if layout not in LAYOUTS:
        choices = ", ".join(repr(k) for k in LAYOUTS)
        raise invalid(rules.op, f"{name} must be one of {choices} (or None, meaning "
                                f"'TND'), got {layout!r}")
    return LAYOUTS[layout]


def _check_seq_type(rules, seq_type):
    value = check_int(rules, "actual_seq_len_type", seq_type)
    if value not in (_seqlens.CUMULATIVE, _seqlens.LENGTHS):
        name = rules.names.get("actual_seq_len_type", "actual_seq_len_type")
        raise invalid(rules.op, f"{name} must be 0 (cumulative ends) or 1 (per-sequence "
                                f"lengths), got {value}")
    return value


def _check_present(rules, **arrays):
    """161001 for the first required array that is None, before any other check."""
    for key, a in arrays.items():
        if a is None:
            raise missing(rules.op, rules.names[key])


def _check_input_and_weight(rules, layout, x, weight, block):
    """(x, weight, (B, S, N, D))."""
    x = check_array(rules, "input", x, layout.ndim, _dims(rules, layout))
    weight = check_array(rules, "weight", weight, 2, f"[{rules.names['block']}, N]")
    check_same_dtype(rules, "weight", weight, "input", x.dtype)
    xname, wname = rules.names["input"], rules.names["weight"]
    heads = weight.shape[1]
    if layout.name in ("BSH", "SBH"):
        H = x.shape[2]
        if heads == 0 or H % heads:
            raise invalid(rules.op, f"{xname} hidden size H = shape[2] = {H} must be a "
                                    f"multiple of N = {wname}.shape[1] = {heads} "
                                    f"(H = N * D with {_layout_is(rules, layout)})")
    B, S, N, D = layout.sizes(x.shape, heads)
    if rules.strict and D % 16:
        raise invalid(rules.op, f"{xname} head dim D must be a multiple of 16, got {D} "
                                f"(shape {x.shape}{_with_layout(rules, layout)})")
    if weight.shape != (block, N):
        raise invalid(rules.op, f"{wname} must have shape ({rules.names['block']}, N) = "
                                f"({block}, {N}), got {weight.shape}")
    return x, weight, (B, S, N, D)


@dataclass(frozen=True)
class Sequences:
    """Where each sequence lives and where its windows go, one entry per sequence."""
    batch: np.ndarray       # batch row of the [B, S, N, D] view
    start: np.ndarray       # first token, within that row
    length: np.ndarray      # tokens
    first_row: np.ndarray   # output row (within the batch row) of its first window
    windows: np.ndarray     # windows
    out_rows: int           # output rows per batch row: T' (TND) or S'


#: most geometries whose tables ``_tables`` keeps, and most bytes they may hold
#: (tables bigger than an eighth of that are not kept: their calls are long anyway)
TABLE_CACHE_ENTRIES = 64
TABLE_CACHE_BYTES = 8 << 20
_table_cache = BoundedCache(TABLE_CACHE_ENTRIES, TABLE_CACHE_BYTES)


def _tables(rules, op, layout, B, S, block, stride, N, D, actual_seq_len, seq_type):
    """(Sequences, tile table) of a problem.

    A model calls the operators once per layer with the same sequence lengths, and
    building the tables is a measurable part of planning a call that finds the
    caches cold (docs/performance.md, "Figures behind the code's choices"). So the
    last TABLE_CACHE_ENTRIES geometries keep theirs, keyed on everything
    the tables depend on: the op (the tile sizes differ), the layout kind, the
    sequence values as checked integers and how to read them, B, S, l, d, N and D.
    Values that fail a check raise before anything is kept, so a kept entry only
    ever answers values that passed. The tables are shared by the plans that use
    them: nothing writes them. (The prepared-call cache, ``_ops.pipeline``, answers a call
    that comes again with the same arrays' layout before planning starts; these tables
    serve the calls it cannot: strided and padded-layout arrays, aclnn's phase one, and
    every signature's first call. docs/design.md, "Calls that come again".)
    """
    if layout.packed:
        values, kind = _seqlens.sequence_values(rules.op, actual_seq_len, seq_type, S,
                                                rules.names)
        key = (op, True, values.tobytes(), kind, S, block, stride, N, D)
    else:
        _check_no_sequences(rules, layout, actual_seq_len)
        values = kind = None
        key = (op, False, B, S, block, stride, N, D)
    kept = _table_cache.get(key)
    if kept is None:
        seqs = _sequences(rules, layout, B, S, block, stride, values, kind)
        tiles = tile_schedule(op, seqs, block, stride, N, D)
        kept = seqs, tiles
        _table_cache.put(key, kept, _table_bytes(key, seqs, tiles))
    seqs, tiles = kept
    if rules.strict and seqs.out_rows == 0:             # no sequence has a window
        raise invalid(rules.op, f"no sequence is as long as {rules.names['block']} = "
                                f"{block}, so there is no window (T' = 0); sequence "
                                f"lengths {_seqlens._show(seqs.length)}")
    return seqs, tiles


def forget_tables():
    """Drop every kept table (tests use it to start from none)."""
    _table_cache.clear()


def _table_bytes(key, seqs, tiles):
    arrays = (seqs.batch, seqs.start, seqs.length, seqs.first_row, seqs.windows, tiles)
    return sum(a.nbytes for a in arrays) + sum(len(k) for k in key if isinstance(k, bytes))


def _check_no_sequences(rules, layout, actual_seq_len):
    """A padded layout takes no sequence lengths: each batch row is one sequence."""
    if actual_seq_len is not None:
        raise invalid(rules.op, f"{rules.names['actual_seq_len']} must be None with "
                                f"{_layout_is(rules, layout)} (each batch row is one "
                                f"sequence of length S), got {_seqlens._show(actual_seq_len)}")


def _sequences(rules, layout, B, S, block, stride, values, kind):
    """The Sequences of a problem (``_tables`` keeps them); a packed layout's from
    the type-checked ``values`` and ``kind`` of ``_ops.seqlens.sequence_values``."""
    if layout.packed:
        offsets, lengths, counts, rows = _seqlens.packed_tables(
            rules.op, values, kind, S, block, stride, rules.names)
        seqs = Sequences(np.zeros(lengths.size, np.int64), offsets[:-1], lengths, rows[:-1],
                         counts, int(rows[-1]))
    else:
        lengths = np.full(B, S, np.int64)
        counts = _seqlens.window_counts(lengths, block, stride)
        seqs = Sequences(np.arange(B, dtype=np.int64), np.zeros(B, np.int64), lengths,
                         np.zeros(B, np.int64), counts, int(counts[0]) if B else 0)
    return seqs


# -- tile schedule ---------------------------------------------------------------

def windows_per_tile(op, block, stride, N, D):
    """Windows per tile for ``op`` ("forward" or "grad"): at least
    ``TILE_BLOCKS[op] * l`` tokens (the backward's per-tile weight-gradient fold is
    over ``l * N * D`` sums) and enough input elements to amortise the per-tile
    setup."""
    by_block = -(-TILE_BLOCKS[op] * block // stride)
    by_size = TILE_ELEMENTS // max(1, stride * N * D)
    return max(1, by_block, by_size)


def tile_schedule(op, seqs, block, stride, N, D):
    """The tile table described in the module docstring, one row per tile.

    Columns (named in ``_kernels.tiles``): BATCH the batch row, S0 sequence start token
    (within the row), NW windows in the sequence, KW0 output row of its first
    window, I0..I1 the tile's windows (sequence-local), TOK_LO..TOK_HI the tokens
    whose input gradient it owns, G0..G1 the windows that touch those tokens.
    """
    return _fill_tiles(seqs.batch, seqs.start, seqs.length, seqs.first_row, seqs.windows,
                       windows_per_tile(op, block, stride, N, D), block, stride)


@jit
def _fill_tiles(batch, start, length, first_row, windows, per_tile, block, stride):
    """``tile_schedule``'s table (compiled: on small problems the NumPy version of
    this took a third of the planning time)."""
    n_tiles = np.zeros(windows.size, np.int64)
    for q in range(windows.size):
        if windows[q] > 0:
            n_tiles[q] = -(-windows[q] // per_tile)
        elif length[q] > 0:
            n_tiles[q] = 1              # tokens but no window: zeros for their gradient
    tiles = np.empty((n_tiles.sum(), N_TILE_COLUMNS), dtype=np.int64)
    row = 0
    for q in range(windows.size):
        s0, nw = start[q], windows[q]
        for c in range(n_tiles[q]):
            i0 = min(c * per_tile, nw)
            i1 = min(i0 + per_tile, nw)
            tok_lo = s0 if c == 0 else s0 + i0 * stride
            tok_hi = s0 + length[q] if c == n_tiles[q] - 1 else s0 + i1 * stride
            g0 = max(0, (tok_lo - s0 - block) // stride + 1)
            tiles[row, BATCH] = batch[q]
            tiles[row, S0] = s0
            tiles[row, NW] = nw
            tiles[row, KW0] = first_row[q]
            tiles[row, I0] = i0
            tiles[row, I1] = i1
            tiles[row, TOK_LO] = tok_lo
            tiles[row, TOK_HI] = tok_hi
            tiles[row, G0] = g0
            tiles[row, G1] = max(g0, min(nw, (tok_hi - 1 - s0) // stride + 1))
            row += 1
    return tiles


# -- the two planners ------------------------------------------------------------

def _layout_is(rules, layout):
    return f"{rules.names.get('layout', 'layout')}={layout.name!r}"


def _with_layout(rules, layout):
    """" with layout='TND'" where the entry point takes a layout, else nothing."""
    return f" with {_layout_is(rules, layout)}" if "layout" in rules.names else ""


def _dims(rules, layout):
    if "layout" not in rules.names:
        return f"[{layout.dims}]"
    return f"[{layout.dims}] ({_layout_is(rules, layout)})"


def _window_dims(rules, layout):
    if "layout" not in rules.names:
        return f"[{layout.dims}] (windows in place of tokens)"
    return f"[{layout.dims}] ({_layout_is(rules, layout)}, windows in place of tokens)"


def plan_forward(rules, x, weight, block, stride, actual_seq_len, seq_type, layout, out):
    _check_present(rules, input=x, weight=weight,
                   **({} if rules.allocate_outputs else {"out": out}))
    block, stride = _check_window(rules, block, stride)
    layout = _check_layout(rules, layout)
    x, weight, (B, S, N, D) = _check_input_and_weight(rules, layout, x, weight, block)
    seq_type = _check_seq_type(rules, seq_type)
    seqs, tiles = _tables(rules, "forward", layout, B, S, block, stride, N, D,
                          actual_seq_len, seq_type)
    given = {"out": out} if out is not None else {}
    out_shape = layout.shape(B, seqs.out_rows, N, D)
    out = check_output(rules, "out", out, out_shape, x.dtype, _window_dims(rules, layout))
    check_no_overlap(rules, given, {"input": x, "weight": weight})
    scratch = forward_scratch_elements(N, D, block, stride)
    views = {"input": layout.view4(x, N)}
    if out is not None:
        views["out"] = layout.view4(out, N)
    return Plan(op="forward", dtype=x.dtype, layout=layout.name, B=B, S=S, N=N, D=D,
                block=block, stride=stride, out_rows=seqs.out_rows, tiles=tiles,
                partial_elements=0, scratch_slots=scratch_slots(),
                scratch_elements=round16(scratch),
                arrays={"input": x, "weight": weight, "out": out}, views=views,
                pending={} if out is not None else {"out": out_shape})


def plan_grad(rules, grad, x, weight, block, stride, actual_seq_len, seq_type, layout,
              input_grad, weight_grad):
    outputs = {} if rules.allocate_outputs else {"input_grad": input_grad,
                                                  "weight_grad": weight_grad}
    _check_present(rules, grad=grad, input=x, weight=weight, **outputs)
    block, stride = _check_window(rules, block, stride)
    layout = _check_layout(rules, layout)
    x, weight, (B, S, N, D) = _check_input_and_weight(rules, layout, x, weight, block)
    grad = check_array(rules, "grad", grad, layout.ndim, _window_dims(rules, layout))
    check_same_dtype(rules, "grad", grad, "input", x.dtype)
    seq_type = _check_seq_type(rules, seq_type)
    seqs, tiles = _tables(rules, "grad", layout, B, S, block, stride, N, D, actual_seq_len,
                          seq_type)
    expected = layout.shape(B, seqs.out_rows, N, D)
    if grad.shape != expected:
        raise invalid(rules.op, f"{rules.names['grad']} must have shape "
                                f"{_window_dims(rules, layout)} = {expected} (the windows of each "
                                f"sequence), got {grad.shape}")
    given = {k: v for k, v in (("input_grad", input_grad), ("weight_grad", weight_grad))
             if v is not None}
    input_grad = check_output(rules, "input_grad", input_grad, x.shape, x.dtype,
                               _dims(rules, layout))
    weight_grad = check_output(rules, "weight_grad", weight_grad, weight.shape, x.dtype,
                                f"[{rules.names['block']}, N]")
    check_no_overlap(rules, given, {"grad": grad, "input": x, "weight": weight})
    scratch = backward_scratch_elements(N, D, block, stride)
    views = {"grad": layout.view4(grad, N), "input": layout.view4(x, N)}
    if input_grad is not None:
        views["input_grad"] = layout.view4(input_grad, N)
    pending = {role: shape for role, a, shape in (("input_grad", input_grad, x.shape),
                                                  ("weight_grad", weight_grad, weight.shape))
               if a is None}
    return Plan(op="grad", dtype=x.dtype, layout=layout.name, B=B, S=S, N=N, D=D,
                block=block, stride=stride, out_rows=seqs.out_rows, tiles=tiles,
                partial_elements=round16(tiles.shape[0] * N * block),
                scratch_slots=scratch_slots(), scratch_elements=round16(scratch),
                arrays={"grad": grad, "input": x, "weight": weight,
                        "input_grad": input_grad, "weight_grad": weight_grad},
                views=views, pending=pending)


# -- signatures (the pipeline's calls that come again) ----------------------------
# A call's signature is everything the checks above read of it (types, dtypes,
# shapes, strides, writability, the integers and the sequence values; never the
# contents), exactly, or None where equality would not mean the same checks: arrays
# of exactly numpy.ndarray, integers of exactly int (True == 1 and 1.0 == 1 in
# Python, and the checks reject both), sequence lengths as a list or tuple of int or
# a 1-D integer array, the layout as a str or None. The weight's writability counts:
# the kernels take a writable weight. They are written out in full, not built in
# loops: after a cache flush every bytecode a call runs is a miss (docs/
# performance.md, "Figures behind the code's choices").

_INT = {int}


def _sequence_key(block, stride, seq, seq_type, layout):
    """The sequence lengths' part of a signature, or None when they, or the call's
    scalars, cannot be compared exactly."""
    if not (type(block) is int and type(stride) is int and type(seq_type) is int
            and (layout is None or type(layout) is str)):
        return None
    if seq is None:
        return ()
    kind = type(seq)
    if kind is list or kind is tuple:
        values = tuple(seq)
        return values if set(map(type, values)) == _INT else None
    if kind is np.ndarray and seq.ndim == 1 and seq.dtype.kind in "iu":
        return seq.dtype.str, seq.tobytes()
    return None


def _output_key(a):
    """An output's part of a signature (False: to be allocated), or None."""
    if a is None:
        return False
    if type(a) is np.ndarray:
        return a.dtype, a.shape, a.strides, a.flags.writeable
    return None


def forward_signature(rules, x, weight, block, stride, seq, seq_type, layout, out):
    """The signature of a forward call, or None."""
    if not (type(x) is np.ndarray and type(weight) is np.ndarray):
        return None
    sequences = _sequence_key(block, stride, seq, seq_type, layout)
    given = _output_key(out)
    if sequences is None or given is None:
        return None
    return ("forward", id(rules), block, stride, sequences, seq_type, layout,
            x.dtype, x.shape, x.strides,
            weight.dtype, weight.shape, weight.strides, weight.flags.writeable, given)


def grad_signature(rules, grad, x, weight, block, stride, seq, seq_type, layout,
                   input_grad, weight_grad):
    """The signature of a backward call, or None."""
    if not (type(grad) is np.ndarray and type(x) is np.ndarray
            and type(weight) is np.ndarray):
        return None
    sequences = _sequence_key(block, stride, seq, seq_type, layout)
    given_ig = _output_key(input_grad)
    given_wg = _output_key(weight_grad)
    if sequences is None or given_ig is None or given_wg is None:
        return None
    return ("grad", id(rules), block, stride, sequences, seq_type, layout,
            grad.dtype, grad.shape, grad.strides, x.dtype, x.shape, x.strides,
            weight.dtype, weight.shape, weight.strides, weight.flags.writeable,
            given_ig, given_wg)
