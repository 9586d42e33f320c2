"""The runnable examples of the README and docs/reference.md run as printed."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def example(name, page="README.md"):
    """The python block that follows ``<!-- README example: name ...-->`` (``docs
    example`` in the docs) in ``page``."""
    text = (ROOT / page).read_text()
    kind = "README" if page == "README.md" else "docs"
    match = re.search(r"<!-- " + kind + r" example: " + re.escape(name) + r"\b[^>]*-->\s*"
                      r"```python\n(.*?)```", text, re.S)
    assert match, f"no example named {name!r} in {page}"
    return match.group(1)


def test_training_example_runs():
    if not os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
        pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", example("training", "docs/reference.md")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = re.findall(r"^step (\d): (\d) sequences, loss ([0-9.]+)$", proc.stdout, re.M)
    assert [int(s) for s, _, _ in steps] == [0, 1, 2, 3]


def test_decoding_example_runs():
    proc = subprocess.run([sys.executable, "-c", example("decoding")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0 2 4]"


def test_torch_quick_start_runs():
    if not os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
        pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", example("torch quick start")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch.Size([15, 8, 128]) torch.Size([32, 8])"


def test_attention_example_runs():
    if not os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
        pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", example("attention")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(256, 2, 2) (32, 2)"
