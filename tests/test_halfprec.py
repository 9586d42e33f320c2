"""The per-element conversions, exhaustively where the input space allows."""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from nsa_numba._kernels import attention as _attention
from nsa_numba._kernels import halfprec as hp
from nsa_numba._kernels import simd as _simd, target as _target
from nsa_numba._core.jit import jit

ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@jit
def _map_decode_portable(a, o):
    for i in range(a.size):
        o[i] = hp.f16_to_f32_portable(a[i])


@jit
def _map_encode_portable(a, o):
    for i in range(a.size):
        o[i] = hp.f32_to_f16_portable(a[i])


@jit
def _map_decode_hw(a, o):
    for i in range(a.size):
        o[i] = hp.f16_to_f32_hw(a[i])


@jit
def _map_encode_hw(a, o):
    for i in range(a.size):
        o[i] = hp.f32_to_f16_hw(a[i])


@jit
def _map_widen(a, o):
    for i in range(a.size):
        o[i] = hp.widen(a[i])


@jit
def _map_narrow(a, o):
    for i in range(a.size):
        o[i] = hp.narrow(a[i], o)


def _float32_probes():
    """Random bit patterns plus every float16 / bfloat16 rounding boundary and neighbour."""
    rng = np.random.default_rng(0)
    probes = [rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
              .view(np.float32)]
    with np.errstate(invalid="ignore"):
        halves = [ALL16.view(np.float16).astype(np.float64),
                  ALL16.view(ml_dtypes.bfloat16).astype(np.float64)]
    for values in halves:
        v = np.unique(values[np.isfinite(values)])
        mids = ((v[1:] + v[:-1]) / 2).astype(np.float32)   # exact in float32
        probes += [mids, np.nextafter(mids, np.float32(np.inf)),
                   np.nextafter(mids, np.float32(-np.inf)), v.astype(np.float32)]
    probes.append(np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 1e-8,
                            -1e-8, 3.0e38, np.nan, -np.nan], np.float32))
    return np.concatenate(probes)


F32 = _float32_probes()
NAN = np.isnan(F32)


def _decode(fn, bits):
    out = np.empty(bits.size, np.float32)
    fn(bits, out)
    return out


def _encode(fn, values, storage=np.uint16):
    out = np.empty(values.size, storage)
    fn(values, out)
    return out


def test_f16_decode_portable_is_exact_for_every_value():
    got = _decode(_map_decode_portable, ALL16)
    with np.errstate(invalid="ignore"):         # NumPy on aarch64 warns on signalling NaNs
        want = ALL16.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    # NaN keeps sign and payload and comes out quiet
    g = got.view(np.uint32)[nan]
    w = want.view(np.uint32)[nan]
    assert np.all(np.isnan(got[nan]))
    assert np.array_equal(g, w | 0x00400000)


def test_f16_encode_portable_rounds_like_numpy():
    got = _encode(_map_encode_portable, F32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = F32.astype(np.float16).view(np.uint16)
    assert np.array_equal(got[~NAN], want[~NAN])
    assert np.all(np.isnan(got[NAN].view(np.float16)))
    # quiet, sign and leading payload bits kept (numpy leaves signalling NaNs signalling)
    bits = F32.view(np.uint32)[NAN]
    expected = ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)
    assert np.array_equal(got[NAN], expected.astype(np.uint16))


@pytest.mark.skipif(not hp.HARDWARE_HALF, reason="no float16 conversion instructions")
def test_hardware_path_equals_portable_path_bit_for_bit():
    # F16C on x86, FCVT on AArch64 (CONTRIBUTING.md: "aarch64 under emulation")
    assert np.array_equal(_decode(_map_decode_hw, ALL16).view(np.uint32),
                          _decode(_map_decode_portable, ALL16).view(np.uint32))
    assert np.array_equal(_encode(_map_encode_hw, F32), _encode(_map_encode_portable, F32))


def test_bfloat16_decode_and_encode():
    b = ALL16.view(np.int16)
    got = _decode(_map_widen, b)
    assert np.array_equal(got.view(np.uint32), ALL16.astype(np.uint32) << 16)
    enc = _encode(_map_narrow, F32, np.int16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = F32.astype(ml_dtypes.bfloat16).view(np.int16)
    assert np.array_equal(enc[~NAN], want[~NAN])
    bits = F32.view(np.uint32)[NAN]
    assert np.array_equal(enc[NAN].view(np.uint16), ((bits >> 16) | 0x40).astype(np.uint16))


@jit
def _rows_narrow(a, o):
    for r in range(o.shape[0]):
        _attention._narrow_row(a, r * o.shape[2], o, r, 0)


@jit
def _rows_widen(a, o):
    for r in range(a.shape[0]):
        _attention._widen_row(a, r, 0, o, r * a.shape[2])


@pytest.mark.parametrize("storage", [np.int16, np.uint16, np.float32])
@pytest.mark.parametrize("step", [1, 2])
def test_attention_rows_convert_as_the_scalar_path(storage, step):
    # the attention kernels' row conversions take 16 elements at a time where the
    # row's elements are adjacent (step 1) and one at a time elsewhere; both give the
    # bits of the per-element conversion, NaN included
    values = F32[:F32.size - F32.size % 48]
    want = _encode(_map_narrow, values, storage)
    out = np.zeros((values.size // 48, 1, 48 * step), storage)[:, :, ::step]
    _rows_narrow(values, out)
    assert np.array_equal(np.ascontiguousarray(out).reshape(-1).view(np.uint8),
                          want.view(np.uint8))
    wide = np.empty(values.size, np.float32)
    _rows_widen(out, wide)
    assert np.array_equal(wide.view(np.uint32), _decode(_map_widen, want).view(np.uint32))


def test_widen_and_narrow_dispatch_on_storage_type():
    assert np.array_equal(_decode(_map_widen, ALL16).view(np.uint32)[:0x7C00],
                          ALL16[:0x7C00].view(np.float16).astype(np.float32).view(np.uint32))
    values = np.array([1.5, -2.25, 1e-3], np.float32)
    assert np.array_equal(_encode(_map_narrow, values, np.uint16),
                          values.astype(np.float16).view(np.uint16))
    out = np.empty(3, np.float32)
    _map_narrow(values.astype(np.float64), out)
    assert np.array_equal(out, values)


PORTABLE_SCRIPT = """
import hashlib, sys
import numpy as np, ml_dtypes
from nsa_numba._kernels import halfprec as _halfprec, simd as _simd
import nsa_numba
sys.path.insert(0, {tests!r})
from conftest import random_problem
print(_halfprec.HARDWARE_HALF, _simd.WIDTH)
x, w, g = random_problem(700, 3, 48, 48, 16, [0, 300, 700], np.float16, seed=5)
y = nsa_numba.nsa_compress(x, w, 48, 16, actual_seq_len=[0, 300, 700])
dx, dw = nsa_numba.nsa_compress_grad(g, x, w, 48, 16, actual_seq_len=[0, 300, 700])
results = [y, dx, dw]
# D = 128: the forward keeps its sums in vectors (compress_forward_simd), which a
# baseline x86-64 holds in SSE registers; float16 needs F16C for it
for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
    x, w, _ = random_problem(300, 2, 128, 32, 16, [0, 100, 300], dtype, seed=6)
    results.append(nsa_numba.nsa_compress(x, w, 32, 16, actual_seq_len=[0, 100, 300]))
    # and the backward pairs its tokens in vectors (compress_backward), likewise
    g = random_problem(300, 2, 128, 32, 16, [0, 100, 300], dtype, seed=7)[2]
    results.extend(nsa_numba.nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=[0, 100, 300]))
print(*[hashlib.sha256(a.tobytes()).hexdigest() for a in results])
"""


def _run_kernels(env_extra):
    env = dict(os.environ, **env_extra)
    code = PORTABLE_SCRIPT.format(tests=os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\n")[:2]


def without_avx512():
    """NUMBA_CPU_* settings for this CPU with its AVX-512 turned off: an AVX2 target,
    whose forward vectors have half the lanes (_simd.WIDTH)."""
    flags = [f for f in _target.features() if not f.startswith(("+avx512", "-avx512"))]
    return {"NUMBA_CPU_NAME": "haswell",
            "NUMBA_CPU_FEATURES": ",".join(flags + ["-avx512f"])}


def _other_cpus():
    """(id, NUMBA_CPU_* settings, expected "HARDWARE_HALF WIDTH") of the builds compared
    with this CPU's: a baseline x86-64 (no F16C, no AVX: the portable float16 code and
    16-lane vectors) and, on an AVX-512 CPU, an AVX2 build of it (32 lanes). A baseline
    AArch64 keeps its FCVT conversions and 128-bit vectors."""
    generic = "False 16" if _target.is_x86() else f"{hp.HARDWARE_HALF} 16"
    cpus = [("generic", {"NUMBA_CPU_NAME": "generic"}, generic)]
    if _target.vector_bits() == 512:
        cpus.append(("avx2", without_avx512(), f"{hp.HARDWARE_HALF} 32"))
    return cpus


OTHER_CPUS = _other_cpus()


@pytest.mark.slow
@pytest.mark.parametrize("settings,expected", [c[1:] for c in OTHER_CPUS],
                         ids=[c[0] for c in OTHER_CPUS])
def test_kernels_on_other_cpus_match(settings, expected):
    # each build in its own process (a separate test, so the two compile in parallel
    # under pytest-xdist), against this CPU's code run the same way
    other = _run_kernels(settings)
    native = _run_kernels({})
    assert native[0] == f"{hp.HARDWARE_HALF} {_simd.WIDTH}"
    assert other == [expected, native[1]]
