"""aclnnNsaCompressAttention: the two phases, the NumPy API's bits, status codes, the
executor rules, and nothing written on failure."""

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from nsa_numba.aclnn import (ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID,
                             ACLNN_ERR_PARAM_NULLPTR, ACLNN_SUCCESS, aclGetRecentErrMsg,
                             aclnnNsaCompressAttention,
                             aclnnNsaCompressAttentionGetWorkspaceSize,
                             aclnnNsaSelectedAttention)

L, STRIDE, L_SEL, COUNT = 32, 16, 64, 2


def _problem(dtype=ml_dtypes.bfloat16, lengths=(300, 200), N1=8, N2=2, seed=3):
    rng = np.random.default_rng(seed)
    cmp = [(n - L) // STRIDE + 1 for n in lengths]
    sel = [-(-c // (L_SEL // STRIDE)) for c in cmp]
    q = rng.standard_normal((sum(lengths), N1, 192)).astype(dtype)
    k = rng.standard_normal((sum(cmp), N2, 192)).astype(dtype)
    v = rng.standard_normal((sum(cmp), N2, 128)).astype(dtype)
    s = np.arange(max(lengths))[:, None]
    mask = np.arange(max(cmp))[None, :] * STRIDE + L - 1 > s
    forced = np.zeros((max(lengths), max(sel)), np.uint8)
    forced[:, 0] = 1
    T1 = q.shape[0]
    outs = dict(softmaxMaxOut=np.full((T1, N1, 8), 5, np.float32),
                softmaxSumOut=np.full((T1, N1, 8), 5, np.float32),
                attentionOutOut=np.full((T1, N1, 128), 5, q.dtype),
                topkIndicesOut=np.full((T1, N2, COUNT), 5, np.int32))
    call = dict(query=q, key=k, value=v, attenMaskOptional=mask, topkMaskOptional=forced,
                actualSeqQLenOptional=np.cumsum(lengths).tolist(),
                actualCmpSeqKvLenOptional=np.cumsum(cmp).tolist(),
                actualSelSeqKvLenOptional=np.cumsum(sel).tolist(), scaleValue=192 ** -0.5,
                headNum=N1, inputLayout="TND", sparseMode=1, compressBlockSize=L,
                compressStride=STRIDE, selectBlockSize=L_SEL, selectBlockCount=COUNT)
    return call, outs


def _run(call, outs):
    status, size, executor = aclnnNsaCompressAttentionGetWorkspaceSize(**call, **outs)
    if status != ACLNN_SUCCESS:
        return status, None
    workspace = np.empty(size, np.uint8) if size else None
    return aclnnNsaCompressAttention(workspace, size, executor), executor


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", [0, 1])
def test_both_phases_give_the_numpy_api_bits(dtype, mode):
    call, outs = _problem(dtype)
    call["sparseMode"] = mode
    status, _ = _run(call, outs)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    want = nsa_numba.nsa_compress_attention(
        call["query"], call["key"], call["value"], call["scaleValue"], call["headNum"], L,
        STRIDE, L_SEL, COUNT, topk_mask=call["topkMaskOptional"],
        atten_mask=call["attenMaskOptional"], actual_seq_qlen=call["actualSeqQLenOptional"],
        actual_cmp_seq_kvlen=call["actualCmpSeqKvLenOptional"],
        actual_sel_seq_kvlen=call["actualSelSeqKvLenOptional"])
    for got, ref in zip((outs["attentionOutOut"], outs["topkIndicesOut"],
                         outs["softmaxMaxOut"], outs["softmaxSumOut"]), want):
        assert np.array_equal(got.view(np.uint8), ref.view(np.uint8))
    assert (outs["topkIndicesOut"][:, :, 0] == 0).all()          # the forced block first


@pytest.mark.parametrize("change,status,words", [
    (dict(query=None), ACLNN_ERR_PARAM_NULLPTR, "query"),
    (dict(attentionOutOut=None), ACLNN_ERR_PARAM_NULLPTR, "attentionOutOut"),
    (dict(inputLayout="BSND"), ACLNN_ERR_PARAM_INVALID, "inputLayout must be 'TND'"),
    (dict(sparseMode=2), ACLNN_ERR_PARAM_INVALID, "sparseMode must be 0 or 1"),
    (dict(topkIndicesOut=np.zeros((500, 2, 2), np.int64)), ACLNN_ERR_PARAM_INVALID,
     "topkIndicesOut dtype must be int32"),
    (dict(attenMaskOptional=np.zeros((300, 19), np.float32)), ACLNN_ERR_PARAM_INVALID,
     "attenMaskOptional dtype must be bool or uint8"),
    (dict(selectBlockCount=5), ACLNN_ERR_PARAM_INVALID, "selectBlockCount = 5 is more"),
    (dict(selectBlockCount=40), ACLNN_ERR_INNER_TILING_ERROR,
     "selectBlockCount must be <= 32"),
    (dict(compressStride=8), ACLNN_ERR_INNER_TILING_ERROR,
     "compressStride must be a multiple of 16"),
    (dict(actualSelSeqKvLenOptional=None), ACLNN_ERR_PARAM_INVALID, "go together"),
], ids=["query", "out", "layout", "mode", "topk dtype", "mask dtype", "count", "count limit",
        "stride", "lists"])
def test_failures_return_status_and_write_nothing(change, status, words):
    call, outs = _problem()
    for key, value in change.items():
        (outs if key in outs else call)[key] = value
    before = {k: None if a is None else a.copy() for k, a in outs.items()}
    got, _ = _run(call, outs)
    message = aclGetRecentErrMsg()
    assert got == status, message
    assert words in message and message.startswith("aclnnNsaCompressAttentionGetWorkspaceSize")
    for k, a in outs.items():
        if a is not None and before[k] is not None:
            assert np.array_equal(a.view(np.uint8), before[k].view(np.uint8)), k


def test_the_executor_belongs_to_its_operator():
    call, outs = _problem()
    status, size, executor = aclnnNsaCompressAttentionGetWorkspaceSize(**call, **outs)
    assert status == ACLNN_SUCCESS
    workspace = np.empty(size, np.uint8)
    assert aclnnNsaSelectedAttention(workspace, size, executor) == ACLNN_ERR_PARAM_INVALID
    assert "made by aclnnNsaCompressAttentionGetWorkspaceSize" in aclGetRecentErrMsg()
    assert aclnnNsaCompressAttention(workspace, size - 1, executor) == ACLNN_ERR_PARAM_INVALID
    assert "at least" in aclGetRecentErrMsg()
    assert aclnnNsaCompressAttention(workspace, size, executor) == ACLNN_SUCCESS
    assert aclnnNsaCompressAttention(workspace, size, executor) == ACLNN_ERR_PARAM_INVALID
    assert "not repeatable" in aclGetRecentErrMsg()
