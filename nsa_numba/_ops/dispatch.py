"""Launching the compress operators' kernels: workspace handling, the kernel each
problem gets, scratch kept per thread, and prepared calls.

Like aclnn, running is the second phase: the caller (or the pipeline) sizes the
workspace from ``plan.workspace_bytes``, allocates it, and passes it here. The
kernels keep all their scratch in it (per-tile partials, per-thread rows). A run
given no workspace uses scratch kept per Python thread (``thread_scratch``).

A full-path run goes through a :class:`Recipe`, what ``launch`` needs besides the
arrays. A run that succeeded can leave a :class:`Prepared` call for the pipeline's
cache: the recipe's kernel and constants, for calls that come again: it takes
the caller's arrays as they are (``run_prepared``).
"""

import threading
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from .._core import launch as _launch
from .._core import pool as _pool
from .._kernels import compress as _kernels
from .._kernels import simd as _simd
from .checks import STORAGE, WORKSPACE_ALIGN, kind_of
from .compress import weight_storage


class Scratch(NamedTuple):
    """The scratch a run needs, in its accumulator dtype: the weight-gradient
    partials ``[n_tiles, N, l]`` (n_tiles 0: none), then per-thread rows ``[slots,
    elements]`` from ``partial_elements`` on (``_plan`` sizes them). A tuple: it keys
    each thread's scratch cuts, and a tuple hashes in C (every repeated call looks
    its cut up)."""
    accumulator: np.dtype
    partials: tuple
    partial_elements: int
    rows: tuple

    @property
    def nbytes(self):
        return ((self.partial_elements + self.rows[0] * self.rows[1])
                * self.accumulator.itemsize)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A training run without its arrays: which kernel, on which tiles, with how
    much scratch, and how its arrays go in. The arrays come to ``launch`` in the
    order of ``ROLES[op]``: the caller's own (``own``) or storage views."""
    op: str                  # "forward" or "grad"
    storage: np.dtype        # the dtype the kernels see the arrays as (checks.STORAGE)
    kernel: object           # forward_kernel's choice, or a backward kernel (backward_vector)
    tiles: np.ndarray
    stride: int
    D: int
    dims: np.ndarray         # [B, S, N, D] of each 4-axis storage view, in role order
    own: bool                # the arrays are the caller's, in storage dtype (kernel_arrays)
    useful: int              # Plan.threads_useful
    scratch: Scratch


#: the storage views ``launch`` takes, by op, in the kernels' order
ROLES = {"forward": ("input", "weight", "out"),
         "grad": ("grad", "input", "weight", "input_grad", "weight_grad")}


def _aligned(workspace, nbytes):
    """``nbytes`` of a uint8 ``workspace`` from its first WORKSPACE_ALIGN-byte boundary."""
    skip = -workspace.ctypes.data % WORKSPACE_ALIGN
    return workspace[skip:skip + nbytes]


def _fresh_aligned(nbytes):
    """``nbytes`` of new memory starting at a WORKSPACE_ALIGN-byte boundary."""
    return _aligned(np.empty(nbytes + WORKSPACE_ALIGN, np.uint8), nbytes)


def scratch_of(plan):
    """The :class:`Scratch` of a training plan."""
    partials = (plan.tiles.shape[0] if plan.partial_elements else 0), plan.N, plan.block
    return Scratch(plan.accumulator, partials, plan.partial_elements,
                   (plan.scratch_slots, plan.scratch_elements))


def _cut(memory, scratch):
    """(partials, scratch rows) of aligned bytes ``memory`` laid out as ``scratch`` says."""
    elements = memory.view(scratch.accumulator)
    p = scratch.partials
    return (elements[:p[0] * p[1] * p[2]].reshape(p),
            elements[scratch.partial_elements:].reshape(scratch.rows))


def carve(plan, workspace):
    """(partials ``[n_tiles, N, l]``, scratch ``[slots, elements]``) in a uint8 workspace.

    The layout is the one ``_ops.compress`` sizes: from the workspace's first
    ``WORKSPACE_ALIGN``-byte boundary, partials, then one scratch row per thread, all
    in the accumulator dtype (rows are whole multiples of 64 bytes, so every row
    starts at a boundary too).
    """
    scratch = scratch_of(plan)
    return _cut(_aligned(workspace, scratch.nbytes), scratch)


#: a Python thread keeps the scratch of its runs given no workspace, up to this size,
#: for its next ones: allocating and carving a new workspace is a handful of NumPy
#: steps, which cost a small call tens of microseconds after a cache flush
#: (docs/performance.md, "Figures behind the code's choices").
THREAD_SCRATCH_BYTES = 16 << 20


class _ThreadScratch(threading.local):
    buffer = None       # 64-byte aligned bytes
    cuts = None         # Scratch -> (partials, rows) in it
    busy = False        # a run on this thread is using it


_thread_scratch = _ThreadScratch()


def thread_scratch(scratch):
    """(partials, rows) of :class:`Scratch` ``scratch`` for a run without a caller's
    workspace: views of this thread's kept buffer (grown as needed, up to
    THREAD_SCRATCH_BYTES), or of new memory when the run needs more or the buffer is in
    use (a signal handler's call in the middle of a run). The kernels write every
    scratch element before they read it, so reuse changes no bit of any result."""
    kept = _thread_scratch
    if not kept.busy and kept.cuts is not None:
        cut = kept.cuts.get(scratch)
        if cut is not None:
            return cut
    nbytes = scratch.nbytes
    if kept.busy or nbytes > THREAD_SCRATCH_BYTES:
        return _cut(_fresh_aligned(nbytes), scratch)
    if kept.buffer is None or kept.buffer.size < nbytes:
        kept.buffer = _fresh_aligned(nbytes)
        kept.cuts = {}
    elif len(kept.cuts) >= 64:
        kept.cuts.clear()
    cut = kept.cuts[scratch] = _cut(kept.buffer[:nbytes], scratch)
    return cut


def simd_fits(plan, x, out):
    """Whether ``compress_forward_simd`` can run this forward on storage views ``x``
    and ``out``: each token in at most two windows (l <= 2d), D a multiple of the
    vector width, unit-stride rows in a dtype it converts, an input laid out in C
    order (its software prefetch needs that; without it the kernel was slower than the
    one-token kernel), and compiled code (under NUMBA_DISABLE_JIT its vector
    operations do not exist)."""
    return (not numba.config.DISABLE_JIT and plan.block <= 2 * plan.stride
            and plan.D % _simd.WIDTH == 0 and x.flags.c_contiguous
            and _simd.row_fits(x) and _simd.row_fits(out))


def backward_vector(plan, x, ig):
    """Whether the backward can run its token pairs in ``_kernels.simd`` vectors
    (``compress_backward_simd``) on storage views ``x`` and ``ig``: D a multiple of
    their width, unit-stride rows of one dtype that ``_kernels.simd`` converts, and compiled
    code."""
    return (not numba.config.DISABLE_JIT and plan.D % _simd.SHORT_WIDTH == 0
            and x.dtype == ig.dtype and _simd.row_fits(x) and _simd.row_fits(ig))


#: token rows of up to this many bytes go to compress_forward_simd where it fits, even
#: when they are long enough for GROUP tokens per pass (N * D >= GROUPED_MIN_ROW): up
#: to there it beat the GROUP kernel, beyond it lost (docs/performance.md, "Figures
#: behind the code's choices").
SIMD_ROW_BYTES = 4096


def forward_kernel(plan, x, out):
    """The forward kernel for this problem (all give the same bits): the register-held
    one where it fits and token rows are short or at most SIMD_ROW_BYTES; otherwise
    one token per pass for short rows and GROUP tokens per pass for long ones."""
    long_rows = plan.N * plan.D >= _kernels.GROUPED_MIN_ROW
    if ((not long_rows or plan.N * plan.D * x.itemsize <= SIMD_ROW_BYTES)
            and simd_fits(plan, x, out)):
        return _kernels.compress_forward_simd
    return _kernels.compress_forward if long_rows else _kernels.compress_forward_rows


def new_workspace(plan):
    return np.empty(plan.workspace_bytes, dtype=np.uint8)


def storage_views(plan, workspace=None):
    """The plan's arrays as its kernels take them, in the order of ``ROLES``."""
    return tuple(plan.storage(role, workspace) for role in ROLES[plan.op])


def kernel_arrays(plan, views):
    """(arrays, own) for a training ``plan``'s storage ``views``: per role, the
    caller's array in its storage dtype and own shape where it is C-contiguous with a
    view that is a reshape of it (not a copy, a padded carrier, words or a strided
    view); else a C-contiguous view with the caller's number of axes (a carrier of a
    packed TND array goes in as ``[T, N, D]``), else the view. ``own``: all are the
    caller's, which a prepared call can pass again. So a packed input's slice, a
    weight that needed a copy and contiguous arrays all run one compiled variant."""
    arrays, own = [], True
    for role, view in zip(ROLES[plan.op], views):
        a = plan.arrays[role]
        if (view.ctypes.data == a.ctypes.data and view.itemsize == a.itemsize
                and a.flags.c_contiguous and view.flags.c_contiguous
                and view.size == a.size and (view.ndim == 4 or view.shape == a.shape)):
            arrays.append(a.view(view.dtype))
            continue
        own = False
        if view.ndim == 4 and a.ndim == 3 and view.shape[0] == 1 and view.flags.c_contiguous:
            arrays.append(view.reshape(view.shape[1:]))
        else:
            arrays.append(view)
    return tuple(arrays), own


def recipe(plan, views):
    """(the :class:`Recipe` of a training ``plan`` run on storage ``views``, the
    arrays its kernel takes)."""
    if plan.op == "forward":
        kernel = forward_kernel(plan, views[0], views[2])
    elif backward_vector(plan, views[1], views[3]):
        kernel = _kernels.compress_backward_simd
    else:
        kernel = _kernels.compress_backward
    arrays, own = kernel_arrays(plan, views)
    dims = np.array([v.shape for v in views if v.ndim == 4], np.int64).reshape(-1, 4)
    chosen = Recipe(op=plan.op, storage=STORAGE[kind_of(plan.dtype)], kernel=kernel,
                    tiles=plan.tiles, stride=plan.stride, D=plan.D,
                    dims=dims, own=own, useful=plan.threads_useful, scratch=scratch_of(plan))
    return chosen, arrays


def launch(recipe, arrays, scratch, threads=None):
    """Run a training recipe: ``arrays`` what its kernel takes (``recipe``), ``scratch``
    its (partials, rows), on at most ``threads`` threads (None: the calling
    thread's count, ``_core.launch.count``)."""
    useful = recipe.useful if threads is None else min(threads, recipe.useful)
    partials, rows = scratch
    if recipe.op == "forward":
        _launch.run(recipe.kernel, useful, 1, *arrays, rows, recipe.dims, recipe.tiles,
                    recipe.stride, recipe.D, False)
        return
    rest = (partials, rows, recipe.dims, recipe.tiles, recipe.stride, recipe.D, False)
    _launch.run(recipe.kernel, useful, 1, *arrays, *rest, closing=True)


def run_compress(plan, workspace=None, threads=None):
    """Launch a training plan (the pipeline's ``launch`` for both compress operators);
    return its Recipe.

    ``workspace``: a writable, C-contiguous uint8 array of at least
    ``plan.workspace_bytes`` (None: this thread's kept scratch, ``thread_scratch``).
    ``threads``: at most this many threads (None: the count of the calling
    thread).
    """
    chosen, arrays = recipe(plan, storage_views(plan, workspace))
    if workspace is not None:
        launch(chosen, arrays, carve(plan, workspace), threads)
        return chosen
    kept = _thread_scratch
    scratch = thread_scratch(chosen.scratch)
    was, kept.busy = kept.busy, True
    try:
        launch(chosen, arrays, scratch, threads)
    finally:
        kept.busy = was
    return chosen


def prepare(plan, workspace, threads=None):
    """A training plan's kernel launches as a function of no arguments, with
    everything before them done in ``workspace`` (``new_workspace``): views, recipe,
    scratch. ``bench --split`` times it apart from the Python work of a call."""
    chosen, arrays = recipe(plan, storage_views(plan, workspace))
    scratch = carve(plan, workspace)
    return lambda: launch(chosen, arrays, scratch, threads)


# -- prepared calls ----------------------------------------------------------------

#: the training kernels a recipe or prepared call runs
KERNELS = (_kernels.compress_forward, _kernels.compress_forward_rows,
           _kernels.compress_forward_simd, _kernels.compress_backward,
           _kernels.compress_backward_simd)

#: the roles a caller may leave to be allocated
OUTPUT_ROLES = ("out", "input_grad", "weight_grad")


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A training call that ran, ready to run again on new arrays of the same
    signature (``_ops.pipeline``): its kernel, which takes the caller's arrays in their
    storage dtype and own shape, and what it takes after them besides the scratch."""
    op: str                  # "forward" or "grad"
    kernel: object           # Recipe.kernel
    constants: tuple         # dims, tiles, stride, D, check (True)
    storage: np.dtype
    scratch: Scratch
    useful: int              # most threads worth waking
    allocate: tuple          # per ROLES entry: the shape of an output to allocate, or None


def prepared_call(plan, chosen, given):
    """(:class:`Prepared`, bytes it holds) of ``plan`` run as Recipe ``chosen``, or None
    where its kernel did not take the caller's own arrays (``kernel_arrays``).
    ``given``: the roles whose outputs the caller passed (the others were
    allocated)."""
    if not chosen.own:
        return None
    allocate = tuple(plan.arrays[role].shape
                     if role in OUTPUT_ROLES and role not in given else None
                     for role in ROLES[plan.op])
    made = Prepared(op=chosen.op, kernel=chosen.kernel,
                    constants=(chosen.dims, chosen.tiles, chosen.stride, chosen.D, True),
                    storage=chosen.storage, scratch=chosen.scratch, useful=chosen.useful,
                    allocate=allocate)
    return made, chosen.tiles.nbytes


def run_prepared(prepared, threads, *views):
    """Run ``prepared`` on the caller's arrays as storage-dtype ``views`` of their own
    shapes, in ``ROLES``' order, on this thread's kept scratch; False, with nothing
    written, when an output may share memory with an input (the caller then goes the
    full path). ``threads`` as in ``launch``."""
    state = _thread_scratch
    partials, rows = thread_scratch(prepared.scratch)
    scratch = (rows,) if prepared.op == "forward" else (partials, rows)
    was, state.busy = state.busy, True
    try:
        useful = prepared.useful if threads is None else min(threads, prepared.useful)
        return _launch.run(prepared.kernel, useful, 1, *views, *scratch, *prepared.constants,
                           closing=prepared.op == "grad")
    finally:
        state.busy = was


# The fast paths of the two training operators are written out, not built from
# ROLES in loops: after a cache flush every bytecode a call runs is a miss (docs/
# performance.md, "Figures behind the code's choices").

def forward_again(prepared, threads, x, weight, block, stride, seq, seq_type, layout, out):
    """The forward's fast path: its output, or None to go the full path."""
    if out is None:
        out = _pool.empty(prepared.allocate[2], x.dtype)
    storage = prepared.storage
    if run_prepared(prepared, threads, x.view(storage), weight.view(storage),
                    out.view(storage)):
        return out
    return None


def grad_again(prepared, threads, g, x, weight, block, stride, seq, seq_type, layout,
               input_grad, weight_grad):
    """The backward's fast path: ``(input_grad, weight_grad)``, or None."""
    if input_grad is None:
        input_grad = _pool.empty(prepared.allocate[3], x.dtype)
    if weight_grad is None:
        weight_grad = _pool.empty(prepared.allocate[4], x.dtype)
    storage = prepared.storage
    if run_prepared(prepared, threads, g.view(storage), x.view(storage),
                    weight.view(storage), input_grad.view(storage),
                    weight_grad.view(storage)):
        return input_grad, weight_grad
    return None


def prepare_forward(plan, launched, x, weight, block, stride, seq, seq_type, layout, out):
    return prepared_call(plan, launched, () if out is None else ("out",))


def prepare_grad(plan, launched, g, x, weight, block, stride, seq, seq_type, layout,
                 input_grad, weight_grad):
    given = tuple(role for role, a in (("input_grad", input_grad),
                                       ("weight_grad", weight_grad)) if a is not None)
    return prepared_call(plan, launched, given)


# -- the with-cache operator ---------------------------------------------------------

def run_infer(plan, workspace=None, threads=None):
    """Launch a decoding step (the pipeline's ``launch`` for the with-cache
    operator)."""
    step = _infer_launch(plan, workspace, threads)
    if step is not None:
        step()


def _infer_launch(plan, workspace, threads):
    """The with-cache operator's one kernel launch over the writing sequences, as a
    function of no arguments (None when no sequence writes)."""
    useful = plan.threads_useful if threads is None else min(threads, plan.threads_useful)
    if not plan.writers:
        return None
    if workspace is None:
        workspace = new_workspace(plan)
    scratch = _aligned(workspace, plan.scratch_bytes).view(plan.accumulator).reshape(
        plan.scratch_slots, plan.scratch_elements)
    weight = weight_storage(plan.arrays["weight"], STORAGE[kind_of(plan.dtype)])
    args = (plan.storage("input"), weight, plan.storage("cache"), plan.slots, plan.source,
            plan.D, scratch)
    return lambda: _launch.run(_kernels.compress_infer, useful, 1, *args)
