"""Bitwise-identical results for any thread count, repeated calls and concurrent callers."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

import nsa_numba
from conftest import DTYPE_IDS, DTYPES, random_problem

# several sequences, several tiles per sequence, tokens covered by 1 to 4 windows
PROBLEM = dict(T=6000, N=3, D=64, block=64, stride=16, seq=[0, 1000, 1001, 4000, 6000])

SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np, ml_dtypes, numba
    import nsa_numba
    sys.path.insert(0, {tests!r})
    from conftest import random_problem
    p = json.loads({problem!r})
    out = {{}}
    for name in {dtypes!r}:
        dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
        x, w, g = random_problem(p["T"], p["N"], p["D"], p["block"], p["stride"], p["seq"], dtype)
        y = nsa_numba.nsa_compress(x, w, p["block"], p["stride"], actual_seq_len=p["seq"])
        dx, dw = nsa_numba.nsa_compress_grad(g, x, w, p["block"], p["stride"],
                                             actual_seq_len=p["seq"])
        out[name] = [hashlib.sha256(a.tobytes()).hexdigest() for a in (y, dx, dw)]
    from nsa_numba._core import launch as _launch
    out["threads"] = _launch.count()
    out["helpers"] = _launch.helpers_started()
    print(json.dumps(out))
""")


def _digests(x, w, g):
    p = PROBLEM
    y = nsa_numba.nsa_compress(x, w, p["block"], p["stride"], actual_seq_len=p["seq"])
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, p["block"], p["stride"],
                                         actual_seq_len=p["seq"])
    return [hashlib.sha256(a.tobytes()).hexdigest() for a in (y, dx, dw)]


def run_in_subprocess(env_extra, dtypes=DTYPE_IDS):
    env = dict(os.environ, **env_extra)
    code = SCRIPT.format(tests=os.path.dirname(__file__), problem=json.dumps(PROBLEM),
                         dtypes=list(dtypes))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_same_bits_for_every_thread_count():
    here = {}
    for dtype, name in zip(DTYPES, DTYPE_IDS):
        here[name] = _digests(*random_problem(**{k: v for k, v in PROBLEM.items()},
                                              dtype=dtype))
    for threads in (1, 2, 3, 8):
        got = run_in_subprocess({"NUMBA_NUM_THREADS": str(threads)})
        assert got["threads"] == threads
        assert got["helpers"] == threads - 1        # every thread was there to take units
        for name in DTYPE_IDS:
            assert got[name] == here[name], (name, threads)


def test_threads_caps_the_calls_in_its_block(monkeypatch):
    import numba

    from nsa_numba._core import launch as _launch
    seen = []                   # the threads each launch could use
    real_run = _launch.run

    def recording_run(kernel, threads, chunk, *args, **options):
        seen.append(_launch.count() if threads is None else min(threads, _launch.count()))
        return real_run(kernel, threads, chunk, *args, **options)

    monkeypatch.setattr(_launch, "run", recording_run)
    data = random_problem(**PROBLEM, dtype=DTYPES[0])
    pool = numba.config.NUMBA_NUM_THREADS
    before = _launch.count()
    with nsa_numba.threads(1):
        capped = _digests(*data)
        with nsa_numba.threads(pool):
            assert _launch.count() == pool
        assert _launch.count() == 1
    assert _launch.count() == before
    assert seen == [1, 1]                     # the forward and backward launches
    assert capped == _digests(*data)
    for bad in (0, -1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="threads: n must be an integer >= 1"):
            nsa_numba.threads(bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_repeated_calls_give_same_bits(dtype):
    data = random_problem(**PROBLEM, dtype=dtype)
    first = _digests(*data)
    for _ in range(3):
        assert _digests(*data) == first


def test_concurrent_python_threads():
    problems = [random_problem(**PROBLEM, dtype=dtype, seed=s)
                for s, dtype in enumerate(DTYPES * 2)]
    expected = [_digests(*p) for p in problems]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(3):
            got = list(pool.map(lambda p: _digests(*p), problems))
            assert got == expected


FORK_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import nsa_numba
    x = np.random.default_rng(0).standard_normal((512, 4, 32)).astype(np.float32)
    w = np.ones((32, 4), np.float32)
    parent = nsa_numba.nsa_compress(x, w, 32, 16)      # the thread pool is now running
    pid = os.fork()
    if pid == 0:
        child = nsa_numba.nsa_compress(x, w, 32, 16)
        dx, dw = nsa_numba.nsa_compress_grad(child, x, w, 32, 16)
        os._exit(0 if np.array_equal(child, parent) else 3)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status))
""")


# the planner keeps the tables of recent calls under a lock (_ops.compress._tables)
FORK_WHILE_KEEPING = textwrap.dedent("""
    import os, signal
    import numpy as np
    import nsa_numba
    from nsa_numba._ops import compress as _compress
    x = np.ones((64, 1, 16), np.float32)
    w = np.ones((32, 1), np.float32)
    nsa_numba.nsa_compress(x, w, 32, 16)
    _compress._table_cache._lock.acquire()     # as if another thread were keeping tables
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)              # a child stuck on the lock ends, and the test fails
        out = nsa_numba.nsa_compress(x, w, 32, 16, actual_seq_len=[20, 64])
        os._exit(0 if out.shape == (1, 1, 16) else 3)
    _compress._table_cache._lock.release()
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status))
""")


# the prepared calls are kept under a lock too (_pipeline)
FORK_WHILE_KEEPING_RECIPES = FORK_WHILE_KEEPING.replace(
    "from nsa_numba._ops import compress as _compress",
    "from nsa_numba._ops import pipeline as _pipeline").replace(
    "_compress._table_cache._lock", "_pipeline._prepared._lock")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
@pytest.mark.parametrize("script", [FORK_SCRIPT, FORK_WHILE_KEEPING,
                                    FORK_WHILE_KEEPING_RECIPES],
                         ids=["after-a-call", "while-the-tables-lock-is-held",
                              "while-the-prepared-calls-lock-is-held"])
def test_forked_child_can_run_the_kernels(script):
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0", proc.stdout + proc.stderr
