"""``python -m nsa_numba bench``: throughput against the machine's copy bandwidth.

Both operators move far more bytes than they compute, so the honest yardstick is
memory bandwidth, measured in the same run on the same threads: a parallel Numba
copy of a buffer larger than the caches, timed in turn with each case's forward and
backward calls, round after round, so that a machine shared with other work slows
all three alike. Each case reports medians over ``repeat`` rounds: the time, the
GB/s it implies, the copy's GB/s, and the percentage of copy (the median over
rounds of the kernel's rate against the same round's copy rate); and, when
PyTorch is installed, the time of the idiomatic PyTorch implementation (``unfold`` +
``einsum``, autograd for the backward) on the same thread count: its best of a third
as many calls, which can only favour it.

A copy counts its read and its write, which the memory system serves side by side;
``--read`` also times two read-only passes in the same rounds: one over a buffer
larger than the caches, the ceiling for the forward, which reads d bytes for every
byte it writes; and one over each case's own input (a parallel Numba pass in
tile-sized chunks), which reads the very memory the forward reads, where the copy
reads other memory. A forward that reads its input once matches that pass at best,
except where the pass, which leaves the prefetching to the hardware, runs slow on
that memory and the forward's software prefetch does not.

Bytes counted: forward = input read + output written; backward = input read + grad
read + input_grad written (the weights are negligible).
"""

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import numba
import numpy as np
from numba import prange

from . import _dispatch, _outputs, _repeat, api
from ._plan import Rules, plan_forward, plan_grad
from ._jit import jit_parallel

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
_COPY_CHUNK = 1 << 16


@jit_parallel
def _parallel_copy(src, dst):
    chunks = (src.size + _COPY_CHUNK - 1) // _COPY_CHUNK
    for c in prange(chunks):
        start = np.int64(c) * _COPY_CHUNK
        stop = min(src.size, start + _COPY_CHUNK)
        dst[start:stop] = src[start:stop]


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


@jit_parallel
def _read_all(buffer):
    total = np.uint64(0)
    for c in prange((buffer.size + _COPY_CHUNK - 1) // _COPY_CHUNK):
        for i in range(c * _COPY_CHUNK, min(buffer.size, (c + 1) * _COPY_CHUNK)):
            total += buffer[i]
    return total


#: bytes of a case's input ``input_read_task`` reads per parallel iteration (a
#: forward tile's size on bench's shapes)
_INPUT_READ_CHUNK = 256 << 10


@jit_parallel
def _read_words(words, chunk):
    """XOR of ``words`` (uint64), in parallel chunks of ``chunk`` words."""
    total = np.uint64(0)
    for c in prange((words.size + chunk - 1) // chunk):
        part = np.uint64(0)
        for i in range(c * chunk, min(words.size, (c + 1) * chunk)):
            part ^= words[i]
        total += part
    return total


def input_read_task(x):
    """(function, bytes read) of a read-only pass over ``x``'s memory, or None for an
    input that is not C-contiguous in whole 8-byte words."""
    if not x.flags.c_contiguous or x.nbytes % 8:
        return None
    words = x.reshape(-1).view(np.uint64)
    return (lambda: _read_words(words, _INPUT_READ_CHUNK // 8)), x.nbytes


class CacheFlush:
    """Reads a clean buffer bigger than the caches: afterwards no timed call finds its
    data still cached from the previous one, nor pays for writing back the dirty
    lines the previous one left (a copy leaves its destination's tail dirty)."""

    def __init__(self, nbytes=128 << 20):
        self.buffer = np.ones(nbytes, np.uint8)

    def __call__(self):
        _read_all(self.buffer)


def copy_task(nbytes):
    """(function, bytes moved) of a parallel copy of ``nbytes`` (at least 64 MiB, more
    than the caches hold); bytes moved counts the read and the write."""
    nbytes = max(int(nbytes), 64 << 20)
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return (lambda: _parallel_copy(src, dst)), 2 * nbytes


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


def torch_baseline(case, x, w, g, seq, repeat):
    """(forward s, backward s) of unfold + einsum in PyTorch, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case.dtype]
    tx = torch.from_numpy(np.ascontiguousarray(x).astype(np.float32)).to(tdtype)
    tw = torch.from_numpy(w.astype(np.float32)).to(tdtype)
    tg = torch.from_numpy(g.astype(np.float32)).to(tdtype)
    starts = [0] + seq[:-1]

    def forward(xx, ww):
        parts = []
        for a, b in zip(starts, seq):
            if b - a >= case.block:
                win = xx[a:b].unfold(0, case.block, case.stride)     # [w, N, D, l]
                parts.append(torch.einsum("wndl,ln->wnd", win, ww))
        return torch.cat(parts)

    def backward():
        xx = tx.detach().requires_grad_(True)
        ww = tw.detach().requires_grad_(True)
        forward(xx, ww).backward(tg)

    with torch.no_grad():
        t_fwd = best_time(lambda: forward(tx, tw), repeat)
    t_bwd = best_time(backward, repeat)
    return t_fwd, t_bwd


def prepared_launches(x, w, g, out, dx, dw, l, d, seq):
    """(forward, backward): the kernel launches of the two calls with their planning
    and the rest of their Python work done beforehand (``_dispatch.prepare``)."""
    fwd = plan_forward(Rules("nsa_compress"), x, w, l, d, seq, 0, "TND", out)
    bwd = plan_grad(Rules("nsa_compress_grad"), g, x, w, l, d, seq, 0, "TND", dx, dw)
    return (_dispatch.prepare(fwd, _dispatch.new_workspace(fwd)),
            _dispatch.prepare(bwd, _dispatch.new_workspace(bwd)))


def run_case(case, repeat, copy, use_torch, flush, read=None, split=False, allocate=False):
    """Time one case: forward, backward, ``copy`` (a ``copy_task``) and ``read`` (a
    ``read_task``, if given) in turn, each after ``flush`` (a ``CacheFlush``); with
    ``split``, also each call's kernel launches alone (``prepared_launches``). With
    ``allocate``, the calls allocate their outputs (and drop them), as autograd has
    them do, instead of writing into given ones."""
    x, w, g, out, seq = make_data(case)
    dx = np.empty(x.shape, x.dtype)
    dw = np.empty_like(w)
    l, d = case.block, case.stride
    copy_fn, copy_bytes = copy
    if allocate:
        calls = [lambda: api.nsa_compress(x, w, l, d, actual_seq_len=seq),
                 lambda: api.nsa_compress_grad(g, x, w, l, d, actual_seq_len=seq)]
    else:
        calls = [lambda: api.nsa_compress(x, w, l, d, actual_seq_len=seq, out=out),
                 lambda: api.nsa_compress_grad(g, x, w, l, d, actual_seq_len=seq,
                                               input_grad=dx, weight_grad=dw)]
    tasks = [copy_fn] + calls
    tasks += list(prepared_launches(x, w, g, out, dx, dw, l, d, seq)) if split else []
    own = input_read_task(x) if read else None
    reads = ([read[0]] if read else []) + ([own[0]] if own else [])
    times = [np.array(t) for t in round_times(tasks + reads, repeat, settle=flush)]
    t_copy, t_fwd, t_bwd = times[:3]
    copy_gbs = copy_bytes / np.median(t_copy) / 1e9
    item = x.dtype.itemsize
    fwd_bytes = (x.size + out.size) * item
    bwd_bytes = (2 * x.size + g.size) * item
    result = dict(case=asdict(case), label=case.label, copy_gbs=copy_gbs)
    if read:
        result["read_gbs"] = read[1] / np.median(times[len(tasks)]) / 1e9

    def pct_copy(t, nbytes):
        # each round's rate against that round's copy rate, then the median
        return float(np.median(100 * (nbytes / t) / (copy_bytes / t_copy)))

    for op, t, nbytes in (("forward", t_fwd, fwd_bytes), ("backward", t_bwd, bwd_bytes)):
        result[op] = dict(ms=np.median(t) * 1e3, best_ms=t.min() * 1e3, bytes=nbytes,
                          gbs=nbytes / np.median(t) / 1e9, pct_copy=pct_copy(t, nbytes))
    if split:
        for op, t, nbytes in (("forward", times[3], fwd_bytes),
                              ("backward", times[4], bwd_bytes)):
            result[op].update(launch_ms=np.median(t) * 1e3,
                              launch_pct_copy=pct_copy(t, nbytes))
    if own:
        # the forward against reading its input once: per round, the read's time over
        # the forward's (the output it writes counts as nothing)
        t_own = times[-1]
        result["input_read_gbs"] = own[1] / np.median(t_own) / 1e9
        result["forward"]["pct_input_read"] = float(np.median(100 * t_own / t_fwd))
        if split:
            result["forward"]["launch_pct_input_read"] = float(np.median(100 * t_own
                                                                         / times[3]))
    baseline = torch_baseline(case, x, w, g, seq, max(1, repeat // 3)) if use_torch else None
    if baseline is not None:
        for op, seconds in zip(("forward", "backward"), baseline):
            result[op]["torch_ms"] = seconds * 1e3
            result[op]["speedup"] = seconds * 1e3 / result[op]["ms"]
    return result


def format_table(results):
    split = "launch_ms" in results[0]["forward"]
    head = (f"{'case':<52}{'op':<9}{'ms':>9}{'GB/s':>8}{'copy':>7}{'% copy':>8}"
            f"{'torch ms':>10}{'x torch':>9}"
            + (f"{'launch ms':>11}{'% copy':>8}" if split else ""))
    lines = [head, "-" * len(head)]
    for r in results:
        for op in ("forward", "backward"):
            m = r[op]
            torch_cols = (f"{m['torch_ms']:>10.2f}{m['speedup']:>8.1f}x" if "torch_ms" in m
                          else f"{'-':>10}{'-':>9}")
            launch = (f"{m['launch_ms']:>11.3f}{m['launch_pct_copy']:>7.0f}%" if split
                      else "")
            lines.append(f"{r['label'] if op == 'forward' else '':<52}{op:<9}"
                         f"{m['ms']:>9.3f}{m['gbs']:>8.1f}{r['copy_gbs']:>7.1f}"
                         f"{m['pct_copy']:>7.0f}%{torch_cols}{launch}")
    return "\n".join(lines)


def format_input_reads(results):
    """``--read``'s second table: per case, a parallel read of its own input and the
    forward's time against it (the call, and its launches alone with --split)."""
    lines = [f"{'case (forward against reading its input once)':<52}{'read GB/s':>10}"
             f"{'% of read':>11}{'launch':>8}"]
    for r in results:
        m = r["forward"]
        if "pct_input_read" not in m:
            lines.append(f"{r['label']:<52}{'-':>10}   (input not C-contiguous)")
            continue
        launch = f"{m['launch_pct_input_read']:>7.0f}%" if "launch_pct_input_read" in m else ""
        lines.append(f"{r['label']:<52}{r['input_read_gbs']:>10.1f}"
                     f"{m['pct_input_read']:>10.0f}%{launch}")
    return "\n".join(lines)


def markdown_table(runs):
    """One markdown table of ``bench --json`` runs (dicts as saved): a row per case and
    op, each run's ms, % of copy (and of its launches alone, if run with --split) and
    x torch side by side, headed by its thread count."""
    split = ["launch_ms" in run["results"][0]["forward"] for run in runs]
    head = ["case", "op"]
    for run, launches in zip(runs, split):
        head += [f"{run['threads']} thr: ms", "% copy"] + (["launch % copy"] if launches
                                                           else []) + ["x torch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    labels = [r["label"] for r in runs[0]["results"]]
    for label in labels:
        for op in ("forward", "backward"):
            row = [label if op == "forward" else "", op]
            for run, launches in zip(runs, split):
                m = next((r[op] for r in run["results"] if r["label"] == label), None)
                if m is None:
                    row += ["-"] * (4 if launches else 3)
                    continue
                row += [f"{m['ms']:.2f}", f"{m['pct_copy']:.0f}%"]
                row += [f"{m['launch_pct_copy']:.0f}%"] if launches else []
                row += [f"{m['speedup']:.0f}x" if "speedup" in m else "-"]
            lines.append("| " + " | ".join(row) + " |")
    copies = ", ".join(f"{run['threads']} thread(s) "
                       f"{min(r['copy_gbs'] for r in run['results']):.1f}-"
                       f"{max(r['copy_gbs'] for r in run['results']):.1f} GB/s"
                       for run in runs)
    return "\n".join(lines) + f"\n\nCopy bandwidth in the same rounds: {copies}."


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
_empty_op = None


def _empty_custom_op():
    """A registered custom op with autograd that does no work (the floor of any
    ``torch.library.custom_op`` call), registered once."""
    global _empty_op
    if _empty_op is None:
        from typing import Optional

        import torch

        @torch.library.custom_op("nsa_numba_bench::empty", mutates_args=())
        def empty(input: torch.Tensor, weight: torch.Tensor, compress_block_size: int,
                  compress_stride: int, actual_seq_len: Optional[torch.Tensor]) -> torch.Tensor:
            return input.new_empty((0,))

        empty.register_fake(lambda input, *args: input.new_empty((0,)))

        def setup(ctx, inputs, output):
            ctx.save_for_backward(inputs[0], inputs[1])

        empty.register_autograd(lambda ctx, grad: (None,) * 5, setup_context=setup)
        _empty_op = torch.ops.nsa_numba_bench.empty
    return _empty_op


def overhead(repeat, calls=2000):
    """Microseconds per call on OVERHEAD_SHAPE (float32, inputs that require grad) of
    the empty custom op, the NumPy API and the torch function, forward and backward:
    medians over ``repeat`` rounds of the best of three runs of ``calls`` calls, the
    functions timed in turn within each round."""
    import timeit

    import torch

    from . import torch as bridge
    T, N, D, l, d = OVERHEAD_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, N, D, generator=gen, requires_grad=True)
    w = torch.randn(l, N, generator=gen, requires_grad=True)
    g = torch.randn((T - l) // d + 1, N, D, generator=gen)
    xn, wn, gn = x.detach().numpy(), w.detach().numpy(), g.numpy()
    empty = _empty_custom_op()
    fns = {
        "empty custom op": lambda: empty(x, w, l, d, None),
        "forward, NumPy": lambda: api.nsa_compress(xn, wn, l, d),
        "forward, torch": lambda: bridge.npu_nsa_compress(x, w, l, d),
        "backward, NumPy": lambda: api.nsa_compress_grad(gn, xn, wn, l, d),
        "backward, torch": lambda: bridge.npu_nsa_compress_grad(g, x, w, l, d),
    }
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            best = min(timeit.repeat(fn, number=calls, repeat=3))
            times[name].append(best / calls * 1e6)
    return {name: float(np.median(t)) for name, t in times.items()}


#: flushed calls ``--overhead`` times up to their kernel launch
TO_LAUNCH_ROUNDS = 101


def python_to_launch(case=None, rounds=TO_LAUNCH_ROUNDS):
    """Medians of the microseconds a call that comes again spends in Python before its
    kernel launch, after a cache flush (NumPy API, forward and backward, ``case``:
    bench's first shape in bf16). The call stops where it would launch: Numba's
    dispatch and the compiled code (the kept call's entry, ``_kernels``) are not run,
    so what is timed is the Python work alone, which ``--split`` can only show as the
    noisy difference of two timings. The stop stands in for the kept calls' entries
    meanwhile: for bench's own process only, where no other thread calls the
    library."""
    case = case or Case(*DEFAULT_SHAPES[0], "bf16")
    x, w, g, out, seq = make_data(case)
    dx, dw = np.empty(x.shape, x.dtype), np.empty_like(w)
    l, d = case.block, case.stride
    calls = {"forward": lambda: api.nsa_compress(x, w, l, d, actual_seq_len=seq, out=out),
             "backward": lambda: api.nsa_compress_grad(g, x, w, l, d, actual_seq_len=seq,
                                                       input_grad=dx, weight_grad=dw)}
    for fn in calls.values():
        fn()                                   # planned and kept
    flush = CacheFlush()
    stamps = []
    times = {name: [] for name in calls}

    def stop(*args):
        stamps.append(time.perf_counter_ns())
        return True                            # as if it ran: no full way after it

    kept = dict(_repeat._entries)
    for key, entry in kept.items():
        _repeat._entries[key] = replace(entry, again=replace(entry.again, entry=stop))
    try:
        for _ in range(rounds):
            for name, fn in calls.items():
                flush()
                start = time.perf_counter_ns()
                fn()
                times[name].append((stamps[-1] - start) / 1e3)
    finally:
        _repeat._entries.update(kept)
    return case, {name: float(np.median(t)) for name, t in times.items()}


def format_overhead(us):
    """The ``--overhead`` table: each call, and what the torch function adds to the
    NumPy call beyond the empty custom op."""
    empty = us["empty custom op"]
    lines = [f"{'call':<22}{'us':>8}   (T, N, D, l, d) = {OVERHEAD_SHAPE}, float32",
             f"{'empty custom op':<22}{empty:>8.1f}"]
    for op in ("forward", "backward"):
        numpy_us, torch_us = us[f"{op}, NumPy"], us[f"{op}, torch"]
        lines.append(f"{op + ', NumPy':<22}{numpy_us:>8.1f}")
        lines.append(f"{op + ', torch':<22}{torch_us:>8.1f}   torch - NumPy = "
                     f"{torch_us - numpy_us:.1f} us, {torch_us - numpy_us - empty:+.1f} us "
                     f"beyond the empty custom op")
    return "\n".join(lines)


def main(args):
    if args.threads is not None:
        if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
            print(f"--threads must be between 1 and NUMBA_NUM_THREADS = "
                  f"{numba.config.NUMBA_NUM_THREADS} (set that variable to allow more)",
                  file=sys.stderr)
            return 2
        numba.set_num_threads(args.threads)
    threads = numba.get_num_threads()
    if args.markdown:
        runs = []
        for path in args.markdown:
            with open(path) as f:
                runs.append(json.load(f))
        print(markdown_table(runs))
        return 0
    if args.overhead:
        return main_overhead(args, threads)
    if args.compare:
        return main_compare(args)
    use_torch = not args.no_torch
    if use_torch:
        try:
            import torch
            torch.set_num_threads(threads)
        except ImportError:
            use_torch = False
    if args.infer:
        return main_infer(args, threads, use_torch)
    shapes = args.shape or DEFAULT_SHAPES
    views = ("contiguous",) + (NON_CONTIGUOUS if args.strided else ())
    cases = [Case(*shape, dtype=dt, view=view)
             for shape in shapes for dt in args.dtype for view in views]
    biggest = max(c.T * c.N * c.D * numpy_dtype(c.dtype).itemsize for c in cases)
    copy = copy_task(2 * biggest)
    read = read_task(2 * biggest, threads) if args.read else None
    flush = CacheFlush()
    results = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.label}", file=sys.stderr, flush=True)
        results.append(run_case(case, args.repeat, copy, use_torch, flush, read,
                                args.split, args.allocate))
    copies = [r["copy_gbs"] for r in results]
    print(f"nsa_numba bench: {threads} thread(s), copy bandwidth {min(copies):.1f}-"
          f"{max(copies):.1f} GB/s (parallel copy of {copy[1] // 2 >> 20} MiB, read + write, "
          f"timed in turn with each case's calls); medians of {args.repeat} rounds")
    if read:
        reads = [r["read_gbs"] for r in results]
        print(f"read bandwidth {min(reads):.1f}-{max(reads):.1f} GB/s (read only: {read[1] >> 20} "
              f"MiB by {threads} NumPy reduction(s), timed in the same rounds)")
    print(format_table(results))
    if read:
        print(format_input_reads(results))
    if not use_torch:
        print("(PyTorch columns: not installed or --no-torch)")
    if args.split:
        print("(launch: the call's kernel launches alone, planned beforehand; the rest of "
              "the call's time is its Python work after the cache flush)")
    if args.allocate:
        budget = _outputs.keep_outputs()
        print("(--allocate: the calls allocate their outputs and drop them; kept outputs: "
              + (f"up to {budget >> 20} MiB" if budget else "off") + ")")
    if args.plot:
        from llvmlite import binding
        plot_results(results, args.plot,
                     f"python -m nsa_numba bench: {binding.get_host_cpu_name()}, {threads} "
                     f"thread(s), medians of {args.repeat} rounds")
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=threads, copy_bytes=copy[1], repeat=args.repeat,
                           allocate=args.allocate, kept_outputs=_outputs.keep_outputs(),
                           results=results), f, indent=2)
    return 0


def main_overhead(args, threads):
    try:
        import torch
    except ImportError:
        print("--overhead needs torch", file=sys.stderr)
        return 2
    torch.set_num_threads(threads)
    us = overhead(args.repeat)
    print(f"nsa_numba bench --overhead: {threads} thread(s); medians of {args.repeat} rounds")
    print(format_overhead(us))
    case, cold = python_to_launch()
    print(f"after a cache flush ({case.label}), Python time from the call to its kernel "
          f"launch, medians of {TO_LAUNCH_ROUNDS}: forward {cold['forward']:.0f} us, "
          f"backward {cold['backward']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=threads, overhead_us=us, shape=OVERHEAD_SHAPE,
                           repeat=args.repeat, to_launch_us=cold,
                           to_launch_case=asdict(case)), f, indent=2)
    return 0


# -- a picture and a comparison ------------------------------------------------------------

def plot_results(results, path, title):
    """Per case: forward and backward GB/s as bars, the copy bandwidth of the same
    rounds as a line over them, each bar labelled with its % of that copy and, where
    measured, how many times faster than PyTorch. PNG or SVG by ``path``'s suffix;
    needs matplotlib (``pip install matplotlib``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(results), 4.2))
    width = 0.38
    for i, r in enumerate(results):
        for k, (op, color) in enumerate((("forward", "#4477aa"), ("backward", "#ee6677"))):
            m = r[op]
            x = i + (k - 0.5) * width
            ax.bar(x, m["gbs"], width, color=color, label=op if i == 0 else None)
            text = f"{m['pct_copy']:.0f}%"
            if "speedup" in m:
                text += f"\n{m['speedup']:.0f}x torch"
            ax.text(x, m["gbs"] * 0.5, text, ha="center", va="center", fontsize=7,
                    color="white")
        ax.hlines(r["copy_gbs"], i - width, i + width, colors="black",
                  label="copy, same rounds" if i == 0 else None)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([f"T={r['case']['T']} N={r['case']['N']}\nl={r['case']['block']} "
                        f"d={r['case']['stride']} {r['case']['dtype']}" for r in results],
                       fontsize=7)
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)
    ax.set_ylim(0, 1.25 * max(r["copy_gbs"] for r in results))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main_compare(args):
    """``asv continuous`` of ``args.compare`` against HEAD in the checkout's asv_bench
    (history environments built from each commit, see asv_bench/asv.conf.json)."""
    import pathlib
    import subprocess
    try:
        root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        print("--compare runs in a git checkout of nsa_numba (it benchmarks commits)",
              file=sys.stderr)
        return 2
    suite = pathlib.Path(root) / "asv_bench"
    if not (suite / "asv.conf.json").exists():
        print(f"--compare: no asv_bench/asv.conf.json under {root}", file=sys.stderr)
        return 2
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, cwd=root).stdout.strip()
    if changed:
        print("--compare: uncommitted changes are not benchmarked (asv builds commits): "
              "commit them first", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "asv", "machine", "--yes"], cwd=suite,
                   capture_output=True)
    command = [sys.executable, "-m", "asv", "continuous", "--split", "--show-stderr",
               "--factor", str(args.factor)]
    for pattern in args.asv_bench or ():
        command += ["--bench", pattern]
    command += [args.compare, "HEAD"]
    print("+ " + " ".join(command[2:]), file=sys.stderr, flush=True)
    return subprocess.run(command, cwd=suite).returncode


# -- memory -----------------------------------------------------------------------------

#: run in a new process: the peak resident memory (VmHWM) is reset through
#: /proc/self/clear_refs once the arrays exist and the kernels are loaded, so the
#: peak seen afterwards is the call's own
_MEMORY_SCRIPT = r"""
import json, sys
import numpy as np
from nsa_numba import aclnn, bench, nsa_compress, nsa_compress_grad

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

case = bench.Case(*json.loads(sys.argv[1]))
x, w, g, out, seq = bench.make_data(case)
l, d = case.block, case.stride
dx, dw = np.ones_like(x), np.ones_like(w)
nsa_compress_grad(g, x, w, l, d, actual_seq_len=seq, input_grad=dx, weight_grad=dw)
result = {}
for op, call, ws in (
        ("forward", lambda: nsa_compress(x, w, l, d, actual_seq_len=seq, out=out),
         aclnn.aclnnNsaCompressGetWorkspaceSize(x, w, seq, "TND", l, d, 0, out)[1]),
        ("backward", lambda: nsa_compress_grad(g, x, w, l, d, actual_seq_len=seq,
                                               input_grad=dx, weight_grad=dw),
         aclnn.aclnnNsaCompressGradGetWorkspaceSize(g, x, w, seq, l, d, 0, "TND", dx,
                                                    dw)[1])):
    rss = status("VmRSS")
    reset_peak()
    call()
    result[op] = dict(added=status("VmHWM") - rss, workspace=ws)
print(json.dumps(result))
"""


def call_memory(case):
    """{op: {"added": bytes, "workspace": bytes}}: the peak resident memory a forward
    and a backward call of ``case`` add above what the process held before the call
    (outputs given, kernels loaded), and the workspace size the aclnn API announces
    for it; measured in a new process. None where the peak cannot be reset (Linux's
    /proc/self/clear_refs is needed)."""
    import os
    import subprocess
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return None
    fields = [case.T, case.N, case.D, case.block, case.stride, case.sequences, case.dtype]
    child = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, json.dumps(fields)],
                           capture_output=True, text=True, timeout=600, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


# -- the with-cache (decoding) operator ------------------------------------------------

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


def torch_infer_step(torch, x, w, slots, table, lengths, cache, block, stride, page):
    """The step in plain PyTorch: the writers, a batched gather of their windows
    through the block table, one einsum in float32, one scatter into the cache."""
    on = (lengths >= block) & ((lengths - block) % stride == 0)
    b = on.nonzero().squeeze(1)
    pos = lengths[b, None] - block + torch.arange(block)
    windows = x[table[b[:, None], pos // page], pos % page]           # [W, l, N, D]
    rows = torch.einsum("wlnd,ln->wnd", windows.float(), w.float())
    cache[slots[b].long()] = rows.to(cache.dtype)


def run_infer_case(name, dtype, repeat, copy, use_torch, flush):
    """Per-call time of the NumPy API (and of ``torch_infer_step``) on one case; for a
    step that moves more than the caches hold, GB/s against the copy of the same rounds
    (caches flushed before each timed call)."""
    import timeit
    B, writers, N = INFER_CASES[name]
    x, w, slots, table, lengths, cache = infer_problem(B, writers, N, dtype)
    win = INFER_WINDOW

    def call():
        api.nsa_compress_infer(x, w, slots, win["block"], win["stride"], win["page"],
                               block_table=table, actual_seq_len=lengths, cache=cache)

    moved = writers * N * win["D"] * (win["block"] + 1) * x.itemsize
    big = moved > (64 << 20)
    result = dict(case=name, dtype=dtype, B=B, writers=writers, N=N, bytes=moved)
    if big:
        copy_fn, copy_bytes = copy
        t_copy, t = (np.array(v) for v in round_times([copy_fn, call], repeat, settle=flush))
        result.update(us=float(np.median(t) * 1e6), copy_gbs=copy_bytes / np.median(t_copy) / 1e9,
                      pct_copy=float(np.median(100 * (moved / t) / (copy_bytes / t_copy))))
    else:
        call()
        calls = 500
        t = [min(timeit.repeat(call, number=calls, repeat=3)) / calls for _ in range(repeat)]
        result["us"] = float(np.median(t) * 1e6)
    result["gbs"] = moved / result["us"] / 1e3
    if use_torch:
        import torch
        tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        tx, tw = (torch.from_numpy(np.asarray(a, np.float32)).to(tdtype) for a in (x, w))
        tcache = torch.zeros(cache.shape, dtype=tdtype)
        targs = (tx, tw, torch.from_numpy(slots), torch.from_numpy(table).long(),
                 torch.from_numpy(lengths), tcache, win["block"], win["stride"], win["page"])

        def fn():
            torch_infer_step(torch, *targs)
        number = 1 if big else 200
        fn()
        best = min(min(timeit.repeat(fn, number=number, repeat=3)) / number
                   for _ in range(max(1, repeat // 3)))
        result["torch_us"] = best * 1e6
        result["speedup"] = result["torch_us"] / result["us"]
    return result


def format_infer(results):
    head = (f"{'case':<14}{'dtype':<7}{'B':>5}{'write':>6}{'N':>4}{'us':>10}{'GB/s':>8}"
            f"{'% copy':>8}{'torch us':>11}{'x torch':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        pct = f"{r['pct_copy']:>7.0f}%" if "pct_copy" in r else f"{'-':>8}"
        tcols = (f"{r['torch_us']:>11.1f}{r['speedup']:>8.1f}x" if "torch_us" in r
                 else f"{'-':>11}{'-':>9}")
        lines.append(f"{r['case']:<14}{r['dtype']:<7}{r['B']:>5}{r['writers']:>6}{r['N']:>4}"
                     f"{r['us']:>10.1f}{r['gbs']:>8.1f}{pct}{tcols}")
    return "\n".join(lines)


def main_infer(args, threads, use_torch):
    dtypes = args.dtype
    copy = copy_task(256 << 20)
    flush = CacheFlush()
    results = []
    cases = [(name, dt) for name in INFER_CASES for dt in dtypes]
    for i, (name, dt) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {name} {dt}", file=sys.stderr, flush=True)
        results.append(run_infer_case(name, dt, args.repeat, copy, use_torch, flush))
    copies = [r["copy_gbs"] for r in results if "copy_gbs" in r]
    span = f"{min(copies):.1f}-{max(copies):.1f} GB/s" if copies else "not measured"
    print(f"nsa_numba bench --infer: {threads} thread(s); NumPy API per call, medians of "
          f"{args.repeat} rounds; D=128 l=32 d=16 page 128; copy bandwidth {span} "
          f"(large step: caches flushed before each call)")
    print(format_infer(results))
    if not use_torch:
        print("(PyTorch columns: not installed or --no-torch)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=threads, repeat=args.repeat, infer=results), f, indent=2)
    return 0


def add_arguments(parser):
    parser.add_argument("--shape", action="append", type=parse_shape, metavar="T,N,D,l,d,seqs",
                        help="a problem to run (repeatable); default: the three reference "
                             "shapes")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                        help="dtypes to run (repeatable); default: bf16 and fp16")
    parser.add_argument("--threads", type=int, help="thread count (default: Numba's)")
    parser.add_argument("--repeat", type=int, default=10,
                        help="timing rounds per case (medians reported)")
    parser.add_argument("--strided", action="store_true",
                        help="also run each case on non-contiguous input views: 'sliced' "
                             "(heads N..2N of a 2N-head buffer) and 'strided' (every other "
                             "element of a buffer twice as wide)")
    parser.add_argument("--read", action="store_true",
                        help="also time a read-only pass over a buffer larger than the "
                             "caches in the same rounds, and print its GB/s: the ceiling "
                             "of a kernel that mostly reads; and one over each case's own "
                             "input, with the forward's time against it")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw the results (PNG or SVG by the suffix; needs "
                             "matplotlib): GB/s per case against the copy of the same run")
    parser.add_argument("--compare", metavar="REF",
                        help="instead: asv continuous REF HEAD in the checkout's asv_bench "
                             "(each commit built in its own virtualenv)")
    parser.add_argument("--factor", type=float, default=1.25,
                        help="with --compare: the ratio asv reports as a change "
                             "(default 1.25)")
    parser.add_argument("--asv-bench", action="append", metavar="REGEX",
                        help="with --compare: only the asv benchmarks matching REGEX "
                             "(repeatable)")
    parser.add_argument("--infer", action="store_true",
                        help="instead: the with-cache (decoding) operator on three steps "
                             "(typical, one sequence, large), against the PyTorch gather + "
                             "einsum step")
    parser.add_argument("--overhead", action="store_true",
                        help="instead: the per-call time of the torch functions on a tiny "
                             "problem against the NumPy API and an empty custom op "
                             "(needs torch)")
    parser.add_argument("--split", action="store_true",
                        help="also time each call's kernel launches alone (planned "
                             "beforehand) in the same rounds: what the kernels reach "
                             "without the call's Python work")
    parser.add_argument("--allocate", action="store_true",
                        help="the calls allocate their outputs, as under autograd, instead "
                             "of writing into given ones (kept outputs make that as fast: "
                             "NSA_NUMBA_KEEP_OUTPUTS_MB=0 shows it without)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", nargs="+", metavar="JSON",
                        help="instead: print runs saved with --json (e.g. one per thread "
                             "count) as one markdown table")
