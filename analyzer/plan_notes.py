"""Evidence and warnings a Plan carries beside its decisions: where config branches, composite
decoders and state sizes come from, and what the code does that the conversion must know
(Legacy paths, fused qkv, state mixers, windows the mask never applies)."""

from __future__ import annotations

from typing import Any

from kvskill.analyzer.config import ModelSpec, text_config
from kvskill.analyzer.decoder_source import text_model_type
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.indexer import indexer_layers, plannable_indexer
from kvskill.analyzer.inputs import ModelSource
from kvskill.analyzer.plan import CacheEntryPlan
from kvskill.analyzer.pooled_indexer import is_pooled
from kvskill.analyzer.qkv_split import fused_qkv_note
from kvskill.analyzer.rules import CodeView, holds_attention_and_state
from kvskill.core.attn_types import AttnType

_STATE_KEYS = (
    "linear_num_value_heads",
    "mamba_d_state",
    "ssm_state_size",
    "state_size",
    "conv_L_cache",
)


def cite_config_branches(facts, source: ModelSource, book: Notebook) -> None:
    """Which branch of each config-decided ``if`` of an attention forward runs, and why
    (``analyzer/config_branch.py``; apply keeps that branch only)."""
    config = text_config(source.config)[0]
    for branch in facts.config_branches:
        value = config.get(branch.key)
        if isinstance(value, bool):
            book.cite("attention_branch", branch.reason(value), facts.where(branch.line))


def cite_decoder_origin(source: ModelSource, code: CodeView, book: Notebook) -> None:
    """Why a composite model's KV cache is its language model's or its text decoder's."""
    if source.delegated_from:
        book.cite(
            "source",
            f"'{source.delegated_from}' builds its language model from text_config "
            f"(model_type '{source.model_type}'); the KV cache is that model's",
            book.cfg("model_type"),
        )
    if source.vision_language_head:
        book.cite(
            "source",
            f"'{source.model_type}' defines its text decoder in its own modeling file (text "
            f"model type '{text_model_type(source)}' has no causal-LM class): "
            f"{code.roles.causal_lm} is converted, its text attention {code.roles.attention[0]} "
            "gets the paged KV cache and the vision tower (no KV cache) is left as it is",
            book.cfg("text_config.model_type"),
        )
        book.warn(
            "vision-language model: the runtime passes token ids with one position per token; "
            "text-only requests are exact (every multimodal-rope section is the text position), "
            "image and video inputs with their 3-D rope positions are not passed through"
        )


def window_only_in_cache(spec: ModelSpec, book: Notebook) -> None:
    """A ``sliding_window`` the attention never reads, which transformers' cache still applies.

    With no ``layer_types``, transformers' ``DynamicCache(config=...)`` makes every layer a
    sliding-window cache layer as soon as ``config.sliding_window`` is set (cache_utils
    ``get_layer_types_and_kwargs``), and that layer keeps only the last W-1 keys. A model
    whose mask stays plain causal (moshi) then attends to the whole prompt in prefill but to
    the last W tokens in decode, so its output depends on how the sequence was split; no one
    mask of the fused operator (causal or band) gives both. The window is harmless only when
    it cannot bind: W >= max_position_embeddings (moshi's default, 3000 and 3000).
    """
    from_window_alone = spec.layer_pattern_source.rsplit(".", 1)[-1] == "sliding_window"
    if spec.sliding_window is None or not from_window_alone or "sliding" in spec.layer_kinds:
        return  # no window, a layer pattern, or code that reads the window (mistral)
    window, key = spec.sliding_window, spec.sources.get("sliding_window")
    max_positions = spec.max_positions  # max_position_embeddings, seq_length, n_positions
    if isinstance(max_positions, int) and window >= max_positions:
        book.cite(
            "layers",
            f"transformers' cache keeps a window of sliding_window={window} keys per layer "
            f"(no layer_types), but it never binds: max_position_embeddings={max_positions}",
            book.cfg(key),
        )
        return
    msg = (
        "mask and cache disagree: the mask is plain causal but transformers' DynamicCache "
        f"makes every layer a sliding-window cache (sliding_window={window}, no layer_types, "
        f"max_position_embeddings={max_positions}): prefill attends to the whole prompt, "
        f"decode only to the last {window} tokens, and no single fused-attention mask gives "
        "both; set sliding_window to null or >= max_position_embeddings"
    )
    book.warn(msg)
    book.block(msg)


def cite_state_entries(entries: dict[str, list[CacheEntryPlan]], source: ModelSource, book) -> None:
    """Where the Mamba-type state sizes come from, or a blocker when they are unknown."""
    if AttnType.MAMBA.value not in entries:
        return
    state = entries[AttnType.MAMBA.value]
    if not state:
        msg = "state layers without recognised conv/SSM sizes in the config: no state entries"
        book.warn(msg)
        book.block(msg)
        return
    key = next((k for k in _STATE_KEYS if source.config.get(k) is not None), None)
    shapes = ", ".join(f"{e.cache_name} {e.num_head}x{e.dim}" for e in state)
    book.cite("cache_entries.Mamba", f"per-request state: {shapes}", book.cfg(key))


def cite_state_mixer(spec: ModelSpec, book: Notebook) -> None:
    """The operators a Kimi delta attention's state layers run on (config.py names the kind)."""
    if spec.state.get("mixer") != "kda":
        return
    book.cite(
        "state_mixer",
        "Kimi delta attention (the gated delta rule with a decay per key channel, a causal conv "
        "over q | k | v): the converted layer runs causal_conv1d_fn / causal_conv1d_update and "
        "chunk_kda (prefill) / fused_recurrent_kda (decode) on the paged conv and SSM states; "
        "torch_npu 2.13.0 has no operator for the rule (npu_chunk_gated_delta_rule takes one "
        "decay per head, npu_recurrent_gated_delta_rule's per-channel gk is 暂不支持), so the "
        "rule runs as the bundled runtime's reference",
        book.cfg(spec.sources.get("state") or "linear_num_heads"),
    )


def code_notes(
    facts: dict[str, Any], spec, book: Notebook, *, null_layer_types: bool = False
) -> None:
    if facts.get("already_converted"):
        book.warn("the modeling code is already converted (cache_entries / get_cache_info)")
        book.cite(
            "code",
            "already paged: the attention declares cache_entries or the model get_cache_info",
            facts["already_converted_source"],
        )
    if facts.get("legacy_framework"):
        book.cite(
            "code",
            "current code is the Legacy framework path (cache_unit + scatter_update_); "
            "converting it to Paged",
            facts["legacy_framework_source"],
        )
        if any(kind != "attention" and kind != "sliding" for kind in spec.layer_kinds):
            # NOTE: the Mamba entries this Plan lists are the config's gated-delta estimate;
            # the framework-Legacy rewrite (KVR022) keeps init_cache's own state layout
            book.cite(
                "cache_entries.Mamba",
                "framework Legacy states: apply declares one MambaCacheEntry per state "
                "init_cache allocates, with its name and row shape (Qwen3.5: conv_state "
                "[conv_dim, kernel], recurrent_state [Nv, Dv, Dk]), not the estimate above",
                "rule: the framework-Legacy state rewrite (KVR022)",
            )
    if facts.get("legacy_standalone") and spec.mla is not None:
        book.cite(
            "code",
            "current code is the standalone Legacy MLA path (init_cache latent and rope caches "
            "written as rows with scatter_update_ at kv_len, read through the model's own arange "
            "block table); converting it to paged mode 3 (absorbed MLA over mode 2)",
            facts["legacy_standalone_source"],
        )
    elif facts.get("legacy_standalone"):
        book.cite(
            "code",
            "current code is the standalone Legacy path (init_cache rows + scatter_update_ at "
            "kv_len + BSH fused attention, standalone mode 1); converting it to paged mode 2",
            facts["legacy_standalone_source"],
        )
    fused = facts.get("fused_qkv")
    if fused:
        book.cite("fused_qkv", fused_qkv_note(fused), fused["split_source"] or fused["source"])
    if facts.get("cache_api") == "tuple_cat":
        book.cite(
            "code",
            "tuple cache grown with torch.cat and returned as present under use_cache "
            "(transformers 4.3x vendor style)",
            facts["cache_update_source"],
        )
    if facts.get("cache_api") == "transformers4":
        book.cite(
            "code",
            "transformers 4 style cache write (past_key_value.update)",
            facts["cache_update_source"],
        )
    kinds = {k for k in spec.layer_kinds if not holds_attention_and_state(spec, k)}
    if plannable_indexer(spec) or is_pooled(spec):
        # the indexer's keys are a cache entry of the layer (analyzer/indexer.py); a k-pool
        # indexer is refused part by part (analyzer/pooled_indexer.py)
        kinds.discard("indexed_attention")
    for kind, note in (
        ("hybrid", "layers that hold both attention KV and a Mamba state"),
        ("indexed_attention", _unplanned_indexer_note(spec)),
    ):
        if kind in kinds:
            msg = f"{note}: planned as FullAttention; the extra cache is not converted"
            book.warn(msg)
            book.block(msg)
    mixers = facts.get("linear_attention_classes") or []
    if mixers and spec.layer_pattern_source.startswith("default"):
        if null_layer_types:
            # lfm2_moe's default config: the per-layer pattern is left to the checkpoint
            msg = (
                f"the config's layer_types is null, so which layers run the state mixer "
                f"{mixers[0]} and which attend is not stated; set layer_types as the "
                "checkpoint's config.json does (--config-overrides layer_types=[...])"
            )
        else:
            # falcon-h1 style: every decoder layer runs an SSM mixer next to its attention
            msg = (
                f"state mixer {mixers[0]} runs beside attention in every layer (no layer "
                "pattern in the config); its conv/SSM state is not planned"
            )
        book.warn(msg)
        book.block(msg)
    if spec.num_mtp_layers:
        book.warn(
            f"{spec.num_mtp_layers} MTP layer(s) after the {spec.num_layers} decoder layers: "
            "without speculative decoding they are not built; with it (run "
            "--speculative-tokens) their caches join the model's (see the plan's mtp)"
        )


def _unplanned_indexer_note(spec: ModelSpec) -> str:
    note = "indexed sparse attention (a top-k indexer with its own cache)"
    problem = indexer_layers(spec).problem if spec.indexer else None
    return f"{note} whose layer pattern cannot be planned ({problem})" if problem else note
