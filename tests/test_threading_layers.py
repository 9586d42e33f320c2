"""Without a usable tbb (aarch64 Linux and macOS have no tbb wheel) the library still
keeps its promises: calls from several Python threads at once, and calls in a process
forked after a call. Each test runs a child Python in which libtbb cannot be loaded, so
the x86-64 CI checks the path those platforms take."""

import os
import subprocess
import sys
import textwrap

import pytest

# what a platform without tbb looks like to the library and to Numba: libtbb does not
# load, and Numba's tbb pool does not import
WITHOUT_TBB = textwrap.dedent("""
    import ctypes, importlib.abc, sys

    class _NoTbbPool(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "numba.np.ufunc.tbbpool":
                raise ImportError("no tbb on this platform (test)")
            return None

    sys.meta_path.insert(0, _NoTbbPool())
    _CDLL = ctypes.CDLL

    class _NoTbbCDLL(_CDLL):
        def __init__(self, name, *args, **kwargs):
            if name and "tbb" in str(name):
                raise OSError(f"{name}: no tbb on this platform (test)")
            super().__init__(name, *args, **kwargs)

    ctypes.CDLL = _NoTbbCDLL
""")

CALLS = textwrap.dedent("""
    import os, signal, threading
    import numpy as np
    import numba
    import nsa_numba
    from nsa_numba import _threading

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 4, 64)).astype(np.float16)     # work for two threads
    w = rng.standard_normal((32, 4)).astype(np.float16)
    seq = [0, 2000, 4096]
    out = nsa_numba.nsa_compress(x, w, 32, 16, actual_seq_len=seq)
    g = np.ones_like(out)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=seq)
    print("layer", _threading.layer(), "|", _threading.reason)

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
        again = nsa_numba.nsa_compress(x, w, 32, 16, actual_seq_len=seq)
        os._exit(0 if np.array_equal(again.view(np.uint16), out.view(np.uint16)) else 3)
    _, status = os.waitpid(pid, 0)
    print("fork", os.waitstatus_to_exitcode(status))
""")


def run_child(code, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    env.update(NSA_NUMBA_QUIET="1", NUMBA_NUM_THREADS="2", **env_extra)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_without_tbb_threads_and_fork_keep_working():
    lines = run_child(WITHOUT_TBB + CALLS)
    assert lines[0].startswith("layer workqueue | no usable tbb library"), lines
    assert lines[1] == "threads 40 True []", lines
    assert lines[2] == "fork 0", lines             # GNU OpenMP would kill the child


def test_the_users_choice_of_layer_is_kept():
    lines = run_child(WITHOUT_TBB + "import numpy as np, nsa_numba\n"
                      "from nsa_numba import _threading\n"
                      "nsa_numba.nsa_compress(np.ones((4096, 4, 64), np.float32), "
                      "np.ones((32, 4), np.float32), 32, 16)\n"
                      "print(_threading.layer(), '|', _threading.reason)\n",
                      NUMBA_THREADING_LAYER="workqueue")
    assert lines == ["workqueue | chosen by NUMBA_THREADING_LAYER"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_with_tbb_the_same_calls_pass():
    lines = run_child(CALLS)
    assert lines[0].split()[1] in ("tbb", "workqueue"), lines
    assert lines[1:] == ["threads 40 True []", "fork 0"], lines
