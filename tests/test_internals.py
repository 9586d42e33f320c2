"""The private torch names the library uses (``_core.internals``) exist in the
installed versions: each has a public fallback, so without this test a new
torch that drops one would only make calls slower, silently."""

import os

import pytest

from nsa_numba._core import internals as _internals


def test_torchs_mode_probes_exist():
    if os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
        import torch
    else:
        torch = pytest.importorskip("torch")
    probes = _internals.torch_probes(torch)
    assert all(callable(p) for p in probes), f"this torch lacks one of {probes}"
    dispatch_stack, function_modes, transforms = probes
    assert dispatch_stack() == 0 and not function_modes() and transforms() is None
    with torch.overrides.TorchFunctionMode():
        assert function_modes()
