"""MLA layers that differ from each other: their own latent dims and heads, and which run a DSA
indexer.

transformers 5 lets a config give some layers their own values (``per_layer_config``, keyed by
layer index: only the keys that differ from the model's). dots3_note uses it for its sliding
layers: 64 heads over a 1024-wide latent with 192-wide nope keys, beside the indexed layers'
128 heads over a 512 latent with 128-wide nope keys. Sizing the caches or checking the operator
limits from the model-level keys alone would describe the sliding layers wrongly, so every MLA
layer is grouped here by what it actually is: attn_type, indexer or not, dims, heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.indexer import layer_spans
from kvskill.analyzer.plan import LayerPlan
from kvskill.core.attn_types import AttnType

#: the MLA keys a layer may set for itself (the same names as the model-level keys)
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True, kw_only=True)
class MlaGroup:
    """MLA layers of one attn_type that share indexer use, dims and head count."""

    attn_type: str
    #: whether these layers run the DSA indexer (and keep its key cache)
    indexed: bool
    #: kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    dims: dict[str, int | None]
    num_heads: int
    layers: list[int]
    #: the layers' window in tokens (SlidingWindow), else None
    sliding_window: int | None = None

    @property
    def label(self) -> str:
        """``"SlidingWindow layers 2-4, 6"`` (``DSA-indexed`` when they run the indexer)."""
        kind = "DSA-indexed " if self.indexed else ""
        return f"{kind}{self.attn_type} layers {layer_spans(self.layers)}"


def layer_dims(spec: ModelSpec, index: int) -> dict[str, int | None]:
    """The MLA dims of layer INDEX: the model's, with the layer's own keys over them."""
    assert spec.mla is not None
    own = spec.layer_overrides.get(index, {})
    return {key: own.get(key, spec.mla.get(key)) for key in MLA_KEYS}


def layer_heads(spec: ModelSpec, index: int) -> int:
    """Query heads of layer INDEX (its own ``num_attention_heads`` when it sets one)."""
    own = spec.layer_overrides.get(index, {}).get("num_attention_heads")
    return int(own) if isinstance(own, int) else spec.num_heads


def mla_groups(
    spec: ModelSpec, layers: list[LayerPlan], indexed_layers: set[int]
) -> list[MlaGroup]:
    """The MLA attention layers of LAYERS grouped by attn_type, indexer use, dims and heads,
    in layer order of their first member; [] for a model without MLA."""
    if spec.mla is None:
        return []
    groups: dict[tuple[Any, ...], MlaGroup] = {}
    for layer in layers:
        if layer.attn_type == AttnType.MAMBA.value:
            continue
        dims = layer_dims(spec, layer.index)
        heads = layer_heads(spec, layer.index)
        indexed = layer.index in indexed_layers
        key = (layer.attn_type.value, indexed, tuple(dims.items()), heads)
        if key in groups:
            groups[key].layers.append(layer.index)
        else:
            groups[key] = MlaGroup(
                attn_type=layer.attn_type.value,
                indexed=indexed,
                dims=dims,
                num_heads=heads,
                layers=[layer.index],
                sliding_window=layer.sliding_window,
            )
    return list(groups.values())


def cite_mla_groups(groups: list[MlaGroup], book: Notebook, source: str) -> None:
    """Evidence of each group when the MLA layers are not all alike."""
    if len(groups) < 2:
        return
    for group in groups:
        dims = group.dims
        head_dim = int(dims["qk_nope_head_dim"] or 0) + int(dims["qk_rope_head_dim"] or 0)
        window = f", window {group.sliding_window}" if group.sliding_window else ""
        book.cite(
            "mla.layers",
            f"{len(group.layers)} {group.label}: {group.num_heads} heads, kv_lora_rank "
            f"{dims['kv_lora_rank']}, nope {dims['qk_nope_head_dim']} + rope "
            f"{dims['qk_rope_head_dim']} (softmax scale {head_dim}^-0.5), v "
            f"{dims['v_head_dim']}{window}",
            source,
        )
