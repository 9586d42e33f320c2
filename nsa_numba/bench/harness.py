"""The timing harness: rounds that time several calls in turn, the cache flush, and
the copy and read passes every figure is measured against."""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._core import launch as _launch
from .._core.jit import jit

_COPY_CHUNK = 1 << 16


@jit
def _copy(work, slot, src, dst):
    chunks = (src.size + _COPY_CHUNK - 1) // _COPY_CHUNK
    c, end = _launch.claim(work, chunks)
    while c < end:
        start = c * _COPY_CHUNK
        stop = min(src.size, start + _COPY_CHUNK)
        dst[start:stop] = src[start:stop]
        c, end = _launch.next_unit(work, c, end, chunks)


def best_time(fn, repeat):
    """Best wall time of ``repeat`` calls after one warm-up call."""
    return min(round_times([fn], repeat)[0])


def round_times(fns, repeat, settle=None):
    """Wall times ``[function][round]`` of ``repeat`` rounds that call the functions
    in turn, after one warm-up call each. On a machine shared with other work, load
    that comes and goes then falls on all of them alike within a round. ``settle``,
    if given, runs untimed before every timed call."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, mine in zip(fns, times):
            if settle is not None:
                settle()
            t = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - t)
    return times


@jit
def _read_all(work, slot, buffer):
    total = np.uint64(0)
    chunks = (buffer.size + _COPY_CHUNK - 1) // _COPY_CHUNK
    c, end = _launch.claim(work, chunks)
    while c < end:
        for i in range(c * _COPY_CHUNK, min(buffer.size, (c + 1) * _COPY_CHUNK)):
            total += buffer[i]
        c, end = _launch.next_unit(work, c, end, chunks)
    return total


#: bytes of a case's input ``input_read_task`` reads per parallel iteration (a
#: forward tile's size on bench's shapes)
_INPUT_READ_CHUNK = 256 << 10


@jit
def _read_words(work, slot, words, chunk, totals):
    """Into ``totals[slot]``: the sum of the XORs of the chunks of ``chunk`` words
    (uint64) of ``words`` this thread took."""
    chunks = (words.size + chunk - 1) // chunk
    c, end = _launch.claim(work, chunks)
    while c < end:
        part = np.uint64(0)
        for i in range(c * chunk, min(words.size, (c + 1) * chunk)):
            part ^= words[i]
        totals[slot] += part
        c, end = _launch.next_unit(work, c, end, chunks)


def _read_sum(words, chunk):
    """The sum over ``words``' chunks of ``chunk`` words of each chunk's XOR, the
    chunks shared out over the threads."""
    totals = np.zeros(_launch.ceiling(), np.uint64)
    _launch.run(_read_words, None, 1, words, chunk, totals)
    return totals.sum(dtype=np.uint64)


def input_read_task(x):
    """(function, bytes read) of a read-only pass over ``x``'s memory, or None for an
    input that is not C-contiguous in whole 8-byte words."""
    if not x.flags.c_contiguous or x.nbytes % 8:
        return None
    words = x.reshape(-1).view(np.uint64)
    return (lambda: _read_sum(words, _INPUT_READ_CHUNK // 8)), x.nbytes


class CacheFlush:
    """Reads a clean buffer bigger than the caches: afterwards no timed call finds its
    data still cached from the previous one, nor pays for writing back the dirty
    lines the previous one left (a copy leaves its destination's tail dirty)."""

    def __init__(self, nbytes=128 << 20):
        self.buffer = np.ones(nbytes, np.uint8)

    def __call__(self):
        _launch.run(_read_all, None, 1, self.buffer)


def copy_task(nbytes):
    """(function, bytes moved) of a parallel copy of ``nbytes`` (at least 64 MiB, more
    than the caches hold); bytes moved counts the read and the write."""
    nbytes = max(int(nbytes), 64 << 20)
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return (lambda: _launch.run(_copy, None, 1, src, dst)), 2 * nbytes


def read_task(nbytes, threads):
    """(function, bytes read) of a read-only pass over a clean buffer of ``nbytes`` (at
    least 64 MiB): an XOR reduction of its 8-byte words in ``threads`` NumPy calls on
    as many Python threads (NumPy lets go of the GIL), one equal chunk each. A
    kernel that reads more than it writes cannot beat this rate."""
    nbytes = max(int(nbytes), 64 << 20) // 8 * 8
    words = np.ones(nbytes // 8, np.uint64)
    chunks = np.array_split(words, threads)
    if threads == 1:
        return (lambda: np.bitwise_xor.reduce(words)), nbytes
    pool = ThreadPoolExecutor(threads)
    return (lambda: list(pool.map(np.bitwise_xor.reduce, chunks))), nbytes
