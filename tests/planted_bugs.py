"""Plants bugs in the attention kernels and planners, one at a time, and shows which
test catches each: the check that the attention tests can fail. Not part of the test
run (it recompiles the kernels once per bug: half an hour on 2 cores).

    python tests/planted_bugs.py [NAME ...] [--markdown]

Each bug is a one-place change to a copy of the package; the attention test files run
against it (stopping at the first failure; a bug in half precision only, its
bfloat16 tests) with a compile cache of their own. A bug that no test catches is
printed as SURVIVED, and the script exits 1.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = ["tests/test_select_attention.py", "tests/test_compress_attention.py",
         "tests/test_fusion_attention.py", "tests/test_attention_threads.py",
         "tests/test_nonfinite.py", "tests/test_fuzz_valid.py"]
FUZZ = "selected or compressed or fusion"


@dataclass
class Bug:
    name: str
    path: str
    old: str
    new: str
    #: the tests to run (a pytest -k expression): by default every attention test
    only: str = ""


BUGS = [
    Bug("compressed attention's importance: first block off by one",
        "nsa_numba/_kernels/attention.py", "lo = max(0, (first - 1) // m)",
        "lo = max(0, first // m)"),
    Bug("forwards and dq: weights rounded to bfloat16 before their products",
        "nsa_numba/_kernels/attention.py",
        "        _mm(w, g * lds, lds, 1, n, rows, b, 0, width, out, g * width, width, False)\n",
        "        like = np.zeros(1, np.int16)\n"
        "        for i in range(g * lds, (g + 4) * lds):\n"
        "            w[i] = widen(narrow(w[i], like))\n"
        "        _mm(w, g * lds, lds, 1, n, rows, b, 0, width, out, g * width, width, False)\n",
        "bfloat16"),
    Bug("forwards: a value of weight 0 summed after all (0 x NaN reaches the row)",
        "nsa_numba/_kernels/attention.py", "                if gate[i] != 0:\n",
        "                if True:\n"),
    Bug("dense forward: softmax_max + 1000 on rows that see keys",
        "nsa_numba/_kernels/attention.py",
        "            _set_stats(smax, ssum, t, h0 + g, top, total)",
        "            _set_stats(smax, ssum, t, h0 + g, top + (1000 if state == SEES else 0), "
        "total)"),
    Bug("dense forward: a fully masked row's count one too many",
        "nsa_numba/_kernels/attention.py",
        "total = s.dtype.type(hi - lo if state == ALL_MASKED else NO_KEYS_SUM)",
        "total = s.dtype.type(hi - lo + 1 if state == ALL_MASKED else NO_KEYS_SUM)"),
    Bug("dense dk/dv owner: the last key of a chunk not written",
        "nsa_numba/_kernels/attention.py", "    for k in range(valid):\n",
        "    for k in range(valid - 1):\n"),
    Bug("dense dk/dv owner: rows summed in reverse on the second thread",
        "nsa_numba/_kernels/attention.py",
        "    for t in range(q_starts[b], q_starts[b + 1]):\n",
        "    t0, t1, step = q_starts[b], q_starts[b + 1], 1\n"
        "    if get_thread_id() == 1:\n"
        "        t0, t1, step = q_starts[b + 1] - 1, q_starts[b] - 1, -1\n"
        "    for t in range(t0, t1, step):\n"),
    Bug("selected dk/dv owner: entries summed in reverse on the second thread",
        "nsa_numba/_kernels/attention.py",
        "    for e in range(offsets[u], offsets[u + 1]):\n",
        "    e0, e1, step = offsets[u], offsets[u + 1], 1\n"
        "    if get_thread_id() == 1:\n"
        "        e0, e1, step = offsets[u + 1] - 1, offsets[u] - 1, -1\n"
        "    for e in range(e0, e1, step):\n"),
    Bug("selected attention: the causal mask hides the query's own block",
        "nsa_numba/_kernels/attention.py", "        if causal and idx > diag:",
        "        if causal and idx >= diag:"),
    Bug("gradients: delta from the group's first head", "nsa_numba/_kernels/attention.py",
        "        delta = _dot_row(dos, g * Dv, out_fwd, t, h)",
        "        delta = _dot_row(dos, 0, out_fwd, t, h0)"),
    Bug("compressed attention's top-k: ties to the higher block", "nsa_numba/_kernels/attention.py",
        "        while i > 0 and x > score[best[i - 1]]:",
        "        while i > 0 and x >= score[best[i - 1]]:"),
    Bug("fusion mode 4: the band one key longer", "nsa_numba/_ops/fusion.py",
        "        lo, hi = off - pre, off + nxt + 1",
        "        lo, hi = off - pre - 1, off + nxt + 1"),
    Bug("fusion TND [T1, T2] mask: row and column bases swapped", "nsa_numba/_ops/fusion.py",
        "bases[:, 0], bases[:, 1] = q_starts[:-1], kv_starts[:-1]",
        "bases[:, 0], bases[:, 1] = kv_starts[:-1], q_starts[:-1]"),
    Bug("a call in parts: key rows not rebased to the part", "nsa_numba/_ops/dense.py",
        "chunk_row=self.chunk_row[c0:c1] - k0,", "chunk_row=self.chunk_row[c0:c1],"),
]


def run(bug, tree, cache):
    """(first failing test or None, seconds) with ``bug`` planted in ``tree``."""
    path = os.path.join(tree, bug.path)
    with open(path) as f:
        original = f.read()
    if original.count(bug.old) != 1:
        raise SystemExit(f"{bug.name}: the text to change is not in {bug.path} exactly once")
    with open(path, "w") as f:
        f.write(original.replace(bug.old, bug.new))
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, NSA_NUMBA_QUIET="1",
               PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    try:
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
             "-k", f"(not fuzz_valid or {FUZZ})" + (f" and ({bug.only})" if bug.only else ""),
             *TESTS, "-m", "not slow and not extended"],
            cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    finally:
        with open(path, "w") as f:
            f.write(original)
    failed = [line.split(" ", 2)[1] for line in child.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    if child.returncode not in (0, 1) and not failed:
        failed = [f"the test run itself (exit {child.returncode})"]
    return (failed[0] if failed else None), time.perf_counter() - start


def main(argv):
    markdown = "--markdown" in argv
    wanted = [a for a in argv if not a.startswith("--")]
    bugs = [b for b in BUGS if not wanted or any(w in b.name for w in wanted)]
    work = tempfile.mkdtemp(prefix="nsa-planted-")
    tree, cache = os.path.join(work, "tree"), os.path.join(work, "cache")
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", "env", "results", "html", ".hypothesis"))
    survived = 0
    if markdown:
        print("| planted bug | caught by | s |\n|---|---|---|")
    try:
        for bug in bugs:
            caught, seconds = run(bug, tree, cache)
            survived += caught is None
            if markdown:
                print(f"| {bug.name} | {caught or '**SURVIVED**'} | {seconds:.0f} |", flush=True)
            else:
                print(f"{'SURVIVED' if caught is None else 'caught  '} {bug.name}: "
                      f"{caught or '-'} ({seconds:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
