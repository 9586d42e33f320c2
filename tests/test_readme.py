"""The README's runnable examples run as printed."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def example(name):
    """The python block that follows ``<!-- README example: name ...-->``."""
    text = README.read_text()
    match = re.search(r"<!-- README example: " + re.escape(name) + r"\b[^>]*-->\s*"
                      r"```python\n(.*?)```", text, re.S)
    assert match, f"no README example named {name!r}"
    return match.group(1)


def test_training_example_runs():
    if not os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
        pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", example("training")], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = re.findall(r"^step (\d): (\d) sequences, loss ([0-9.]+)$", proc.stdout, re.M)
    assert [int(s) for s, _, _ in steps] == [0, 1, 2, 3]


def test_decoding_example_runs():
    proc = subprocess.run([sys.executable, "-c", example("decoding")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0 2 4]"
