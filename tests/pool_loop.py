"""A training loop whose packed length changes every step, run in a child process by
tests/test_pool.py: prints a JSON line with the process's resident memory at the end
(VmRSS), its peak (VmHWM) and the largest output the loop allocated, in bytes.

    python tests/pool_loop.py numpy|torch STEPS
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


def main():
    kind, steps = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(0)
    low, high = (28000, 36000) if kind == "numpy" else (14000, 18000)
    lengths = [int(t) for t in rng.integers(low, high + 1, size=steps)]
    # measured with the last step's input gradient still held, as a training loop
    # holds its gradients
    largest, held = (numpy_loop if kind == "numpy" else torch_loop)(lengths)
    used, kept, _ = nsa_numba._pool.stats()
    print(json.dumps(dict(rss=status_bytes("VmRSS"), peak=status_bytes("VmHWM"),
                          largest=largest, buffers=used, pooled=kept)))


if __name__ == "__main__":
    main()
