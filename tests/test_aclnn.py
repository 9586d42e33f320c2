"""The aclnn mirror: two-phase protocol, status codes, messages, executors, workspace."""

import re
import threading
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from nsa_numba import aclnn
from nsa_numba.aclnn import (ACLNN_ERR_INNER, ACLNN_ERR_PARAM_INVALID,
                             ACLNN_ERR_PARAM_NULLPTR, ACLNN_SUCCESS,
                             aclDestroyAclOpExecutor, aclGetRecentErrMsg,
                             aclnnNsaCompress, aclnnNsaCompressGetWorkspaceSize,
                             aclnnNsaCompressGrad, aclnnNsaCompressGradGetWorkspaceSize,
                             aclSetAclOpExecutorRepeatable)
from conftest import HALF_DTYPES, assert_forward_accurate, assert_grad_accurate
from test_validation import good
from test_validation import rule_cases as _rule_cases

# Python API name -> C API name, per operator
FORWARD_NAMES = {"compress_block_size": "compressBlockSize", "compress_stride":
                 "compressStride", "actual_seq_len_type": "actSeqLenType",
                 "actual_seq_len": "actSeqLenOptional", "layout": "layoutOptional",
                 "out": "output"}
GRAD_NAMES = dict(FORWARD_NAMES, actual_seq_len="actSeqLenOptionalOptional",
                  layout="layoutOptionalOptional", grad="outputGrad",
                  input_grad="inputGradOut", weight_grad="weightGradOut")


def translate(fragment, names):
    pattern = r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b"
    return re.sub(pattern, lambda m: names[m.group(1)], fragment)


def forward_phase1(a):
    return aclnnNsaCompressGetWorkspaceSize(a["input"], a["weight"], a["seq"], a["layout"],
                                            a["block"], a["stride"], a["seq_type"], a["out"])


def grad_phase1(a):
    return aclnnNsaCompressGradGetWorkspaceSize(a["grad"], a["input"], a["weight"], a["seq"],
                                                a["block"], a["stride"], a["seq_type"],
                                                a["layout"], a["input_grad"],
                                                a["weight_grad"])


def run_both_phases(a, op):
    phase1, phase2 = ((forward_phase1, aclnnNsaCompress) if op == "forward"
                      else (grad_phase1, aclnnNsaCompressGrad))
    status, size, executor = phase1(a)
    if status != ACLNN_SUCCESS:
        return status
    workspace = np.empty(size, np.uint8) if size else None
    return phase2(workspace, size, executor, None)


def outputs_of(a, op):
    keys = ("out",) if op == "forward" else ("input_grad", "weight_grad")
    return {k: a[k] for k in keys if isinstance(a[k], np.ndarray)}


def assert_untouched(before):
    for key, (array, copy) in before.items():
        assert np.array_equal(array.view(np.uint8), copy.view(np.uint8)), key


def snapshot(outputs):
    return {k: (v, v.copy()) for k, v in outputs.items()}


@pytest.mark.parametrize("op,change,status,fragments", list(_rule_cases()))
def test_every_rule_gives_its_status_and_message(op, change, status, fragments):
    aclGetRecentErrMsg()
    args = good()
    args.update(change)
    before = snapshot(outputs_of(args, op))
    status_got, size, executor = (forward_phase1 if op == "forward" else grad_phase1)(args)
    assert (status_got, size, executor) == (status, 0, None)
    message = aclGetRecentErrMsg()
    names = FORWARD_NAMES if op == "forward" else GRAD_NAMES
    prefix = ("aclnnNsaCompressGetWorkspaceSize: " if op == "forward"
              else "aclnnNsaCompressGradGetWorkspaceSize: ")
    assert message.startswith(prefix), message
    for fragment in fragments:
        assert translate(fragment, names) in message, (fragment, message)
    assert aclGetRecentErrMsg() == ""   # read once, then cleared
    assert_untouched(before)


@pytest.mark.parametrize("op,key,cname", [
    ("forward", "out", "output"),
    ("grad", "input_grad", "inputGradOut"),
    ("grad", "weight_grad", "weightGradOut"),
])
def test_missing_output_is_a_null_pointer(op, key, cname):
    args = good()
    args[key] = None
    before = snapshot(outputs_of(args, op))
    assert run_both_phases(args, op) == ACLNN_ERR_PARAM_NULLPTR
    assert f"{cname} is required but got None" in aclGetRecentErrMsg()
    assert_untouched(before)


@pytest.mark.parametrize("op", ["forward", "grad"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_only_half_precision_like_the_npu(op, dtype):
    args = good(dtype)
    assert run_both_phases(args, op) == ACLNN_ERR_PARAM_INVALID
    message = aclGetRecentErrMsg()
    assert "dtype must be one of float16, bfloat16" in message
    assert np.dtype(dtype).name in message


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_forward_round_trip(dtype):
    args = good(dtype)
    status, size, executor = forward_phase1(args)
    assert status == ACLNN_SUCCESS and executor is not None
    assert aclnnNsaCompress(np.empty(size, np.uint8), size, executor) == ACLNN_SUCCESS
    assert_forward_accurate(args["out"], args["input"], args["weight"], 32, 16, args["seq"])
    expected = nsa_numba.nsa_compress(args["input"], args["weight"], 32, 16,
                                      actual_seq_len=args["seq"])
    assert np.array_equal(args["out"].view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("seq_type,seq", [(0, [0, 128, 272]), (1, [0, 128, 144])])
def test_backward_round_trip(dtype, seq_type, seq):
    args = good(dtype)
    args.update(seq=seq, seq_type=seq_type)
    status, size, executor = grad_phase1(args)
    assert status == ACLNN_SUCCESS
    assert size > 0
    assert aclnnNsaCompressGrad(np.empty(size, np.uint8), size, executor) == ACLNN_SUCCESS
    assert_grad_accurate(args["input_grad"], args["weight_grad"], args["grad"],
                         args["input"], args["weight"], 32, 16, [0, 128, 272])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_backward_with_block_equal_to_stride(dtype):
    # the NPU's grad accepts l == d (see compress._check_window); so does the mirror
    args = good(dtype)
    seq = [0, 128, 272]
    windows = 128 // 32 + 144 // 32
    args.update(stride=32, grad=args["grad"][:windows].copy())
    status, size, executor = grad_phase1(args)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    assert aclnnNsaCompressGrad(np.empty(size, np.uint8), size, executor) == ACLNN_SUCCESS
    assert_grad_accurate(args["input_grad"], args["weight_grad"], args["grad"],
                         args["input"], args["weight"], 32, 32, seq)


def prepared_grad(dtype=np.float16):
    args = good(dtype)
    status, size, executor = grad_phase1(args)
    assert status == ACLNN_SUCCESS
    return args, size, executor


RUN_FAILURES = {
    "executor-none": (lambda ws, n, ex: (ws, n, None, None), ACLNN_ERR_PARAM_NULLPTR,
                      "executor is required but got None"),
    "executor-wrong-type": (lambda ws, n, ex: (ws, n, object(), None), ACLNN_ERR_PARAM_INVALID,
                            "executor must be an aclOpExecutor"),
    "workspace-none": (lambda ws, n, ex: (None, n, ex, None), ACLNN_ERR_PARAM_INVALID,
                       "workspace must be an array of"),
    "workspace-list": (lambda ws, n, ex: ([0] * n, n, ex, None), ACLNN_ERR_PARAM_INVALID,
                       "workspace must be a numpy.ndarray, got list"),
    "workspace-small": (lambda ws, n, ex: (ws[:n - 1], n, ex, None), ACLNN_ERR_PARAM_INVALID,
                        "workspace holds"),
    "size-small": (lambda ws, n, ex: (ws, n - 1, ex, None), ACLNN_ERR_PARAM_INVALID,
                   "workspaceSize must be at least"),
    "size-float": (lambda ws, n, ex: (ws, float(n), ex, None), ACLNN_ERR_PARAM_INVALID,
                   "workspaceSize must be an integer"),
    "workspace-readonly": (lambda ws, n, ex: (_readonly(ws), n, ex, None),
                           ACLNN_ERR_PARAM_INVALID, "workspace must be writable"),
    "workspace-strided": (lambda ws, n, ex: (np.empty(2 * n, np.uint8)[::2], n, ex, None),
                          ACLNN_ERR_PARAM_INVALID, "workspace must be C-contiguous"),
    "stream": (lambda ws, n, ex: (ws, n, ex, "stream0"), ACLNN_ERR_PARAM_INVALID,
               "stream must be None"),
}


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("case", list(RUN_FAILURES))
def test_run_phase_checks(case):
    args, size, executor = prepared_grad()
    make, status, fragment = RUN_FAILURES[case]
    before = snapshot(outputs_of(args, "grad"))
    workspace = np.empty(size, np.uint8)
    assert aclnnNsaCompressGrad(*make(workspace, size, executor)) == status
    message = aclGetRecentErrMsg()
    assert message.startswith("aclnnNsaCompressGrad: ") and fragment in message, message
    assert_untouched(before)
    # the failed attempt did not spend the executor
    assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_SUCCESS


def test_larger_workspace_of_any_dtype_is_fine():
    args, size, executor = prepared_grad()
    workspace = np.empty(size // 8 + 1, np.float64)
    assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_SUCCESS
    assert_grad_accurate(args["input_grad"], args["weight_grad"], args["grad"],
                         args["input"], args["weight"], 32, 16, args["seq"])


def test_executor_of_the_other_operator_is_rejected():
    args, size, executor = prepared_grad()
    assert aclnnNsaCompress(np.empty(size, np.uint8), size, executor) == ACLNN_ERR_PARAM_INVALID
    assert "made by aclnnNsaCompressGradGetWorkspaceSize" in aclGetRecentErrMsg()


def test_executor_runs_once():
    args, size, executor = prepared_grad()
    workspace = np.empty(size, np.uint8)
    assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_SUCCESS
    args["input_grad"][...] = 5
    before = snapshot(outputs_of(args, "grad"))
    assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_ERR_PARAM_INVALID
    assert "already ran once and is not repeatable" in aclGetRecentErrMsg()
    assert_untouched(before)
    assert aclSetAclOpExecutorRepeatable(executor) == ACLNN_ERR_PARAM_INVALID
    assert "already ran once" in aclGetRecentErrMsg()


def test_repeatable_executor_reruns_on_current_data_until_destroyed():
    args, size, executor = prepared_grad(ml_dtypes.bfloat16)
    assert aclSetAclOpExecutorRepeatable(executor) == ACLNN_SUCCESS
    workspace = np.empty(size, np.uint8)
    results = []
    for _ in range(3):
        args["input_grad"][...] = 0
        assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_SUCCESS
        results.append((args["input_grad"].copy(), args["weight_grad"].copy()))
    for dx, dw in results[1:]:
        assert np.array_equal(dx.view(np.uint16), results[0][0].view(np.uint16))
        assert np.array_equal(dw.view(np.uint16), results[0][1].view(np.uint16))
    args["grad"][...] = args["grad"] * 2       # a run reads the tensors as they are now
    assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_SUCCESS
    assert_grad_accurate(args["input_grad"], args["weight_grad"], args["grad"],
                         args["input"], args["weight"], 32, 16, args["seq"])
    assert aclDestroyAclOpExecutor(executor) == ACLNN_SUCCESS
    assert executor.plan is None                # the tensors are released
    assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_ERR_PARAM_INVALID
    assert "destroyed" in aclGetRecentErrMsg()
    assert aclDestroyAclOpExecutor(executor) == ACLNN_ERR_PARAM_INVALID
    assert aclSetAclOpExecutorRepeatable(executor) == ACLNN_ERR_PARAM_INVALID
    aclGetRecentErrMsg()


def test_executor_calls_with_none():
    assert aclSetAclOpExecutorRepeatable(None) == ACLNN_ERR_PARAM_NULLPTR
    assert aclDestroyAclOpExecutor(None) == ACLNN_ERR_PARAM_NULLPTR
    messages = aclGetRecentErrMsg().splitlines()
    assert messages[0].startswith("aclDestroyAclOpExecutor: executor is required")  # newest
    assert messages[1].startswith("aclSetAclOpExecutorRepeatable: executor is required")


def test_error_messages_are_per_thread():
    aclGetRecentErrMsg()
    seen = {}

    def other():
        assert aclDestroyAclOpExecutor(None) == ACLNN_ERR_PARAM_NULLPTR
        seen["other"] = aclGetRecentErrMsg()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert "executor is required" in seen["other"]
    assert aclGetRecentErrMsg() == ""


def test_internal_errors_become_a_status(monkeypatch):
    args, size, executor = prepared_grad()

    def broken(*a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(aclnn._pipeline, "launch", broken)
    assert aclnnNsaCompressGrad(np.empty(size, np.uint8), size, executor) == ACLNN_ERR_INNER
    assert "internal error: RuntimeError: kernel exploded" in aclGetRecentErrMsg()
    monkeypatch.setattr(aclnn._pipeline, "plan", broken)
    assert forward_phase1(good()) == (ACLNN_ERR_INNER, 0, None)
    assert "aclnnNsaCompressGetWorkspaceSize: internal error" in aclGetRecentErrMsg()


def test_workspace_size_formula():
    # seed example: one tile per non-empty sequence (7 and 8 windows, below the
    # 64-window backward tile size); partials 2*64*32 floats, then one slot per thread
    # of (ceil(l/d) + 1 + l) * N * D + 2 * D floats
    from nsa_numba._ops.checks import scratch_slots
    rng = np.random.default_rng(0)
    x = rng.standard_normal((272, 64, 128)).astype(np.float16)
    w = rng.standard_normal((32, 64)).astype(np.float16)
    g = np.zeros((15, 64, 128), np.float16)
    status, size, executor = aclnnNsaCompressGradGetWorkspaceSize(
        g, x, w, [0, 128, 272], 32, 16, 0, "TND", np.empty_like(x), np.empty_like(w))
    # plus 63 bytes of room to start the scratch at a 64-byte boundary
    assert status == ACLNN_SUCCESS
    assert size == 4 * (2 * 64 * 32 + scratch_slots() * ((2 + 1 + 32) * 64 * 128 + 2 * 128)) + 63
    status, size, _ = aclnnNsaCompressGetWorkspaceSize(x, w, [0, 128, 272], "TND", 32, 16, 0,
                                                       np.empty((15, 64, 128), np.float16))
    assert size == 4 * scratch_slots() * (2 * 64 * 128 + 128) + 63


@pytest.mark.parametrize("op", ["forward", "grad"])
def test_workspace_at_any_address(op):
    # The run carves its scratch from the workspace's first 64-byte boundary: a
    # buffer of exactly workspaceSize bytes suffices wherever it starts, the scratch
    # is aligned, and the results do not depend on where the buffer is.
    from nsa_numba._ops import dispatch as _dispatch
    rng = np.random.default_rng(3)
    x = rng.standard_normal((200, 4, 48)).astype(np.float16)
    w = rng.standard_normal((32, 4)).astype(np.float16)
    seq = [0, 90, 200]
    g = rng.standard_normal((9, 4, 48)).astype(np.float16)    # 0 + 4 + 5 windows
    results = set()
    for offset in (0, 1, 4, 16, 33, 63):
        outs = ((np.full((g.shape[0], 4, 48), np.nan, np.float16),) if op == "forward"
                else (np.full_like(x, np.nan), np.full_like(w, np.nan)))
        status, size, executor = (
            aclnnNsaCompressGetWorkspaceSize(x, w, seq, "TND", 32, 16, 0, *outs)
            if op == "forward" else
            aclnnNsaCompressGradGetWorkspaceSize(g, x, w, seq, 32, 16, 0, "TND", *outs))
        assert status == ACLNN_SUCCESS and size > 63
        buffer = np.empty(size + 64, np.uint8)
        start = (-buffer.ctypes.data % 64 + offset) % 64
        workspace = buffer[start:start + size]
        partials, scratch = _dispatch.carve(executor.plan, workspace)
        assert scratch.ctypes.data % 64 == 0 and partials.ctypes.data % 64 == 0
        assert scratch.ctypes.data + scratch.nbytes <= workspace.ctypes.data + size
        run = aclnnNsaCompress if op == "forward" else aclnnNsaCompressGrad
        assert run(workspace, size, executor, None) == ACLNN_SUCCESS
        results.add(b"".join(o.tobytes() for o in outs))
    assert len(results) == 1
    if op == "forward":
        assert_forward_accurate(outs[0], x, w, 32, 16, seq)
    else:
        assert_grad_accurate(*outs, g, x, w, 32, 16, seq)


def test_run_phase_allocates_nothing_large():
    # All scratch lives in the caller's workspace: what the run phase allocates
    # through Python and NumPy (the weight table, views) stays small however big
    # the problem is.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16384, 8, 128)).astype(np.float16)       # 32 MiB
    w = rng.standard_normal((32, 8)).astype(np.float16)
    g = rng.standard_normal((1023, 8, 128)).astype(np.float16)
    dx, dw = np.empty_like(x), np.empty_like(w)
    status, size, executor = aclnnNsaCompressGradGetWorkspaceSize(
        g, x, w, None, 32, 16, 0, "TND", dx, dw)
    assert status == ACLNN_SUCCESS
    workspace = np.empty(size, np.uint8)
    aclSetAclOpExecutorRepeatable(executor)
    assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_SUCCESS  # compile
    tracemalloc.start()
    try:
        assert aclnnNsaCompressGrad(workspace, size, executor) == ACLNN_SUCCESS
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert x.nbytes > 500 * peak


def test_two_executors_in_two_threads():
    problems = []
    for seed, dtype in enumerate(HALF_DTYPES * 2):
        args = good(dtype)
        args["input"] = np.random.default_rng(seed).standard_normal(
            args["input"].shape).astype(dtype)
        status, size, executor = grad_phase1(args)
        assert status == ACLNN_SUCCESS
        aclSetAclOpExecutorRepeatable(executor)
        problems.append((args, size, executor))
    expected = []
    for args, size, executor in problems:
        aclnnNsaCompressGrad(np.empty(size, np.uint8), size, executor)
        expected.append(args["input_grad"].copy())
    failures = []

    def work(i):
        args, size, executor = problems[i]
        workspace = np.empty(size, np.uint8)
        for _ in range(20):
            if aclnnNsaCompressGrad(workspace, size, executor) != ACLNN_SUCCESS:
                failures.append(aclGetRecentErrMsg())
            if not np.array_equal(args["input_grad"].view(np.uint16),
                                  expected[i].view(np.uint16)):
                failures.append(f"problem {i}: wrong result")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_seed_c_example_all_ones():
    # The documentation's C example, all tensors of ones: each input gradient counts
    # the windows over the token, each weight gradient is T' * D = 15 * 128.
    T, N, D, l, d, n_windows = 272, 64, 128, 32, 16, 15
    outputGrad = np.ones((n_windows, N, D), np.float16)
    inputKV = np.ones((T, N, D), np.float16)
    weight = np.ones((l, N), np.float16)
    inputGradOut = np.zeros((T, N, D), np.float16)
    weightGradOut = np.zeros((l, N), np.float16)
    ret, workspaceSize, executor = aclnnNsaCompressGradGetWorkspaceSize(
        outputGrad, inputKV, weight, [0, 128, 272], l, d, 0, "TND", inputGradOut,
        weightGradOut)
    assert ret == ACLNN_SUCCESS, aclGetRecentErrMsg()
    workspace = np.empty(workspaceSize, np.uint8) if workspaceSize > 0 else None
    assert aclnnNsaCompressGrad(workspace, workspaceSize, executor, None) == ACLNN_SUCCESS
    cover = np.zeros(T)
    for start in list(range(0, 97, 16)) + list(range(128, 241, 16)):
        cover[start:start + l] += 1
    assert np.array_equal(inputGradOut[:, 0, 0].astype(np.float64), cover)
    assert np.all(inputGradOut == inputGradOut[:, :1, :1])
    assert np.all(weightGradOut == 1920)


def test_workspace_must_not_overlap_the_tensors():
    args, size, executor = prepared_grad()
    before = snapshot(outputs_of(args, "grad"))
    inside = args["input"].reshape(-1).view(np.uint8)[:size]
    assert aclnnNsaCompressGrad(inside, size, executor) == ACLNN_ERR_PARAM_INVALID
    assert "workspace overlaps the input tensor" in aclGetRecentErrMsg()
    assert_untouched(before)
