"""Running a validated plan: workspace handling and kernel launches.

Like aclnn, running is the second phase: the caller (or ``nsa_numba.api``) sizes the
workspace from ``plan.workspace_bytes``, allocates it, and passes it here. All
scratch that outlives a single tile lives in that workspace.
"""

import numpy as np

from . import _kernels, _threading


def _weight_table(plan):
    """The weight as ``[N, l]`` in the accumulator dtype (small: read once per run)."""
    return np.ascontiguousarray(plan.arrays["weight"].astype(plan.accumulator).T)


def partials_view(plan, workspace):
    """The weight-gradient partials ``[n_tiles, N, l]`` inside a uint8 workspace."""
    count = plan.tiles.shape[0] * plan.N * plan.block
    return workspace[:plan.workspace_bytes].view(plan.accumulator)[:count].reshape(
        plan.tiles.shape[0], plan.N, plan.block)


def new_workspace(plan):
    return np.empty(plan.workspace_bytes, dtype=np.uint8)


def run(plan, workspace=None):
    """Compute the plan's outputs. ``workspace``: uint8, >= plan.workspace_bytes."""
    if workspace is None:
        workspace = new_workspace(plan)
    wt = _weight_table(plan)
    if plan.op == "forward":
        _threading.launch(_kernels.compress_forward, plan.storage("input"), wt,
                          plan.storage("out"), plan.tiles, plan.stride)
        return
    partials = partials_view(plan, workspace)
    _threading.launch(_kernels.compress_backward, plan.storage("grad"),
                      plan.storage("input"), wt, plan.storage("input_grad"), partials,
                      plan.tiles, plan.stride)
    _kernels.reduce_weight_grad(partials, plan.storage("weight_grad"))
