"""The cases ``bench``, the asv suite and the tests run: the training shapes, the
decoding steps, and the data each is run on."""

import argparse
from dataclasses import dataclass

import numpy as np

from .. import api

#: (T, N, D, l, d, number of equal sequences)
DEFAULT_SHAPES = [
    (32768, 4, 128, 32, 16, 4),
    (16384, 16, 128, 64, 32, 4),
    (8192, 64, 128, 32, 16, 8),
]


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def numpy_dtype(name):
    """The numpy dtype of a ``--dtype`` choice (bfloat16 through ml_dtypes)."""
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(DTYPES[name])


def sequence_ends(T, count):
    """Cumulative ends of ``count`` near-equal sequences covering T tokens."""
    return np.linspace(0, T, count + 1).round().astype(np.int64)[1:].tolist()


#: the non-contiguous input views ``--strided`` adds (see make_data)
NON_CONTIGUOUS = ("sliced", "strided")


@dataclass
class Case:
    T: int
    N: int
    D: int
    block: int
    stride: int
    sequences: int
    dtype: str
    view: str = "contiguous"   # or one of NON_CONTIGUOUS

    @property
    def label(self):
        view = "" if self.view == "contiguous" else f" {self.view}"
        return (f"T={self.T} N={self.N} D={self.D} l={self.block} d={self.stride} "
                f"seqs={self.sequences} {self.dtype}{view}")


def make_data(case, seed=0):
    dtype = numpy_dtype(case.dtype)
    rng = np.random.default_rng(seed)
    seq = sequence_ends(case.T, case.sequences)
    shape = (case.T, case.N, case.D)
    if case.view == "sliced":      # heads N..2N of a buffer of 2N heads
        x = rng.standard_normal((case.T, 2 * case.N, case.D)).astype(dtype)[:, case.N:]
    elif case.view == "strided":   # every other element of a buffer twice as wide
        x = rng.standard_normal(shape[:2] + (2 * case.D,)).astype(dtype)[..., ::2]
    else:
        x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((case.block, case.N)).astype(dtype)
    out = api.nsa_compress(x, w, case.block, case.stride, actual_seq_len=seq)
    g = rng.standard_normal(out.shape).astype(dtype)
    return x, w, g, out, seq


def parse_shape(text):
    """``T,N,D,l,d,seqs`` as a tuple of 6 positive integers (argparse type)."""
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 6 or min(parts) < 1:
        raise argparse.ArgumentTypeError(
            f"--shape takes T,N,D,l,d,seqs (6 positive integers), got {text!r}")
    return parts


#: the tiny problem of ``--overhead``: (T, N, D, l, d)
OVERHEAD_SHAPE = (64, 1, 16, 16, 16)


#: ``--infer`` cases: name -> (sequences B, of which writing, heads N); D = 128,
#: l = 32, d = 16, page 128
INFER_CASES = {
    "typical step": (32, 2, 8),
    "one sequence": (1, 1, 8),
    "large step": (256, 256, 64),
}


INFER_WINDOW = dict(D=128, block=32, stride=16, page=128)


def infer_problem(B, writers, N, dtype, D=128, block=32, stride=16, page=128, seed=0):
    """A paged decoding step: B sequences of 32 to 255 tokens, ``writers`` of them on a
    window boundary, pages shuffled over the pool, the cache as small as the NPU
    allows. Every page holds the same random values (making a pool of up to 0.5 GiB
    of distinct ones would take longer than the benchmark). -> (x, w, slot_mapping,
    block_table, actual_seq_len, cache)."""
    dtype = numpy_dtype(dtype)
    rng = np.random.default_rng(seed)
    on = rng.permutation(B) < writers
    windows = rng.integers(0, (2 * page - block) // stride, B)
    lengths = block + stride * windows + np.where(on, 0, rng.integers(1, stride, B))
    per_seq = -(-int(lengths.max()) // page)
    pages = B * per_seq
    x = np.empty((pages, page, N, D), dtype)
    x[...] = rng.standard_normal((page, N, D), np.float32).astype(dtype)
    w = rng.standard_normal((block, N), np.float32).astype(dtype)
    table = rng.permutation(pages).reshape(B, per_seq).astype(np.int32)
    rows = max(B, (pages * page - block) // stride + 1)
    cache = np.zeros((rows, N, D), dtype)
    slots = rng.permutation(rows)[:B].astype(np.int32)
    return x, w, slots, table, lengths, cache


# -- selected attention ------------------------------------------------------------------

#: ``--select`` cases: name -> (sequence lengths, N1, N2, D, Dv, l', c); causal
SELECT_CASES = {
    "paper layer": ((2048, 2048), 64, 4, 192, 128, 64, 16),
    "small group": ((2048, 2048), 8, 2, 192, 128, 64, 16),
    "long sequence": ((16384,), 16, 1, 192, 128, 64, 16),
}


def select_indices(lengths, N2, block, count, rng, causal=True):
    """Block indices ``[T, N2, count]`` (int32) as NSA's selection makes them: each
    token's list holds block 0 and its own two latest blocks (forced, as the paper's
    initial and local blocks), then distinct blocks of its sequence drawn at random
    (with ``causal``, from those not after its own while there are enough; the rest
    come from later ones, which the mask hides). Every list is distinct blocks."""
    T = int(sum(lengths))
    topk = np.empty((T, N2, count), np.int32)
    t = 0
    for n in lengths:
        blocks = n // block
        if n and blocks < count:
            raise ValueError(f"a sequence of {n} tokens holds {blocks} blocks of {block}, "
                             f"fewer than the {count} each list names")
        for s in range(n):
            own = min(s // block, blocks - 1) if causal else blocks - 1
            for j in range(N2):
                chosen = list(dict.fromkeys((0, own, max(own - 1, 0))))[:count]
                rest = rng.permutation(own + 1) if own + 1 > len(chosen) else ()
                later = rng.permutation(np.arange(own + 1, blocks))
                for b in (*rest, *later):
                    if len(chosen) == count:
                        break
                    if b not in chosen:
                        chosen.append(int(b))
                topk[t + s, j] = chosen
        t += n
    return topk


def visible_keys(topk, lengths, block, causal=True):
    """Keys the selected lists let each (token, KV head) see, summed: what a
    forward computes scores for (the FLOP count's key total)."""
    if not causal:
        return topk.size * block
    pos = np.concatenate([np.arange(n) for n in lengths])[:, None, None]
    own = pos // block
    full = np.where(topk < own, block, 0)
    diag = np.where(topk == own, pos % block + 1, 0)
    return int((full + diag).sum())


def select_problem(lengths, N1, N2, D, Dv, block, count, dtype, seed=0, causal=True):
    """(query, key, value, topk_indices, scale, ends) of a selected-attention problem:
    self-attention over packed sequences of ``lengths`` (prefix-sum ``ends``)."""
    if isinstance(dtype, str):
        dtype = numpy_dtype({"bfloat16": "bf16"}.get(dtype, dtype)) \
            if dtype in (*DTYPES, "bfloat16") else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    T = int(sum(lengths))
    q = rng.standard_normal((T, N1, D), np.float32).astype(dtype)
    k = rng.standard_normal((T, N2, D), np.float32).astype(dtype)
    v = rng.standard_normal((T, N2, Dv), np.float32).astype(dtype)
    topk = select_indices(lengths, N2, block, count, rng, causal)
    return q, k, v, topk, D ** -0.5, np.cumsum(lengths).tolist()


# -- compressed attention ------------------------------------------------------------------

#: ``--compress-attention`` cases: name -> (sequence lengths, N1, N2, D, Dv, c), with
#: CMP_WINDOW's blocks and the causal compressed mask
CMP_CASES = {
    "paper layer": ((4096, 4096), 64, 4, 192, 128, 16),
    "small group": ((4096, 4096), 8, 2, 192, 128, 16),
    "long sequence": ((32768,), 16, 1, 192, 128, 16),
}
#: l, d, l' of every case (the paper's)
CMP_WINDOW = dict(block=32, stride=16, select_block=64)


def cmp_lengths(lengths):
    """(compressed tokens, blocks of raw keys) per sequence of ``lengths`` tokens."""
    w = CMP_WINDOW
    cmp = [max(0, (n - w["block"]) // w["stride"] + 1) for n in lengths]
    m = w["select_block"] // w["stride"]
    return cmp, [-(-c // m) for c in cmp]


def cmp_mask(lengths):
    """The causal compressed mask: compressed key k is visible to position s iff its
    window has ended, ``k d + l - 1 <= s``."""
    cmp, _ = cmp_lengths(lengths)
    s = np.arange(max(lengths))[:, None]
    k = np.arange(max(cmp))[None, :]
    return k * CMP_WINDOW["stride"] + CMP_WINDOW["block"] - 1 > s


def cmp_visible(lengths):
    """(query, compressed key) pairs the causal mask leaves visible, summed over the
    sequences: the FLOP count's key total per head."""
    cmp, _ = cmp_lengths(lengths)
    w = CMP_WINDOW
    return int(sum(np.minimum(np.maximum((np.arange(n) - w["block"] + 1) // w["stride"] + 1,
                                         0), c).sum() for n, c in zip(lengths, cmp)))


def cmp_problem(lengths, N1, N2, D, Dv, dtype, seed=0):
    """(query, key, value, atten_mask, lists, scale) of a compressed-attention problem:
    ``lists`` the three prefix-sum arguments by name."""
    if isinstance(dtype, str):
        dtype = numpy_dtype(dtype) if dtype in DTYPES else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    cmp, blocks = cmp_lengths(lengths)
    q = rng.standard_normal((sum(lengths), N1, D), np.float32).astype(dtype)
    k = rng.standard_normal((sum(cmp), N2, D), np.float32).astype(dtype)
    v = rng.standard_normal((sum(cmp), N2, Dv), np.float32).astype(dtype)
    lists = dict(actual_seq_qlen=np.cumsum(lengths).tolist(),
                 actual_cmp_seq_kvlen=np.cumsum(cmp).tolist(),
                 actual_sel_seq_kvlen=np.cumsum(blocks).tolist())
    return q, k, v, cmp_mask(lengths), lists, D ** -0.5


# -- fusion attention (the window branch) ---------------------------------------------------

#: ``--fusion-attention`` cases: name -> (sequence lengths, N1, N2, D, Dv, window); a
#: window of w keys is sparse mode 4 (pre_tockens w - 1, next_tockens 0), None the
#: causal mask (mode 3), both with the 2048 x 2048 mask, layout TND
FUSION_CASES = {
    "window 2k": ((2048,), 16, 1, 192, 128, 512),
    "window 2k GQA": ((2048,), 64, 4, 192, 128, 512),
    "window 16k": ((16384,), 16, 1, 192, 128, 512),
    "window 16k GQA": ((16384,), 64, 4, 192, 128, 512),
    "causal 4k": ((4096, 4096), 16, 4, 128, 128, None),
}


def fusion_visible(lengths, window):
    """(query, key) pairs a causal window of ``window`` keys (None: unbounded) leaves
    visible, summed over sequences of ``lengths``: the FLOP count's total per head."""
    total = 0
    for n in lengths:
        seen = np.arange(1, n + 1)
        total += int(np.minimum(seen, window).sum() if window else seen.sum())
    return total


def fusion_problem(lengths, N1, N2, D, Dv, window, dtype, seed=0):
    """(query, key, value, keyword arguments of ``fusion_attention``) of a case."""
    if isinstance(dtype, str):
        dtype = numpy_dtype(dtype) if dtype in DTYPES else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    T = sum(lengths)
    q, k, v = (rng.standard_normal((T, N, X), np.float32).astype(dtype)
               for N, X in ((N1, D), (N2, D), (N2, Dv)))
    ends = np.cumsum(lengths).tolist()
    kw = dict(atten_mask=np.triu(np.ones((2048, 2048), bool), 1), scale=D ** -0.5,
              actual_seq_qlen=ends, actual_seq_kvlen=ends)
    if window:
        kw.update(sparse_mode=4, pre_tockens=window - 1, next_tockens=0)
    else:
        kw.update(sparse_mode=3)
    return q, k, v, kw
