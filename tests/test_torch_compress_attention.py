"""npu_nsa_compress_attention through PyTorch: the NumPy API's bits (forward and
gradient, the latter through the generic attention's gradient), opcheck, float64
gradcheck through fully masked rows and holes in the mask, autocast and errors. A
model's training step through it: tests/test_torch_fusion_attention.py."""

import os

import numpy as np
import pytest

if os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
    import torch
else:
    torch = pytest.importorskip("torch")

import nsa_numba  # noqa: E402
from nsa_numba import NsaError  # noqa: E402
from nsa_numba.torch import npu_nsa_compress_attention  # noqa: E402

L, STRIDE, L_SEL = 32, 16, 64
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
         torch.float64: "float64"}


def _compressed(n):
    return max(0, (n - L) // STRIDE + 1)


def _lists(lengths):
    """(seq_q, cmp, sel) prefix sums for raw sequences of ``lengths`` tokens."""
    cmp = [_compressed(n) for n in lengths]
    sel = [-(-c // (L_SEL // STRIDE)) for c in cmp]
    return (np.cumsum(lengths).tolist(), np.cumsum(cmp).tolist(), np.cumsum(sel).tolist())


def _mask(lengths):
    """The causal compressed mask: key k visible to position s iff k d + l - 1 <= s."""
    s = torch.arange(max(lengths))[:, None]
    k = torch.arange(max(_compressed(n) for n in lengths))[None, :]
    return k * STRIDE + L - 1 > s


def _tensors(lengths, dtype, N1=4, N2=2, D=192, Dv=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    tc = sum(_compressed(n) for n in lengths)
    return [torch.randn(shape, generator=g).to(dtype)
            for shape in ((sum(lengths), N1, D), (tc, N2, D), (tc, N2, Dv))]


def _call(q, k, v, lengths, count=2, mask=True, topk_mask=None):
    seq_q, cmp, sel = _lists(lengths)
    return npu_nsa_compress_attention(q, k, v, q.shape[2] ** -0.5, q.shape[1], L, STRIDE,
                                      L_SEL, count, topk_mask=topk_mask,
                                      atten_mask=_mask(lengths) if mask else None,
                                      actual_seq_qlen=seq_q, actual_cmp_seq_kvlen=cmp,
                                      actual_sel_seq_kvlen=sel)


def _numpy(t):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _same_bits(t, a):
    return np.array_equal(_numpy(t).view(np.uint8), np.ascontiguousarray(a).view(np.uint8))


@pytest.mark.parametrize("dtype", list(NAMES), ids=list(NAMES.values()))
def test_autograd_gives_the_numpy_api_bits(dtype):
    lengths = [300, 160]
    q, k, v = (t.requires_grad_() for t in _tensors(lengths, dtype, seed=1))
    out, topk, smax, ssum = _call(q, k, v, lengths)
    assert topk.dtype == torch.int32 and topk.shape == (460, 2, 2)
    assert not any(t.requires_grad for t in (topk, smax, ssum))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out.backward(grad)
    seq_q, cmp, sel = _lists(lengths)
    arrays = [_numpy(t) for t in (q, k, v)]
    mask = _mask(lengths).numpy()
    want = nsa_numba.nsa_compress_attention(*arrays, q.shape[2] ** -0.5, 4, L, STRIDE, L_SEL,
                                            2, atten_mask=mask, actual_seq_qlen=seq_q,
                                            actual_cmp_seq_kvlen=cmp,
                                            actual_sel_seq_kvlen=sel)
    for got, ref in zip((out, topk, smax, ssum), want):
        assert _same_bits(got, ref)
    grads = nsa_numba.nsa_compress_attention_grad(_numpy(grad), *arrays, *want[:1],
                                                  *want[2:], q.shape[2] ** -0.5, 4,
                                                  atten_mask=mask, actual_seq_qlen=seq_q,
                                                  actual_cmp_seq_kvlen=cmp)
    for got, ref in zip((q.grad, k.grad, v.grad), grads):
        assert _same_bits(got, ref)


def test_opcheck_both_operators():
    lengths = [200, 120]
    q, k, v = _tensors(lengths, torch.float32, N1=4, N2=1, D=24, Dv=16, seed=3)
    seq_q, cmp, sel = _lists(lengths)
    forced = torch.zeros(200, 3, dtype=torch.bool)
    forced[:, 0] = True
    args = (q, k, v, 0.2, 4, L, STRIDE, L_SEL, 2, forced, _mask(lengths), seq_q, cmp, sel)
    torch.library.opcheck(torch.ops.nsa_numba.nsa_compress_attention.default, args)
    out, _, smax, ssum = torch.ops.nsa_numba.nsa_compress_attention(*args)
    # its backward is the generic attention's gradient, TND, sparse mode 1
    grad_args = (q, k, v, torch.randn_like(out), 4, "TND", _mask(lengths), smax, ssum, out,
                 0.2, 1.0, 2147483647, 2147483647, 0, seq_q, cmp, 1)
    torch.library.opcheck(torch.ops.nsa_numba.fusion_attention_grad.default, grad_args)


@pytest.mark.slow
@pytest.mark.parametrize("holes", [False, True], ids=["causal", "holes"])
def test_float64_gradcheck(holes):
    lengths = [150, 100]
    q, k, v = _tensors(lengths, torch.float64, N1=2, N2=1, D=8, Dv=4, seed=4)
    seq_q, cmp, sel = _lists(lengths)
    mask = _mask(lengths)
    if holes:                    # keys hidden inside rows' ranges, and whole rows
        mask = mask | (torch.rand(mask.shape, generator=torch.Generator().manual_seed(5))
                       < 0.3)
        mask[60:70] = True

    def f(a, b, c):
        return npu_nsa_compress_attention(a, b, c, 0.4, 2, L, STRIDE, L_SEL, 2,
                                          atten_mask=mask, actual_seq_qlen=seq_q,
                                          actual_cmp_seq_kvlen=cmp,
                                          actual_sel_seq_kvlen=sel)[0]
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


def test_autocast_casts_to_bfloat16():
    lengths = [128, 96]
    q, k, v = _tensors(lengths, torch.float32, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _, smax, _ = _call(q, k, v, lengths)
    assert out.dtype == torch.bfloat16 and smax.dtype == torch.float32
    want = _call(*(t.to(torch.bfloat16) for t in (q, k, v)), lengths)[0]
    assert torch.equal(out, want)


def test_errors_name_the_torch_function():
    lengths = [128, 96]
    q, k, v = _tensors(lengths, torch.float32, seed=7)
    with pytest.raises(NsaError, match="npu_nsa_compress_attention: query must be a "
                                       "torch.Tensor"):
        _call(q.numpy(), k, v, lengths)
    seq_q, cmp, sel = _lists(lengths)
    with pytest.raises(NsaError, match="atten_mask dtype must be bool or uint8, got "
                                       "torch.float32"):
        npu_nsa_compress_attention(q, k, v, 0.1, 4, L, STRIDE, L_SEL, 2,
                                   atten_mask=_mask(lengths).float(), actual_seq_qlen=seq_q,
                                   actual_cmp_seq_kvlen=cmp, actual_sel_seq_kvlen=sel)
    with pytest.raises(NsaError, match="must divide 128") as info:
        _call(q[:, :3], k[:, :1], v[:, :1], lengths)
    assert info.value.status == 561002 and "strict" not in str(info.value)
