"""Every validation rule: status code, a message naming parameter/value/rule, no writes."""

import ml_dtypes
import numpy as np
import pytest

import nsa_numba
from nsa_numba import NsaError

T, N, D, L, S = 272, 4, 32, 32, 16
SEQ = [0, 128, 272]
TP = 15  # windows


def good(dtype=np.float16):
    rng = np.random.default_rng(0)
    return dict(
        input=rng.standard_normal((T, N, D)).astype(dtype),
        weight=rng.standard_normal((L, N)).astype(dtype),
        grad=rng.standard_normal((TP, N, D)).astype(dtype),
        out=np.full((TP, N, D), 3, dtype),
        input_grad=np.full((T, N, D), 3, dtype),
        weight_grad=np.full((L, N), 3, dtype),
        block=L, stride=S, seq=SEQ, seq_type=0, layout="TND",
    )


def call_forward(a):
    return nsa_numba.nsa_compress(a["input"], a["weight"], a["block"], a["stride"],
                                  actual_seq_len=a["seq"], actual_seq_len_type=a["seq_type"],
                                  layout=a["layout"], out=a["out"])


def call_grad(a):
    return nsa_numba.nsa_compress_grad(a["grad"], a["input"], a["weight"], a["block"],
                                       a["stride"], actual_seq_len=a["seq"],
                                       actual_seq_len_type=a["seq_type"], layout=a["layout"],
                                       input_grad=a["input_grad"], weight_grad=a["weight_grad"])


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


# (id, ops, change, status, message fragments)
BOTH = ("forward", "grad")
RULES = [
    ("input-none", BOTH, dict(input=None), 161001, ["input", "None"]),
    ("weight-none", BOTH, dict(weight=None), 161001, ["weight", "None"]),
    ("grad-none", ("grad",), dict(grad=None), 161001, ["grad", "None"]),
    ("none-before-other-errors", ("grad",), dict(grad=None, block=20), 161001, ["grad"]),
    ("input-list", BOTH, dict(input=[[[1.0]]]), 161002, ["input", "numpy.ndarray", "list"]),
    ("input-2d", BOTH, dict(input=np.zeros((T, N * D), np.float16)), 161002,
     ["input must be 3-D [T, N, D] (layout='TND')", "2-D"]),
    ("weight-3d", BOTH, dict(weight=np.zeros((L, N, 1), np.float16)), 161002,
     ["weight must be 2-D [compress_block_size, N]", "3-D"]),
    ("grad-2d", ("grad",), dict(grad=np.zeros((TP, N), np.float16)), 161002, ["grad", "3-D"]),
    ("int-dtype", BOTH, dict(input=np.zeros((T, N, D), np.int16)), 161002,
     ["input", "dtype", "int16"]),
    ("complex-dtype", BOTH, dict(input=np.zeros((T, N, D), np.complex64)), 161002,
     ["input", "dtype", "complex64"]),
    ("big-endian", BOTH, dict(input=np.zeros((T, N, D), ">f2")), 161002, ["input", ">f2"]),
    ("weight-dtype", BOTH, dict(weight=np.zeros((L, N), np.float32)), 161002,
     ["weight", "float32", "float16"]),
    ("grad-dtype", ("grad",), dict(grad=np.zeros((TP, N, D), ml_dtypes.bfloat16)), 161002,
     ["grad", "bfloat16"]),
    ("empty-input", BOTH, dict(input=np.zeros((0, N, D), np.float16), seq=None), 161002,
     ["input", "empty", "(0, 4, 32)"]),
    ("head-dim", BOTH, dict(input=np.zeros((T, N, 24), np.float16)), 161002,
     ["D", "multiple of 16", "24"]),
    ("weight-shape", BOTH, dict(weight=np.zeros((L, N + 1), np.float16)), 161002,
     ["weight", "(32, 4)", "(32, 5)"]),
    ("weight-rows", BOTH, dict(weight=np.zeros((16, N), np.float16)), 161002,
     ["weight", "(32, 4)", "(16, 4)"]),
    ("block-float", BOTH, dict(block=32.0), 161002, ["compress_block_size", "integer", "32.0"]),
    ("block-bool", BOTH, dict(stride=True), 161002, ["compress_stride", "integer", "True"]),
    ("block-str", BOTH, dict(block="32"), 161002, ["compress_block_size", "'32'"]),
    ("block-not-16", BOTH, dict(block=40), 161002,
     ["compress_block_size", "multiple of 16", "40"]),
    ("stride-zero", BOTH, dict(stride=0), 161002, ["compress_stride", "multiple of 16", "0"]),
    ("stride-negative", BOTH, dict(stride=-16), 161002, ["compress_stride", "-16"]),
    ("block-huge", BOTH, dict(block=2 ** 70), 161002, ["compress_block_size", "int64"]),
    ("block-lt-stride", BOTH, dict(stride=48), 161002,
     ["compress_block_size must be >= compress_stride", "48"]),
    ("layout-other", BOTH, dict(layout="NTD"), 161002,
     ["layout must be one of 'TND', 'BSND', 'BNSD', 'BSH', 'SBH'", "'NTD'"]),
    ("layout-ndim", BOTH, dict(layout="BSND"), 161002,
     ["input must be 4-D [B, S, N, D] (layout='BSND')", "3-D"]),
    ("layout-lowercase", BOTH, dict(layout="tnd"), 161002, ["layout", "'tnd'"]),
    ("layout-type", BOTH, dict(layout=3), 161002, ["layout", "string", "int"]),
    ("seq-type-2", BOTH, dict(seq_type=2), 161002, ["actual_seq_len_type", "0", "1", "2"]),
    ("seq-type-float", BOTH, dict(seq_type=0.0), 161002, ["actual_seq_len_type", "integer"]),
    ("seq-dict", BOTH, dict(seq={0: 272}), 161002, ["actual_seq_len", "dict"]),
    ("seq-str", BOTH, dict(seq="272"), 161002, ["actual_seq_len", "str"]),
    ("seq-float-item", BOTH, dict(seq=[0, 128.0, 272]), 161002,
     ["actual_seq_len[1]", "integer", "128.0"]),
    ("seq-bool-item", BOTH, dict(seq=[True, 272]), 161002, ["actual_seq_len[0]", "True"]),
    ("seq-2d-array", BOTH, dict(seq=np.array([[0, 272]])), 161002, ["actual_seq_len", "1-D"]),
    ("seq-float-array", BOTH, dict(seq=np.array([0.0, 272.0])), 161002,
     ["actual_seq_len", "integers", "float64"]),
    ("seq-empty", BOTH, dict(seq=[]), 161002, ["actual_seq_len", "at least one"]),
    ("seq-negative", BOTH, dict(seq=[-1, 272]), 161002, ["actual_seq_len", ">= 0", "-1"]),
    ("seq-decreasing", BOTH, dict(seq=[0, 200, 128, 272]), 161002,
     ["actual_seq_len", "non-decreasing", "128", "200"]),
    ("seq-short", BOTH, dict(seq=[0, 128, 270]), 161002, ["actual_seq_len", "T = 272", "270"]),
    ("seq-long", BOTH, dict(seq=[0, 128, 300]), 161002, ["actual_seq_len", "T = 272", "300"]),
    ("seq-huge", BOTH, dict(seq=[0, 2 ** 64]), 161002, ["actual_seq_len[1]", "int64"]),
    ("seq-huge-uint64", BOTH, dict(seq=np.array([2 ** 63 + 1], np.uint64)), 161002,
     ["actual_seq_len", "int64"]),
    ("lengths-sum", BOTH, dict(seq=[128, 100], seq_type=1), 161002,
     ["actual_seq_len", "sum", "T = 272", "228"]),
    ("lengths-too-long", BOTH, dict(seq=[0, 500], seq_type=1), 161002,
     ["actual_seq_len", "sum", "272"]),
    ("no-window", BOTH, dict(seq=[10] * 27 + [2], seq_type=1), 161002,
     ["no sequence is as long as compress_block_size = 32", "T' = 0"]),
    ("out-shape", ("forward",), dict(out=np.zeros((TP + 1, N, D), np.float16)), 161002,
     ["out", "(15, 4, 32)", "(16, 4, 32)"]),
    ("out-dtype", ("forward",), dict(out=np.zeros((TP, N, D), np.float32)), 161002,
     ["out", "float32", "float16"]),
    ("out-readonly", ("forward",), dict(out=readonly(np.zeros((TP, N, D), np.float16))),
     161002, ["out", "writable"]),
    ("out-list", ("forward",), dict(out=[]), 161002, ["out", "numpy.ndarray", "list"]),
    ("grad-shape", ("grad",), dict(grad=np.zeros((TP - 1, N, D), np.float16)), 161002,
     ["grad", "(15, 4, 32)", "(14, 4, 32)", "windows"]),
    ("input-grad-shape", ("grad",), dict(input_grad=np.zeros((T, N, D + 16), np.float16)),
     161002, ["input_grad", "(272, 4, 32)", "(272, 4, 48)"]),
    ("input-grad-readonly", ("grad",),
     dict(input_grad=readonly(np.zeros((T, N, D), np.float16))), 161002,
     ["input_grad", "writable"]),
    ("weight-grad-dtype", ("grad",), dict(weight_grad=np.zeros((L, N), np.float64)), 161002,
     ["weight_grad", "float64", "float16"]),
    ("weight-grad-shape", ("grad",), dict(weight_grad=np.zeros((N, L), np.float16)), 161002,
     ["weight_grad", "(32, 4)", "(4, 32)"]),
]


def rule_cases():
    """pytest params (op, change, status, fragments) for every rule and operator."""
    for rid, ops, change, status, fragments in RULES:
        for op in ops:
            yield pytest.param(op, change, status, fragments, id=f"{op}-{rid}")


@pytest.mark.parametrize("op,change,status,fragments", list(rule_cases()))
def test_rule(op, change, status, fragments):
    args = good()
    args.update(change)
    outputs = [k for k in ("out", "input_grad", "weight_grad")
               if isinstance(args[k], np.ndarray)]
    before = {k: args[k].copy() for k in outputs}
    with pytest.raises(NsaError) as info:
        (call_forward if op == "forward" else call_grad)(args)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.status == status
    message = str(err)
    assert message.startswith("nsa_compress_grad: " if op == "grad" else "nsa_compress: ")
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    for k in outputs:  # no output element changed
        assert np.array_equal(args[k].view(np.uint8), before[k].view(np.uint8)), k


def test_valid_arguments_pass():
    # the baseline of the table above really is valid in both strict checks
    args = good()
    assert call_forward(args) is args["out"]
    dx, dw = call_grad(args)
    assert dx is args["input_grad"] and dw is args["weight_grad"]


@pytest.mark.parametrize("value", [np.int32(32), np.uint8(32), np.int64(32)])
def test_numpy_integers_are_integers(value):
    args = good()
    args["block"] = value
    call_forward(args)
    args["seq"] = np.array(SEQ, dtype=np.uint16)
    call_grad(args)


def _big():
    return np.zeros((T, N, D), np.float16)


OVERLAPS = [
    ("forward", lambda a: dict(out=a["input"][:TP]), "out overlaps input in memory"),
    ("grad", lambda a: dict(input_grad=a["input"]), "input_grad overlaps input in memory"),
    ("grad", lambda a: dict(weight_grad=a["weight"]), "weight_grad overlaps weight in memory"),
    ("grad", lambda a: (lambda big: dict(input_grad=big, weight_grad=big[:L, 0, :N]))(_big()),
     "input_grad overlaps weight_grad in memory"),
    ("grad", lambda a: dict(input_grad=np.lib.stride_tricks.as_strided(
        a["grad"], (T, N, D), (0,) + a["grad"].strides[1:], writeable=True)),
     "input_grad has elements that share memory"),        # (and overlaps grad)
]


@pytest.mark.parametrize("op,make,fragment", OVERLAPS)
def test_outputs_must_not_overlap_inputs(op, make, fragment):
    args = good()
    args.update(make(args))
    before = {k: v.copy() for k, v in args.items() if isinstance(v, np.ndarray)}
    with pytest.raises(NsaError, match=fragment) as info:
        (call_forward if op == "forward" else call_grad)(args)
    assert info.value.status == 161002
    for k, v in before.items():
        assert np.array_equal(args[k].view(np.uint8), v.view(np.uint8)), k


def test_interleaved_views_of_one_buffer_are_fine():
    # out and input share a buffer but not a single element
    buf = np.random.default_rng(0).standard_normal((T, N, 2 * D)).astype(np.float16)
    x = buf[..., ::2]
    out = buf[:TP, :, 1::2]
    args = good()
    args.update(input=x, out=out)
    expected = nsa_numba.nsa_compress(x.copy(), args["weight"], L, S, actual_seq_len=SEQ)
    call_forward(args)
    assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))
