"""The PyTorch bridge: torch_npu names, autograd, custom-op registration, torch.compile."""

import os

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from conftest import assert_grad_accurate
from nsa_numba import NsaError
from nsa_numba._core import pool as _pool

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


@pytest.mark.slow
def test_gradgradcheck_float64():
    # second derivatives: the gradient operator has autograd of its own
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(80, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(32, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    for seq in ([0, 50, 80], torch.tensor([0, 50, 80]), None):
        assert torch.autograd.gradgradcheck(
            lambda a, b, seq=seq: npu_nsa_compress(a, b, 32, 16, actual_seq_len=seq), (x, w))
    g = torch.randn(2, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda gg, a, b: npu_nsa_compress_grad(gg, a, b, 32, 16, actual_seq_len=[0, 50, 80]),
        (g, x, w))


def test_opcheck_both_operators():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(96, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(32, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(3, 2, 16, dtype=torch.float64, generator=gen)
    ends = [0, 50, 96]
    seq = torch.tensor(ends)
    compress = torch.ops.nsa_numba.nsa_compress.default
    for op, args in ((compress, (x, w, 32, 16, None, seq)),
                     (compress, (x, w, 32, 16, ends, None)),
                     (compress, (x, w, 32, 16, None, None)),
                     (torch.ops.nsa_numba.nsa_compress_grad.default,
                      (g, x, w, 32, 16, None, seq)),
                     (torch.ops.nsa_numba.nsa_compress_grad.default,
                      (g, x, w, 32, 16, ends, None))):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("block", [16, 32])
def test_autograd_with_block_equal_to_stride(block):
    # the NPU's backward accepts l == d (MindSpore trains with 16/16 and 32/32)
    x, w, _ = tensors(torch.float32, seed=9)
    w = w[:block].clone()
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = npu_nsa_compress(x, w, block, block, actual_seq_len=SEQ)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(10))
    y.backward(g)
    assert_grad_accurate(x.grad.numpy(), w.grad.numpy(), g.numpy(), x.detach().numpy(),
                         w.detach().numpy(), block, block, SEQ)


def test_calls_use_at_most_torchs_thread_count():
    import numba

    from ddp_train import record_launch_threads
    from nsa_numba._ops import dispatch as _dispatch
    from nsa_numba._core import launch as _launch
    real = _dispatch.launch, _dispatch.run_prepared, _launch.run
    seen = record_launch_threads()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4096, 4, 32, generator=gen).to(torch.bfloat16)   # work for 2 threads
    w = torch.randn(32, 4, generator=gen).to(torch.bfloat16)
    seq = [0, 2000, 4096]
    g = torch.randn(254, 4, 32, generator=gen).to(torch.bfloat16)
    before = torch.get_num_threads()
    pool = numba.config.NUMBA_NUM_THREADS
    results = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results[n] = (npu_nsa_compress(x, w, 32, 16, actual_seq_len=seq),
                          *npu_nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=seq))
    finally:
        torch.set_num_threads(before)
        _dispatch.launch, _dispatch.run_prepared, _launch.run = real
    assert len(seen) == 4 and all(useful >= 2 for _, useful in seen), seen
    assert [ran for ran, _ in seen] == [1, 1, min(2, pool), min(2, pool)]
    assert _launch.count() == pool                  # the caller's own count untouched
    for a, b in zip(results[1], results[2]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


class Compressor(torch.nn.Module):
    """Keys and values compressed from one packed input with their own weights, then
    contracted over the windows (as attention over compressed tokens does, which
    needs both to have the same, data-dependent, length). The loss is linear in each
    output, so every gradient is the operator's own or an exact product."""

    def __init__(self, heads=4, block=32, stride=16):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.block, self.stride = block, stride
        self.wk = torch.nn.Parameter(torch.randn(block, heads, generator=gen) / block)
        self.wv = torch.nn.Parameter(torch.randn(block, heads, generator=gen) / block)

    def forward(self, x, seq, target):
        k = npu_nsa_compress(x, self.wk, self.block, self.stride, actual_seq_len=seq)
        v = npu_nsa_compress(x, self.wv, self.block, self.stride, actual_seq_len=seq)
        return (torch.einsum("knd,knd->nd", k, v) * target).sum()


def batches(count, kind, seed=12, heads=4, dim=32, block=32, stride=16):
    """``count`` packed batches (x, seq, target), each with its own number of
    sequences and lengths."""
    rng = np.random.default_rng(seed)
    out = []
    # Sequences shorter than a window, among others, for tensors. A list's T' is an
    # expression with a max(0, windows) per sequence, on which inductor places guards:
    # a list whose set of too-short sequences changes compiles again, so lists get
    # sequences of at least one window each (the counts below hold for those).
    shortest = 16 if kind == "tensor" else block
    for _ in range(count):
        lengths = rng.integers(shortest, 120, size=int(rng.integers(2, 5)))
        lengths[0] = max(lengths[0], block)              # at least one window
        ends = np.cumsum(lengths).tolist()
        x = torch.from_numpy(rng.standard_normal((ends[-1], heads, dim)).astype(np.float32))
        target = torch.from_numpy(rng.standard_normal((heads, dim)).astype(np.float32))
        seq = {"list": ends, "tuple": tuple(ends), "tensor": torch.tensor(ends)}[kind]
        out.append((x, seq, target))
    return out


def counting_backend(name, graphs):
    """A torch.compile backend: ``name``'s, recording each graph it compiles."""
    from torch._dynamo.backends.registry import lookup_backend
    real = lookup_backend(name)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return real(gm, example_inputs)
    return backend


def train(model, data, step):
    """Each step's gradients (input, then parameters; AdamW updates between steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    grads = []
    for x, seq, target in data:
        opt.zero_grad()
        x = x.clone().requires_grad_(True)
        step(x, seq, target).backward()
        grads.append([x.grad] + [p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


# torch's inductor itself uses torch.jit.script_method, which warns in torch 2.13
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
@pytest.mark.parametrize("kind", ["list", "tuple", "tensor"])
@pytest.mark.parametrize("backend", [
    "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_training_with_changing_sequences(backend, kind, dynamic):
    data = batches(6, kind)
    eager = Compressor()
    want = train(eager, data, eager)
    torch._dynamo.reset()
    graphs = []
    model = Compressor()
    compiled = torch.compile(model, backend=counting_backend(backend, graphs),
                             fullgraph=True, dynamic=dynamic)
    got = train(model, data, compiled)
    for step, (a, b) in enumerate(zip(want, got)):
        for p, q in zip(a, b):
            assert torch.equal(p, q), f"gradients differ at step {step}"
    # A tensor's values never reach a guard, nor its length once that is dynamic:
    # one graph (dynamic=True); by default, a static first graph and one more for
    # each of T and the sequence count as Dynamo sees it change (at most three). A
    # Python list's length always does (Dynamo specialises on it): one graph per
    # sequence count, plus (default) the static first graph and at most one more
    # while Dynamo learns which sizes and values change.
    counts = len({len(seq) for _, seq, _ in data})
    if kind == "tensor":
        assert len(graphs) == 1 if dynamic else 2 <= len(graphs) <= 3, len(graphs)
    elif dynamic:
        assert len(graphs) == counts
    else:
        assert counts + 1 <= len(graphs) <= counts + 2, (len(graphs), counts)


def test_eager_path_and_registered_operator_agree():
    # plain eager calls skip the dispatcher (autograd.Function); the registered
    # operators are what tracing sees: same bits, same derivatives
    from nsa_numba.torch import _CompressFunction
    x, w, g = tensors(torch.bfloat16, seed=13)
    seq = torch.tensor(SEQ)
    results = []
    for call in (npu_nsa_compress,
                 lambda *a, **k: torch.ops.nsa_numba.nsa_compress(*a, None, k["actual_seq_len"])):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = call(xx, ww, 32, 16, actual_seq_len=seq)
        y.backward(g)
        results.append((y, xx.grad, ww.grad, type(y.grad_fn).__name__))
    (y0, dx0, dw0, fn0), (y1, dx1, dw1, fn1) = results
    assert fn0 == "_CompressFunctionBackward" and fn1 != fn0
    for a, b in ((y0, y1), (dx0, dx1), (dw0, dw1)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    with torch.device("cpu"):                 # a function mode: the registered operator
        y = npu_nsa_compress(x, w, 32, 16, actual_seq_len=seq)
    assert torch.equal(y.view(torch.int16), y0.view(torch.int16))
    assert issubclass(_CompressFunction, torch.autograd.Function)


def test_fake_tensors_get_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    # a shape environment gives data-dependent sizes (T' with sequence ends) a symbol
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.empty(272, 4, 32))
        w = mode.from_tensor(torch.empty(32, 4))
        one = npu_nsa_compress(x, w, 32, 16)
        assert tuple(one.shape) == (16, 4, 32)          # (272 - 32) // 16 + 1
        packed = npu_nsa_compress(x, w, 32, 16, actual_seq_len=SEQ)
        assert packed.dim() == 3 and packed.shape[1:] == (4, 32)   # T' from the data
        dx, dw = npu_nsa_compress_grad(one, x, w, 32, 16)
        assert dx.shape == x.shape and dw.shape == w.shape


def test_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint
    x, w, g = tensors(torch.float32, seed=14)
    grads = []
    for wrap in (lambda f, *a: f(*a), lambda f, *a: checkpoint(f, *a, use_reentrant=False)):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = wrap(lambda a, b: npu_nsa_compress(a * 2, b, 32, 16, actual_seq_len=SEQ), xx, ww)
        y.backward(g)
        grads.append((xx.grad, ww.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Compressed(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        x, w, _ = tensors(torch.float16, seed=i)
        return npu_nsa_compress(x, w, 32, 16, actual_seq_len=SEQ)


def test_dataloader_workers_call_the_operator():
    # workers are forked after this process has run kernels (see _core.launch)
    npu_nsa_compress(*tensors(torch.float16)[:2], 32, 16)
    loader = torch.utils.data.DataLoader(_Compressed(), batch_size=2, num_workers=2)
    got = torch.cat(list(loader))
    want = torch.stack([_Compressed()[i] for i in range(4)])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_errors_name_the_torch_npu_functions():
    x, w, g = tensors(torch.float16)
    with pytest.raises(NsaError, match="^npu_nsa_compress: compress_block_size must be a "
                                       "positive multiple of 16, got 20"):
        npu_nsa_compress(x, w, 20, 16)
    with pytest.raises(NsaError, match="dtype must be one of .* got torch.int32") as info:
        npu_nsa_compress(x.to(torch.int32), w, 32, 16)
    assert info.value.status == 161002
    with pytest.raises(NsaError, match="^npu_nsa_compress: actual_seq_len .* must end at "
                                       "T = 272"):
        npu_nsa_compress(x, w, 32, 16, actual_seq_len=[0, 100])
    with pytest.raises(NsaError, match=r"^npu_nsa_compress: actual_seq_len\[1\] must be an "
                                       "integer, got 100.0"):
        npu_nsa_compress(x, w, 32, 16, actual_seq_len=[0, 100.0, 272])
    with pytest.raises(NsaError, match="^npu_nsa_compress: actual_seq_len must hold "
                                       "integers, got dtype torch.float32"):
        npu_nsa_compress(x, w, 32, 16, actual_seq_len=torch.tensor([0.0, 272.0]))
    with pytest.raises(NsaError, match="^npu_nsa_compress_grad: compress_block_size must be "
                                       ">= compress_stride, got compress_block_size=32 and "
                                       "compress_stride=48"):
        npu_nsa_compress_grad(g, x, w, 32, 48, actual_seq_len=SEQ)
    with pytest.raises(NsaError, match="^npu_nsa_compress_grad: grad must have shape"):
        npu_nsa_compress_grad(g[1:], x, w, 32, 16, actual_seq_len=SEQ)
    with pytest.raises(NsaError, match="^npu_nsa_compress: compress_stride must be an "
                                       "integer, got 16.0"):
        npu_nsa_compress(x, w, 32, 16.0)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_tensors_cross_without_copies(dtype):
    x = torch.randn(8, 3, 32).to(dtype)[:, 1:, ::2]
    a = _as_numpy("test", "x", x)
    assert a.ctypes.data == x.data_ptr()
    assert a.strides == tuple(s * x.element_size() for s in x.stride())


def test_training_steps_take_their_input_gradient_from_kept_memory(kept):
    # autograd lets the backward allocate its input gradient every step; once a
    # step's gradient is dropped, the next step's comes from the same kept buffer,
    # and one still held is left alone
    gen = torch.Generator().manual_seed(7)
    seq = [3000, 8192]
    x = torch.randn(8192, 4, 128, generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = torch.randn(32, 4, generator=gen).to(torch.bfloat16).requires_grad_(True)
    assert x.numel() * 2 >= _pool.MIN_BYTES
    held = []
    for step in range(4):
        x.grad = w.grad = None
        y = npu_nsa_compress(x, w, 32, 16, actual_seq_len=seq)
        g = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
        y.backward(g)
        xn = numpy_of(x)        # the check's call writes into a given array: no kept one
        dx, dw = nsa_numba.nsa_compress_grad(numpy_of(g), xn, numpy_of(w), 32, 16,
                                             actual_seq_len=seq,
                                             input_grad=np.empty_like(xn))
        assert same_bits(x.grad, dx) and same_bits(w.grad, dw)
        # steps 0-2 drop their gradient before the next one: one buffer serves them
        # all; step 3 runs while step 2's is held, so it needs a second one
        assert _pool.stats()[0] == (1 if step < 3 else 2)
        if step == 2:
            held = [x.grad, x.grad.clone()]
    assert torch.equal(held[0].view(torch.int16), held[1].view(torch.int16))


def test_an_input_gradient_still_held_is_not_written_over(kept):
    gen = torch.Generator().manual_seed(8)
    seq = [8192]
    x = torch.randn(8192, 4, 128, generator=gen).to(torch.bfloat16)
    w = torch.randn(32, 4, generator=gen).to(torch.bfloat16)
    g = torch.randn(511, 4, 128, generator=gen).to(torch.bfloat16)
    first, _ = npu_nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=seq)
    saved, address = first.clone(), first.data_ptr()
    second, _ = npu_nsa_compress_grad(2 * g, x, w, 32, 16, actual_seq_len=seq)
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first.view(torch.int16), saved.view(torch.int16))
    assert _pool.stats()[0] == 2
    del first
    third, _ = npu_nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=seq)
    assert torch.equal(third.view(torch.int16), saved.view(torch.int16))
    assert third.data_ptr() == address and _pool.stats()[0] == 2   # first's buffer


# -- the with-cache operator ---------------------------------------------------------------

def infer_tensors(dtype, seed=0):
    """A paged decoding step as tensors: 6 sequences over 8 pages of 64 tokens."""
    from test_infer import paged_problem
    lengths = [32, 33, 48, 80, 64, 95]
    x, w, slots, table, cache = paged_problem(lengths, N=4, D=32, dtype=np.float32, seed=seed)
    x, w, cache = (torch.from_numpy(a).to(dtype) for a in (x, w, cache))
    return (x, w, torch.from_numpy(slots).to(torch.int32),
            torch.from_numpy(table.clip(0)).to(torch.int32), lengths, cache)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_infer_updates_the_cache_in_place(dtype):
    from nsa_numba.torch import npu_nsa_compress_infer
    x, w, slots, table, lengths, cache = infer_tensors(dtype)
    want = numpy_of(cache).copy()
    nsa_numba.nsa_compress_infer(numpy_of(x), numpy_of(w), slots.numpy(), 32, 16, 64,
                                 block_table=table.numpy(), actual_seq_len=lengths,
                                 cache=want)
    ptr, version = cache.data_ptr(), cache._version
    got = npu_nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                 actual_seq_len=torch.tensor(lengths), cache=cache)
    assert got is cache and cache.data_ptr() == ptr
    assert cache._version > version                 # autograd sees the mutation
    assert same_bits(cache, want)


def test_infer_opcheck():
    x, w, slots, table, lengths, cache = infer_tensors(torch.float64, seed=1)
    for args in ((x, w, slots, 32, 16, 64, table, torch.tensor(lengths), cache),
                 (x.reshape(-1, 4, 32)[:400], w, slots, 32, 16, 64, None,
                  torch.tensor(lengths), cache)):
        result = torch.library.opcheck(torch.ops.nsa_numba.nsa_compress_infer.default, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor",
                                                               marks=pytest.mark.slow)])
def test_infer_decoding_steps_under_torch_compile(backend):
    from nsa_numba.torch import npu_nsa_compress_infer
    x, w, slots, table, lengths, cache = infer_tensors(torch.bfloat16, seed=2)

    def step(cache, lengths):
        npu_nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                               actual_seq_len=lengths, cache=cache)
        return cache

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    for k in range(32):                             # every sequence grows by one a step
        now = torch.tensor([n + k for n in lengths])
        step(eager_cache, now)
        compiled(compiled_cache, now)
        assert torch.equal(eager_cache.view(torch.int16), compiled_cache.view(torch.int16)), k
    assert not torch.equal(eager_cache, cache)


def test_infer_errors_name_the_torch_npu_function():
    from nsa_numba.torch import npu_nsa_compress_infer
    x, w, slots, table, lengths, cache = infer_tensors(torch.float16)
    with pytest.raises(NsaError, match="^npu_nsa_compress_infer: cache is required") as info:
        npu_nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                               actual_seq_len=lengths)
    assert info.value.status == 161001
    with pytest.raises(NsaError, match=r"^npu_nsa_compress_infer: block_table\[0, 0\] = 99 "
                                       r"is outside the 15 pages"):
        npu_nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table * 0 + 99,
                               actual_seq_len=lengths, cache=cache)
    with pytest.raises(NsaError, match="^npu_nsa_compress_infer: page_block_size must be 64 "
                                       "or 128, got 32") as info:
        npu_nsa_compress_infer(x, w, slots, 32, 16, 32, block_table=table,
                               actual_seq_len=lengths, cache=cache)
    assert info.value.status == 561002
