import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from nsa_numba._core import pool as _pool
from nsa_numba import reference as ref
from nsa_numba._core.jit import BOUNDSCHECK


#: the two halves of the kernels compiled side by side, of about equal compile time:
#: two dtypes each (attention is most of a dtype's compile)
WARMUP_PARTS = ('("bf16", "fp16")', '("fp32", "fp64")')


def pytest_configure(config):
    """Before pytest-xdist starts its workers, compile the kernels into the disk cache
    (``nsa_numba.warmup``, strided views included), in two processes that share out
    the dtypes (WARMUP_PARTS), so both cores compile and each kernel compiles once:
    otherwise every worker compiles the same kernels for itself on a fresh clone. (Not
    in a worker, nor with NSA_NUMBA_BOUNDSCHECK, which has no cache.)"""
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or BOUNDSCHECK or not workers:
        return
    env = dict(os.environ, NSA_NUMBA_QUIET="1")
    procs = [subprocess.Popen(
        [sys.executable, "-c", "import io, nsa_numba._warmup as f; "
                               f"f.warmup(dtypes={dtypes}, strided=True, out=io.StringIO())"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for dtypes in WARMUP_PARTS]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise pytest.UsageError(f"compiling the kernels ahead failed:\n{err}")


HALF_DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
DTYPES = HALF_DTYPES + [np.dtype(np.float32), np.dtype(np.float64)]
DTYPE_IDS = [str(t) for t in DTYPES]


@pytest.fixture(params=DTYPES, ids=DTYPE_IDS)
def dtype(request):
    return request.param


@pytest.fixture
def kept(monkeypatch):
    """The output pool (``_core.pool``) at the default budget, empty before and after."""
    monkeypatch.setattr(_pool, "_budget", 1 << 30)
    _pool.release_outputs()
    yield
    _pool.release_outputs()


def random_problem(T, N, D, block, stride, seq, dtype, seq_type=0, seed=0):
    """Random input, weight and output gradient for a problem, in ``dtype``."""
    rng = np.random.default_rng(seed)
    n_windows = ref.window_starts(T, block, stride, seq, seq_type).size
    x = rng.standard_normal((T, N, D)).astype(dtype)
    w = rng.standard_normal((block, N)).astype(dtype)
    g = rng.standard_normal((n_windows, N, D)).astype(dtype)
    return x, w, g


def accumulator(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def n_sequences(T, seq):
    return 1 if seq is None else len(seq)


def assert_forward_accurate(out, x, w, block, stride, seq, seq_type=0):
    exact = ref.compress(x, w, block, stride, seq, seq_type)
    assert out.shape == exact.shape
    assert out.dtype == x.dtype
    depth, _, _ = ref.depths(out.shape[0], x.shape[2], block, stride,
                             n_sequences(x.shape[0], seq))
    report = ref.check_accuracy(out, exact, ref.abs_terms_forward(x, w, block, stride, seq,
                                                                  seq_type),
                                x.dtype, depth, accumulator(x.dtype))
    assert report["ok"], report


def assert_grad_accurate(dx, dw, g, x, w, block, stride, seq, seq_type=0):
    exact_dx, exact_dw = ref.compress_grad(g, x, w, block, stride, seq, seq_type)
    abs_dx, abs_dw = ref.abs_terms_grad(g, x, w, block, stride, seq, seq_type)
    assert dx.shape == x.shape and dw.shape == w.shape
    assert dx.dtype == x.dtype and dw.dtype == x.dtype
    _, d_ig, d_wg = ref.depths(g.shape[0], x.shape[2], block, stride,
                               n_sequences(x.shape[0], seq))
    acc = accumulator(x.dtype)
    report = ref.check_accuracy(dx, exact_dx, abs_dx, x.dtype, d_ig, acc)
    assert report["ok"], ("input_grad", report)
    report = ref.check_accuracy(dw, exact_dw, abs_dw, x.dtype, d_wg, acc)
    assert report["ok"], ("weight_grad", report)
