"""aclnnNsaSelectedAttention / ...Grad: the two phases, the NumPy API's bits, status
codes, the executor rules, and nothing written on failure."""

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from nsa_numba.aclnn import (ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID,
                             ACLNN_ERR_PARAM_NULLPTR, ACLNN_SUCCESS, aclGetRecentErrMsg,
                             aclnnNsaCompress, aclnnNsaSelectedAttention,
                             aclnnNsaSelectedAttentionGetWorkspaceSize,
                             aclnnNsaSelectedAttentionGrad,
                             aclnnNsaSelectedAttentionGradGetWorkspaceSize)
from nsa_numba.bench.cases import select_problem


def _problem(dtype=ml_dtypes.bfloat16):
    q, k, v, topk, scale, ends = select_problem([32, 64], 8, 2, 192, 128, 16, 2,
                                                np.dtype(dtype), seed=3)
    T1, N1 = q.shape[:2]
    outs = dict(softmaxMaxOut=np.full((T1, N1, 8), 5, np.float32),
                softmaxSumOut=np.full((T1, N1, 8), 5, np.float32),
                attentionOut=np.full((T1, N1, 128), 5, q.dtype))
    call = dict(query=q, key=k, value=v, topkIndices=topk, attenMaskOptional=np.ones(1),
                actualSeqQLenOptional=ends, actualSeqKvLenOptional=ends, scaleValue=scale,
                headNum=N1, inputLayout="TND", sparseMode=2, selectedBlockSize=16,
                selectedBlockCount=2)
    return call, outs


def _forward(call, outs):
    status, size, executor = aclnnNsaSelectedAttentionGetWorkspaceSize(**call, **outs)
    if status != ACLNN_SUCCESS:
        return status, None
    workspace = np.empty(size, np.uint8) if size else None
    return aclnnNsaSelectedAttention(workspace, size, executor), executor


def _python(call, causal=True):
    return nsa_numba.nsa_select_attention(
        call["query"], call["key"], call["value"], call["topkIndices"], call["scaleValue"],
        call["headNum"], call["selectedBlockSize"], call["selectedBlockCount"],
        atten_mask=np.ones(1) if causal else None,
        actual_seq_qlen=call["actualSeqQLenOptional"],
        actual_seq_kvlen=call["actualSeqKvLenOptional"])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_both_phases_give_the_numpy_api_bits(dtype):
    call, outs = _problem(dtype)
    status, _ = _forward(call, outs)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    want = _python(call)
    for got, ref in zip((outs["attentionOut"], outs["softmaxMaxOut"],
                         outs["softmaxSumOut"]), want):
        assert np.array_equal(got.view(np.uint8), ref.view(np.uint8))
    grad = np.random.default_rng(0).standard_normal(want[0].shape).astype(want[0].dtype)
    dq, dk, dv = (np.full(call[k].shape, 5, call[k].dtype) for k in ("query", "key", "value"))
    status, size, executor = aclnnNsaSelectedAttentionGradGetWorkspaceSize(
        call["query"], call["key"], call["value"], want[0], grad, want[1], want[2],
        call["topkIndices"], call["actualSeqQLenOptional"], call["actualSeqKvLenOptional"],
        call["attenMaskOptional"], call["scaleValue"], 16, 2, call["headNum"], "TND", 2, dq,
        dk, dv)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    assert aclnnNsaSelectedAttentionGrad(np.empty(size, np.uint8), size, executor) == 0
    ref = nsa_numba.nsa_select_attention_grad(
        grad, call["query"], call["key"], call["value"], *want, call["topkIndices"],
        call["scaleValue"], call["headNum"], 16, 2, atten_mask=np.ones(1),
        actual_seq_qlen=call["actualSeqQLenOptional"],
        actual_seq_kvlen=call["actualSeqKvLenOptional"])
    for got, r in zip((dq, dk, dv), ref):
        assert np.array_equal(got.view(np.uint8), r.view(np.uint8))


def test_sparse_mode_0_ignores_the_mask():
    call, outs = _problem()
    call["sparseMode"] = 0
    assert _forward(call, outs)[0] == ACLNN_SUCCESS
    assert np.array_equal(outs["attentionOut"].view(np.uint8),
                          _python(call, causal=False)[0].view(np.uint8))


def _set(key, value):
    return lambda call, outs: (call if key in call else outs).__setitem__(key, value(
        call if key in call else outs) if callable(value) else value)


BAD = {
    "query null": (_set("query", None), ACLNN_ERR_PARAM_NULLPTR, "query"),
    "output null": (_set("attentionOut", None), ACLNN_ERR_PARAM_NULLPTR, "attentionOut"),
    "float32": (_set("key", lambda c: c["key"].astype(np.float32)), ACLNN_ERR_PARAM_INVALID,
                "key dtype"),
    "int64 indices": (_set("topkIndices", lambda c: c["topkIndices"].astype(np.int64)),
                      ACLNN_ERR_PARAM_INVALID, "topkIndices dtype must be int32"),
    "layout": (_set("inputLayout", "BSND"), ACLNN_ERR_PARAM_INVALID, "inputLayout"),
    "sparse mode": (_set("sparseMode", 1), ACLNN_ERR_PARAM_INVALID, "sparseMode"),
    "Dv 64": (_set("value", lambda c: np.ascontiguousarray(c["value"][..., :64])),
              ACLNN_ERR_INNER_TILING_ERROR, "Dv"),
    "index out of range": (lambda c, o: c["topkIndices"].__setitem__((40, 1, 0), 9),
                           ACLNN_ERR_PARAM_INVALID, "topkIndices[40, 1, 0] = 9"),
    "stats dtype": (_set("softmaxSumOut", lambda o: o["softmaxSumOut"].astype(np.float16)),
                    ACLNN_ERR_PARAM_INVALID, "softmaxSumOut dtype"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_phase_one_rejects(name):
    change, status, words = BAD[name]
    call, outs = _problem()
    change(call, outs)
    before = {k: a.copy() for k, a in outs.items() if a is not None}
    aclGetRecentErrMsg()
    got, _ = _forward(call, outs)
    assert got == status
    message = aclGetRecentErrMsg()
    assert words in message and message.startswith(
        "aclnnNsaSelectedAttentionGetWorkspaceSize: "), message
    for k, a in before.items():
        assert np.array_equal(outs[k], a)


def test_phase_two_rules():
    call, outs = _problem()
    status, size, executor = aclnnNsaSelectedAttentionGetWorkspaceSize(**call, **outs)
    assert status == ACLNN_SUCCESS and size > 0
    assert aclnnNsaSelectedAttention(np.empty(size - 1, np.uint8), size - 1, executor) \
        == ACLNN_ERR_PARAM_INVALID
    assert "at least" in aclGetRecentErrMsg()
    assert (outs["attentionOut"].view(np.uint16) == np.float32(5).view(np.uint32) >> 16).all()
    assert aclnnNsaCompress(np.empty(size, np.uint8), size, executor) == ACLNN_ERR_PARAM_INVALID
    assert "made by aclnnNsaSelectedAttentionGetWorkspaceSize" in aclGetRecentErrMsg()
    assert aclnnNsaSelectedAttention(np.empty(size, np.uint8), size, executor) == 0
    assert aclnnNsaSelectedAttention(np.empty(size, np.uint8), size, executor) \
        == ACLNN_ERR_PARAM_INVALID
    assert "not repeatable" in aclGetRecentErrMsg()


def test_workspace_holds_no_gathered_keys():
    # the paper's layer: blocks staged once (in the input's 16 bits), never per query
    from nsa_numba._ops import pipeline as _pipeline
    from nsa_numba._ops.operators import SELECT, SELECT_GRAD
    from nsa_numba._ops.select import select_rules
    T, N1, N2, D, Dv, l, c = 4096, 64, 4, 192, 128, 64, 16
    q = np.zeros((T, N1, D), ml_dtypes.bfloat16)
    k = np.zeros((T, N2, D), ml_dtypes.bfloat16)
    v = np.zeros((T, N2, Dv), ml_dtypes.bfloat16)
    topk = np.zeros((T, N2, c), np.int32)
    common = (topk, 0.1, N1, l, c, np.ones(1), [2048, 4096], [2048, 4096])
    fwd = _pipeline.plan(SELECT, select_rules("f"), (q, k, v, *common, None, None, None))
    out = np.zeros((T, N1, Dv), ml_dtypes.bfloat16)
    stats = np.zeros((T, N1, 8), np.float32)
    grad = _pipeline.plan(SELECT_GRAD, select_rules("g"),
                          (out, q, k, v, out, stats, stats, *common, None, None, None))
    gathered = T * c * l * D * 2           # one copy of the selected keys per query
    staged = k.nbytes + v.nbytes            # every key and value once
    assert fwd.workspace_bytes < staged + (8 << 20) < gathered // 50
    assert grad.workspace_bytes < 2 * staged + T * N2 * c * 8 + (8 << 20)
