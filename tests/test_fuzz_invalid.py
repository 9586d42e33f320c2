"""Generated invalid calls (``fuzz_invalid_cases.py``) and the hostile calls that
once crashed (``hostile_cases.py``), run in a child process.

A crash of the interpreter (a segfault from an out-of-bounds write, an abort) or a
hang would otherwise take the test runner with it; here either is a failed test
with the child's output.
"""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 900


def test_invalid_calls_in_a_child_process():
    # one process (-n 0), and the 150 cases per test these always ran: rejecting bad
    # input compiles little, so they cost seconds, unlike the valid problems
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
               "--hypothesis-show-statistics", os.path.join(HERE, "fuzz_invalid_cases.py"),
               os.path.join(HERE, "hostile_cases.py")]
    env = dict(os.environ)
    env.setdefault("NSA_NUMBA_FUZZ_EXAMPLES", "150")
    try:
        child = subprocess.run(command, cwd=HERE, capture_output=True, text=True,
                               timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"the invalid-input fuzz hung for {TIMEOUT_S} s:\n"
                             f"{(err.stdout or b'')[-4000:]!r}") from None
    report = child.stdout[-6000:] + child.stderr[-2000:]
    assert child.returncode == 0, f"child exit status {child.returncode}:\n{report}"
    # (hypothesis' statistics may say "failed to satisfy assume()": not a failed test)
    assert " passed" in child.stdout and not re.search(r"\d+ failed", child.stdout), report
