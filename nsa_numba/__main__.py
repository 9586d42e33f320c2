"""Command line: ``python -m nsa_numba {demo,info,bench,warmup}``."""

import argparse
import os
import platform
import sys
import time

import numpy as np


def _ms(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def demo(args):
    """The seed example of aclnnNsaCompressGrad, forward and backward, checked."""
    import nsa_numba
    from nsa_numba import reference as ref

    T, N, D, block, stride = 272, 64, 128, 32, 16
    seq = [0, 128, 272]
    dtype = np.float16
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((T, N, D)).astype(dtype)
    w = rng.standard_normal((block, N)).astype(dtype)

    print("nsa_numba demo: the aclnnNsaCompressGrad seed example")
    print(f"  input {list(x.shape)} float16, weight {list(w.shape)}, "
          f"compress_block_size={block}, compress_stride={stride}, "
          f"actual_seq_len={seq} (cumulative)")

    t0 = time.perf_counter()
    out = nsa_numba.nsa_compress(x, w, block, stride, actual_seq_len=seq)
    t_first_fwd = time.perf_counter() - t0
    g = rng.standard_normal(out.shape).astype(dtype)
    t0 = time.perf_counter()
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, block, stride, actual_seq_len=seq)
    t_first_bwd = time.perf_counter() - t0

    def again(fn):
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    t_fwd = again(lambda: nsa_numba.nsa_compress(x, w, block, stride, actual_seq_len=seq,
                                                 out=out))
    t_bwd = again(lambda: nsa_numba.nsa_compress_grad(g, x, w, block, stride,
                                                      actual_seq_len=seq, input_grad=dx,
                                                      weight_grad=dw))

    windows = out.shape[0]
    d_fwd, d_ig, d_wg = ref.depths(windows, D, block, stride, len(seq))
    exact = ref.compress(x, w, block, stride, seq)
    exact_dx, exact_dw = ref.compress_grad(g, x, w, block, stride, seq)
    abs_dx, abs_dw = ref.abs_terms_grad(g, x, w, block, stride, seq)
    checks = [
        ("forward", "out", out, ref.check_accuracy(
            out, exact, ref.abs_terms_forward(x, w, block, stride, seq), dtype, d_fwd),
         t_first_fwd, t_fwd),
        ("backward", "input_grad", dx,
         ref.check_accuracy(dx, exact_dx, abs_dx, dtype, d_ig), t_first_bwd, t_bwd),
        ("", "weight_grad", dw, ref.check_accuracy(dw, exact_dw, abs_dw, dtype, d_wg),
         None, None),
    ]
    ok = True
    print(f"  {'':9}{'result':12}{'shape':17}{'max error':>11}{'beyond f32 sum':>16}"
          f"{'first call':>13}{'then':>11}")
    for op, name, arr, acc, first, then in checks:
        ok &= acc["ok"]
        times = (f"{_ms(first):>13}{_ms(then):>11}" if first is not None else "")
        print(f"  {op:9}{name:12}{str(list(arr.shape)):17}{acc['max_ulp']:>7.2f} ulp"
              f"{acc['max_excess_ulp']:>12.2f} ulp{times}")
    print("  (promise: at most 1 ulp beyond the float32 accumulation error bound; "
          "'first call' includes compiling or loading the cached kernels)")
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


def info(args):
    """Versions, threading and cache facts that matter when reporting a problem."""
    import llvmlite
    import ml_dtypes
    import numba

    import nsa_numba
    from nsa_numba._core import launch as _launch, pool as _pool
    from nsa_numba._kernels import compress as _kernels, halfprec as _halfprec, simd as _simd
    from nsa_numba._kernels import target as _target

    cache = getattr(_kernels.compress_forward, "_cache", None)
    budget = _pool.keep_outputs()
    rows = [
        ("nsa_numba", nsa_numba.__version__),
        ("python", sys.version.split()[0]),
        ("numba", numba.__version__),
        ("llvmlite", llvmlite.__version__),
        ("numpy", np.__version__),
        ("ml_dtypes", ml_dtypes.__version__),
        ("torch", _torch_version()),
        ("threads", f"{_launch.count()} (NUMBA_NUM_THREADS="
                    f"{os.environ.get('NUMBA_NUM_THREADS', 'unset')}, cores "
                    f"{os.cpu_count()}): the caller and up to {_launch.ceiling() - 1} "
                    f"helper threads of nsa_numba's own"),
        ("cpu", f"{platform.machine()} {numba.config.CPU_NAME or _host_cpu_name()}"),
        ("vector path", f"{_target.vector_isa()} ({_target.vector_bits()}-bit registers): "
                        f"forward sums in {_simd.WIDTH} lanes, backward {_simd.SHORT_WIDTH}"),
        ("float16 path", f"{_halfprec.HALF_INSTRUCTIONS} instructions"
                         if _halfprec.HARDWARE_HALF else "portable integer code"),
        ("kernel cache", getattr(cache, "_cache_path", None) or "disabled"),
        ("output pool", f"up to {budget >> 20} MiB of allocated outputs of "
                        f"{_pool.MIN_BYTES >> 20} MiB or more"
                        if budget else "off (every output allocated)"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _bench(args):
    from . import bench
    if not args.dtype:
        args.dtype = ["bf16", "fp16"]
    return bench.main(args)


def _warmup(args):
    from . import _firstrun, _warmup
    if args.jobs is not None and args.jobs < 1:
        raise SystemExit(f"python -m nsa_numba warmup: --jobs must be at least 1, got "
                         f"{args.jobs}")
    _firstrun.compile_messages(False)   # the steps say what is compiling
    _warmup.warmup(args.dtype or _warmup.DTYPES, strided=args.strided, times=args.times,
                   jobs=args.jobs or _warmup.default_jobs())
    return 0


def _torch_version():
    """The installed PyTorch's version, or why the bridge cannot be used, without
    importing torch (which takes seconds)."""
    from importlib import metadata
    try:
        return metadata.version("torch") + " (nsa_numba.torch needs 2.4 or newer)"
    except metadata.PackageNotFoundError:
        return "not installed (nsa_numba.torch needs it: pip install 'nsa_numba[torch]')"


def _host_cpu_name():
    from llvmlite import binding
    return binding.get_host_cpu_name()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nsa_numba",
                                     description="NSA compress operators on the CPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run and check the aclnnNsaCompressGrad seed example")
    p.add_argument("--seed", type=int, default=0, help="random seed for the data")
    p.set_defaults(func=demo)
    p = sub.add_parser("info", help="versions, threads, CPU, cache directory")
    p.set_defaults(func=info)
    p = sub.add_parser("bench", help="throughput against copy bandwidth (and PyTorch)")
    from . import bench
    bench.add_arguments(p)
    p.set_defaults(func=_bench)
    p = sub.add_parser("warmup", help="compile the kernels ahead of time (for images and "
                                      "CI caches)")
    p.add_argument("--dtype", action="append", choices=("bf16", "fp16", "fp32", "fp64"),
                   help="a dtype to compile for (repeatable); default: all four")
    p.add_argument("--strided", action="store_true",
                   help="also compile for inputs taken every other element of the last "
                        "axis or in reverse token order (each a variant of its own)")
    p.add_argument("--times", action="store_true",
                   help="also print what compiled: kernel, dtype, variant (array layouts), "
                        "seconds and LLVM IR size (empty on a warm cache)")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="compile the dtypes in up to N processes at once (default: one "
                        "per core)")
    p.set_defaults(func=_warmup)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
