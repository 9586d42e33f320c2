"""A training loop whose packed length changes every step, run in a child process by
tests/test_pool.py: prints a JSON line with the process's resident memory at the end
(VmRSS), its peak (VmHWM) and the largest output the loop allocated, in bytes.

    python tests/pool_loop.py numpy|torch|attention STEPS
"""

import json
import sys

import numpy as np

import nsa_numba


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise RuntimeError(f"no {field} in /proc/self/status")


def numpy_loop(lengths):
    """Forward and backward through the NumPy API, N = 4, D = 128, float32; each
    step's input gradient is held until the next step's backward has made its own (the
    largest output's bytes are returned with the last one)."""
    N, D = 4, 128
    w = np.full((32, N), 0.25, np.float32)
    held, largest = None, 0
    for T in lengths:
        x = np.full((T, N, D), 0.5, np.float32)
        out = nsa_numba.nsa_compress(x, w, 32, 16)
        dx, dw = nsa_numba.nsa_compress_grad(np.ones_like(out), x, w, 32, 16)
        largest = max(largest, dx.nbytes, out.nbytes)
        held = dx
    return largest, held


def torch_loop(lengths):
    """The same through torch autograd, N = 8, D = 128, bfloat16: the input gradient
    is allocated by the operator and kept as ``x.grad`` until the next step (the last
    one is returned)."""
    import torch

    from nsa_numba.torch import npu_nsa_compress

    N, D = 8, 128
    w = torch.full((32, N), 0.25, dtype=torch.bfloat16, requires_grad=True)
    held, largest = None, 0
    for T in lengths:
        x = torch.full((T, N, D), 0.5, dtype=torch.bfloat16, requires_grad=True)
        y = npu_nsa_compress(x, w, 32, 16)
        y.float().square().sum().backward()
        largest = max(largest, x.grad.numel() * 2, y.numel() * 2)
        held, w.grad = x.grad, None
    return largest, held


def attention_loop(lengths):
    """An NSA layer's three attention operators, forward and gradient, through the NumPy
    API, bfloat16, N1 = 16, N2 = 2, D = 192, Dv = 128: compressed attention (its top-k
    feeding selected attention) and the 64-key window; each step's query gradients are
    held until the next step's exist (the largest output's bytes are returned with the
    last ones)."""
    import ml_dtypes
    bf16, N1, N2, D, Dv, scale = np.dtype(ml_dtypes.bfloat16), 16, 2, 192, 128, 0.07
    rng = np.random.default_rng(1)
    triu = np.triu(np.ones((2048, 2048), bool), 1)
    held, largest = None, 0
    for T in lengths:
        Tc = (T - 32) // 16 + 1
        q = rng.standard_normal((T, N1, D), np.float32).astype(bf16)
        k, kc = (rng.standard_normal((n, N2, D), np.float32).astype(bf16) for n in (T, Tc))
        v, vc = (rng.standard_normal((n, N2, Dv), np.float32).astype(bf16) for n in (T, Tc))
        mask = np.arange(Tc)[None, :] * 16 + 31 > np.arange(T)[:, None]
        cmp = dict(atten_mask=mask, actual_seq_qlen=[T], actual_cmp_seq_kvlen=[Tc])
        out, topk, m, s = nsa_numba.nsa_compress_attention(
            q, kc, vc, scale, N1, 32, 16, 64, 2, actual_sel_seq_kvlen=[-(-Tc // 4)], **cmp)
        g = np.ones_like(out)
        grads = [nsa_numba.nsa_compress_attention_grad(g, q, kc, vc, out, m, s, scale, N1,
                                                       **cmp)[0]]
        sel = dict(atten_mask=triu, actual_seq_qlen=[T], actual_seq_kvlen=[T])
        out, m, s = nsa_numba.nsa_select_attention(q, k, v, topk, scale, N1, 64, 2, **sel)
        grads.append(nsa_numba.nsa_select_attention_grad(g, q, k, v, out, m, s, topk, scale,
                                                         N1, 64, 2, **sel)[0])
        win = dict(atten_mask=triu, sparse_mode=4, pre_tockens=63, next_tockens=0,
                   actual_seq_qlen=[T], actual_seq_kvlen=[T])
        out, m, s = nsa_numba.fusion_attention(q, k, v, N1, "TND", scale=scale, **win)[:3]
        grads.append(nsa_numba.fusion_attention_grad(
            q, k, v, g, N1, "TND", softmax_max=m, softmax_sum=s, attention_in=out,
            scale_value=scale, **win)[0])
        largest = max(largest, grads[0].nbytes, out.nbytes)
        held = grads
    return largest, held


LOOPS = {"numpy": (numpy_loop, 28000, 36000), "torch": (torch_loop, 14000, 18000),
         "attention": (attention_loop, 18, 68)}


def main():
    kind, steps = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(0)
    loop, low, high = LOOPS[kind]
    lengths = [int(t) for t in rng.integers(low, high + 1, size=steps)]
    if kind == "attention":             # whole blocks of 64 keys (1152 .. 4352 tokens)
        lengths = [64 * n for n in lengths]
    # measured with the last step's input gradient still held, as a training loop
    # holds its gradients
    largest, held = loop(lengths)
    used, kept, _ = nsa_numba._core.pool.stats()
    print(json.dumps(dict(rss=status_bytes("VmRSS"), peak=status_bytes("VmHWM"),
                          largest=largest, buffers=used, pooled=kept)))


if __name__ == "__main__":
    main()
