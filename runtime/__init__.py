"""Runtime: paged KV-cache management, layouts, operators and the generation engine."""

from kvskill.runtime.block_pool import NULL_BLOCK_ID, BlockPool
from kvskill.runtime.cache_info import (
    AttnType,
    CacheAllocator,
    CacheEntry,
    CacheInfoError,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
    validate_cache_info,
)
from kvskill.runtime.forward_context import (
    ForwardMetaData,
    PrefillCPMetaData,
    forward_context,
    get_forward_metadata,
    reset_forward_metadata,
    set_forward_metadata,
    step_metadata,
)
from kvskill.runtime.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvskill.runtime.layout import bind_kv_cache, kv_lane_view, split_page, strided_view
from kvskill.runtime.legacy_attention import legacy_attention_inputs, packed_output
from kvskill.runtime.managers import (
    ATTN_TYPE_MANAGER_MAP,
    FIXED_BLOCK_ATTN_TYPES,
    FullAttentionManager,
    LegacyManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    register_attn_type,
)
from kvskill.runtime.masks import get_init_attn_mask
from kvskill.runtime.state_access import gather_ssm_states, scatter_ssm_states_
from kvskill.runtime.tables import (
    prepare_block_tables,
    prepare_slot_mapping,
    prepare_token_positions,
)

__all__ = [
    "ATTN_TYPE_MANAGER_MAP",
    "FIXED_BLOCK_ATTN_TYPES",
    "NULL_BLOCK_ID",
    "AttnType",
    "BlockPool",
    "CacheAllocator",
    "CacheEntry",
    "CacheInfoError",
    "FullAttentionManager",
    "ForwardMetaData",
    "KVCacheBlocks",
    "KVCacheManager",
    "LayerCacheInfo",
    "LegacyManager",
    "MambaCacheEntry",
    "MambaManager",
    "ModelCacheInfo",
    "PrefillCPMetaData",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "bind_kv_cache",
    "forward_context",
    "gather_ssm_states",
    "get_forward_metadata",
    "get_init_attn_mask",
    "kv_lane_view",
    "reset_forward_metadata",
    "set_forward_metadata",
    "step_metadata",
    "validate_cache_info",
    "legacy_attention_inputs",
    "packed_output",
    "prepare_block_tables",
    "prepare_slot_mapping",
    "prepare_token_positions",
    "register_attn_type",
    "scatter_ssm_states_",
    "split_page",
    "strided_view",
]

# Engine and Python API.
from kvskill.runtime.engine import EngineStats, LLMEngine, StepRecord  # noqa: E402
from kvskill.runtime.engine_config import EngineConfig  # noqa: E402
from kvskill.runtime.kv_cache_setup import prepare_kv_cache  # noqa: E402
from kvskill.runtime.llm import LLM  # noqa: E402
from kvskill.runtime.loader import LoadedModel, load_model  # noqa: E402
from kvskill.runtime.request import (  # noqa: E402
    FinishReason,
    RequestOutput,
    SamplingParams,
    StepOutput,
)

__all__ += [
    "LLM",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "LoadedModel",
    "RequestOutput",
    "SamplingParams",
    "StepOutput",
    "StepRecord",
    "load_model",
    "prepare_kv_cache",
]
