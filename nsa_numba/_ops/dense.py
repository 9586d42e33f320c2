"""Dense attention's plan and launch: every key of a sequence that its geometry and
mask leave visible (``_kernels.attention``'s dense kernels). Fusion attention (``_ops.fusion``)
and compressed attention (``_ops.compress_attention``) check their arguments and build
a :class:`DensePlan`; the gradient of both is the one :func:`dense_steps` launches.

The kernels take every operator array token-major with four axes, ``[B, S, N, X]``
(token ``t`` is ``[t // S, t % S]``): a strided view of the layout the caller gave
(:func:`token_rows`), never a copy. A TND array is ``[1, T, N, X]``.

Workspace: the keys staged as float32 in chunks of ``_kernels.attention.CHUNK`` per
sequence (transposed for the scores, as rows for the values' sum; for the gradient
the keys as rows and the values transposed), each row's visible range, one scratch
row and one index row per thread, and for the gradient the owners' work.
"""

import functools
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .._core import launch as _launch
from .._kernels import attention as _attention
from .checks import round16, scratch_slots
from .select import AttentionPlan

#: the roles whose arrays have the key heads N2 (the others have the query heads N1)
KEY_ROLES = frozenset({"key", "value", "dk", "dv"})
STAT_ROLES = frozenset({"softmax_max", "softmax_sum"})
#: most bytes of staged keys and per-token tables a call holds at once: a call over
#: more sequences than that runs in parts of whole sequences (a part's workspace is
#: this or one sequence's, whichever is larger), one after the other
PART_BYTES = 128 << 20


def token_rows(a, layout, heads):
    """``a`` (of ``layout``: TND, BSND, BNSD, BSH or SBH, ``heads`` heads) as a
    ``[B, S, N, X]`` view."""
    if layout == "TND":
        return a[None]
    if layout == "BSND":
        return a
    if layout == "BNSD":
        return a.transpose(0, 2, 1, 3)
    width = a.shape[2] // heads
    s0, s1, s2 = a.strides
    if layout == "BSH":
        shape, strides = (a.shape[0], a.shape[1]), (s0, s1)
    else:                                               # SBH
        shape, strides = (a.shape[1], a.shape[0]), (s1, s0)
    return as_strided(a, (*shape, heads, width), (*strides, width * s2, s2),
                      writeable=a.flags.writeable)


def stat_rows(a, layout):
    """Softmax statistics (TND ``[T1, N1, 8]``, else ``[B, N1, S1, 8]``) as a ``[B, S,
    N, 8]`` view."""
    return a[None] if layout == "TND" else a.transpose(0, 2, 1, 3)


class Chunks:
    """What dense plans share: keys staged in chunks of ``_kernels.attention.CHUNK`` per
    sequence (``chunk_starts`` [B + 1]: each sequence's first chunk; ``chunk_row``,
    ``chunk_len``: each chunk's first key row and key count)."""

    @property
    def chunks(self):
        return self.chunk_row.size

    @property
    def row(self):
        """Floats in one of a unit's score rows: the most chunks a sequence has, in
        keys, and a vector's slack."""
        most = int(np.diff(self.chunk_starts).max(initial=0))
        return most * _attention.CHUNK + _attention.KEY_ALIGN


def chunks(kv_starts):
    """``(chunk_starts, chunk_row, chunk_len)`` for sequences starting at ``kv_starts``."""
    C = _attention.CHUNK
    lengths = np.diff(kv_starts)
    per = -(-lengths // C)
    starts = np.concatenate(([0], np.cumsum(per))).astype(np.int64)
    seq = np.repeat(np.arange(lengths.size), per)           # each chunk's sequence
    first = (np.arange(seq.size, dtype=np.int64) - starts[seq]) * C    # within it
    return dict(chunk_starts=starts, chunk_row=(kv_starts[seq] + first).astype(np.int64),
                chunk_len=np.minimum(C, lengths[seq] - first).astype(np.int64))


def token_blocks(q_starts, tokens):
    """``[n, 2]`` int64: the first token and the count of each block of at most
    ``tokens`` consecutive query tokens, blocks within a sequence."""
    lengths = np.diff(q_starts)
    per = -(-lengths // tokens)
    seq = np.repeat(np.arange(lengths.size), per)
    within = np.arange(seq.size) - np.repeat(np.cumsum(per) - per, per)
    firsts = q_starts[:-1][seq] + within * tokens
    return np.stack([firsts, np.minimum(tokens, q_starts[1:][seq] - firsts)],
                    axis=1).astype(np.int64)


def unbounded(batches):
    """The geometry of sequences whose rows may see every key, without a mask offset."""
    U = _attention.UNBOUNDED
    return np.tile(np.array([-U, U, 0, 0], np.int64), (batches, 1))


@dataclass(frozen=True, kw_only=True)
class DensePlan(Chunks, AttentionPlan):
    """A checked dense-attention call, forward or gradient (``op`` ending in
    "_grad"), ready to launch. ``geo``, ``mask``, ``mstep`` and ``zero_rows`` are
    ``_kernels.attention.dense_ranges``' arguments; ``mask_heads`` is 1, or N1 when the mask
    has a row per head (then each unit is one head: ``Gu = 1``, else ``Gu = G``)."""
    op: str
    dtype: np.dtype
    T1: int
    N2: int
    G: int
    Gu: int
    D: int
    Dv: int
    scale: float
    q_starts: np.ndarray            # [B + 1]
    kv_starts: np.ndarray           # [B + 1]
    chunk_starts: np.ndarray
    chunk_row: np.ndarray
    chunk_len: np.ndarray
    geo: np.ndarray                 # [B, 4] int64
    mask: np.ndarray                # uint8 [rows, cols], or [0, 0] for none
    mstep: int
    mask_heads: int
    zero_rows: bool
    input_layout: str               # how the arrays are laid out (token_rows)
    arrays: dict
    pending: dict = field(default_factory=dict)
    #: a part's sequences in the whole call's arrays (``part``): ``((t0, t1), (k0, k1))``
    #: its query tokens and keys (TND), or its batch rows twice; None: the whole call
    cut: tuple = None

    @property
    def grad(self):
        return self.op.endswith("_grad")

    @property
    def units(self):
        return self.T1 * self.N2 * self.G // self.Gu

    @property
    def tokens(self):
        """Consecutive tokens a forward or dq unit takes: enough that its rows (tokens
        times its ``Gu`` heads) reach ``_kernels.attention.UNIT_ROWS``, so each key chunk it
        loads serves that many rows."""
        return max(1, _attention.UNIT_ROWS // self.Gu)

    @property
    def rows4(self):
        """A unit's rows, tokens times heads, rounded up to 4."""
        return -(-self.tokens * self.Gu // 4) * 4

    def summary(self):
        return (f"{self.op} {self.input_layout} T1={self.T1} N1={self.N2 * self.G} "
                f"N2={self.N2} D={self.D} Dv={self.Dv}")

    def rows(self, role):
        """``role``'s array as the kernels take it: storage dtype, ``[B, S, N, X]`` (a
        part's sequences only)."""
        a = self.storage(role)
        if role in STAT_ROLES:
            view = stat_rows(a, self.input_layout)
        else:
            view = token_rows(a, self.input_layout, self.N2 if role in KEY_ROLES
                              else self.N2 * self.G)
        return view if self.cut is None else self.clip(view, role in KEY_ROLES)

    def clip(self, view, keys=False):
        """A ``[B, S, ...]`` view of the whole call cut to this part's query tokens
        (``keys``: its keys)."""
        lo, hi = self.cut[keys]
        return view[:, lo:hi] if self.input_layout == "TND" else view[lo:hi]

    def _cost(self):
        """Bytes of staged keys and per-token tables of each sequence."""
        width = 2 * self.D + self.Dv if self.grad else self.D + self.Dv
        chunks = np.diff(self.chunk_starts) * (self.N2 * _attention.CHUNK * width
                                                * self.accumulator.itemsize)
        return chunks + np.diff(self.q_starts) * (self.mask_heads * 32 + 16)

    @functools.cached_property
    def parts(self):
        """The call as runs of whole sequences of at most ``PART_BYTES`` each (more
        where one sequence takes more): ``[self]`` when it fits whole."""
        if self.cut is not None:
            return [self]
        total = np.cumsum(self._cost())
        if not total.size or total[-1] <= PART_BYTES:
            return [self]
        group = total // PART_BYTES
        cuts = np.flatnonzero(np.diff(group)) + 1
        bounds = [0, *cuts.tolist(), total.size]
        return [self.part(b0, b1) for b0, b1 in zip(bounds[:-1], bounds[1:])]

    def part(self, b0, b1):
        """The plan of sequences ``b0 .. b1 - 1`` alone, over the same arrays."""
        t0, t1 = int(self.q_starts[b0]), int(self.q_starts[b1])
        k0, k1 = int(self.kv_starts[b0]), int(self.kv_starts[b1])
        c0, c1 = int(self.chunk_starts[b0]), int(self.chunk_starts[b1])
        cut = ((t0, t1), (k0, k1)) if self.input_layout == "TND" else ((b0, b1), (b0, b1))
        return replace(self, T1=t1 - t0, q_starts=self.q_starts[b0:b1 + 1] - t0,
                       kv_starts=self.kv_starts[b0:b1 + 1] - k0,
                       chunk_starts=self.chunk_starts[b0:b1 + 1] - c0,
                       chunk_row=self.chunk_row[c0:c1] - k0,
                       chunk_len=self.chunk_len[c0:c1], geo=self.geo[b0:b1], cut=cut,
                       **self._part_fields(b0, b1))

    def _part_fields(self, b0, b1):
        """A subclass's own per-sequence fields, cut to sequences ``b0 .. b1 - 1``."""
        return {}

    @property
    def workspace_bytes(self):
        parts = self.parts
        if len(parts) == 1:
            return AttentionPlan.workspace_bytes.fget(self)
        return max(p.workspace_bytes for p in parts)

    def layout(self):
        """(name, elements, dtype) of each workspace region, in order."""
        G4, U4 = -(-self.Gu // 4) * 4, self.rows4
        lds, D, Dv, C = self.row, self.D, self.Dv, _attention.CHUNK
        slots = scratch_slots()
        st = self.accumulator               # keys staged widened: the tile loads them as is
        staged = self.chunks * self.N2 * C
        ranges = ("ranges", self.T1 * self.mask_heads * 4, np.dtype(np.int64))
        if not self.grad:
            floats = U4 * (D + lds + Dv) + 2 * lds
            index = max(D, C) + lds
            return [("blocks", self.blocks_size, np.dtype(np.int64)),
                    ("kt", staged * D, st), ("vrow", staged * Dv, st), ranges,
                    ("scratch", slots * round16(floats), self.accumulator),
                    ("index", slots * round16(index), np.dtype(np.int64))]
        R = G4 * max(1, _attention.PAIR_ROWS // G4)       # _attention.owner_batch rows
        dq_floats = U4 * (D + Dv) + 2 * U4 * lds + 3 * U4 + U4 * D
        owner_floats = R * (D + Dv) + 2 * R * (C + _attention.KEY_ALIGN) + 3 * R + C * (D + Dv)
        index = max(D, Dv, lds, R)
        return [("blocks", self.blocks_size, np.dtype(np.int64)),
                ("kt", staged * D, st), ("krow", staged * D, st), ("vt", staged * Dv, st),
                ranges, ("work", self.chunks + 1, np.dtype(np.int64)),
                ("scratch", slots * round16(max(dq_floats, owner_floats)), self.accumulator),
                ("index", slots * round16(index), np.dtype(np.int64))]

    @property
    def blocks_size(self):
        """Elements of the ``[n, 2]`` token blocks (``token_blocks``), at most."""
        return 2 * (self.T1 // self.tokens + self.q_starts.size)

    def forward_step(self, w, useful, ranges, blocks):
        """The forward's launch after staging and ranges."""
        _launch.any_layout(
            _attention.dense_forward, useful, 4, self.rows("query"), self.q_starts,
            self.kv_starts, self.chunk_starts, blocks, ranges, w["kt"], w["vrow"], self.mask,
            self.geo, self.mstep, self.rows("attention_out"), self.rows("softmax_max"),
            self.rows("softmax_sum"), w["scratch"], w["index"], self.G, self.Gu, self.row,
            self.accumulator.type(self.scale))


def run_dense(plan, workspace=None, threads=None):
    """Launch a planned dense call (the pipeline's ``launch``)."""
    for _, step in dense_steps(plan, workspace, threads):
        step()


def dense_steps(plan, workspace=None, threads=None):
    """A planned call's launches in order, as ``(name, function of no arguments)``:
    "stage" and "ranges" (the rows' visible keys), then the forward's "forward", or
    the gradient's "dq", "order" (the key owners by work) and "dk dv"; each part's
    (``DensePlan.parts``) in turn, all in the one workspace."""
    if plan.units == 0 and not plan.grad:
        return []
    parts = plan.parts
    if len(parts) == 1:
        return _part_steps(plan, workspace, threads)
    if workspace is None:
        workspace = np.empty(plan.workspace_bytes, np.uint8)
    return [step for part in parts for step in _part_steps(part, workspace, threads)]


def _part_steps(plan, workspace, threads):
    if plan.units == 0 and not plan.grad:
        return []
    w = plan.carve(workspace)
    useful = plan.threads_useful if threads is None else min(threads, plan.threads_useful)
    scale = plan.accumulator.type(plan.scale)
    empty = np.zeros(0, plan.accumulator)
    staged = (w["kt"], w["krow"], empty, w["vt"]) if plan.grad else \
        (w["kt"], empty, w["vrow"], empty)
    ranges = w["ranges"].reshape(plan.T1, plan.mask_heads, 4)
    made = token_blocks(plan.q_starts, plan.tokens)
    blocks = w["blocks"][:made.size].reshape(-1, 2)

    def stage():            # (writes nothing before it runs: parts share the workspace)
        blocks[:] = made
        _launch.any_layout(_attention.dense_stage, useful, 1, plan.rows("key"),
                           plan.rows("value"), plan.chunk_row, plan.chunk_len, *staged)

    steps = [("stage", stage),
             ("ranges", lambda: _launch.any_layout(
                 _attention.dense_ranges, useful, 64, plan.mask, plan.q_starts, plan.kv_starts,
                 plan.geo, plan.mstep, plan.zero_rows, ranges))]
    if not plan.grad:
        steps.append(("forward", lambda: plan.forward_step(w, useful, ranges, blocks)))
        return steps
    rows = plan.rows
    common = (rows("query"), rows("grad"), rows("attention_out"), rows("softmax_max"),
              rows("softmax_sum"), plan.q_starts, plan.kv_starts, plan.chunk_starts, ranges)
    if plan.units:
        steps.append(("dq", lambda: _launch.any_layout(
            _attention.dense_grad_dq, useful, 4, *common[:-1], blocks, ranges, w["kt"],
            w["krow"], w["vt"], plan.mask, plan.geo, plan.mstep, rows("dq"), w["scratch"],
            w["index"], plan.G, plan.Gu, plan.row, scale)))
    order = []

    def rank():
        _attention.chunk_work(ranges, plan.q_starts, plan.chunk_starts, w["work"])
        # the threads take the owners with the most rows first (ties by index)
        work = np.repeat(w["work"][:-1], plan.N2)
        order[:] = [np.argsort(-work, kind="stable")]

    steps.append(("order", rank))
    steps.append(("dk dv", lambda: _launch.any_layout(
        _attention.dense_grad_dkdv, useful, 1, *common, order[0], w["kt"], w["vt"],
        plan.mask, plan.geo, plan.mstep, rows("dk"), rows("dv"), w["scratch"], w["index"],
        plan.G, plan.Gu, scale)))
    return steps
