"""nsa_numba: Native Sparse Attention compress operators on the CPU, with Numba.

The same computation as Huawei CANN's ``aclnnNsaCompress`` and
``aclnnNsaCompressGrad`` (torch_npu ``npu_nsa_compress`` / ``npu_nsa_compress_grad``)
for packed variable-length sequences in layout TND.
"""

from . import _threading

_threading.configure()  # before anything can start Numba's thread pool

from ._errors import NsaError  # noqa: E402
from ._threading import threads  # noqa: E402
from .api import nsa_compress, nsa_compress_grad  # noqa: E402

__version__ = "0.1.0"

__all__ = ["NsaError", "nsa_compress", "nsa_compress_grad", "threads", "__version__"]
