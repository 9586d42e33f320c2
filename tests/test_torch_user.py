"""The PyTorch bridge as a torch_npu user's first training script meets it: models
that contract the compressed keys (attention-shaped) under inductor, a fixed number of
graphs for list-form sequence ends, errors that fit the function called, mixed
precision under autocast, and the eager decoding path."""

import os

import numpy as np
import pytest

if os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
    import torch
else:
    torch = pytest.importorskip("torch")

from nsa_numba import NsaError  # noqa: E402
from nsa_numba.torch import (npu_nsa_compress, npu_nsa_compress_grad,  # noqa: E402
                             npu_nsa_compress_infer, pad_sequence_ends)


class Attention(torch.nn.Module):
    """Queries attend over keys and values compressed from the packed input: the
    contraction, softmax and backward through both compress calls that a real NSA
    layer runs (and that an element-wise loss would not exercise)."""

    def __init__(self, heads=2, block=32, stride=16, dtype=torch.float32, values=True):
        super().__init__()
        self.values = values
        gen = torch.Generator().manual_seed(3)
        self.block, self.stride = block, stride
        self.wk = torch.nn.Parameter((torch.randn(block, heads, generator=gen) / block).to(dtype))
        self.wv = torch.nn.Parameter((torch.randn(block, heads, generator=gen) / block).to(dtype))

    def forward(self, x, seq):
        k = npu_nsa_compress(x, self.wk, self.block, self.stride, actual_seq_len=seq)
        p = torch.einsum("thd,khd->htk", x, k).float().softmax(-1)
        if not self.values:
            return (p * p).sum()
        v = npu_nsa_compress(x, self.wv, self.block, self.stride, actual_seq_len=seq)
        return torch.einsum("htk,khd->thd", p, v.float()).square().sum()


def grads(model, x, seq, step):
    x = x.clone().requires_grad_(True)
    model.zero_grad()
    loss = step(x, seq)
    loss.backward()
    return loss.detach(), x.grad, [p.grad.clone() for p in model.parameters()
                                   if p.grad is not None]


def batch(T, seed, heads=2, dim=32, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, heads, dim, generator=gen) / 4).to(dtype)


# torch's inductor itself uses torch.jit.script_method, which warns in torch 2.13
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
@pytest.mark.parametrize("kind", ["tensor", "list"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_over_compressed_keys_under_inductor(kind, dynamic, dtype):
    # with tensor ends in bfloat16, inductor's bmm lowering asks whether the
    # data-dependent T' equals 1 (a torch limitation, docs/reference.md "torch.compile
    # and data-dependent lengths"), so that case contracts the keys only
    torch._dynamo.reset()
    model = Attention(dtype=dtype, values=not (kind == "tensor" and dtype == torch.bfloat16))
    compiled = torch.compile(model, backend="inductor", fullgraph=True, dynamic=dynamic)
    for step, ends in enumerate([[100, 250], [90, 200, 300]]):
        x = batch(ends[-1], step, dtype=dtype)
        seq = torch.tensor(ends) if kind == "tensor" else ends
        want = grads(model, x, seq, model)
        got = grads(model, x, seq, compiled)
        tol = dict(rtol=2e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4,
                                                                            atol=1e-5)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, **tol)


def test_the_output_length_is_bounded_for_the_compiler():
    # the fake kernel's data-dependent T' carries the strict rules' bounds
    # (1 <= T' <= T // d), which is what lets inductor lower a contraction over it
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        x = torch.empty(300, 2, 32)
        w = torch.empty(32, 2)
        k = torch.ops.nsa_numba.nsa_compress(x, w, 32, 16, None, torch.tensor([100, 300]))
    rows = k.shape[0]
    assert env.bound_sympy(rows.node.expr).lower == 1
    assert env.bound_sympy(rows.node.expr).upper == 300 // 16


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_padded_list_ends_compile_a_fixed_number_of_graphs():
    # a list's length is part of the graph; padded to one count, batches with 2 to 5
    # sequences share the graphs that one count compiles
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = Attention()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    rng = np.random.default_rng(1)
    for step in range(5):
        lengths = rng.integers(32, 90, size=2 + step % 4)
        ends = np.cumsum(lengths).tolist()
        x = batch(ends[-1], step)
        want = grads(model, x, ends, model)
        got = grads(model, x, pad_sequence_ends(ends, 6), compiled)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1, len(graphs)


def test_pad_sequence_ends_refuses_what_does_not_fit():
    assert pad_sequence_ends((10, 20), 4) == [10, 20, 20, 20]
    with pytest.raises(NsaError, match="holds 3 sequence ends, more than count = 2"):
        pad_sequence_ends([1, 2, 3], 2)
    with pytest.raises(NsaError, match="count must be an int >= 1, got 0"):
        pad_sequence_ends([1], 0)


# -- errors that fit the function called --------------------------------------------

def test_numpy_arrays_get_a_clean_error():
    x, w = np.ones((64, 2, 32), np.float32), np.ones((32, 2), np.float32)
    with pytest.raises(NsaError, match=r"^npu_nsa_compress: input must be a torch.Tensor, "
                                       r"got numpy.ndarray \(NumPy arrays go to "
                                       r"nsa_numba.nsa_compress") as info:
        npu_nsa_compress(x, w, 32, 16)
    assert info.value.status == 161002
    with pytest.raises(NsaError, match="^npu_nsa_compress_grad: grad must be a torch.Tensor"):
        npu_nsa_compress_grad(np.ones((3, 2, 32), np.float32), torch.from_numpy(x),
                              torch.from_numpy(w), 32, 16)
    with pytest.raises(NsaError, match="^npu_nsa_compress: weight is required"):
        npu_nsa_compress(torch.from_numpy(x), None, 32, 16)


def test_messages_name_only_the_options_the_torch_functions_take():
    x, w = torch.ones(64, 2, 20), torch.ones(32, 2)
    with pytest.raises(NsaError) as info:
        npu_nsa_compress(x, w, 32, 16)
    assert "head dim D must be a multiple of 16, got 20 (shape (64, 2, 20))" in str(info.value)
    x = torch.ones(300, 2, 32)
    with pytest.raises(NsaError) as info:
        npu_nsa_compress(x, w, 32, 16, actual_seq_len=[0, 100])
    message = str(info.value)
    assert "actual_seq_len (cumulative ends) must end at T = 300" in message
    for option in ("layout", "actual_seq_len_type", "strict"):
        assert option not in message


def test_lengths_passed_as_ends_are_recognised():
    x, w = torch.ones(300, 2, 32), torch.ones(32, 2)
    with pytest.raises(NsaError, match=r"these look like per-sequence lengths \(they sum to "
                                       r"T = 300\): the cumulative ends of those lengths are "
                                       r"\[100, 250, 300\]$"):
        npu_nsa_compress(x, w, 32, 16, actual_seq_len=[100, 150, 50])
    import nsa_numba          # the NumPy API also offers its actual_seq_len_type
    with pytest.raises(NsaError, match=r"\[100, 250, 300\], or pass actual_seq_len_type=1$"):
        nsa_numba.nsa_compress(x.numpy(), w.numpy(), 32, 16, actual_seq_len=[100, 150, 50])


def test_decoding_rules_print_their_bound_and_no_foreign_options():
    kv = torch.zeros(12, 128, 2, 32)
    w = torch.ones(32, 2)
    table = torch.arange(12).reshape(2, 6)
    with pytest.raises(NsaError, match=r"must have more than \(block_num \* page_block_size - "
                                       r"compress_block_size\) / compress_stride = "
                                       r"\(12 \* 128 - 32\) / 16 = 94 rows \(at least 95\), "
                                       r"got 93") as info:
        npu_nsa_compress_infer(kv, w, torch.tensor([0, 1]), 32, 16, 128, block_table=table,
                               actual_seq_len=torch.tensor([48, 48]),
                               cache=torch.zeros(93, 2, 32))
    assert info.value.status == 561002
    with pytest.raises(NsaError) as info:
        npu_nsa_compress_infer(kv, w, torch.tensor([3, 3]), 32, 16, 128, block_table=table,
                               actual_seq_len=torch.tensor([48, 48]),
                               cache=torch.zeros(95, 2, 32))
    assert "rows must not repeat among writing sequences" in str(info.value)
    assert "strict" not in str(info.value)


# -- mixed precision ------------------------------------------------------------------

def autocast_step(x, wk):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k = npu_nsa_compress(x, wk, 32, 16, actual_seq_len=[100, 200])
        return k, (k.float() * 0.5).square().sum()


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_autocast_casts_float32_parameters(mode):
    x = batch(200, 0)                                       # float32 activations
    wk = torch.nn.Parameter(torch.randn(32, 2) / 32)       # float32 parameters
    step = autocast_step if mode == "eager" else torch.compile(
        autocast_step, backend="aot_eager", fullgraph=True)
    k, loss = step(x, wk)
    assert k.dtype == torch.bfloat16
    want = npu_nsa_compress(x.to(torch.bfloat16), wk.detach().to(torch.bfloat16), 32, 16,
                            actual_seq_len=[100, 200])
    assert torch.equal(k.view(torch.int16), want.view(torch.int16))
    loss.backward()
    assert wk.grad.dtype == torch.float32                   # back through the cast


def test_float64_is_not_cast_under_autocast():
    x = batch(200, 0).double()
    w = torch.randn(32, 2, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert npu_nsa_compress(x, w, 32, 16).dtype == torch.float64


# -- the eager decoding path ----------------------------------------------------------

@pytest.mark.parametrize("form", ["tensors", "lists"])
def test_eager_decoding_matches_the_registered_operator(form):
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(8, 64, 2, 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(32, 2, generator=gen).to(torch.bfloat16)
    slots, lengths = [5, 1, 7], [48, 50, 96]
    table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    args = (slots, lengths) if form == "lists" else (torch.tensor(slots), torch.tensor(lengths))
    eager = torch.zeros(32, 2, 32, dtype=torch.bfloat16)
    npu_nsa_compress_infer(kv, w, args[0], 32, 16, 64, block_table=table,
                           actual_seq_len=args[1], cache=eager)
    registered = torch.zeros(32, 2, 32, dtype=torch.bfloat16)
    torch.ops.nsa_numba.nsa_compress_infer(kv, w, torch.tensor(slots), 32, 16, 64, table,
                                           torch.tensor(lengths), registered)
    assert torch.equal(eager.view(torch.int16), registered.view(torch.int16))
    assert eager[5].any() and eager[7].any() and not eager[1].any()   # 50 is off a boundary
