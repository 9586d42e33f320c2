"""Compiling ahead: :func:`warmup` (``python -m nsa_numba warmup``) runs small
problems that reach every kernel for the chosen dtypes (and, on request, common
strided views), so that an image or a CI cache can carry the compiled code. On
the command line it compiles the dtypes in a process each, as many at once as
there are cores (Numba compiles on one core per process).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import _firstrun, api
from ._core.launch import threads
from ._firstrun import cache_dir
from ._kernels import simd as _simd
from ._ops.seqlens import window_counts

#: the dtypes ``warmup`` knows, by their short names
DTYPES = ("bf16", "fp16", "fp32", "fp64")


def _numpy_dtype(name):
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp16": np.float16, "fp32": np.float32, "fp64": np.float64}[name])


#: what ``warmup`` can compile, by operator ("attention": selected attention and its
#: gradient, and compressed attention)
OPS = ("forward", "backward", "decoding", "attention")
#: the inputs ``warmup(strided=True)`` adds, with contiguous weights, gradients and
#: outputs: views users often pass (each a variant of its own for the kernels), every
#: other element of the last axis and tokens in reverse order
_VIEWS = {"every-other-element": lambda a: np.repeat(a, 2, axis=-1)[..., ::2],
          "reversed-tokens": lambda a: np.ascontiguousarray(a[::-1])[::-1]}


def _contracted(g):
    """``g`` laid out as autograd hands over the gradient of a contraction's operand
    (``einsum``, ``matmul``): the same values, the axes in another memory order (here
    windows innermost, strides like (1, D * T', T')), a variant of its own for the
    backward kernel."""
    return np.ascontiguousarray(g.transpose(1, 2, 0)).transpose(2, 0, 1)


def _steps(dtype, strided):
    """(op, label, function) triples that between them reach every kernel for
    ``dtype`` on C-contiguous arrays (and with ``strided``, on the views of _VIEWS)."""
    rng = np.random.default_rng(0)

    def data(*shape):
        return rng.standard_normal(shape).astype(dtype)

    def problem(T, N, D, view):
        seq = [0, T // 3, T]
        windows = int(window_counts(np.diff(seq), 32, 16).sum())
        return view(data(T, N, D)), data(32, N), data(windows, N, D), seq

    # each call twice: the second, like a training loop's next step, runs the
    # prepared call through its kernel's entry (``_ops.pipeline``), which compiles apart
    def forward(T, N, D, view=lambda a: a):
        x, w, _, seq = problem(T, N, D, view)
        for _ in range(2):
            api.nsa_compress(x, w, 32, 16, actual_seq_len=seq, strict=False)

    def backward(T, N, D, view=lambda a: a, grad_view=lambda a: a):
        x, w, g, seq = problem(T, N, D, view)
        g = grad_view(g)
        for _ in range(2):
            api.nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=seq, strict=False)

    def decode(writers, parallel):
        x, w = data(4, 64, 2, 64), data(32, 2)          # 4 pages of 64 tokens
        cache = np.zeros((writers, 2, 64), dtype)
        table = (np.arange(writers, dtype=np.int32) % 4).reshape(writers, 1)
        with threads(2 if parallel else 1):
            api.nsa_compress_infer(x, w, np.arange(writers), 32, 16, 64,
                                   block_table=table, actual_seq_len=[48] * writers,
                                   cache=cache, strict=False)

    def attention():
        # two sequences, G = 2, a block of 16 (whole tiles) and a causal mask; arrays of
        # any memory order share the one variant (_launch.any_layout)
        ends, topk = [64, 128], np.zeros((128, 1, 2), np.int32)
        topk[:, 0, 1] = np.arange(128) % 64 // 16
        q, k, v = data(128, 2, 32), data(128, 1, 32), data(128, 1, 16)
        kw = dict(atten_mask=np.ones(1), actual_seq_qlen=ends, actual_seq_kvlen=ends,
                  strict=False)
        out, smax, ssum = api.nsa_select_attention(q, k, v, topk, 0.2, 2, 16, 2, **kw)
        api.nsa_select_attention_grad(out.copy(), q, k, v, out, smax, ssum, topk, 0.2, 2, 16,
                                      2, **kw)
        # compressed attention over 7 compressed keys per sequence (l 32, d 16, l' 64)
        out, _, smax, ssum = api.nsa_compress_attention(
            q, k[:14], v[:14], 0.2, 2, 32, 16, 64, 1, atten_mask=np.zeros((64, 7), bool),
            actual_seq_qlen=ends, actual_cmp_seq_kvlen=[7, 14], actual_sel_seq_kvlen=[2, 4],
            strict=False)
        api.nsa_compress_attention_grad(out.copy(), q, k[:14], v[:14], out, smax, ssum, 0.2, 2,
                                        atten_mask=np.zeros((64, 7), bool),
                                        actual_seq_qlen=ends, actual_cmp_seq_kvlen=[7, 14],
                                        strict=False)
        # fusion attention (the window branch) shares the dense kernels but its forward
        kw = dict(atten_mask=np.ones((2048, 2048), bool), sparse_mode=4, pre_tockens=15,
                  next_tockens=0, actual_seq_qlen=ends, actual_seq_kvlen=ends, strict=False)
        out, smax, ssum, *_ = api.fusion_attention(q, k, v, 2, "TND", **kw)
        api.fusion_attention_grad(q, k, v, out.copy(), 2, "TND", softmax_max=smax,
                                  softmax_sum=ssum, attention_in=out, **kw)

    width = _simd.WIDTH
    steps = [
        ("forward", "forward, vector rows", lambda: forward(96, 2, 2 * width)),
        ("forward", "forward, other rows", lambda: forward(96, 2, 20)),
        ("forward", "forward, long rows", lambda: forward(64, 32, 256)),
        ("backward", "backward, vector rows", lambda: backward(96, 2, 2 * width)),
        ("backward", "backward, contraction's gradient",
         lambda: backward(96, 2, 2 * width, grad_view=_contracted)),
        ("decoding", "decoding step, one thread", lambda: decode(2, False)),
        ("decoding", "decoding step, threads", lambda: decode(64, True)),
        ("attention", "attention: selected, compressed, window, with gradients", attention),
    ]
    if strided:
        for name, view in _VIEWS.items():
            steps += [("forward", f"forward, {name}", lambda v=view: forward(96, 2, 64, v)),
                      ("backward", f"backward, {name}",
                       lambda v=view: backward(96, 2, 64, v)),
                      ("backward", f"backward, {name}, contraction's gradient",
                       lambda v=view: backward(96, 2, 64, v, _contracted))]
    return steps


def warmup(dtypes=DTYPES, ops=OPS, strided=False, out=sys.stdout, times=False, jobs=1):
    """Compile (or load from the cache) the kernels of ``ops`` (see ``OPS``) for
    ``dtypes`` (short names, see ``DTYPES``) on contiguous arrays, and with ``strided``
    on common views too; prints each step and its time to ``out`` and returns the
    total seconds. ``times``: also print what compiled, one row per kernel or helper
    variant (``compile_table``). ``jobs``: compile the dtypes in up to this many
    processes at once (Numba compiles on one core per process; the kernel cache takes
    concurrent writers)."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"warmup: jobs must be an integer >= 1, got {jobs!r}")
    for name, given, known in (("dtype", dtypes, DTYPES), ("op", ops, OPS)):
        unknown = [v for v in given if v not in known]
        if unknown:
            raise ValueError(f"warmup: unknown {name} {unknown[0]!r}; the {name}s are "
                             f"{', '.join(known)}")
    start = time.perf_counter()
    where = cache_dir()
    print(f"nsa_numba warmup: {', '.join(dtypes)}; cache "
          f"{where or 'off (nothing will be kept)'}"
          + (f"; {min(jobs, len(dtypes))} processes" if jobs > 1 and len(dtypes) > 1 else ""),
          file=out, flush=True)
    if jobs > 1 and len(dtypes) > 1 and where:
        lines, records = _in_processes(dtypes, ops, strided, jobs)
        for line in lines:
            print(line, file=out, flush=True)
    else:
        records = _firstrun.record() if times else None
        try:
            _steps_run(dtypes, ops, strided, out, records)
        finally:
            if times:
                _firstrun.record(False)
    total = time.perf_counter() - start
    print(f"done in {total:.1f} s", file=out, flush=True)
    if times:
        print(compile_table(records), file=out, flush=True)
    return total


def _steps_run(dtypes, ops, strided, out, records):
    """Run the steps of ``dtypes`` here, one line each to ``out``."""
    plan = [(name, label, fn) for name in dtypes
            for op, label, fn in _steps(_numpy_dtype(name), strided) if op in ops]
    for i, (name, label, fn) in enumerate(plan, 1):
        t = time.perf_counter()
        fn()
        step = f"[{i}/{len(plan)}]"
        print(f"  {step:<8}{name:<6}{label:<36}{time.perf_counter() - t:6.1f} s", file=out,
              flush=True)


def default_jobs():
    """The cores this process may run on: ``warmup``'s process count on the command
    line."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        return os.cpu_count() or 1


#: what a ``_in_processes`` child runs: one dtype's steps, then its lines and what it
#: compiled as one JSON line
_CHILD = """
import io, json, sys
from nsa_numba import _firstrun, _warmup
out, records = io.StringIO(), _firstrun.record()
_warmup._steps_run([sys.argv[1]], tuple(sys.argv[3:]), sys.argv[2] == "1", out, records)
print(json.dumps({"lines": out.getvalue().splitlines(), "records": records}))
"""


def _in_processes(dtypes, ops, strided, jobs):
    """(step lines, compile records) of each dtype's steps run in a process of its own,
    at most ``jobs`` at a time, in ``dtypes``' order. The children import this very
    package (its directory goes first on their path) and write to files, not pipes,
    so that no amount of output can stall them."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NSA_NUMBA_QUIET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    waiting, running, done = list(dtypes), {}, {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                name = waiting.pop(0)
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                proc = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, name, "1" if strided else "0", *ops],
                    env=env, stdout=out, stderr=err, text=True)
                running[name] = (proc, out, err)
            finished = [name for name, (proc, _, _) in running.items()
                        if proc.poll() is not None]
            if not finished:
                time.sleep(0.05)
            for name in finished:
                proc, out, err = running.pop(name)
                with out, err:
                    out.seek(0)
                    err.seek(0)
                    stdout, stderr = out.read(), err.read()
                if proc.returncode or not stdout.strip():
                    raise RuntimeError(f"warmup of {name} failed in its process:\n{stderr}")
                done[name] = json.loads(stdout.splitlines()[-1])
    finally:
        for proc, out, err in running.values():
            proc.kill()
            proc.wait()
            out.close()
            err.close()
    lines = [line for name in dtypes for line in done[name]["lines"]]
    records = [tuple(r) for name in dtypes for r in done[name]["records"]]
    return lines, records


def compile_table(records):
    """What compiled (``_firstrun.record``'s rows), slowest first: kernel or helper,
    dtype, variant (array layouts), seconds and LLVM IR size, then the total."""
    if not records:
        return ("nothing compiled: the kernel cache is warm (NUMBA_CACHE_DIR=<an empty "
                "directory> times a cold start)")
    lines = [f"{'compiled':<28}{'dtype':<10}{'variant':<14}{'seconds':>8}{'IR KiB':>9}"]
    for name, dtype, variant, seconds, ir in sorted(records, key=lambda r: -r[3]):
        size = f"{ir / 1024:9.0f}" if ir is not None else f"{'-':>9}"
        lines.append(f"{name:<28}{dtype or '-':<10}{variant or '-':<14}{seconds:8.2f}{size}")
    lines.append(f"{'total':<52}{sum(r[3] for r in records):8.2f}")
    return "\n".join(lines)
