"""Memory: no hidden full-size copies, and 64-bit offsets past 2**31 elements."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import nsa_numba
from nsa_numba import reference as ref
from conftest import assert_forward_accurate, assert_grad_accurate

MiB = 1 << 20

# Run in a fresh process: peak RSS (VmHWM) is reset through /proc/self/clear_refs
# after the arrays exist and the kernels are compiled, so the peak seen is the call's.
PEAK_SCRIPT = r"""
import json, sys
import numpy as np
import nsa_numba
from nsa_numba import aclnn

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

T, N, D, L, S = 102400, 4, 128, 32, 16
seq = [T // 2, T]
rng = np.random.default_rng(0)
x = rng.standard_normal((T, N, D), dtype=np.float32).astype(np.float16)
w = rng.standard_normal((L, N), dtype=np.float32).astype(np.float16)
Tp = 2 * ((T // 2 - L) // S + 1)
g = rng.standard_normal((Tp, N, D), dtype=np.float32).astype(np.float16)
# outputs filled (not np.zeros, whose pages would first be touched by the call)
out, dx, dw = np.ones((Tp, N, D), np.float16), np.ones_like(x), np.ones_like(w)
small = dict(actual_seq_len=[64, 128])
nsa_numba.nsa_compress(x[:128], w, L, S, **small)               # compile (or load) first
nsa_numba.nsa_compress_grad(g[:6], x[:128], w, L, S, **small)
_, fw_ws, _ = aclnn.aclnnNsaCompressGetWorkspaceSize(x, w, seq, "TND", L, S, 0, out)
_, bw_ws, _ = aclnn.aclnnNsaCompressGradGetWorkspaceSize(g, x, w, seq, L, S, 0, "TND", dx, dw)
result = {"input_bytes": x.nbytes}
rss = status("VmRSS"); reset_peak()
nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=seq, out=out)
result["forward"] = (status("VmHWM") - rss, fw_ws)
rss = status("VmRSS"); reset_peak()
nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=seq, input_grad=dx, weight_grad=dw)
result["backward"] = (status("VmHWM") - rss, bw_ws)
print(json.dumps(result))
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
def test_peak_memory_is_the_workspace_plus_a_few_mib():
    child = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True,
                           text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["input_bytes"] >= 100 * MiB
    for op in ("forward", "backward"):
        extra, workspace = result[op]
        assert extra <= workspace + 4 * MiB, (op, extra / MiB, workspace / MiB)


@pytest.mark.slow
def test_offsets_past_two_to_the_31_elements():
    # N * D = 128 elements per token: T tokens make 2**31 + 128 * 4096 elements (4 GiB
    # of float16). np.zeros pages cost nothing until written; the last sequence (the
    # one checked) starts beyond element 2**31.
    N, D, L, S = 1, 128, 32, 16
    tail = 4096
    T = 2 ** 31 // (N * D) + tail
    x = np.zeros((T, N, D), np.float16)
    assert x.size > 2 ** 31
    rng = np.random.default_rng(5)
    x[T - tail:] = rng.standard_normal((tail, N, D)).astype(np.float16)
    w = rng.standard_normal((L, N)).astype(np.float16)
    seq = [T - tail, T]
    head_windows = (T - tail - L) // S + 1
    out = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=seq)
    far = out[head_windows:]
    assert far.shape[0] == (tail - L) // S + 1
    assert_forward_accurate(far, x[T - tail:], w, L, S, None)
    assert not out[:head_windows].any()
    del out

    g = np.zeros((head_windows + far.shape[0], N, D), np.float16)
    g[head_windows:] = rng.standard_normal(far.shape).astype(np.float16)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=seq)
    assert_grad_accurate(dx[T - tail:], dw, g[head_windows:], x[T - tail:], w, L, S, None)
    assert not dx[:T - tail].any()
    assert ref.window_starts(tail, L, S).size == far.shape[0]
