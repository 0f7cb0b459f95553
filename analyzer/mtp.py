"""The model's multi-token-prediction (MTP) layers: where they are, what they cache, what
speculative decoding with them costs.

An MTP layer (DeepSeek-V3's ``num_nextn_predict_layers``, GLM-4-MoE's, ...) is one more decoder
layer after the main ones: it reads the main model's final hidden state of position p and the
embedding of token p+1 and predicts token p+2. Its checkpoint tensors sit at
``model.layers.<N+i>.*`` (N = ``num_hidden_layers``). The runtime builds it from the converted
decoder layer class, so it declares the same cache entries as a main layer of its kind; its
``ModelCacheInfo`` is merged after the main model's (the framework's ``ModelCacheInfo.merge``):
layer indices N..N+k-1, the same groups, block tables and slot mappings as the main layers.

With gated-delta layers (Qwen3-Next: MTP tensors under ``mtp.*``, counted by
``mtp_num_hidden_layers``) every Mamba entry carries ``next_n``: its manager keeps
``1 + next_n`` state blocks per request, the framework's ``MambaCacheEntry.next_n``.
"""

from __future__ import annotations

from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.plan import CacheEntryPlan, MtpPlan
from kvskill.core.attn_types import AttnType
from kvskill.core.cache_bytes import dtype_bytes, entry_bytes, token_bytes

#: config keys that count the MTP layers, in the order they are read
MTP_COUNT_KEYS = (
    "num_mtp_layers",
    "num_nextn_predict_layers",
    "mtp_num_layers",
    "mtp_num_hidden_layers",
)

MERGE_NOTE = (
    "the drafter's ModelCacheInfo is merged after the main model's (ModelCacheInfo.merge): "
    "its layers are renumbered N..N+k-1 and join the main layers' groups, so they share the "
    "block tables and slot mappings; a request's MTP cache row p holds the pair (hidden state "
    "of position p, token p+1)"
)


def mtp_plan(
    spec: ModelSpec,
    cache_entries: dict[str, list[CacheEntryPlan]],
    kv_bytes_per_token: int,
) -> MtpPlan | None:
    """The MTP plan of a model whose config declares MTP layers; None otherwise."""
    k = spec.num_mtp_layers
    if k <= 0:
        return None
    key = spec.sources.get("num_mtp_layers", MTP_COUNT_KEYS[0])
    n = spec.num_layers
    kinds = set(spec.layer_kinds)
    attn_type = AttnType.FULL_ATTENTION.value
    entries = [
        e for e in cache_entries.get(attn_type, []) if e.num_layers is None and not e.manager_key
    ]
    per_layer = sum(
        token_bytes(entry_bytes(e.dim, e.num_head, dtype_bytes(e.dtype)), e.compress_ratio)
        for e in entries
    )
    refusal = None
    # Gated delta nets speculate: their converted forward writes the state after every token
    # of a verify step into the request's 1 + next_n state blocks and the runtime keeps the
    # last accepted one (runtime/speculative.py). Windows release blocks by the accepted
    # length and keep a 2 * next_n margin. Other state mixers keep one state per request.
    # NOTE: Kimi delta attention (kimi_linear, bailing_hybrid: beside MLA layers) writes its
    # rows through the same converted code but has not run speculatively: it stays refused.
    served = {"attention", "sliding"}
    if spec.state.get("mixer") == "gated_delta" and spec.mla is None:
        served.add("linear_attention")
    if kinds - served:
        refusal = (
            f"layer kinds {sorted(kinds - served)} besides full attention and windows: a "
            "speculative step would have to advance their states over accepted tokens only, "
            "which the runtime does for the gated delta nets of non-MLA models only"
        )
    elif not entries:
        refusal = "no full-attention cache entry to give the MTP layers"
    return MtpPlan(
        num_layers=k,
        config_key=key,
        layer_indices=list(range(n, n + k)),
        weight_prefixes=[f"model.layers.{i}." for i in range(n, n + k)],
        attn_type=attn_type,
        cache_entries=entries,
        bytes_per_token=per_layer * k,
        kv_bytes_per_token_speculative=kv_bytes_per_token + per_layer * k,
        next_n=k,
        merge=MERGE_NOTE,
        speculative_refusal=refusal,
    )
