"""``python -m nsa_numba demo`` and ``info``, and the pure-Python debugging path."""

import os
import subprocess
import sys
import textwrap


def run(*args, env_extra=None, code=None):
    env = dict(os.environ, **(env_extra or {}))
    cmd = [sys.executable] + (["-c", code] if code else ["-m", "nsa_numba", *args])
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_demo_checks_the_seed_example():
    proc = run("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK"
    text = proc.stdout
    for fragment in ("[15, 64, 128]", "[272, 64, 128]", "[32, 64]", "ulp", "first call",
                     "actual_seq_len=[0, 128, 272]"):
        assert fragment in text


def test_info_reports_the_setup():
    proc = run("info")
    assert proc.returncode == 0, proc.stderr
    for key in ("nsa_numba", "numba", "threads", "cpu", "vector path",
                "float16 path", "kernel cache", "output pool", "torch"):
        assert key in proc.stdout
    threads = [ln for ln in proc.stdout.splitlines() if ln.startswith("threads")][0]
    assert "helper threads of nsa_numba's own" in threads
    kept = [ln for ln in proc.stdout.splitlines() if ln.startswith("output pool")][0]
    assert "up to 1024 MiB of allocated outputs of 4 MiB or more" in kept
    off = run("info", env_extra={"NSA_NUMBA_KEEP_OUTPUTS_MB": "0"})
    assert any(ln.startswith("output pool ") and ln.endswith(" off (every output allocated)")
               for ln in off.stdout.splitlines())


def test_unknown_command_fails():
    assert run("nonsense").returncode != 0


def test_pure_python_path_matches_compiled():
    # NUMBA_DISABLE_JIT=1 runs the kernels as plain Python (for debuggers and
    # coverage tools); on a tiny problem it must agree with the compiled kernels.
    code = textwrap.dedent("""
        import hashlib, sys
        import numpy as np, ml_dtypes
        import nsa_numba
        rng = np.random.default_rng(1)
        for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
            x = rng.standard_normal((40, 2, 16)).astype(dtype)
            w = rng.standard_normal((16, 2)).astype(dtype)
            y = nsa_numba.nsa_compress(x, w, 16, 8, actual_seq_len=[0, 15, 40], strict=False)
            dx, dw = nsa_numba.nsa_compress_grad(y, x, w, 16, 8, actual_seq_len=[0, 15, 40],
                                                 strict=False)
            print(*[hashlib.sha256(a.tobytes()).hexdigest() for a in (y, dx, dw)])
    """)
    compiled = run(code=code)
    plain = run(code=code, env_extra={"NUMBA_DISABLE_JIT": "1"})
    assert compiled.returncode == 0, compiled.stderr
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == compiled.stdout


def test_import_does_not_load_ml_dtypes():
    # ml_dtypes 0.7 takes ~0.9 s to import; float16/float32 users should not pay it.
    proc = run(code="import sys, nsa_numba; print('ml_dtypes' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
