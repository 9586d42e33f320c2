"""Kernel launches on the library's own threads.

Every kernel is a serial, ``nogil`` compiled function whose first two arguments are
``work`` (three int64: the next unit to hand out, how many units a thread takes at a
time, and ALONE when the caller runs every unit itself) and ``slot`` (which row of
the per-thread scratch the caller owns). It takes units with :func:`claim` and
:func:`next_unit` until none remain::

    unit, end = claim(work, total)
    while unit < end:
        ...                          # owner-computes: a unit writes only its own outputs
        unit, end = next_unit(work, unit, end, total)

:func:`run` calls it on the calling thread (slot 0) and on up to ``threads - 1``
helper threads (slots 1, 2, ...) kept by this module. A helper that starts after the
caller found no units left does nothing, so the caller never waits for a helper that
is busy with another launch: a launch needs no thread but its own to finish, and any
number of Python threads may launch at once. Which thread runs a unit changes from run
to run; what a unit computes does not, so the results are bitwise the same for any
thread count (the scratch a unit uses is overwritten before it is read).

Each kernel is compiled once, as one serial function: no Numba threading layer, no
parallel-loop lowering (which compiled each kernel's loop body twice, docs/design.md
"What a kernel costs to compile"). Helpers are Python threads, at most
``NUMBA_NUM_THREADS - 1`` of them, started on first need; a process forked from one
that has them starts with none and makes its own.
"""

import os
import queue
import threading

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from .jit import jit


@intrinsic
def _fetch_add(typingctx, work, amount):
    """``work[0] += amount`` as one atomic step; returns the value before."""
    if not (isinstance(work, types.Array) and work.dtype == types.int64
            and isinstance(amount, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        value = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", array.data, value, "monotonic")

    return types.int64(work, amount), codegen


if numba.config.DISABLE_JIT:            # the kernels run as Python: a lock does the same
    _fetch_lock = threading.Lock()

    def _fetch_add(work, amount):       # noqa: F811
        with _fetch_lock:
            before = int(work[0])
            work[0] = before + amount
        return before


@jit(inline="always")
def claim(work, total):
    """(unit, end): the units ``unit <= u < end`` this thread computes next, ``unit >=
    end`` when every one of ``total`` has been handed out."""
    unit = _fetch_add(work, work[1])
    return unit, min(unit + work[1], total)


@jit(inline="always")
def next_unit(work, unit, end, total):
    """(unit, end) after ``unit``: the next of those claimed, else a new claim."""
    if unit + 1 < end:
        return unit + 1, end
    return claim(work, total)


# -- the threads -------------------------------------------------------------------

#: ``NUMBA_NUM_THREADS``, read once (Numba fixes it at its start)
_CEILING = int(numba.config.NUMBA_NUM_THREADS)


def ceiling():
    """Threads a launch may use at most, helpers included: ``NUMBA_NUM_THREADS`` (the
    core count unless set before import); the scratch has one row per thread."""
    return _CEILING


_local = threading.local()


def count():
    """The calling thread's thread count (:class:`threads`), else :func:`ceiling`."""
    return getattr(_local, "n", 0) or _CEILING


def set_count(n):
    """Set the calling thread's count to ``n`` (0: :func:`ceiling`); the count before."""
    before = getattr(_local, "n", 0)
    _local.n = n
    return before


class threads:
    """Context manager: kernels launched from this thread inside the block use at
    most ``n`` threads, then the count before is restored.

    ::

        with nsa_numba.threads(1):
            out = nsa_numba.nsa_compress(x, w, 32, 16)

    ``n`` is capped at ``NUMBA_NUM_THREADS`` (set that variable before import to cap
    a whole process). Other Python threads keep their own count. Results are bitwise
    the same for any ``n``.
    """

    def __init__(self, n):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"threads: n must be an integer >= 1, got {n!r}")
        self.n = min(n, ceiling())
        self._saved = []

    def __enter__(self):
        self._saved.append(set_count(self.n))
        return self

    def __exit__(self, *exc):
        set_count(self._saved.pop())
        return False


class _Job:
    """One launch as its helpers see it."""

    __slots__ = ("fn", "work", "args", "running", "closed", "error", "done")

    def __init__(self, fn, work, args):
        self.fn, self.work, self.args = fn, work, args
        self.running = 0          # helpers inside fn
        self.closed = False       # the caller has finished: helpers not yet in stay out
        self.error = None
        self.done = threading.Condition(threading.Lock())


_pool_lock = threading.Lock()
_idle = []        # the inboxes of helpers waiting for a job
_started = 0      # helpers alive in this process


def _helper(inbox):
    while True:
        _take_part(*inbox.get())
        with _pool_lock:
            _idle.append(inbox)


def _take_part(job, slot):
    """A helper's part in ``job`` (nothing once the caller has finished). A function
    of its own so that nothing of the job stays referenced while the helper waits
    for the next one (the arrays would stay alive: outputs kept from the pool)."""
    with job.done:
        enter = not job.closed
        if enter:
            job.running += 1
    if not enter:
        return
    try:
        job.fn(job.work, slot, *job.args)
    except BaseException as error:       # re-raised by the caller
        job.error = error
    with job.done:
        job.running -= 1
        if job.running == 0:
            job.done.notify_all()


def _take(n):
    """Up to ``n`` idle helpers' inboxes, starting helpers while fewer than
    ``ceiling() - 1`` exist."""
    global _started
    with _pool_lock:
        while len(_idle) < n and _started < ceiling() - 1:
            inbox = queue.SimpleQueue()
            threading.Thread(target=_helper, args=(inbox,), daemon=True,
                             name=f"nsa_numba-{_started + 1}").start()
            _started += 1
            _idle.append(inbox)
        taken = _idle[len(_idle) - min(n, len(_idle)):]
        del _idle[len(_idle) - len(taken):]
    return taken


def _forget_helpers():
    """In a forked child: the parent's helpers did not come along."""
    global _pool_lock, _started
    _pool_lock = threading.Lock()
    _idle.clear()
    _started = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def helpers_started():
    """How many helper threads this process has (``python -m nsa_numba info``)."""
    return _started


#: the ``slot`` of a kernel's closing call (:func:`run` with ``closing``)
FINISH = -1
#: ``work[2]`` when the caller runs every unit itself: it may close in the same call
ALONE = 1
_NO_WORK = np.zeros(3, np.int64)


def any_layout(kernel, threads, chunk, *args):
    """:func:`run` of the compiled ``kernel`` for ``args`` with every 3- or 4-axis
    array (and 2-axis uint8 mask) typed as of any layout: the attention kernels read
    and write those arrays an element at a time, where the layout costs nothing, and
    one variant per dtype serves every memory order (each other layout would compile
    again for seconds: docs/design.md, "What a kernel costs to compile")."""
    return run(_entry(kernel, args), threads, chunk, *args)


#: compiled entry points by (kernel, argument types): a few per kernel and dtype
_entries = {}
#: the types of what :func:`run` passes first (``work``, ``slot``)
_LAUNCH_TYPES = (types.int64[::1], types.int64)


def _entry(kernel, args):
    signature = tuple(_any_layout(numba.typeof(a)) for a in args)
    fn = _entries.get((kernel, signature))
    if fn is None:
        fn = _entries[kernel, signature] = kernel.compile(_LAUNCH_TYPES + signature)
    return fn


def _any_layout(t):
    if isinstance(t, types.Array) and (t.ndim in (3, 4) or (
            t.ndim == 2 and t.dtype == types.uint8)):     # and masks
        return types.Array(t.dtype, t.ndim, "A", aligned=t.aligned)
    return t


def run(kernel, threads, chunk, *args, closing=False):
    """``kernel(work, slot, *args)`` on the calling thread and up to ``threads - 1``
    helpers (``threads`` None: :func:`count`; always capped by it), each taking
    ``chunk`` units at a time; returns the caller's result.

    ``closing``: the kernel has a closing step (a fixed-order sum of its units'
    partial results), which runs once every unit is done, in the same compiled
    function (no second compile): at the end of the caller's own call when it ran
    alone (``work[2] == ALONE``), else in a call with slot FINISH after the helpers are
    done, unless the caller's result was False (the kernel refused its arrays)."""
    n = count() if threads is None else min(threads, count())
    inboxes = _take(n - 1) if n > 1 else ()
    if not inboxes:
        return kernel(np.array([0, chunk, ALONE], np.int64), 0, *args)
    work = np.array([0, chunk, 0], np.int64)
    job = _Job(kernel, work, args)
    for slot, inbox in enumerate(inboxes, 1):
        inbox.put((job, slot))
    try:
        result = kernel(work, 0, *args)
    finally:
        with job.done:
            job.closed = True
            while job.running:
                job.done.wait()
    error, job.args = job.error, None
    if error is not None:
        raise error
    if closing and result is not False:
        kernel(_NO_WORK, FINISH, *args)
    return result
