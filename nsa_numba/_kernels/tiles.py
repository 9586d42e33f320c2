"""What the planner writes and the kernels read: the tile table's columns and the
per-thread scratch sizes of the training kernels.

Both ``_ops.compress`` (which builds the table and sizes the workspace) and ``_kernels.compress``
(which read them) import this module; neither imports the other for it. The table
is described in ``_ops.compress.tile_schedule``, the scratch in ``_ops.compress``'s docstring.
"""

from .._core.jit import jit

# columns of the tile table, one row per tile
BATCH, S0, NW, KW0, I0, I1, TOK_LO, TOK_HI, G0, G1 = range(10)
N_TILE_COLUMNS = 10


@jit
def ring_slots(block, stride):
    """Most windows that can contain one token: ceil(l / d)."""
    return (block + stride - 1) // stride


def forward_scratch_elements(N, D, block, stride):
    """Scratch one thread of the forward kernels needs, in accumulator elements: the
    ring of open window sums and one row of D."""
    return ring_slots(block, stride) * N * D + D


def backward_scratch_elements(N, D, block, stride):
    """Scratch one thread of ``compress_backward`` needs, in accumulator elements:
    the ring of decoded gradient rows, one more row, the per-element weight-gradient
    sums and two rows of D."""
    return (ring_slots(block, stride) + 1 + block) * N * D + 2 * D
