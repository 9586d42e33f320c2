"""Tensor layouts: every one is a stride view ``[B, S, N, D]`` for the kernels.

=======  ===============  =========================================================
layout   input shape      sequences
=======  ===============  =========================================================
TND      [T, N, D]        packed back to back; ``actual_seq_len`` says where they
                          end (viewed as B = 1, S = T)
BSND     [B, S, N, D]     each batch row is one sequence of length S
BNSD     [B, N, S, D]     same, heads before tokens
BSH      [B, S, H]        same, H = N * D with N = weight.shape[1]
SBH      [S, B, H]        same, tokens before batch
=======  ===============  =========================================================

The forward output keeps the input's layout with the token axis holding the
windows instead (T' for TND, S' = (S - l) // d + 1 per row otherwise); the input
gradient has the input's layout. No layout ever copies data.
"""

import sys
from dataclasses import dataclass

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:       # numpy < 2
    from numpy import byte_bounds


@dataclass(frozen=True)
class Layout:
    name: str
    dims: str          # the axes, for messages

    @property
    def ndim(self):
        return len(self.dims.split(","))

    @property
    def packed(self):
        return self.name == "TND"

    def sizes(self, shape, heads):
        """(B, S, N, D) of an array of ``shape``; ``heads`` is N for BSH / SBH."""
        if self.name == "TND":
            T, N, D = shape
            return 1, T, N, D
        if self.name == "BSND":
            return shape
        if self.name == "BNSD":
            B, N, S, D = shape
            return B, S, N, D
        if self.name == "BSH":
            B, S, H = shape
        else:
            S, B, H = shape
        return B, S, heads, H // heads

    def shape(self, B, S, N, D):
        """The shape of a ``[B, S, N, D]`` problem in this layout."""
        return {"TND": (S, N, D), "BSND": (B, S, N, D), "BNSD": (B, N, S, D),
                "BSH": (B, S, N * D), "SBH": (S, B, N * D)}[self.name]

    def view4(self, a, heads):
        """``a`` as a ``[B, S, N, D]`` view (never a copy)."""
        if self.name == "TND":
            return a[None]
        if self.name == "BSND":
            return a
        if self.name == "BNSD":
            return a.transpose(0, 2, 1, 3)
        bsh = a if self.name == "BSH" else a.transpose(1, 0, 2)
        B, S, H = bsh.shape
        view = bsh.reshape(B, S, heads, H // heads)   # splitting one axis never copies
        assert view.size == 0 or np.shares_memory(view, a)
        return view


LAYOUTS = {layout.name: layout for layout in (
    Layout("TND", "T, N, D"), Layout("BSND", "B, S, N, D"), Layout("BNSD", "B, N, S, D"),
    Layout("BSH", "B, S, H"), Layout("SBH", "S, B, H"))}


def c_carrier(a):
    """``a`` (4-D) as a C-contiguous array for the kernels, when its memory allows.

    Numba compiles loops over arrays that are not C-contiguous with the element
    stride as a run-time value, and LLVM does not vectorise them: a slice of heads,
    tokens or batch rows of a larger array ran about six times slower than the same data
    contiguous, although each ``[D]`` row is contiguous in both. When ``a``'s last
    axis is contiguous and every other stride is a positive whole multiple of the
    next one, ``a`` is a block of a C-contiguous array of padded shape
    ``(B, S', N', D')``; this returns that array's view starting at ``a``'s first
    element (the padding may reach past ``a``'s buffer). The kernels take N and D
    separately and index only ``[:, :, :N, :D]``, so the padding is never read or
    written. Any other ``a`` is returned unchanged (and runs on the slower loops).
    """
    if a.flags.c_contiguous or a.size == 0:
        return a
    item = a.itemsize
    strides = list(a.strides)
    if a.shape[3] > 1 and strides[3] != item:
        return a
    strides[3] = item
    padded = [a.shape[0], 0, 0, 0]
    for k in (2, 1, 0):
        if a.shape[k] == 1:   # any stride will do: take the unpadded one
            strides[k] = strides[k + 1] * a.shape[k + 1]
        step, rest = divmod(strides[k], strides[k + 1])
        if strides[k] <= 0 or rest or step < a.shape[k + 1]:
            return a
        padded[k + 1] = step
    carrier = np.lib.stride_tricks.as_strided(a, shape=tuple(padded), strides=tuple(strides),
                                              writeable=a.flags.writeable)
    assert carrier.flags.c_contiguous
    return carrier


#: word storage for an input read at a step of several elements: (storage dtype,
#: step in bytes) -> the dtype of one word, which holds an element at its low
#: address and the gap up to the next one (see ``word_view``; ``_kernels.halfprec.widen``
#: decodes the element)
WORD_STORAGE = {
    (np.dtype(np.uint16), 4): np.dtype(np.uint32),          # float16, every 2nd
    (np.dtype(np.uint16), 8): np.dtype(np.uint64),          # float16, every 4th
    (np.dtype(np.int16), 4): np.dtype(np.int32),            # bfloat16, every 2nd
    (np.dtype(np.int16), 8): np.dtype(np.int64),            # bfloat16, every 4th
    (np.dtype(np.float32), 8): np.dtype(np.complex64),      # the real part
    (np.dtype(np.float64), 16): np.dtype(np.complex128),    # the real part
}


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def word_view(a, storage, avoid=()):
    """An input ``a`` (4-D) whose last axis takes every 2nd (or, for 16-bit formats,
    every 4th) element, as an array of words that each hold one element and the gap
    after it, at unit stride; or None.

    Numba compiles a last axis with a run-time stride into scalar loops: reading every
    other element ran 4-6 times slower than contiguous input, though the memory read
    is only twice as large. The words' last axis is unit-stride, so the kernels'
    loops vectorise as for contiguous input, and ``widen`` keeps each word's element.
    ``storage`` is the dtype ``a``'s bits are viewed as in the kernels
    (``_ops.checks.STORAGE``).

    A word reads the gap bytes after its element, which belong to other data; so
    None (the strided loops) unless the last element's word ends inside the memory of
    ``a``'s root array, no array in ``avoid`` (the outputs) may share those bytes,
    and the words are aligned. Integer words keep the element in their low bits,
    which is the low address only on little-endian machines; elsewhere, None.
    """
    storage = np.dtype(storage)
    if a.ndim != 4 or a.size == 0 or a.itemsize != storage.itemsize:
        return None
    step = a.strides[3]
    word = WORD_STORAGE.get((storage, step))
    if word is None or (word.kind in "iu" and sys.byteorder != "little"):
        return None
    high = byte_bounds(a)[1]              # one past the highest element's last byte
    if high - a.itemsize + step > byte_bounds(_root(a))[1]:
        return None
    k = step // a.itemsize
    span = np.lib.stride_tricks.as_strided(
        a, shape=a.shape[:3] + (a.shape[3] * k,), strides=a.strides[:3] + (a.itemsize,),
        writeable=False)
    words = span.view(word)
    if not words.flags.aligned or any(np.may_share_memory(words, b) for b in avoid):
        return None
    return words
