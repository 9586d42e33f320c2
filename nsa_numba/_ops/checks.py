"""What every operator's planner shares: the dtypes and their storage and
accumulator types, :class:`Rules` (what differs between the NumPy, torch and aclnn
entry points of an operator), and the argument checks, each raising ``NsaError``
with the parameter's name as the entry point spells it."""

import functools
from dataclasses import dataclass, field

import numba
import numpy as np

from .._core.errors import invalid, missing
from . import seqlens as _seqlens

#: the supported dtypes, by name. bfloat16 arrays come from ml_dtypes, which the
#: library does not import (it takes most of a second to import): a
#: bfloat16 array exists only once its creator has imported it, and is recognised
#: by its dtype's name and size.
FLOAT16, BFLOAT16, FLOAT32, FLOAT64 = "float16", "bfloat16", "float32", "float64"

#: the dtype arrays of each kind are viewed as inside the kernels (see ``_kernels.halfprec``)
STORAGE = {FLOAT16: np.dtype(np.uint16), BFLOAT16: np.dtype(np.int16),
           FLOAT32: np.dtype(np.float32), FLOAT64: np.dtype(np.float64)}

#: accumulation dtype: float32, except float64 problems
ACCUMULATOR = {FLOAT16: np.dtype(np.float32), BFLOAT16: np.dtype(np.float32),
               FLOAT32: np.dtype(np.float32), FLOAT64: np.dtype(np.float64)}

#: a run starts its scratch at this byte boundary of the workspace it is given: the
#: kernels' vector stores to the scratch then never straddle a cache line (NumPy
#: returns buffers 16 or 32 bytes past one, which slowed both kernels: docs/
#: performance.md, "Figures behind the code's choices").
WORKSPACE_ALIGN = 64


@functools.lru_cache(maxsize=64)
def kind_of(dtype):
    """The supported kind (a name above) of a numpy dtype, or None."""
    if dtype.name == BFLOAT16 and dtype.itemsize == 2 and dtype.kind == "V":
        return BFLOAT16
    for name in (FLOAT16, FLOAT32, FLOAT64):
        if dtype == np.dtype(name):   # native byte order only
            return name
    return None


PY_NAMES = {
    "input": "input", "weight": "weight", "grad": "grad", "out": "out",
    "input_grad": "input_grad", "weight_grad": "weight_grad",
    "block": "compress_block_size", "stride": "compress_stride",
    "actual_seq_len": "actual_seq_len", "actual_seq_len_type": "actual_seq_len_type",
    "layout": "layout", "strict": "strict",
}


#: the parameters only some entry points have: a message mentions one only when the
#: entry point's ``Rules.names`` has it (the torch functions take none of them)
OPTIONAL_NAMES = ("layout", "actual_seq_len_type", "strict")


def without_options(names):
    """``names`` without the optional parameters (``OPTIONAL_NAMES``)."""
    return {k: v for k, v in names.items() if k not in OPTIONAL_NAMES}


@dataclass(frozen=True)
class Rules:
    """What differs between the entry points of an operator (the NumPy API, torch,
    aclnn); the checks themselves do not. Every operator's planner takes one."""
    op: str                         # the entry point's name, in messages
    names: dict = field(default_factory=lambda: dict(PY_NAMES))    # role -> parameter
    dtypes: tuple = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
    strict: bool = True
    allocate_outputs: bool = True   # False: a None output is an error (161001)
    #: the dtype index arrays must have (None: any integer dtype, and lists or tuples
    #: of integers too)
    index_dtype: object = None


def check_int(rules, key, value):
    return _seqlens.as_int64(rules.op, rules.names.get(key, key), value)


def check_array(rules, key, a, ndim, dims):
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


def check_same_dtype(rules, key, a, like_key, dtype):
    """``a`` (parameter ``key``) has ``dtype``, that of parameter ``like_key``."""
    if a.dtype != dtype:
        raise invalid(rules.op, f"{rules.names[key]} dtype must equal "
                                f"{rules.names[like_key]} dtype {dtype}, got {a.dtype}")


def check_output(rules, key, a, shape, dtype, dims):
    """A caller-provided output, checked (None stays None when the rules allocate
    missing outputs: ``Plan.allocate`` does, once every check has passed)."""
    if a is None and rules.allocate_outputs:
        return None
    check_array(rules, key, a, len(shape), dims)
    name = rules.names[key]
    if a.shape != tuple(shape):
        raise invalid(rules.op, f"{name} must have shape {tuple(shape)}, got {a.shape}")
    check_same_dtype(rules, key, a, "input", dtype)
    if not a.flags.writeable:
        raise invalid(rules.op, f"{name} must be writable, got a read-only array")
    return a


def overlaps(a, b):
    """Whether two arrays share memory; when that is too hard to decide, assume so."""
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 20))
    except np.exceptions.TooHardError:
        return True


def self_overlaps(a):
    """Whether two elements of ``a`` share a byte (a stride of 0 over an axis of more
    than one element, say); when that is too hard to decide, assume so."""
    if a.size <= 1:
        return False
    span = a.itemsize
    for stride, n in sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1):
        if stride < span:
            break
        span += stride * (n - 1)
    else:
        return False                # each axis steps past everything the axes below span
    if a.size > SELF_OVERLAP_EXACT:
        return True
    offsets = np.zeros(1, np.int64)
    for s, n in zip(a.strides, a.shape):
        offsets = (offsets[:, None] + s * np.arange(n, dtype=np.int64)).reshape(-1)
    offsets.sort()
    return bool((np.diff(offsets) < a.itemsize).any())


#: elements up to which ``self_overlaps`` decides an unusual layout by listing the
#: offsets of its elements (32 MiB of them); a larger one is refused
SELF_OVERLAP_EXACT = 1 << 22


def check_no_overlap(rules, outputs, inputs):
    """The outputs the caller gave (None: allocated later) must share no memory with
    each other, with any array of ``inputs`` (everything the call reads: other values
    are passed over), nor between their own elements. NsaError naming both arrays."""
    keys = [k for k, a in outputs.items() if a is not None]
    readers = [(k, a) for k, a in inputs.items() if isinstance(a, np.ndarray)]
    for i, okey in enumerate(keys):
        out = outputs[okey]
        if self_overlaps(out):
            raise invalid(rules.op, f"{rules.names[okey]} has elements that share memory "
                                    f"(shape {out.shape}, strides {out.strides}); an output "
                                    f"must have a place of its own for every element")
        for key, a in readers + [(k, outputs[k]) for k in keys[i + 1:]]:
            if overlaps(out, a):
                raise invalid(rules.op, f"{rules.names[okey]} overlaps {rules.names[key]} in "
                                        f"memory; outputs must not share memory with the "
                                        f"inputs or with each other")


def round16(elements):
    return -(-int(elements) // 16) * 16


def scratch_slots():
    """Threads a launch may use: Numba's ceiling, fixed at its start."""
    return int(numba.config.NUMBA_NUM_THREADS)
