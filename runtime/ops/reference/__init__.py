"""Reference torch_npu: the operators kvskill calls, in plain PyTorch, with the real signatures.

Import it through ``kvskill.runtime.ops.torch_npu`` so that an NPU machine gets the real module.
Quantized, collective and not-yet-modelled operators resolve to callables that refuse by name
(``refused.py``); torch_npu's float8/float4 dtype names resolve to torch's own dtypes.
"""

from __future__ import annotations

from typing import Any

import torch

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
from .grouped_matmul import npu_grouped_matmul
from .kv_rmsnorm_rope_cache import npu_kv_rmsnorm_rope_cache
from .lightning_indexer import npu_lightning_indexer
from .moe_distribute import npu_moe_distribute_combine_v2, npu_moe_distribute_dispatch_v2
from .moe_gating import npu_moe_gating_top_k_softmax
from .moe_routing import npu_moe_finalize_routing, npu_moe_init_routing_v2, npu_moe_re_routing
from .refused import REFUSED_DTYPES, RefusedOperatorError, refuse, refusing_operator
from .rms_norm import npu_add_rms_norm, npu_rms_norm
from .rope import npu_interleave_rope
from .rotary_embedding import npu_apply_rotary_pos_emb, npu_rotary_mul
from .scatter import (
    npu_scatter_nd_update,
    npu_scatter_nd_update_,
    scatter_update,
    scatter_update_,
)
from .sparse_flash_attention import npu_sparse_flash_attention
from .swiglu import npu_swiglu

__all__ = [
    "OpInputError",
    "ReferenceUnsupportedError",
    "RefusedOperatorError",
    "npu_add_rms_norm",
    "npu_apply_rotary_pos_emb",
    "npu_grouped_matmul",
    "npu_moe_distribute_combine_v2",
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing_v2",
    "npu_moe_re_routing",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "get_npu_format",
    "npu_format_cast",
    "npu_chunk_gated_delta_rule",
    "npu_format_cast_",
    "npu_fused_causal_conv1d",
    "npu_fused_infer_attention_score",
    "npu_interleave_rope",
    "npu_fused_infer_attention_score_v2",
    "npu_kv_rmsnorm_rope_cache",
    "npu_lightning_indexer",
    "npu_recurrent_gated_delta_rule",
    "npu_recurrent_gated_delta_rule_functional",
    "npu_scatter_nd_update",
    "npu_scatter_nd_update_",
    "npu_sparse_flash_attention",
    "scatter_update",
    "scatter_update_",
]

#: torch_npu dtype names that torch itself defines (2.13: float8/float4 formats)
_TORCH_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2")


def __getattr__(name: str) -> Any:
    # Only names absent above reach this: refused operators and dtype aliases.
    refused = refusing_operator(name)
    if refused is not None:
        return refused
    if name in REFUSED_DTYPES:
        refuse(name, REFUSED_DTYPES[name])
    if name in _TORCH_DTYPES and hasattr(torch, name):
        return getattr(torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
