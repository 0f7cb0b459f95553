"""Reference torch_npu: the operators kvskill calls, in plain PyTorch, with the real signatures.

Import it through ``kvskill.runtime.ops.torch_npu`` so that an NPU machine gets the real module.
"""

from __future__ import annotations

from ._checks import OpInputError, ReferenceUnsupportedError
from .fused_infer_attention import (
    npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2,
)
from .scatter import (
    npu_scatter_nd_update,
    npu_scatter_nd_update_,
    scatter_update,
    scatter_update_,
)

__all__ = [
    "OpInputError",
    "ReferenceUnsupportedError",
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_scatter_nd_update",
    "npu_scatter_nd_update_",
    "scatter_update",
    "scatter_update_",
]
