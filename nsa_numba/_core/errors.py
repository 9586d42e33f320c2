"""Status codes and the one exception type the library raises for bad input.

The codes are the aclnn ones, so a caller that switches between the NPU and this
library sees the same numbers.
"""

ACLNN_SUCCESS = 0
ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002
ACLNN_ERR_RUNTIME_ERROR = 361001
ACLNN_ERR_INNER = 561000
ACLNN_ERR_INNER_TILING_ERROR = 561002


class NsaError(ValueError):
    """Invalid argument to an NSA compress operator.

    ``status`` is the aclnn status code the NPU returns for the same input:
    161001 (``ACLNN_ERR_PARAM_NULLPTR``) for a required tensor that is None,
    561002 (``ACLNN_ERR_INNER_TILING_ERROR``) for what the with-cache operator's
    tiling rejects (see ``_ops.infer``), 161002 (``ACLNN_ERR_PARAM_INVALID``) for
    everything else.
    """

    def __init__(self, message, status=ACLNN_ERR_PARAM_INVALID):
        super().__init__(message)
        self.status = int(status)


def invalid(op, message):
    """An NsaError with status 161002, the message prefixed with the operator name."""
    return NsaError(f"{op}: {message}", ACLNN_ERR_PARAM_INVALID)


def tiling(op, message):
    """An NsaError with status 561002, for what the NPU's tiling rejects."""
    return NsaError(f"{op}: {message}", ACLNN_ERR_INNER_TILING_ERROR)


def missing(op, name):
    """An NsaError with status 161001 for a required array that is None."""
    return NsaError(f"{op}: {name} is required but got None (a null tensor)",
                    ACLNN_ERR_PARAM_NULLPTR)
