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
(``torch.library.custom_op``) with fake-tensor and autograd implementations, so
they work under ``torch.compile`` and pass ``torch.library.opcheck``.

Tensors cross to NumPy without copies (bfloat16 through an int16 view); results
are the NumPy API's, bit for bit. Invalid arguments raise ``nsa_numba.NsaError``.
Requires PyTorch 2.4 or newer.
"""

from typing import List, Optional

import numpy as np
import torch

from . import _seqlens, api
from ._errors import invalid
from ._plan import PY_NAMES

__all__ = ["npu_nsa_compress", "npu_nsa_compress_grad"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _as_numpy(op, name, t):
    """A NumPy view of CPU tensor ``t`` (no copy)."""
    if not isinstance(t, torch.Tensor):
        raise invalid(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise invalid(op, f"{name} must be on the CPU, got device {t.device}")
    if t.dtype not in _DTYPES:
        raise invalid(op, f"{name} dtype must be one of float16, bfloat16, float32, "
                          f"float64, got {t.dtype}")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _as_tensor(a):
    """A tensor over NumPy array ``a`` (no copy)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _empty_numpy(op, like, shape):
    """A new tensor of ``like``'s dtype and its NumPy view."""
    t = torch.empty(shape, dtype=like.dtype)
    return t, _as_numpy(op, "out", t)


def _window_count(op, T, block, stride, actual_seq_len):
    """T' for the output shape (the fake implementation needs it without data).

    NumPy rather than ``_seqlens.packed_tables``: under dynamic shapes T arrives as a
    ``torch.SymInt``, which compiled code cannot take."""
    offsets = _seqlens.sequence_offsets(op, actual_seq_len, _seqlens.CUMULATIVE, T,
                                        PY_NAMES)
    return int(_seqlens.window_counts(np.diff(offsets), block, stride).sum())


@torch.library.custom_op("nsa_numba::nsa_compress", mutates_args=())
def _nsa_compress(input: torch.Tensor, weight: torch.Tensor, compress_block_size: int,
                  compress_stride: int, actual_seq_len: Optional[List[int]]) -> torch.Tensor:
    op = "npu_nsa_compress"
    x = _as_numpy(op, "input", input)
    w = _as_numpy(op, "weight", weight)
    return _as_tensor(api.nsa_compress(x, w, compress_block_size, compress_stride,
                                       actual_seq_len=actual_seq_len))


@_nsa_compress.register_fake
def _nsa_compress_fake(input, weight, compress_block_size, compress_stride, actual_seq_len):
    windows = _window_count("npu_nsa_compress", input.shape[0], compress_block_size,
                            compress_stride, actual_seq_len)
    return input.new_empty((windows, input.shape[1], input.shape[2]))


@torch.library.custom_op("nsa_numba::nsa_compress_grad", mutates_args=())
def _nsa_compress_grad(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                       compress_block_size: int, compress_stride: int,
                       actual_seq_len: Optional[List[int]]) -> List[torch.Tensor]:
    op = "npu_nsa_compress_grad"
    g = _as_numpy(op, "grad", grad)
    x = _as_numpy(op, "input", input)
    w = _as_numpy(op, "weight", weight)
    input_grad, x_grad = _empty_numpy(op, input, input.shape)
    weight_grad, w_grad = _empty_numpy(op, weight, weight.shape)
    api.nsa_compress_grad(g, x, w, compress_block_size, compress_stride,
                          actual_seq_len=actual_seq_len, input_grad=x_grad, weight_grad=w_grad)
    return [input_grad, weight_grad]


@_nsa_compress_grad.register_fake
def _nsa_compress_grad_fake(grad, input, weight, compress_block_size, compress_stride,
                            actual_seq_len):
    return [torch.empty_like(input, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format)]


def _setup_context(ctx, inputs, output):
    input, weight, block, stride, actual_seq_len = inputs
    ctx.save_for_backward(input, weight)
    ctx.window = (block, stride, actual_seq_len)


def _backward(ctx, grad):
    input, weight = ctx.saved_tensors
    block, stride, actual_seq_len = ctx.window
    input_grad, weight_grad = torch.ops.nsa_numba.nsa_compress_grad(
        grad, input, weight, block, stride, actual_seq_len)
    return (input_grad if ctx.needs_input_grad[0] else None,
            weight_grad if ctx.needs_input_grad[1] else None, None, None, None)


_nsa_compress.register_autograd(_backward, setup_context=_setup_context)


def _seq_list(actual_seq_len):
    """``actual_seq_len`` as a list of Python ints (the operator schema's int[])."""
    if actual_seq_len is None:
        return None
    if isinstance(actual_seq_len, torch.Tensor):
        actual_seq_len = actual_seq_len.tolist()
    if isinstance(actual_seq_len, np.ndarray):
        actual_seq_len = actual_seq_len.tolist()
    return list(actual_seq_len)


def npu_nsa_compress(input, weight, compress_block_size, compress_stride, *,
                     actual_seq_len=None):
    """torch_npu.npu_nsa_compress on the CPU: ``[T', N, D]``, differentiable.

    ``actual_seq_len``: cumulative sequence ends (list, tuple, 1-D array or tensor),
    or None for one sequence.
    """
    return torch.ops.nsa_numba.nsa_compress(input, weight, compress_block_size,
                                            compress_stride, _seq_list(actual_seq_len))


def npu_nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride, *,
                          actual_seq_len=None):
    """torch_npu.npu_nsa_compress_grad on the CPU: ``(input_grad, weight_grad)``."""
    input_grad, weight_grad = torch.ops.nsa_numba.nsa_compress_grad(
        grad, input, weight, compress_block_size, compress_stride, _seq_list(actual_seq_len))
    return input_grad, weight_grad
