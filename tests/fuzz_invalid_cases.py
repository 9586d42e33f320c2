"""Generated invalid calls through the Python API and the aclnn mirror.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``):
``test_fuzz_invalid.py`` runs this file in a child process, so that a crash of the
interpreter or a hang shows up as a failed test instead of a dead test runner.

Each case starts from a valid problem and breaks exactly one thing, in a way that is
invalid whatever the rest is. The promise checked: the Python API raises NsaError (a
ValueError) with status 161001 or 161002 and a message naming a parameter; the aclnn
mirror returns that status from phase one or two and records a message; no output
and no input changes.
"""

import fractions
import math

import ml_dtypes
import numpy as np
from hypothesis import assume, given, note, strategies as st

import nsa_numba
from nsa_numba import NsaError
from nsa_numba.aclnn import (ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR,
                             ACLNN_SUCCESS, aclDestroyAclOpExecutor, aclGetRecentErrMsg,
                             aclSetAclOpExecutorRepeatable,
                             aclnnNsaCompress, aclnnNsaCompressGetWorkspaceSize,
                             aclnnNsaCompressAttention,
                             aclnnNsaCompressAttentionGetWorkspaceSize,
                             aclnnNsaCompressGrad, aclnnNsaCompressGradGetWorkspaceSize,
                             aclnnNsaSelectedAttention,
                             aclnnNsaSelectedAttentionGetWorkspaceSize,
                             aclnnNsaSelectedAttentionGrad,
                             aclnnNsaSelectedAttentionGradGetWorkspaceSize)
from nsa_numba._ops.layouts import LAYOUTS
from fuzzing import settings  # noqa: F401  (loads the profile)

REJECTED = {ACLNN_ERR_PARAM_NULLPTR, ACLNN_ERR_PARAM_INVALID}
PY_PARAMS = ["input", "weight", "grad", "out", "input_grad", "weight_grad",
             "compress_block_size", "compress_stride", "actual_seq_len",
             "actual_seq_len_type", "layout"]
C_PARAMS = ["input", "weight", "outputGrad", "output", "inputGradOut", "weightGradOut",
            "compressBlockSize", "compressStride", "actSeqLenOptional", "actSeqLenType",
            "layoutOptional", "workspace", "workspaceSize", "executor", "stream"]
OUTPUTS = {"forward": ("out",), "grad": ("input_grad", "weight_grad")}
INPUTS = {"forward": ("input", "weight"), "grad": ("grad", "input", "weight")}


# -- a valid starting point ----------------------------------------------------------

@st.composite
def valid_calls(draw):
    """A valid strict float16/bfloat16 call, every output given (the aclnn needs them)."""
    op = draw(st.sampled_from(["forward", "grad"]))
    dtype = np.dtype(draw(st.sampled_from([np.float16, ml_dtypes.bfloat16])))
    N = draw(st.integers(1, 3))
    D = 16 * draw(st.integers(1, 2))
    stride = 16
    block = 16 * draw(st.integers(1, 3))
    layout = draw(st.sampled_from(["TND", "BSND"]))
    if layout == "TND":
        lengths = draw(st.lists(st.integers(0, 4 * block), min_size=1, max_size=4))
        lengths[0] = max(lengths[0], block)
        seq_type = draw(st.sampled_from([0, 1]))
        seq = (np.cumsum(lengths) if seq_type == 0 else np.array(lengths)).tolist()
        shape = (sum(lengths), N, D)
    else:
        lengths = [draw(st.integers(block, 4 * block))] * draw(st.integers(1, 2))
        seq, seq_type = None, 0
        shape = (len(lengths), lengths[0], N, D)
    windows = sum((n - block) // stride + 1 for n in lengths if n >= block)
    out_shape = (windows, N, D) if layout == "TND" else (len(lengths), windows // len(lengths),
                                                         N, D)
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    call = dict(op=op, dtype=dtype, block=block, stride=stride, seq=seq, seq_type=seq_type,
                layout=layout, lengths=lengths,
                input=rng.standard_normal(shape).astype(dtype),
                weight=rng.standard_normal((block, N)).astype(dtype))
    if op == "forward":
        call["out"] = np.full(out_shape, 3, dtype)
    else:
        call["grad"] = rng.standard_normal(out_shape).astype(dtype)
        call["input_grad"] = np.full(shape, 3, dtype)
        call["weight_grad"] = np.full((block, N), 3, dtype)
    return call


# -- ways to break one argument ------------------------------------------------------

class Opaque:
    """An object of no type the library knows."""


NOT_ARRAYS = st.one_of(
    st.booleans(), st.integers(), st.floats(), st.complex_numbers(), st.text(max_size=4),
    st.binary(max_size=4), st.lists(st.floats(), max_size=3),
    st.lists(st.lists(st.integers(), max_size=2), max_size=2), st.tuples(st.integers()),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.builds(Opaque), st.just(Ellipsis), st.just(slice(None)), st.just(np.float16),
    st.just(np.float16(1.0)), st.just(memoryview(b"ab")))

BAD_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64, np.bool_, np.complex64, np.complex128, np.object_, ">f2", ">f4",
              "<U1", "S2", "V2", "m8[s]", "M8[D]", np.longdouble, np.float32, np.float64,
              [("a", np.float16)], ml_dtypes.float8_e4m3fn]


@st.composite
def bad_array(draw, call, role):
    """A value for array argument ``role`` that no rule accepts, whatever the rest is."""
    good = call[role]
    how = draw(st.sampled_from(["not-array", "ndim", "dtype", "shape", "readonly",
                                "alias", "self-overlap"] if role in OUTPUTS[call["op"]] else
                               ["not-array", "none", "ndim", "dtype", "shape", "masked"]))
    note(f"{role}: {how}")
    if how == "none":
        return None
    if how in ("self-overlap", "masked"):
        return _hostile_array(draw, good, how)
    if how == "not-array":
        return draw(NOT_ARRAYS)
    if how == "ndim":
        ndim = draw(st.integers(0, 6).filter(lambda n: n != good.ndim))
        shape = tuple(draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim)))
        return np.zeros(shape, dtype=good.dtype)
    if how == "dtype":
        dtype = np.dtype(draw(st.sampled_from(BAD_DTYPES + [_other_half(good.dtype)])))
        return np.zeros(good.shape, dtype=dtype)
    if how == "shape":
        shape = list(good.shape)
        if role == "input":   # only the head dim: other changes can still fit the sequences
            shape[-1] += draw(st.sampled_from([-good.shape[-1], 1, 16]))
        else:
            axis = draw(st.integers(0, len(shape) - 1))
            shape[axis] = draw(st.integers(0, shape[axis] + 20).filter(
                lambda n: n != good.shape[axis]))
        return np.full(shape, 3, dtype=good.dtype)
    if how == "readonly":
        good.flags.writeable = False
        return good
    return draw(st.sampled_from(_aliases(call, role)))


def _hostile_array(draw, good, how):
    """``good``'s shape and dtype over memory two of its elements share (a stride of 0
    along one axis, or rows that step by less than they span), or as a masked array."""
    if how == "masked":
        return np.ma.masked_array(good)          # (no mask: the bytes compare as they are)
    axis = draw(st.integers(0, good.ndim - 1))
    assume(good.shape[axis] > 1)
    strides = list(good.strides)
    strides[axis] = draw(st.sampled_from([0, good.itemsize if axis < good.ndim - 1 else 0]))
    return np.lib.stride_tricks.as_strided(good, good.shape, strides, writeable=True)


def _other_half(dtype):
    return ml_dtypes.bfloat16 if dtype == np.float16 else np.float16


def _aliases(call, role):
    """Views of ``role``'s shape onto memory an input or another output uses."""
    shape, n = call[role].shape, call[role].size
    candidates = []
    for other in INPUTS[call["op"]] + OUTPUTS[call["op"]]:
        if other == role:
            continue
        flat = call[other].reshape(-1)
        if flat.size >= n:
            candidates.append(flat[:n].reshape(shape))
            candidates.append(flat[flat.size - n:].reshape(shape)[::-1])
    if role == "input_grad":
        candidates.append(call["input"])
    return candidates or [call[INPUTS[call["op"]][0]]]


INTEGRAL_TYPES = [int, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32,
                  np.uint64]


@st.composite
def not_integers(draw, near):
    """Values that are not integers, some of them equal in value to one."""
    return draw(st.one_of(
        NOT_ARRAYS.filter(lambda v: isinstance(v, (bool, np.bool_)) or not isinstance(
            v, (int, np.integer))),
        st.sampled_from([float(near), np.float64(near), np.float16(near), str(near),
                         fractions.Fraction(near), complex(near), np.array(near),
                         np.array([near]), [near], True, False, None, math.nan, math.inf,
                         np.bool_(True)])))


@st.composite
def bad_block(draw, call):
    """Anything but the weight's first dimension as an integer."""
    if draw(st.booleans()):
        return draw(not_integers(call["block"]))
    value = draw(st.integers(-2 ** 70, 2 ** 70).filter(lambda v: v != call["block"]))
    cast = draw(st.sampled_from(INTEGRAL_TYPES))
    try:
        return cast(value)
    except OverflowError:
        return value


@st.composite
def bad_stride(draw, call):
    """Not an integer, or one the strict rules reject: <= 0, not a multiple of 16, or
    over l."""
    if draw(st.booleans()):
        return draw(not_integers(call["stride"]))
    limit = call["block"]

    def rejected(v):
        return v <= 0 or v % 16 or v > limit
    return draw(st.one_of(st.integers(-2 ** 70, 2 ** 70), st.integers(-40, 80))
                .filter(rejected))


@st.composite
def bad_seq(draw, call):
    """An actual_seq_len that cannot describe these tokens with these windows."""
    T = call["input"].shape[0] if call["layout"] == "TND" else None
    if T is None:   # padded layouts take none at all
        return draw(st.one_of(st.lists(st.integers(0, 300), max_size=3),
                              NOT_ARRAYS.filter(lambda v: v is not None)))
    how = draw(st.sampled_from(["container", "item", "overflow", "array", "random"]))
    note(f"actual_seq_len: {how}")
    good = list(call["seq"])
    if how == "container":
        return draw(NOT_ARRAYS.filter(lambda v: not isinstance(v, (list, tuple))))
    if how == "item":
        i = draw(st.integers(0, len(good)))
        item = draw(st.sampled_from([1.0, "3", None, True, np.float32(2), [1], b"1",
                                     fractions.Fraction(1, 2), complex(1), math.nan]))
        return good[:i] + [item] + good[i:]
    if how == "overflow":
        i = draw(st.integers(0, len(good) - 1))
        good[i] = draw(st.sampled_from([2 ** 63, 2 ** 64 + 5, -2 ** 63 - 1, 10 ** 30]))
        return good if draw(st.booleans()) else np.array(good, dtype=object)
    if how == "array":
        return draw(st.sampled_from([
            np.array(good, dtype=np.float64), np.array(good, dtype=np.bool_),
            np.array([good]), np.array(good).reshape(-1, 1), np.array(good[0]),
            np.array([], dtype=np.int64), np.array(good, dtype=np.complex64),
            np.array([2 ** 64 - 1] + good, dtype=np.uint64)]))
    values = draw(st.lists(st.integers(-5, T + 40), max_size=6))
    assume(not _describes(values, call))
    return values


def _describes(values, call):
    """Whether ``values`` (for the call's type) is a valid split of T with the same
    number of windows."""
    if not values or min(values) < 0:
        return False
    if call["seq_type"] == 0:
        if any(b < a for a, b in zip(values, values[1:])):
            return False
        lengths = np.diff([0] + values)
    else:
        lengths = np.array(values)
    if lengths.sum() != call["input"].shape[0]:
        return False
    block, stride = call["block"], call["stride"]
    windows = sum((n - block) // stride + 1 for n in lengths if n >= block)
    return windows == sum((n - block) // stride + 1 for n in call["lengths"] if n >= block)


LAYOUT_TEXT = st.one_of(st.text(max_size=5), st.sampled_from(
    ["tnd", " TND", "TND\x00", "BSNDX", "", "T N D"])).filter(lambda s: s not in LAYOUTS)


@st.composite
def mutations(draw):
    call = draw(valid_calls())
    op = call["op"]
    key = draw(st.sampled_from(list(INPUTS[op] + OUTPUTS[op])
                               + ["block", "stride", "seq", "seq_type", "layout"]))
    if key in INPUTS[op] or key in OUTPUTS[op]:
        value = draw(bad_array(call, key))
    elif key == "block":
        value = draw(bad_block(call))
    elif key == "stride":
        value = draw(bad_stride(call))
    elif key == "seq":
        value = draw(bad_seq(call))
    elif key == "seq_type":
        value = draw(st.one_of(not_integers(0), st.integers(-2 ** 70, 2 ** 70).filter(
            lambda v: v not in (0, 1))))
    else:
        value = draw(st.one_of(LAYOUT_TEXT, NOT_ARRAYS.filter(
            lambda v: not isinstance(v, str))))
    note(f"broken: {key} = {value!r}"[:400])
    call[key] = value
    return call


# -- running both APIs ---------------------------------------------------------------

def _arrays(call):
    keys = INPUTS[call["op"]] + OUTPUTS[call["op"]]
    return {k: call[k] for k in keys if isinstance(call[k], np.ndarray)}


def _snapshot(call):
    return {k: (a, a.copy()) for k, a in _arrays(call).items() if a.dtype != object}


def _assert_unchanged(snapshot):
    for key, (a, copy) in snapshot.items():
        assert a.tobytes() == copy.tobytes(), f"{key} changed"


def _python_call(call):
    kw = dict(actual_seq_len=call["seq"], actual_seq_len_type=call["seq_type"],
              layout=call["layout"])
    if call["op"] == "forward":
        return nsa_numba.nsa_compress(call["input"], call["weight"], call["block"],
                                      call["stride"], out=call["out"], **kw)
    return nsa_numba.nsa_compress_grad(call["grad"], call["input"], call["weight"],
                                       call["block"], call["stride"],
                                       input_grad=call["input_grad"],
                                       weight_grad=call["weight_grad"], **kw)


def _aclnn_phase1(call):
    if call["op"] == "forward":
        return aclnnNsaCompressGetWorkspaceSize(
            call["input"], call["weight"], call["seq"], call["layout"], call["block"],
            call["stride"], call["seq_type"], call["out"])
    return aclnnNsaCompressGradGetWorkspaceSize(
        call["grad"], call["input"], call["weight"], call["seq"], call["block"],
        call["stride"], call["seq_type"], call["layout"], call["input_grad"],
        call["weight_grad"])


def _assert_python_rejects(call):
    try:
        _python_call(call)
    except NsaError as err:
        assert err.status in REJECTED, err.status
        assert any(name in str(err) for name in PY_PARAMS), str(err)
        return str(err)
    raise AssertionError("the Python API accepted an invalid call")


def _assert_aclnn_rejects(call):
    aclGetRecentErrMsg()
    status, size, executor = _aclnn_phase1(call)
    if status == ACLNN_SUCCESS:
        run = aclnnNsaCompress if call["op"] == "forward" else aclnnNsaCompressGrad
        status = run(np.empty(size, np.uint8), size, executor)
        raise AssertionError(f"the aclnn mirror accepted an invalid call (run: {status})")
    assert (size, executor) == (0, None)
    assert status in REJECTED, (status, aclGetRecentErrMsg())
    message = aclGetRecentErrMsg()
    assert any(name in message for name in C_PARAMS), message
    return message


@given(mutations())
def test_invalid_argument_is_rejected_by_both_apis(call):
    snapshot = _snapshot(call)
    note(_assert_python_rejects(call))
    _assert_unchanged(snapshot)
    note(_assert_aclnn_rejects(call))
    _assert_unchanged(snapshot)


@given(valid_calls())
def test_float32_is_valid_in_python_only(call):
    for key in _arrays(call):
        call[key] = call[key].astype(np.float32)
    snapshot = _snapshot(call)
    _assert_aclnn_rejects(call)
    _assert_unchanged(snapshot)
    _python_call(call)


# -- phase two ------------------------------------------------------------------------

@st.composite
def bad_runs(draw):
    """A valid phase one, then a broken phase-two argument."""
    call = draw(valid_calls())
    key = draw(st.sampled_from(["workspace", "workspaceSize", "executor", "stream"]))
    how = draw(st.sampled_from({
        "workspace": ["not-array", "small", "readonly", "strided", "overlap", "object"],
        "workspaceSize": ["not-integer", "small"],
        "executor": ["not-executor", "none", "other-op", "destroyed", "spent"],
        "stream": ["object"]}[key]))
    salt = draw(NOT_ARRAYS)
    return call, key, how, salt


def _phase2_args(call, key, how, salt, size, executor):
    """(run, workspace, workspaceSize, executor, stream) with ``key`` broken ``how``."""
    workspace, workspace_size, stream = np.empty(size, np.uint8), size, None
    run = aclnnNsaCompress if call["op"] == "forward" else aclnnNsaCompressGrad
    if key == "workspace":
        assume(size > 0)   # with no workspace needed, any workspace is accepted
        workspace = {
            "not-array": lambda: salt if salt is not None else [0] * size,
            "small": lambda: np.empty(size - 1, np.uint8),
            "readonly": lambda: np.frombuffer(bytes(size), np.uint8),
            "strided": lambda: np.empty(2 * size, np.uint8)[::2],
            "overlap": lambda: call["buffer"],
            "object": lambda: np.empty(size, dtype=object),
        }[how]()
    elif key == "workspaceSize":
        if how == "small":
            assume(size > 0)
            workspace_size = size - 1
        elif isinstance(salt, (int, np.integer)) and not isinstance(salt, bool):
            workspace_size = float(size)
        else:
            workspace_size = salt
    elif key == "executor":
        if how == "not-executor":
            executor = salt if salt is not None else Opaque()
        elif how == "none":
            executor = None
        elif how == "other-op":
            run = aclnnNsaCompressGrad if call["op"] == "forward" else aclnnNsaCompress
        elif how == "destroyed":
            assert aclDestroyAclOpExecutor(executor) == ACLNN_SUCCESS
        else:   # spent: not made repeatable, so its one run is used up
            assert run(np.empty(size, np.uint8), size, executor) == ACLNN_SUCCESS
    else:
        stream = salt if salt is not None else Opaque()
    return run, workspace, workspace_size, executor, stream


def _move_output_into_workspace(call):
    """Put the first output at the start of a buffer big enough to be the workspace too."""
    status, size, executor = _aclnn_phase1(call)
    assert status == ACLNN_SUCCESS and aclDestroyAclOpExecutor(executor) == ACLNN_SUCCESS
    role = OUTPUTS[call["op"]][0]
    a = call[role]
    call["buffer"] = np.zeros(a.nbytes + size, np.uint8)
    call[role] = call["buffer"][:a.nbytes].view(a.dtype).reshape(a.shape)
    call[role][...] = a


@given(bad_runs())
def test_invalid_run_is_rejected(case):
    call, key, how, salt = case
    note(f"{key}: {how}, {salt!r}"[:300])
    if how == "overlap":
        _move_output_into_workspace(call)
    status, size, executor = _aclnn_phase1(call)
    assert status == ACLNN_SUCCESS
    run, workspace, workspace_size, executor, stream = _phase2_args(
        call, key, how, salt, size, executor)
    snapshot = _snapshot(call)
    aclGetRecentErrMsg()
    status = run(workspace, workspace_size, executor, stream)
    assert status in REJECTED, (status, aclGetRecentErrMsg())
    assert aclGetRecentErrMsg()
    _assert_unchanged(snapshot)


# -- the with-cache (decoding) operator ------------------------------------------------------

from nsa_numba.aclnn import (ACLNN_ERR_INNER_TILING_ERROR,  # noqa: E402
                             aclnnNsaCompressWithCache,
                             aclnnNsaCompressWithCacheGetWorkspaceSize)

INFER_REJECTED = REJECTED | {ACLNN_ERR_INNER_TILING_ERROR}
INFER_PY_PARAMS = ["input", "weight", "slot_mapping", "compress_block_size",
                   "compress_stride", "page_block_size", "block_table", "actual_seq_len",
                   "layout", "cache"]
INFER_C_PARAMS = ["input", "weight", "slotMapping", "compressBlockSize", "compressStride",
                  "pageBlockSize", "blockTableOptional", "actSeqLenOptional", "layoutOptional",
                  "outputCache", "actSeqLenType"]


@st.composite
def valid_infer_calls(draw):
    """A valid strict float16/bfloat16 decoding step with at least one writer, int32
    indices (what the aclnn takes)."""
    dtype = np.dtype(draw(st.sampled_from([np.float16, ml_dtypes.bfloat16])))
    N = draw(st.integers(1, 3))
    D = 16 * draw(st.integers(1, 2))
    stride = 16 * draw(st.integers(1, 2))
    block = 16 * draw(st.integers(stride // 16, 4))
    page = draw(st.sampled_from([64, 128]))
    paged = draw(st.booleans())
    lengths = draw(st.lists(st.integers(0, 200), min_size=1, max_size=4))
    lengths[0] = block + stride * draw(st.integers(0, 3))          # a writer
    B = len(lengths)
    per_seq = -(-max(lengths) // page)
    pages = B * per_seq
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    rows = max(B, (pages * page - block) // stride + 1) if paged else B + 2
    call = dict(dtype=dtype, block=block, stride=stride, page=page, lengths=lengths,
                seq=list(lengths), layout="TND", seq_type=1,
                weight=rng.standard_normal((block, N)).astype(dtype),
                slot_mapping=rng.permutation(rows)[:B].astype(np.int32),
                cache=rng.standard_normal((rows, N, D)).astype(dtype))
    if paged:
        call["input"] = rng.standard_normal((pages, page, N, D)).astype(dtype)
        call["block_table"] = rng.permutation(pages).reshape(B, per_seq).astype(np.int32)
    else:
        call["input"] = rng.standard_normal((sum(lengths), N, D)).astype(dtype)
        call["block_table"] = None
    return call


def _writers(call):
    return [b for b, s in enumerate(call["lengths"])
            if s >= call["block"] and (s - call["block"]) % call["stride"] == 0]


@st.composite
def infer_mutations(draw):
    """A valid step with one argument broken so that no rule accepts it."""
    call = draw(valid_infer_calls())
    paged = call["block_table"] is not None
    keys = ["input", "weight", "cache", "slot_mapping", "seq", "block", "stride", "page"]
    keys += ["block_table"] if paged else ["layout"]
    key = draw(st.sampled_from(keys))
    writer = _writers(call)[0]
    good = call.get(key)
    if key in ("input", "weight", "cache"):
        how = draw(st.sampled_from(["none", "not-array", "dtype", "ndim", "heads"]
                                   + (["readonly", "short"] if key == "cache" else [])))
        note(f"{key}: {how}")
        if how == "none":
            value = None
        elif how == "not-array":
            value = draw(NOT_ARRAYS)
        elif how == "dtype":
            value = good.astype(np.dtype(draw(st.sampled_from(
                [np.int16, np.float32, np.uint8, _other_half(good.dtype)]))))
            if key == "input" and value.dtype == np.float32:
                value = value.astype(np.int32)          # float32 input: valid in Python
        elif how == "ndim":
            value = good.reshape(good.shape + (1,))
        elif how == "heads":
            shape = list(good.shape)
            shape[-1 if key != "weight" else 1] += 1
            value = np.zeros(shape, good.dtype)
        elif how == "readonly":
            good.flags.writeable = False
            value = good
        else:   # too few rows for the writer's slot
            value = good[:int(call["slot_mapping"][writer])]
        call[key] = value
    elif key == "slot_mapping":
        how = draw(st.sampled_from(["none", "range", "negative", "repeat", "float", "2d",
                                    "length"]))
        note(f"slot_mapping: {how}")
        slots = good.copy()
        if how == "none":
            slots = None
        elif how == "range":
            slots[writer] = call["cache"].shape[0] + draw(st.integers(0, 5))
        elif how == "negative":
            slots[writer] = -draw(st.integers(1, 5))
        elif how == "repeat":
            call["seq"] = call["seq"] + [call["seq"][writer]]
            call["lengths"] = call["seq"]
            slots = np.append(slots, slots[writer]).astype(np.int32)
            if paged:
                call["block_table"] = np.concatenate(
                    [call["block_table"], call["block_table"][writer:writer + 1]])
        elif how == "float":
            slots = slots.astype(np.float32)
        elif how == "2d":
            slots = slots[:, None]
        else:
            slots = slots[:-1] if slots.size > 1 else np.append(slots, 0).astype(np.int32)
        call["slot_mapping"] = slots
    elif key == "seq":
        how = draw(st.sampled_from(["none", "negative", "float", "length", "long"]))
        note(f"actual_seq_len: {how}")
        seq = list(call["seq"])
        if how == "none":
            seq = None
        elif how == "negative":
            seq[draw(st.integers(0, len(seq) - 1))] = -draw(st.integers(1, 100))
        elif how == "float":
            seq[writer] = float(seq[writer])
        elif how == "length":
            seq = seq + [0]
        else:   # beyond the block table's capacity, or past T
            capacity = (call["block_table"].shape[1] * call["page"] if paged
                        else call["input"].shape[0])
            seq[writer] = capacity + draw(st.integers(1, 40))
        call["seq"] = seq
    elif key == "block_table":
        how = draw(st.sampled_from(["range", "negative", "rows", "float", "capacity"]))
        note(f"block_table: {how}")
        table = good.copy()
        s = call["lengths"][writer]
        col = (s - call["block"]) // call["page"]          # the page of the window's start
        if how == "range":
            table[writer, col] = call["input"].shape[0] + draw(st.integers(0, 5))
        elif how == "negative":
            table[writer, col] = -1
        elif how == "rows":
            table = table[1:] if table.shape[0] > 1 else np.concatenate([table, table])
        elif how == "float":
            table = table.astype(np.float32)
        else:
            table = table[:, :col] if col else table[:, :0]
        call["block_table"] = table
    elif key == "layout":
        call["layout"] = draw(LAYOUT_TEXT.filter(lambda v: v != "TND"))
    else:
        value = draw(st.sampled_from({
            "block": [0, -16, 40, 80, 32.0, "32", None, call["stride"] - 16 or -1],
            "stride": [0, 8, 80, 16.0, True, call["block"] + 16],
            "page": [0, 32, 96, 256, 64.0, None]}[key]))
        note(f"{key}: {value!r}")
        call[key] = value
    return call


def _infer_snapshot(call):
    return {k: (call[k], call[k].copy()) for k in ("input", "weight", "cache", "slot_mapping",
                                                     "block_table")
            if isinstance(call.get(k), np.ndarray) and call[k].dtype != object}


@given(infer_mutations())
def test_invalid_decoding_step_is_rejected_by_both_apis(call):
    snapshot = _infer_snapshot(call)
    try:
        nsa_numba.nsa_compress_infer(call["input"], call["weight"], call["slot_mapping"],
                                     call["block"], call["stride"], call["page"],
                                     block_table=call["block_table"], actual_seq_len=call["seq"],
                                     layout=call["layout"], cache=call["cache"])
    except NsaError as err:
        assert err.status in INFER_REJECTED, err.status
        assert any(name in str(err) for name in INFER_PY_PARAMS), str(err)
        note(str(err))
    else:
        raise AssertionError("the Python API accepted an invalid decoding step")
    _assert_unchanged(snapshot)
    aclGetRecentErrMsg()
    status, size, executor = aclnnNsaCompressWithCacheGetWorkspaceSize(
        call["input"], call["weight"], call["slot_mapping"], call["seq"], call["block_table"],
        call["layout"], call["block"], call["stride"], call["seq_type"], call["page"],
        call["cache"])
    if status == ACLNN_SUCCESS:
        status = aclnnNsaCompressWithCache(np.empty(size, np.uint8), size, executor)
        raise AssertionError(f"the aclnn mirror accepted an invalid decoding step ({status})")
    assert status in INFER_REJECTED, (status, aclGetRecentErrMsg())
    message = aclGetRecentErrMsg()
    assert any(name in message for name in INFER_C_PARAMS), message
    _assert_unchanged(snapshot)


# -- selected attention --------------------------------------------------------------------

SELECT_REJECTED = REJECTED | {ACLNN_ERR_INNER_TILING_ERROR}
SELECT_PY_PARAMS = ["query", "key", "value", "topk_indices", "scale_value", "head_num",
                    "select_block_size", "select_block_count", "atten_mask",
                    "actual_seq_qlen", "actual_seq_kvlen", "attention_out", "softmax_max",
                    "softmax_sum", "grad", "dq", "dk", "dv", "N1", "N2"]
SELECT_C_PARAMS = ["query", "key", "value", "topkIndices", "scaleValue", "headNum",
                   "selectedBlockSize", "selectedBlockCount", "attenMaskOptional",
                   "actualSeqQLenOptional", "actualSeqKvLenOptional", "attentionOut",
                   "softmaxMaxOut", "softmaxSumOut", "softmaxMax", "softmaxSum",
                   "attentionOutGrad", "dqOut", "dkOut", "dvOut", "N1", "N2"]
SELECT_ARRAYS = {"forward": ("query", "key", "value", "topk", "attention_out", "softmax_max",
                             "softmax_sum"),
                 "grad": ("grad", "query", "key", "value", "attention_out", "softmax_max",
                          "softmax_sum", "topk", "dq", "dk", "dv")}
SELECT_OUTPUTS = {"forward": ("attention_out", "softmax_max", "softmax_sum"),
                  "grad": ("dq", "dk", "dv")}


#: scales no rule accepts: not numbers, a bool, and numbers beyond a finite float
HOSTILE_SCALES = ["1", None, [1.0], True, 10 ** 400, -(10 ** 400), float("inf"),
                  float("nan")]


@st.composite
def valid_select_calls(draw):
    """A valid strict float16/bfloat16 selected-attention call, outputs given."""
    from nsa_numba.bench.cases import select_problem
    op = draw(st.sampled_from(["forward", "grad"]))
    dtype = np.dtype(draw(st.sampled_from([np.float16, ml_dtypes.bfloat16])))
    N2, G = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    block, count = 16, draw(st.integers(1, 2))
    lengths = [block * draw(st.integers(count, count + 1))
               for _ in range(draw(st.integers(1, 2)))]
    q, k, v, topk, scale, ends = select_problem(lengths, N1 := N2 * G, N2, 192, 128, block,
                                                count, dtype, seed=draw(st.integers(0, 99)))
    T = q.shape[0]
    call = dict(op=op, query=q, key=k, value=v, topk=topk, scale=scale, head_num=N1,
                block=block, count=count, mask=np.ones(1), seq_q=ends, seq_kv=list(ends),
                attention_out=np.full((T, N1, 128), 3, dtype),
                softmax_max=np.full((T, N1, 8), 3, np.float32),
                softmax_sum=np.full((T, N1, 8), 3, np.float32))
    if op == "grad":
        call.update(grad=np.ones((T, N1, 128), dtype), dq=np.full(q.shape, 3, dtype),
                    dk=np.full(k.shape, 3, dtype), dv=np.full(v.shape, 3, dtype))
    return call


@st.composite
def select_mutations(draw):
    call = draw(valid_select_calls())
    key = draw(st.sampled_from(list(SELECT_ARRAYS[call["op"]]) + [
        "scale", "head_num", "block", "count", "mask", "seq_q", "seq_kv"]))
    good = call[key]
    if key == "topk":
        how = draw(st.sampled_from(["negative", "past", "shape", "float", "none",
                                    "over-output"]))
        note(f"topk: {how}")
        bad = good.copy()
        if how == "over-output":            # valid indices in an output's memory
            output = call[draw(st.sampled_from(SELECT_OUTPUTS[call["op"]]))]
            words = output.reshape(-1).view(np.uint8)
            assume(words.size >= good.nbytes)
            start = draw(st.integers(0, (words.size - good.nbytes) // 4)) * 4
            bad = words[start:start + good.nbytes].view(np.int32).reshape(good.shape)
            bad[...] = good
        t, j, i = (draw(st.integers(0, n - 1)) for n in good.shape)
        if how == "negative":
            bad[t, j, i] = -draw(st.integers(1, 2 ** 31 - 1))
        elif how == "past":
            bad[t, j, i] = draw(st.integers(good.max() + 2, 2 ** 31 - 1))
        elif how == "shape":
            bad = bad[:, :, :0] if draw(st.booleans()) else bad[1:]
        elif how == "float":
            bad = bad.astype(np.float32)
        else:
            bad = None
        call["topk"] = bad
    elif isinstance(good, np.ndarray):
        output = key in SELECT_OUTPUTS[call["op"]]    # None: allocated (Python API)
        how = draw(st.sampled_from(["not-array", "ndim", "dtype", "shape"]
                                   + (["alias", "self-overlap"] if output
                                      else ["none", "masked"])))
        note(f"{key}: {how}")
        if how == "none":
            call[key] = None
        elif how in ("self-overlap", "masked"):
            call[key] = _hostile_array(draw, good, how)
        elif how == "not-array":
            call[key] = draw(NOT_ARRAYS)
        elif how == "ndim":
            call[key] = good.reshape(-1)
        elif how == "dtype":
            call[key] = good.astype(np.float64 if key.startswith("softmax") else
                                    _other_half(good.dtype))
        elif how == "shape":
            axis = draw(st.integers(0, 2))
            shape = list(good.shape)
            shape[axis] = draw(st.integers(1, shape[axis] + 20).filter(
                lambda n: n != good.shape[axis]))
            call[key] = np.full(shape, 3, good.dtype)
        else:                            # an output over an input's or another's memory
            source = call["query" if key != "attention_out" else "value"]
            if good.dtype == source.dtype and source.size >= good.size:
                call[key] = source.reshape(-1)[:good.size].reshape(good.shape)
            else:
                other = [o for o in SELECT_OUTPUTS[call["op"]] if o != key
                         and call[o].dtype == good.dtype and call[o].size >= good.size]
                assume(other)
                call[key] = call[other[0]].reshape(-1)[:good.size].reshape(good.shape)
    elif key in ("seq_q", "seq_kv"):
        call[key] = _bad_lengths(draw, key, good)
    else:
        value = draw(st.sampled_from({
            "scale": HOSTILE_SCALES,
            "head_num": [0, call["head_num"] + 1, 1.0, None],
            "block": [0, 8, 24, 256, 16.0, "16"],
            "count": [0, 33, 2.0, None],
            "mask": ["causal", 1, [1]]}[key]))
        note(f"{key}: {value!r}")
        call[key] = value
    return call


def _select_snapshot(call):
    return {k: (call[k], call[k].copy()) for k in SELECT_ARRAYS[call["op"]]
            if isinstance(call.get(k), np.ndarray) and call[k].dtype != object}


def _select_python(call):
    kw = dict(atten_mask=call["mask"], actual_seq_qlen=call["seq_q"],
              actual_seq_kvlen=call["seq_kv"])
    common = (call["topk"], call["scale"], call["head_num"], call["block"], call["count"])
    if call["op"] == "forward":
        return nsa_numba.nsa_select_attention(
            call["query"], call["key"], call["value"], *common,
            attention_out=call["attention_out"], softmax_max=call["softmax_max"],
            softmax_sum=call["softmax_sum"], **kw)
    return nsa_numba.nsa_select_attention_grad(
        call["grad"], call["query"], call["key"], call["value"], call["attention_out"],
        call["softmax_max"], call["softmax_sum"], *common, dq=call["dq"], dk=call["dk"],
        dv=call["dv"], **kw)


def _select_aclnn(call):
    status, size, executor, run = _select_phase_one(call)
    if status == ACLNN_SUCCESS:
        status = run(np.empty(size, np.uint8), size, executor)
        raise AssertionError(f"the aclnn mirror accepted an invalid call ({status})")
    return status


def _select_phase_one(call):
    """(status, workspace size, executor, phase two) of a selected-attention call."""
    if call["op"] == "forward":
        status, size, executor = aclnnNsaSelectedAttentionGetWorkspaceSize(
            call["query"], call["key"], call["value"], call["topk"], call["mask"],
            call["seq_q"], call["seq_kv"], call["scale"], call["head_num"], "TND", 2,
            call["block"], call["count"], call["softmax_max"], call["softmax_sum"],
            call["attention_out"])
        run = aclnnNsaSelectedAttention
    else:
        status, size, executor = aclnnNsaSelectedAttentionGradGetWorkspaceSize(
            call["query"], call["key"], call["value"], call["attention_out"], call["grad"],
            call["softmax_max"], call["softmax_sum"], call["topk"], call["seq_q"],
            call["seq_kv"], call["mask"], call["scale"], call["block"], call["count"],
            call["head_num"], "TND", 2, call["dq"], call["dk"], call["dv"])
        run = aclnnNsaSelectedAttentionGrad
    return status, size, executor, run


@given(valid_select_calls(), st.booleans())
def test_a_workspace_over_the_indices_is_refused(call, at_start):
    """The indices given to phase one live inside the workspace given to phase two (at
    its start or its end): the run fails and writes nothing."""
    status, size, _, _ = _select_phase_one(call)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    good = call["topk"]
    buffer = np.zeros(size + good.nbytes + 64, np.uint8)
    start = 0 if at_start else buffer.size - good.nbytes
    inside = buffer[start:start + good.nbytes].view(np.int32).reshape(good.shape)
    inside[...] = good
    call["topk"] = inside
    status, size, executor, run = _select_phase_one(call)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    snapshot = _select_snapshot(call)
    aclGetRecentErrMsg()
    status = run(buffer, buffer.size, executor)
    message = aclGetRecentErrMsg()
    assert status == ACLNN_ERR_PARAM_INVALID and "topkIndices" in message, (status, message)
    _assert_unchanged(snapshot)


@given(valid_select_calls(), st.booleans(), st.data())
def test_indices_broken_between_the_aclnn_phases_are_refused(call, repeated, data):
    """Phase two checks the indices it reads again: broken after phase one, or between
    two runs of a repeatable executor, the run fails and writes nothing."""
    status, size, executor, run = _select_phase_one(call)
    assert status == ACLNN_SUCCESS, aclGetRecentErrMsg()
    if repeated:
        assert aclSetAclOpExecutorRepeatable(executor) == ACLNN_SUCCESS
        assert run(np.empty(size, np.uint8), size, executor) == ACLNN_SUCCESS
    topk = call["topk"]
    at = tuple(data.draw(st.integers(0, n - 1)) for n in topk.shape)
    topk[at] = data.draw(st.one_of(st.integers(-2 ** 31, -1),
                                   st.integers(int(topk.max()) + 1 + 64, 2 ** 31 - 1)))
    note(f"topk{at} = {topk[at]}")
    snapshot = _select_snapshot(call)
    aclGetRecentErrMsg()
    status = run(np.empty(size, np.uint8), size, executor)
    message = aclGetRecentErrMsg()
    assert status == ACLNN_ERR_PARAM_INVALID, (status, message)
    assert f"topkIndices[{at[0]}, {at[1]}, {at[2]}]" in message, message
    _assert_unchanged(snapshot)


@given(select_mutations())
def test_invalid_selected_attention_is_rejected_by_both_apis(call):
    snapshot = _select_snapshot(call)
    try:
        _select_python(call)
    except NsaError as err:
        assert err.status in SELECT_REJECTED, err.status
        assert any(name in str(err) for name in SELECT_PY_PARAMS), str(err)
        note(str(err))
    else:
        raise AssertionError("the Python API accepted an invalid selected-attention call")
    _assert_unchanged(snapshot)
    aclGetRecentErrMsg()
    status = _select_aclnn(call)
    assert status in SELECT_REJECTED, (status, aclGetRecentErrMsg())
    message = aclGetRecentErrMsg()
    assert any(name in message for name in SELECT_C_PARAMS), message
    _assert_unchanged(snapshot)


# -- compressed attention --------------------------------------------------------------------

CMP_PY_PARAMS = ["query", "key", "value", "scale_value", "head_num", "compress_block_size",
                 "compress_stride", "select_block_size", "select_block_count", "topk_mask",
                 "atten_mask", "actual_seq_qlen", "actual_cmp_seq_kvlen",
                 "actual_sel_seq_kvlen", "attention_out", "topk_indices", "softmax_max",
                 "softmax_sum", "grad", "dq", "dk", "dv", "N1", "N2", "Dv"]
CMP_C_PARAMS = ["query", "key", "value", "scaleValue", "headNum", "compressBlockSize",
                "compressStride", "selectBlockSize", "selectBlockCount", "topkMaskOptional",
                "attenMaskOptional", "actualSeqQLenOptional", "actualCmpSeqKvLenOptional",
                "actualSelSeqKvLenOptional", "attentionOutOut", "topkIndicesOut",
                "softmaxMaxOut", "softmaxSumOut", "N1", "N2", "Dv"]
CMP_ARRAYS = {"forward": ("query", "key", "value", "atten_mask", "topk_mask",
                          "attention_out", "topk", "softmax_max", "softmax_sum"),
              "grad": ("grad", "query", "key", "value", "attention_out", "softmax_max",
                       "softmax_sum", "atten_mask", "dq", "dk", "dv")}
CMP_OUTPUTS = {"forward": ("attention_out", "topk", "softmax_max", "softmax_sum"),
               "grad": ("dq", "dk", "dv")}


@st.composite
def valid_cmp_calls(draw):
    """A valid strict float16/bfloat16 compressed-attention call (forward or gradient),
    outputs given: l 32, d 16, l' 64, the causal compressed mask."""
    op = draw(st.sampled_from(["forward", "grad"]))
    dtype = np.dtype(draw(st.sampled_from([np.float16, ml_dtypes.bfloat16])))
    N2, G = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    N1, D, Dv = N2 * G, draw(st.sampled_from([16, 32])), 16
    lengths = [draw(st.integers(96, 200)) for _ in range(draw(st.integers(1, 2)))]
    cmp = [(n - 32) // 16 + 1 for n in lengths]
    sel = [-(-c // 4) for c in cmp]
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    T, Tc = sum(lengths), sum(cmp)
    mask = np.arange(max(cmp))[None, :] * 16 + 31 > np.arange(max(lengths))[:, None]
    call = dict(op=op, query=rng.standard_normal((T, N1, D)).astype(dtype),
                key=rng.standard_normal((Tc, N2, D)).astype(dtype),
                value=rng.standard_normal((Tc, N2, Dv)).astype(dtype), scale=0.25,
                head_num=N1, block=32, stride=16, select_block=64,
                count=draw(st.integers(1, min(sel))), atten_mask=mask,
                topk_mask=np.zeros((max(lengths), max(sel)), np.bool_),
                seq_q=np.cumsum(lengths).tolist(), seq_kv=np.cumsum(cmp).tolist(),
                seq_sel=np.cumsum(sel).tolist(),
                attention_out=np.full((T, N1, Dv), 3, dtype),
                softmax_max=np.full((T, N1, 8), 3, np.float32),
                softmax_sum=np.full((T, N1, 8), 3, np.float32))
    call["topk"] = np.full((T, N2, call["count"]), 3, np.int32)
    if op == "grad":
        call.update(grad=np.ones((T, N1, Dv), dtype), dq=np.full((T, N1, D), 3, dtype),
                    dk=np.full((Tc, N2, D), 3, dtype), dv=np.full((Tc, N2, Dv), 3, dtype))
    return call


@st.composite
def cmp_mutations(draw):
    call = draw(valid_cmp_calls())
    op = call["op"]
    scalars = ["scale", "head_num", "seq_q", "seq_kv"] + (
        ["block", "stride", "select_block", "count", "seq_sel"] if op == "forward" else [])
    key = draw(st.sampled_from(list(CMP_ARRAYS[op]) + scalars))
    good = call[key]
    if key in ("atten_mask", "topk_mask"):
        call[key] = _bad_mask(draw, key, good, call, CMP_OUTPUTS[op])
    elif isinstance(good, np.ndarray):
        call[key] = _bad_attention_array(
            draw, call, key, key in CMP_OUTPUTS[op],
            lambda axis: not (key in ("softmax_max", "softmax_sum") and axis == 2))
    elif key.startswith("seq_"):
        call[key] = _bad_lengths(draw, key, good)
    else:
        value = draw(st.sampled_from({
            "scale": HOSTILE_SCALES,
            "head_num": [0, call["head_num"] + 1, 1.0, None],
            "block": [0, 24, 80, 256, 32.0],
            "stride": [0, 8, 48, 16.0],
            "select_block": [0, 16, 56, 256, 64.0],
            "count": [0, 33, 40, 2.0, None]}[key]))
        note(f"{key}: {value!r}")
        call[key] = value
    return call


def _bad_mask(draw, key, good, call, outputs):
    """An attention mask made invalid: a float dtype, too small, 1-D, a list, or (the
    right contents) in the memory of one of ``outputs``."""
    how = draw(st.sampled_from(["dtype", "small", "ndim", "not-array", "over-output"]))
    note(f"{key}: {how}")
    if how == "over-output":
        raw = call[draw(st.sampled_from(outputs))].reshape(-1).view(np.uint8)
        assume(raw.size >= good.size)
        bad = raw[:good.size].view(np.bool_).reshape(good.shape)
        bad[...] = good
        return bad
    return {"dtype": lambda: good.astype(np.float32),
            "small": lambda: good[..., :-1, :-1],
            "ndim": lambda: good.reshape(-1),
            "not-array": lambda: good.tolist()}[how]()


def _bad_attention_array(draw, call, key, output, axis_ok):
    """``call[key]`` made invalid: not an array, flat, another dtype, another size along
    an axis ``axis_ok`` allows, or (an output) over the query's memory, or (an input)
    None."""
    good = call[key]
    how = draw(st.sampled_from(["not-array", "ndim", "dtype", "shape"]
                               + (["alias", "self-overlap"] if output else ["none", "masked"])))
    note(f"{key}: {how}")
    if how == "none":
        return None
    if how in ("self-overlap", "masked"):
        return _hostile_array(draw, good, how)
    if how == "not-array":
        return draw(NOT_ARRAYS)
    if how == "ndim":
        return good.reshape(-1)
    if how == "dtype":
        return good.astype(np.float64 if good.dtype.kind != "V" and good.dtype.itemsize != 2
                           else _other_half(good.dtype))
    if how == "shape":
        axis = draw(st.integers(0, good.ndim - 1))
        assume(axis_ok(axis))
        shape = list(good.shape)
        shape[axis] = draw(st.integers(1, shape[axis] + 20).filter(
            lambda n: n != good.shape[axis]))
        return np.full(shape, 3, good.dtype)
    source = call["query"]               # an output over an input's memory
    assume(source.dtype == good.dtype and source.size >= good.size)
    return source.reshape(-1)[:good.size].reshape(good.shape)


def _bad_lengths(draw, key, good):
    """Prefix sums made invalid: the wrong end, decreasing, one value more, a float."""
    how = draw(st.sampled_from(["end", "decreasing", "length", "float"]))
    note(f"{key}: {how}")
    seq = list(good)
    if how == "end":
        seq[-1] += draw(st.sampled_from([-1, 1, 16]))
    elif how == "decreasing":
        assume(len(seq) > 1)
        seq[0] = seq[-1] + 1
    elif how == "length":
        seq = seq + [seq[-1] + 1]
    else:
        seq[0] = float(seq[0]) + 0.5
    return seq


def _python_rejects(call, arrays, params, python, what):
    """``python(call)`` raises NsaError with an attention status naming a parameter of
    ``params`` and changes none of the call's ``arrays``; returns their snapshot."""
    snapshot = {k: (call[k], call[k].copy()) for k in arrays[call["op"]]
                if isinstance(call.get(k), np.ndarray) and call[k].dtype != object}
    try:
        python(call)
    except NsaError as err:
        assert err.status in SELECT_REJECTED, err.status
        assert any(name in str(err) for name in params), str(err)
        note(str(err))
    else:
        raise AssertionError(f"the Python API accepted an invalid {what} call")
    _assert_unchanged(snapshot)
    return snapshot


def _cmp_python(call):
    if call["op"] == "forward":
        return nsa_numba.nsa_compress_attention(
            call["query"], call["key"], call["value"], call["scale"], call["head_num"],
            call["block"], call["stride"], call["select_block"], call["count"],
            topk_mask=call["topk_mask"], atten_mask=call["atten_mask"],
            actual_seq_qlen=call["seq_q"], actual_cmp_seq_kvlen=call["seq_kv"],
            actual_sel_seq_kvlen=call["seq_sel"], attention_out=call["attention_out"],
            topk_indices=call["topk"], softmax_max=call["softmax_max"],
            softmax_sum=call["softmax_sum"])
    return nsa_numba.nsa_compress_attention_grad(
        call["grad"], call["query"], call["key"], call["value"], call["attention_out"],
        call["softmax_max"], call["softmax_sum"], call["scale"], call["head_num"],
        atten_mask=call["atten_mask"], actual_seq_qlen=call["seq_q"],
        actual_cmp_seq_kvlen=call["seq_kv"], dq=call["dq"], dk=call["dk"], dv=call["dv"])


@given(cmp_mutations())
def test_invalid_compressed_attention_is_rejected_by_both_apis(call):
    snapshot = _python_rejects(call, CMP_ARRAYS, CMP_PY_PARAMS, _cmp_python,
                               "compressed-attention")
    if call["op"] == "grad":             # no aclnn gradient operator
        return
    aclGetRecentErrMsg()
    status, size, executor = aclnnNsaCompressAttentionGetWorkspaceSize(
        call["query"], call["key"], call["value"], call["atten_mask"], call["topk_mask"],
        call["seq_q"], call["seq_kv"], call["seq_sel"], call["scale"], call["head_num"],
        "TND", 1, call["block"], call["stride"], call["select_block"], call["count"],
        call["softmax_max"], call["softmax_sum"], call["attention_out"], call["topk"])
    if status == ACLNN_SUCCESS:
        aclnnNsaCompressAttention(np.empty(size, np.uint8), size, executor)
        raise AssertionError("the aclnn mirror accepted an invalid compressed-attention call")
    message = aclGetRecentErrMsg()
    assert status in SELECT_REJECTED, (status, message)
    assert any(name in message for name in CMP_C_PARAMS), message
    _assert_unchanged(snapshot)


# -- fusion attention (the NumPy API; there is no aclnn mirror) ------------------------------

FUSION_PY_PARAMS = ["query", "key", "value", "dy", "head_num", "input_layout", "atten_mask",
                    "scale", "scale_value", "keep_prob", "pre_tockens", "next_tockens",
                    "inner_precise", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode",
                    "attention_out", "attention_in", "softmax_max", "softmax_sum", "dq",
                    "dk", "dv", "N1", "N2", "D", "Dv"]
FUSION_ARRAYS = {"forward": ("query", "key", "value", "attention_out", "softmax_max",
                             "softmax_sum"),
                 "grad": ("query", "key", "value", "grad", "attention_out", "softmax_max",
                          "softmax_sum", "dq", "dk", "dv")}
FUSION_OUTPUTS = {"forward": ("attention_out", "softmax_max", "softmax_sum"),
                  "grad": ("dq", "dk", "dv")}
FUSION_LAYOUTS = ("TND", "BSND", "BNSD", "BSH", "SBH")


def _fusion_shape(layout, B, S, N, X):
    return {"TND": (B * S, N, X), "BSND": (B, S, N, X), "BNSD": (B, N, S, X),
            "BSH": (B, S, N * X), "SBH": (S, B, N * X)}[layout]


@st.composite
def valid_fusion_calls(draw):
    """A valid strict fusion-attention call (forward or gradient), outputs given: a
    band (mode 4), a causal mask (mode 2) or an explicit mask (modes 0 and 1)."""
    op = draw(st.sampled_from(["forward", "grad"]))
    layout = draw(st.sampled_from(FUSION_LAYOUTS))
    dtype = np.dtype(draw(st.sampled_from([np.float16, ml_dtypes.bfloat16, np.float32])))
    N2, G = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    N1, D, Dv = N2 * G, draw(st.sampled_from([16, 32])), 16
    B, S = draw(st.integers(1, 2)), draw(st.integers(8, 40))
    mode = draw(st.sampled_from([0, 1, 2, 4]))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    if mode >= 2:
        mask = np.triu(np.ones((2048, 2048), np.bool_), 1)
    else:
        mask = np.triu(np.ones((S, S), np.bool_), 1)
        if layout != "TND" and draw(st.booleans()):
            mask = np.broadcast_to(mask, (B, N1, S, S)).copy()
    stats = (B * S, N1, 8) if layout == "TND" else (B, N1, S, 8)
    call = dict(op=op, layout=layout, query=rng.standard_normal(
                    _fusion_shape(layout, B, S, N1, D)).astype(dtype),
                key=rng.standard_normal(_fusion_shape(layout, B, S, N2, D)).astype(dtype),
                value=rng.standard_normal(_fusion_shape(layout, B, S, N2, Dv)).astype(dtype),
                head_num=N1, atten_mask=mask, scale=0.25, keep_prob=1.0, pre=S, nxt=0,
                inner_precise=0, sparse_mode=mode,
                seq_q=[S * (b + 1) for b in range(B)] if layout == "TND" else None,
                seq_kv=[S * (b + 1) for b in range(B)] if layout == "TND" else None,
                attention_out=np.full(_fusion_shape(layout, B, S, N1, Dv), 3, dtype),
                softmax_max=np.full(stats, 3, np.float32),
                softmax_sum=np.full(stats, 3, np.float32))
    if op == "grad":
        call.update(grad=np.ones_like(call["attention_out"]),
                    dq=np.full(call["query"].shape, 3, dtype),
                    dk=np.full(call["key"].shape, 3, dtype),
                    dv=np.full(call["value"].shape, 3, dtype))
    return call


@st.composite
def fusion_mutations(draw):
    call = draw(valid_fusion_calls())
    op, layout = call["op"], call["layout"]
    scalars = ["scale", "head_num", "layout", "keep_prob", "sparse_mode", "inner_precise",
               "seq_q", "seq_kv"]
    key = draw(st.sampled_from(list(FUSION_ARRAYS[op]) + ["atten_mask"] + scalars))
    good = call[key]
    if key == "atten_mask":
        call[key] = _bad_mask(draw, key, good, call, FUSION_OUTPUTS[op])
    elif isinstance(good, np.ndarray):
        stat = key in ("softmax_max", "softmax_sum")
        # the gradient reads one lane of the statistics; a key and value with more or
        # fewer heads in BSH/SBH can still divide
        call[key] = _bad_attention_array(
            draw, call, key, key in FUSION_OUTPUTS[op],
            lambda axis: not (stat and axis == good.ndim - 1 and op == "grad") and not (
                layout in ("BSH", "SBH") and key in ("key", "value", "dk", "dv")
                and axis == 2))
    elif key.startswith("seq_"):                # padded layouts take none
        call[key] = _bad_lengths(draw, key, good or [4])
    else:
        value = draw(st.sampled_from({
            "scale": HOSTILE_SCALES,
            "head_num": [0, -1, 1.0, None] + ([] if layout in ("BSH", "SBH")
                                              else [call["head_num"] + 1]),
            "layout": ["", "TNDX", "NSD", "BSHD", 3, None],
            "keep_prob": [0.0, -1.0, 1.5, "1", None],
            "sparse_mode": [-1, 9, 2.0, None],
            "inner_precise": [-1, 4, 1.0]}[key]))
        note(f"{key}: {value!r}")
        call[key] = value
    return call


def _fusion_python(call):
    common = dict(atten_mask=call["atten_mask"], keep_prob=call["keep_prob"],
                  pre_tockens=call["pre"], next_tockens=call["nxt"],
                  inner_precise=call["inner_precise"], actual_seq_qlen=call["seq_q"],
                  actual_seq_kvlen=call["seq_kv"], sparse_mode=call["sparse_mode"])
    if call["op"] == "forward":
        return nsa_numba.fusion_attention(
            call["query"], call["key"], call["value"], call["head_num"], call["layout"],
            scale=call["scale"], attention_out=call["attention_out"],
            softmax_max=call["softmax_max"], softmax_sum=call["softmax_sum"], **common)
    return nsa_numba.fusion_attention_grad(
        call["query"], call["key"], call["value"], call["grad"], call["head_num"],
        call["layout"], softmax_max=call["softmax_max"], softmax_sum=call["softmax_sum"],
        attention_in=call["attention_out"], scale_value=call["scale"], dq=call["dq"],
        dk=call["dk"], dv=call["dv"], **common)


@given(fusion_mutations())
def test_invalid_fusion_attention_is_rejected(call):
    _python_rejects(call, FUSION_ARRAYS, FUSION_PY_PARAMS, _fusion_python, "fusion-attention")


@given(valid_fusion_calls())
def test_the_unmutated_fusion_calls_are_valid(call):
    _fusion_python(call)                # the mutations start from calls that pass
