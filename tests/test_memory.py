"""Memory: no hidden full-size copies, and 64-bit offsets past 2**31 elements."""

import os

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
