"""The aclnn two-phase C API of the NSA operators, mirrored in Python.

Code written against CANN's ``aclnnNsaCompress`` / ``aclnnNsaCompressGrad`` /
``aclnnNsaCompressWithCache`` / ``aclnnNsaSelectedAttention`` /
``aclnnNsaSelectedAttentionGrad`` / ``aclnnNsaCompressAttention`` runs unchanged and
fails the same way:

1. ``aclnn...GetWorkspaceSize(...)`` validates every argument against the NPU's
   documented constraints and returns ``(status, workspace_size, executor)``;
2. the caller allocates ``workspace_size`` bytes (a writable, C-contiguous numpy
   array; ``None`` when the size is 0);
3. ``aclnn...(workspace, workspace_size, executor, stream)`` computes into the
   output tensors given in phase 1 and returns a status.

Mapping of C types: ``None`` is a null pointer; a numpy array of any strides is an
``aclTensor``; a list, tuple or 1-D integer array is an ``aclIntArray``; a str or None
is the layout string. Execution is synchronous on the CPU: ``stream`` must be None.

These functions never raise for bad input. They return a status code and leave a
message for ``aclGetRecentErrMsg()`` (kept per thread, newest first, cleared when
read). An unexpected internal exception becomes ``ACLNN_ERR_INNER`` with its
message. On any failure no output element changes.

The checks are the same code as ``nsa_numba.nsa_compress`` / ``nsa_compress_grad`` /
``nsa_compress_infer`` / ``nsa_select_attention`` / ``_grad`` /
``nsa_compress_attention`` in strict mode (``_ops.compress``, ``_ops.infer``, ``_ops.select``,
``_ops.compress_attention``), with the C parameter names, float16 / bfloat16 only, and
int32 ``slotMapping`` / ``blockTableOptional`` / ``topkIndices``; selected attention
also takes ``inputLayout`` "TND" only and ``sparseMode`` 0 or 2, compressed attention
"TND" and 0 or 1. Compressed attention has no gradient operator on the NPU (torch_npu
differentiates it with its generic attention gradient), so none here.
The with-cache operator returns 561002 (``ACLNN_ERR_INNER_TILING_ERROR``) for what
the NPU's tiling rejects, as the NPU does.
"""

import contextlib
import threading

import numpy as np

from ._core.errors import (
    ACLNN_ERR_INNER,
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    ACLNN_SUCCESS,
    NsaError,
    invalid,
)
from ._ops import pipeline as _pipeline
from ._ops.checks import BFLOAT16, FLOAT16, Rules, overlaps
from ._ops.compress_attention import compress_attention_rules
from ._ops.infer import infer_rules
from ._ops.operators import (
    COMPRESS,
    COMPRESS_ATTENTION,
    COMPRESS_GRAD,
    COMPRESS_INFER,
    SELECT,
    SELECT_GRAD,
)
from ._ops.select import select_rules

__all__ = [
    "ACLNN_SUCCESS", "ACLNN_ERR_PARAM_NULLPTR", "ACLNN_ERR_PARAM_INVALID",
    "ACLNN_ERR_RUNTIME_ERROR", "ACLNN_ERR_INNER",
    "aclnnNsaCompressGetWorkspaceSize", "aclnnNsaCompress",
    "aclnnNsaCompressGradGetWorkspaceSize", "aclnnNsaCompressGrad",
    "aclnnNsaCompressWithCacheGetWorkspaceSize", "aclnnNsaCompressWithCache",
    "ACLNN_ERR_INNER_TILING_ERROR",
    "aclnnNsaSelectedAttentionGetWorkspaceSize", "aclnnNsaSelectedAttention",
    "aclnnNsaSelectedAttentionGradGetWorkspaceSize", "aclnnNsaSelectedAttentionGrad",
    "aclnnNsaCompressAttentionGetWorkspaceSize", "aclnnNsaCompressAttention",
    "aclGetRecentErrMsg", "aclSetAclOpExecutorRepeatable", "aclDestroyAclOpExecutor",
    "aclOpExecutor",
]

_COMMON_NAMES = {
    "input": "input", "weight": "weight",
    "block": "compressBlockSize", "stride": "compressStride",
    "actual_seq_len_type": "actSeqLenType",
}
FORWARD_RULES = Rules(
    "aclnnNsaCompressGetWorkspaceSize",
    names=dict(_COMMON_NAMES, out="output", actual_seq_len="actSeqLenOptional",
               layout="layoutOptional"),
    dtypes=(FLOAT16, BFLOAT16), strict=True, allocate_outputs=False)
GRAD_RULES = Rules(
    "aclnnNsaCompressGradGetWorkspaceSize",
    names=dict(_COMMON_NAMES, grad="outputGrad", input_grad="inputGradOut",
               weight_grad="weightGradOut", actual_seq_len="actSeqLenOptionalOptional",
               layout="layoutOptionalOptional"),
    dtypes=(FLOAT16, BFLOAT16), strict=True, allocate_outputs=False)

INFER_RULES = infer_rules(
    "aclnnNsaCompressWithCacheGetWorkspaceSize",
    names=dict(input="input", weight="weight", slot_mapping="slotMapping",
               block="compressBlockSize", stride="compressStride", page="pageBlockSize",
               block_table="blockTableOptional", actual_seq_len="actSeqLenOptional",
               layout="layoutOptional", cache="outputCache",
               actual_seq_len_type="actSeqLenType"),
    dtypes=(FLOAT16, BFLOAT16), index_dtype=np.dtype(np.int32), strict=True)

_SELECT_NAMES = dict(
    query="query", key="key", value="value", topk="topkIndices", scale="scaleValue",
    head_num="headNum", block="selectedBlockSize", count="selectedBlockCount",
    atten_mask="attenMaskOptional", seq_q="actualSeqQLenOptional",
    seq_kv="actualSeqKvLenOptional", attention_out="attentionOut",
    softmax_max="softmaxMaxOut", softmax_sum="softmaxSumOut")
SELECT_RULES = select_rules(
    "aclnnNsaSelectedAttentionGetWorkspaceSize", names=_SELECT_NAMES,
    dtypes=(FLOAT16, BFLOAT16), index_dtype=np.dtype(np.int32), strict=True,
    allocate_outputs=False)
SELECT_GRAD_RULES = select_rules(
    "aclnnNsaSelectedAttentionGradGetWorkspaceSize",
    names=dict(_SELECT_NAMES, attention_out="attentionOut", grad="attentionOutGrad",
               softmax_max="softmaxMax", softmax_sum="softmaxSum", dq="dqOut", dk="dkOut",
               dv="dvOut"),
    dtypes=(FLOAT16, BFLOAT16), index_dtype=np.dtype(np.int32), strict=True,
    allocate_outputs=False)

CMP_RULES = compress_attention_rules(
    "aclnnNsaCompressAttentionGetWorkspaceSize",
    names=dict(query="query", key="key", value="value", scale="scaleValue", head_num="headNum",
               block="compressBlockSize", stride="compressStride",
               select_block="selectBlockSize", count="selectBlockCount",
               topk_mask="topkMaskOptional", atten_mask="attenMaskOptional",
               seq_q="actualSeqQLenOptional", seq_kv="actualCmpSeqKvLenOptional",
               seq_sel="actualSelSeqKvLenOptional", attention_out="attentionOutOut",
               topk="topkIndicesOut", softmax_max="softmaxMaxOut",
               softmax_sum="softmaxSumOut"),
    dtypes=(FLOAT16, BFLOAT16), strict=True, allocate_outputs=False)

_errors = threading.local()


def aclGetRecentErrMsg():
    """The calling thread's error messages since the last call, newest first; then cleared.

    Returns "" when there are none.
    """
    messages = getattr(_errors, "messages", [])
    _errors.messages = []
    return "\n".join(reversed(messages))


def _fail(status, message):
    if not hasattr(_errors, "messages"):
        _errors.messages = []
    _errors.messages.append(message)
    return status


class aclOpExecutor:
    """What phase one hands to phase two: the validated plan and its run state.

    Runs once, unless ``aclSetAclOpExecutorRepeatable`` was called; a repeatable
    executor runs until ``aclDestroyAclOpExecutor``. Each run reads the current
    contents of the tensors given in phase one; where the checks read contents
    (selected attention's indices, the with-cache operator's slots and block table),
    each run checks them again first and fails with nothing written.
    """

    def __init__(self, plan, operator, rules, args):
        self.plan = plan
        #: what phase one was given: a run re-checks the arrays whose contents the
        #: checks read (``Operator.reads_contents``) by planning again
        self.call = (operator, rules, args)
        self.repeatable = False
        self.runs = 0
        self.destroyed = False
        self._lock = threading.Lock()

    def __repr__(self):
        if self.destroyed:
            return "<aclOpExecutor destroyed>"
        kind = "repeatable " if self.repeatable else ""
        return (f"<aclOpExecutor {kind}{self.plan.summary()} "
                f"workspace={self.plan.workspace_bytes} bytes runs={self.runs}>")


def _get_workspace_size(rules, operator, *args):
    try:
        plan = _pipeline.plan(operator, rules, args)
    except NsaError as err:
        return _fail(err.status, str(err)), 0, None
    except Exception as err:  # noqa: BLE001 - an unexpected failure must not escape
        return _fail(ACLNN_ERR_INNER, f"{rules.op}: internal error: "
                                      f"{type(err).__name__}: {err}"), 0, None
    return ACLNN_SUCCESS, plan.workspace_bytes, aclOpExecutor(plan, operator, rules, args)


def aclnnNsaCompressGetWorkspaceSize(input, weight, actSeqLenOptional, layoutOptional,
                                     compressBlockSize, compressStride, actSeqLenType,
                                     output):
    """Phase one of the forward: validate, plan. -> (status, workspace_size, executor)."""
    return _get_workspace_size(FORWARD_RULES, COMPRESS, input, weight,
                               compressBlockSize, compressStride, actSeqLenOptional,
                               actSeqLenType, layoutOptional, output)


def aclnnNsaCompressGradGetWorkspaceSize(outputGrad, input, weight,
                                         actSeqLenOptionalOptional, compressBlockSize,
                                         compressStride, actSeqLenType,
                                         layoutOptionalOptional, inputGradOut,
                                         weightGradOut):
    """Phase one of the backward: validate, plan. -> (status, workspace_size, executor)."""
    return _get_workspace_size(GRAD_RULES, COMPRESS_GRAD, outputGrad, input, weight,
                               compressBlockSize, compressStride, actSeqLenOptionalOptional,
                               actSeqLenType, layoutOptionalOptional, inputGradOut,
                               weightGradOut)


def aclnnNsaCompressWithCacheGetWorkspaceSize(input, weight, slotMapping, actSeqLenOptional,
                                              blockTableOptional, layoutOptional,
                                              compressBlockSize, compressStride,
                                              actSeqLenType, pageBlockSize, outputCache):
    """Phase one of the with-cache operator: validate, plan.
    -> (status, workspace_size, executor). ``slotMapping`` and ``blockTableOptional``
    are int32 arrays; ``actSeqLenOptional`` holds per-sequence lengths
    (``actSeqLenType`` 1)."""
    return _get_workspace_size(INFER_RULES, COMPRESS_INFER, input, weight, slotMapping,
                               compressBlockSize, compressStride, pageBlockSize,
                               blockTableOptional, actSeqLenOptional, actSeqLenType,
                               layoutOptional, outputCache)


def _layout_and_mode(rules, inputLayout, sparseMode, modes, meaning):
    """NsaError for a layout other than TND or a sparseMode not in ``modes``."""
    if not (isinstance(inputLayout, str) and inputLayout == "TND"):
        raise invalid(rules.op, f"inputLayout must be 'TND', got {inputLayout!r}")
    if isinstance(sparseMode, (bool, np.bool_)) or sparseMode not in modes:
        raise invalid(rules.op, f"sparseMode must be {' or '.join(map(str, modes))} "
                                f"({meaning}), got {sparseMode!r}")


def _select_mask(rules, inputLayout, sparseMode, attenMaskOptional):
    """The mask the planner gets (causal only with sparseMode 2 and a mask), or NsaError
    for a layout other than TND or a sparseMode other than 0 and 2."""
    _layout_and_mode(rules, inputLayout, sparseMode, (0, 2),
                     "2: causal when attenMaskOptional is given")
    return attenMaskOptional if sparseMode == 2 else None


def aclnnNsaSelectedAttentionGetWorkspaceSize(query, key, value, topkIndices,
                                              attenMaskOptional, actualSeqQLenOptional,
                                              actualSeqKvLenOptional, scaleValue, headNum,
                                              inputLayout, sparseMode, selectedBlockSize,
                                              selectedBlockCount, softmaxMaxOut,
                                              softmaxSumOut, attentionOut):
    """Phase one of selected attention: validate, plan. -> (status, workspace_size,
    executor). ``topkIndices`` int32 ``[T1, N2, c]``; the length lists are prefix sums;
    the mask applies (derived from the indices, contents not read) with ``sparseMode``
    2."""
    try:
        mask = _select_mask(SELECT_RULES, inputLayout, sparseMode, attenMaskOptional)
    except NsaError as err:
        return _fail(err.status, str(err)), 0, None
    return _get_workspace_size(SELECT_RULES, SELECT, query, key, value, topkIndices,
                               scaleValue, headNum, selectedBlockSize, selectedBlockCount,
                               mask, actualSeqQLenOptional, actualSeqKvLenOptional,
                               attentionOut, softmaxMaxOut, softmaxSumOut)


def aclnnNsaSelectedAttentionGradGetWorkspaceSize(query, key, value, attentionOut,
                                                  attentionOutGrad, softmaxMax, softmaxSum,
                                                  topkIndices, actualSeqQLenOptional,
                                                  actualSeqKvLenOptional, attenMaskOptional,
                                                  scaleValue, selectedBlockSize,
                                                  selectedBlockCount, headNum, inputLayout,
                                                  sparseMode, dqOut, dkOut, dvOut):
    """Phase one of the selected-attention gradient. -> (status, workspace_size,
    executor). The gradient is that of the forward with the same mask and sparseMode
    (docs/reference.md: the NPU masks with sparseMode 2 even without a mask)."""
    try:
        mask = _select_mask(SELECT_GRAD_RULES, inputLayout, sparseMode, attenMaskOptional)
    except NsaError as err:
        return _fail(err.status, str(err)), 0, None
    return _get_workspace_size(SELECT_GRAD_RULES, SELECT_GRAD, attentionOutGrad, query, key,
                               value, attentionOut, softmaxMax, softmaxSum, topkIndices,
                               scaleValue, headNum, selectedBlockSize, selectedBlockCount,
                               mask, actualSeqQLenOptional, actualSeqKvLenOptional, dqOut,
                               dkOut, dvOut)


def aclnnNsaCompressAttentionGetWorkspaceSize(query, key, value, attenMaskOptional,
                                              topkMaskOptional, actualSeqQLenOptional,
                                              actualCmpSeqKvLenOptional,
                                              actualSelSeqKvLenOptional, scaleValue, headNum,
                                              inputLayout, sparseMode, compressBlockSize,
                                              compressStride, selectBlockSize,
                                              selectBlockCount, softmaxMaxOut, softmaxSumOut,
                                              attentionOutOut, topkIndicesOut):
    """Phase one of compressed attention: validate, plan. -> (status, workspace_size,
    executor). Masks bool or uint8 (1 = masked, 1 = forced), the length lists prefix
    sums, ``topkIndicesOut`` int32 ``[T1, N2, selectBlockCount]``; ``sparseMode`` 0 or
    1 (torch_npu passes 1), the mask applying whenever it is given."""
    try:
        _layout_and_mode(CMP_RULES, inputLayout, sparseMode, (0, 1),
                         "the mask applies when given")
    except NsaError as err:
        return _fail(err.status, str(err)), 0, None
    return _get_workspace_size(CMP_RULES, COMPRESS_ATTENTION, query, key, value, scaleValue,
                               headNum, compressBlockSize, compressStride, selectBlockSize,
                               selectBlockCount, topkMaskOptional, attenMaskOptional,
                               actualSeqQLenOptional, actualCmpSeqKvLenOptional,
                               actualSelSeqKvLenOptional, attentionOutOut, topkIndicesOut,
                               softmaxMaxOut, softmaxSumOut)


def _check_run(op, kind, workspace, workspace_size, executor, stream):
    """The workspace as C-contiguous uint8 bytes, or raise NsaError. Caller holds the lock."""
    if executor is None:
        raise NsaError(f"{op}: executor is required but got None (a null pointer)",
                       ACLNN_ERR_PARAM_NULLPTR)
    if not isinstance(executor, aclOpExecutor):
        raise NsaError(f"{op}: executor must be an aclOpExecutor from "
                       f"{op}GetWorkspaceSize, got {type(executor).__name__}")
    if executor.destroyed:
        raise NsaError(f"{op}: executor was destroyed by aclDestroyAclOpExecutor")
    if executor.plan.op != kind:
        other = _OPERATORS[executor.plan.op]
        raise NsaError(f"{op}: executor was made by {other}GetWorkspaceSize, "
                       f"not {op}GetWorkspaceSize")
    if executor.runs and not executor.repeatable:
        raise NsaError(f"{op}: executor already ran once and is not repeatable "
                       f"(call aclSetAclOpExecutorRepeatable before its first run)")
    if stream is not None:
        raise NsaError(f"{op}: stream must be None (the CPU runs synchronously), "
                       f"got {type(stream).__name__}")
    needed = executor.plan.workspace_bytes
    if isinstance(workspace_size, (bool, np.bool_)) or not isinstance(
            workspace_size, (int, np.integer)):
        raise NsaError(f"{op}: workspaceSize must be an integer, got {workspace_size!r}")
    if workspace_size < needed:
        raise NsaError(f"{op}: workspaceSize must be at least {needed} bytes (from "
                       f"{op}GetWorkspaceSize), got {workspace_size}")
    if needed == 0:
        return None
    if workspace is None:
        raise NsaError(f"{op}: workspace must be an array of {needed} bytes, got None")
    if not isinstance(workspace, np.ndarray):
        raise NsaError(f"{op}: workspace must be a numpy.ndarray, got "
                       f"{type(workspace).__name__}")
    if workspace.dtype.hasobject:
        raise NsaError(f"{op}: workspace must hold plain bytes (e.g. uint8), got dtype "
                       f"{workspace.dtype} (Python object references)")
    if not workspace.flags.c_contiguous:
        raise NsaError(f"{op}: workspace must be C-contiguous, got strides "
                       f"{workspace.strides}")
    if not workspace.flags.writeable:
        raise NsaError(f"{op}: workspace must be writable, got a read-only array")
    if workspace.nbytes < workspace_size:
        raise NsaError(f"{op}: workspace holds {workspace.nbytes} bytes, fewer than "
                       f"workspaceSize = {workspace_size}")
    for name, array in _pipeline.array_arguments(*executor.call):
        if overlaps(workspace, array):
            raise NsaError(f"{op}: workspace overlaps the {name} tensor in memory")
    return workspace.reshape(-1).view(np.uint8)


def _run(op, kind, workspace, workspace_size, executor, stream):
    lock = executor._lock if isinstance(executor, aclOpExecutor) else contextlib.nullcontext()
    try:
        with lock:
            raw = _check_run(op, kind, workspace, workspace_size, executor, stream)
            operator, rules, args = executor.call
            plan = executor.plan
            if operator.reads_contents:         # every check again, on what is there now
                try:
                    plan = _pipeline.plan(operator, rules, args)
                except NsaError as err:
                    why = str(err).removeprefix(f"{rules.op}: ")
                    raise NsaError(f"{op}: checked again at this run: {why}",
                                   err.status) from None
                if plan.workspace_bytes > executor.plan.workspace_bytes:
                    raise AssertionError("a plan's workspace grew with the index contents")
            _pipeline.launch(plan, raw)
            executor.runs += 1
    except NsaError as err:
        return _fail(err.status, str(err))
    except MemoryError as err:
        return _fail(ACLNN_ERR_RUNTIME_ERROR, f"{op}: out of memory: {err}")
    except Exception as err:  # noqa: BLE001 - an unexpected failure must not escape
        return _fail(ACLNN_ERR_INNER, f"{op}: internal error: {type(err).__name__}: {err}")
    return ACLNN_SUCCESS


#: the operator each plan kind belongs to
_OPERATORS = {"forward": "aclnnNsaCompress", "grad": "aclnnNsaCompressGrad",
              "infer": "aclnnNsaCompressWithCache", "select": "aclnnNsaSelectedAttention",
              "select_grad": "aclnnNsaSelectedAttentionGrad",
              "compress_attention": "aclnnNsaCompressAttention"}


def aclnnNsaCompress(workspace, workspaceSize, executor, stream=None):
    """Phase two of the forward: compute ``output``. -> status."""
    return _run("aclnnNsaCompress", "forward", workspace, workspaceSize, executor, stream)


def aclnnNsaCompressGrad(workspace, workspaceSize, executor, stream=None):
    """Phase two of the backward: compute ``inputGradOut`` and ``weightGradOut``. -> status."""
    return _run("aclnnNsaCompressGrad", "grad", workspace, workspaceSize, executor, stream)


def aclnnNsaCompressWithCache(workspace, workspaceSize, executor, stream=None):
    """Phase two of the with-cache operator: update ``outputCache`` in place. -> status."""
    return _run("aclnnNsaCompressWithCache", "infer", workspace, workspaceSize, executor,
                stream)


def aclnnNsaSelectedAttention(workspace, workspaceSize, executor, stream=None):
    """Phase two of selected attention: compute ``attentionOut``, ``softmaxMaxOut`` and
    ``softmaxSumOut``. -> status."""
    return _run("aclnnNsaSelectedAttention", "select", workspace, workspaceSize, executor,
                stream)


def aclnnNsaSelectedAttentionGrad(workspace, workspaceSize, executor, stream=None):
    """Phase two of the selected-attention gradient: compute ``dqOut``, ``dkOut`` and
    ``dvOut``. -> status."""
    return _run("aclnnNsaSelectedAttentionGrad", "select_grad", workspace, workspaceSize,
                executor, stream)


def aclnnNsaCompressAttention(workspace, workspaceSize, executor, stream=None):
    """Phase two of compressed attention: compute ``attentionOutOut``, ``topkIndicesOut``,
    ``softmaxMaxOut`` and ``softmaxSumOut``. -> status."""
    return _run("aclnnNsaCompressAttention", "compress_attention", workspace, workspaceSize,
                executor, stream)


def _executor_call(op, executor):
    if executor is None:
        return _fail(ACLNN_ERR_PARAM_NULLPTR,
                     f"{op}: executor is required but got None (a null pointer)")
    if not isinstance(executor, aclOpExecutor):
        return _fail(ACLNN_ERR_PARAM_INVALID, f"{op}: executor must be an aclOpExecutor, "
                                              f"got {type(executor).__name__}")
    if executor.destroyed:
        return _fail(ACLNN_ERR_PARAM_INVALID, f"{op}: executor was already destroyed")
    return ACLNN_SUCCESS


def aclSetAclOpExecutorRepeatable(executor):
    """Let ``executor`` run any number of times (until destroyed). -> status.

    Must come before the executor's first run: a non-repeatable executor is spent
    by its run.
    """
    op = "aclSetAclOpExecutorRepeatable"
    status = _executor_call(op, executor)
    if status != ACLNN_SUCCESS:
        return status
    with executor._lock:
        if executor.runs and not executor.repeatable:
            return _fail(ACLNN_ERR_PARAM_INVALID,
                         f"{op}: executor already ran once and was not repeatable")
        executor.repeatable = True
    return ACLNN_SUCCESS


def aclDestroyAclOpExecutor(executor):
    """Release ``executor`` (and its references to the tensors). -> status."""
    status = _executor_call("aclDestroyAclOpExecutor", executor)
    if status != ACLNN_SUCCESS:
        return status
    with executor._lock:
        executor.destroyed = True
        executor.plan = executor.call = None
    return ACLNN_SUCCESS
