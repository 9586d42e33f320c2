"""Hostile calls that once crashed the interpreter or computed from memory they should
not have read, and their neighbours: indices, masks and workspaces sharing memory with
what a call writes, index contents changed between the aclnn phases, outputs whose
elements share memory, and values no check expected (huge scalars, masked, sparse and
meta arrays).

Not collected by a plain ``pytest`` run: ``test_fuzz_invalid.py`` runs this file in a
child process, so that a crash is a failed test rather than a dead test runner. Every
case asserts the documented answer (the error, its status and the parameter it names)
and that nothing the call could write changed.
"""

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from nsa_numba import NsaError
from nsa_numba import aclnn as A
from nsa_numba.bench.cases import select_problem

BF16 = np.dtype(ml_dtypes.bfloat16)
SENTINEL = 3


def _select_call(T=256, N1=4, block=64, count=2, dtype=BF16, seed=0):
    """A valid strict selected-attention problem, outputs given (full of a sentinel)."""
    q, k, v, topk, scale, ends = select_problem([T], N1, 1, 192, 128, block, count, dtype,
                                                seed=seed)
    return dict(q=q, k=k, v=v, topk=topk, scale=scale, ends=ends, N1=N1, block=block,
                count=count, out=np.full((T, N1, 128), SENTINEL, dtype),
                smax=np.full((T, N1, 8), SENTINEL, np.float32),
                ssum=np.full((T, N1, 8), SENTINEL, np.float32))


def _small_forward(T, N, D, block, count):
    """A non-strict float32 selected-attention problem (every token selects blocks 0 to
    count - 1) and its forward: q, k, v, topk, out, softmax_max, softmax_sum."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((T, N, D)).astype(np.float32) for _ in range(3))
    topk = np.tile(np.arange(count, dtype=np.int32), (T, N, 1))
    return (q, k, v, topk, *nsa_numba.nsa_select_attention(q, k, v, topk, 0.25, N, block,
                                                           count, strict=False))


def _unchanged(*arrays):
    """A function asserting that ``arrays`` still hold what they hold now."""
    kept = [(a, a.copy()) for a in arrays]

    def check():
        for a, before in kept:
            assert np.array_equal(a.view(np.uint8), before.view(np.uint8)), "an array changed"
    return check


def _rejects(fragments, call, status=161002):
    with pytest.raises(NsaError) as err:
        call()
    assert err.value.status == status, (err.value.status, str(err.value))
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def _aclnn_select(c, topk=None, repeatable=False):
    status, size, executor = A.aclnnNsaSelectedAttentionGetWorkspaceSize(
        c["q"], c["k"], c["v"], c["topk"] if topk is None else topk, None, c["ends"],
        c["ends"], c["scale"], c["N1"], "TND", 0, c["block"], c["count"], c["smax"], c["ssum"],
        c["out"])
    assert status == A.ACLNN_SUCCESS, A.aclGetRecentErrMsg()
    if repeatable:
        assert A.aclSetAclOpExecutorRepeatable(executor) == A.ACLNN_SUCCESS
    return size, executor


def _run_fails(run, size, executor, fragment, workspace=None):
    A.aclGetRecentErrMsg()
    workspace = np.empty(size, np.uint8) if workspace is None else workspace
    status = run(workspace, workspace.size, executor)
    message = A.aclGetRecentErrMsg()
    assert status == A.ACLNN_ERR_PARAM_INVALID, (status, message)
    assert fragment in message, message


# -- indices and masks sharing memory with an output -----------------------------------

def test_select_indices_over_an_output_are_refused():
    q, k, v, _, scale, _ = select_problem([1024], 2, 2, 192, 128, 64, 8, np.float32)
    smax = np.empty((1024, 2, 8), np.float32)
    topk = smax.view(np.int32)                   # the indices live in softmax_max
    topk[...] = np.arange(8)
    check = _unchanged(smax)
    _rejects(["softmax_max overlaps topk_indices"], lambda: nsa_numba.nsa_select_attention(
        q, k, v, topk, scale, 2, 64, 8, softmax_max=smax))
    check()


def test_select_grad_indices_over_dq_are_refused():
    T, N, block, count, D = 256, 2, 16, 16, 16
    q, k, v, topk, o, m, s = _small_forward(T, N, D, block, count)
    dq = np.empty((T, N, D), np.float32)
    over = dq.view(np.int32)
    over[...] = topk
    check = _unchanged(dq)
    _rejects(["dq overlaps topk_indices"], lambda: nsa_numba.nsa_select_attention_grad(
        np.ones_like(o), q, k, v, o, m, s, over, 0.25, N, block, count, dq=dq,
        strict=False))
    check()


# -- the aclnn run checks again what it reads ------------------------------------------

def test_aclnn_select_indices_broken_after_phase_one_are_refused_at_the_run():
    c = _select_call()
    size, executor = _aclnn_select(c)
    c["topk"][...] = 1_000_000
    check = _unchanged(c["out"], c["smax"], c["ssum"])
    _run_fails(A.aclnnNsaSelectedAttention, size, executor, "topkIndices")
    check()


def test_aclnn_select_repeated_run_checks_the_indices_again():
    c = _select_call()
    size, executor = _aclnn_select(c, repeatable=True)
    assert A.aclnnNsaSelectedAttention(np.empty(size, np.uint8), size, executor) == 0
    c["topk"][0, 0, 0] = -1
    check = _unchanged(c["out"], c["smax"], c["ssum"])
    _run_fails(A.aclnnNsaSelectedAttention, size, executor, "topkIndices[0, 0, 0] = -1")
    check()
    c["topk"][0, 0, 0] = 0                      # mended: the executor runs again
    assert A.aclnnNsaSelectedAttention(np.empty(size, np.uint8), size, executor) == 0


def test_aclnn_select_runs_read_the_current_strided_indices():
    c = _select_call()
    wide = np.zeros(c["topk"].shape[:2] + (2 * c["count"],), np.int32)
    strided = wide[:, :, ::2]                    # not contiguous: no longer copied once
    strided[...] = c["topk"]
    size, executor = _aclnn_select(c, topk=strided, repeatable=True)
    assert A.aclnnNsaSelectedAttention(np.empty(size, np.uint8), size, executor) == 0
    strided[...] = strided[:, :, ::-1]           # the same blocks in another order
    assert A.aclnnNsaSelectedAttention(np.empty(size, np.uint8), size, executor) == 0
    expected = nsa_numba.nsa_select_attention(
        c["q"], c["k"], c["v"], strided.copy(), c["scale"], c["N1"], c["block"], c["count"],
        actual_seq_qlen=c["ends"], actual_seq_kvlen=c["ends"])[0]
    assert np.array_equal(c["out"].view(np.uint16), expected.view(np.uint16))


def test_aclnn_decoding_slots_broken_after_phase_one_are_refused_at_the_run():
    rng = np.random.default_rng(2)
    N, D, l, d, page = 2, 128, 32, 16, 128
    kv = rng.standard_normal((4, page, N, D)).astype(np.float16)
    weight = rng.standard_normal((l, N)).astype(np.float16)
    table = np.arange(4, dtype=np.int32).reshape(2, 2)
    cache = np.zeros((64, N, D), np.float16)
    slots = np.array([0, 1], np.int32)
    status, size, executor = A.aclnnNsaCompressWithCacheGetWorkspaceSize(
        kv, weight, slots, [32, 48], table, "TND", l, d, 1, page, cache)
    assert status == 0, A.aclGetRecentErrMsg()
    slots[1] = 10 ** 6
    check = _unchanged(cache)
    _run_fails(A.aclnnNsaCompressWithCache, size, executor, "slotMapping")
    check()


def test_aclnn_workspace_over_the_indices_is_refused():
    c = _select_call()
    size, _ = _aclnn_select(c)
    workspace = np.zeros(size + c["topk"].nbytes, np.uint8)
    inside = workspace[size:].view(np.int32).reshape(c["topk"].shape)
    inside[...] = c["topk"]
    size, executor = _aclnn_select(c, topk=inside)
    check = _unchanged(c["out"], c["smax"], c["ssum"], inside)
    _run_fails(A.aclnnNsaSelectedAttention, size, executor, "workspace overlaps the "
               "topkIndices tensor", workspace=workspace)
    check()


def test_aclnn_workspace_over_the_compressed_attention_mask_is_refused():
    rng = np.random.default_rng(3)
    T, Tc, N1, N2 = 200, 11, 4, 2
    q = rng.standard_normal((T, N1, 32)).astype(BF16)
    k = rng.standard_normal((Tc, N2, 32)).astype(BF16)
    v = rng.standard_normal((Tc, N2, 16)).astype(BF16)
    mask = np.arange(Tc)[None, :] * 16 + 31 > np.arange(T)[:, None]
    out = np.full((T, N1, 16), SENTINEL, BF16)
    topk = np.full((T, N2, 2), SENTINEL, np.int32)
    smax, ssum = (np.full((T, N1, 8), SENTINEL, np.float32) for _ in range(2))

    def phase_one(m):
        status, size, executor = A.aclnnNsaCompressAttentionGetWorkspaceSize(
            q, k, v, m, None, [T], [Tc], [3], 0.25, N1, "TND", 1, 32, 16, 64, 2, smax, ssum,
            out, topk)
        assert status == 0, A.aclGetRecentErrMsg()
        return size, executor

    size, _ = phase_one(mask)
    workspace = np.zeros(size + mask.nbytes, np.uint8)
    inside = workspace[size:].view(np.bool_).reshape(mask.shape)
    inside[...] = mask
    size, executor = phase_one(inside)
    check = _unchanged(out, topk, smax, ssum, inside)
    _run_fails(A.aclnnNsaCompressAttention, size, executor,
               "workspace overlaps the attenMaskOptional tensor", workspace=workspace)
    check()


# -- outputs whose elements share memory -----------------------------------------------

def _self_overlapping(shape, dtype):
    """An array of ``shape`` whose first axis has stride 0: every row is the same memory."""
    row = np.full(shape[1:], SENTINEL, dtype)
    return np.lib.stride_tricks.as_strided(row, shape, (0,) + row.strides, writeable=True)


def test_an_output_whose_elements_share_memory_is_refused():
    T, N, block, count, D = 256, 2, 16, 4, 16
    q, k, v, topk, o, m, s = _small_forward(T, N, D, block, count)
    rng = np.random.default_rng(4)
    dk = _self_overlapping(k.shape, np.float32)
    check = _unchanged(dk)
    _rejects(["dk has elements that share memory"],
             lambda: nsa_numba.nsa_select_attention_grad(
                 np.ones_like(o), q, k, v, o, m, s, topk, 0.25, N, block, count, dk=dk,
                 strict=False))
    out = _self_overlapping((T, N, D), np.float32)
    _rejects(["attention_out has elements that share memory"],
             lambda: nsa_numba.fusion_attention(q, k, v, N, "TND", actual_seq_qlen=[T],
                                                actual_seq_kvlen=[T], attention_out=out))
    x = rng.standard_normal((T, N, D)).astype(np.float32)
    w = rng.standard_normal((32, N)).astype(np.float32)
    windows = (T - 32) // 16 + 1
    compressed = _self_overlapping((windows, N, D), np.float32)
    _rejects(["out has elements that share memory"],
             lambda: nsa_numba.nsa_compress(x, w, 32, 16, out=compressed, strict=False))
    cache = _self_overlapping((8, N, D), np.float32)
    _rejects(["cache has elements that share memory"],
             lambda: nsa_numba.nsa_compress_infer(x, w, np.array([0]), 32, 16, 128,
                                                  actual_seq_len=[32], cache=cache,
                                                  strict=False))
    check()


def test_self_overlap_is_decided_exactly_for_interleaved_strides():
    from nsa_numba._ops.checks import self_overlaps
    base = np.zeros(64, np.float32)
    as_strided = np.lib.stride_tricks.as_strided
    assert not self_overlaps(as_strided(base, (2, 3), (12, 8)))   # 0 8 16 / 12 20 28
    assert self_overlaps(as_strided(base, (2, 3), (8, 4)))        # 0 4 8 / 8 ...
    assert not self_overlaps(base[::-3])
    assert not self_overlaps(base.reshape(4, 4, 4).transpose(2, 0, 1)[:, ::2])
    assert self_overlaps(as_strided(base, (3, 2), (4, 2)))         # 2-byte steps, 4 bytes


# -- values no check expected ----------------------------------------------------------

@pytest.mark.parametrize("scale", [10 ** 400, -(10 ** 400), float("inf"), float("nan")])
def test_scales_beyond_float_are_refused_by_name(scale):
    q = np.zeros((16, 2, 16), np.float32)
    _rejects(["scale must be a finite real number"], lambda: nsa_numba.fusion_attention(
        q, q, q, 2, "TND", scale=scale, actual_seq_qlen=[16], actual_seq_kvlen=[16]))
    c = _select_call()
    _rejects(["scale_value must be a finite real number"],
             lambda: nsa_numba.nsa_select_attention(
                 c["q"], c["k"], c["v"], c["topk"], scale, c["N1"], c["block"], c["count"]))


def test_a_masked_array_is_refused_by_name():
    q = np.ma.masked_array(np.zeros((16, 2, 16), np.float32))
    k = np.zeros((16, 2, 16), np.float32)
    _rejects(["query must be a plain numpy.ndarray", "MaskedArray"],
             lambda: nsa_numba.fusion_attention(q, k, k, 2, "TND", actual_seq_qlen=[16],
                                                actual_seq_kvlen=[16]))
    out = np.ma.masked_array(np.zeros((16, 2, 16), np.float32))
    _rejects(["attention_out must be a plain numpy.ndarray"],
             lambda: nsa_numba.fusion_attention(k, k, k, 2, "TND", actual_seq_qlen=[16],
                                                actual_seq_kvlen=[16], attention_out=out))


def test_sparse_and_mixed_device_tensors_are_refused_by_name():
    torch = pytest.importorskip("torch")
    from nsa_numba.torch import npu_fusion_attention, npu_nsa_select_attention
    q = torch.randn(64, 2, 16)
    with pytest.raises(NsaError, match="query must be a dense"):
        npu_fusion_attention(q.to_sparse(), q, q, 2, "TND", actual_seq_qlen=[64],
                             actual_seq_kvlen=[64])
    mask = torch.ones(64, 64, dtype=torch.bool).to_sparse()
    with pytest.raises(NsaError, match="atten_mask must be a dense"):
        npu_fusion_attention(q, q, q, 2, "TND", atten_mask=mask, sparse_mode=1,
                             actual_seq_qlen=[64], actual_seq_kvlen=[64])
    meta = torch.empty(128, 2, 192, device="meta", dtype=torch.bfloat16)
    k = torch.randn(128, 1, 192, dtype=torch.bfloat16)
    v = torch.randn(128, 1, 128, dtype=torch.bfloat16)
    topk = torch.full((128, 1, 2), 1000, dtype=torch.int32)
    with pytest.raises(NsaError, match="key is on device cpu and query on meta"):
        npu_nsa_select_attention(meta, k, v, topk, 0.1, 2, 64, 2, actual_seq_qlen=[128],
                                 actual_seq_kvlen=[128])
