"""The with-cache (decoding) operator: nsa_compress_infer and its aclnn mirror."""

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from nsa_numba import NsaError
from nsa_numba import reference as ref
from nsa_numba.aclnn import (ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID,
                             ACLNN_ERR_PARAM_NULLPTR, ACLNN_SUCCESS, aclGetRecentErrMsg,
                             aclnnNsaCompress, aclnnNsaCompressWithCache,
                             aclnnNsaCompressWithCacheGetWorkspaceSize,
                             aclSetAclOpExecutorRepeatable)
from conftest import DTYPE_IDS, DTYPES, HALF_DTYPES, accumulator
from test_accuracy import assert_bitwise
from test_strides import VIEWS


def bits(a):
    return np.ascontiguousarray(a).view(f"u{a.itemsize}")


def paged_problem(lengths, N=4, D=32, block=32, stride=16, page=64, dtype=np.float16,
                  rows=None, seed=0, extra_pages=3):
    """A paged decoding step: pages shuffled over the pool, a block table with -1
    padding past each sequence's pages, slots a permutation of the rows (by default
    the fewest the NPU allows: more than (pages * page - l) / d)."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    per_seq = max(1, -(-max(lengths) // page))
    pages = B * per_seq + extra_pages
    if rows is None:
        rows = (pages * page - block) // stride + 1
    x = rng.standard_normal((pages, page, N, D)).astype(dtype)
    w = rng.standard_normal((block, N)).astype(dtype)
    table = np.full((B, per_seq), -1, np.int64)
    pool = rng.permutation(pages)
    for b, s in enumerate(lengths):
        used = max(1, -(-s // page))
        table[b, :used] = pool[b * per_seq:b * per_seq + used]
    slots = rng.permutation(rows)[:B]
    cache = rng.standard_normal((rows, N, D)).astype(dtype)
    return x, w, slots, table, cache


def check_step(result, cache_before, x, w, slots, block, stride, page, lengths, table=None):
    """Rows written as the float64 reference says (within the accuracy promise), every
    other row bitwise unchanged."""
    exact, written = ref.compress_infer(x, w, slots, block, stride, page, lengths,
                                        cache_before, table)
    untouched = np.setdiff1d(np.arange(cache_before.shape[0]), written)
    assert_bitwise(result[untouched], cache_before[untouched])
    if written:
        rows = np.array(written)
        depth = block + 1
        abs_terms, _ = ref.compress_infer(np.abs(x.astype(np.float64)),
                                          np.abs(w.astype(np.float64)), slots, block, stride,
                                          page, lengths, np.zeros(cache_before.shape), table)
        report = ref.check_accuracy(result[rows], exact[rows], abs_terms[rows], x.dtype,
                                    depth, accumulator(x.dtype))
        assert report["ok"], report
    return written


# -- the published examples ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cann_example_all_ones(dtype):
    # l=32, d=16, N=24, D=192, B=4, page 128, 4 pages per sequence; only sequence 0
    # (length 32 = l) is on a boundary: row 0 becomes 32.0, the rest stay 1.0
    x = np.ones((16, 128, 24, 192), dtype)
    w = np.ones((32, 24), dtype)
    cache = np.ones((512, 24, 192), dtype)
    table = np.arange(16, dtype=np.int32).reshape(4, 4)
    slots = np.zeros(4, np.int32)
    got = nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 128, block_table=table,
                                       actual_seq_len=[32, 0, 0, 0], cache=cache)
    assert got is cache
    assert np.all(cache[0].astype(np.float32) == 32.0)
    assert np.all(cache[1:].astype(np.float32) == 1.0)


@pytest.mark.parametrize("length", [32, 48, 128])
def test_torch_npu_test_case(length):
    # torch_npu's case: input [1, 128, 1, 192], weight [32, 1], page 128, one sequence
    rng = np.random.default_rng(length)
    x = rng.standard_normal((1, 128, 1, 192)).astype(np.float16)
    w = rng.standard_normal((32, 1)).astype(np.float16)
    cache = rng.standard_normal((8, 1, 192)).astype(np.float16)
    before = cache.copy()
    nsa_numba.nsa_compress_infer(x, w, np.array([3], np.int32), 32, 16, 128,
                                 block_table=np.array([[0]], np.int32),
                                 actual_seq_len=[length], cache=cache)
    assert check_step(cache, before, x, w, [3], 32, 16, 128, [length], [[0]]) == [3]


# -- semantics ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_some_sequences_on_a_boundary(dtype):
    # lengths on and off boundaries, windows inside one page and across two
    lengths = [32, 33, 48, 47, 80, 0, 96, 100, 128, 31, 144]
    x, w, slots, table, cache = paged_problem(lengths, dtype=dtype, seed=1)
    before = cache.copy()
    nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                 actual_seq_len=lengths, cache=cache)
    written = check_step(cache, before, x, w, slots, 32, 16, 64, lengths, table)
    assert len(written) == 6          # 32, 48, 80, 96, 128, 144


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_same_bits_as_the_training_forward(dtype):
    # the window a decoding step compresses is the training forward's last window of
    # the sequence: the same sums in the same order, so the same bits
    lengths = [80, 112, 64]
    x, w, slots, table, cache = paged_problem(lengths, dtype=dtype, seed=2, page=64)
    nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                 actual_seq_len=lengths, cache=cache)
    for b, s in enumerate(lengths):
        tokens = np.stack([x[table[b, p // 64], p % 64] for p in range(s)])
        out = nsa_numba.nsa_compress(tokens, w, 32, 16)
        assert_bitwise(cache[slots[b]], out[-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_windows_straddle_pages(dtype):
    # page 64, l = 64: every window that does not start on a page start spans two
    lengths = [64 + 16 * k for k in range(8)]
    x, w, slots, table, cache = paged_problem(lengths, block=64, stride=16, page=64,
                                              dtype=dtype, seed=3)
    before = cache.copy()
    nsa_numba.nsa_compress_infer(x, w, slots, 64, 16, 64, block_table=table,
                                 actual_seq_len=lengths, cache=cache)
    assert len(check_step(cache, before, x, w, slots, 64, 16, 64, lengths, table)) == 8


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_packed_and_paged_agree(dtype):
    lengths = [48, 50, 80, 32, 17]
    x, w, slots, table, cache = paged_problem(lengths, dtype=dtype, seed=4)
    packed = np.concatenate([np.stack([x[table[b, p // 64], p % 64] for p in range(s)])
                             for b, s in enumerate(lengths) if s] + [x[0, :5]])  # spare tail
    paged_cache, packed_cache = cache.copy(), cache.copy()
    nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                 actual_seq_len=lengths, cache=paged_cache)
    nsa_numba.nsa_compress_infer(packed, w, slots, 32, 16, 64, actual_seq_len=lengths,
                                 cache=packed_cache, layout="TND")
    assert_bitwise(paged_cache, packed_cache)
    check_step(packed_cache, cache, packed, w, slots, 32, 16, 64, lengths)


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_strided_arrays(dtype, view):
    lengths = [32, 64, 40, 96]
    x, w, slots, table, cache = paged_problem(lengths, dtype=dtype, seed=5)
    want = cache.copy()
    nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                 actual_seq_len=lengths, cache=want)
    xs, ws = VIEWS[view](x, 0), VIEWS[view](w, 0)
    cs = VIEWS[view](cache, 0)
    got = nsa_numba.nsa_compress_infer(xs, ws, slots, 32, 16, 64, block_table=table,
                                       actual_seq_len=lengths, cache=cs)
    assert got is cs
    assert_bitwise(cs, want)


def test_same_bits_for_any_thread_count():
    lengths = [32 + 16 * k for k in range(40)]
    x, w, slots, table, cache = paged_problem(lengths, N=8, D=64, seed=6,
                                              dtype=ml_dtypes.bfloat16)
    results = []
    for n in (1, 2):
        c = cache.copy()
        with nsa_numba.threads(n):
            nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                         actual_seq_len=lengths, cache=c)
        results.append(c)
    assert_bitwise(*results)


def test_index_arrays_of_any_integer_type():
    lengths = [32, 48]
    x, w, slots, table, cache = paged_problem(lengths, seed=7)
    want = cache.copy()
    nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                 actual_seq_len=lengths, cache=want)
    for kind in (np.int16, np.uint32, np.int64, list):
        c = cache.copy()
        convert = (lambda a: a.tolist()) if kind is list else (lambda a: a.astype(kind))
        nsa_numba.nsa_compress_infer(x, w, convert(slots), 32, 16, 64,
                                     block_table=convert(table),
                                     actual_seq_len=np.array(lengths, np.int32), cache=c)
        assert_bitwise(c, want)


def test_no_writer_writes_nothing():
    x, w, slots, table, cache = paged_problem([33, 47, 0], seed=8)
    before = cache.copy()
    nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                 actual_seq_len=[33, 47, 0], cache=cache)
    assert_bitwise(cache, before)


def test_non_strict_repeated_rows_keep_the_last_writer():
    lengths = [32, 48, 40, 64]
    x, w, _, table, cache = paged_problem(lengths, seed=9)
    slots = np.array([5, 5, 5, 2])           # sequences 0 and 1 write row 5, 2 does not
    with pytest.raises(NsaError, match=r"cache row 5 to sequences 0 and 1") as info:
        nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                     actual_seq_len=lengths, cache=cache.copy())
    assert info.value.status == ACLNN_ERR_PARAM_INVALID
    before = cache.copy()
    nsa_numba.nsa_compress_infer(x, w, slots, 32, 16, 64, block_table=table,
                                 actual_seq_len=lengths, cache=cache, strict=False)
    check_step(cache, before, x, w, slots, 32, 16, 64, lengths, table)   # reference: last wins


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_non_strict_sizes(dtype):
    # what the NPU's tiling would reject but the maths allows: l=5, d=3, page 7, D=9,
    # windows over three pages
    lengths = [5, 8, 11, 20, 6]
    x, w, slots, table, cache = paged_problem(lengths, N=3, D=9, block=5, stride=3, page=7,
                                              dtype=dtype, rows=9, seed=10, extra_pages=0)
    before = cache.copy()
    nsa_numba.nsa_compress_infer(x, w, slots, 5, 3, 7, block_table=table,
                                 actual_seq_len=lengths, cache=cache, strict=False)
    assert len(check_step(cache, before, x, w, slots, 5, 3, 7, lengths, table)) == 4
    with pytest.raises(NsaError) as info:
        nsa_numba.nsa_compress_infer(x, w, slots, 5, 3, 7, block_table=table,
                                     actual_seq_len=lengths, cache=cache)
    assert info.value.status == ACLNN_ERR_INNER_TILING_ERROR


# -- validation --------------------------------------------------------------------------

def good(dtype=np.float16):
    lengths = [32, 48, 40]
    x, w, slots, table, cache = paged_problem(lengths, dtype=dtype, seed=11, rows=64)
    return dict(input=x, weight=w, slot_mapping=slots.astype(np.int32),
                block_table=table.clip(0).astype(np.int32), seq=lengths, cache=cache,
                block=32, stride=16, page=64, layout="TND", seq_type=1)


def call_numpy(a, strict=True):
    return nsa_numba.nsa_compress_infer(
        a["input"], a["weight"], a["slot_mapping"], a["block"], a["stride"], a["page"],
        block_table=a["block_table"], actual_seq_len=a["seq"], layout=a["layout"],
        cache=a["cache"], strict=strict)


INVALID = [
    ("input-none", dict(input=None), ACLNN_ERR_PARAM_NULLPTR, ["input", "None"]),
    ("weight-none", dict(weight=None), ACLNN_ERR_PARAM_NULLPTR, ["weight"]),
    ("slots-none", dict(slot_mapping=None), ACLNN_ERR_PARAM_NULLPTR, ["slot_mapping"]),
    ("cache-none", dict(cache=None), ACLNN_ERR_PARAM_NULLPTR, ["cache"]),
    ("seq-none", dict(seq=None), ACLNN_ERR_PARAM_NULLPTR, ["actual_seq_len"]),
    ("input-int", dict(input=np.zeros((7, 64, 4, 32), np.int16)), ACLNN_ERR_PARAM_INVALID,
     ["input", "dtype", "int16"]),
    ("input-3d-with-table", dict(input=np.zeros((7, 64, 32), np.float16)),
     ACLNN_ERR_PARAM_INVALID, ["input", "4-D", "3-D"]),
    ("page-mismatch", dict(input=np.zeros((7, 32, 4, 32), np.float16)),
     ACLNN_ERR_PARAM_INVALID, ["input.shape[1]", "page_block_size = 64"]),
    ("weight-dtype", dict(weight=np.zeros((32, 4), np.float32)), ACLNN_ERR_PARAM_INVALID,
     ["weight", "float32", "float16"]),
    ("weight-heads", dict(weight=np.zeros((32, 5), np.float16)),
     ACLNN_ERR_INNER_TILING_ERROR, ["weight", "5", "N = 4"]),
    ("weight-rows", dict(weight=np.zeros((16, 4), np.float16)), ACLNN_ERR_PARAM_INVALID,
     ["weight", "(32, 4)", "(16, 4)"]),
    ("cache-shape", dict(cache=np.zeros((64, 4, 16), np.float16)), ACLNN_ERR_PARAM_INVALID,
     ["cache", "(rows, 4, 32)"]),
    ("cache-dtype", dict(cache=np.zeros((64, 4, 32), np.float32)), ACLNN_ERR_PARAM_INVALID,
     ["cache", "float32"]),
    ("cache-readonly", dict(cache=np.broadcast_to(np.zeros((1, 4, 32), np.float16),
                                                  (64, 4, 32))),
     ACLNN_ERR_PARAM_INVALID, ["cache", "read-only"]),
    ("cache-too-short", dict(cache=np.zeros((20, 4, 32), np.float16)),
     ACLNN_ERR_INNER_TILING_ERROR, ["cache", "more than", "rows (at least 23), got 20"]),
    ("block-not-16", dict(block=40), ACLNN_ERR_INNER_TILING_ERROR,
     ["compress_block_size", "multiple of 16", "40"]),
    ("block-over-64", dict(block=80), ACLNN_ERR_INNER_TILING_ERROR,
     ["compress_block_size", "<= 64", "80"]),
    ("stride-80", dict(stride=80), ACLNN_ERR_INNER_TILING_ERROR, ["compress_stride", "80"]),
    ("block-lt-stride", dict(stride=48), ACLNN_ERR_INNER_TILING_ERROR,
     ["compress_block_size must be >= compress_stride"]),
    ("page-96", dict(page=96), ACLNN_ERR_INNER_TILING_ERROR, ["page_block_size", "96"]),
    ("block-float", dict(block=32.0), ACLNN_ERR_PARAM_INVALID,
     ["compress_block_size", "integer"]),
    ("seq-length", dict(seq=[32, 48]), ACLNN_ERR_PARAM_INVALID,
     ["actual_seq_len", "slot_mapping", "2 and 3"]),
    ("seq-negative", dict(seq=[32, -1, 40]), ACLNN_ERR_PARAM_INVALID,
     ["actual_seq_len", ">= 0", "-1"]),
    ("seq-float", dict(seq=[32, 48.0, 40]), ACLNN_ERR_PARAM_INVALID,
     ["actual_seq_len[1]", "integer"]),
    ("seq-past-table", dict(seq=[32, 48, 200]), ACLNN_ERR_PARAM_INVALID,
     ["actual_seq_len[2] = 200", "block_table row 2", "= 64"]),
    ("slot-out", dict(slot_mapping=np.array([0, 64, 1], np.int32)), ACLNN_ERR_PARAM_INVALID,
     ["slot_mapping[1] = 64", "64 rows"]),
    ("slot-negative", dict(slot_mapping=np.array([-1, 3, 1], np.int32)),
     ACLNN_ERR_PARAM_INVALID, ["slot_mapping[0] = -1"]),
    ("slots-repeat", dict(slot_mapping=np.array([4, 4, 1], np.int32)),
     ACLNN_ERR_PARAM_INVALID, ["cache row 4", "sequences 0 and 1"]),
    ("slots-2d", dict(slot_mapping=np.zeros((3, 1), np.int32)), ACLNN_ERR_PARAM_INVALID,
     ["slot_mapping", "1-D"]),
    ("slots-float", dict(slot_mapping=np.zeros(3, np.float32)), ACLNN_ERR_PARAM_INVALID,
     ["slot_mapping", "integers"]),
    ("table-page-out", dict(block_table=np.array([[0], [99], [4]], np.int32)),
     ACLNN_ERR_PARAM_INVALID, ["block_table[1, 0] = 99"]),
    ("table-rows", dict(block_table=np.zeros((2, 2), np.int32)), ACLNN_ERR_PARAM_INVALID,
     ["block_table", "one row per sequence"]),
    ("cache-overlaps-input", "overlap", ACLNN_ERR_PARAM_INVALID, ["cache", "overlaps"]),
]


def broken(change):
    a = good()
    if change == "overlap":
        a["cache"] = a["input"][0, :, :, :].copy()
        a["input"] = np.concatenate([a["cache"][None]] * 7)
        a["cache"] = a["input"][0]
        return a
    a.update(change)
    return a


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_arguments(case):
    _, change, status, fragments = case
    a = broken(change)
    cache = a["cache"]
    before = None if cache is None else cache.copy()
    with pytest.raises(NsaError) as info:
        call_numpy(a)
    assert info.value.status == status, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    if before is not None:
        assert_bitwise(cache, before)


def test_packed_input_rules():
    a = good()
    packed = a["input"].reshape(-1, 4, 32)[:100]
    with pytest.raises(NsaError, match="sum to at most T = 100") as info:
        nsa_numba.nsa_compress_infer(packed, a["weight"], a["slot_mapping"], 32, 16, 64,
                                     actual_seq_len=[32, 48, 40], cache=a["cache"])
    assert info.value.status == ACLNN_ERR_PARAM_INVALID
    with pytest.raises(NsaError, match="layout must be 'TND'") as info:
        nsa_numba.nsa_compress_infer(packed, a["weight"], a["slot_mapping"], 32, 16, 64,
                                     actual_seq_len=[32, 48], cache=a["cache"], layout="BSND")
    assert info.value.status == ACLNN_ERR_INNER_TILING_ERROR


# -- the aclnn mirror ----------------------------------------------------------------------

def aclnn_phase1(a):
    return aclnnNsaCompressWithCacheGetWorkspaceSize(
        a["input"], a["weight"], a["slot_mapping"], a["seq"], a["block_table"], a["layout"],
        a["block"], a["stride"], a["seq_type"], a["page"], a["cache"])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_aclnn_round_trip_equals_the_numpy_api(dtype):
    a = good(dtype)
    want = a["cache"].copy()
    nsa_numba.nsa_compress_infer(a["input"], a["weight"], a["slot_mapping"], 32, 16, 64,
                                 block_table=a["block_table"], actual_seq_len=a["seq"],
                                 cache=want)
    status, size, executor = aclnn_phase1(a)
    assert status == ACLNN_SUCCESS and size > 0, aclGetRecentErrMsg()
    assert aclnnNsaCompressWithCache(np.empty(size, np.uint8), size, executor) == ACLNN_SUCCESS
    assert_bitwise(a["cache"], want)
    # spent: an executor runs once unless made repeatable
    assert aclnnNsaCompressWithCache(np.empty(size, np.uint8), size, executor) \
        == ACLNN_ERR_PARAM_INVALID
    assert "already ran once" in aclGetRecentErrMsg()


def test_aclnn_repeatable_executor_and_other_operators_executor():
    a = good()
    status, size, executor = aclnn_phase1(a)
    assert aclSetAclOpExecutorRepeatable(executor) == ACLNN_SUCCESS
    for _ in range(2):
        assert aclnnNsaCompressWithCache(np.empty(size, np.uint8), size, executor) \
            == ACLNN_SUCCESS
    assert aclnnNsaCompress(np.empty(size, np.uint8), size, executor) == ACLNN_ERR_PARAM_INVALID
    assert "made by aclnnNsaCompressWithCacheGetWorkspaceSize" in aclGetRecentErrMsg()


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_aclnn_status_codes(case):
    _, change, status, _ = case
    a = broken(change)
    before = None if a["cache"] is None else a["cache"].copy()
    aclGetRecentErrMsg()
    if change != "overlap" and any(k in change for k in ("slot_mapping", "block_table")) \
            and getattr(change.get("slot_mapping", change.get("block_table")), "dtype",
                        None) not in (None, np.int32):
        status = ACLNN_ERR_PARAM_INVALID
    got, size, executor = aclnn_phase1(a)
    assert (got, size, executor) == (status, 0, None)
    message = aclGetRecentErrMsg()
    for name in ("outputCache", "slotMapping", "actSeqLenOptional", "blockTableOptional",
                 "compressBlockSize", "compressStride", "pageBlockSize", "input", "weight"):
        if name in message:
            break
    else:
        raise AssertionError(message)
    if before is not None:
        assert_bitwise(a["cache"], before)


def test_aclnn_takes_int32_indices_and_half_precision_only():
    a = good()
    a["slot_mapping"] = a["slot_mapping"].astype(np.int64)
    assert aclnn_phase1(a)[0] == ACLNN_ERR_PARAM_INVALID
    assert "slotMapping dtype must be int32, got int64" in aclGetRecentErrMsg()
    a = good()
    a["block_table"] = a["block_table"].tolist()
    assert aclnn_phase1(a)[0] == ACLNN_ERR_PARAM_INVALID
    assert "blockTableOptional must be a numpy.ndarray of int32" in aclGetRecentErrMsg()
    a = good()
    a["seq_type"] = 0
    assert aclnn_phase1(a)[0] == ACLNN_ERR_INNER_TILING_ERROR
    assert "actSeqLenType must be 1" in aclGetRecentErrMsg()
    a = good(np.float32)
    assert aclnn_phase1(a)[0] == ACLNN_ERR_PARAM_INVALID
