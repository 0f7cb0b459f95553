"""The decisions of the KV design, each with its evidence.

Order follows the selection flow: per-layer kinds, attention form, whether Paged is possible
(else Legacy with the blocker), FA version, layout, sparse modes and window tokens, KV heads
per rank, cache entries. Deployment mode lives in ``deploy``, the softmax scale in ``scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvskill.analyzer.config import ATTENTION_AND_STATE_MODEL_TYPES, ModelSpec, pinned_state_dtypes
from kvskill.analyzer.evidence import Notebook, hf_window_rule_source
from kvskill.analyzer.indexer import INDEXER_KEY_CACHE, plannable_indexer
from kvskill.analyzer.layer_mla import MlaGroup
from kvskill.analyzer.plan import (
    AttentionKind,
    CacheEntryPlan,
    FaVersion,
    InputLayout,
    KvMode,
    LayerPlan,
    SparseModes,
    WindowTokens,
)
from kvskill.analyzer.roles import CodeRoles
from kvskill.analyzer.scan import ModuleFacts
from kvskill.core.attn_types import AttnType

#: layer kinds whose cache is a fixed-size state per request (grouped as Mamba)
STATE_KINDS = frozenset({"linear_attention", "mamba", "conv", "recurrent"})
#: layer kinds without any cache
NO_CACHE_KINDS = frozenset({"mlp"})
#: head dims the fused operator accepts in TND for non-MLA attention (npu_ops §7 item 10)
TND_HEAD_DIMS = frozenset({64, 128, 192})


@dataclass(frozen=True, kw_only=True)
class CodeView:
    """The scanned modeling file and the roles found in it."""

    facts: ModuleFacts
    roles: CodeRoles

    def attention_class(self):
        name = self.roles.attention[0] if self.roles.attention else None
        return self.facts.classes.get(name) if name else None

    def where(self, line: int | None) -> str:
        return self.facts.where(line) if line else self.facts.file_name


# -- layers -----------------------------------------------------------------------------------


def holds_attention_and_state(spec: ModelSpec, kind: str) -> bool:
    """A "hybrid" layer of a family whose every such layer holds an attention KV cache and a
    Mamba state (``ATTENTION_AND_STATE_MODEL_TYPES``)."""
    return (
        kind == "hybrid"
        and spec.model_type in ATTENTION_AND_STATE_MODEL_TYPES
        and spec.state.get("mixer") in ("mamba1", "mamba2")
    )


def decide_layers(spec: ModelSpec, book: Notebook) -> list[LayerPlan]:
    """One LayerPlan per decoder layer that holds a cache (MLP-only layers have none)."""
    layers: list[LayerPlan] = []
    for index, kind in enumerate(spec.layer_kinds):
        if kind in NO_CACHE_KINDS:
            continue
        if kind in STATE_KINDS:
            layers.append(LayerPlan(index=index, kind=kind, attn_type=AttnType.MAMBA.value))
        elif holds_attention_and_state(spec, kind):
            # attention and a Mamba mixer in one layer: one entry per cache group, same index
            for attn_type in (AttnType.FULL_ATTENTION, AttnType.MAMBA):
                layers.append(LayerPlan(index=index, kind=kind, attn_type=attn_type.value))
        elif kind == "sliding" or (kind == "compressed_attention" and spec.sliding_window):
            # a compressed layer's own keys are a window; its compressed entries are extra
            # cache groups (analyzer/compressed_attention.py)
            layers.append(
                LayerPlan(
                    index=index,
                    kind=("mla" if spec.mla else "attention") if kind == "sliding" else kind,
                    attn_type=AttnType.SLIDING_WINDOW.value,
                    sliding_window=spec.sliding_window,
                )
            )
        else:
            layer_kind = "mla" if spec.mla and kind == "attention" else kind
            layers.append(
                LayerPlan(index=index, kind=layer_kind, attn_type=AttnType.FULL_ATTENTION.value)
            )
    _cite_layers(spec, layers, book)
    return layers


def _cite_layers(spec: ModelSpec, layers: list[LayerPlan], book: Notebook) -> None:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.attn_type] = counts.get(layer.attn_type, 0) + 1
    summary = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    book.cite(
        "layers",
        f"{spec.num_layers} decoder layers: {summary} (pattern from {spec.layer_pattern_source})",
        book.cfg(spec.layer_pattern_source.split(" ")[0])
        if not spec.layer_pattern_source.startswith("default")
        else book.cfg(spec.sources.get("num_layers")),
    )
    if spec.sliding_window is not None and AttnType.SLIDING_WINDOW.value not in counts:
        book.cite(
            "layers",
            f"sliding_window={spec.sliding_window} is set but no layer uses it, so the model "
            "is not a sliding-window model",
            book.cfg(spec.sources.get("sliding_window")),
        )


# -- attention form, Paged vs Legacy --------------------------------------------------------


def decide_attention(spec: ModelSpec, book: Notebook) -> AttentionKind:
    if spec.mla:
        book.cite(
            "attention",
            f"MLA: kv_lora_rank={spec.mla['kv_lora_rank']} with a separate rope key of "
            f"{spec.mla['qk_rope_head_dim']} dims"
            if spec.mla["qk_rope_head_dim"]
            else f"MLA: kv_lora_rank={spec.mla['kv_lora_rank']} without a rope key "
            "(qk_rope_head_dim 0: the latent is the whole key)",
            book.cfg(spec.sources.get("mla")),
        )
        return AttentionKind.MLA
    heads, kv = spec.num_heads, spec.num_kv_heads
    form = AttentionKind.MHA if kv == heads else AttentionKind.MQA if kv == 1 else AttentionKind.GQA
    book.cite(
        "attention",
        f"{heads} query heads and {kv} KV heads -> {form.upper()}",
        book.cfg(spec.sources.get("num_kv_heads") or spec.sources.get("num_heads")),
    )
    return form


def decide_kv_mode(
    spec: ModelSpec, code: CodeView, book: Notebook, alibi: tuple[str, str] | None = None
) -> tuple[KvMode, str | None]:
    """Paged unless an operator cannot express the model's attention (then the blocker).

    ``alibi``: (name, where) of the model's ALiBi bias builder (``alibi_builder``).
    """
    blocker: str | None = None
    source = ""
    softcap_line = _softcap_line(code)
    if spec.attn_logit_softcapping is not None and softcap_line is not None:
        blocker = (
            f"attention logit soft-capping (attn_logit_softcapping={spec.attn_logit_softcapping:g})"
            ": the fused attention operators have no soft-capping parameter"
        )
        source = code.where(softcap_line)
    elif "chunked" in spec.layer_kinds:
        blocker = (
            f"chunked attention (attention_chunk_size={spec.attention_chunk_size}): a query "
            "sees only its own chunk, which no causal or band sparse_mode expresses"
        )
        source = book.cfg(spec.sources.get("attention_chunk_size") or "layer_types")
    elif alibi is not None:
        name, source = alibi
        blocker = (
            f"ALiBi position bias ({name}): the fused attention takes a position bias only as "
            "pse_shift, which references/npu_ops.md does not document on the paged TND path, "
            "and neither FA version takes ALiBi slopes (no pse_type in the torch_npu 2.13.0 "
            "schema)"
        )
    if blocker:
        book.cite("kv_mode", f"Legacy: Paged + FA is impossible because of {blocker}", source)
        return KvMode.LEGACY, blocker
    if spec.attn_logit_softcapping is not None:
        book.cite(
            "kv_mode",
            "attn_logit_softcapping is set but the attention code never applies it",
            book.cfg("attn_logit_softcapping"),
        )
    book.cite(
        "kv_mode",
        "Paged: every layer's attention maps onto the fused operator (no soft-capping, "
        "no chunked attention, no ALiBi)",
        "rule: Paged unless an operator cannot express the attention",
    )
    return KvMode.PAGED, None


def alibi_builder(spec: ModelSpec, code: CodeView, book: Notebook) -> tuple[str, str] | None:
    """(name, where) of the function that builds an ALiBi bias the model adds, else None.

    Bloom's ``build_alibi_tensor``, MPT's ``build_mpt_alibi_tensor``, Baichuan-13B's
    ``_gen_alibi_mask`` (module functions or methods). A file that reads ``config.alibi``
    (Falcon) adds it only when the config says so; one that builds it unconditionally (MPT
    ignores ``attn_config.alibi``) always does.
    """
    facts = code.facts
    found = [(name, line) for name, line in facts.functions.items() if "alibi" in name.lower()]
    for cls in facts.classes.values():
        found += [
            (f"{cls.name}.{m}", line) for m, line in cls.methods.items() if "alibi" in m.lower()
        ]
    if not found:
        return None
    switch = facts.config_reads.get("alibi")
    if switch is not None and not spec.alibi:
        book.cite(
            "position_bias",
            f"no ALiBi: the code adds it only under config.alibi, which is {spec.alibi}",
            code.where(switch),
        )
        return None
    name, line = min(found, key=lambda item: item[1])
    book.cite(
        "position_bias",
        f"ALiBi: {name} builds a per-head linear bias of the key distance that the attention "
        "adds to its scores",
        code.where(line),
    )
    return name, code.where(line)


def _softcap_line(code: CodeView) -> int | None:
    for name in code.roles.attention:
        cls = code.facts.classes.get(name)
        if cls is None:
            continue
        for key in ("softcap", "attn_logit_softcapping", "logit_softcapping"):
            if key in cls.names_used:
                return cls.names_used[key]
    return None


# -- FA version, layout, sparse modes ------------------------------------------------------------


def sinks_line(code: CodeView) -> int | None:
    for name in code.roles.attention:
        cls = code.facts.classes.get(name)
        if cls is None:
            continue
        if "sinks" in cls.self_attrs:
            return cls.self_attrs["sinks"]
        for key in ("s_aux", "sinks", "learnable_sink", "attention_sinks"):
            if key in cls.names_used:
                return cls.names_used[key]
    return None


def decide_fa_version(code: CodeView, book: Notebook) -> tuple[FaVersion, str]:
    line = sinks_line(code)
    if line is not None:
        reason = (
            "learnable attention sinks: only FA v2 (npu_fused_infer_attention_score_v2) "
            "takes learnable_sink"
        )
        book.cite("fa_version", reason, code.where(line))
        return FaVersion.V2, reason
    reason = "no learnable sinks or other v2-only feature, so FA v1 (the default for GQA/MoE)"
    book.cite("fa_version", reason, code.facts.file_name)
    return FaVersion.V1, reason


def decide_layout(
    kv_mode: KvMode, attention: AttentionKind, book: Notebook
) -> tuple[InputLayout, bool]:
    """(input_layout, mla_absorb)."""
    if kv_mode is KvMode.LEGACY:
        book.cite(
            "input_layout",
            "Legacy keeps one static row per request (batch-major, BSH) and the model's own "
            "attention reads it",
            "rule",
        )
        return InputLayout.BSH, False
    if attention is AttentionKind.MLA:
        book.cite(
            "mla_absorb",
            "MLA: absorb kv_b_proj so attention runs on the latent cache (key = value = "
            "nope cache, rope passed separately)",
            "rule: MLA -> absorb",
        )
        book.cite("input_layout", "MLA absorb uses TND_NTD", "rule")
        return InputLayout.TND_NTD, True
    book.cite("input_layout", "packed variable-length tokens: TND", "rule")
    return InputLayout.TND, False


def decide_sparse_modes(
    kv_mode: str,
    attention: str,
    attn_types: list[str],
    window: int | None,
    book: Notebook,
    *,
    indexed: bool = False,
) -> tuple[dict[str, SparseModes], dict[str, WindowTokens]]:
    """sparse_mode per attn_type and pre/next tokens for windows (``indexed``: MLA whose
    indexer's top-k picks the keys, attended by the sparse attention operator)."""
    if kv_mode is KvMode.LEGACY:
        return {}, {}
    modes: dict[str, SparseModes] = {}
    windows: dict[str, WindowTokens] = {}
    for attn_type in attn_types:
        if attn_type == AttnType.MAMBA.value:
            continue
        if attn_type == AttnType.SLIDING_WINDOW.value and window:
            modes[attn_type] = SparseModes(prefill=4, decode=4)
            windows[attn_type] = WindowTokens(pre_tokens=window - 1, next_tokens=0)
            book.cite(
                f"sparse_mode.{attn_type}",
                f"band mask (4) in prefill and decode; the model's window W={window} includes "
                f"the query itself (key j visible iff j > i - W), and pre_tokens=P admits P+1 "
                f"keys with the diagonal, so pre_tokens={window - 1}, next_tokens=0",
                f"{hf_window_rule_source()}; npu_ops.md §1.5",
            )
        elif attention is AttentionKind.MLA and indexed:
            modes[attn_type] = SparseModes(prefill=3, decode=3)
            book.cite(
                f"sparse_mode.{attn_type}",
                "DSA: the indexer and the sparse attention are causal (3, bottom-right) in "
                "prefill and decode; they take no mask, the indexer's top-k picks the keys",
                "rule: npu_lightning_indexer / npu_sparse_flash_attention sparse_mode 3",
            )
        elif attention is AttentionKind.MLA:
            modes[attn_type] = SparseModes(prefill=3, decode=0)
            book.cite(
                f"sparse_mode.{attn_type}",
                "MLA absorb: causal (3) with the 2048x2048 mask in prefill; dense (0) without a "
                "mask for single-token decode",
                "rule: MLA absorb prefill 3 / decode 0",
            )
        else:
            modes[attn_type] = SparseModes(prefill=3, decode=3)
            book.cite(
                f"sparse_mode.{attn_type}",
                "causal (3) with the 2048x2048 bool mask, the same in prefill and decode",
                "rule: TND paged full attention",
            )
    return modes, windows


# -- scale, heads, cache entries ----------------------------------------------------------------


def decide_kv_heads(spec: ModelSpec, attn_tp_size: int, book: Notebook) -> int:
    if spec.mla:
        book.cite(
            "num_key_value_heads_per_rank",
            f"MLA latent KV is one head and is not split across attn_tp_size={attn_tp_size}",
            "rule: MLA latent not split",
        )
        return 1
    per_rank = max(spec.num_kv_heads // attn_tp_size, 1)
    book.cite(
        "num_key_value_heads_per_rank",
        f"max({spec.num_kv_heads} // {attn_tp_size}, 1) = {per_rank}",
        f"{book.cfg(spec.sources.get('num_kv_heads'))}; flag --attn-tp-size",
    )
    if attn_tp_size > spec.num_kv_heads:
        book.warn(
            f"attn_tp_size={attn_tp_size} exceeds the {spec.num_kv_heads} KV heads: every rank "
            f"holds 1 KV head (replicated {attn_tp_size // max(spec.num_kv_heads, 1)}x)"
        )
    elif spec.num_kv_heads % attn_tp_size:
        book.warn(
            f"{spec.num_kv_heads} KV heads do not divide by attn_tp_size={attn_tp_size}; "
            f"{per_rank} per rank leaves heads unassigned"
        )
    return per_rank


def sliding_kv_heads(
    spec: ModelSpec, code: CodeView, attn_tp_size: int, book: Notebook
) -> int | None:
    """KV heads per rank of sliding layers whose attention ``__init__`` multiplies the
    config's count (MiMo-V2-Flash: ``num_key_value_heads * 2 if is_swa``), else None."""
    cls = code.attention_class()
    found = cls.sliding_kv_head_factor if cls is not None else None
    if found is None:
        return None
    factor, line = found
    heads = spec.num_kv_heads * factor
    per_rank = max(heads // attn_tp_size, 1)
    book.cite(
        "cache_entries.SlidingWindow",
        f"sliding layers have {factor} x {spec.num_kv_heads} = {heads} KV heads "
        f"({per_rank} per rank), set in the attention __init__",
        code.where(line),
    )
    return per_rank


def cache_entries(
    spec: ModelSpec,
    attn_types: list[str],
    kv_heads_per_rank: int,
    attn_tp_size: int,
    sliding_kv_heads_per_rank: int | None = None,
    mla_groups: list[MlaGroup] | None = None,
) -> dict[str, list[CacheEntryPlan]]:
    """The caches one layer of each attn_type declares.

    ``sliding_kv_heads_per_rank``: the sliding layers' own KV heads when the code gives them
    more than the config's count (see ``sliding_kv_heads``). ``mla_groups``: the MLA layers by
    attn_type, indexer use and their own dims (``analyzer.layer_mla``); an attn_type whose
    layers differ in latent dims is refused before the entries are written.
    """
    dtype = spec.dtype
    entries: dict[str, list[CacheEntryPlan]] = {}
    for attn_type in attn_types:
        if attn_type == AttnType.MAMBA.value:
            entries[attn_type] = _state_entries(spec, attn_tp_size)
        elif spec.mla:
            # the latent of this attn_type's layers (per-layer dims where the config gives
            # them), the indexer's keys only where one of them runs the indexer
            groups = [g for g in mla_groups or [] if g.attn_type == attn_type]
            dims = groups[0].dims if groups else spec.mla
            window = groups[0].sliding_window if groups else None
            entries[attn_type] = [
                _entry("nope_cache", int(dims["kv_lora_rank"] or 0), 1, dtype, window),
            ]
            # a latent without rope (qk_rope_head_dim 0) keeps no rope key
            if dims["qk_rope_head_dim"]:
                entries[attn_type].append(
                    _entry("rope_cache", int(dims["qk_rope_head_dim"]), 1, dtype, window)
                )
            indexed = any(g.indexed for g in groups) if groups else True
            if plannable_indexer(spec) and indexed:
                assert spec.indexer is not None
                entries[attn_type].append(
                    _entry(INDEXER_KEY_CACHE, spec.indexer["head_dim"], 1, dtype)
                )
        else:
            sliding = attn_type == AttnType.SLIDING_WINDOW.value
            window = spec.sliding_window if sliding else None
            heads = kv_heads_per_rank
            if sliding and sliding_kv_heads_per_rank is not None:
                heads = sliding_kv_heads_per_rank
            entries[attn_type] = [
                _entry("k_cache", spec.head_dim, heads, dtype, window),
                _entry("v_cache", spec.v_head_dim, heads, dtype, window),
            ]
    return entries


def _entry(name: str, dim, num_head: int, dtype: str, window: int | None = None) -> CacheEntryPlan:
    return CacheEntryPlan(
        cache_name=name, dim=dim, num_head=num_head, dtype=dtype, sliding_window=window
    )


def _state_entries(spec: ModelSpec, attn_tp_size: int) -> list[CacheEntryPlan]:
    state = spec.state
    if not state:
        return []
    # each state in its own dtype: the one the model pins, else the model's
    pinned = pinned_state_dtypes(state)
    conv_dim = max(state["conv_dim"] // attn_tp_size, 1)
    conv_dtype = pinned.get("conv_state", spec.dtype)
    entries = [_entry("conv_state", [state["conv_kernel"] - 1, conv_dim], 1, conv_dtype)]
    if state.get("num_state_heads"):
        heads = max(state["num_state_heads"] // attn_tp_size, 1)
        dims = [state["state_k_dim"], state["state_v_dim"]]
        entries.append(_entry("ssm_state", dims, heads, pinned.get("ssm_state", spec.dtype)))
    return entries
