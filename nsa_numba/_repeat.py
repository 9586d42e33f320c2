"""Calls that come again: a model calls each operator once per layer and step with
new arrays of the same shapes, dtypes and sequence lengths.

Checking and planning a call reads its arguments' types, dtypes, shapes and strides,
the outputs' writability (and the weight's: the kernels take a writable one), the
integers and the sequence values: never the array contents, and the addresses only
to check that outputs share no memory with the inputs. A call's *signature* is all
of that read, exactly (:func:`forward_signature`, :func:`grad_signature`). After a
call succeeds, its :class:`Entry` (a ``_dispatch.Again``: the recipe bound to its
kernel's entry) is kept under its signature; a later call with the same signature
passes the same checks and gets the same plan, so it only views its arrays in their
storage dtype and launches the entry, which checks in machine code that the outputs
share no memory with the inputs. Anything else, and any overlap, goes the full way
(``_plan``), which also raises every error: an entry only ever answers arguments
that passed.

Signatures are taken only where equality means the same checks: arrays of exactly
``numpy.ndarray``, integers of exactly ``int`` (``True == 1`` and ``1.0 == 1`` in
Python, and the checks reject both), sequence lengths as a list or tuple of ``int``
or a 1-D integer array, the layout as a ``str`` or None, ``strict`` as a bool. Entries
are kept only where the kernels take views of the caller's memory that are
reshapes of it: C-contiguous arrays (and a writable weight), checked against the
plan's storage views when an entry is made.

This halves the cost of a small call after a cache flush (docs/performance.md,
"Figures behind the code's choices").
"""

import os
import threading
from dataclasses import dataclass

import numpy as np

from . import _dispatch, _pool
from ._plan import plan_forward, plan_grad

#: most signatures kept, and most bytes of tile tables they may hold (the oldest go
#: first; a table of more than an eighth of that is not kept: its calls, over that
#: many sequences, are long anyway). The tables are mostly those ``_plan`` keeps too.
KEPT = 256
KEPT_BYTES = 8 << 20

_entries = {}
_kept_bytes = 0
_lock = threading.Lock()
OUTPUTS = ("out", "input_grad", "weight_grad")
_INT = {int}


@dataclass(frozen=True)
class Entry:
    rules: object            # the Rules the call was checked with (kept alive: keys use its id)
    again: object            # _dispatch.Again
    storage: np.dtype        # the dtype the entry takes the arrays in
    allocate: tuple          # per ROLES entry: the shape of an output to allocate, or None


def _sequences(block, stride, seq, seq_type, layout):
    """The sequence lengths' part of a signature, or None when they, or the call's
    scalars, cannot be compared exactly (not of the exact types a signature holds)."""
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


def _output(a):
    """An output's part of a signature (False: to be allocated), or None."""
    if a is None:
        return False
    if type(a) is np.ndarray:
        return a.dtype, a.shape, a.strides, a.flags.writeable
    return None


# The signatures are written out in full, not built in loops: after a cache flush
# every bytecode a call runs is a miss, and the loops, list appends and helper
# calls of a generic version cost a call more (`bench --overhead`; docs/
# performance.md, "Figures behind the code's choices").

def forward_signature(rules, x, weight, block, stride, seq, seq_type, layout, out):
    """The signature of a forward call, or None (the call goes the full way). The
    weight's writability counts: the kernels take a writable weight."""
    if not (type(x) is np.ndarray and type(weight) is np.ndarray):
        return None
    sequences = _sequences(block, stride, seq, seq_type, layout)
    given = _output(out)
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
    sequences = _sequences(block, stride, seq, seq_type, layout)
    given_ig = _output(input_grad)
    given_wg = _output(weight_grad)
    if sequences is None or given_ig is None or given_wg is None:
        return None
    return ("grad", id(rules), block, stride, sequences, seq_type, layout,
            grad.dtype, grad.shape, grad.strides, x.dtype, x.shape, x.strides,
            weight.dtype, weight.shape, weight.strides, weight.flags.writeable,
            given_ig, given_wg)


def compress(rules, args, threads=None, known=True):
    """The forward's output for ``plan_forward``'s ``args`` (after ``rules``): from a
    kept entry when the call's signature has one, else planned the full way (every
    check and error), run and kept. ``known``: whether ``rules`` is an object that
    lives as long as the process (signatures name it by its id)."""
    x, weight, out = args[0], args[1], args[-1]
    signature = forward_signature(rules, *args) if known else None
    entry = _entries.get(signature)         # None is never a key
    if entry is not None:
        if out is None:
            out = _pool.empty(entry.allocate[2], x.dtype)
        storage = entry.storage
        if _dispatch.run_again(entry.again, threads, x.view(storage), weight.view(storage),
                               out.view(storage)):
            return out
    plan = plan_forward(rules, *args)
    keep(signature, rules, plan, *_dispatch.run(plan, threads=threads),
         () if out is None else ("out",))
    return plan.arrays["out"]


def compress_grad(rules, args, threads=None, known=True):
    """``(input_grad, weight_grad)`` for ``plan_grad``'s ``args``, as ``compress``."""
    g, x, weight, input_grad, weight_grad = args[0], args[1], args[2], args[-2], args[-1]
    signature = grad_signature(rules, *args) if known else None
    entry = _entries.get(signature)
    if entry is not None:
        if input_grad is None:
            input_grad = _pool.empty(entry.allocate[3], x.dtype)
        if weight_grad is None:
            weight_grad = _pool.empty(entry.allocate[4], x.dtype)
        storage = entry.storage
        if _dispatch.run_again(entry.again, threads, g.view(storage), x.view(storage),
                               weight.view(storage), input_grad.view(storage),
                               weight_grad.view(storage)):
            return input_grad, weight_grad
    plan = plan_grad(rules, *args)
    given = tuple(role for role, a in (("input_grad", input_grad), ("weight_grad", weight_grad))
                  if a is not None)
    keep(signature, rules, plan, *_dispatch.run(plan, threads=threads), given)
    return plan.arrays["input_grad"], plan.arrays["weight_grad"]


def keep(signature, rules, plan, recipe, views, given):
    """Keep what ``plan`` (run as ``recipe`` on storage ``views``) needs for later calls
    with ``signature``, if its arrays allow: C-contiguous, with storage views that
    are reshapes of them (the weights' views of the same shape). ``given``: which
    roles' outputs the caller passed (the others were allocated)."""
    if signature is None:
        return
    roles = _dispatch.ROLES[plan.op]
    allocate = []
    for role, view in zip(roles, views):
        a = plan.arrays[role]
        if (view.ctypes.data != a.ctypes.data or view.itemsize != a.itemsize
                or not (a.flags.c_contiguous and view.flags.c_contiguous)
                or view.size != a.size or (view.ndim != 4 and view.shape != a.shape)):
            return          # a copy, a padded carrier, words, a strided view: the full way
        allocate.append(a.shape if role in OUTPUTS and role not in given else None)
    if recipe.tiles.nbytes > KEPT_BYTES // 8:
        return
    global _kept_bytes
    entry = Entry(rules, _dispatch.again(recipe, views), recipe.storage, tuple(allocate))
    with _lock:
        if signature in _entries:          # another thread kept the same call
            return
        _entries[signature] = entry
        _kept_bytes += recipe.tiles.nbytes
        while len(_entries) > KEPT or _kept_bytes > KEPT_BYTES:
            _kept_bytes -= _entries.pop(next(iter(_entries))).again.recipe.tiles.nbytes


def forget():
    """Drop every kept entry (tests start from none)."""
    global _kept_bytes
    with _lock:
        _entries.clear()
        _kept_bytes = 0


def _after_fork():
    """In a forked child: a new lock (another thread may have held the parent's at the
    fork) and no entries (that thread may have been halfway through changing them)."""
    global _lock, _kept_bytes
    _lock = threading.Lock()
    _entries.clear()
    _kept_bytes = 0


if hasattr(os, "register_at_fork"):      # POSIX
    os.register_at_fork(after_in_child=_after_fork)
