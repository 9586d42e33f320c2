"""The output pool: large outputs the operators allocate come from buffers the
process keeps and hands out again once their caller has let go of them.

A training step allocates its outputs again every time (PyTorch's autograd always
lets the operator allocate the input gradient). An array of 32 MiB or more is fresh
memory from the system on every allocation (glibc maps it, and unmaps it when it is
freed), and the system zeroes each page of it on first write: that about doubled the
backward's time (docs/performance.md, "Allocated outputs").

The pool is about bytes, not shapes: a request of ``n`` bytes (``MIN_BYTES`` or more)
takes the smallest free buffer of ``n`` to ``FIT * n`` bytes, whatever shape or dtype
it served before, so a loop whose packed length changes every step reuses what it
has. When no free buffer serves it, a new one of ``n`` bytes is made, and every free
buffer smaller than ``n`` is let go first (it could not serve this request, and a
loop whose lengths grow would otherwise keep one buffer per length). So the pool
holds about one buffer per output of a kind that is alive at once: a training loop
that holds one step's gradient while the next step's is made keeps two gradient
buffers where allocating afresh would hold one, and frees nothing to the system
between steps (docs/design.md, "The output pool"). All buffers together stay within
twice the largest request (``KEEP_LARGEST``: a step that makes many outputs, as an
attention layer's does, pools the first of them and allocates the rest) and within
the budget (``keep_outputs``; ``NSA_NUMBA_KEEP_OUTPUTS_MB`` sets it at import, 0
turns the pool off), the least recently used free ones let go first to make room; an
output that does not fit is allocated.

The caller gets a view of a buffer, never the buffer, so nothing it does to its
array's flags or shape reaches the buffer; every view of that view, every tensor
made from it and every exported buffer holds a reference to the buffer (NumPy points
each view at the array that owns the memory). A buffer whose reference count is down
to the pool's own is unreachable from outside and free to hand out again. The kernels
write every element of their outputs, so what a buffer held before changes nothing.

Not on Python builds without the GIL (where reference counts are not exact): there
every output is allocated.
"""

import math
import os
import sys
import threading

import numpy as np

from . import config as _config

#: outputs smaller than this are allocated (the C library's free lists serve them)
MIN_BYTES = 4 << 20
#: a free buffer serves a request of at least 1 / FIT of its size: a small output
#: never holds a large output's buffer, which would make the large one allocate
FIT = 2
#: the pool holds at most this many times the largest output it was asked for (and
#: never more than the budget): what it keeps beyond allocating afresh, which a
#: caller may drop at any moment, stays within two of the largest outputs however
#: many outputs a step makes
KEEP_LARGEST = 2

_lock = threading.Lock()
_buffers = []       # uint8 arrays, least recently handed out first
_pooled_bytes = 0
_largest = 0        # the largest request since the pool was last emptied


def _refs(buffers, i):
    """The reference count of ``buffers[i]``: the list's reference and the call's
    argument when nothing else refers to it (``_FREE_REFS``, measured the same way)."""
    return sys.getrefcount(buffers[i])


_FREE_REFS = _refs([np.empty(0)], 0)
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()
_budget = _config.pool_budget() if _GIL else 0


def _best_fit(nbytes):
    """The index of the smallest free buffer that serves ``nbytes`` (at least that
    many bytes, at most ``FIT`` times as many), or -1. Called with the lock held."""
    best, best_size = -1, FIT * nbytes + 1
    buffers = _buffers
    for i in range(len(buffers)):
        size = buffers[i].size
        if nbytes <= size < best_size and _refs(buffers, i) <= _FREE_REFS:
            best, best_size = i, size
    return best


def empty(shape, dtype):
    """An output array of ``shape`` and ``dtype`` (contents undefined, as
    ``np.empty``): a view of a pooled buffer where the rules above allow."""
    dtype = np.dtype(dtype)
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes < MIN_BYTES or nbytes > _budget:
        return np.empty(shape, dtype)
    global _pooled_bytes, _largest
    with _lock:
        i = _best_fit(nbytes)
        if i >= 0:
            buffer = _buffers.pop(i)
            _buffers.append(buffer)          # most recently handed out last
        else:
            _largest = max(_largest, nbytes)
            limit = min(_budget, KEEP_LARGEST * _largest)
            _drop_free(lambda size: size < nbytes)
            _drop_free(lambda size: _pooled_bytes + nbytes > limit)
            if _pooled_bytes + nbytes > limit:
                return np.empty(shape, dtype)
            buffer = np.empty(nbytes, np.uint8)
            _buffers.append(buffer)
            _pooled_bytes += nbytes
        return buffer[:nbytes].view(dtype).reshape(shape)


def _drop_free(condition):
    """Let go of the free buffers, least recently used first, while
    ``condition(size)`` holds for them. Called with the lock held."""
    global _pooled_bytes
    i = 0
    while i < len(_buffers):
        size = _buffers[i].size
        if condition(size) and _refs(_buffers, i) <= _FREE_REFS:
            del _buffers[i]
            _pooled_bytes -= size
        else:
            i += 1


def keep_outputs(max_bytes=None):
    """Set the most bytes of large output buffers kept for reuse (``0``: allocate
    every output afresh) and return the previous limit; without an argument, only
    return it. Lowering it lets go of free buffers beyond the new limit at once;
    if the buffers in use alone exceed it, they are forgotten (and stay with their
    users)."""
    global _budget
    if max_bytes is None:
        return _budget
    if type(max_bytes) is not int or max_bytes < 0:
        raise ValueError(f"keep_outputs: max_bytes must be an int >= 0, got {max_bytes!r}")
    with _lock:
        previous, _budget = _budget, max_bytes if _GIL else 0
        _drop_free(lambda size: _pooled_bytes > _budget)
        if _pooled_bytes > _budget:      # what is left is in use: forget it all
            _forget()
    return previous


def release_outputs():
    """Forget every pooled output buffer: the free ones go back to the system, the
    ones in use stay with their users."""
    with _lock:
        _forget()


def stats():
    """(buffers pooled, bytes pooled, bytes of them in use), for tests and ``info``."""
    with _lock:
        in_use = sum(_buffers[i].size for i in range(len(_buffers))
                     if _refs(_buffers, i) > _FREE_REFS)
        return len(_buffers), _pooled_bytes, in_use


def _forget():
    global _pooled_bytes, _largest
    _buffers.clear()
    _pooled_bytes = _largest = 0


def _after_fork():
    """In a forked child: a new lock (another thread may have held the parent's) and
    an empty pool."""
    global _lock
    _lock = threading.Lock()
    _forget()


if hasattr(os, "register_at_fork"):      # POSIX
    os.register_at_fork(after_in_child=_after_fork)
