"""PyTorch bridge under torch_npu's names: a drop-in CPU fallback with autograd.

::

    from nsa_numba.torch import npu_nsa_compress, npu_nsa_compress_grad

    out = npu_nsa_compress(input, weight, compress_block_size, compress_stride,
                           actual_seq_len=[0, 128, 272])       # differentiable
    input_grad, weight_grad = npu_nsa_compress_grad(grad, input, weight, 32, 16,
                                                    actual_seq_len=[0, 128, 272])

Same arguments and semantics as ``torch_npu.npu_nsa_compress`` (layout TND,
``actual_seq_len`` the cumulative sequence ends). CPU tensors of float16, bfloat16,
float32 and float64, any strides. The operators are registered as
``torch.ops.nsa_numba.nsa_compress`` and ``torch.ops.nsa_numba.nsa_compress_grad``
(``torch.library.custom_op``) with fake-tensor and autograd implementations (the
gradient operator's own autograd gives second derivatives), so they work under
``torch.compile`` and pass ``torch.library.opcheck`` and ``gradgradcheck``.

Under ``torch.compile`` the forward's row count T' comes from the sequence ends:
given as a list or tuple, their values are symbolic integers (Dynamo makes them
so once they change) and T' is the exact expression in them; given as a tensor,
T' is a data-dependent size, checked equal across calls with the same tensor and
window (so keys and values compressed alike have lengths that match). Either way one graph serves
batches of any lengths; Dynamo guards on a list's length, so lists compile once per
sequence count (see the README for the counts).

Selected attention, ``npu_nsa_select_attention`` and ``npu_nsa_select_attention_grad``
(``torch.ops.nsa_numba.nsa_select_attention`` / ``_grad``), takes the same arguments as
torch_npu's; autograd differentiates it in query, key and value with the gradient
operator, so the gradients are the explicit call's bits. Its sequence lengths are
lists (or 1-D tensors, read once in eager code); under ``torch.compile`` a new number
of sequences compiles a new graph (Dynamo guards on a list's length). Compressed
attention, ``npu_nsa_compress_attention`` (``torch.ops.nsa_numba.nsa_compress_attention``)
works the same way, its gradient through the generic attention's (as torch_npu's is).

The generic attention, ``npu_fusion_attention`` and ``npu_fusion_attention_grad``
(``torch.ops.nsa_numba.fusion_attention`` / ``_grad``), sparse modes 0 to 4, all five
layouts: the NSA window branch.

Tensors cross to NumPy without copies (bfloat16 through an int16 view); results
are the NumPy API's, bit for bit. A call uses at most ``torch.get_num_threads()``
threads, so torchrun's per-rank ``OMP_NUM_THREADS`` holds for these kernels too.
Invalid arguments raise ``nsa_numba.NsaError`` naming the torch_npu function and
its arguments. Requires PyTorch 2.4 or newer.
"""

import weakref
from typing import List, Optional

import numpy as np
import torch
from torch.autograd.graph import increment_version as _increment_version

from ._core import internals as _internals
from ._core.errors import invalid, missing
from ._ops import pipeline as _pipeline
from ._ops import seqlens as _seqlens
from ._ops.checks import PY_NAMES, Rules, without_options
from ._ops.compress_attention import PY_NAMES as CMP_NAMES
from ._ops.compress_attention import compress_attention_rules
from ._ops.fusion import FORWARD_NAMES as FUSION_NAMES
from ._ops.fusion import GRAD_NAMES as FUSION_GRAD_NAMES
from ._ops.fusion import NO_BOUND as _NO_BOUND
from ._ops.fusion import fusion_rules
from ._ops.infer import PY_NAMES as INFER_NAMES
from ._ops.infer import infer_rules
from ._ops.operators import (
    COMPRESS,
    COMPRESS_ATTENTION,
    COMPRESS_GRAD,
    COMPRESS_INFER,
    FUSION_ATTENTION,
    FUSION_ATTENTION_GRAD,
    SELECT,
    SELECT_GRAD,
)
from ._ops.select import PY_NAMES as SELECT_NAMES
from ._ops.select import select_rules

__all__ = ["npu_fusion_attention", "npu_fusion_attention_grad", "npu_nsa_compress",
           "npu_nsa_compress_attention", "npu_nsa_compress_grad",
           "npu_nsa_compress_infer", "npu_nsa_select_attention",
           "npu_nsa_select_attention_grad", "pad_sequence_ends"]

_FORWARD = "npu_nsa_compress"
_GRAD = "npu_nsa_compress_grad"
_INFER = "npu_nsa_compress_infer"
#: the checks of the NumPy API, with torch_npu's function names (its argument names
#: are the NumPy API's) and none of its options (layout, sequence-length type,
#: strict): the messages name only what the torch functions take
_INFER_RULES = infer_rules(_INFER, names=without_options(INFER_NAMES))
_RULES = {op: Rules(op, names=without_options(PY_NAMES)) for op in (_FORWARD, _GRAD)}
_DTYPES = {torch.float16: None, torch.bfloat16: None, torch.float32: None,
           torch.float64: None}
_INT_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))
_bfloat16 = None   # ml_dtypes.bfloat16, imported at the first bfloat16 tensor


def _as_numpy(op, name, t):
    """A NumPy view of CPU tensor ``t`` (no copy)."""
    if not isinstance(t, torch.Tensor):
        raise invalid(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise invalid(op, f"{name} must be on the CPU, got device {t.device}")
    _require_dense(op, name, t)
    dtype = t.dtype
    if dtype not in _DTYPES:
        raise invalid(op, f"{name} dtype must be one of float16, bfloat16, float32, "
                          f"float64, got {dtype}")
    if t.requires_grad:
        t = t.detach()
    if dtype is torch.bfloat16:
        global _bfloat16
        if _bfloat16 is None:
            import ml_dtypes
            _bfloat16 = np.dtype(ml_dtypes.bfloat16)
        return t.view(torch.int16).numpy().view(_bfloat16)
    return t.numpy()


def _as_tensor(a):
    """A tensor over NumPy array ``a`` (no copy)."""
    if a.dtype.kind == "V":           # bfloat16, the one such dtype the operators take
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _seq_values(op, values, tensor):
    """The sequence ends the operators got (a list or array of ``values``, a
    ``tensor``, or neither) as the planner takes them."""
    if tensor is None:
        return values
    if tensor.device.type != "cpu":
        raise invalid(op, f"actual_seq_len must be on the CPU, got device {tensor.device}")
    return tensor.numpy()


# -- the operators -----------------------------------------------------------------
# Both take the sequence ends as a list (``actual_seq_len``) or as a tensor
# (``actual_seq_len_tensor``), never both; the public functions choose.

def _compress_impl(input, weight, block, stride, values, tensor):
    """The forward on tensors: the output as a tensor, on at most
    ``torch.get_num_threads()`` threads."""
    x = _as_numpy(_FORWARD, "input", input)
    w = _as_numpy(_FORWARD, "weight", weight)
    seq = _seq_values(_FORWARD, values, tensor)
    return _as_tensor(_pipeline.call(COMPRESS, _RULES[_FORWARD],
                                     (x, w, block, stride, seq, 0, "TND", None),
                                     threads=torch.get_num_threads()))


def _compress_grad_impl(grad, input, weight, block, stride, values, tensor):
    """The backward on tensors: ``[input_grad, weight_grad]``."""
    g = _as_numpy(_GRAD, "grad", grad)
    x = _as_numpy(_GRAD, "input", input)
    w = _as_numpy(_GRAD, "weight", weight)
    seq = _seq_values(_GRAD, values, tensor)
    outputs = _pipeline.call(COMPRESS_GRAD, _RULES[_GRAD],
                             (g, x, w, block, stride, seq, 0, "TND", None, None),
                             threads=torch.get_num_threads())
    return [_as_tensor(a) for a in outputs]


@torch.library.custom_op("nsa_numba::nsa_compress", mutates_args=())
def _nsa_compress(input: torch.Tensor, weight: torch.Tensor, compress_block_size: int,
                  compress_stride: int, actual_seq_len: Optional[List[int]],
                  actual_seq_len_tensor: Optional[torch.Tensor]) -> torch.Tensor:
    return _compress_impl(input, weight, compress_block_size, compress_stride, actual_seq_len,
                          actual_seq_len_tensor)


def _check_meta(op, *named):
    """The checks a fake tensor allows (dtype, rank), with the real call's messages."""
    for name, t, ndim in named:
        if t.dtype not in _DTYPES:
            raise invalid(op, f"{name} dtype must be one of float16, bfloat16, float32, "
                              f"float64, got {t.dtype}")
        if t.dtype != named[0][1].dtype:
            raise invalid(op, f"{name} dtype must equal input dtype {named[0][1].dtype}, "
                              f"got {t.dtype}")
        if t.dim() != ndim:
            raise invalid(op, f"{name} must be {ndim}-D, got {t.dim()}-D of shape "
                              f"{tuple(t.shape)}")


def _windows(length, block, stride):
    """Windows of a sequence of ``length`` tokens (ints or SymInts)."""
    return torch.sym_max((length - block) // stride + 1, 0)


#: data-dependent row counts already made: id(fake sequence-ends tensor) ->
#: (weak reference to it, {(l, d): size}); by identity, as tensors compare by value
_sizes_of = {}


def _rows_for_tensor(tensor, block, stride, tokens):
    """T' for sequence ends held in a (fake) tensor: a data-dependent size. Later calls
    with the same tensor and window get a new size checked equal to the first one's
    (``torch._check``), so the keys and values of a layer, compressed alike, have
    lengths that later operations can match. (Returning the first size itself
    broke AOTAutograd's renaming of unbacked symbols.)

    The torch functions apply the strict rules, which the real call enforces before it
    returns: at least one window (T' = 0 is refused), and l >= d, so each window
    starts d tokens after the last one of its sequence and T' <= T // d. The size is
    declared with those bounds: without the lower one, inductor cannot lower a
    contraction or a softmax over the keys (it must know ``Max(1, T') == T'``)."""
    key = id(tensor)
    entry = _sizes_of.get(key)
    if entry is None or entry[0]() is not tensor:
        entry = (weakref.ref(tensor, lambda _, key=key: _sizes_of.pop(key, None)), {})
        _sizes_of[key] = entry
    sizes = entry[1]
    rows = torch.library.get_ctx().new_dynamic_size(min=1)
    torch._check(rows <= tokens // stride)
    if (block, stride) in sizes:         # the size of an earlier call: the same value
        torch._check(rows == sizes[block, stride])
    else:
        sizes[block, stride] = rows
    return rows


@_nsa_compress.register_fake
def _nsa_compress_fake(input, weight, compress_block_size, compress_stride, actual_seq_len,
                       actual_seq_len_tensor):
    _check_meta(_FORWARD, ("input", input, 3), ("weight", weight, 2))
    block, stride = compress_block_size, compress_stride
    if actual_seq_len_tensor is not None:
        rows = _rows_for_tensor(actual_seq_len_tensor, block, stride, input.shape[0])
    elif actual_seq_len is not None:           # the exact expression in the ends
        rows, start = 0, 0
        for end in actual_seq_len:
            rows, start = rows + _windows(end - start, block, stride), end
    else:                                      # one sequence: T' follows from T
        rows = _windows(input.shape[0], block, stride)
    return input.new_empty((rows, input.shape[1], input.shape[2]))


@torch.library.custom_op("nsa_numba::nsa_compress_grad", mutates_args=())
def _nsa_compress_grad(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                       compress_block_size: int, compress_stride: int,
                       actual_seq_len: Optional[List[int]],
                       actual_seq_len_tensor: Optional[torch.Tensor]) -> List[torch.Tensor]:
    return _compress_grad_impl(grad, input, weight, compress_block_size, compress_stride,
                               actual_seq_len, actual_seq_len_tensor)


@_nsa_compress_grad.register_fake
def _nsa_compress_grad_fake(grad, input, weight, compress_block_size, compress_stride,
                            actual_seq_len, actual_seq_len_tensor):
    _check_meta(_GRAD, ("input", input, 3), ("weight", weight, 2), ("grad", grad, 3))
    return [torch.empty_like(input, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format)]


# -- autograd ------------------------------------------------------------------------
# The operator is linear in the input and in the weight, and its gradient operator
# is linear in each argument too, so every derivative is again one of the two.
# ``ctx.seq`` is (values, tensor); the tensor, if any, is also a saved tensor.

def _compress_setup(ctx, inputs, output):
    input, weight, block, stride, values, tensor = inputs
    ctx.save_for_backward(input, weight, tensor)
    ctx.window = (block, stride)
    ctx.values = values


def _grad_setup(ctx, inputs, output):
    grad, input, weight, block, stride, values, tensor = inputs
    ctx.save_for_backward(grad, input, weight, tensor)
    ctx.window = (block, stride)
    ctx.values = values


def _compress_backward(ctx, grad):
    input, weight, tensor = ctx.saved_tensors
    need_input, need_weight = ctx.needs_input_grad[:2]
    none = (None,) * 4
    if not (need_input or need_weight):
        return (None, None) + none
    input_grad, weight_grad = _compress_grad(grad, input, weight, *ctx.window, ctx.values,
                                             tensor)
    return (input_grad if need_input else None, weight_grad if need_weight else None) + none


def _grad_backward(ctx, a, b):
    """Derivatives of ``(input_grad, weight_grad)`` with cotangents ``(a, b)``:

    * input_grad = A(weight)^T grad, so ``a`` reaches grad as compress(a, weight)
      and weight as the weight gradient of compress at input ``a``;
    * weight_grad is bilinear in grad and input: ``b`` reaches grad as
      compress(input, b) and input as the input gradient of compress with weight b.
    """
    grad, input, weight, tensor = ctx.saved_tensors
    seq = (*ctx.window, ctx.values, tensor)
    need_grad, need_input, need_weight = ctx.needs_input_grad[:3]
    d_grad = d_input = d_weight = None
    if a is not None:
        if need_grad:
            d_grad = _compress(a, weight, *seq)
        if need_weight:
            d_weight = _compress_grad(grad, a, weight, *seq)[1]
    if b is not None:
        if need_grad:
            term = _compress(input, b, *seq)
            d_grad = term if d_grad is None else d_grad + term
        if need_input:
            d_input = _compress_grad(grad, input, b, *seq)[0]
    return (d_grad, d_input, d_weight) + (None,) * 4


_nsa_compress.register_autograd(_compress_backward, setup_context=_compress_setup)
_nsa_compress_grad.register_autograd(lambda ctx, grads: _grad_backward(ctx, *grads),
                                     setup_context=_grad_setup)


# (forward takes ctx itself: with a separate setup_context, Function.apply binds the
# arguments through inspect.signature on every call, a cost of its own: docs/
# performance.md, "Figures behind the code's choices")
class _CompressFunction(torch.autograd.Function):
    """The eager path of ``nsa_compress``: same implementation and derivatives as
    the registered operator, without the dispatcher's round trip."""

    @staticmethod
    def forward(ctx, input, weight, block, stride, values, tensor):
        _compress_setup(ctx, (input, weight, block, stride, values, tensor), None)
        return _compress_impl(input, weight, block, stride, values, tensor)

    backward = staticmethod(_compress_backward)


class _CompressGradFunction(torch.autograd.Function):
    """The eager path of ``nsa_compress_grad``."""

    @staticmethod
    def forward(ctx, grad, input, weight, block, stride, values, tensor):
        _grad_setup(ctx, (grad, input, weight, block, stride, values, tensor), None)
        return tuple(_compress_grad_impl(grad, input, weight, block, stride, values, tensor))

    backward = staticmethod(_grad_backward)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_dispatch_stack, _function_modes, _transforms = _internals.torch_probes(torch)


def _eager(*tensors):
    """Whether a call may skip the dispatcher: plain tensors, and nothing tracing,
    transforming or intercepting operators (torch.compile, fake tensors, dispatch
    and function modes, vmap...), which all need the registered operator.

    The registered operators' dispatch costs about as much as a call on small
    tensors does, so eager code takes this path (``python -m nsa_numba bench
    --overhead`` measures both; docs/reference.md has the figures).
    """
    if (torch.compiler.is_compiling() or _dispatch_stack is None or _dispatch_stack()
            or _function_modes is None or _function_modes()
            or _transforms is None or _transforms() is not None):
        return False
    return all(t is None or type(t) in _PLAIN_TYPES for t in tensors)


def _op_values(values):
    """Sequence-end values as the registered operators' int list."""
    return values.tolist() if isinstance(values, np.ndarray) else values


def _compress(input, weight, block, stride, values, tensor):
    if _eager(input, weight, tensor):
        return _CompressFunction.apply(input, weight, block, stride, values, tensor)
    return torch.ops.nsa_numba.nsa_compress(input, weight, block, stride, _op_values(values),
                                            tensor)


def _compress_grad(grad, input, weight, block, stride, values, tensor):
    if _eager(grad, input, weight, tensor):
        return _CompressGradFunction.apply(grad, input, weight, block, stride, values, tensor)
    return tuple(torch.ops.nsa_numba.nsa_compress_grad(grad, input, weight, block, stride,
                                                       _op_values(values), tensor))


# -- torch_npu's functions -------------------------------------------------------------

def _check_int(op, name, value):
    """``value`` as an int, or NsaError; a SymInt (under torch.compile) as it is."""
    if isinstance(value, torch.SymInt):
        return value
    return _seqlens.as_int64(op, name, value)


def _seq_arguments(op, actual_seq_len):
    """(values, tensor): ``actual_seq_len`` as the operators take it, NsaError for a
    container or element type they cannot. A tensor stays a tensor (int64); a list or
    tuple becomes an int64 array in eager code and stays a list under torch.compile,
    where its elements may be SymInts (the kernels check the values when they run).
    """
    if actual_seq_len is None:
        return None, None
    if isinstance(actual_seq_len, torch.Tensor):
        if actual_seq_len.dim() != 1:
            raise invalid(op, f"actual_seq_len must be 1-D, got a tensor of shape "
                              f"{tuple(actual_seq_len.shape)}")
        if actual_seq_len.dtype not in _INT_DTYPES:
            raise invalid(op, f"actual_seq_len must hold integers, got dtype "
                              f"{actual_seq_len.dtype}")
        return None, actual_seq_len.to(torch.int64)
    if torch.compiler.is_compiling() and isinstance(actual_seq_len, (list, tuple)):
        for i, v in enumerate(actual_seq_len):
            if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
                raise invalid(op, f"actual_seq_len[{i}] must be an integer, got {v!r} "
                                  f"({type(v).__name__})")
        return list(actual_seq_len), None
    return _seqlens.as_int_vector(op, "actual_seq_len", actual_seq_len), None


def _real(op, name, value):
    """``value`` as a float, or NsaError; under torch.compile (where it may be a symbolic
    float) only its type is checked here, its value by the operator when it runs."""
    if torch.compiler.is_compiling():
        if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymFloat)):
            raise invalid(op, f"{name} must be a real number, got {value!r} "
                              f"({type(value).__name__})")
        return value
    return _seqlens.as_real(op, name, value)


def _require_tensors(op, **named):
    """NsaError for an argument that is not a tensor (a NumPy array, a list...): the
    torch functions take tensors, the NumPy API (``nsa_numba.nsa_compress``...) arrays;
    and for tensors that are not dense, or not all on one device (meta tensors with
    CPU ones would otherwise get meta results and no checks at all)."""
    device = None
    for name, value in named.items():
        if value is None:
            raise missing(op, name)
        if not isinstance(value, torch.Tensor):
            hint = (" (NumPy arrays go to nsa_numba.nsa_compress and its siblings)"
                    if isinstance(value, np.ndarray) else "")
            raise invalid(op, f"{name} must be a torch.Tensor, got "
                              f"{type(value).__module__}.{type(value).__name__}{hint}")
        _require_dense(op, name, value)
        if device is None:
            device, first = value.device, name
        elif value.device != device:
            raise invalid(op, f"{name} is on device {value.device} and {first} on {device}; "
                              f"the tensors of a call must be on one device")


def _require_dense(op, name, t):
    """NsaError for a sparse, quantized or other tensor that has no strided memory."""
    if t.layout is not torch.strided:
        raise invalid(op, f"{name} must be a dense (strided) tensor, got layout {t.layout} "
                          f"(call .to_dense() first)")


def _autocast(*tensors):
    """The floating tensors cast to the CPU autocast dtype inside ``torch.autocast``
    ("cpu"), as PyTorch's matmul-class operators cast theirs: every floating dtype but
    float64; the tensors as they are outside it."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t.dtype in _AUTOCAST_FROM and t.dtype != dtype else t
                 for t in tensors)


_AUTOCAST_FROM = (torch.float16, torch.bfloat16, torch.float32)


def npu_nsa_compress(input, weight, compress_block_size, compress_stride, *,
                     actual_seq_len=None):
    """torch_npu.npu_nsa_compress on the CPU: ``[T', N, D]``, differentiable.

    ``actual_seq_len``: cumulative sequence ends (list, tuple, 1-D integer array or
    tensor), or None for one sequence. Inside ``torch.autocast("cpu")`` the input and
    weight are cast to the autocast dtype first (float64 ones are not).
    """
    op = _FORWARD
    _require_tensors(op, input=input, weight=weight)
    input, weight = _autocast(input, weight)
    return _compress(input, weight, _check_int(op, "compress_block_size", compress_block_size),
                     _check_int(op, "compress_stride", compress_stride),
                     *_seq_arguments(op, actual_seq_len))


def npu_nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride, *,
                          actual_seq_len=None):
    """torch_npu.npu_nsa_compress_grad on the CPU: ``(input_grad, weight_grad)``,
    itself differentiable (second derivatives). Cast under autocast as
    ``npu_nsa_compress`` is."""
    op = _GRAD
    _require_tensors(op, grad=grad, input=input, weight=weight)
    grad, input, weight = _autocast(grad, input, weight)
    input_grad, weight_grad = _compress_grad(
        grad, input, weight, _check_int(op, "compress_block_size", compress_block_size),
        _check_int(op, "compress_stride", compress_stride), *_seq_arguments(op, actual_seq_len))
    return input_grad, weight_grad


# -- the with-cache (decoding) operator ------------------------------------------------

def _index_numpy(op, name, t):
    """A CPU integer tensor as a NumPy array (no copy), or None."""
    if t is None:
        return None
    if not t.is_cpu:
        raise invalid(op, f"{name} must be on the CPU, got device {t.device}")
    _require_dense(op, name, t)
    if t.dtype not in _INT_DTYPES:
        raise invalid(op, f"{name} must hold integers, got dtype {t.dtype}")
    return t.numpy()


@torch.library.custom_op("nsa_numba::nsa_compress_infer", mutates_args=("cache",))
def _nsa_compress_infer(input: torch.Tensor, weight: torch.Tensor, slot_mapping: torch.Tensor,
                        compress_block_size: int, compress_stride: int, page_block_size: int,
                        block_table: Optional[torch.Tensor], actual_seq_len: torch.Tensor,
                        cache: torch.Tensor) -> None:
    _compress_infer_impl(input, weight, slot_mapping, compress_block_size, compress_stride,
                         page_block_size, block_table, actual_seq_len, cache)


def _compress_infer_impl(input, weight, slot_mapping, block, stride, page, block_table,
                         actual_seq_len, cache):
    """The decoding step on tensors (index arguments as tensors, or lists for the
    planner to check), on at most ``torch.get_num_threads()`` threads."""
    op = _INFER
    _pipeline.call(COMPRESS_INFER, _INFER_RULES,
                   (_as_numpy(op, "input", input), _as_numpy(op, "weight", weight),
                    _index_value(op, "slot_mapping", slot_mapping), block, stride, page,
                    _index_value(op, "block_table", block_table),
                    _index_value(op, "actual_seq_len", actual_seq_len), 1, "TND",
                    _as_numpy(op, "cache", cache)),
                   threads=torch.get_num_threads())


@_nsa_compress_infer.register_fake
def _nsa_compress_infer_fake(input, weight, slot_mapping, compress_block_size, compress_stride,
                             page_block_size, block_table, actual_seq_len, cache):
    _check_meta(_INFER, ("input", input, input.dim()), ("weight", weight, 2),
                ("cache", cache, 3))


def _index_tensor(op, name, values, ndim=1):
    """An integer tensor as it is; a list, tuple or integer array as an int64 tensor
    (NsaError for anything that is not integers)."""
    if isinstance(values, torch.Tensor):
        return values
    if torch.compiler.is_compiling() and isinstance(values, (list, tuple)):
        return torch.tensor(values, dtype=torch.int64)
    if ndim == 1:
        return torch.from_numpy(_seqlens.as_int_vector(op, name, values))
    values = np.asarray(values)
    if values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.integer):
        raise invalid(op, f"{name} must hold integers, got dtype {values.dtype}")
    return torch.from_numpy(values.astype(np.int64))


def npu_nsa_compress_infer(input, weight, slot_mapping, compress_block_size, compress_stride,
                           page_block_size, *, block_table=None, actual_seq_len=None,
                           cache=None):
    """torch_npu.npu_nsa_compress_infer on the CPU: one decoding step of the
    compressed-KV cache, updated in place and returned (see
    ``nsa_numba.nsa_compress_infer`` for the semantics and rules).

    ``input``: paged ``[block_num, page_block_size, N, D]`` with ``block_table``
    ``[B, blocks_per_seq]``, or packed ``[T, N, D]`` without; ``slot_mapping`` and
    ``actual_seq_len`` (per-sequence lengths): ``[B]`` integer tensors (or lists);
    ``cache``: ``[rows, N, D]``, required. Registered as
    ``torch.ops.nsa_numba.nsa_compress_infer``, which declares ``cache`` mutated, so
    it works under ``torch.compile``.
    """
    op = _INFER
    plain = _PLAIN_TYPES
    if (type(input) in plain and type(weight) in plain and type(cache) in plain
            and type(slot_mapping) in _EAGER_INDEX and type(block_table) in _EAGER_INDEX
            and type(actual_seq_len) in _EAGER_INDEX and _eager()):
        # eager code skips the dispatcher's round trip, which cost a decoding step
        # several times the NumPy call's own Python work (bench --overhead); lists and
        # integer tensors go to the planner as they are (it checks them, None included)
        _compress_infer_impl(input, weight, slot_mapping, compress_block_size,
                             compress_stride, page_block_size, block_table, actual_seq_len,
                             cache)
        _increment_version(cache)     # written in place, as the registered op declares
        return cache
    for name, value in (("input", input), ("weight", weight), ("slot_mapping", slot_mapping),
                        ("actual_seq_len", actual_seq_len), ("cache", cache)):
        if value is None:
            raise missing(op, name)
    _require_tensors(op, input=input, weight=weight, cache=cache)
    torch.ops.nsa_numba.nsa_compress_infer(
        input, weight, _index_tensor(op, "slot_mapping", slot_mapping),
        _check_int(op, "compress_block_size", compress_block_size),
        _check_int(op, "compress_stride", compress_stride),
        _check_int(op, "page_block_size", page_block_size),
        None if block_table is None else _index_tensor(op, "block_table", block_table, 2),
        _index_tensor(op, "actual_seq_len", actual_seq_len), cache)
    return cache


#: what the eager decoding path takes as an index argument: plain tensors, and what the
#: planner checks itself (lists, tuples, NumPy arrays, None)
_EAGER_INDEX = frozenset((torch.Tensor, torch.nn.Parameter, list, tuple, np.ndarray,
                          type(None)))


def _index_value(op, name, value):
    """An index argument of the eager decoding path: a CPU integer tensor as a NumPy
    array (no copy); anything else as it is, for the planner to check."""
    if type(value) is torch.Tensor:
        return _index_numpy(op, name, value)
    return value


def pad_sequence_ends(actual_seq_len, count):
    """Cumulative sequence ends (a list or tuple of ints) padded to ``count`` values
    with empty trailing sequences (the last end repeated), as a list.

    Under ``torch.compile`` a list of sequence ends is a Python list, whose length
    Dynamo specialises on: every new number of sequences compiles a new graph. Padding
    every batch's ends to one count (the most sequences a batch can hold) makes the
    length constant; the empty sequences have no windows and change no result. A
    tensor of ends needs no padding (its values never reach a guard).
    """
    ends = list(actual_seq_len)
    if type(count) is not int or count < 1:
        raise invalid("pad_sequence_ends", f"count must be an int >= 1, got {count!r}")
    if len(ends) > count:
        raise invalid("pad_sequence_ends", f"actual_seq_len holds {len(ends)} sequence "
                                           f"ends, more than count = {count}")
    if not ends:
        raise invalid("pad_sequence_ends", "actual_seq_len must hold at least one end")
    return ends + [ends[-1]] * (count - len(ends))


# -- selected attention ----------------------------------------------------------------

_SELECT = "npu_nsa_select_attention"
_SELECT_GRAD = "npu_nsa_select_attention_grad"
_SELECT_RULES = {op: select_rules(op, names=without_options(SELECT_NAMES))
                 for op in (_SELECT, _SELECT_GRAD)}


def _indices_numpy(op, name, t):
    """An integer CPU tensor as a NumPy array (no copy)."""
    if not isinstance(t, torch.Tensor):
        raise invalid(op, f"{name} must be a torch.Tensor of integers, got "
                          f"{type(t).__name__}")
    return _index_numpy(op, name, t)


def _select_impl(query, key, value, topk_indices, scale, head_num, block, count, causal,
                 seq_q, seq_kv):
    op = _SELECT
    results = _pipeline.call(
        SELECT, _SELECT_RULES[op],
        (_as_numpy(op, "query", query), _as_numpy(op, "key", key),
         _as_numpy(op, "value", value), _indices_numpy(op, "topk_indices", topk_indices),
         scale, head_num, block, count, _CAUSAL if causal else None, seq_q, seq_kv, None, None,
         None), threads=torch.get_num_threads())
    return tuple(_as_tensor(a) for a in results)


def _select_grad_impl(grad, query, key, value, attention_out, softmax_max, softmax_sum,
                      topk_indices, scale, head_num, block, count, causal, seq_q, seq_kv):
    op = _SELECT_GRAD
    named = (("grad", grad), ("query", query), ("key", key), ("value", value),
             ("attention_out", attention_out), ("softmax_max", softmax_max),
             ("softmax_sum", softmax_sum))
    arrays = [_as_numpy(op, name, t) for name, t in named]
    results = _pipeline.call(
        SELECT_GRAD, _SELECT_RULES[op],
        (*arrays, _indices_numpy(op, "topk_indices", topk_indices), scale, head_num, block,
         count, _CAUSAL if causal else None, seq_q, seq_kv, None, None, None),
        threads=torch.get_num_threads())
    return tuple(_as_tensor(a) for a in results)


#: what the operators pass as the mask: only whether one is given matters
_CAUSAL = np.ones(1, np.bool_)


@torch.library.custom_op("nsa_numba::nsa_select_attention", mutates_args=())
def _nsa_select_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          topk_indices: torch.Tensor, scale_value: float, head_num: int,
                          select_block_size: int, select_block_count: int, causal: bool,
                          actual_seq_qlen: Optional[List[int]],
                          actual_seq_kvlen: Optional[List[int]]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _select_impl(query, key, value, topk_indices, scale_value, head_num,
                        select_block_size, select_block_count, causal, actual_seq_qlen,
                        actual_seq_kvlen)


def _stat_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@_nsa_select_attention.register_fake
def _nsa_select_attention_fake(query, key, value, topk_indices, scale_value, head_num,
                               select_block_size, select_block_count, causal,
                               actual_seq_qlen, actual_seq_kvlen):
    _check_meta(_SELECT, ("query", query, 3), ("key", key, 3), ("value", value, 3))
    T1, N1 = query.shape[0], query.shape[1]
    stats = query.new_empty((T1, N1, 8), dtype=_stat_dtype(query))
    return (query.new_empty((T1, N1, value.shape[2])), stats, torch.empty_like(stats))


@torch.library.custom_op("nsa_numba::nsa_select_attention_grad", mutates_args=())
def _nsa_select_attention_grad(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_out: torch.Tensor,
                               softmax_max: torch.Tensor, softmax_sum: torch.Tensor,
                               topk_indices: torch.Tensor, scale_value: float, head_num: int,
                               select_block_size: int, select_block_count: int, causal: bool,
                               actual_seq_qlen: Optional[List[int]],
                               actual_seq_kvlen: Optional[List[int]]
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _select_grad_impl(grad, query, key, value, attention_out, softmax_max, softmax_sum,
                             topk_indices, scale_value, head_num, select_block_size,
                             select_block_count, causal, actual_seq_qlen, actual_seq_kvlen)


@_nsa_select_attention_grad.register_fake
def _nsa_select_attention_grad_fake(grad, query, key, value, attention_out, softmax_max,
                                    softmax_sum, topk_indices, scale_value, head_num,
                                    select_block_size, select_block_count, causal,
                                    actual_seq_qlen, actual_seq_kvlen):
    _check_meta(_SELECT_GRAD, ("query", query, 3), ("key", key, 3), ("value", value, 3),
                ("grad", grad, 3))
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (query, key, value))


def _select_setup(ctx, inputs, output):
    query, key, value, topk, scale, head_num, block, count, causal, seq_q, seq_kv = inputs
    out, smax, ssum = output
    ctx.save_for_backward(query, key, value, topk, out, smax, ssum)
    ctx.options = (scale, head_num, block, count, causal, seq_q, seq_kv)
    ctx.mark_non_differentiable(smax, ssum)


def _select_backward(ctx, grad, _max_grad, _sum_grad):
    query, key, value, topk, out, smax, ssum = ctx.saved_tensors
    if grad is None or not any(ctx.needs_input_grad[:3]):
        return (None,) * 11
    dq, dk, dv = torch.ops.nsa_numba.nsa_select_attention_grad(
        grad, query, key, value, out, smax, ssum, topk, *ctx.options)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None,
            dv if need[2] else None) + (None,) * 8


_nsa_select_attention.register_autograd(_select_backward, setup_context=_select_setup)


def _seq_list(op, name, values):
    """Prefix sums as the operators' int list: a list or tuple (SymInts allowed under
    torch.compile), a 1-D integer array or tensor, or None."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype not in _INT_DTYPES:
            raise invalid(op, f"{name} must be a 1-D integer tensor or a list, got a tensor "
                              f"of shape {tuple(values.shape)} and dtype {values.dtype}")
        return values.tolist()
    if torch.compiler.is_compiling() and isinstance(values, (list, tuple)):
        return list(values)
    return _seqlens.as_int_vector(op, name, values).tolist()


def _select_arguments(op, tensors, topk_indices, scale_value, head_num, block, count,
                      atten_mask, actual_seq_qlen, actual_seq_kvlen):
    _require_tensors(op, **tensors, topk_indices=topk_indices)
    if atten_mask is not None and not isinstance(atten_mask, torch.Tensor):
        raise invalid(op, f"atten_mask must be None or a tensor (only whether it is given "
                          f"matters), got {type(atten_mask).__name__}")
    return (topk_indices, _real(op, "scale_value", scale_value),
            _check_int(op, "head_num", head_num),
            _check_int(op, "select_block_size", block),
            _check_int(op, "select_block_count", count), atten_mask is not None,
            _seq_list(op, "actual_seq_qlen", actual_seq_qlen),
            _seq_list(op, "actual_seq_kvlen", actual_seq_kvlen))


def npu_nsa_select_attention(query, key, value, topk_indices, scale_value, head_num,
                             select_block_size, select_block_count, *, atten_mask=None,
                             actual_seq_qlen=None, actual_seq_kvlen=None):
    """torch_npu.npu_nsa_select_attention on the CPU: ``(attention_out, softmax_max,
    softmax_sum)``; differentiable in query, key and value (see
    ``nsa_numba.nsa_select_attention`` for the semantics and the rules, which are the
    strict ones here). ``topk_indices``: an integer tensor ``[T1, N2, c]``;
    ``atten_mask``: any tensor makes the call causal (contents not read);
    ``actual_seq_qlen`` / ``actual_seq_kvlen``: prefix sums (lists, tuples or 1-D
    integer tensors). Registered as ``torch.ops.nsa_numba.nsa_select_attention``. Cast
    under autocast as ``npu_nsa_compress`` is."""
    op = _SELECT
    tensors = dict(query=query, key=key, value=value)
    options = _select_arguments(op, tensors, topk_indices, scale_value, head_num,
                                select_block_size, select_block_count, atten_mask,
                                actual_seq_qlen, actual_seq_kvlen)
    query, key, value = _autocast(query, key, value)
    return tuple(torch.ops.nsa_numba.nsa_select_attention(query, key, value, *options))


def npu_nsa_select_attention_grad(grad, query, key, value, attention_out, softmax_max,
                                  softmax_sum, topk_indices, scale_value, head_num,
                                  select_block_size, select_block_count, *, atten_mask=None,
                                  actual_seq_qlen=None, actual_seq_kvlen=None):
    """torch_npu.npu_nsa_select_attention_grad on the CPU: ``(dq, dk, dv)``, the same bits
    as autograd's gradients of ``npu_nsa_select_attention``."""
    op = _SELECT_GRAD
    tensors = dict(grad=grad, query=query, key=key, value=value, attention_out=attention_out,
                   softmax_max=softmax_max, softmax_sum=softmax_sum)
    options = _select_arguments(op, tensors, topk_indices, scale_value, head_num,
                                select_block_size, select_block_count, atten_mask,
                                actual_seq_qlen, actual_seq_kvlen)
    grad, query, key, value, attention_out = _autocast(grad, query, key, value, attention_out)
    return tuple(torch.ops.nsa_numba.nsa_select_attention_grad(
        grad, query, key, value, attention_out, softmax_max, softmax_sum, *options))


# -- compressed attention ----------------------------------------------------------------

_CMP = "npu_nsa_compress_attention"
_CMP_RULES = {_CMP: compress_attention_rules(_CMP, names=without_options(CMP_NAMES))}


def _mask_numpy(op, name, t):
    """A bool or uint8 CPU tensor as a NumPy array (no copy), or None."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise invalid(op, f"{name} must be None or a bool or uint8 torch.Tensor, got "
                          f"{type(t).__name__}")
    if not t.is_cpu:
        raise invalid(op, f"{name} must be on the CPU, got device {t.device}")
    _require_dense(op, name, t)
    if t.dtype not in (torch.bool, torch.uint8):
        raise invalid(op, f"{name} dtype must be bool or uint8, got {t.dtype}")
    return t.numpy()


@torch.library.custom_op("nsa_numba::nsa_compress_attention", mutates_args=())
def _nsa_compress_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            scale_value: float, head_num: int, compress_block_size: int,
                            compress_stride: int, select_block_size: int,
                            select_block_count: int, topk_mask: Optional[torch.Tensor],
                            atten_mask: Optional[torch.Tensor],
                            actual_seq_qlen: Optional[List[int]],
                            actual_cmp_seq_kvlen: Optional[List[int]],
                            actual_sel_seq_kvlen: Optional[List[int]]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    op = _CMP
    results = _pipeline.call(
        COMPRESS_ATTENTION, _CMP_RULES[op],
        (_as_numpy(op, "query", query), _as_numpy(op, "key", key),
         _as_numpy(op, "value", value), scale_value, head_num, compress_block_size,
         compress_stride, select_block_size, select_block_count,
         _mask_numpy(op, "topk_mask", topk_mask), _mask_numpy(op, "atten_mask", atten_mask),
         actual_seq_qlen, actual_cmp_seq_kvlen, actual_sel_seq_kvlen, None, None, None, None),
        threads=torch.get_num_threads())
    return tuple(_as_tensor(a) for a in results)


@_nsa_compress_attention.register_fake
def _nsa_compress_attention_fake(query, key, value, scale_value, head_num, compress_block_size,
                                 compress_stride, select_block_size, select_block_count,
                                 topk_mask, atten_mask, actual_seq_qlen, actual_cmp_seq_kvlen,
                                 actual_sel_seq_kvlen):
    _check_meta(_CMP, ("query", query, 3), ("key", key, 3), ("value", value, 3))
    T1, N1 = query.shape[0], query.shape[1]
    stats = query.new_empty((T1, N1, 8), dtype=_stat_dtype(query))
    topk = query.new_empty((T1, key.shape[1], select_block_count), dtype=torch.int32)
    return (query.new_empty((T1, N1, value.shape[2])), topk, stats, torch.empty_like(stats))


def _cmp_setup(ctx, inputs, output):
    (query, key, value, scale, head_num, _, _, _, _, _, atten_mask, seq_q, seq_kv,
     _) = inputs
    out, topk, smax, ssum = output
    ctx.save_for_backward(query, key, value, atten_mask, out, smax, ssum)
    ctx.options = (scale, head_num)
    ctx.lengths = (seq_q, seq_kv)
    ctx.mark_non_differentiable(topk, smax, ssum)


def _cmp_backward(ctx, grad, _topk_grad, _max_grad, _sum_grad):
    query, key, value, atten_mask, out, smax, ssum = ctx.saved_tensors
    if grad is None or not any(ctx.needs_input_grad[:3]):
        return (None,) * 14
    scale, head_num = ctx.options
    seq_q, seq_kv = ctx.lengths
    if seq_q is None:                   # one sequence: the lists TND requires
        seq_q, seq_kv = [query.shape[0]], [key.shape[0]]
    if atten_mask is not None:          # the mask's [max Sq, max Tc] corner, as torch_npu passes
        atten_mask = atten_mask[:_longest(seq_q), :_longest(seq_kv)]
    # torch_npu's backward of compressed attention: its generic attention gradient, mode 1
    dq, dk, dv = torch.ops.nsa_numba.fusion_attention_grad(
        query, key, value, grad, head_num, "TND", atten_mask, smax, ssum, out, scale, 1.0,
        _NO_BOUND, _NO_BOUND, 0, seq_q, seq_kv, 1)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None,
            dv if need[2] else None) + (None,) * 11


_nsa_compress_attention.register_autograd(_cmp_backward, setup_context=_cmp_setup)


def npu_nsa_compress_attention(query, key, value, scale_value, head_num, compress_block_size,
                               compress_stride, select_block_size, select_block_count, *,
                               topk_mask=None, atten_mask=None, actual_seq_qlen=None,
                               actual_cmp_seq_kvlen=None, actual_sel_seq_kvlen=None):
    """torch_npu.npu_nsa_compress_attention on the CPU: ``(attention_out, topk_indices,
    softmax_max, softmax_sum)``; differentiable in query, key and value (the indices and
    the statistics are not), through ``torch.ops.nsa_numba.fusion_attention_grad``
    (sparse mode 1, as torch_npu's backward).
    See ``nsa_numba.nsa_compress_attention`` for the semantics and the rules, which are
    the strict ones here. ``atten_mask``, ``topk_mask``: bool or uint8 tensors (1 =
    masked, 1 = forced); the three length lists: prefix sums (lists, tuples or 1-D
    integer tensors), all or none. Registered as
    ``torch.ops.nsa_numba.nsa_compress_attention``. Cast under autocast as
    ``npu_nsa_compress`` is."""
    op = _CMP
    _require_tensors(op, query=query, key=key, value=value)
    for name, mask in (("topk_mask", topk_mask), ("atten_mask", atten_mask)):
        if mask is not None:
            _mask_numpy(op, name, mask)
    scale_value = _real(op, "scale_value", scale_value)
    ints = [_check_int(op, name, v) for name, v in (
        ("head_num", head_num), ("compress_block_size", compress_block_size),
        ("compress_stride", compress_stride), ("select_block_size", select_block_size),
        ("select_block_count", select_block_count))]
    lengths = [_seq_list(op, name, v) for name, v in (
        ("actual_seq_qlen", actual_seq_qlen), ("actual_cmp_seq_kvlen", actual_cmp_seq_kvlen),
        ("actual_sel_seq_kvlen", actual_sel_seq_kvlen))]
    query, key, value = _autocast(query, key, value)
    return tuple(torch.ops.nsa_numba.nsa_compress_attention(
        query, key, value, scale_value, *ints, topk_mask, atten_mask, *lengths))


def _longest(ends):
    """The longest sequence of prefix sums ``ends`` (ints or SymInts)."""
    longest, previous = ends[0], ends[0]
    for end in ends[1:]:
        longest = torch.sym_max(longest, end - previous)
        previous = end
    return longest


# -- the generic attention (npu_fusion_attention) -----------------------------------------

_FUSION = "npu_fusion_attention"
_FUSION_GRAD = "npu_fusion_attention_grad"
_FUSION_RULES = {op: fusion_rules(op, grad=grad, names={
    k: v for k, v in (FUSION_GRAD_NAMES if grad else FUSION_NAMES).items() if k != "strict"})
    for op, grad in ((_FUSION, False), (_FUSION_GRAD, True))}


@torch.library.custom_op("nsa_numba::fusion_attention", mutates_args=())
def _fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      head_num: int, input_layout: str, atten_mask: Optional[torch.Tensor],
                      scale: float, keep_prob: float, pre_tockens: int, next_tockens: int,
                      inner_precise: int, actual_seq_qlen: Optional[List[int]],
                      actual_seq_kvlen: Optional[List[int]], sparse_mode: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = _FUSION
    results = _pipeline.call(
        FUSION_ATTENTION, _FUSION_RULES[op],
        (_as_numpy(op, "query", query), _as_numpy(op, "key", key),
         _as_numpy(op, "value", value), head_num, input_layout, None, None,
         _mask_numpy(op, "atten_mask", atten_mask), scale, keep_prob, pre_tockens,
         next_tockens, inner_precise, None, actual_seq_qlen, actual_seq_kvlen, sparse_mode, "",
         None, None, None), threads=torch.get_num_threads())
    return tuple(_as_tensor(a) for a in results[:3])


def _fusion_shapes(query, key, value, head_num, layout):
    """The output's and the statistics' shapes (ints or SymInts) of ``layout``."""
    layout = layout.upper()
    if layout == "TND":
        return (query.shape[0], head_num, value.shape[2]), (query.shape[0], head_num, 8)
    if layout in ("BSND", "BNSD"):
        B, Dv = query.shape[0], value.shape[3]
        Sq = query.shape[1] if layout == "BSND" else query.shape[2]
        out = (B, Sq, head_num, Dv) if layout == "BSND" else (B, head_num, Sq, Dv)
        return out, (B, head_num, Sq, 8)
    D = query.shape[2] // head_num
    N2 = key.shape[2] // D
    Dv = value.shape[2] // N2
    B, Sq = (query.shape[0], query.shape[1]) if layout == "BSH" else (query.shape[1],
                                                                       query.shape[0])
    out = (B, Sq, head_num * Dv) if layout == "BSH" else (Sq, B, head_num * Dv)
    return out, (B, head_num, Sq, 8)


def _fusion_dims(query):
    return 4 if query.dim() == 4 else 3


@_fusion_attention.register_fake
def _fusion_attention_fake(query, key, value, head_num, input_layout, atten_mask, scale,
                           keep_prob, pre_tockens, next_tockens, inner_precise,
                           actual_seq_qlen, actual_seq_kvlen, sparse_mode):
    n = _fusion_dims(query)
    _check_meta(_FUSION, ("query", query, n), ("key", key, n), ("value", value, n))
    out, stats = _fusion_shapes(query, key, value, head_num, input_layout)
    stat = query.new_empty(stats, dtype=_stat_dtype(query))
    return query.new_empty(out), stat, torch.empty_like(stat)


@torch.library.custom_op("nsa_numba::fusion_attention_grad", mutates_args=())
def _fusion_attention_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           dy: torch.Tensor, head_num: int, input_layout: str,
                           atten_mask: Optional[torch.Tensor], softmax_max: torch.Tensor,
                           softmax_sum: torch.Tensor, attention_in: torch.Tensor,
                           scale_value: float, keep_prob: float, pre_tockens: int,
                           next_tockens: int, inner_precise: int,
                           actual_seq_qlen: Optional[List[int]],
                           actual_seq_kvlen: Optional[List[int]], sparse_mode: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = _FUSION_GRAD
    arrays = [_as_numpy(op, name, t) for name, t in (
        ("query", query), ("key", key), ("value", value), ("dy", dy))]
    saved = [_as_numpy(op, name, t) for name, t in (
        ("softmax_max", softmax_max), ("softmax_sum", softmax_sum),
        ("attention_in", attention_in))]
    results = _pipeline.call(
        FUSION_ATTENTION_GRAD, _FUSION_RULES[op],
        (*arrays, head_num, input_layout, None, None,
         _mask_numpy(op, "atten_mask", atten_mask), *saved, scale_value, keep_prob,
         pre_tockens, next_tockens, inner_precise, None, actual_seq_qlen, actual_seq_kvlen,
         sparse_mode, "", None, None, None), threads=torch.get_num_threads())
    return tuple(_as_tensor(a) for a in results[:3])


@_fusion_attention_grad.register_fake
def _fusion_attention_grad_fake(query, key, value, dy, head_num, input_layout, atten_mask,
                                softmax_max, softmax_sum, attention_in, scale_value,
                                keep_prob, pre_tockens, next_tockens, inner_precise,
                                actual_seq_qlen, actual_seq_kvlen, sparse_mode):
    n = _fusion_dims(query)
    _check_meta(_FUSION_GRAD, ("query", query, n), ("key", key, n), ("value", value, n),
                ("dy", dy, n))
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (query, key, value))


def _fusion_setup(ctx, inputs, output):
    query, key, value, head_num, layout, atten_mask, scale, *options = inputs
    out, smax, ssum = output
    ctx.save_for_backward(query, key, value, atten_mask, out, smax, ssum)
    ctx.options = (head_num, layout, scale, *options)
    ctx.mark_non_differentiable(smax, ssum)


def _fusion_backward(ctx, grad, _max_grad, _sum_grad):
    query, key, value, atten_mask, out, smax, ssum = ctx.saved_tensors
    if grad is None or not any(ctx.needs_input_grad[:3]):
        return (None,) * 14
    head_num, layout, scale, *options = ctx.options
    dq, dk, dv = torch.ops.nsa_numba.fusion_attention_grad(
        query, key, value, grad, head_num, layout, atten_mask, smax, ssum, out, scale,
        *options)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None,
            dv if need[2] else None) + (None,) * 11


_fusion_attention.register_autograd(_fusion_backward, setup_context=_fusion_setup)


def _fusion_arguments(op, tensors, head_num, input_layout, pse, padding_mask, atten_mask,
                      scale, keep_prob, pre_tockens, next_tockens, inner_precise, prefix,
                      actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout,
                      scale_name):
    """The custom op's arguments after ``tensors``, checked as far as the types go (the
    planner checks the rest), and NotImplementedError for what is not computed."""
    _require_tensors(op, **tensors)
    if atten_mask is not None:
        _mask_numpy(op, "atten_mask", atten_mask)
    for name, value in (("pse", pse), ("padding_mask", padding_mask), ("prefix", prefix)):
        if value is not None:
            raise NotImplementedError(f"{op}: {name} is not supported (it must be None)")
    scale, keep_prob = (_real(op, name, value) for name, value in (
        (scale_name, scale), ("keep_prob", keep_prob)))
    if 0 < keep_prob < 1:
        raise NotImplementedError(f"{op}: keep_prob < 1 (dropout) is not supported, got "
                                  f"{keep_prob}")
    if softmax_layout not in ("", "TND"):
        raise NotImplementedError(f"{op}: softmax_layout must be '' or 'TND' (both write the "
                                  f"statistics token-major), got {softmax_layout!r}")
    if not isinstance(input_layout, str):
        raise invalid(op, f"input_layout must be a str, got {input_layout!r}")
    ints = [_check_int(op, name, v) for name, v in (
        ("pre_tockens", pre_tockens), ("next_tockens", next_tockens),
        ("inner_precise", inner_precise))]
    seqs = [_seq_list(op, name, v) for name, v in (("actual_seq_qlen", actual_seq_qlen),
                                                    ("actual_seq_kvlen", actual_seq_kvlen))]
    return (_check_int(op, "head_num", head_num), input_layout, atten_mask, scale,
            keep_prob, *ints, *seqs, _check_int(op, "sparse_mode", sparse_mode))


def _numels(query, key, head_num, layout, seq_q, seq_kv):
    """``N1 * sum_b Sq_b * Skv_b``, what torch_npu returns as ``numels``."""
    if layout.upper() == "TND":
        total, pq, pk = 0, 0, 0
        for eq, ek in zip(seq_q or [], seq_kv or []):
            total, pq, pk = total + (eq - pq) * (ek - pk), eq, ek
        return head_num * total
    s = {"BSND": (0, 1, 1), "BNSD": (0, 2, 2), "BSH": (0, 1, 1), "SBH": (1, 0, 0)}.get(
        layout.upper())
    if s is None:
        return 0
    return query.shape[s[0]] * head_num * query.shape[s[1]] * key.shape[s[2]]


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None,
                         padding_mask=None, atten_mask=None, scale=1., keep_prob=1.,
                         pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                         sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout=""):
    """torch_npu.npu_fusion_attention on the CPU, sparse modes 0 to 4: ``(attention_out,
    softmax_max, softmax_sum, softmax_out, seed, offset, numels)``, differentiable in
    query, key and value through ``torch.ops.nsa_numba.fusion_attention_grad``. See
    ``nsa_numba.fusion_attention`` for the semantics and the rules (the strict ones
    here). ``atten_mask``: a bool or uint8 tensor (1 = masked); the lengths: prefix
    sums (lists, tuples or 1-D integer tensors). ``softmax_out`` is empty, seed and
    offset 0 (no dropout). Cast under autocast as ``npu_nsa_compress`` is."""
    op = _FUSION
    options = _fusion_arguments(op, dict(query=query, key=key, value=value), head_num,
                                input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
                                pre_tockens, next_tockens, inner_precise, prefix,
                                actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout,
                                "scale")
    query, key, value = _autocast(query, key, value)
    out, smax, ssum = torch.ops.nsa_numba.fusion_attention(query, key, value, *options)
    numels = _numels(query, key, options[0], input_layout, options[8], options[9])
    return out, smax, ssum, query.new_empty(0), 0, 0, numels


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None,
                              padding_mask=None, atten_mask=None, softmax_max=None,
                              softmax_sum=None, softmax_in=None, attention_in=None,
                              scale_value=1., keep_prob=1., pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0,
                              numels=0, prefix=None, actual_seq_qlen=None,
                              actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout=""):
    """torch_npu.npu_fusion_attention_grad on the CPU: ``(dq, dk, dv, None)`` (no pse, so
    no dpse), the same bits as autograd's gradients of ``npu_fusion_attention``.
    ``softmax_in``, ``seed``, ``offset``, ``numels`` are not read."""
    op = _FUSION_GRAD
    tensors = dict(query=query, key=key, value=value, dy=dy, softmax_max=softmax_max,
                   softmax_sum=softmax_sum, attention_in=attention_in)
    options = _fusion_arguments(op, tensors, head_num, input_layout, pse, padding_mask,
                                atten_mask, scale_value, keep_prob, pre_tockens, next_tockens,
                                inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
                                sparse_mode, softmax_layout, "scale_value")
    query, key, value, dy, attention_in = _autocast(query, key, value, dy, attention_in)
    head_num, layout, mask, scale, *rest = options
    return (*torch.ops.nsa_numba.fusion_attention_grad(
        query, key, value, dy, head_num, layout, mask, softmax_max, softmax_sum, attention_in,
        scale, *rest), None)
