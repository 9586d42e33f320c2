"""One path for every call of every operator: validate -> plan -> allocate -> launch.

An operator is an :class:`Operator` record, registered once (``_ops.operators``): its
planner checks every argument and returns a plan (nothing allocated, nothing
written); the pipeline then allocates the outputs the caller left to it (from the
output pool, ``_core.pool``) and has the operator launch its kernels. The NumPy API, the
PyTorch bridge and the aclnn mirror all call through here; the aclnn mirror splits
the path where its two phases do (:func:`plan`, then :func:`launch` with the
caller's workspace).

Calls that come again
---------------------
A model calls each operator once per layer and step with new arrays of the same
shapes, dtypes and sequence lengths. An operator may give a *signature*: everything
its checks read of a call (types, dtypes, shapes, strides, writability, the integers
and sequence values; never the contents), exactly, or None where equality would not
mean the same checks. After a call succeeds, the operator's ``prepare`` makes a
prepared call (``_ops.dispatch.Prepared``), kept under the signature in the prepared-call
cache; a later call with the same signature passes the same checks and gets the
same plan, so the operator's ``fast`` path runs the prepared call on the new arrays
(which checks in machine code that the outputs share no memory with the inputs).
Anything else, and any overlap, goes the full path, which also raises every error:
a prepared call only ever answers arguments that passed. Operators without a
signature always take the full path.
"""

import inspect
from dataclasses import dataclass

import numpy as np

from .._core.cache import BoundedCache
from .._core.errors import invalid

#: most prepared calls kept, and most bytes of tile tables they may hold
CACHED_CALLS = 256
CACHED_BYTES = 8 << 20

_prepared = BoundedCache(CACHED_CALLS, CACHED_BYTES)

#: registered operators, by name (``Operator.name``, also each plan's ``op``)
OPERATORS = {}


@dataclass(frozen=True, kw_only=True)
class Operator:
    """What the pipeline needs of an operator. Every function takes the operator's
    arguments in its planner's order (``args``)."""
    name: str
    #: (rules, *args) -> a plan: every check, no allocation; NsaError if invalid
    planner: object
    #: (plan, workspace or None, threads or None) -> what ``prepare`` takes
    launch: object
    #: plan -> what the call returns
    results: object
    #: (rules, *args) -> hashable signature or None (optional: the fast path)
    signature: object = None
    #: (prepared, threads, *args) -> the results, or None to go the full path
    fast: object = None
    #: (plan, launched, *args) -> (prepared call, bytes it holds), or None
    prepare: object = None
    #: whether the planner reads the contents of arrays (indices), not only their
    #: shapes: the aclnn mirror then plans again at every run, on the current contents
    reads_contents: bool = False


#: each operator's planner parameters after ``rules``, by operator name
_PARAMS = {}
#: planner parameters whose name in the rules is another
_ROLES = {"x": "input"}


def register(operator):
    """Make ``operator`` callable through the pipeline (once, at import)."""
    if operator.name in OPERATORS:
        raise ValueError(f"operator {operator.name!r} is already registered")
    OPERATORS[operator.name] = operator
    _PARAMS[operator.name] = tuple(inspect.signature(operator.planner).parameters)[1:]
    return operator


def array_arguments(operator, rules, args):
    """``(name, array)`` of every NumPy array among a call's ``args``, named as
    ``rules`` name its parameter."""
    for param, a in zip(_PARAMS[operator.name], args):
        if isinstance(a, np.ndarray):
            yield rules.names.get(_ROLES.get(param, param), param), a


def _checked_plan(operator, rules, args):
    """The planner's plan; first NsaError for a masked array, whose mask no kernel
    would honour (the planners take every other array as what it is)."""
    for name, a in array_arguments(operator, rules, args):
        if isinstance(a, np.ma.MaskedArray):
            raise invalid(rules.op, f"{name} must be a plain numpy.ndarray, got a "
                                    f"numpy.ma.MaskedArray, whose mask would be ignored "
                                    f"(pass its .filled() or .data)")
    return operator.planner(rules, *args)


def call(operator, rules, args, threads=None, known=True):
    """Run ``operator`` on ``args`` checked by ``rules`` and return its results:
    through a prepared call when the call's signature has one, else the full path
    (and prepared for next time). ``threads``: at most this many threads (None:
    the calling thread's count). ``known``: whether ``rules`` lives as long
    as the process (signatures name it by its id)."""
    signature = operator.signature(rules, *args) if known and operator.signature else None
    kept = _prepared._items.get(signature)     # _prepared.get, without the method call
    if kept is not None:
        results = operator.fast(kept[0], threads, *args)
        if results is not None:
            return results
    plan = _checked_plan(operator, rules, args)
    plan.allocate()
    launched = operator.launch(plan, None, threads)
    if signature is not None:
        made = operator.prepare(plan, launched, *args)
        if made is not None:
            _prepared.put(signature, *made)
    return operator.results(plan)


def plan(operator, rules, args):
    """The first half of the path (aclnn's phase one): the checked plan with its
    outputs allocated."""
    checked = _checked_plan(operator, rules, args)
    checked.allocate()
    return checked


def launch(checked, workspace=None, threads=None):
    """The second half (aclnn's phase two): launch ``checked``'s kernels in
    ``workspace`` (a writable C-contiguous uint8 array of at least its
    ``workspace_bytes``; None: this thread's kept scratch)."""
    OPERATORS[checked.op].launch(checked, workspace, threads)


def forget():
    """Drop every prepared call (tests start from none)."""
    _prepared.clear()


def prepared_calls():
    """The prepared calls kept, oldest first (for tests and ``bench --overhead``)."""
    return _prepared.values()
