"""The private Numba and torch names the library uses (``_internals``) exist in the
installed versions: each has a public fallback, so without this test a new Numba or
torch that drops one would only make calls slower, silently."""

import os

import numpy as np
import pytest

import nsa_numba
from nsa_numba import _internals


def test_numbas_thread_count_functions_exist_once_the_pool_runs():
    nsa_numba.nsa_compress(np.ones((64, 1, 16), np.float32), np.ones((16, 1), np.float32),
                           16, 16)
    assert _internals.numba_pool_started()
    functions = _internals.numba_thread_count_functions()
    assert functions is not None, "this Numba has no _get_num_threads / _set_num_threads"
    get, put = functions
    current = get()
    assert current >= 1
    put(1)
    try:
        assert get() == 1
    finally:
        put(current)
    assert get() == current


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
