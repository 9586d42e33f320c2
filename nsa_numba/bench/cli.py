"""``python -m nsa_numba bench``: the command line."""

import json
import sys
from dataclasses import asdict

import numba

from .._core import launch as _launch
from .._core import pool as _pool
from .cases import (
    CMP_CASES,
    DEFAULT_SHAPES,
    DTYPES,
    FUSION_CASES,
    INFER_CASES,
    NON_CONTIGUOUS,
    OVERHEAD_SHAPE,
    SELECT_CASES,
    Case,
    numpy_dtype,
    parse_shape,
)
from .harness import CacheFlush, copy_task, read_task
from .reports import (
    format_infer,
    format_input_reads,
    format_overhead,
    format_table,
    markdown_table,
    plot_results,
)
from .runs import TO_LAUNCH_ROUNDS, overhead, python_to_launch, run_case, run_infer_case


def main(args):
    before = _launch.set_count(0)
    try:
        return _main(args)
    finally:
        _launch.set_count(before)


def _main(args):
    if args.threads is not None:
        if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
            print(f"--threads must be between 1 and NUMBA_NUM_THREADS = "
                  f"{numba.config.NUMBA_NUM_THREADS} (set that variable to allow more)",
                  file=sys.stderr)
            return 2
        _launch.set_count(args.threads)
    threads = _launch.count()
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
    for flag in ATTENTION_BENCHES:
        if getattr(args, flag.replace("-", "_")):
            return main_attention(args, threads, use_torch, flag)
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
        budget = _pool.keep_outputs()
        print("(--allocate: the calls allocate their outputs and drop them; output pool: "
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
                           allocate=args.allocate, pool_budget=_pool.keep_outputs(),
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


#: the attention benchmarks: flag -> (the option naming cases, the cases, the runner and
#: table in .attention, the JSON key, the note under the table)
ATTENTION_BENCHES = {
    "select": ("select_case", SELECT_CASES, "run_select_case", "format_select", "select",
               "(FLOPs: 2 per multiply-add over the keys each query sees; % mm: of the rate "
               "above; x torch: the PyTorch implementation's time over this one's"),
    "compress-attention": (
        "compress_attention_case", CMP_CASES, "run_cmp_case", "format_cmp",
        "compress_attention",
        "(FLOPs: 2 per multiply-add over the compressed keys each query sees, the top-k's "
        "work not counted; % mm: of the rate above; x torch: the PyTorch implementation's "
        "time over this one's; ws: the larger call's workspace; weights: the [T, N1, Tc] "
        "float32 matrix of the visible pairs, which no call holds"),
    "fusion-attention": (
        "fusion_attention_case", FUSION_CASES, "run_fusion_case", "format_fusion",
        "fusion_attention",
        "(FLOPs: 2 per multiply-add over the keys in each query's window; % mm: of the rate "
        "above; x torch: PyTorch's scaled_dot_product_attention blocked for the band (its "
        "time over this one's), f+b: forward and backward together; ws: the larger call's "
        "workspace"),
}


def main_attention(args, threads, use_torch, flag):
    """``bench --select``, ``--compress-attention`` or ``--fusion-attention``."""
    from . import attention
    option, known, runner, table, key, note = ATTENTION_BENCHES[flag]
    run, fmt = getattr(attention, runner), getattr(attention, table)
    rate, who = attention.matmul_rate(threads)
    cases = [(name, dt) for name in getattr(args, option) or list(known) for dt in args.dtype]
    results = []
    for i, (name, dt) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {name} {dt}", file=sys.stderr, flush=True)
        results.append(run(name, dt, args.repeat, rate, use_torch, args.split))
    print(f"nsa_numba bench --{flag}: {threads} thread(s); medians of {args.repeat} rounds; "
          + (f"float32 matrix-multiply rate {rate:.0f} GFLOP/s ({who}, {threads} thread(s), "
             f"same run)" if rate else "no matrix-multiply rate (neither BLAS ran)"))
    print(fmt(results))
    print(note + ("" if use_torch else "; PyTorch columns: not installed or --no-torch") + ")")
    if args.split:
        print(attention.format_steps(results, rate))
        print(SPLIT_NOTE)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": threads, "repeat": args.repeat, "matmul_gflops": rate,
                       "matmul_by": who, key: results}, f, indent=2)
    return 0


SPLIT_NOTE = ("(each launch alone, planned beforehand: the gradient's dq and dk dv passes "
              "both recompute the scores and dP, so their FLOPs add up to more than the "
              "call's)")


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
    parser.add_argument("--select", action="store_true",
                        help="instead: selected attention, forward and gradient, on the "
                             "paper's layer, a small group and a long sequence (causal), "
                             "against the float32 matrix-multiply rate of the same run and a "
                             "PyTorch implementation")
    parser.add_argument("--select-case", action="append", choices=list(SELECT_CASES),
                        help="with --select: only this case (repeatable)")
    parser.add_argument("--compress-attention", action="store_true",
                        help="instead: compressed attention (with its top-k) and its "
                             "gradient, on the paper's layer, a small group and a long "
                             "sequence (causal compressed mask), against the float32 "
                             "matrix-multiply rate of the same run and a PyTorch "
                             "implementation")
    parser.add_argument("--compress-attention-case", action="append",
                        choices=list(CMP_CASES),
                        help="with --compress-attention: only this case (repeatable)")
    parser.add_argument("--fusion-attention", action="store_true",
                        help="instead: fusion attention (npu_fusion_attention, the NSA "
                             "window branch) and its gradient: a window of 512 keys over "
                             "2k and 16k tokens (N1/N2 16/1 and 64/4) and a causal case, "
                             "against the float32 matrix-multiply rate of the same run and "
                             "PyTorch's scaled_dot_product_attention blocked for the band")
    parser.add_argument("--fusion-attention-case", action="append",
                        choices=list(FUSION_CASES),
                        help="with --fusion-attention: only this case (repeatable)")
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
                             "of writing into given ones (the output pool makes that as fast: "
                             "NSA_NUMBA_KEEP_OUTPUTS_MB=0 shows it without)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", nargs="+", metavar="JSON",
                        help="instead: print runs saved with --json (e.g. one per thread "
                             "count) as one markdown table")
