"""The output pool (``_core.pool``): an allocated output comes back only once nothing
refers to it, with results as exact as a fresh one's."""

import json
import os
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from conftest import assert_forward_accurate, assert_grad_accurate, random_problem
from nsa_numba._ops import pipeline as _pipeline
from nsa_numba._core import pool as _pool
from test_layouts import to_layout

HERE = os.path.dirname(os.path.abspath(__file__))

L, S = 32, 16
# an input gradient of 8 MiB: over _pool.MIN_BYTES
T, N, D = 8192, 4, 64
SEQ = [3000, 3001, 8192]      # tails no window covers (their gradient rows are zero)


def problem(dtype=np.float32, seed=0):
    return random_problem(T, N, D, L, S, SEQ, dtype, seed=seed)


def address(a):
    return a.__array_interface__["data"][0]


def test_the_input_gradient_is_large_enough_to_keep():
    x, w, g = problem()
    assert x.nbytes >= _pool.MIN_BYTES > g.nbytes


def test_a_dropped_output_is_handed_out_again_with_exact_results(kept):
    x, w, g = problem()
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    first = address(dx)
    dx[...] = np.nan                        # what the next call finds there
    del dx
    x2, w2, g2 = problem(seed=1)
    dx2, dw2 = nsa_numba.nsa_compress_grad(g2, x2, w2, L, S, actual_seq_len=SEQ)
    assert address(dx2) == first
    assert_grad_accurate(dx2, dw2, g2, x2, w2, L, S, SEQ)
    assert _pool.stats()[:2] == (1, dx2.nbytes)


@pytest.mark.parametrize("hold", ["array", "view", "memoryview", "strided_view"])
def test_an_output_still_referred_to_is_not_handed_out(kept, hold):
    x, w, g = problem()
    dx, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    before = dx.copy()
    holder = {"array": lambda a: a, "view": lambda a: a[100:],
              "memoryview": memoryview, "strided_view": lambda a: a.view()[::2]}[hold](dx)
    first = address(dx)
    del dx
    x2, w2, g2 = problem(seed=1)
    dx2, _ = nsa_numba.nsa_compress_grad(g2, x2, w2, L, S, actual_seq_len=SEQ)
    assert address(dx2) != first
    held = np.asarray(holder)
    assert np.array_equal(held, {"array": before, "view": before[100:], "memoryview": before,
                                 "strided_view": before[::2]}[hold], equal_nan=True)
    assert _pool.stats()[0] == 2


def test_the_caller_gets_a_view_whose_flags_do_not_reach_the_buffer(kept):
    x, w, g = problem()
    dx, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    assert dx.base is not None and dx.flags.owndata is False
    dx.flags.writeable = False
    dx.shape = (T * N, D)
    first = address(dx)
    del dx
    dx2, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    assert address(dx2) == first
    assert dx2.flags.writeable and dx2.shape == (T, N, D)


def test_outputs_from_nan_filled_buffers_are_exact_in_every_layout(kept, monkeypatch):
    # every output kept, however small; each call's outputs are filled with NaN and
    # dropped, and the next call must get the same memory and the same bits as a
    # call into fresh outputs: TND with short sequences, one shorter than a window,
    # non-strict d > l (tokens between windows), and the four padded layouts
    monkeypatch.setattr(_pool, "MIN_BYTES", 0)
    rng = np.random.default_rng(3)
    problems = []
    for kw, seq, block, stride in [(dict(), [40, 41, 300], L, S),
                                   (dict(strict=False), [10, 40, 300], 20, 24)]:
        x, w, g = random_problem(300, 2, 16, block, stride, seq, ml_dtypes.bfloat16, seed=4)
        problems.append((x, w, g, block, stride, dict(actual_seq_len=seq, **kw)))
    for layout in ("BSND", "BNSD", "BSH", "SBH"):
        x4 = rng.standard_normal((3, 64, 2, 16)).astype(np.float16)       # B, S, N, D
        w = rng.standard_normal((L, 2)).astype(np.float16)
        g4 = rng.standard_normal((3, 3, 2, 16)).astype(np.float16)        # 3 windows a row
        problems.append((to_layout(x4, layout), w, to_layout(g4, layout), L, S,
                         dict(layout=layout)))
    for x, w, g, block, stride, kw in problems:
        fresh = [nsa_numba.nsa_compress(x, w, block, stride, out=np.empty_like(
                     nsa_numba.nsa_compress(x, w, block, stride, **kw)), **kw),
                 *nsa_numba.nsa_compress_grad(g, x, w, block, stride,
                                              input_grad=np.empty_like(x),
                                              weight_grad=np.empty_like(w), **kw)]
        addresses = []
        for _ in range(3):
            got = [nsa_numba.nsa_compress(x, w, block, stride, **kw),
                   *nsa_numba.nsa_compress_grad(g, x, w, block, stride, **kw)]
            for a, b in zip(got, fresh):
                assert a.shape == b.shape and np.array_equal(a.view(np.uint16),
                                                             b.view(np.uint16))
            addresses.append([address(a) for a in got])
            for a in got:
                a[...] = np.nan
            del got, a
        assert addresses[0] == addresses[1] == addresses[2], kw
        if "actual_seq_len" in kw:     # and the values are right
            assert_forward_accurate(fresh[0], x, w, block, stride, kw["actual_seq_len"])
            assert_grad_accurate(fresh[1], fresh[2], g, x, w, block, stride,
                                 kw["actual_seq_len"])


def test_small_outputs_are_not_pooled(kept):
    x, w, g = random_problem(300, 2, 16, L, S, [100, 300], np.float32)
    nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=[100, 300])
    assert _pool.stats() == (0, 0, 0)


def test_the_budget_bounds_what_is_pooled(kept):
    x, w, g = problem()
    size = x.nbytes
    assert _pool.keep_outputs(size) == 1 << 30
    held = [nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)[0]
            for _ in range(3)]
    # one pooled (in use), two allocated beyond the budget
    assert _pool.stats() == (1, size, size)
    first = address(held[0])
    del held
    assert _pool.stats() == (1, size, 0)
    # a smaller output of another shape takes the free buffer
    x2, w2, g2 = random_problem(T, N, D // 2, L, S, SEQ, np.float32)
    dx2, _ = nsa_numba.nsa_compress_grad(g2, x2, w2, L, S, actual_seq_len=SEQ)
    assert address(dx2) == first and _pool.stats() == (1, size, size)
    # one larger than the budget is allocated, and nothing goes for it
    x3, w3, g3 = random_problem(T, N, 2 * D, L, S, SEQ, np.float32)
    dx3, _ = nsa_numba.nsa_compress_grad(g3, x3, w3, L, S, actual_seq_len=SEQ)
    assert dx3.flags.owndata and _pool.stats() == (1, size, size)
    # no budget: the one in use is forgotten, and stays its caller's
    assert _pool.keep_outputs(0) == size
    assert _pool.stats() == (0, 0, 0)
    dx, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    assert dx.flags.owndata and _pool.stats() == (0, 0, 0)
    assert _pool.keep_outputs() == 0


def test_a_free_buffer_serves_any_output_that_fits(kept):
    # the pool is about bytes: a float32 input gradient's buffer serves a bfloat16
    # one of twice the tokens, then a float64 forward output of another layout
    x, w, g = problem()
    dx, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    first, size = address(dx), dx.nbytes
    del dx
    seq2 = [3000, 16384]
    x2, w2, g2 = random_problem(2 * T, N, D, L, S, seq2, ml_dtypes.bfloat16, seed=2)
    dx2, dw2 = nsa_numba.nsa_compress_grad(g2, x2, w2, L, S, actual_seq_len=seq2)
    assert address(dx2) == first and dx2.nbytes == size
    assert_grad_accurate(dx2, dw2, g2, x2, w2, L, S, seq2)
    del dx2
    rng = np.random.default_rng(5)
    x3 = rng.random((4, 16, 4096, 64))                    # BNSD, float64
    w3 = rng.random((L, 16))
    out = nsa_numba.nsa_compress(x3, w3, L, S, layout="BNSD")     # 7.97 MiB
    assert address(out) == first and out.shape == (4, 16, 255, 64)
    fresh = nsa_numba.nsa_compress(x3, w3, L, S, layout="BNSD", out=np.empty_like(out))
    assert np.array_equal(out, fresh)
    assert _pool.stats() == (1, size, size)


def test_the_smallest_free_buffer_that_fits_is_taken(kept, monkeypatch):
    monkeypatch.setattr(_pool, "MIN_BYTES", 1 << 20)
    big = _pool.empty((4 << 20,), np.uint8)
    small = _pool.empty((2 << 20,), np.uint8)
    addresses = address(big), address(small)
    del big, small
    a = _pool.empty((1 << 20,), np.float32)           # 4 MiB: only the big one fits
    b = _pool.empty((1 << 20,), np.uint16)            # 2 MiB: the small one is smallest
    assert (address(a), address(b)) == addresses
    assert _pool.stats() == (2, 6 << 20, 6 << 20)


def test_a_buffer_too_small_for_any_request_is_let_go(kept, monkeypatch):
    # a loop whose outputs grow: each new buffer replaces the free smaller ones
    monkeypatch.setattr(_pool, "MIN_BYTES", 1 << 20)
    held = _pool.empty((3 << 20,), np.uint8)
    for megabytes in (1, 2, 4, 8):
        a = _pool.empty((megabytes << 20,), np.uint8)
        del a
        assert _pool.stats() == (2, (3 + megabytes) << 20, 3 << 20)
    # a smaller one reuses what is free, and the buffer in use stays
    a = _pool.empty((5 << 20,), np.uint8)
    assert _pool.stats() == (2, 11 << 20, 11 << 20)
    del a, held


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("kind,steps", [("numpy", 30), ("torch", 30), ("attention", 8)])
def test_a_loop_whose_length_changes_every_step_holds_at_most_two_outputs_more(kind, steps):
    # the packed length T changes every step (28000..36000 tokens through NumPy,
    # 14000..18000 through torch autograd, 1152..4352 through the three attention
    # operators' forwards and gradients, six pooled outputs a step); each step's
    # gradients are held until the next ones exist, and the last are held at the end.
    # The pool holds at most two of the largest outputs, and against the same loop
    # with every output fresh the process at most that much more, at the end and at
    # the peak.
    if kind == "torch":
        pytest.importorskip("torch")
    runs = {}
    # a short run first, so that neither measured process compiles (LLVM's memory would
    # count in the one that does, on a cold cache)
    warm = subprocess.run([sys.executable, os.path.join(HERE, "pool_loop.py"), kind, "2"],
                          env=dict(os.environ, NSA_NUMBA_QUIET="1"), capture_output=True,
                          text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr
    for budget in ("1024", "0"):
        env = dict(os.environ, NSA_NUMBA_KEEP_OUTPUTS_MB=budget, NSA_NUMBA_QUIET="1")
        run = subprocess.run([sys.executable, os.path.join(HERE, "pool_loop.py"), kind,
                              str(steps)],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        runs[budget] = json.loads(run.stdout.strip().splitlines()[-1])
    pooled, fresh = runs["1024"], runs["0"]
    largest = pooled["largest"]
    assert fresh["buffers"] == 0 and pooled["buffers"] >= 1
    assert pooled["pooled"] <= 2 * largest, pooled
    slack = 16 << 20         # what two processes' unrelated memory differs by
    assert pooled["rss"] - fresh["rss"] <= 2 * largest + slack, (pooled, fresh)
    assert pooled["peak"] - fresh["peak"] <= 2 * largest + slack, (pooled, fresh)


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_a_bad_budget_is_refused(kept, bad):
    with pytest.raises(ValueError, match=r"keep_outputs: max_bytes must be an int >= 0, "
                                         rf"got {bad!r}"):
        _pool.keep_outputs(bad)
    assert _pool.keep_outputs() == 1 << 30


def test_a_bad_budget_in_the_environment_is_refused_at_import():
    env = dict(os.environ, NSA_NUMBA_KEEP_OUTPUTS_MB="lots")
    run = subprocess.run([sys.executable, "-c", "import nsa_numba"], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "NSA_NUMBA_KEEP_OUTPUTS_MB must be a whole number of MiB" in run.stderr
    assert "'lots'" in run.stderr
    env["NSA_NUMBA_KEEP_OUTPUTS_MB"] = "0"
    run = subprocess.run([sys.executable, "-c", "import nsa_numba; "
                          "print(nsa_numba.keep_outputs())"], env=env,
                         capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "0"


def test_threads_calling_at_once_get_distinct_buffers(kept):
    x, w, g = problem()
    expected, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    expected = expected.copy()
    results = [None] * 4
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        got = []
        for _ in range(3):
            got.append(nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)[0])
        results[i] = got

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    arrays = [a for got in results for a in got]
    assert len({address(a) for a in arrays}) == len(arrays)
    for a in arrays:
        assert np.array_equal(a, expected)


def test_release_lets_go_of_unused_buffers_and_forgets_used_ones(kept):
    x, w, g = problem()
    in_use, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    copy = in_use.copy()
    _pool.release_outputs()
    assert _pool.stats() == (0, 0, 0)
    again, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    assert address(again) != address(in_use)
    assert np.array_equal(in_use, copy)


def test_prepared_calls_and_full_calls_share_the_buffers(kept):
    # the first call goes the full path (planned), the next ones the fast path
    _pipeline.forget()
    x, w, g = problem()
    addresses = set()
    for _ in range(3):
        dx, _ = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
        addresses.add(address(dx))
        del dx
    assert len(addresses) == 1
