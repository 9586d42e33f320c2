"""The pipeline (``_ops.pipeline``): every operator's calls go validate -> plan ->
allocate -> launch; a call whose signature a successful call had runs the prepared
call and skips planning, with the full path's results and errors."""

import threading
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from conftest import assert_forward_accurate, assert_grad_accurate, random_problem
from nsa_numba import NsaError, api
from nsa_numba._ops import dispatch as _dispatch, operators as _operators, pipeline as _pipeline
from nsa_numba._core import launch as _launch, pool as _pool

L, S = 32, 16
T, N, D = 300, 4, 32
SEQ = [100, 172, 300]
TP = 5 + 3 + 7           # windows of the three sequences


@pytest.fixture
def plans(monkeypatch):
    """Start with nothing kept; count the NumPy API's calls that are planned the full
    way."""
    _pipeline.forget()
    counted = {"forward": 0, "grad": 0}
    real = _operators.COMPRESS.planner, _operators.COMPRESS_GRAD.planner

    def forward(*args):
        counted["forward"] += 1
        return real[0](*args)

    def grad(*args):
        counted["grad"] += 1
        return real[1](*args)

    monkeypatch.setattr(api, "COMPRESS", replace(_operators.COMPRESS, planner=forward))
    monkeypatch.setattr(api, "COMPRESS_GRAD", replace(_operators.COMPRESS_GRAD, planner=grad))
    yield counted
    _pipeline.forget()


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def full_way(fn, *args, **kwargs):
    """``fn``'s result with nothing kept, and what it keeps dropped after."""
    cache = _pipeline._prepared
    saved = cache._items.copy(), cache._bytes
    cache.clear()
    try:
        return fn(*args, **kwargs)
    finally:
        cache.clear()
        cache._items.update(saved[0])
        cache._bytes = saved[1]


SEQUENCES = [(SEQ, 0), (tuple(SEQ), 0), (np.array(SEQ, np.int32), 0), ([100, 72, 128], 1),
             (None, 0)]


@pytest.mark.parametrize("seq,seq_type", SEQUENCES, ids=["list", "tuple", "array", "lengths",
                                                         "none"])
@pytest.mark.parametrize("given", [False, True], ids=["allocated", "given"])
def test_repeated_calls_are_the_full_paths_results(plans, dtype, seq, seq_type, given):
    for seed in range(3):     # new arrays each call, as a model's layers make them
        x, w, g = random_problem(T, N, D, L, S, seq, dtype, seq_type, seed=seed)
        out = np.full((g.shape[0], N, D), np.nan, dtype) if given else None
        dx = np.full(x.shape, np.nan, dtype) if given else None
        dw = np.full(w.shape, np.nan, dtype) if given else None
        y = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=seq, actual_seq_len_type=seq_type,
                                   out=out)
        gx, gw = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=seq,
                                             actual_seq_len_type=seq_type, input_grad=dx,
                                             weight_grad=dw)
        if given:
            assert y is out and gx is dx and gw is dw
        assert_forward_accurate(y, x, w, L, S, seq, seq_type)
        assert_grad_accurate(gx, gw, g, x, w, L, S, seq, seq_type)
        # the same calls the full way: the same bits
        assert np.array_equal(bits(full_way(nsa_numba.nsa_compress, x, w, L, S,
                                            actual_seq_len=seq,
                                            actual_seq_len_type=seq_type)), bits(y))
        full = full_way(nsa_numba.nsa_compress_grad, g, x, w, L, S, actual_seq_len=seq,
                        actual_seq_len_type=seq_type)
        assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(full, (gx, gw)))
    # the first seed's call was planned, and each full-way call; no other call was
    assert plans == {"forward": 4, "grad": 4}


@pytest.mark.parametrize("layout,shape,out_shape", [
    ("BSND", (3, 100, N, D), (3, 5, N, D)),
    ("BSH", (3, 100, N * D), (3, 5, N * D)),
])
def test_padded_layouts_repeat(plans, layout, shape, out_shape):
    rng = np.random.default_rng(1)
    for _ in range(2):
        x = rng.standard_normal(shape).astype(np.float32)
        w = rng.standard_normal((L, N)).astype(np.float32)
        g = rng.standard_normal(out_shape).astype(np.float32)
        y = nsa_numba.nsa_compress(x, w, L, S, layout=layout)
        gx, gw = nsa_numba.nsa_compress_grad(g, x, w, L, S, layout=layout)
        x3 = x.reshape(3 * 100, N, D)
        ends = [100, 200, 300]
        assert_forward_accurate(y.reshape(-1, N, D), x3, w, L, S, ends)
        assert_grad_accurate(gx.reshape(-1, N, D), gw, g.reshape(-1, N, D), x3, w, L, S, ends)
    assert plans == {"forward": 1, "grad": 1}


def good(dtype=np.float16, seed=0):
    x, w, g = random_problem(T, N, D, L, S, SEQ, dtype, seed=seed)
    return x, w, g


LENGTHS = dict(actual_seq_len=[1, 171, 128], actual_seq_len_type=1)
REJECTED = [
    # (a valid call, a change that compares equal to it (==, hash) but is refused)
    ({}, dict(actual_seq_len=[100.0, 172, 300]), "must be an integer"),
    (LENGTHS, dict(actual_seq_len=[True, 171, 128]), "must be an integer"),
    ({}, dict(compress_block_size=32.0), "compress_block_size must be an integer"),
    ({}, dict(compress_stride=np.float64(16)), "compress_stride must be an integer"),
    ({}, dict(actual_seq_len=np.array([100, 172, 300], np.float64)), "must hold integers"),
    (LENGTHS, dict(actual_seq_len_type=True), "actual_seq_len_type must be an integer"),
    ({}, dict(actual_seq_len_type=False), "actual_seq_len_type must be an integer"),
]


@pytest.mark.parametrize("op", ["forward", "grad"])
@pytest.mark.parametrize("valid,change,fragment", REJECTED)
def test_prepared_signatures_keep_every_check(plans, op, valid, change, fragment):
    x, w, _ = good()
    call = dict(dict(compress_block_size=L, compress_stride=S, actual_seq_len=SEQ), **valid)
    y = nsa_numba.nsa_compress(x, w, **call)
    g = np.ones_like(y)
    if op == "forward":
        fn, args, outputs = nsa_numba.nsa_compress, (x, w), dict(out=np.zeros_like(y))
    else:
        fn, args = nsa_numba.nsa_compress_grad, (g, x, w)
        outputs = dict(input_grad=np.zeros_like(x), weight_grad=np.zeros_like(w))
    fn(*args, **call, **outputs)                               # kept, outputs given
    before = {k: bits(v).copy() for k, v in outputs.items()}
    with pytest.raises(NsaError, match=fragment):
        fn(*args, **dict(call, **change), **outputs)
    assert all(np.array_equal(bits(outputs[k]), v) for k, v in before.items())
    assert _pipeline.prepared_calls()                          # the valid calls were kept


OVERLAPS = [
    # outputs with a kept signature (the shapes, strides and dtype of new arrays) that
    # share memory with the inputs
    ("forward", lambda x, w, g: dict(out=x[:TP]), "out overlaps input"),
    ("grad", lambda x, w, g: dict(input_grad=x), "input_grad overlaps input"),
    ("grad", lambda x, w, g: dict(weight_grad=w), "weight_grad overlaps weight"),
    ("grad", lambda x, w, g: dict(input_grad=np.zeros_like(x), weight_grad=w[::-1][::-1]),
     "weight_grad overlaps weight"),
]


@pytest.mark.parametrize("op,make,fragment", OVERLAPS)
def test_prepared_signatures_still_check_overlap(plans, op, make, fragment):
    x, w, g = good()
    outputs = make(x, w, g)
    fresh = {k: np.zeros_like(v) for k, v in outputs.items()}
    call = dict(compress_block_size=L, compress_stride=S, actual_seq_len=SEQ)
    fn = nsa_numba.nsa_compress if op == "forward" else nsa_numba.nsa_compress_grad
    args = (x, w) if op == "forward" else (g, x, w)
    fn(*args, **call, **fresh)                                  # kept
    before = [bits(a).copy() for a in (x, w, g)]
    with pytest.raises(NsaError, match=fragment):
        fn(*args, **call, **outputs)
    assert all(np.array_equal(bits(a), b) for a, b in zip((x, w, g), before))


def test_read_only_outputs_are_refused_after_writable_ones(plans):
    x, w, _ = good()
    out = np.zeros((TP, N, D), x.dtype)
    nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=SEQ, out=out)
    out.flags.writeable = False
    with pytest.raises(NsaError, match="out must be writable"):
        nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=SEQ, out=out)


def test_strictness_is_part_of_the_signature(plans):
    x = np.zeros((40, 1, 16), np.float32)
    w = np.zeros((L, 1), np.float32)
    assert nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=[20, 40], strict=False).shape[0] == 0
    with pytest.raises(NsaError, match="no sequence is as long"):
        nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=[20, 40])
    # a strict that is not a bool works, the full way every time
    for _ in range(2):
        nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=[20, 40], strict=0)
    assert plans["forward"] == 4


def test_non_contiguous_calls_are_not_prepared(plans):
    rng = np.random.default_rng(2)
    for _ in range(2):
        x = rng.standard_normal((T, N, 2 * D)).astype(ml_dtypes.bfloat16)[..., ::2]
        w = rng.standard_normal((L, N)).astype(ml_dtypes.bfloat16)
        assert_forward_accurate(nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=SEQ),
                                x, w, L, S, SEQ)
    assert plans["forward"] == 2 and not _pipeline.prepared_calls()


def test_prepared_calls_are_bounded(plans):
    w = np.zeros((L, 1), np.float32)
    for t in range(_pipeline.CACHED_CALLS + 5):
        nsa_numba.nsa_compress(np.zeros((L + t, 1, 16), np.float32), w, L, S)
    assert len(_pipeline.prepared_calls()) == _pipeline.CACHED_CALLS


def test_prepared_calls_tile_tables_are_bounded(plans, monkeypatch):
    monkeypatch.setattr(_pipeline._prepared, "max_bytes", 64 * 80)   # 64 tiles of 80 bytes
    w = np.zeros((L, 1), np.float32)
    x = np.zeros((20 * L, 1, 16), np.float32)
    for k in range(12):          # eight sequences, a tile each: 640 bytes, an eighth
        ends = [2 * L * (i + 1) + k for i in range(7)] + [20 * L]
        nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=ends)
    kept = [p.constants[1].nbytes for p in _pipeline.prepared_calls()]
    assert kept == [640] * 8 and _pipeline._prepared.nbytes == 64 * 80     # the oldest went
    big = [2 * L * (i + 1) for i in range(8)] + [20 * L]    # nine tiles: over an eighth
    for _ in range(2):
        nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=big)
    assert plans["forward"] == 14                            # never kept


def test_a_call_inside_a_call_gets_its_own_scratch(plans, monkeypatch):
    # A call made while this thread's run is under way (as a signal handler's would
    # be) must not use the scratch that run is using.
    x, w, g = good(np.float32)
    expected = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    real = _launch.run
    inner = []

    def launch_and_interrupt(kernel, threads, chunk, *args, **options):
        result = real(kernel, threads, chunk, *args, **options)   # the outer partials written
        if not inner:
            inner.append(None)
            inner[0] = nsa_numba.nsa_compress_grad(g[::-1].copy(), x, w, L, S,
                                                   actual_seq_len=SEQ)
        return result

    monkeypatch.setattr(_launch, "run", launch_and_interrupt)
    got = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    assert inner[0] is not None and all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert not _dispatch._thread_scratch.busy


def test_threads_keep_their_own_scratch(plans):
    # Python threads calling at once: each result is the one-thread result
    problems = [good(np.float32, seed) for seed in range(4)]
    expected = [nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
                for x, w, g in problems]
    results = {}

    def work(i):
        x, w, g = problems[i]
        for _ in range(20):
            results[i] = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (dx, dw) in enumerate(expected):
        assert np.array_equal(results[i][0], dx) and np.array_equal(results[i][1], dw)


def test_any_weight_array_runs_the_kernels_compiled_for_one(plans):
    # the kernels take the weight C-contiguous and writable (a copy when it is not), so
    # a transposed or read-only weight compiles nothing new
    from nsa_numba._kernels import compress as _kernels
    x, w, g = good(np.float32)
    nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=SEQ)
    nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    kernels = [k for k in vars(_kernels).values() if hasattr(k, "signatures")]
    compiled = sum(len(k.signatures) for k in kernels)
    read_only = w.copy()
    read_only.flags.writeable = False
    for weight in (np.asfortranarray(w), w.T.copy().T, read_only, read_only):
        assert_forward_accurate(nsa_numba.nsa_compress(x, weight, L, S, actual_seq_len=SEQ),
                                x, w, L, S, SEQ)
        gx, gw = nsa_numba.nsa_compress_grad(g, x, weight, L, S, actual_seq_len=SEQ)
        assert_grad_accurate(gx, gw, g, x, w, L, S, SEQ)
    assert sum(len(k.signatures) for k in kernels) == compiled


def test_calls_with_work_for_every_thread_that_come_again_match_the_full_way(plans):
    # the prepared calls (kept after a first call) give the full way's bits with
    # work for every thread
    import numba
    rng = np.random.default_rng(5)
    seq = [0, 3000, 6000]
    for seed in range(2):
        x = rng.standard_normal((6000, 3, 64)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((L, 3)).astype(ml_dtypes.bfloat16)
        g = rng.standard_normal((2 * ((3000 - L) // S + 1), 3, 64)).astype(ml_dtypes.bfloat16)
        y = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=seq)
        gx, gw = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=seq)
        assert_forward_accurate(y, x, w, L, S, seq)
        assert_grad_accurate(gx, gw, g, x, w, L, S, seq)
    kept = _pipeline.prepared_calls()
    assert len(kept) == 2 and all(k.useful >= numba.config.NUMBA_NUM_THREADS for k in kept)
    assert np.array_equal(bits(full_way(nsa_numba.nsa_compress, x, w, L, S,
                                        actual_seq_len=seq)), bits(y))
    full = full_way(nsa_numba.nsa_compress_grad, g, x, w, L, S, actual_seq_len=seq)
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(full, (gx, gw)))


def test_the_entries_overlap_check_is_numpys_on_contiguous_arrays():
    from nsa_numba._kernels.compress import _apart
    buffer = np.zeros(64, np.float32)
    spans = [(0, 16), (8, 24), (16, 32), (31, 40), (40, 40), (10, 10), (0, 64), (63, 64)]
    for a0, a1 in spans:
        for b0, b1 in spans:
            a, b = buffer[a0:a1], buffer[b0:b1]
            assert _apart(a, b) == (not np.may_share_memory(a, b)), (a0, a1, b0, b1)
            # across dtypes and shapes, as the entries see weights beside rows
            assert _apart(a.view(np.int16).reshape(-1, 2), b) == _apart(a, b)


# -- one pipeline for every operator --------------------------------------------------

def test_every_operator_is_registered_once():
    assert set(_pipeline.OPERATORS) == {"forward", "grad", "infer", "select", "select_grad",
                                        "compress_attention", "compress_attention_grad",
                                        "fusion_attention", "fusion_attention_grad"}
    assert _pipeline.OPERATORS["infer"] is _operators.COMPRESS_INFER
    assert _pipeline.OPERATORS["select_grad"] is _operators.SELECT_GRAD
    with pytest.raises(ValueError, match="already registered"):
        _pipeline.register(_operators.COMPRESS)


def test_the_decoding_operator_goes_through_the_pipeline(monkeypatch):
    from test_infer import paged_problem
    x, w, slots, table, cache = paged_problem([32, 48, 64], N=2, D=16, dtype=np.float32)
    seen = []
    real = _operators.COMPRESS_INFER.launch

    def launch(plan, workspace, threads):
        seen.append(plan.op)
        return real(plan, workspace, threads)

    monkeypatch.setattr(api, "COMPRESS_INFER", replace(_operators.COMPRESS_INFER,
                                                       launch=launch))
    got = nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                       actual_seq_len=[32, 48, 64], cache=cache)
    assert got is cache and seen == ["infer"]


@pytest.mark.parametrize("op", ["forward", "grad"])
def test_a_rejected_call_takes_nothing_from_the_pool(kept, monkeypatch, op):
    # every check runs before any output is allocated: a call whose given output
    # overlaps an input, its last check, leaves the pool as it was
    monkeypatch.setattr(_pool, "MIN_BYTES", 0)
    x, w, g = good(np.float32)
    with pytest.raises(NsaError, match="overlaps"):
        if op == "forward":
            nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=SEQ, out=x[:TP])
        else:
            nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ, weight_grad=w)
    assert _pool.stats() == (0, 0, 0)


def test_a_prepared_call_is_one_record_built_by_keyword(plans):
    x, w, g = good(np.float32)
    for _ in range(2):
        nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=SEQ)
    (prepared,) = _pipeline.prepared_calls()
    assert isinstance(prepared, _dispatch.Prepared) and prepared.op == "grad"
    assert prepared.kernel is _dispatch._kernels.compress_backward_simd     # float32, D = 32
    assert prepared.allocate[3] == x.shape and prepared.allocate[4] == w.shape
    with pytest.raises(TypeError):
        _dispatch.Prepared(prepared.op, prepared.kernel)        # keywords only
    assert plans["grad"] == 1
