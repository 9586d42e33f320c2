"""Validation and planning: the one path every entry point goes through.

``plan_forward`` and ``plan_grad`` check every argument, work out the sequence
geometry and the tile schedule, and return a :class:`Plan`. Nothing is written
before a plan exists, so a rejected call leaves every output untouched. The Python
API (``nsa_numba.nsa_compress``...) and the aclnn mirror differ only in the
:class:`Rules` they pass: parameter names, the dtypes allowed, whether missing
outputs are allocated, and strictness.

Tiles
-----
Windows of each sequence are cut into runs of ``W`` windows (``windows_per_tile``).
A tile is one run, all heads; the parallel kernels run one tile per iteration.
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
  (``(ceil(l/d) + l) * N * D + 2 * D``), each rounded up to 16 elements.

Slots are indexed by Numba's thread id; what a slot holds never reaches a result
through anything but the fixed-order sums above.
"""

import numbers
from dataclasses import dataclass, field

import numba
import numpy as np

from . import _seqlens
from ._errors import invalid, missing
from . import _kernels
from ._kernels import G0, G1, I0, I1, KW0, N_TILE_COLUMNS, NW, S0, TOK_HI, TOK_LO

#: target input elements per tile (all heads): big enough to amortise the window
#: overlap at tile edges and the per-tile setup, small enough to spread work over
#: the cores and keep a tile's decoded gradient rows in cache
TILE_ELEMENTS = 1 << 16
#: and at least this many window lengths of tokens per tile
TILE_BLOCKS = 8

#: the supported dtypes, by name. bfloat16 arrays come from ml_dtypes, which the
#: library does not import (ml_dtypes 0.7.0 takes about 0.9 s to import): a
#: bfloat16 array exists only once its creator has imported it, and is recognised
#: by its dtype's name and size.
FLOAT16, BFLOAT16, FLOAT32, FLOAT64 = "float16", "bfloat16", "float32", "float64"
#: the dtype arrays of each kind are viewed as inside the kernels (see _halfprec)
STORAGE = {FLOAT16: np.dtype(np.uint16), BFLOAT16: np.dtype(np.int16),
           FLOAT32: np.dtype(np.float32), FLOAT64: np.dtype(np.float64)}
#: accumulation dtype: float32, except float64 problems
ACCUMULATOR = {FLOAT16: np.dtype(np.float32), BFLOAT16: np.dtype(np.float32),
               FLOAT32: np.dtype(np.float32), FLOAT64: np.dtype(np.float64)}


def kind_of(dtype):
    """The supported kind (a name above) of a numpy dtype, or None."""
    if dtype.name == BFLOAT16 and dtype.itemsize == 2 and dtype.kind == "V":
        return BFLOAT16
    for name in (FLOAT16, FLOAT32, FLOAT64):
        if dtype == np.dtype(name):   # native byte order only
            return name
    return None


_INT64_MAX = np.iinfo(np.int64).max

PY_NAMES = {
    "input": "input", "weight": "weight", "grad": "grad", "out": "out",
    "input_grad": "input_grad", "weight_grad": "weight_grad",
    "block": "compress_block_size", "stride": "compress_stride",
    "actual_seq_len": "actual_seq_len", "actual_seq_len_type": "actual_seq_len_type",
    "layout": "layout",
}


@dataclass(frozen=True)
class Rules:
    """What differs between entry points; the checks themselves do not."""
    op: str
    names: dict = field(default_factory=lambda: dict(PY_NAMES))
    dtypes: tuple = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
    strict: bool = True
    allocate_outputs: bool = True   # False: a None output is an error (161001)


@dataclass(frozen=True)
class Plan:
    """A validated problem, ready to run.

    ``arrays`` maps role names (``input``, ``weight``, ``grad``, ``out``,
    ``input_grad``, ``weight_grad``) to the caller's arrays; ``storage(role)`` gives
    the view the kernels take.
    """
    op: str
    dtype: np.dtype
    T: int
    N: int
    D: int
    block: int
    stride: int
    seq_offsets: np.ndarray        # [B + 1] token offsets
    window_offsets: np.ndarray     # [B + 1] output-row offsets; last = T'
    tiles: np.ndarray              # [n_tiles, N_TILE_COLUMNS] int64, columns S0 ... G1
    partial_elements: int          # weight-gradient partials at the workspace start
    scratch_slots: int             # per-thread scratch rows after them
    scratch_elements: int          # elements per row
    arrays: dict

    @property
    def workspace_bytes(self):
        count = self.partial_elements + self.scratch_slots * self.scratch_elements
        return count * self.accumulator.itemsize

    @property
    def n_windows(self):
        return int(self.window_offsets[-1])

    @property
    def accumulator(self):
        return ACCUMULATOR[kind_of(self.dtype)]

    def storage(self, role):
        return self.arrays[role].view(STORAGE[kind_of(self.dtype)])


# -- argument checks -------------------------------------------------------------

def _check_int(rules, key, value):
    name = rules.names[key]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise invalid(rules.op, f"{name} must be an integer, got {value!r} "
                                f"({type(value).__name__})")
    value = int(value)
    if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        raise invalid(rules.op, f"{name} must fit in int64, got {value}")
    return value


def _check_array(rules, key, a, ndim, dims):
    name = rules.names[key]
    if a is None:
        raise missing(rules.op, name)
    if not isinstance(a, np.ndarray):
        raise invalid(rules.op, f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.ndim != ndim:
        raise invalid(rules.op, f"{name} must be {ndim}-D {dims}, got {a.ndim}-D array "
                                f"of shape {a.shape}")
    if kind_of(a.dtype) not in rules.dtypes:
        allowed = ", ".join(rules.dtypes)
        raise invalid(rules.op, f"{name} dtype must be one of {allowed}, got {a.dtype}")
    if rules.strict and a.size == 0:
        raise invalid(rules.op, f"{name} must not be empty, got shape {a.shape}")
    return a


def _check_same_dtype(rules, dtype, key, a):
    if a.dtype != dtype:
        raise invalid(rules.op, f"{rules.names[key]} dtype must equal "
                                f"{rules.names['input']} dtype {dtype}, got {a.dtype}")


def _check_output(rules, key, a, shape, dtype, dims):
    """A caller-provided output, or a new one when the rules allow allocation."""
    if a is None and rules.allocate_outputs:
        return np.empty(shape, dtype=dtype)
    _check_array(rules, key, a, len(shape), dims)
    name = rules.names[key]
    if a.shape != tuple(shape):
        raise invalid(rules.op, f"{name} must have shape {tuple(shape)}, got {a.shape}")
    _check_same_dtype(rules, dtype, key, a)
    if not a.flags.writeable:
        raise invalid(rules.op, f"{name} must be writable, got a read-only array")
    return a


def _check_window(rules, block, stride, forward):
    lname, dname = rules.names["block"], rules.names["stride"]
    block = _check_int(rules, "block", block)
    stride = _check_int(rules, "stride", stride)
    if rules.strict:
        for name, value in ((lname, block), (dname, stride)):
            if value <= 0 or value % 16:
                raise invalid(rules.op, f"{name} must be a positive multiple of 16, "
                                        f"got {value}")
        if forward and block < stride:
            raise invalid(rules.op, f"{lname} must be >= {dname}, got {lname}={block} "
                                    f"and {dname}={stride}")
        if not forward and block <= stride:
            raise invalid(rules.op, f"{lname} must be > {dname}, got {lname}={block} "
                                    f"and {dname}={stride}")
    else:
        for name, value in ((lname, block), (dname, stride)):
            if value < 1:
                raise invalid(rules.op, f"{name} must be >= 1, got {value}")
    return block, stride


def _check_layout(rules, layout):
    name = rules.names["layout"]
    if layout is None:
        return "TND"
    if not isinstance(layout, str):
        raise invalid(rules.op, f"{name} must be a string or None, got {layout!r} "
                                f"({type(layout).__name__})")
    if layout != "TND":
        raise invalid(rules.op, f"{name} must be 'TND' (or None, meaning TND), "
                                f"got {layout!r}")
    return layout


def _check_seq_type(rules, seq_type):
    value = _check_int(rules, "actual_seq_len_type", seq_type)
    if value not in (_seqlens.CUMULATIVE, _seqlens.LENGTHS):
        raise invalid(rules.op, f"{rules.names['actual_seq_len_type']} must be 0 "
                                f"(cumulative ends) or 1 (per-sequence lengths), got {value}")
    return value


def _check_present(rules, **arrays):
    """161001 for the first required array that is None, before any other check."""
    for key, a in arrays.items():
        if a is None:
            raise missing(rules.op, rules.names[key])


def _check_input_and_weight(rules, x, weight, block):
    x = _check_array(rules, "input", x, 3, "[T, N, D]")
    weight = _check_array(rules, "weight", weight, 2, f"[{rules.names['block']}, N]")
    _check_same_dtype(rules, x.dtype, "weight", weight)
    T, N, D = x.shape
    if rules.strict and D % 16:
        raise invalid(rules.op, f"{rules.names['input']} head dim D = shape[2] must be a "
                                f"multiple of 16, got {D}")
    if weight.shape != (block, N):
        raise invalid(rules.op, f"{rules.names['weight']} must have shape "
                                f"({rules.names['block']}, N) = ({block}, {N}), "
                                f"got {weight.shape}")
    return x, weight


def _geometry(rules, T, block, stride, actual_seq_len, seq_type):
    offsets = _seqlens.sequence_offsets(rules.op, actual_seq_len, seq_type, T, rules.names)
    counts = _seqlens.window_counts(np.diff(offsets), block, stride)
    win_offsets = _seqlens.window_offsets(counts)
    if rules.strict and win_offsets[-1] == 0:
        raise invalid(rules.op, f"no sequence is as long as {rules.names['block']} = "
                                f"{block}, so there is no window (T' = 0); sequence "
                                f"lengths {_seqlens._show(np.diff(offsets))}")
    return offsets, win_offsets


# -- tile schedule ---------------------------------------------------------------

def windows_per_tile(block, stride, N, D):
    """Windows per tile: enough tokens to amortise the per-tile weight-gradient fold
    (over ``l * N * D`` sums, so at least ``TILE_BLOCKS * l`` tokens) and enough input
    elements to amortise the per-tile setup."""
    by_block = -(-TILE_BLOCKS * block // stride)
    by_size = TILE_ELEMENTS // max(1, stride * N * D)
    return max(1, by_block, by_size)


def tile_schedule(seq_offsets, win_offsets, block, stride, N, D):
    """The tile table described in the module docstring, one row per tile.

    Columns (named in ``_kernels``): S0 sequence start token, NW windows in the
    sequence, KW0 output row of its first window, I0..I1 the tile's windows
    (sequence-local), TOK_LO..TOK_HI the tokens whose input gradient it owns,
    G0..G1 the windows that touch those tokens.
    """
    starts = seq_offsets[:-1]
    lengths = np.diff(seq_offsets)
    counts = np.diff(win_offsets)
    per_tile = windows_per_tile(block, stride, N, D)
    n_tiles = np.where(counts > 0, -(-counts // per_tile), (lengths > 0).astype(np.int64))
    seq = np.repeat(np.arange(starts.size), n_tiles)
    first_tile = np.concatenate(([0], np.cumsum(n_tiles)[:-1]))
    c = np.arange(seq.size, dtype=np.int64) - np.repeat(first_tile, n_tiles)
    tiles = np.empty((seq.size, N_TILE_COLUMNS), dtype=np.int64)
    s0, nw = starts[seq], counts[seq]
    tiles[:, S0] = s0
    tiles[:, NW] = nw
    tiles[:, KW0] = win_offsets[:-1][seq]
    tiles[:, I0] = np.minimum(c * per_tile, nw)
    tiles[:, I1] = np.minimum(tiles[:, I0] + per_tile, nw)
    tiles[:, TOK_LO] = np.where(c == 0, s0, s0 + tiles[:, I0] * stride)
    last = c == n_tiles[seq] - 1
    tiles[:, TOK_HI] = np.where(last, s0 + lengths[seq], s0 + tiles[:, I1] * stride)
    tiles[:, G0] = np.maximum(0, (tiles[:, TOK_LO] - s0 - block) // stride + 1)
    tiles[:, G1] = np.maximum(tiles[:, G0], np.minimum(nw, (tiles[:, TOK_HI] - 1 - s0)
                                                       // stride + 1))
    return tiles


def _round16(elements):
    return -(-int(elements) // 16) * 16


def scratch_slots():
    """Threads a launch may use: Numba's ceiling, fixed at its start."""
    return int(numba.config.NUMBA_NUM_THREADS)


# -- the two planners ------------------------------------------------------------

def plan_forward(rules, x, weight, block, stride, actual_seq_len, seq_type, layout, out):
    _check_present(rules, input=x, weight=weight,
                   **({} if rules.allocate_outputs else {"out": out}))
    block, stride = _check_window(rules, block, stride, forward=True)
    x, weight = _check_input_and_weight(rules, x, weight, block)
    _check_layout(rules, layout)
    seq_type = _check_seq_type(rules, seq_type)
    T, N, D = x.shape
    offsets, win_offsets = _geometry(rules, T, block, stride, actual_seq_len, seq_type)
    out = _check_output(rules, "out", out, (int(win_offsets[-1]), N, D), x.dtype,
                        "[T', N, D]")
    tiles = tile_schedule(offsets, win_offsets, block, stride, N, D)
    scratch = _kernels.forward_scratch_elements(N, D, block, stride)
    return Plan("forward", x.dtype, T, N, D, block, stride, offsets, win_offsets, tiles,
                0, scratch_slots(), _round16(scratch),
                {"input": x, "weight": weight, "out": out})


def plan_grad(rules, grad, x, weight, block, stride, actual_seq_len, seq_type, layout,
              input_grad, weight_grad):
    outputs = {} if rules.allocate_outputs else {"input_grad": input_grad,
                                                  "weight_grad": weight_grad}
    _check_present(rules, grad=grad, input=x, weight=weight, **outputs)
    block, stride = _check_window(rules, block, stride, forward=False)
    grad = _check_array(rules, "grad", grad, 3, "[T', N, D]")
    x, weight = _check_input_and_weight(rules, x, weight, block)
    _check_same_dtype(rules, x.dtype, "grad", grad)
    _check_layout(rules, layout)
    seq_type = _check_seq_type(rules, seq_type)
    T, N, D = x.shape
    offsets, win_offsets = _geometry(rules, T, block, stride, actual_seq_len, seq_type)
    expected = (int(win_offsets[-1]), N, D)
    if grad.shape != expected:
        raise invalid(rules.op, f"{rules.names['grad']} must have shape [T', N, D] = "
                                f"{expected} (T' = number of windows), got {grad.shape}")
    input_grad = _check_output(rules, "input_grad", input_grad, x.shape, x.dtype, "[T, N, D]")
    weight_grad = _check_output(rules, "weight_grad", weight_grad, weight.shape, x.dtype,
                                f"[{rules.names['block']}, N]")
    tiles = tile_schedule(offsets, win_offsets, block, stride, N, D)
    scratch = _kernels.backward_scratch_elements(N, D, block, stride)
    return Plan("grad", x.dtype, T, N, D, block, stride, offsets, win_offsets, tiles,
                _round16(tiles.shape[0] * N * block), scratch_slots(), _round16(scratch),
                {"grad": grad, "input": x, "weight": weight,
                 "input_grad": input_grad, "weight_grad": weight_grad})
