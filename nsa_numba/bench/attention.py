"""``bench --select``, ``--compress-attention`` and ``--fusion-attention``: selected,
compressed and fusion (window) attention, forward and gradient, against the
machine's float32 matrix-multiply rate measured in the same run and PyTorch
implementations of the same semantics.

FLOPs count the keys a query actually attends to (selected attention:
``cases.visible_keys``, whole blocks before its own and its own block up to its
position; compressed attention: ``cases.cmp_visible``, the compressed keys whose
window has ended; fusion attention: ``cases.fusion_visible``, the keys in the
window), times 2 per multiply-add: the forward's two products (scores over
D, the values' weighted sum over Dv), ``2 (D + Dv)`` per visible key and query head;
the gradient's five (scores again, dP, dq, dk, dv), ``2 (3 D + 2 Dv)``. Compressed
attention's importance scores and top-k are work beyond that count."""

import os
import time

import numpy as np

from .. import api
from .._ops import compress_attention as _compress_attention
from .._ops import dense as _dense
from .._ops import fusion as _fusion
from .._ops import pipeline as _pipeline
from .._ops import select as _select
from .._ops.operators import (
    COMPRESS_ATTENTION,
    COMPRESS_ATTENTION_GRAD,
    FUSION_ATTENTION,
    FUSION_ATTENTION_GRAD,
    SELECT,
    SELECT_GRAD,
)
from .cases import (
    CMP_CASES,
    CMP_WINDOW,
    FUSION_CASES,
    SELECT_CASES,
    cmp_lengths,
    cmp_problem,
    cmp_visible,
    fusion_problem,
    fusion_visible,
    select_problem,
    visible_keys,
)
from .harness import round_times

#: the square product the matrix-multiply rate is taken from
MATMUL_N = 3072


def matmul_rate(threads, repeat=3):
    """(GFLOP/s, by whom): the best float32 square product of NumPy's and PyTorch's at
    ``threads`` threads (NumPy's BLAS only when ``threads`` is every core: its thread
    count is fixed when it loads)."""
    n = MATMUL_N
    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    b = a.T.copy()
    best = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if threads == cores:
        best.append((min(round_times([lambda: a @ b], repeat)[0]), "NumPy"))
    try:
        import torch
        torch.set_num_threads(threads)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        best.append((min(round_times([lambda: ta @ tb], repeat)[0]), "PyTorch"))
    except ImportError:
        pass
    if not best:
        return None, None
    seconds, who = min(best)
    return 2 * n ** 3 / seconds / 1e9, who


def _timed(result, forward, backward, flops, rate, repeat):
    """Medians of ``repeat`` rounds of ``forward`` and ``backward`` into ``result``, with
    their GFLOP/s (``flops``: the two calls' counts) and % of the matmul ``rate``."""
    t_fwd, t_bwd = (float(np.median(t)) for t in round_times([forward, backward], repeat))
    result.update(forward_s=t_fwd, backward_s=t_bwd, forward_gflops=flops[0] / t_fwd / 1e9,
                  backward_gflops=flops[1] / t_bwd / 1e9)
    if rate:
        result["forward_pct"] = 100 * result["forward_gflops"] / rate
        result["backward_pct"] = 100 * result["backward_gflops"] / rate
    return result


def _split(result, plans, steps_of, work, repeat):
    """``result["steps"]``: each launch of ``plans`` alone (``steps_of(plan)``), medians
    of ``repeat`` rounds, with GFLOP/s for the launches ``work`` counts."""
    steps = [(f"{p.op} {name}", fn) for p in plans for name, fn in steps_of(p)]
    times = round_times([fn for _, fn in steps], repeat)
    result["steps"] = {
        name: dict(s=float(np.median(t)),
                   **({"gflops": work[name] / float(np.median(t)) / 1e9} if name in work
                      else {}))
        for (name, _), t in zip(steps, times)}


def _versus(result, ref_fwd, ref_both):
    """The PyTorch implementation's times (forward, forward + backward) and the
    speed-ups over it. Its backward is the difference of the two: where noise makes
    that not positive (a tiny case on a loaded machine), the backward's columns are
    NaN rather than a meaningless ratio."""
    back = ref_both - ref_fwd if ref_both > ref_fwd else float("nan")
    result["torch_forward_s"] = ref_fwd
    result["torch_backward_s"] = back
    result["forward_speedup"] = ref_fwd / result["forward_s"]
    result["backward_speedup"] = back / result["backward_s"]


def _better_of_two(forward, both):
    """(forward s, forward + backward s) of a PyTorch baseline: each path once untimed
    (PyTorch's first calls set things up, autograd's too), then the better of two
    timed calls each."""
    forward()
    both()
    times = []
    for fn in (forward, both):
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    return times[0], times[1]


def _dense_split(result, plans, op, flops, keys, D, Dv, repeat):
    """``_split`` of a dense forward and gradient (``op`` and ``op``_grad), with the
    FLOPs of the forward and of the gradient's two passes."""
    _split(result, plans, _dense.dense_steps,
           {f"{op} forward": flops, f"{op}_grad dq": 2 * keys * (2 * D + Dv),
            f"{op}_grad dk dv": 2 * keys * (2 * D + 2 * Dv)}, repeat)


def torch_select(q, k, v, topk, scale, block, ends, chunk=16):
    """(forward s, forward + backward s) of selected attention written in PyTorch over
    chunks of ``chunk`` tokens: gather the selected blocks, matmul, mask, softmax in
    float32, matmul; autograd for the gradient, each chunk's backward right after its
    forward (a whole-sequence graph would hold every chunk's gathered keys)."""
    import torch
    tq, tk, tv = (torch.from_numpy(a.astype(np.float32)) for a in (q, k, v))
    topk = torch.from_numpy(topk.astype(np.int64))
    T, N1, D = tq.shape
    N2, count = topk.shape[1], topk.shape[2]
    G = N1 // N2
    starts = np.concatenate(([0], ends[:-1]))
    seq = np.repeat(np.arange(len(ends)), np.diff(np.concatenate(([0], ends))))
    kv0 = torch.from_numpy(starts[seq])                      # each token's first key row
    pos = torch.arange(T) - kv0
    lanes = torch.arange(block)
    heads = torch.arange(N2)[None, :, None]

    def chunk_out(a, b, qq, kk, vv):
        rows = (kv0[a:b, None, None, None] + topk[a:b, :, :, None] * block + lanes)
        rows = rows.reshape(b - a, N2, count * block)
        ks, vs = kk[rows, heads], vv[rows, heads]            # [C, N2, K, D]
        s = torch.einsum("cjgd,cjkd->cjgk", qq[a:b].view(b - a, N2, G, D), ks) * scale
        key = (topk[a:b, :, :, None] * block + lanes).reshape(b - a, N2, 1, -1)
        s = s.masked_fill(key > pos[a:b, None, None, None], float(np.finfo(np.float32).min))
        return torch.einsum("cjgk,cjke->cjge", s.softmax(-1), vs)

    def forward():
        with torch.no_grad():
            for a in range(0, T, chunk):
                chunk_out(a, min(T, a + chunk), tq, tk, tv)

    def both():
        qq, kk, vv = (t.detach().requires_grad_() for t in (tq, tk, tv))
        for a in range(0, T, chunk):
            chunk_out(a, min(T, a + chunk), qq, kk, vv).square().sum().backward()

    forward()                           # PyTorch's first calls set things up: untimed
    times = []
    for fn in (forward, both):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def run_select_case(name, dtype, repeat, rate, use_torch, split=False):
    """One ``SELECT_CASES`` case: medians of ``repeat`` rounds of the forward and the
    gradient (outputs given: the kernels' time, not the allocator's); with ``split``
    also each launch of the two calls alone (``_ops.select.select_steps``), with the
    GFLOP/s of the three that compute."""
    lengths, N1, N2, D, Dv, block, count = SELECT_CASES[name]
    q, k, v, topk, scale, ends = select_problem(lengths, N1, N2, D, Dv, block, count, dtype)
    kw = dict(atten_mask=np.ones(1), actual_seq_qlen=ends, actual_seq_kvlen=ends)
    out = api.nsa_select_attention(q, k, v, topk, scale, N1, block, count, **kw)
    grad = np.random.default_rng(1).standard_normal(out[0].shape).astype(q.dtype)
    given = [np.empty_like(a) for a in (q, k, v)]
    outs = [np.empty_like(a) for a in out]

    def forward():
        api.nsa_select_attention(q, k, v, topk, scale, N1, block, count, attention_out=outs[0],
                                 softmax_max=outs[1], softmax_sum=outs[2], **kw)

    def backward():
        api.nsa_select_attention_grad(grad, q, k, v, *out, topk, scale, N1, block, count,
                                      dq=given[0], dk=given[1], dv=given[2], **kw)

    G = N1 // N2
    keys = visible_keys(topk, lengths, block)
    flops = (2 * keys * G * (D + Dv), 2 * keys * G * (3 * D + 2 * Dv))
    result = _timed(dict(case=name, dtype=dtype, lengths=list(lengths), N1=N1, N2=N2, D=D,
                         Dv=Dv, block=block, count=count), forward, backward, flops, rate,
                    repeat)
    if split:
        args = (topk, scale, N1, block, count, kw["atten_mask"], ends, ends)
        plans = (_pipeline.plan(SELECT, _select.select_rules("bench"),
                                (q, k, v, *args, *outs)),
                 _pipeline.plan(SELECT_GRAD, _select.select_rules("bench"),
                                (grad, q, k, v, *out, *args, *given)))
        _split(result, plans, _select.select_steps,
               {"select forward": flops[0], "select_grad dq": 2 * keys * G * (2 * D + Dv),
                "select_grad dk dv": 2 * keys * G * (2 * D + 2 * Dv)}, repeat)
    if use_torch:
        _versus(result, *torch_select(q, k, v, topk, scale, block, np.asarray(ends)))
    return result


def format_steps(results, rate):
    """``--split``'s table: each launch's median time, and the GFLOP/s (and % of the
    matmul rate) of those that compute."""
    lines = [f"{'case':<16}{'dtype':<6}{'launch':<32}{'ms':>9}{'GFLOP/s':>9}{'% mm':>6}"]
    for r in results:
        for name, step in r.get("steps", {}).items():
            gf = step.get("gflops")
            lines.append(f"{r['case']:<16}{r['dtype']:<6}{name:<32}{step['s'] * 1e3:9.1f}"
                         + (f"{gf:9.1f}" + (f"{100 * gf / rate:6.0f}" if rate else "")
                            if gf else ""))
    return "\n".join(lines)


def format_select(results):
    """The ``--select`` table: time, GFLOP/s, % of the matmul rate, speed-up over
    PyTorch, forward and gradient."""
    head = (f"{'case':<16}{'dtype':<6}{'fwd ms':>9}{'GFLOP/s':>9}{'% mm':>6}{'x torch':>9}"
            f"{'bwd ms':>10}{'GFLOP/s':>9}{'% mm':>6}{'x torch':>9}")
    lines = [head]
    for r in results:
        def part(kind):
            pct = f"{r[kind + '_pct']:6.0f}" if kind + "_pct" in r else f"{'-':>6}"
            speed = (f"{r[kind + '_speedup']:9.1f}" if kind + "_speedup" in r
                     else f"{'-':>9}")
            return (f"{r[kind + '_s'] * 1e3:{10 if kind == 'backward' else 9}.1f}"
                    f"{r[kind + '_gflops']:9.1f}{pct}{speed}")
        lines.append(f"{r['case']:<16}{r['dtype']:<6}{part('forward')}{part('backward')}")
    return "\n".join(lines)


# -- compressed attention ----------------------------------------------------------------

def torch_compress_attention(q, k, v, mask, lists, scale, count, chunk=256):
    """(forward s, forward + backward s) of compressed attention written in PyTorch
    over chunks of ``chunk`` queries of a sequence: scores against the sequence's
    compressed keys, the mask, softmax in float32, the values' sum; the group's weights
    through the importance window as one product with a ``[Tc, blocks]`` weight matrix,
    ``torch.topk``; autograd for the gradient (each chunk's backward right after its
    forward, as a training step that fits in memory would). Each path runs once
    untimed, then the better of two timed calls counts."""
    import torch

    from ..reference import importance_weights
    w = CMP_WINDOW
    tq, tk, tv = (torch.from_numpy(a.astype(np.float32)) for a in (q, k, v))
    tmask = torch.from_numpy(np.asarray(mask, bool))
    T, N1, D = tq.shape
    N2 = tk.shape[1]
    G = N1 // N2
    q_ends, kv_ends = lists["actual_seq_qlen"], lists["actual_cmp_seq_kvlen"]
    seqs = list(zip([0] + q_ends[:-1], q_ends, [0] + kv_ends[:-1], kv_ends))
    weights = {}
    for _, _, k0, k1 in seqs:
        if k1 - k0 not in weights:
            weights[k1 - k0] = torch.from_numpy(importance_weights(
                k1 - k0, w["block"], w["stride"], w["select_block"]).T.astype(np.float32))

    def chunk_out(q0, a, b, k0, k1, qq, kk, vv):
        s = torch.einsum("cjgd,kjd->cjgk", qq[a:b].view(b - a, N2, G, D), kk[k0:k1]) * scale
        s = s.masked_fill(tmask[a - q0:b - q0, None, None, :k1 - k0],
                          float(np.finfo(np.float32).min))
        p = s.softmax(-1)
        score = p.detach().sum(2) @ weights[k1 - k0]                   # [C, N2, blocks]
        score.topk(count, -1)
        return torch.einsum("cjgk,kje->cjge", p, vv[k0:k1])

    def forward():
        with torch.no_grad():
            for q0, q1, k0, k1 in seqs:
                for a in range(q0, q1, chunk):
                    chunk_out(q0, a, min(q1, a + chunk), k0, k1, tq, tk, tv)

    def both():
        qq, kk, vv = (t.detach().requires_grad_() for t in (tq, tk, tv))
        for q0, q1, k0, k1 in seqs:
            for a in range(q0, q1, chunk):
                chunk_out(q0, a, min(q1, a + chunk), k0, k1, qq, kk, vv).square().sum() \
                    .backward()

    return _better_of_two(forward, both)


def run_cmp_case(name, dtype, repeat, rate, use_torch, split=False):
    """One ``CMP_CASES`` case: medians of ``repeat`` rounds of the forward (with its
    top-k) and the gradient, outputs given; the workspace each announces (what a call
    adds to memory: tests/test_memory.py); with ``split`` each launch alone."""
    lengths, N1, N2, D, Dv, count = CMP_CASES[name]
    q, k, v, mask, lists, scale = cmp_problem(lengths, N1, N2, D, Dv, dtype)
    w = CMP_WINDOW
    args = (scale, N1, w["block"], w["stride"], w["select_block"], count)
    out = api.nsa_compress_attention(q, k, v, *args, atten_mask=mask, **lists)
    grad = np.random.default_rng(1).standard_normal(out[0].shape).astype(q.dtype)
    given = [np.empty_like(a) for a in (q, k, v)]
    outs = [np.empty_like(a) for a in out]
    seqs = dict(actual_seq_qlen=lists["actual_seq_qlen"],
                actual_cmp_seq_kvlen=lists["actual_cmp_seq_kvlen"])

    def forward():
        api.nsa_compress_attention(q, k, v, *args, atten_mask=mask, attention_out=outs[0],
                                   topk_indices=outs[1], softmax_max=outs[2],
                                   softmax_sum=outs[3], **lists)

    def backward():
        api.nsa_compress_attention_grad(grad, q, k, v, out[0], out[2], out[3], scale, N1,
                                        atten_mask=mask, dq=given[0], dk=given[1],
                                        dv=given[2], **seqs)

    keys = cmp_visible(lengths) * N1
    flops = (2 * keys * (D + Dv), 2 * keys * (3 * D + 2 * Dv))
    rules = _compress_attention.compress_attention_rules("bench")
    plans = (_pipeline.plan(COMPRESS_ATTENTION, rules, (
                 q, k, v, *args, None, mask, *lists.values(), *outs)),
             _pipeline.plan(COMPRESS_ATTENTION_GRAD, rules, (
                 grad, q, k, v, out[0], out[2], out[3], scale, N1, mask, *seqs.values(),
                 *given)))
    result = _timed(dict(case=name, dtype=dtype, lengths=list(lengths), N1=N1, N2=N2, D=D,
                         Dv=Dv, count=count, compressed=cmp_lengths(lengths)[0],
                         forward_workspace=plans[0].workspace_bytes,
                         backward_workspace=plans[1].workspace_bytes, weights_bytes=keys * 4),
                    forward, backward, flops, rate, repeat)
    if split:
        _dense_split(result, plans, "compress_attention", flops[0], keys, D, Dv, repeat)
    if use_torch:
        _versus(result, *torch_compress_attention(q, k, v, mask, lists, scale, count))
    return result


def format_cmp(results):
    """The ``--compress-attention`` table: ``format_select``'s columns and each call's
    workspace (what it adds to memory) beside the float32 weights a PyTorch forward
    would hold whole."""
    table = format_select(results).splitlines()
    lines = [table[0] + f"{'ws MiB':>8}{'weights MiB':>12}"]
    for r, line in zip(results, table[1:]):
        ws = max(r["forward_workspace"], r["backward_workspace"]) / 2 ** 20
        lines.append(line + f"{ws:8.1f}{r['weights_bytes'] / 2 ** 20:12.0f}")
    return "\n".join(lines)


# -- fusion attention (the window branch) ---------------------------------------------------

def torch_window(q, k, v, kw, window, chunk=512):
    """(forward s, forward + backward s) of the same attention written with PyTorch's
    ``scaled_dot_product_attention`` as a user would, in the input dtype: for a window
    of w keys, chunks of ``chunk`` queries, each over the slab of keys its window
    reaches (``chunk + w - 1``) with the band as a boolean mask; for the causal case
    one call per sequence with ``is_causal``. Autograd through the whole output. Each
    path runs once untimed, then the better of two timed calls counts."""
    import torch
    import torch.nn.functional as F
    tq, tk, tv = (_torch_of(a) for a in (q, k, v))
    scale = kw["scale"]
    ends = kw["actual_seq_qlen"]
    starts = [0] + ends[:-1]

    def output(qq, kk, vv):
        outs = []
        for s0, s1 in zip(starts, ends):
            a4 = lambda t, lo, hi: t[lo:hi].transpose(0, 1)[None]       # noqa: E731
            if not window:
                outs.append(F.scaled_dot_product_attention(
                    a4(qq, s0, s1), a4(kk, s0, s1), a4(vv, s0, s1), is_causal=True,
                    scale=scale, enable_gqa=True))
                continue
            for a in range(s0, s1, chunk):
                b = min(s1, a + chunk)
                lo = max(s0, a - window + 1)
                i = torch.arange(a, b)[:, None]
                j = torch.arange(lo, b)[None, :]
                band = (j <= i) & (j > i - window)
                outs.append(F.scaled_dot_product_attention(
                    a4(qq, a, b), a4(kk, lo, b), a4(vv, lo, b), attn_mask=band, scale=scale,
                    enable_gqa=True))
        return torch.cat([o[0].transpose(0, 1) for o in outs])

    def forward():
        with torch.no_grad():
            output(tq, tk, tv)

    def both():
        qq, kk, vv = (t.detach().requires_grad_() for t in (tq, tk, tv))
        out = output(qq, kk, vv)
        out.backward(torch.ones_like(out))

    return _better_of_two(forward, both)


def _torch_of(a):
    import torch
    if a.dtype.kind == "V":                         # bfloat16
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def run_fusion_case(name, dtype, repeat, rate, use_torch, split=False):
    """One ``FUSION_CASES`` case: medians of ``repeat`` rounds of the forward and the
    gradient, outputs given; the workspace each announces; with ``split`` each launch
    alone."""
    lengths, N1, N2, D, Dv, window = FUSION_CASES[name]
    q, k, v, kw = fusion_problem(lengths, N1, N2, D, Dv, window, dtype)
    out = api.fusion_attention(q, k, v, N1, "TND", **kw)
    grad = np.random.default_rng(1).standard_normal(out[0].shape).astype(q.dtype)
    given = [np.empty_like(a) for a in (q, k, v)]
    outs = [np.empty_like(a) for a in out[:3]]
    gkw = dict(kw, scale_value=kw["scale"])
    del gkw["scale"]

    def forward():
        api.fusion_attention(q, k, v, N1, "TND", attention_out=outs[0], softmax_max=outs[1],
                             softmax_sum=outs[2], **kw)

    def backward():
        api.fusion_attention_grad(q, k, v, grad, N1, "TND", softmax_max=out[1],
                                  softmax_sum=out[2], attention_in=out[0], dq=given[0],
                                  dk=given[1], dv=given[2], **gkw)

    keys = fusion_visible(lengths, window) * N1
    flops = (2 * keys * (D + Dv), 2 * keys * (3 * D + 2 * Dv))
    common = (None, None, kw["atten_mask"], kw["scale"], 1.0, kw.get("pre_tockens", 0),
              kw.get("next_tockens", 0), 0, None, kw["actual_seq_qlen"],
              kw["actual_seq_kvlen"], kw["sparse_mode"], "")
    plans = (_pipeline.plan(FUSION_ATTENTION, _fusion.fusion_rules("bench"),
                            (q, k, v, N1, "TND", *common, *outs)),
             _pipeline.plan(FUSION_ATTENTION_GRAD, _fusion.fusion_rules("bench", grad=True),
                            (q, k, v, grad, N1, "TND", *common[:3], out[1], out[2], out[0],
                             *common[3:], *given)))
    result = _timed(dict(case=name, dtype=dtype, lengths=list(lengths), N1=N1, N2=N2, D=D,
                         Dv=Dv, window=window, forward_workspace=plans[0].workspace_bytes,
                         backward_workspace=plans[1].workspace_bytes),
                    forward, backward, flops, rate, repeat)
    if split:
        _dense_split(result, plans, "fusion_attention", flops[0], keys, D, Dv, repeat)
    if use_torch:
        _versus(result, *torch_window(q, k, v, kw, window))
    return result


def format_fusion(results):
    """The ``--fusion-attention`` table: ``format_select``'s columns, forward + backward
    against PyTorch, and each call's workspace."""
    table = format_select(results).splitlines()
    lines = [table[0] + f"{'x torch f+b':>12}{'ws MiB':>8}"]
    for r, line in zip(results, table[1:]):
        both = "-"
        if "torch_forward_s" in r:
            ours = r["forward_s"] + r["backward_s"]
            both = f"{(r['torch_forward_s'] + r['torch_backward_s']) / ours:.1f}"
        ws = max(r["forward_workspace"], r["backward_workspace"]) / 2 ** 20
        lines.append(line + f"{both:>12}{ws:8.1f}")
    return "\n".join(lines)
