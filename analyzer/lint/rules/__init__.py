"""The registry of lint rules, in id order. Ids are stable: never reuse or renumber one."""

from __future__ import annotations

from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules.kv001_no_causal_mask import NoCausalMaskInPrefill
from kvskill.analyzer.lint.rules.kv002_sliding_without_band import SlidingWithoutBand
from kvskill.analyzer.lint.rules.kv003_float_mask import FloatAttenMask
from kvskill.analyzer.lint.rules.kv004_mask_shape import MaskShapeNot2048
from kvskill.analyzer.lint.rules.kv005_fa_keyword_version import FaKeywordVersionMismatch
from kvskill.analyzer.lint.rules.kv006_missing_scale import MissingSoftmaxScale
from kvskill.analyzer.lint.rules.kv007_block_table_dict import BlockTableWholeDict
from kvskill.analyzer.lint.rules.kv008_kv_len_in_layer import KvLenIncrementedInLayer
from kvskill.analyzer.lint.rules.kv009_num_head_per_rank import NumHeadNotPerRank
from kvskill.analyzer.lint.rules.kv010_yarn_mscale import YarnScaleMissingMscale
from kvskill.analyzer.lint.rules.kv011_mla_decode_sparse3 import MlaDecodeSparseMode3
from kvskill.analyzer.lint.rules.kv012_cache_info_incomplete import CacheInfoIncomplete
from kvskill.analyzer.lint.rules.kv013_cache_entries_untouched import CacheEntriesUntouched
from kvskill.analyzer.lint.rules.kv014_cache_entry_contract import CacheEntryContract
from kvskill.analyzer.lint.rules.kv015_sparse_dense_mask import SparseDenseMask
from kvskill.analyzer.lint.rules.kv016_sparse_paged_layout import SparsePagedLayout
from kvskill.analyzer.lint.rules.kv017_sparse_mode_value import SparseModeValue
from kvskill.analyzer.lint.rules.kv018_sparse_attention_mla_absorb import SparseAttentionMlaAbsorb
from kvskill.analyzer.lint.rules.kv019_sparse_lengths_list import SparseLengthsList

RULES: tuple[type[Rule], ...] = (
    NoCausalMaskInPrefill,
    SlidingWithoutBand,
    FloatAttenMask,
    MaskShapeNot2048,
    FaKeywordVersionMismatch,
    MissingSoftmaxScale,
    BlockTableWholeDict,
    KvLenIncrementedInLayer,
    NumHeadNotPerRank,
    YarnScaleMissingMscale,
    MlaDecodeSparseMode3,
    CacheInfoIncomplete,
    CacheEntriesUntouched,
    CacheEntryContract,
    SparseDenseMask,
    SparsePagedLayout,
    SparseModeValue,
    SparseAttentionMlaAbsorb,
    SparseLengthsList,
)

__all__ = ["RULES"]
