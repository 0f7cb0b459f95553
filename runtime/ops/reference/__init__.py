"""Reference torch_npu: the operators kvskill calls, in plain PyTorch, with the real signatures.

Import it through ``kvskill.runtime.ops.torch_npu`` so that an NPU machine gets the real module.
"""

from __future__ import annotations

from ._checks import OpInputError, ReferenceUnsupportedError
from .causal_conv import npu_fused_causal_conv1d
from .format_cast import get_npu_format, npu_format_cast, npu_format_cast_
from .fused_infer_attention import (
    npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2,
)
from .gated_delta import (
    npu_chunk_gated_delta_rule,
    npu_recurrent_gated_delta_rule,
    npu_recurrent_gated_delta_rule_functional,
)
from .kv_rmsnorm_rope_cache import npu_kv_rmsnorm_rope_cache
from .rope import npu_interleave_rope
from .scatter import (
    npu_scatter_nd_update,
    npu_scatter_nd_update_,
    scatter_update,
    scatter_update_,
)

__all__ = [
    "OpInputError",
    "ReferenceUnsupportedError",
    "get_npu_format",
    "npu_format_cast",
    "npu_chunk_gated_delta_rule",
    "npu_format_cast_",
    "npu_fused_causal_conv1d",
    "npu_fused_infer_attention_score",
    "npu_interleave_rope",
    "npu_fused_infer_attention_score_v2",
    "npu_kv_rmsnorm_rope_cache",
    "npu_recurrent_gated_delta_rule",
    "npu_recurrent_gated_delta_rule_functional",
    "npu_scatter_nd_update",
    "npu_scatter_nd_update_",
    "scatter_update",
    "scatter_update_",
]
