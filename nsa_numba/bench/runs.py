"""Running the cases: each call timed against the copy of the same rounds, the
PyTorch implementations beside them, the per-call overhead, and peak memory."""

import json
import sys
import time
from dataclasses import asdict, replace

import numpy as np

from .. import api
from .._ops import dispatch as _dispatch
from .._ops import pipeline as _pipeline
from .._ops.checks import Rules
from .._ops.operators import COMPRESS, COMPRESS_GRAD
from .cases import (
    DEFAULT_SHAPES,
    INFER_CASES,
    INFER_WINDOW,
    OVERHEAD_SHAPE,
    Case,
    infer_problem,
    make_data,
)
from .harness import CacheFlush, best_time, input_read_task, round_times


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
    and the rest of their Python work done beforehand (``_ops.dispatch.prepare``)."""
    fwd = _pipeline.plan(COMPRESS, Rules("nsa_compress"), (x, w, l, d, seq, 0, "TND", out))
    bwd = _pipeline.plan(COMPRESS_GRAD, Rules("nsa_compress_grad"),
                         (g, x, w, l, d, seq, 0, "TND", dx, dw))
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
    the empty custom op, the NumPy API and the torch function, forward and backward,
    and of a decoding step (``--infer``'s typical step, bf16) through both: medians
    over ``repeat`` rounds of the best of three runs of ``calls`` calls, the functions
    timed in turn within each round."""
    import timeit

    import torch

    from .. import torch as bridge
    T, N, D, l, d = OVERHEAD_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, N, D, generator=gen, requires_grad=True)
    w = torch.randn(l, N, generator=gen, requires_grad=True)
    g = torch.randn((T - l) // d + 1, N, D, generator=gen)
    xn, wn, gn = x.detach().numpy(), w.detach().numpy(), g.numpy()
    empty = _empty_custom_op()
    win = INFER_WINDOW
    kv, kw, slots, table, lengths, cache = infer_problem(*INFER_CASES["typical step"], "bf16")
    tkv, tkw, tcache = (bridge._as_tensor(a) for a in (kv, kw, cache))
    tslots, ttable, tlengths = (torch.from_numpy(a) for a in (slots, table, lengths))
    fns = {
        "empty custom op": lambda: empty(x, w, l, d, None),
        "forward, NumPy": lambda: api.nsa_compress(xn, wn, l, d),
        "forward, torch": lambda: bridge.npu_nsa_compress(x, w, l, d),
        "backward, NumPy": lambda: api.nsa_compress_grad(gn, xn, wn, l, d),
        "backward, torch": lambda: bridge.npu_nsa_compress_grad(g, x, w, l, d),
        "decoding, NumPy": lambda: api.nsa_compress_infer(
            kv, kw, slots, win["block"], win["stride"], win["page"], block_table=table,
            actual_seq_len=lengths, cache=cache),
        "decoding, torch": lambda: bridge.npu_nsa_compress_infer(
            tkv, tkw, tslots, win["block"], win["stride"], win["page"], block_table=ttable,
            actual_seq_len=tlengths, cache=tcache),
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
    dispatch and the compiled code (the prepared call's kernel, ``_kernels.compress``) are not run,
    so what is timed is the Python work alone, which ``--split`` can only show as the
    noisy difference of two timings. The stop stands in for the kept calls' kernels
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

    def stop(work, slot, *args):
        if slot == 0:                          # the caller's launch, not a helper's
            stamps.append(time.perf_counter_ns())
        return True                            # as if it ran: no full way after it

    cache = _pipeline._prepared
    kept = cache.items()
    for key, prepared in kept:
        cache.replace(key, replace(prepared, kernel=stop))
    try:
        for _ in range(rounds):
            for name, fn in calls.items():
                flush()
                start = time.perf_counter_ns()
                fn()
                times[name].append((stamps[-1] - start) / 1e3)
    finally:
        for key, prepared in kept:
            cache.replace(key, prepared)
    return case, {name: float(np.median(t)) for name, t in times.items()}


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
