"""The common-error table: the known KV/FA mistakes that apply to this model's design."""

from __future__ import annotations

from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.indexer import reads_sparsely
from kvskill.analyzer.rules import TND_HEAD_DIMS
from kvskill.core.attn_types import AttnType


def add_pitfalls(
    *,
    spec: ModelSpec,
    book: Notebook,
    kv_mode: str,
    deploy_mode: str,
    attention: str,
    fa_version: str,
    attn_types: list[str],
    kv_heads_per_rank: int,
    attn_tp_size: int,
    scale_has_mscale: bool,
    keeps_absorbed_prefill: bool = False,
) -> None:
    """Append one warning per applicable row of the common-error table (and operator limits).

    KEEPS_ABSORBED_PREFILL: the conversion keeps the model's own absorbed MLA call for prefill
    too (the framework's standalone Legacy MLA), instead of an un-absorbed prefill.
    """
    warn = book.warn
    if kv_mode == "legacy":
        warn(
            "Legacy mode serves offline inference only; online serving needs Paged once the "
            "blocker is gone"
        )
        return
    dsa = attention == "mla" and reads_sparsely(spec)
    if dsa:
        _dsa_pitfalls(warn, int((spec.indexer or {}).get("kpool") or 1))
    else:
        _fused_attention_pitfalls(warn, fa_version)
    full_like = [t for t in attn_types if t != AttnType.MAMBA.value]
    if attention != "mla" and AttnType.FULL_ATTENTION.value in full_like:
        warn(
            "full attention needs sparse_mode=3 with the causal mask in prefill and decode; "
            "sparse_mode=0 without a mask removes causal masking (garbled prefill, no error)"
        )
    if attention == "mla" and not dsa:
        _mla_pitfalls(warn, keeps_absorbed_prefill)
    if AttnType.SLIDING_WINDOW.value in attn_types:
        warn(
            "sliding-window layers keep sparse_mode=4 with pre_tokens=W-1, next_tokens=0 in "
            "decode too; sparse_mode=0 lets long sequences see keys outside the window"
        )
    if len(full_like) + (AttnType.MAMBA.value in attn_types) > 1:
        warn(
            "mixed attn_types: set attn_type per layer in the attention __init__ from the "
            "layer pattern; one manager name for every layer is wrong"
        )
    if deploy_mode == "framework":
        warn(
            "framework: block_table and slot_mapping are dicts keyed by attn_type; pass "
            "block_table[self.attn_type], never the dict"
        )
        warn(
            "framework: get_cache_info() needs self.block_size saved in __init__ and one "
            "LayerCacheInfo per decoder layer"
        )
    else:
        warn(
            "standalone: kv_len is a runner variable every layer reads; incrementing it inside "
            "a layer shifts the cache write position layer by layer"
        )
    if attention != "mla":
        warn(
            f"cache_entries num_head = max(num_kv_heads // attn_tp_size, 1) = "
            f"{kv_heads_per_rank} at attn_tp_size={attn_tp_size}; update it when the TP size "
            "changes"
        )
        if spec.head_dim not in TND_HEAD_DIMS:
            warn(
                f"head_dim {spec.head_dim}: recent CANN accepts TND non-MLA head dims 64/128/192 "
                "only (unconfirmed on hardware); the CPU reference runs it"
            )
        q_per_rank = max(spec.num_heads // attn_tp_size, 1)
        if q_per_rank // max(kv_heads_per_rank, 1) > 64:
            warn(f"GQA ratio {q_per_rank // kv_heads_per_rank} exceeds the operator's limit of 64")
    if scale_has_mscale:
        warn(
            "YaRN mscale_all_dim: the FA scale must include mscale^2; leaving it out is "
            "silently too small"
        )
    if spec.dtype not in ("float16", "bfloat16"):
        # torch_npu 2.13.0 docs: the fused attention takes float16/bfloat16 (int8 quantised)
        warn(
            f"model dtype {spec.dtype}: the NPU's fused attention takes float16 or bfloat16; "
            "float32 runs on the CPU reference only"
        )
    if not spec.dtype_known:
        warn(f"config names no dtype; cache dtype {spec.dtype} assumed")


def _dsa_pitfalls(warn, pool: int = 1) -> None:
    """The indexed sparse attention's rows (lint KV015-KV019 check the code for them); POOL:
    tokens per scored key of a k-pool indexer (GLM-5.3), 1 for a per-token one."""
    warn(
        "DSA: npu_lightning_indexer and npu_sparse_flash_attention take no atten_mask (causal "
        "through sparse_mode=3, prefill and decode); their lengths are int32 tensors, cumulative "
        "for the TND query, per request for the paged keys"
    )
    warn(
        "DSA: with block_table both read the paged caches as layout 'PA_BSND' (ND rows, "
        "[blocks, block_size, 1, dim]): the latent is written with cache_mode 'PA_BNSD', not "
        "NZ; the indexer's keys are the layer's third cache entry, paged with the latent"
        + (f" (one pooled key per {pool} tokens)" if pool > 1 else "")
    )
    warn(
        "DSA: the indexer's relu(q . k) scores are not scaled by the operator; the model's "
        "softmax scale (and 1/sqrt(heads)) go into its weights; sparse_count = index_topk"
        + (f" // index_kpool, the pools kept, with sparse_block_size {pool}" if pool > 1 else "")
    )


def _fused_attention_pitfalls(warn, fa_version: str) -> None:
    warn(
        "atten_mask must be the bool [2048, 2048] tile (True = masked, triu(diagonal=1)); "
        "float masks or other shapes are rejected by the operator"
    )
    if fa_version == "v1":
        warn(
            "FA v1 keywords: scale=, num_heads=, actual_seq_lengths=, actual_seq_lengths_kv=; "
            "a v2 name (softmax_scale=) leaves the scale at its default 1.0"
        )
    else:
        warn(
            "FA v2 keywords: softmax_scale=, num_query_heads=, actual_seq_qlen=, "
            "actual_seq_kvlen=; a v1 name (scale=) leaves the scale at its default 1.0"
        )


def _mla_pitfalls(warn, keeps_absorbed_prefill: bool) -> None:
    warn(
        "MLA absorb decode must use sparse_mode=0 with atten_mask=None; sparse_mode=3 "
        "there gives large deviations"
    )
    warn(
        "MLA absorb: the FA call's num_key_value_heads=1 must equal cache_entries "
        "num_head=1, and the model class must set is_mla_backend=True"
    )
    # torch_npu 2.13.0 docs, FA 约束说明 › 当query的d等于512时 (references/npu_ops.md §9);
    # the operator limits the MLA dims hit are in op_limits
    if keeps_absorbed_prefill:
        warn(
            "MLA on the NPU: the 512-wide latent (absorbed) query takes 1..16 query tokens "
            "per request; the standalone Legacy MLA conversion keeps the model's own "
            "absorbed call for prefill, so with kv_lora_rank 512 prompts longer than 16 "
            "tokens are outside the device's limits (none documented for a 128-wide one)"
        )
    else:
        warn(
            "MLA on the NPU: the 512-wide latent (absorbed) query takes 1..16 query tokens "
            "per request, so decode runs absorbed and prefill un-absorbed (the cached "
            "latent decompressed by kv_b_proj, TND without page attention)"
        )
