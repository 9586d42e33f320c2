"""TND variable-length sequences: offsets, window counts and window starts.

Tokens of all sequences are packed back to back along T. Sequence ``b`` occupies
tokens ``offsets[b]:offsets[b + 1]`` (the CSR idiom). A sequence of length ``L``
yields ``max(0, (L - l) // d + 1)`` windows; window ``i`` of sequence ``b`` starts at
token ``offsets[b] + i * d`` and is output row ``rows[b] + i`` (``packed_tables``).
"""

import math
import numbers

import numpy as np

from .._core.errors import invalid
from .._core.jit import jit

CUMULATIVE = 0   # actual_seq_len holds the running ends of the sequences
LENGTHS = 1      # actual_seq_len holds one length per sequence

_INT64_MAX = np.iinfo(np.int64).max
#: element types of a list or tuple that NumPy converts to int64 exactly or not at all
#: (OverflowError): int and the NumPy integers of C's signed types and of its unsigned
#: ones narrower than 8 bytes (not bool, which NumPy takes as 0 or 1; not uint64)
_EXACT_INT_TYPES = {int} | {np.dtype(code).type for code in "bhilqpBHI"
                            if np.dtype(code).kind == "i" or np.dtype(code).itemsize < 8}


def _show(values, limit=8, width=200):
    """A short text of a possibly long sequence of numbers for error messages; any
    other object (the value of a rejected argument can be anything) by its repr."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if isinstance(values, (list, tuple)):
        text = str(list(values[:limit]))
        if len(values) > limit:
            text = f"{text[:-1]}, ...] ({len(values)} values)"
    else:
        text = repr(values)
    return text if len(text) <= width else text[:width - 3] + "..."


def as_int64(op, label, value):
    """``value`` as a Python int, or NsaError naming ``label`` unless it is an integer
    (not a bool) that fits in int64."""
    if type(value) is not int and (isinstance(value, (bool, np.bool_))   # int: no ABC check
                                   or not isinstance(value, numbers.Integral)):
        raise invalid(op, f"{label} must be an integer, got {value!r} "
                          f"({type(value).__name__})")
    value = int(value)
    if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        raise invalid(op, f"{label} must fit in int64, got {value}")
    return value


def as_real(op, label, value):
    """``value`` (a real number, not a bool) as a finite Python float, or NsaError
    naming ``label``: an integer too large for a float, an infinity or a NaN."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise invalid(op, f"{label} must be a real number, got {value!r} "
                          f"({type(value).__name__})")
    try:
        result = float(value)
    except OverflowError:
        bits = abs(int(value)).bit_length()         # (str() of it may be refused)
        raise invalid(op, f"{label} must be a finite real number, got a number of "
                          f"{bits} bits, beyond float64") from None
    if not math.isfinite(result):
        raise invalid(op, f"{label} must be a finite real number, got {value!r}")
    return result


def as_int_vector(op, name, values):
    """The list / tuple / 1-D integer array ``values`` as int64, or NsaError."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise invalid(op, f"{name} must be 1-D, got an array of shape {values.shape}")
        if values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.integer):
            raise invalid(op, f"{name} must hold integers, got dtype {values.dtype}")
        if values.dtype == np.uint64 and values.size and values.max() > _INT64_MAX:
            raise invalid(op, f"{name} values must fit in int64, got {int(values.max())}")
        return values.astype(np.int64)
    if not isinstance(values, (list, tuple)):
        raise invalid(op, f"{name} must be None, a list, a tuple or a 1-D integer array, "
                          f"got {type(values).__name__}")
    if set(map(type, values)) <= _EXACT_INT_TYPES:
        # plain ints (the usual case) or NumPy integers that all fit in int64, converted
        # in one C loop: the checked loop below costs per value, which thousands of
        # sequences make a millisecond a call
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            pass                    # beyond int64: the loop below names the value
    return np.array([as_int64(op, f"{name}[{i}]", v) for i, v in enumerate(values)],
                    dtype=np.int64)


def sequence_values(op, actual_seq_len, seq_len_type, total_tokens, names):
    """(int64 vector, CUMULATIVE or LENGTHS): the values ``packed_tables`` works from,
    type-checked but not yet range-checked. None stands for one sequence of all
    ``total_tokens``."""
    if actual_seq_len is None:
        return np.array([total_tokens], np.int64), CUMULATIVE
    return as_int_vector(op, names["actual_seq_len"], actual_seq_len), seq_len_type


def sequence_offsets(op, actual_seq_len, seq_len_type, total_tokens, names):
    """Token offsets ``[0, end_0, end_1, ..., T]`` of the packed sequences.

    ``names`` maps ``"actual_seq_len"`` and ``"actual_seq_len_type"`` to the
    parameter names of the calling API, for the messages.
    """
    name, type_name = names["actual_seq_len"], names.get("actual_seq_len_type")
    if actual_seq_len is None:
        return np.array([0, total_tokens], dtype=np.int64)
    values = as_int_vector(op, name, actual_seq_len)
    if values.size == 0:
        raise invalid(op, f"{name} must hold at least one value, got an empty list")
    if values.min() < 0:
        bad = int(np.argmax(values < 0))
        raise invalid(op, f"{name} values must be >= 0, got {int(values[bad])} at index {bad}")
    if seq_len_type == CUMULATIVE:
        ends = values
        kind = f"{type_name}=0: cumulative ends" if type_name else "cumulative ends"
        drops = np.flatnonzero(np.diff(ends) < 0)
        if drops.size:
            i = int(drops[0]) + 1
            raise invalid(op, f"{name} ({kind}) must be non-decreasing, got {int(ends[i])} "
                              f"at index {i} after {int(ends[i - 1])}: {_show(ends)}"
                              f"{_lengths_hint(values, total_tokens, type_name)}")
        if ends[-1] != total_tokens:
            raise invalid(op, f"{name} ({kind}) must end at T = {total_tokens} "
                              f"(input.shape[0]), got last value {int(ends[-1])}: "
                              f"{_show(ends)}{_lengths_hint(values, total_tokens, type_name)}")
    else:
        too_long = np.flatnonzero(values > total_tokens)
        total = None if too_long.size else int(values.sum())  # no overflow: each <= T
        if total != total_tokens:
            shown = "more" if total is None else total
            raise invalid(op, f"{name} ({type_name}=1: per-sequence lengths) must sum "
                              f"to T = {total_tokens} (input.shape[0]), got {shown}: "
                              f"{_show(values)}")
        ends = np.cumsum(values)
    return np.concatenate(([0], ends)).astype(np.int64)


def _lengths_hint(values, total_tokens, type_name):
    """What to do when cumulative ends were expected and ``values`` look like
    per-sequence lengths instead (they sum to T), or ""."""
    if values.size < 2 or int(values.sum()) != total_tokens:
        return ""
    ends = _show(np.cumsum(values))
    other = f", or pass {type_name}=1" if type_name else ""
    return (f"; these look like per-sequence lengths (they sum to T = {total_tokens}): "
            f"the cumulative ends of those lengths are {ends}{other}")


def window_counts(lengths, block, stride):
    """Windows per sequence: ``(L - l) // d + 1`` for ``L >= l``, else 0."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.where(lengths >= block, (lengths - block) // stride + 1, 0).astype(np.int64)


def packed_tables(op, values, kind, total_tokens, block, stride, names):
    """(offsets, lengths, window counts, first output rows) of the packed sequences
    whose values and kind ``sequence_values`` returned (it type-checks them once;
    planning keys its kept tables on them too), in one compiled pass: ``offsets``
    as ``sequence_offsets`` gives them, lengths their differences, counts as
    ``window_counts`` gives them, and ``rows`` the running sum of the counts from 0
    (``rows[b]``: sequence b's first window; ``rows[-1]``: T').

    A call often follows other work that has pushed this module's code and data out
    of the CPU caches, and then a dozen small NumPy steps cost several times the
    compiled pass (docs/performance.md, "Figures behind the code's choices"). Values
    the pass rejects go to
    ``sequence_offsets``, whose error names the rule they break.
    """
    ok, offsets, lengths, counts, rows = _packed_tables(values, kind, total_tokens, block,
                                                        stride)
    if not ok:
        sequence_offsets(op, values, kind, total_tokens, names)
        raise AssertionError(f"sequence values rejected by the compiled check only: "
                             f"{_show(values)}")
    return offsets, lengths, counts, rows


@jit
def _packed_tables(values, kind, total_tokens, block, stride):
    """(ok, offsets, lengths, counts, rows); ``ok`` is False exactly when
    ``sequence_offsets`` raises for these values (``kind``: CUMULATIVE or LENGTHS)."""
    n = values.size
    offsets = np.zeros(n + 1, np.int64)
    lengths = np.zeros(n, np.int64)
    counts = np.zeros(n, np.int64)
    rows = np.zeros(n + 1, np.int64)
    for i in range(n):
        v = values[i]
        if v < 0:
            return False, offsets, lengths, counts, rows
        # lengths: v >= 0 and offsets[i] >= 0, so a sum past int64 wraps below offsets[i]
        end = v if kind == CUMULATIVE else offsets[i] + v
        if end < offsets[i] or end > total_tokens:    # decreasing ends, or past T
            return False, offsets, lengths, counts, rows
        offsets[i + 1] = end
        length = end - offsets[i]
        lengths[i] = length
        counts[i] = (length - block) // stride + 1 if length >= block else 0
        rows[i + 1] = rows[i] + counts[i]
    return n > 0 and offsets[n] == total_tokens, offsets, lengths, counts, rows
