"""Running a validated plan: workspace handling and kernel launches.

Like aclnn, running is the second phase: the caller (or ``nsa_numba.api``) sizes the
workspace from ``plan.workspace_bytes``, allocates it, and passes it here. The
kernels keep all their scratch in it (per-tile partials, per-thread rows).
"""

import numba
import numpy as np

from . import _firstrun, _kernels, _simd, _threading
from ._plan import WORKSPACE_ALIGN


def _weight_table(plan):
    """The weight as ``[N, l]`` in the accumulator dtype (small: read once per run)."""
    return np.ascontiguousarray(plan.arrays["weight"].astype(plan.accumulator).T)


def _aligned_elements(plan, workspace):
    """The plan's ``scratch_bytes`` of the workspace from its first WORKSPACE_ALIGN-byte
    boundary, as accumulator elements."""
    skip = -workspace.ctypes.data % WORKSPACE_ALIGN
    return workspace[skip:skip + plan.scratch_bytes].view(plan.accumulator)


def carve(plan, workspace):
    """(partials ``[n_tiles, N, l]``, scratch ``[slots, elements]``) in a uint8 workspace.

    The layout is the one ``_plan`` sizes: from the workspace's first
    ``WORKSPACE_ALIGN``-byte boundary, partials, then one scratch row per thread, all
    in the accumulator dtype (rows are whole multiples of 64 bytes, so every row
    starts at a boundary too).
    """
    elements = _aligned_elements(plan, workspace)
    n_tiles = plan.tiles.shape[0] if plan.partial_elements else 0   # none in the forward
    partials = elements[:n_tiles * plan.N * plan.block].reshape(n_tiles, plan.N, plan.block)
    scratch = elements[plan.partial_elements:].reshape(plan.scratch_slots,
                                                       plan.scratch_elements)
    return partials, scratch


def simd_fits(plan, x, out):
    """Whether ``compress_forward_simd`` can run this forward on storage views ``x``
    and ``out``: each token in at most two windows (l <= 2d), D a multiple of the
    vector width, unit-stride rows in a dtype it converts, an input laid out in C
    order (its software prefetch needs that; without it the kernel measured 1.3x the
    one-token kernel's time), and compiled code (under NUMBA_DISABLE_JIT its vector
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
#: when they are long enough for GROUP tokens per pass (N * D >= GROUPED_MIN_ROW).
#: Measured against the GROUP kernel (2 threads, cold caches): 0.85-0.93x the time for
#: 4 KiB rows (bfloat16 and float16, N = 16, D = 128), 1.0-1.6x for 8 KiB rows (float32
#: N = 16, bfloat16 N = 32) and 1.35x for 16 KiB rows (bfloat16 N = 64).
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


def run(plan, workspace=None, threads=None):
    """Compute the plan's outputs.

    ``workspace``: a writable, C-contiguous uint8 array of at least
    ``plan.workspace_bytes`` (allocated here when None). ``threads``: at most this
    many threads (None: Numba's count for the calling thread).
    """
    launch = prepare(plan, workspace, threads)
    if launch is not None:
        launch()


def prepare(plan, workspace=None, threads=None):
    """The plan's kernel launches as a function of no arguments (None when there is
    nothing to compute), with everything before them done: workspace carved, weight
    table built, kernel and thread count chosen. ``run`` calls it at once;
    ``bench --split`` times it apart from the Python work of a call."""
    useful = plan.threads_useful if threads is None else min(threads, plan.threads_useful)
    _firstrun.calling = plan.dtype      # named if a kernel compiles now
    if plan.op == "infer":
        return _prepare_infer(plan, workspace, useful)
    if workspace is None:
        workspace = new_workspace(plan)
    partials, scratch = carve(plan, workspace)
    wt = _weight_table(plan)
    if plan.op == "forward":
        x, out = plan.storage("input", workspace), plan.storage("out")
        kernel = forward_kernel(plan, x, out)
        return lambda: _threading.launch(kernel, useful, x, wt, out, plan.tiles, plan.stride,
                                         plan.D, scratch)
    x, ig = plan.storage("input", workspace), plan.storage("input_grad")
    g, wg = plan.storage("grad", workspace), plan.storage("weight_grad")
    vector = backward_vector(plan, x, ig)

    def backward():
        _threading.launch(_kernels.compress_backward, useful, g, x, wt, ig, partials,
                          plan.tiles, plan.stride, plan.D, scratch, vector)
        _kernels.reduce_weight_grad(partials, wg)
    return backward


def _prepare_infer(plan, workspace, threads):
    """The with-cache operator: one kernel launch over the writing sequences."""
    if not plan.writers:
        return None
    if workspace is None:
        workspace = new_workspace(plan)
    scratch = _aligned_elements(plan, workspace).reshape(plan.scratch_slots,
                                                         plan.scratch_elements)
    args = (plan.storage("input"), _weight_table(plan), plan.storage("cache"), plan.slots,
            plan.source, plan.D, scratch)
    if threads == 1:
        return lambda: _kernels.compress_infer_serial(*args)
    return lambda: _threading.launch(_kernels.compress_infer, threads, *args)
