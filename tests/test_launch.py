"""The launcher (``_core.launch``): kernels run on the calling thread and helper threads of
the library's own, with no Numba threading layer. Calls from several Python threads at
once, and calls in a process forked after a call (a data-loader worker), keep their
results; every unit is computed once; an error on a helper reaches the caller."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from nsa_numba._core import launch as _launch
from nsa_numba._core.jit import jit

CALLS = textwrap.dedent("""
    import os, signal, threading
    import numpy as np
    import numba
    import nsa_numba
    from nsa_numba._core import launch as _launch
    from numba.np.ufunc import parallel

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 4, 64)).astype(np.float16)     # work for two threads
    w = rng.standard_normal((32, 4)).astype(np.float16)
    seq = [0, 2000, 4096]
    out = nsa_numba.nsa_compress(x, w, 32, 16, actual_seq_len=seq)
    g = np.ones_like(out)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=seq)
    print("helpers", _launch.helpers_started(), "numba layer started", parallel._is_initialized)

    # several Python threads at once, each calling again and again
    results, errors = [], []
    def work():
        try:
            for _ in range(10):
                results.append(nsa_numba.nsa_compress_grad(g, x, w, 32, 16,
                                                           actual_seq_len=seq))
        except Exception as err:           # reported below
            errors.append(err)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = all(np.array_equal(a.view(np.uint16), dx.view(np.uint16))
               and np.array_equal(b.view(np.uint16), dw.view(np.uint16)) for a, b in results)
    print("threads", len(results), same, errors)

    # a process forked after the calls (a data-loader worker) calls again
    pid = os.fork()
    if pid == 0:
        signal.alarm(120)
        before = _launch.helpers_started()
        again = nsa_numba.nsa_compress(x, w, 32, 16, actual_seq_len=seq)
        same = np.array_equal(again.view(np.uint16), out.view(np.uint16))
        os._exit(3 if not same else 4 if (before, _launch.helpers_started()) != (0, 1) else 0)
    _, status = os.waitpid(pid, 0)
    print("fork", os.waitstatus_to_exitcode(status))
""")

def run_child(code, **env_extra):
    env = dict(os.environ, NSA_NUMBA_QUIET="1", NUMBA_NUM_THREADS="2", **env_extra)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_threads_and_fork_keep_working_without_a_numba_threading_layer():
    lines = run_child(CALLS)
    assert lines == ["helpers 1 numba layer started False", "threads 40 True []",
                     "fork 0"], lines


@jit
def _count_units(work, slot, hits, slots, spin):
    unit, end = _launch.claim(work, hits.size)
    while unit < end:
        x = 0.0
        for i in range(spin):               # a unit's worth of work
            x += i * 1e-9
        hits[unit] += 1
        slots[unit] = slot if x >= 0 else -1
        unit, end = _launch.next_unit(work, unit, end, hits.size)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_every_unit_is_computed_once_by_a_thread_of_the_launch(chunk):
    n = _launch.ceiling()
    hits = np.zeros(1000, np.int64)
    slots = np.full(1000, -1, np.int64)
    with _launch.threads(n):
        _launch.run(_count_units, n, chunk, hits, slots, 20000)
    assert (hits == 1).all()
    assert set(np.unique(slots)) <= set(range(n))


def test_concurrent_launches_from_python_threads_share_the_helpers():
    results = []

    def launch():
        hits = np.zeros(500, np.int64)
        slots = np.zeros(500, np.int64)
        for _ in range(20):
            hits[:] = 0
            _launch.run(_count_units, None, 1, hits, slots, 2000)
            results.append(bool((hits == 1).all()))

    callers = [threading.Thread(target=launch) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert results == [True] * 80
    assert _launch.helpers_started() <= _launch.ceiling() - 1


def test_an_error_on_a_helper_reaches_the_caller():
    if _launch.ceiling() < 2:
        pytest.skip("NUMBA_NUM_THREADS = 1: no helper")
    started = threading.Event()

    def kernel(work, slot, seen):
        seen.append(slot)
        if slot == 0:
            started.wait(10)        # the helper joins before the caller finishes
            return "caller"
        started.set()
        raise RuntimeError("a helper failed")

    for _ in range(1000):           # the helpers back from the tests before
        if len(_launch._idle) == _launch.helpers_started():
            break
        time.sleep(0.01)
    seen = []
    with _launch.threads(2), pytest.raises(RuntimeError, match="a helper failed"):
        _launch.run(kernel, 2, 1, seen)
    assert sorted(seen) == [0, 1]
    assert _launch.run(lambda work, slot: slot, 1, 1) == 0        # one thread: the caller


def test_threads_refuses_what_is_not_a_count():
    for bad in (0, -1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="threads: n must be an integer >= 1"):
            _launch.threads(bad)
