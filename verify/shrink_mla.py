"""Shrinking an MLA config for verification without leaving the fused operator's limits.

The absorbed MLA attention needs rope head dim 64 and a query head dim (``kv_lora_rank``) of
512 or 128 (npu_ops §1.8); a shrunk config must stay inside them, so the latent shrinks to
128 and the rope dim is never touched. Other MLA dims become small but distinct (nope 16,
value 24) so a swapped key/value split shows up in the logits. ``q_lora_rank`` keeps its
presence (None stays None), group-limited MoE routing keeps one group, and the dense-then-MoE
layer pattern (``first_k_dense_replace``) keeps at least one layer of each kind.
"""

from __future__ import annotations

from typing import Any

from kvskill.analyzer.config_keys import lookup, write_keys
from kvskill.implementer.mla.spec import MLA_QUERY_DIMS

#: the smaller latent width the fused MLA attention accepts
LATENT_RANK = min(MLA_QUERY_DIMS)
NOPE_HEAD_DIM = 16
V_HEAD_DIM = 24
Q_LORA_RANK = 32
#: the DSA indexer of a shrunk twin: heads, and positions kept per query. A position scores
#: exactly 0 when relu zeroes it in every head (probability 2^-heads with random weights), and
#: the top-k breaks such ties by an order the operator and torch.topk need not share; with 16
#: heads a tie at the top-k boundary is out of reach of the verify prompts (4 heads made one in
#: three short rows).
INDEX_N_HEADS = 16
INDEX_TOPK = 24
#: a k-pool indexer (GLM-5.3's ``index_kpool``) of a shrunk twin: pools of 4 tokens (a power
#: of two dividing the MLA block size, as the sparse attention's sparse_block_size must be),
#: 2 of them kept, so prompts of a dozen tokens on already have pools the indexer drops
INDEX_KPOOL = 4
INDEX_POOLS_KEPT = 2


def is_mla_config(config: dict[str, Any]) -> bool:
    """A latent-attention config (it names a KV latent rank)."""
    return isinstance(config.get("kv_lora_rank"), int)


def shrink_mla(
    config: dict[str, Any], shrunk: dict[str, Any], names: dict[str, str] | None = None
) -> dict[str, Any]:
    """The MLA keys of ``shrunk`` (the generic shrink of ``config``) to override.

    Args:
        config: the original config.
        shrunk: the generic shrink's result (hidden size, heads, layers already small).
        names: the config class's attribute_map; the layer count is written under the key
            the model reads (``analyzer.config_keys``).

    Returns:
        key -> new value; apply with ``shrunk.update(...)``.
    """
    rope = config.get("qk_rope_head_dim")
    new: dict[str, Any] = {
        "kv_lora_rank": LATENT_RANK
        if config["kv_lora_rank"] in MLA_QUERY_DIMS
        else config["kv_lora_rank"],
        "qk_nope_head_dim": NOPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
    }
    if rope is not None:
        new["qk_rope_head_dim"] = rope
        # the rotary embedding of these models is sized by head_dim = the rope head dim
        new["head_dim"] = rope
        if "qk_head_dim" in config:
            new["qk_head_dim"] = NOPE_HEAD_DIM + rope
    if config.get("q_lora_rank"):
        new["q_lora_rank"] = Q_LORA_RANK
    if isinstance(config.get("index_topk"), int):
        # the sparse attention takes the 512 latent only, the indexer a 128 key head only
        new["kv_lora_rank"] = config["kv_lora_rank"]
        new["index_n_heads"] = min(INDEX_N_HEADS, int(config.get("index_n_heads") or 1))
        new["index_topk"] = min(INDEX_TOPK, config["index_topk"])
        if int(config.get("index_kpool") or 1) > 1:
            # the config requires index_topk to be a multiple of index_kpool
            new["index_kpool"] = INDEX_KPOOL
            new["index_topk"] = INDEX_KPOOL * INDEX_POOLS_KEPT
    dense = config.get("first_k_dense_replace")
    if isinstance(dense, int):
        new["first_k_dense_replace"] = min(dense, 1)
        layers = int(lookup(shrunk, "num_layers", names)[0] or 2)
        # one dense layer and one MoE layer at least
        count = min(
            int(lookup(config, "num_layers", names)[0] or layers),
            max(layers, new["first_k_dense_replace"] + 1),
        )
        new.update(dict.fromkeys(write_keys(config, "num_layers", names), count))
    return new
