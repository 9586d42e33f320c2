"""Memory: no hidden full-size copies, and 64-bit offsets past 2**31 elements."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import nsa_numba
from nsa_numba import bench
from nsa_numba import reference as ref
from conftest import assert_forward_accurate, assert_grad_accurate

MiB = 1 << 20


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
def test_peak_memory_is_the_workspace_plus_a_few_mib():
    # bench.call_memory runs the calls in a fresh process and resets its peak RSS
    # (VmHWM) once the arrays exist and the kernels are loaded: the peak is the call's
    case = bench.Case(102400, 4, 128, 32, 16, 2, "fp16")      # two sequences, 100 MiB input
    assert case.T * case.N * case.D * 2 >= 100 * MiB
    result = bench.call_memory(case)
    for op in ("forward", "backward"):
        extra, workspace = result[op]["added"], result[op]["workspace"]
        assert extra <= workspace + 4 * MiB, (op, extra / MiB, workspace / MiB)


#: the child's setup: a problem's ``fwd`` and ``bwd`` calls and ``spaces``, each call's
#: workspace; MEASURE then reports what each adds to the peak RSS
PRELUDE = r"""
import json
import numpy as np
import nsa_numba
from nsa_numba._ops import pipeline as _pipeline
"""
MEASURE = r"""
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

fwd(), bwd()                                   # kernels loaded
result = {}
for op, call in (("forward", fwd), ("backward", bwd)):
    rss = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    call()
    result[op] = dict(added=status("VmHWM") - rss, workspace=spaces[op])
print(json.dumps(result))
"""

CMP_MEMORY = r"""
from nsa_numba._ops.compress_attention import compress_attention_rules
from nsa_numba._ops.operators import COMPRESS_ATTENTION, COMPRESS_ATTENTION_GRAD
# two sequences of 4096 tokens, 32 query heads over 2 KV heads, the paper's head dims
rng = np.random.default_rng(0)
lengths, N1, N2 = [4096, 4096], 32, 2
cmp = [(n - 32) // 16 + 1 for n in lengths]
q = rng.standard_normal((8192, N1, 192)).astype(np.float16)
k = rng.standard_normal((sum(cmp), N2, 192)).astype(np.float16)
v = rng.standard_normal((sum(cmp), N2, 128)).astype(np.float16)
mask = np.arange(max(cmp))[None, :] * 16 + 31 > np.arange(4096)[:, None]
seqs = dict(actual_seq_qlen=[4096, 8192], actual_cmp_seq_kvlen=np.cumsum(cmp).tolist())
sel = np.cumsum([-(-c // 4) for c in cmp]).tolist()
out = np.empty((8192, N1, 128), np.float16)
topk = np.empty((8192, N2, 16), np.int32)
smax, ssum = (np.empty((8192, N1, 8), np.float32) for _ in range(2))
g = np.ones_like(out)
dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
fwd = lambda: nsa_numba.nsa_compress_attention(
    q, k, v, 0.07, N1, 32, 16, 64, 16, atten_mask=mask, actual_sel_seq_kvlen=sel,
    attention_out=out, topk_indices=topk, softmax_max=smax, softmax_sum=ssum, **seqs)
bwd = lambda: nsa_numba.nsa_compress_attention_grad(
    g, q, k, v, out, smax, ssum, 0.07, N1, atten_mask=mask, dq=dq, dk=dk, dv=dv, **seqs)
rules = compress_attention_rules("x")
spaces = {
    "forward": _pipeline.plan(COMPRESS_ATTENTION, rules, (
        q, k, v, 0.07, N1, 32, 16, 64, 16, None, mask, seqs["actual_seq_qlen"],
        seqs["actual_cmp_seq_kvlen"], sel, out, topk, smax, ssum)).workspace_bytes,
    "backward": _pipeline.plan(COMPRESS_ATTENTION_GRAD, rules, (
        g, q, k, v, out, smax, ssum, 0.07, N1, mask, seqs["actual_seq_qlen"],
        seqs["actual_cmp_seq_kvlen"], dq, dk, dv)).workspace_bytes}
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
def test_compressed_attention_holds_no_weights_matrix():
    # the [T, N1, Tc] float32 weights of this problem would be 8192 * 32 * 255 * 4 bytes
    # (255 MiB); a call adds its workspace and a few MiB, forward and gradient alike
    _added_at_most_the_workspace(CMP_MEMORY, 16 * MiB)


WINDOW_MEMORY = r"""
from nsa_numba._ops.fusion import fusion_rules
from nsa_numba._ops.operators import FUSION_ATTENTION, FUSION_ATTENTION_GRAD
# the window branch: 8192 tokens, 32 query heads over 2 KV heads, a window of 512 keys
rng = np.random.default_rng(0)
T, N1, N2 = 8192, 32, 2
q = rng.standard_normal((T, N1, 192)).astype(np.float16)
k = rng.standard_normal((T, N2, 192)).astype(np.float16)
v = rng.standard_normal((T, N2, 128)).astype(np.float16)
triu = np.triu(np.ones((2048, 2048), bool), 1)
kw = dict(atten_mask=triu, sparse_mode=4, pre_tockens=511, next_tockens=0,
          actual_seq_qlen=[T], actual_seq_kvlen=[T])
out = np.empty((T, N1, 128), np.float16)
smax, ssum = (np.empty((T, N1, 8), np.float32) for _ in range(2))
g = np.ones_like(out)
dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
fwd = lambda: nsa_numba.fusion_attention(q, k, v, N1, "TND", scale=0.07, attention_out=out,
                                         softmax_max=smax, softmax_sum=ssum, **kw)
bwd = lambda: nsa_numba.fusion_attention_grad(q, k, v, g, N1, "TND", softmax_max=smax,
                                              softmax_sum=ssum, attention_in=out,
                                              scale_value=0.07, dq=dq, dk=dk, dv=dv, **kw)
common = (None, None, triu, 0.07, 1.0, 511, 0, 0, None, [T], [T], 4, "")
spaces = {
    "forward": _pipeline.plan(FUSION_ATTENTION, fusion_rules("x"), (
        q, k, v, N1, "TND", *common, out, smax, ssum)).workspace_bytes,
    "backward": _pipeline.plan(FUSION_ATTENTION_GRAD, fusion_rules("x", grad=True), (
        q, k, v, g, N1, "TND", *common[:3], smax, ssum, out, *common[3:], dq, dk,
        dv)).workspace_bytes}
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
def test_the_window_branch_holds_no_weights_matrix():
    # the [T, N1, w] float32 weights would be 8192 * 32 * 512 * 4 bytes (512 MiB); a call
    # adds its workspace (the keys staged as float32, 2 x 8192 x 320 x 4 bytes for the
    # forward) and a few MiB
    _added_at_most_the_workspace(WINDOW_MEMORY, 48 * MiB)


MANY_SEQUENCES = r"""
from nsa_numba._ops.fusion import fusion_rules
from nsa_numba._ops.operators import FUSION_ATTENTION, FUSION_ATTENTION_GRAD
# 200,000 one-token sequences (BSND, S = 1); the staged keys alone would take 64 keys
# of float32 per sequence, 3.3 GB for the gradient, if the call ran them all at once
B = 200_000
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((B, 1, 2, 16)).astype(np.float16) for _ in range(3))
out = np.empty_like(q)
smax, ssum = (np.empty((B, 2, 1, 8), np.float32) for _ in range(2))
g = np.ones_like(out)
dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
fwd = lambda: nsa_numba.fusion_attention(q, k, v, 2, "BSND", attention_out=out,
                                         softmax_max=smax, softmax_sum=ssum)
bwd = lambda: nsa_numba.fusion_attention_grad(q, k, v, g, 2, "BSND", softmax_max=smax,
                                              softmax_sum=ssum, attention_in=out, dq=dq,
                                              dk=dk, dv=dv)
common = (None, None, None, 1.0, 1.0, 2 ** 31 - 1, 2 ** 31 - 1, 0, None, None, None, 0, "")
spaces = {
    "forward": _pipeline.plan(FUSION_ATTENTION, fusion_rules("x"), (
        q, k, v, 2, "BSND", *common, out, smax, ssum)).workspace_bytes,
    "backward": _pipeline.plan(FUSION_ATTENTION_GRAD, fusion_rules("x", grad=True), (
        q, k, v, g, 2, "BSND", *common[:3], smax, ssum, out, *common[3:], dq, dk,
        dv)).workspace_bytes}
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
def test_many_short_sequences_run_in_bounded_memory():
    # the call runs in parts of whole sequences whose staged keys take at most
    # _dense.PART_BYTES; the plan's tables take about 100 bytes a sequence
    from nsa_numba._ops.dense import PART_BYTES
    _added_at_most_the_workspace(MANY_SEQUENCES, PART_BYTES + MiB, slack=200 * 200_000)


def _added_at_most_the_workspace(script, most, slack=4 * MiB):
    """Run ``script`` in a child (PRELUDE, it, MEASURE): each call's workspace is under
    ``most`` and the call adds at most that workspace and ``slack`` to the peak RSS."""
    child = subprocess.run([sys.executable, "-c", PRELUDE + script + MEASURE],
                           capture_output=True, text=True, timeout=900, check=True)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    for op in ("forward", "backward"):
        extra, workspace = result[op]["added"], result[op]["workspace"]
        assert workspace < most, (op, workspace / MiB)
        assert extra <= workspace + slack, (op, extra / MiB, workspace / MiB)


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
