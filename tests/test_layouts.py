"""Padded layouts (BSND, BNSD, BSH, SBH): the same bits as TND with one sequence per row."""

import numpy as np
import pytest

import nsa_numba
from nsa_numba import NsaError
from nsa_numba._ops.layouts import c_carrier
from nsa_numba.aclnn import (ACLNN_SUCCESS, aclnnNsaCompressGrad,
                             aclnnNsaCompressGradGetWorkspaceSize)
from conftest import DTYPE_IDS, DTYPES

B, S, N, D, L, STRIDE = 3, 100, 4, 32, 32, 16
S_OUT = (S - L) // STRIDE + 1


def to_layout(a4, layout):
    """A [B, S, N, D] array as a (contiguous) array of ``layout``."""
    b, s, n, d = a4.shape
    return {
        "BSND": lambda: a4.copy(),
        "BNSD": lambda: np.ascontiguousarray(a4.transpose(0, 2, 1, 3)),
        "BSH": lambda: a4.reshape(b, s, n * d).copy(),
        "SBH": lambda: np.ascontiguousarray(a4.transpose(1, 0, 2, 3)).reshape(s, b, n * d),
    }[layout]()


def from_layout(a, layout, n=N):
    """An array of ``layout`` back as [B, S, N, D]."""
    if layout == "BSND":
        return a
    if layout == "BNSD":
        return a.transpose(0, 2, 1, 3)
    split = (a.shape[0], a.shape[1], n, a.shape[2] // n)   # not -1: sizes may be 0
    if layout == "BSH":
        return a.reshape(split)
    return a.reshape(split).transpose(1, 0, 2, 3)


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                 np.ascontiguousarray(b).view(np.uint8))


def data(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x4 = rng.standard_normal((B, S, N, D)).astype(dtype)
    w = rng.standard_normal((L, N)).astype(dtype)
    g4 = rng.standard_normal((B, S_OUT, N, D)).astype(dtype)
    return x4, w, g4


def tnd_results(x4, w, g4):
    seq = [S * (b + 1) for b in range(B)]
    out = nsa_numba.nsa_compress(x4.reshape(B * S, N, D), w, L, STRIDE, actual_seq_len=seq)
    dx, dw = nsa_numba.nsa_compress_grad(g4.reshape(B * S_OUT, N, D), x4.reshape(B * S, N, D),
                                         w, L, STRIDE, actual_seq_len=seq)
    return out.reshape(B, S_OUT, N, D), dx.reshape(B, S, N, D), dw


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
@pytest.mark.parametrize("dtype", [pytest.param(t, marks=() if t.name == "bfloat16"
                                                else pytest.mark.slow) for t in DTYPES],
                         ids=DTYPE_IDS)      # bfloat16 by default, the others in the slow run
def test_layout_equals_tnd(layout, dtype):
    x4, w, g4 = data(dtype)
    out4, dx4, dw = tnd_results(x4, w, g4)
    x = to_layout(x4, layout)
    out = nsa_numba.nsa_compress(x, w, L, STRIDE, layout=layout)
    assert out.shape == to_layout(out4, layout).shape
    assert same_bits(from_layout(out, layout), out4)
    dx, dw_l = nsa_numba.nsa_compress_grad(to_layout(g4, layout), x, w, L, STRIDE,
                                           layout=layout)
    assert dx.shape == x.shape
    assert same_bits(from_layout(dx, layout), dx4)
    assert same_bits(dw_l, dw)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
def test_layout_views_of_other_memory_orders(layout):
    # a BNSD-shaped view of BSND memory, etc.: strided inputs and outputs, no copies
    x4, w, g4 = data(np.float32, seed=1)
    out4, dx4, dw = tnd_results(x4, w, g4)
    if layout == "BSND":
        x = to_layout(x4, "BNSD").transpose(0, 2, 1, 3)  # BSND view of BNSD memory
    elif layout == "BNSD":
        x = x4.copy().transpose(0, 2, 1, 3)            # BNSD view of BSND memory
    elif layout == "SBH":
        x = to_layout(x4, "BSH").transpose(1, 0, 2)      # SBH view of BSH memory
    elif layout == "BSH":
        x = to_layout(x4, "SBH").transpose(1, 0, 2)      # BSH view of SBH memory
    out = np.full(to_layout(out4, layout).shape[::-1], np.nan, np.float32).T  # reversed strides
    r = nsa_numba.nsa_compress(x, w, L, STRIDE, layout=layout, out=out)
    assert r is out
    assert same_bits(from_layout(out, layout), out4)


def test_layouts_through_the_aclnn_mirror():
    x4, w, g4 = data(np.float16)
    _, dx4, dw = tnd_results(x4, w, g4)
    x, g = to_layout(x4, "BNSD"), to_layout(g4, "BNSD")
    dx, dwo = np.empty_like(x), np.empty_like(w)
    status, size, executor = aclnnNsaCompressGradGetWorkspaceSize(
        g, x, w, None, L, STRIDE, 0, "BNSD", dx, dwo)
    assert status == ACLNN_SUCCESS
    assert aclnnNsaCompressGrad(np.empty(size, np.uint8), size, executor) == ACLNN_SUCCESS
    assert same_bits(from_layout(dx, "BNSD"), dx4) and same_bits(dwo, dw)


@pytest.mark.parametrize("layout,make,fragment", [
    ("BSND", lambda x4, w: dict(actual_seq_len=[0, 300]),
     "actual_seq_len must be None with layout='BSND'"),
    ("BSH", lambda x4, w: dict(weight=np.zeros((L, 5), np.float16)),
     "hidden size H = shape[2] = 128 must be a multiple of N = weight.shape[1] = 5"),
    ("SBH", lambda x4, w: dict(input=to_layout(x4[:, :20], "SBH")),
     "no sequence is as long as compress_block_size = 32"),
    ("BNSD", lambda x4, w: dict(out=np.zeros((B, S_OUT, N, D), np.float16)),
     "out must have shape (3, 4, 5, 32)"),
    ("BSH", lambda x4, w: dict(input=x4),
     "input must be 3-D [B, S, H] (layout='BSH')"),
])
def test_layout_rules(layout, make, fragment):
    x4, w, _ = data(np.float16)
    args = dict(input=to_layout(x4, layout), weight=w, out=None, actual_seq_len=None)
    args.update(make(x4, w))
    with pytest.raises(NsaError) as info:
        nsa_numba.nsa_compress(args["input"], args["weight"], L, STRIDE, layout=layout,
                               actual_seq_len=args["actual_seq_len"], out=args["out"])
    assert info.value.status == 161002
    assert fragment in str(info.value), str(info.value)


def _carrier_cases():
    base = np.arange(3 * 10 * 6 * 40, dtype=np.float32).reshape(3, 10, 6, 40)
    return {
        "heads-slice": (base[:, :, 2:5, :], True),
        "tokens-slice": (base[:, 3:7], True),
        "all-dims-slice": (base[1:, 2:9, 1:4, 5:30], True),
        "one-head": (base[:, :, 4:5, :], True),
        "every-other-element": (base[..., ::2], False),
        "reversed-tokens": (base[:, ::-1], False),
        "heads-before-tokens": (base.transpose(0, 2, 1, 3), False),
    }


@pytest.mark.parametrize("case", list(_carrier_cases()))
def test_c_carrier_gives_a_contiguous_view_of_the_same_elements(case):
    a, expect_carrier = _carrier_cases()[case]
    carrier = c_carrier(a)
    if not expect_carrier:
        assert carrier is a
        return
    assert carrier.flags.c_contiguous
    assert carrier.__array_interface__["data"][0] == a.__array_interface__["data"][0]
    B, S, N, D = a.shape
    assert carrier.shape[0] == B and all(p >= n for p, n in zip(carrier.shape, a.shape))
    assert np.array_equal(carrier[:, :S, :N, :D], a)    # the kernels' indices only
