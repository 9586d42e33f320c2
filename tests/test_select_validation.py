"""Bad arguments to nsa_select_attention / _grad: NsaError with the status code and
a message naming the parameter, the value and the rule; nothing written."""

import numpy as np
import pytest

import nsa_numba
from nsa_numba import NsaError
from nsa_numba.bench.cases import select_problem

NULL, INVALID, TILING = 161001, 161002, 561002


def _strict_problem():
    """A valid strict call: D 192, Dv 128, l' 16, c 2, two sequences of whole blocks."""
    q, k, v, topk, scale, ends = select_problem([32, 64], 4, 2, 192, 128, 16, 2, "float16",
                                                seed=1)
    return dict(query=q, key=k, value=v, topk_indices=topk, scale_value=scale, head_num=4,
                select_block_size=16, select_block_count=2, atten_mask=np.ones(1),
                actual_seq_qlen=ends, actual_seq_kvlen=ends)


def _outputs(call):
    T1, N1 = call["query"].shape[:2]
    return dict(attention_out=np.full((T1, N1, call["value"].shape[2]), 3, np.float16),
                softmax_max=np.full((T1, N1, 8), 3, np.float32),
                softmax_sum=np.full((T1, N1, 8), 3, np.float32))


def _forward(call, **outputs):
    c = dict(call)
    args = [c.pop(k) for k in ("query", "key", "value", "topk_indices", "scale_value",
                               "head_num", "select_block_size", "select_block_count")]
    return nsa_numba.nsa_select_attention(*args, **c, **outputs)


def _mutated(change):
    call = _strict_problem()
    change(call)
    return call


def _set(key, value):
    return lambda call: call.__setitem__(key, value(call) if callable(value) else value)


CASES = {
    # name: (change, status, words the message must hold)
    "query None": (_set("query", None), NULL, ["query", "None"]),
    "key dtype": (_set("key", lambda c: c["key"].astype(np.float32)), INVALID,
                  ["key", "float32", "float16"]),
    "query 2-D": (_set("query", lambda c: c["query"][0]), INVALID, ["query", "3-D"]),
    "head_num": (_set("head_num", 8), INVALID, ["head_num", "8", "4"]),
    "heads not a multiple": (lambda c: c.update(query=c["query"][:, :3], head_num=3),
                             INVALID, ["N1 = 3", "N2 = 2"]),
    "value heads": (_set("value", lambda c: c["value"][:, :1]), INVALID, ["value", "N2"]),
    "key head dim": (_set("key", lambda c: c["key"][..., :128]), INVALID, ["key", "192"]),
    "D 128 forward": (lambda c: [c.__setitem__(k, c[k][..., :128]) for k in ("query", "key")],
                      TILING, ["D", "192", "128"]),
    "Dv 64": (_set("value", lambda c: c["value"][..., :64]), TILING, ["Dv", "128", "64"]),
    "block not 16s": (_set("select_block_size", 24), TILING, ["select_block_size", "24"]),
    "block 0": (_set("select_block_size", 0), INVALID, ["select_block_size", ">= 1", "0"]),
    "count 33": (_set("select_block_count", 33), INVALID, ["topk_indices", "33"]),
    "count float": (_set("select_block_count", 2.0), INVALID, ["select_block_count", "2.0"]),
    "scale text": (_set("scale_value", "0.1"), INVALID, ["scale_value", "'0.1'"]),
    "topk None": (_set("topk_indices", None), NULL, ["topk_indices"]),
    "topk float": (_set("topk_indices", lambda c: c["topk_indices"].astype(float)), INVALID,
                   ["topk_indices", "integers"]),
    "topk shape": (_set("topk_indices", lambda c: c["topk_indices"][:, :1]), INVALID,
                   ["topk_indices", "shape"]),
    "topk negative": (lambda c: c["topk_indices"].__setitem__((5, 1, 0), -1), INVALID,
                      ["topk_indices[5, 1, 0] = -1", "[0, 2)"]),
    "topk past its sequence": (lambda c: c["topk_indices"].__setitem__((3, 0, 1), 2), INVALID,
                               ["topk_indices[3, 0, 1] = 2", "sequence 0", "[0, 2)"]),
    "topk huge": (lambda c: c.__setitem__("topk_indices", np.full(c["topk_indices"].shape,
                                                                  2 ** 40)), INVALID,
                  ["topk_indices", str(2 ** 40)]),
    "seq not ending at T": (_set("actual_seq_kvlen", [32, 90]), INVALID,
                            ["actual_seq_kvlen", "96"]),
    "seq decreasing": (_set("actual_seq_qlen", [64, 32]), INVALID,
                       ["actual_seq_qlen", "non-decreasing"]),
    "seq counts differ": (lambda c: [c.__setitem__("actual_seq_qlen", [32, 32, 96]),
                                     c.__setitem__("actual_seq_kvlen", [32, 96])], INVALID,
                          ["actual_seq_qlen", "actual_seq_kvlen", "3", "2"]),
    "only one seq list": (_set("actual_seq_kvlen", None), INVALID,
                          ["actual_seq_qlen", "actual_seq_kvlen"]),
    "kv shorter than c blocks": (lambda c: [c.__setitem__("actual_seq_kvlen", [16, 96])],
                                 TILING, ["key sequence 0", "16", "32"]),
    "mask not an array": (_set("atten_mask", "causal"), INVALID, ["atten_mask", "str"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_forward_argument(name):
    change, status, words = CASES[name]
    call = _mutated(change)
    outputs = _outputs(_strict_problem())
    before = {k: a.copy() for k, a in outputs.items()}
    with pytest.raises(NsaError) as info:
        _forward(call, **outputs)
    assert info.value.status == status, str(info.value)
    message = str(info.value)
    assert message.startswith("nsa_select_attention: ")
    for word in words:
        assert word in message, message
    for k, a in outputs.items():
        assert np.array_equal(a, before[k]), f"{k} was written"


def test_strict_false_takes_what_the_maths_allows():
    call = _strict_problem()
    call["query"], call["key"] = call["query"][..., :40], call["key"][..., :40]
    call["value"] = call["value"][..., :24]
    out, _, _ = _forward(dict(call, strict=False))
    assert out.shape == (96, 4, 24)
    with pytest.raises(NsaError):
        _forward(call)


@pytest.mark.parametrize("role,bad,words", [
    ("attention_out", lambda a: a[:, :, :64], ["attention_out", "shape"]),
    ("softmax_max", lambda a: a.astype(np.float16), ["softmax_max", "float32"]),
    ("softmax_sum", lambda a: a.view(np.int32), ["softmax_sum", "float32"]),
    ("attention_out", lambda a: np.broadcast_to(a[:1], a.shape), ["attention_out",
                                                                   "writable"]),
])
def test_bad_forward_output(role, bad, words):
    call = _strict_problem()
    outputs = _outputs(call)
    outputs[role] = bad(outputs[role])
    with pytest.raises(NsaError) as info:
        _forward(call, **outputs)
    assert info.value.status == INVALID
    for word in words:
        assert word in str(info.value), str(info.value)


def test_outputs_that_share_memory_are_refused():
    call = _strict_problem()
    outputs = _outputs(call)
    outputs["softmax_sum"] = outputs["softmax_max"]
    with pytest.raises(NsaError, match="softmax_max overlaps softmax_sum"):
        _forward(call, **outputs)
    outputs = _outputs(call)
    outputs["attention_out"] = call["query"][..., :128]
    with pytest.raises(NsaError, match="attention_out overlaps query"):
        _forward(call, **outputs)


def test_bad_gradient_arguments():
    call = _strict_problem()
    out, smax, ssum = _forward(call)
    g = np.ones_like(out)
    args = [g, call["query"], call["key"], call["value"], out, smax, ssum,
            call["topk_indices"], call["scale_value"], 4, 16, 2]
    kw = dict(atten_mask=call["atten_mask"], actual_seq_qlen=call["actual_seq_qlen"],
              actual_seq_kvlen=call["actual_seq_kvlen"])
    given = [np.full(a.shape, 3, a.dtype) for a in (call["query"], call["key"],
                                                     call["value"])]
    cases = [
        (0, None, NULL, "grad"),
        (0, g[:, :, :64], INVALID, "grad must have shape"),
        (4, out.astype(np.float32), INVALID, "attention_out dtype"),
        (5, smax[:, :2], INVALID, "softmax_max must have shape"),
        (6, ssum.astype(np.float64), INVALID, "softmax_sum dtype must be float32"),
        (6, None, NULL, "softmax_sum"),
    ]
    for position, value, status, words in cases:
        bad = list(args)
        bad[position] = value
        with pytest.raises(NsaError) as info:
            nsa_numba.nsa_select_attention_grad(*bad, dq=given[0], dk=given[1], dv=given[2],
                                                **kw)
        assert info.value.status == status and words in str(info.value), str(info.value)
        assert str(info.value).startswith("nsa_select_attention_grad: ")
        assert all((a == 3).all() for a in given)
    # the gradient allows D 128 in strict mode, the forward does not
    small = select_problem([32, 64], 4, 2, 128, 128, 16, 2, "float16", seed=2)
    with pytest.raises(NsaError, match="D must be 192"):
        nsa_numba.nsa_select_attention(*small[:4], small[4], 4, 16, 2)
    out, smax, ssum = nsa_numba.nsa_select_attention(*small[:4], small[4], 4, 16, 2,
                                                     strict=False)
    dq, dk, dv = nsa_numba.nsa_select_attention_grad(out, *small[:3], out, smax, ssum,
                                                     small[3], small[4], 4, 16, 2)
    assert dq.shape == small[0].shape
    with pytest.raises(NsaError, match="dq overlaps query"):
        nsa_numba.nsa_select_attention_grad(*args, dq=call["query"], **kw)
