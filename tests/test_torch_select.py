"""npu_nsa_select_attention / _grad through PyTorch: the NumPy API's bits, autograd
equal to the explicit gradient call, opcheck, float64 gradcheck, torch.compile over
batches whose lengths change, autocast and errors."""

import os

import numpy as np
import pytest

if os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
    import torch
else:
    torch = pytest.importorskip("torch")

import nsa_numba  # noqa: E402
from nsa_numba import NsaError  # noqa: E402
from nsa_numba.bench.cases import select_problem  # noqa: E402
from nsa_numba.torch import (npu_nsa_select_attention,  # noqa: E402
                             npu_nsa_select_attention_grad)

TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
         torch.float64: "float64"}
#: a strict problem: D 192, Dv 128, l' 16, c 2, two sequences
SHAPE = dict(N1=4, N2=2, D=192, Dv=128, block=16, count=2)


def _tensors(lengths, dtype, seed=0, count=2):
    q, k, v, topk, scale, ends = select_problem(lengths, SHAPE["N1"], SHAPE["N2"], SHAPE["D"],
                                                SHAPE["Dv"], SHAPE["block"], count,
                                                "float32", seed=seed)
    qkv = [torch.from_numpy(a).to(dtype) for a in (q, k, v)]
    return qkv, torch.from_numpy(topk), scale, ends


def _call(q, k, v, topk, scale, ends, mask=True, count=2):
    return npu_nsa_select_attention(q, k, v, topk, scale, SHAPE["N1"], SHAPE["block"], count,
                                    atten_mask=torch.ones(1, dtype=torch.bool) if mask else None,
                                    actual_seq_qlen=ends, actual_seq_kvlen=ends)


def _numpy(t):
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().numpy()


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=[NAMES[d] for d in TORCH_DTYPES])
def test_autograd_gives_the_gradient_call_bits_and_the_numpy_api_bits(dtype):
    (q, k, v), topk, scale, ends = _tensors([32, 48], dtype, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, smax, ssum = _call(q, k, v, topk, scale, ends)
    assert out.dtype == dtype and smax.dtype == ssum.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32)
    assert not smax.requires_grad and not ssum.requires_grad
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out.backward(grad)
    mask = torch.ones(2, 2)
    explicit = npu_nsa_select_attention_grad(grad, q.detach(), k.detach(), v.detach(),
                                             out.detach(), smax, ssum, topk, scale,
                                             SHAPE["N1"], SHAPE["block"], 2, atten_mask=mask,
                                             actual_seq_qlen=ends, actual_seq_kvlen=ends)
    for got, want in zip((q.grad, k.grad, v.grad), explicit):
        assert torch.equal(got, want)
    arrays = [_numpy(t) for t in (q, k, v)]
    want = nsa_numba.nsa_select_attention(*arrays, topk.numpy(), scale, SHAPE["N1"],
                                          SHAPE["block"], 2, atten_mask=np.ones(1),
                                          actual_seq_qlen=ends, actual_seq_kvlen=ends)
    for got, ref in zip((out, smax, ssum), want):
        assert np.array_equal(_numpy(got.detach()).view(np.uint8), ref.view(np.uint8))


def test_opcheck_both_operators():
    (q, k, v), topk, scale, ends = _tensors([32, 48], torch.float32, seed=3)
    args = (q, k, v, topk, scale, SHAPE["N1"], SHAPE["block"], 2, True, ends, ends)
    torch.library.opcheck(torch.ops.nsa_numba.nsa_select_attention.default, args)
    out, smax, ssum = torch.ops.nsa_numba.nsa_select_attention(*args)
    grad_args = (torch.randn_like(out), q, k, v, out, smax, ssum) + args[3:]
    torch.library.opcheck(torch.ops.nsa_numba.nsa_select_attention_grad.default, grad_args)


@pytest.mark.parametrize("mask", [True, False], ids=["causal", "unmasked"])
def test_float64_gradcheck(mask):
    # differentiated in slices (queries 28..35, across the sequence boundary; keys and
    # values of the first block, which every query selects), seen through a slice of the
    # output: a failing check then reports a Jacobian of 1024 x 16384 elements rather
    # than building one of 3e9 (23 GB) in its slow mode
    (q, k, v), topk, scale, ends = _tensors([32, 32], torch.float64, seed=4)
    parts = (q[28:36].clone(), k[:16].clone(), v[:16].clone())

    def f(qs, ks, vs):
        whole = (torch.cat([q[:28], qs, q[36:]]), torch.cat([ks, k[16:]]),
                 torch.cat([vs, v[16:]]))
        return _call(*whole, topk, scale, ends, mask)[0][24:40, :, :16]

    assert torch.autograd.gradcheck(f, tuple(t.requires_grad_() for t in parts), eps=1e-6,
                                    atol=1e-6, fast_mode=True)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_training_steps_with_changing_lengths():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    proj = torch.nn.Linear(128, 128, dtype=torch.float32)

    def loss_of(q, k, v, topk, ends):
        out, _, _ = _call(q, k, v, topk, SHAPE["D"] ** -0.5, ends)
        return proj(out).square().mean()

    compiled = torch.compile(loss_of, backend=backend, fullgraph=True, dynamic=True)
    for step, lengths in enumerate(([32, 48], [64, 32], [48, 48], [96, 32])):
        (q, k, v), topk, _, ends = _tensors(lengths, torch.float32, seed=10 + step)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(loss_of(*leaves, topk, ends), leaves)
        got = torch.autograd.grad(compiled(*leaves, topk, ends), leaves)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert len(graphs) <= 2, len(graphs)


def test_autocast_casts_to_bfloat16():
    (q, k, v), topk, scale, ends = _tensors([32, 32], torch.float32, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, smax, _ = _call(q, k, v, topk, scale, ends)
    assert out.dtype == torch.bfloat16 and smax.dtype == torch.float32
    want, _, _ = _call(*(t.to(torch.bfloat16) for t in (q, k, v)), topk, scale, ends)
    assert torch.equal(out, want)


def test_errors_name_the_torch_function():
    (q, k, v), topk, scale, ends = _tensors([32, 48], torch.float32, seed=6)
    with pytest.raises(NsaError, match="npu_nsa_select_attention: query must be a "
                                       "torch.Tensor"):
        _call(q.numpy(), k, v, topk, scale, ends)
    with pytest.raises(NsaError, match=r"npu_nsa_select_attention: topk_indices\[0, 0, 1\]"):
        bad = topk.clone()
        bad[0, 0, 1] = 99
        _call(q, k, v, bad, scale, ends)
    with pytest.raises(NsaError, match="npu_nsa_select_attention: scale_value must be a real"):
        _call(q, k, v, topk, "0.1", ends)
    with pytest.raises(NsaError, match="head dim D must be 192") as info:
        _call(q[..., :128], k[..., :128], v, topk, scale, ends)
    assert info.value.status == 561002 and "strict" not in str(info.value)
