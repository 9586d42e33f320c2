"""The PyTorch bridge: torch_npu names, autograd, custom-op registration, torch.compile."""

import os

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from nsa_numba import NsaError

if os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
    import torch  # CI: torch must be there, these tests must run
else:
    torch = pytest.importorskip("torch")

from nsa_numba.torch import _as_numpy, npu_nsa_compress, npu_nsa_compress_grad  # noqa: E402

SEQ = [0, 100, 272]
TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NP_DTYPES = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16,
             torch.float32: np.float32, torch.float64: np.float64}


def tensors(dtype, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(272, 4, 64 if strided else 32, generator=gen).to(dtype)
    if strided:
        x = x[:, :, ::2]                          # non-contiguous view
    w = torch.randn(32, 4, generator=gen).to(dtype)
    g = torch.randn(14, 4, 32, generator=gen).to(dtype)   # 5 + 9 windows
    return x, w, g


def same_bits(t, a):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return np.array_equal(t.contiguous().numpy().view(np.uint8),
                          np.ascontiguousarray(a).view(np.uint8))


def numpy_of(t):
    return t.detach().float().numpy().astype(NP_DTYPES[t.dtype])


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_matches_the_numpy_api_bitwise(dtype, strided):
    x, w, g = tensors(dtype, strided=strided)
    y = npu_nsa_compress(x, w, 32, 16, actual_seq_len=SEQ)
    assert y.dtype == dtype and y.shape == (14, 4, 32)
    assert same_bits(y, nsa_numba.nsa_compress(numpy_of(x), numpy_of(w), 32, 16,
                                               actual_seq_len=SEQ))
    dx, dw = npu_nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=SEQ)
    ndx, ndw = nsa_numba.nsa_compress_grad(numpy_of(g), numpy_of(x), numpy_of(w), 32, 16,
                                           actual_seq_len=SEQ)
    assert same_bits(dx, ndx) and same_bits(dw, ndw)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_autograd_calls_the_grad_operator(dtype):
    x, w, g = tensors(dtype, seed=1)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = npu_nsa_compress(x, w, 32, 16, actual_seq_len=torch.tensor(SEQ))
    y.backward(g)
    dx, dw = npu_nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=np.array(SEQ))
    assert same_bits(x.grad, _as_numpy("test", "dx", dx))
    assert same_bits(w.grad, _as_numpy("test", "dw", dw))


def test_only_the_requested_gradients():
    x, w, g = tensors(torch.float32)
    w.requires_grad_(True)
    npu_nsa_compress(x, w, 32, 16, actual_seq_len=SEQ).backward(g)
    assert x.grad is None and w.grad is not None


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(32, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: npu_nsa_compress(a, b, 32, 16, actual_seq_len=[0, 50, 96]), (x, w))


def test_opcheck_both_operators():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(96, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(32, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(3, 2, 16, dtype=torch.float64, generator=gen)
    for op, args in ((torch.ops.nsa_numba.nsa_compress.default, (x, w, 32, 16, [0, 50, 96])),
                     (torch.ops.nsa_numba.nsa_compress_grad.default,
                      (g, x.detach(), w.detach(), 32, 16, [0, 50, 96]))):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


class Compressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(32, 4, generator=gen))
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        k = npu_nsa_compress(self.proj(x), self.w, 32, 16, actual_seq_len=SEQ)
        return (k * k).sum()


# torch's inductor itself uses torch.jit.script_method, which warns in torch 2.13
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", [
    "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_full_graph(backend):
    torch._dynamo.reset()
    model = Compressor()
    x = torch.randn(272, 4, 32, generator=torch.Generator().manual_seed(6))
    expected = model(x)
    expected.backward()
    expected_grad = model.w.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    got = compiled(x)
    got.backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(model.w.grad, expected_grad)


def test_errors_are_nsa_errors():
    x, w, g = tensors(torch.float16)
    with pytest.raises(NsaError, match="compress_block_size must be a positive multiple"):
        npu_nsa_compress(x, w, 20, 16)
    with pytest.raises(NsaError, match="dtype must be one of .* got torch.int32") as info:
        npu_nsa_compress(x.to(torch.int32), w, 32, 16)
    assert info.value.status == 161002
    with pytest.raises(NsaError, match="must end at T = 272"):
        npu_nsa_compress(x, w, 32, 16, actual_seq_len=[0, 100])
    with pytest.raises(NsaError, match="compress_block_size must be > compress_stride"):
        npu_nsa_compress_grad(g, x, w, 32, 32, actual_seq_len=SEQ)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_tensors_cross_without_copies(dtype):
    x = torch.randn(8, 3, 32).to(dtype)[:, 1:, ::2]
    a = _as_numpy("test", "x", x)
    assert a.ctypes.data == x.data_ptr()
    assert a.strides == tuple(s * x.element_size() for s in x.stride())
