"""Running a validated plan: workspace handling and kernel launches.

Like aclnn, running is the second phase: the caller (or ``nsa_numba.api``) sizes the
workspace from ``plan.workspace_bytes``, allocates it, and passes it here. The
kernels keep all their scratch in it (per-tile partials, per-thread rows). A run
given no workspace uses one kept per Python thread (``kept_scratch``).

Every training run goes through a :class:`Recipe`, what ``launch`` needs besides
the arrays; ``recipe`` derives it from a plan, and ``_repeat`` keeps the recipes of
calls that come again, so that those skip planning.
"""

import threading
from dataclasses import dataclass

import numba
import numpy as np

from . import _kernels, _simd, _threading
from ._plan import STORAGE, WORKSPACE_ALIGN, kind_of, weight_storage


@dataclass(frozen=True)
class Recipe:
    """A training run without its arrays: which kernel, on which tiles, with how
    much scratch. The arrays come to ``launch`` as storage views, in the order of
    ``ROLES[op]``."""
    op: str                  # "forward" or "grad"
    dtype: np.dtype          # the call's dtype (named if a kernel compiles)
    storage: np.dtype        # the dtype the kernels see its arrays as (_plan.STORAGE)
    accumulator: np.dtype
    kernel: object           # forward_kernel's choice, or compress_backward
    vector: bool             # backward: token pairs in _simd vectors (backward_vector)
    tiles: np.ndarray
    stride: int
    D: int
    useful: int              # Plan.threads_useful
    partials: tuple          # weight-gradient partials' shape [n_tiles, N, l] (n_tiles 0: none)
    partial_elements: int    # elements before the scratch rows (Plan.partial_elements)
    rows: tuple              # scratch rows' shape [slots, elements]

    @property
    def scratch_bytes(self):
        return ((self.partial_elements + self.rows[0] * self.rows[1])
                * self.accumulator.itemsize)


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


def _aligned_elements(plan, workspace):
    """The plan's ``scratch_bytes`` of the workspace from its first WORKSPACE_ALIGN-byte
    boundary, as accumulator elements."""
    return _aligned(workspace, plan.scratch_bytes).view(plan.accumulator)


def _partials_shape(plan):
    """The weight-gradient partials' shape ``[n_tiles, N, l]`` (no tiles: the forward)."""
    return (plan.tiles.shape[0] if plan.partial_elements else 0), plan.N, plan.block


def _cut(elements, partials, partial_elements, rows):
    """(partials, scratch rows) of accumulator ``elements`` laid out as ``carve`` says."""
    return (elements[:partials[0] * partials[1] * partials[2]].reshape(partials),
            elements[partial_elements:].reshape(rows))


def carve(plan, workspace):
    """(partials ``[n_tiles, N, l]``, scratch ``[slots, elements]``) in a uint8 workspace.

    The layout is the one ``_plan`` sizes: from the workspace's first
    ``WORKSPACE_ALIGN``-byte boundary, partials, then one scratch row per thread, all
    in the accumulator dtype (rows are whole multiples of 64 bytes, so every row
    starts at a boundary too).
    """
    return _cut(_aligned_elements(plan, workspace), _partials_shape(plan),
                plan.partial_elements, (plan.scratch_slots, plan.scratch_elements))


#: a Python thread keeps the scratch of its runs given no workspace, up to this size,
#: for its next ones: allocating and carving a new workspace is a handful of NumPy
#: steps, which cost a small call tens of microseconds after a cache flush
#: (docs/performance.md, "Figures behind the code's choices").
KEPT_SCRATCH_BYTES = 16 << 20


class _Kept(threading.local):
    buffer = None       # 64-byte aligned bytes
    cuts = None         # (accumulator, partials, rows) -> (partials, scratch) in it
    busy = False        # a run on this thread is using it


_kept = _Kept()


def kept_scratch(recipe, key=None):
    """(partials, scratch) for a run without a caller's workspace (``key``: the
    recipe's ``_scratch_key``, if known): views of this thread's kept buffer (grown
    as needed, up to KEPT_SCRATCH_BYTES), or of new memory when the run needs more or
    the buffer is in use (a signal handler's call in the middle of a run). The
    kernels write every scratch element before they read it, so reuse changes no bit
    of any result."""
    kept = _kept
    key = key or _scratch_key(recipe)
    if not kept.busy and kept.cuts is not None:
        cut = kept.cuts.get(key)
        if cut is not None:
            return cut
    nbytes = recipe.scratch_bytes
    if kept.busy or nbytes > KEPT_SCRATCH_BYTES:
        return _cut_bytes(recipe, _fresh_aligned(nbytes))
    if kept.buffer is None or kept.buffer.size < nbytes:
        kept.buffer = _fresh_aligned(nbytes)
        kept.cuts = {}
    elif len(kept.cuts) >= 64:
        kept.cuts.clear()
    cut = kept.cuts[key] = _cut_bytes(recipe, kept.buffer[:nbytes])
    return cut


def _scratch_key(recipe):
    """What a recipe's scratch cut depends on (its key in ``_Kept.cuts``)."""
    return recipe.accumulator, recipe.partials, recipe.rows


def _cut_bytes(recipe, memory):
    """The recipe's (partials, scratch) in aligned bytes ``memory``."""
    return _cut(memory.view(recipe.accumulator), recipe.partials, recipe.partial_elements,
                recipe.rows)


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
    """Whether ``compress_backward`` can run its token pairs in ``_simd`` vectors on
    storage views ``x`` and ``ig``: D a multiple of their width, unit-stride rows of
    one dtype that ``_simd`` converts, and compiled code."""
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


def recipe(plan, views):
    """The :class:`Recipe` of a training ``plan`` run on storage ``views``."""
    if plan.op == "forward":
        kernel, vector = forward_kernel(plan, views[0], views[2]), False
    else:
        kernel, vector = _kernels.compress_backward, backward_vector(plan, views[1], views[3])
    return Recipe(plan.op, plan.dtype, STORAGE[kind_of(plan.dtype)], plan.accumulator,
                  kernel, vector, plan.tiles, plan.stride, plan.D, plan.threads_useful,
                  _partials_shape(plan), plan.partial_elements,
                  (plan.scratch_slots, plan.scratch_elements))


def launch(recipe, views, scratch, threads=None):
    """Run a training recipe: ``views`` its storage views (``ROLES``), ``scratch`` its
    (partials, rows), on at most ``threads`` threads (None: Numba's count for the
    calling thread)."""
    useful = recipe.useful if threads is None else min(threads, recipe.useful)
    partials, rows = scratch
    if recipe.op == "forward":
        x, w, out = views
        _threading.launch(recipe.kernel, useful, x, w, out, recipe.tiles, recipe.stride,
                          recipe.D, rows)
        return
    g, x, w, ig, wg = views
    _threading.launch(recipe.kernel, useful, g, x, w, ig, partials, recipe.tiles,
                      recipe.stride, recipe.D, rows, recipe.vector)
    _kernels.reduce_weight_grad(partials, wg)


def launch_kept(recipe, views, threads=None):
    """``launch`` on this thread's kept scratch (``kept_scratch``), marked in use
    meanwhile."""
    kept = _kept
    scratch = kept_scratch(recipe)
    was, kept.busy = kept.busy, True
    try:
        launch(recipe, views, scratch, threads)
    finally:
        kept.busy = was


#: the entry ``Again`` takes for each training kernel (``_kernels``, "calls that come
#: again")
_AGAIN = {_kernels.compress_forward: _kernels.compress_kept_forward,
          _kernels.compress_forward_rows: _kernels.compress_kept_forward_rows,
          _kernels.compress_forward_simd: _kernels.compress_kept_forward_simd,
          _kernels.compress_backward: _kernels.compress_kept_backward}


@dataclass(frozen=True)
class Again:
    """A recipe bound for calls that come again (``_repeat``): its kernel's entry,
    which takes the caller's arrays in their storage dtype and own shape (``views``
    of ``run_again``), and what the entry takes after them besides the scratch."""
    recipe: Recipe
    entry: object
    constants: tuple          # dims, tiles, stride, D (and the backward's vector flag)
    all_threads: bool         # the recipe wants the whole pool: no thread count to cap
    scratch_key: tuple        # its scratch's key in this thread's kept cuts (kept_scratch)


def again(recipe, views):
    """The :class:`Again` of ``recipe`` run on storage ``views`` (``ROLES``' order) of
    C-contiguous caller arrays; their [B, S, N, D] shapes become the entry's ``dims``."""
    dims = np.array([v.shape for v in views if v.ndim == 4], np.int64).reshape(-1, 4)
    constants = (dims, recipe.tiles, recipe.stride, recipe.D)
    if recipe.op == "grad":
        constants += (recipe.vector,)
    return Again(recipe, _AGAIN[recipe.kernel], constants,
                 recipe.useful >= numba.config.NUMBA_NUM_THREADS, _scratch_key(recipe))


def run_again(kept, threads, *views):
    """Run :class:`Again` ``kept`` on the caller's arrays as storage-dtype ``views`` of
    their own shapes, in ``ROLES``' order, on this thread's kept scratch; False, with
    nothing written, when an output may share memory with an input (the caller then
    goes the full way). ``threads`` as in ``launch``."""
    recipe = kept.recipe
    state = _kept
    partials, rows = kept_scratch(recipe, kept.scratch_key)
    scratch = (rows,) if recipe.op == "forward" else (partials, rows)
    was, state.busy = state.busy, True
    try:
        if (kept.all_threads and (threads is None or threads >= recipe.useful)
                and _threading.concurrent):       # no count to cap, no launch lock
            return kept.entry(*views, *scratch, *kept.constants)
        useful = recipe.useful if threads is None else min(threads, recipe.useful)
        return _threading.launch(kept.entry, useful, *views, *scratch, *kept.constants)
    finally:
        state.busy = was


def run(plan, workspace=None, threads=None):
    """Compute the plan's outputs; return its Recipe and the storage views it ran on
    (None for a decoding step).

    ``workspace``: a writable, C-contiguous uint8 array of at least
    ``plan.workspace_bytes`` (None: this thread's kept scratch, ``kept_scratch``).
    ``threads``: at most this many threads (None: Numba's count for the calling
    thread).
    """
    if plan.op == "infer":
        step = _prepare_infer(plan, workspace, threads)
        if step is not None:
            step()
        return None
    views = storage_views(plan, workspace)
    chosen = recipe(plan, views)
    if workspace is None:
        launch_kept(chosen, views, threads)
    else:
        launch(chosen, views, carve(plan, workspace), threads)
    return chosen, views


def prepare(plan, workspace, threads=None):
    """The plan's kernel launches as a function of no arguments (None when there is
    nothing to compute), with everything before them done in ``workspace``
    (``new_workspace``): views, recipe, scratch. ``bench --split`` times it apart
    from the Python work of a call."""
    if plan.op == "infer":
        return _prepare_infer(plan, workspace, threads)
    views = storage_views(plan, workspace)
    chosen, scratch = recipe(plan, views), carve(plan, workspace)
    return lambda: launch(chosen, views, scratch, threads)


def _prepare_infer(plan, workspace, threads):
    """The with-cache operator: one kernel launch over the writing sequences."""
    useful = plan.threads_useful if threads is None else min(threads, plan.threads_useful)
    if not plan.writers:
        return None
    if workspace is None:
        workspace = new_workspace(plan)
    scratch = _aligned_elements(plan, workspace).reshape(plan.scratch_slots,
                                                         plan.scratch_elements)
    weight = weight_storage(plan.arrays["weight"], STORAGE[kind_of(plan.dtype)])
    args = (plan.storage("input"), weight, plan.storage("cache"), plan.slots, plan.source,
            plan.D, scratch)
    if useful == 1:
        return lambda: _kernels.compress_infer_serial(*args)
    return lambda: _threading.launch(_kernels.compress_infer, useful, *args)
