"""nsa_numba: Native Sparse Attention operators on the CPU, with Numba.

The same computation as Huawei CANN's ``aclnnNsaCompress``,
``aclnnNsaCompressGrad``, ``aclnnNsaCompressWithCache`` and
``aclnnNsaSelectedAttention`` / ``...Grad`` (torch_npu ``npu_nsa_compress`` /
``npu_nsa_compress_grad`` / ``npu_nsa_compress_infer`` /
``npu_nsa_select_attention`` / ``_grad``) for packed variable-length sequences in
layout TND and paged KV caches; and ``aclnnNsaCompressAttention``
(``npu_nsa_compress_attention``) with its gradient; and torch_npu's generic
attention ``npu_fusion_attention`` / ``_grad`` (sparse modes 0 to 4), the NSA
window branch.
"""

from . import _firstrun
from ._core.errors import NsaError
from ._firstrun import compile_messages
from ._core.launch import threads
from ._core.pool import keep_outputs, release_outputs
from .api import (fusion_attention, fusion_attention_grad, nsa_compress,
                  nsa_compress_attention, nsa_compress_attention_grad, nsa_compress_grad,
                  nsa_compress_infer, nsa_select_attention, nsa_select_attention_grad)
from ._warmup import warmup

__version__ = "0.1.0"

_firstrun.install()

__all__ = ["NsaError", "compile_messages", "fusion_attention", "fusion_attention_grad",
           "keep_outputs", "nsa_compress",
           "nsa_compress_attention", "nsa_compress_attention_grad", "nsa_compress_grad",
           "nsa_compress_infer", "nsa_select_attention", "nsa_select_attention_grad",
           "release_outputs", "threads", "warmup", "__version__"]
