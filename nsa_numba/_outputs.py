"""Output arrays that come back: large outputs the operators allocate are kept and
handed out again once their caller has let go of them.

A training step allocates the same outputs every time (the backward's input
gradient has the input's shape), and PyTorch's autograd always lets the operator
allocate. An array of 32 MiB or more is fresh memory from the system on every
allocation (glibc maps it, and unmaps it when it is freed), and the system zeroes
each page of it on first write: that about doubled the backward's time on bench's
shapes (docs/performance.md, "Allocated outputs").

So an allocated output of at least ``MIN_BYTES`` comes from a kept buffer of its
shape and dtype that nothing else refers to any more, else from a new one that is
kept, while the kept buffers total at most the budget (``keep_outputs``; the
environment variable ``NSA_NUMBA_KEEP_OUTPUTS_MB`` sets it at import, 0 turns the
keeping off). The caller gets a view of the buffer, never the buffer itself, so
nothing it does to its array's flags or shape reaches the buffer; every view of
that view, every tensor made from it and every exported buffer holds a reference
to the kept buffer (NumPy points each view at the array that owns the memory). A
buffer whose reference count is down to the keeper's own is therefore unreachable
from outside and safe to hand out again. The kernels write every element of their
outputs, so what a buffer held before changes nothing.

Not on Python builds without the GIL (where reference counts are not exact): there
every output is allocated.
"""

import math
import os
import sys
import threading

import numpy as np

#: outputs smaller than this are allocated (the C library's free lists serve them)
MIN_BYTES = 4 << 20
_ENV = "NSA_NUMBA_KEEP_OUTPUTS_MB"
_DEFAULT_MB = 1024

_lock = threading.Lock()
_kept = {}          # (shape, dtype) -> [buffer, ...], oldest first
_kept_bytes = 0


def _refs(buffers, i):
    """The reference count of ``buffers[i]``: the list's reference and the call's
    argument when nothing else refers to it (``_FREE_REFS``, measured the same way)."""
    return sys.getrefcount(buffers[i])


def _unused_index(buffers):
    """The index of the first of ``buffers`` nothing outside the list refers to, or -1."""
    for i in range(len(buffers)):
        if _refs(buffers, i) <= _FREE_REFS:
            return i
    return -1


_FREE_REFS = _refs([np.empty(0)], 0)
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


def _budget_from_env():
    text = os.environ.get(_ENV, "").strip()
    if not text:
        return _DEFAULT_MB << 20
    if not text.isdigit():
        raise ValueError(f"{_ENV} must be a whole number of MiB (0 turns the keeping "
                         f"off), got {text!r}")
    return int(text) << 20


_budget = _budget_from_env() if _GIL else 0


def empty(shape, dtype):
    """An output array of ``shape`` and ``dtype`` (contents undefined, as
    ``np.empty``): from a kept buffer where the rules above allow."""
    dtype = np.dtype(dtype)
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes < MIN_BYTES or nbytes > _budget:
        return np.empty(shape, dtype)
    global _kept_bytes
    key = (tuple(shape), dtype)
    with _lock:
        buffers = _kept.get(key)
        i = _unused_index(buffers) if buffers else -1
        if i >= 0:
            return buffers[i].view()
        buffer = np.empty(shape, dtype)
        if not _make_room(nbytes):
            return buffer
        _kept.setdefault(key, []).append(buffer)
        _kept_bytes += nbytes
        return buffer.view()


def _make_room(nbytes):
    """Whether ``nbytes`` more fit the budget, after dropping unused buffers (the
    oldest shapes first) if they must. Called with the lock held."""
    global _kept_bytes
    for key in list(_kept):
        buffers = _kept[key]
        while _kept_bytes + nbytes > _budget:
            i = _unused_index(buffers)
            if i < 0:
                break
            _kept_bytes -= buffers[i].nbytes
            del buffers[i]
        if not buffers:
            del _kept[key]
    return _kept_bytes + nbytes <= _budget


def keep_outputs(max_bytes=None):
    """Set the most bytes of large output buffers kept for reuse (``0``: allocate
    every output afresh) and return the previous limit; without an argument, only
    return it. Lowering it lets go of unused buffers beyond the new limit at once;
    if the buffers in use alone exceed it, they are forgotten (and stay with their
    users)."""
    global _budget
    if max_bytes is None:
        return _budget
    if type(max_bytes) is not int or max_bytes < 0:
        raise ValueError(f"keep_outputs: max_bytes must be an int >= 0, got {max_bytes!r}")
    with _lock:
        previous, _budget = _budget, max_bytes if _GIL else 0
        _make_room(0)
        if _kept_bytes > _budget:      # what is left is in use: forget it all
            _forget()
    return previous


def release_outputs():
    """Forget every kept output buffer: the unused ones go back to the system, the
    ones in use stay with their users."""
    with _lock:
        _forget()


def kept():
    """(buffers kept, bytes kept, bytes of them in use), for the tests."""
    with _lock:
        count = sum(len(buffers) for buffers in _kept.values())
        in_use = sum(buffers[i].nbytes for buffers in _kept.values()
                     for i in range(len(buffers)) if _refs(buffers, i) > _FREE_REFS)
        return count, _kept_bytes, in_use


def _forget():
    global _kept_bytes
    _kept.clear()
    _kept_bytes = 0


def _after_fork():
    """In a forked child: a new lock (another thread may have held the parent's) and
    nothing kept."""
    global _lock
    _lock = threading.Lock()
    _forget()


if hasattr(os, "register_at_fork"):      # POSIX
    os.register_at_fork(after_in_child=_after_fork)
