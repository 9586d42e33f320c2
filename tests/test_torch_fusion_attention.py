"""npu_fusion_attention through PyTorch: the NumPy API's bits (forward and gradient),
autograd equal to the explicit gradient call, opcheck, float64 gradcheck through
bands, holes and fully masked rows, errors, and a model's use: an NSA layer's three
branches (compressed, selected and the sliding window) trained under torch.compile
with lengths that change every step, then generating token by token."""

import os

import pytest

if os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
    import torch
else:
    torch = pytest.importorskip("torch")

import nsa_numba  # noqa: E402
from nsa_numba import NsaError  # noqa: E402
from nsa_numba.torch import (npu_fusion_attention, npu_fusion_attention_grad,  # noqa: E402
                             npu_nsa_compress, npu_nsa_compress_attention,
                             npu_nsa_select_attention)
from test_torch_compress_attention import _numpy, _same_bits  # noqa: E402

TRIU = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
         torch.float64: "float64"}


def _tensors(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]


WINDOW = dict(atten_mask=TRIU, sparse_mode=4, pre_tockens=63, next_tockens=0)


@pytest.mark.parametrize("dtype", list(NAMES), ids=list(NAMES.values()))
@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_autograd_gives_the_numpy_api_bits(dtype, layout):
    if layout == "TND":
        shapes, lists = ((300, 8, 64), (300, 2, 64), (300, 2, 32)), dict(
            actual_seq_qlen=[180, 300], actual_seq_kvlen=[180, 300])
    else:
        shapes, lists = ((2, 8, 150, 64), (2, 2, 150, 64), (2, 2, 150, 32)), {}
    q, k, v = (t.requires_grad_() for t in _tensors(shapes, dtype, seed=1))
    out, smax, ssum, softmax_out, seed, offset, numels = npu_fusion_attention(
        q, k, v, 8, layout, scale=0.125, **WINDOW, **lists)
    assert softmax_out.numel() == 0 and (seed, offset) == (0, 0)
    assert numels == (8 * (180 * 180 + 120 * 120) if layout == "TND" else 2 * 8 * 150 * 150)
    assert not smax.requires_grad and smax.dtype == (torch.float64 if dtype == torch.float64
                                                     else torch.float32)
    dy = _tensors([out.shape], dtype, seed=2)[0]
    out.backward(dy)
    arrays = [_numpy(t) for t in (q, k, v)]
    kw = dict(WINDOW, atten_mask=TRIU.numpy(), **lists)
    want = nsa_numba.fusion_attention(*arrays, 8, layout, scale=0.125, **kw)
    for got, ref in zip((out, smax, ssum), want):
        assert _same_bits(got, ref)
    grads = nsa_numba.fusion_attention_grad(*arrays, _numpy(dy), 8, layout, softmax_max=want[1],
                                            softmax_sum=want[2], attention_in=want[0],
                                            scale_value=0.125, **kw)
    explicit = npu_fusion_attention_grad(q.detach(), k.detach(), v.detach(), dy, 8, layout,
                                         softmax_max=smax, softmax_sum=ssum,
                                         attention_in=out.detach(), scale_value=0.125,
                                         **WINDOW, **lists)
    assert explicit[3] is None
    for got, ref, again in zip((q.grad, k.grad, v.grad), grads, explicit):
        assert _same_bits(got, ref) and torch.equal(got, again)


def test_opcheck_both_operators():
    q, k, v = _tensors(((2, 40, 4, 24), (2, 50, 2, 24), (2, 50, 2, 16)), torch.float32, 3)
    mask = torch.rand(2, 4, 40, 50, generator=torch.Generator().manual_seed(4)) < 0.3
    args = (q, k, v, 4, "BSND", mask, 0.2, 1.0, 10, 5, 0, None, None, 0)
    torch.library.opcheck(torch.ops.nsa_numba.fusion_attention.default, args)
    out, smax, ssum = torch.ops.nsa_numba.fusion_attention(*args)
    grad_args = (q, k, v, torch.randn_like(out), 4, "BSND", mask, smax, ssum, out, 0.2, 1.0,
                 10, 5, 0, None, None, 0)
    torch.library.opcheck(torch.ops.nsa_numba.fusion_attention_grad.default, grad_args)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["band", "holes", "bsh"])
def test_float64_gradcheck(case):
    if case == "bsh":
        shapes, layout, lists = ((2, 12, 16), (2, 9, 8), (2, 9, 6)), "BSH", {}
        kw = dict(atten_mask=TRIU, sparse_mode=3)
    else:
        shapes, layout = ((20, 4, 8), (22, 2, 8), (22, 2, 4)), "TND"
        lists = dict(actual_seq_qlen=[8, 20], actual_seq_kvlen=[10, 22])
        kw = dict(atten_mask=TRIU, sparse_mode=4, pre_tockens=3, next_tockens=1)
        if case == "holes":         # the [T1, T2] mask, with holes and a fully masked row
            mask = torch.rand(20, 22, generator=torch.Generator().manual_seed(5)) < 0.3
            mask[3] = True
            kw = dict(atten_mask=mask, sparse_mode=1)
    q, k, v = _tensors(shapes, torch.float64, seed=6)

    def f(a, b, c):
        return npu_fusion_attention(a, b, c, 2 if layout == "BSH" else 4, layout, scale=0.4,
                                    **kw, **lists)[0]
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


def test_errors_name_the_torch_function():
    q, k, v = _tensors(((1, 16, 4, 16), (1, 16, 4, 16), (1, 16, 4, 16)), torch.float32)
    with pytest.raises(NsaError, match="npu_fusion_attention: query must be a torch.Tensor"):
        npu_fusion_attention(q.numpy(), k, v, 4, "BSND")
    with pytest.raises(NsaError, match="npu_fusion_attention: input_layout must be one of"):
        npu_fusion_attention(q, k, v, 4, "BSDN")
    with pytest.raises(NotImplementedError, match="pse is not supported"):
        npu_fusion_attention(q, k, v, 4, "BSND", pse=q)
    with pytest.raises(NotImplementedError, match="dropout"):
        npu_fusion_attention(q, k, v, 4, "BSND", keep_prob=0.5)
    with pytest.raises(NsaError, match="2048 x 2048") as info:
        npu_fusion_attention(q, k, v, 4, "BSND", atten_mask=TRIU[:16, :16], sparse_mode=2)
    assert info.value.status == 561002


WINDOW_KEYS = 64


class _NSALayer(torch.nn.Module):
    """The three branches of an NSA layer as a model calls them on the NPU: compressed
    attention over learnt compressions of the keys and values, selected attention over
    the blocks it picks, and the sliding window through the generic attention."""

    L, STRIDE, L_SEL, COUNT = 32, 16, 64, 2

    def __init__(self, N1=4, N2=1):
        super().__init__()
        g = torch.Generator().manual_seed(8)
        self.wk = torch.nn.Parameter(torch.rand(self.L, N2, generator=g) / self.L)
        self.wv = torch.nn.Parameter(torch.rand(self.L, N2, generator=g) / self.L)
        self.gates = torch.nn.Parameter(torch.ones(3))
        self.N1 = N1

    def forward(self, q, k, v, lengths):
        L, S, Ls = self.L, self.STRIDE, self.L_SEL
        ends = _ends(lengths)
        kc = npu_nsa_compress(k, self.wk, L, S, actual_seq_len=ends)
        vc = npu_nsa_compress(v, self.wv, L, S, actual_seq_len=ends)
        cmp = _ends([(n - L) // S + 1 for n in lengths])
        sel = _ends([((n - L) // S + 1 + Ls // S - 1) // (Ls // S) for n in lengths])
        most = max(lengths)
        mask = torch.arange((most - L) // S + 1)[None, :] * S + L - 1 > torch.arange(most)[:, None]
        scale = q.shape[2] ** -0.5
        o_cmp, topk, _, _ = npu_nsa_compress_attention(
            q, kc, vc, scale, self.N1, L, S, Ls, self.COUNT, atten_mask=mask,
            actual_seq_qlen=ends, actual_cmp_seq_kvlen=cmp, actual_sel_seq_kvlen=sel)
        o_sel, _, _ = npu_nsa_select_attention(
            q, k, v, topk, scale, self.N1, Ls, self.COUNT, atten_mask=mask,
            actual_seq_qlen=ends, actual_seq_kvlen=ends)
        o_win = npu_fusion_attention(q, k, v, self.N1, "TND", atten_mask=TRIU, scale=scale,
                                     pre_tockens=WINDOW_KEYS - 1, next_tockens=0,
                                     actual_seq_qlen=ends, actual_seq_kvlen=ends,
                                     sparse_mode=4)[0]
        return self.gates[0] * o_cmp + self.gates[1] * o_sel + self.gates[2] * o_win


def _ends(lengths):
    out, total = [], 0
    for n in lengths:
        total = total + n
        out.append(total)
    return out


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_an_nsa_layer_trains_compiled_then_generates():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = _NSALayer()
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step, lengths in enumerate(([256, 192], [128, 320], [192, 192], [320, 128])):
        g = torch.Generator().manual_seed(20 + step)
        T = sum(lengths)
        q = torch.randn(T, 4, 192, generator=g).requires_grad_()
        k = torch.randn(T, 1, 192, generator=g).requires_grad_()
        v = torch.randn(T, 1, 128, generator=g).requires_grad_()
        leaves = [q, k, v, *layer.parameters()]
        want = torch.autograd.grad(layer(q, k, v, lengths).square().mean(), leaves)
        loss = compiled(q, k, v, lengths).square().mean()
        got = torch.autograd.grad(loss, leaves, retain_graph=True)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in want)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert len(graphs) <= 2, len(graphs)
    # generation: each new token's query over the keys so far; the window branch is a
    # one-row sequence whose band (mode 4, from the bottom-right) sees the last 64 keys
    g = torch.Generator().manual_seed(40)
    k = torch.randn(300, 1, 192, generator=g)
    v = torch.randn(300, 1, 128, generator=g)
    with torch.no_grad():
        for n in (100, 101, 250):
            q = torch.randn(1, 4, 192, generator=g)
            out = npu_fusion_attention(q, k[:n], v[:n], 4, "TND", atten_mask=TRIU,
                                       scale=192 ** -0.5, pre_tockens=WINDOW_KEYS - 1,
                                       next_tockens=0, actual_seq_qlen=[1],
                                       actual_seq_kvlen=[n], sparse_mode=4)[0]
            s = (q[0] @ k[n - WINDOW_KEYS:n, 0].T) * 192 ** -0.5
            want = torch.softmax(s.double(), -1) @ v[n - WINDOW_KEYS:n, 0].double()
            assert torch.allclose(out[0].double(), want, atol=2e-5)
