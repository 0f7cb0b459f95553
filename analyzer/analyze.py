"""``analyze_model``: MODEL -> Plan (inputs, config, code scan, rules, memory).

``plan_for_source`` decides the Plan of a resolved source in these stages, in order; each
records its evidence in one ``Notebook``, so the Plan's evidence follows this order:

1. the decoder: a composite model's language model, or the text decoder its own file
   defines (``decoder_source.py``); the modeling file's facts and class roles, refusing what
   is no causal decoder (``_read_code``). A file with no attention of its own is planned
   from where its attention comes (``_plan_elsewhere``).
2. the config, normalised as the code reads it; the tensor-parallel split (``_read_config``)
3. the deploy mode (``decide_deploy_mode``)
4. every layer's kind and attn_type, and cross-layer KV sharing (``_decide_layers``)
5. attention kind, KV mode, FA version, layout, sparse modes, softmax scale, KV heads per
   rank (``_decide_attention``)
6. the cache entries of each attn_type (``_decide_cache_entries``); KV bytes per token and
   blocks for the memory budget (``_size_caches``)
7. the code record and its notes (``_read_code_facts``); the common-error table and the
   operators' limits (``_add_checks``); rope style (``_cite_rope``); the MLA cache write
   (``_mla_cache_write``)
8. the Plan (``_assemble_plan``)

The notes the stages add beside their decisions live in ``plan_notes.py``.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvskill.analyzer.code_facts import RopeDecision, code_facts, rope_style
from kvskill.analyzer.compressed_attention import (
    compressed_cache_entries,
    decide_compressed_attention,
    layer_types_of,
)
from kvskill.analyzer.compressed_attention import refusal as compressed_refusal
from kvskill.analyzer.compressed_features import blockers as compressed_blockers
from kvskill.analyzer.compressed_features import compressed_features, converted_attention
from kvskill.analyzer.compressed_features import operator_limits as compressed_operator_limits
from kvskill.analyzer.config import ModelSpec, normalise, text_config
from kvskill.analyzer.config_keys import (
    attribute_map_for,
    cite_vendor_keys,
    source_config_defaults,
)
from kvskill.analyzer.decoder_source import (
    language_model_source,
    own_text_decoder,
    refuse_encoder,
    refuse_non_causal,
    wrapped_language_model,
)
from kvskill.analyzer.deploy import decide_deploy_mode
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.indexer import (
    INDEXER_KEY_CACHE,
    decide_indexer,
    indexer_layers,
    plannable_indexer,
    reads_sparsely,
)
from kvskill.analyzer.inherited import (
    inherited_attention,
    inherited_attention_reason,
    inherited_module,
    sibling_module,
)
from kvskill.analyzer.inputs import (
    ModelSource,
    causal_lm_class_name,
    resolve_model,
    transformers_root,
)
from kvskill.analyzer.kv_sharing import (
    KvSharing,
    share_layers,
    sharing_of_source,
    sharing_record,
)
from kvskill.analyzer.kv_sizing import ConfigView, apply_code_sizing, sizing_of_source
from kvskill.analyzer.layer_mla import MlaGroup, cite_mla_groups, mla_groups
from kvskill.analyzer.legacy_rows import legacy_rows_reason
from kvskill.analyzer.memory import plan_memory
from kvskill.analyzer.mla_layers import cite_mla_layers
from kvskill.analyzer.mla_write import FUSED, SCATTER, decide_mla_cache_write
from kvskill.analyzer.mtp import mtp_plan
from kvskill.analyzer.op_limits import add_operator_limits
from kvskill.analyzer.pitfalls import add_pitfalls
from kvskill.analyzer.plan import (
    AttentionKind,
    CacheEntryPlan,
    CompressedAttentionPlan,
    DeployMode,
    Evidence,
    FaVersion,
    InputLayout,
    KvMode,
    LayerPlan,
    Plan,
    PlanSource,
    SparseModes,
    WindowTokens,
)
from kvskill.analyzer.plan_notes import (
    cite_config_branches,
    cite_decoder_origin,
    cite_state_entries,
    cite_state_mixer,
    code_notes,
    window_only_in_cache,
)
from kvskill.analyzer.pooled_indexer import (
    decide_pooled_indexer,
    is_pooled,
    pooled_cache_entries,
)
from kvskill.analyzer.roles import find_roles
from kvskill.analyzer.rules import (
    CodeView,
    alibi_builder,
    cache_entries,
    decide_attention,
    decide_fa_version,
    decide_kv_heads,
    decide_kv_mode,
    decide_layers,
    decide_layout,
    decide_sparse_modes,
    sinks_line,
    sliding_kv_heads,
)
from kvskill.analyzer.scale import ScaleDecision, decide_scale
from kvskill.analyzer.scan import scan_file
from kvskill.analyzer.state_cache import state_cache
from kvskill.core.attn_types import AttnType
from kvskill.core.config_checks import check_tp_split
from kvskill.core.errors import BadInputError, UnsupportedModelError

DEFAULT_BLOCK_SIZE = 128
_ATTN_TYPE_ORDER = {t.value: i for i, t in enumerate(AttnType)}


@contextmanager
def _quiet_transformers():
    # Config classes log validation chatter (token ids outside a default vocab, ...).
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def analyze_model(
    model: str,
    *,
    deploy_mode: str = "auto",
    config_overrides: dict[str, Any] | None = None,
    attn_tp_size: int = 1,
    block_size: int | None = None,
    kv_memory_bytes: int | None = None,
    hbm_gb: float | None = None,
    prompt_file: Path | None = None,
) -> Plan:
    """Decide the KV-cache design of MODEL (a directory or a transformers model type).

    PROMPT_FILE is the task prompt; a ``部署模式:`` line there decides the deploy mode
    when DEPLOY_MODE is "auto" (``deploy.py``).

    Raises BadInputError (exit 2) for unusable input and UnsupportedModelError (exit 3) for
    a model that cannot be served (no causal decoder). Never imports the model's code.
    """
    if deploy_mode not in ("auto", "framework", "standalone"):
        raise BadInputError(
            f"deploy mode '{deploy_mode}' is not one of auto, framework, standalone"
        )
    if attn_tp_size < 1:
        raise BadInputError(f"attn_tp_size must be >= 1, got {attn_tp_size}")
    if block_size is not None and block_size < 1:
        raise BadInputError(f"block_size must be >= 1, got {block_size}")
    with _quiet_transformers():
        source = resolve_model(model, config_overrides)
    return plan_for_source(
        source,
        deploy_mode=deploy_mode,
        attn_tp_size=attn_tp_size,
        block_size=block_size or DEFAULT_BLOCK_SIZE,
        kv_memory_bytes=kv_memory_bytes,
        hbm_gb=hbm_gb,
        prompt_file=prompt_file,
    )


def attention_sublayers(code: CodeView, book: Notebook) -> int:
    """Attention modules per decoder layer, as the decoder layer's ``__init__`` builds them:
    LongCat-Flash keeps ``nn.ModuleList([Attention(...) for i in [0, 1]])``, so each decoder
    layer holds two caches' worth of KV (each sublayer is one layer of ``get_cache_info``)."""
    facts = code.facts
    layer = facts.classes.get(code.roles.decoder_layer or "")
    if layer is None:
        return 1
    attention = set(code.roles.attention)
    # NOTE: only a container of attention modules multiplies: a second single attribute is
    # usually conditional (GPT-2's cross-attention exists only with add_cross_attention)
    held = {
        attr: layer.attr_counts[attr]
        for attr, names in layer.attr_classes.items()
        if attention.intersection(names) and layer.attr_counts.get(attr, 1) > 1
    }
    if not held:
        return 1
    attr, total = max(held.items(), key=lambda item: item[1])
    book.cite(
        "layers",
        f"each decoder layer holds {total} attention sublayers (self.{attr}); every sublayer "
        "has its own cache entries, so KV bytes and blocks count them all",
        f"{facts.file_name}:{layer.self_attrs.get(attr, layer.line)}",
    )
    return total


def _inherited_source(source: ModelSource, facts) -> ModelSource | None:
    """The remote file's model planned from the transformers modeling file its attention
    classes come from (``analyzer/inherited.py``), with the remote file's config; None when
    the file takes no attention from transformers, or from several modules."""
    module = inherited_module(facts) if source.kind == "remote_code" else None
    if module is None:
        return None
    path = transformers_root().joinpath(*module.split(".")[1:]).with_suffix(".py")
    if not path.is_file():
        return None
    return replace(source, modeling_file=str(path))


def _converted_sibling_plan(source: ModelSource, facts, options: dict) -> Plan | None:
    """The Plan of the converted module beside a remote file that takes its attention from it
    (``from .modeling_llama import LlamaAttention``): an output apply wrote for an inherited
    attention, read again. None when the file takes none from a module beside it, or that
    module is not converted code (the refusal then names the file's classes as before)."""
    module = sibling_module(facts) if source.kind == "remote_code" else None
    if module is None:
        return None
    path = Path(source.modeling_file).parent / f"{module[1:]}.py"
    if not path.is_file():
        return None
    try:
        plan = plan_for_source(replace(source, modeling_file=str(path)), **options)
    except UnsupportedModelError:
        return None
    return plan if plan.code.get("already_converted") else None


def _inheriting_plan(plan: Plan, source: ModelSource, facts, roles) -> Plan:
    """PLAN (made from the inherited transformers file, or the converted module beside the
    file) for the remote file: its own causal-LM class, its source, and the evidence of where
    the attention comes from."""
    inherits = plan.source.modeling_file
    beside = Path(inherits).parent == Path(source.modeling_file).parent
    found = inherited_attention(facts) or [
        f"{cls.name} {'subclasses' if base in cls.bases else 'builds'} {base} from "
        f"{Path(inherits).name} beside it"
        for cls in facts.classes.values()
        for base in (*cls.bases, *sorted({n for ns in cls.attr_classes.values() for n in ns}))
        if f".{Path(inherits).stem}.{base}" in facts.imported_names
        and base.endswith(("Attention", "DecoderLayer"))
    ]
    how = (
        "which is already converted (an output of apply): nothing is rewritten"
        if beside
        else "so that file is planned and converted into the output directory, and this file "
        "imports it from there"
    )
    cited = Evidence(
        decision="source",
        reason="; ".join(found) + f": the attention is {Path(inherits).name}'s, " + how,
        source=f"{facts.file_name}:{facts.classes[roles.causal_lm].line}",
    )
    return replace(
        plan,
        architecture=roles.causal_lm,
        source=PlanSource(**{**source.as_plan_source(), "inherits_code": inherits}),
        evidence=[cited, *plan.evidence],
    )


def plan_for_source(
    source: ModelSource,
    *,
    deploy_mode: str,
    attn_tp_size: int,
    block_size: int,
    kv_memory_bytes: int | None,
    hbm_gb: float | None,
    prompt_file: Path | None = None,
) -> Plan:
    """All decisions for a resolved source, stage by stage (listed in the module docstring).

    Every stage that decides something records its evidence in one ``Notebook``, in stage
    order; the Plan's ``evidence`` and ``warnings`` keep that order.
    """
    # A composite model's language model is planned with the same options.
    options = dict(
        deploy_mode=deploy_mode,
        attn_tp_size=attn_tp_size,
        block_size=block_size,
        kv_memory_bytes=kv_memory_bytes,
        hbm_gb=hbm_gb,
        prompt_file=prompt_file,
    )
    language_model = wrapped_language_model(source)
    if language_model is not None:
        return plan_for_source(language_model, **options)
    source = own_text_decoder(source)
    code = _read_code(source)
    if not code.roles.attention and not code.roles.linear_attention:
        return _plan_elsewhere(source, code, options)
    book = Notebook(source=source)
    read = _read_config(source, code, attn_tp_size, book)
    spec = read.spec
    mode = decide_deploy_mode(
        deploy_mode,
        source.runner_files,
        book,
        prompt_file=prompt_file,
        model_dir=None if source.kind == "transformers" else Path(source.path),
    )
    layers = _decide_layers(source, code, read, book)
    design = _decide_attention(spec, code, layers.attn_types, attn_tp_size, book)
    groups = _mla_layer_groups(spec, layers.layers, book)
    entries = _decide_cache_entries(source, spec, layers, design, attn_tp_size, groups, book)
    if is_pooled(spec):
        entries = pooled_cache_entries(spec, entries, AttnType.FULL_ATTENTION.value)
    compressed = _decide_compressed_attention(source, code, spec, attn_tp_size, book)
    if compressed is not None:
        entries = compressed_cache_entries(compressed)
    caches = _size_caches(
        source,
        code,
        spec,
        layers,
        entries,
        design.kv_mode,
        block_size=block_size,
        kv_memory_bytes=kv_memory_bytes,
        hbm_gb=hbm_gb,
        book=book,
    )
    facts = _read_code_facts(source, code, read, layers.sharing, book)
    _add_checks(
        spec,
        code,
        design,
        facts,
        mode,
        layers.attn_types,
        attn_tp_size,
        block_size,
        book,
        fused_attention=compressed is None,
        mla_groups=groups,
    )
    rope = _cite_rope(source, code, spec, book)
    cache_write = (
        _mla_cache_write(source, spec, book, indexed=reads_sparsely(spec))
        if design.attention is AttentionKind.MLA
        else None
    )
    return _assemble_plan(
        source=source,
        code=code,
        spec=spec,
        mode=mode,
        layers=layers,
        design=design,
        caches=caches,
        facts=facts,
        rope=rope,
        cache_write=cache_write,
        attn_tp_size=attn_tp_size,
        block_size=block_size,
        book=book,
        compressed=compressed,
    )


# ---- stage 1: the decoder's source and code -------------------------------------------------


def _read_code(source: ModelSource) -> CodeView:
    """The modeling file's facts and the roles of its classes; refuses what is not a causal
    decoder (encoder-decoder, encoder-only, no causal-LM class, bidirectional unless a flag)."""
    refuse_non_causal(source)
    facts = scan_file(source.modeling_file)
    hint = causal_lm_class_name(source.model_type) if source.kind != "remote_code" else None
    if source.kind == "remote_code":
        auto = (source.config.get("auto_map") or {}).get("AutoModelForCausalLM")
        hint = auto.split(".")[-1] if isinstance(auto, str) else None
    hint = source.vision_language_head or hint
    roles = find_roles(facts, hint)
    code = CodeView(facts=facts, roles=roles)
    if roles.causal_lm is None:
        raise UnsupportedModelError(
            f"{facts.file_name} defines no *ForCausalLM class; not a causal decoder"
        )
    refuse_encoder(source, facts)
    return code


def _plan_elsewhere(source: ModelSource, code: CodeView, options: dict) -> Plan:
    """A file with no attention class of its own: the Plan of the language model it builds
    from text_config, of the transformers file or the converted module beside it that its
    attention comes from; else the refusal that says why."""
    facts, roles = code.facts, code.roles
    inner = language_model_source(source)
    if inner is not None:
        return plan_for_source(inner, **options)
    inherited = _inherited_source(source, facts)
    if inherited is not None:
        return _inheriting_plan(plan_for_source(inherited, **options), source, facts, roles)
    converted = _converted_sibling_plan(source, facts, options)
    if converted is not None:
        return _inheriting_plan(converted, source, facts, roles)
    raise UnsupportedModelError(
        inherited_attention_reason(facts)
        or legacy_rows_reason(facts, source.config)
        or f"{facts.file_name}: no attention class that writes a KV cache or runs attention"
    )


# ---- stage 2: the config, as the code reads it ----------------------------------------------


@dataclass(frozen=True)
class _ConfigRead:
    """The normalised config and what it took to read it."""

    spec: ModelSpec
    #: the model's config attribute aliases (``attribute_map``)
    attribute_map: dict[str, str]
    #: the Plan's ``code.kv_heads`` record: the KV heads the attention's code sizes, or None
    code_sizing: dict[str, Any] | None


def _read_config(
    source: ModelSource, code: CodeView, attn_tp_size: int, book: Notebook
) -> _ConfigRead:
    """Normalise the config (KV heads as the attention's ``__init__`` sizes them), check the
    tensor-parallel split, and cite where the values come from."""
    remote = source.kind == "remote_code"
    attribute_map = attribute_map_for(
        source.model_type, source.config, Path(source.path) if remote else None, remote=remote
    )
    spec = normalise(
        source.config,
        uses_sliding_window=_code_reads_window(code),
        derived=source.derived,
        attribute_map=attribute_map,
    )
    spec, code_sizing = _sized_by_code(source, code, spec, attribute_map, book)
    check_tp_split(spec.num_heads, spec.num_kv_heads, attn_tp_size, mla=spec.mla is not None)
    cite_vendor_keys(spec, attribute_map, book)
    cite_config_branches(code.facts, source, book)
    cite_decoder_origin(source, code, book)
    return _ConfigRead(spec=spec, attribute_map=attribute_map, code_sizing=code_sizing)


# ---- stage 3: layers ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layers:
    """Every layer's kind and attn_type, and the cross-layer KV sharing they follow."""

    layers: list[LayerPlan]
    #: sorted in AttnType order
    attn_types: list[str]
    sharing: KvSharing | None


def _decide_layers(
    source: ModelSource, code: CodeView, read: _ConfigRead, book: Notebook
) -> _Layers:
    spec = read.spec
    layers = decide_layers(spec, book)
    sharing = _kv_sharing(source, code, spec, read.attribute_map)
    layers = share_layers(layers, sharing, code.where, book)
    window_only_in_cache(spec, book)
    if not layers:
        raise UnsupportedModelError(f"'{source.model_type}': no layer holds a KV cache or state")
    attn_types = sorted({layer.attn_type for layer in layers}, key=_ATTN_TYPE_ORDER.get)
    return _Layers(layers=layers, attn_types=attn_types, sharing=sharing)


# ---- stage 4: attention and its operator ----------------------------------------------------


@dataclass(frozen=True)
class _AttentionDesign:
    """The attention's kind, KV mode, fused-operator version and parameters, per rank."""

    attention: AttentionKind
    #: the ALiBi bias builder (name, where) when the model adds one
    alibi: tuple[str, str] | None
    kv_mode: KvMode
    legacy_reason: str | None
    fa_version: FaVersion
    fa_reason: str
    layout: InputLayout
    absorb: bool
    sparse_modes: dict[str, SparseModes]
    window_tokens: dict[str, WindowTokens]
    scale: ScaleDecision
    kv_heads: int
    #: KV heads per rank of the sliding-window layers when they differ, else None
    sliding_heads: int | None


def _decide_attention(
    spec: ModelSpec, code: CodeView, attn_types: list[str], attn_tp_size: int, book: Notebook
) -> _AttentionDesign:
    attention = decide_attention(spec, book)
    alibi = alibi_builder(spec, code, book)
    kv_mode, legacy_reason = decide_kv_mode(spec, code, book, alibi)
    fa_version, fa_reason = decide_fa_version(code, book)
    layout, absorb = decide_layout(kv_mode, attention, book)
    modes, windows = decide_sparse_modes(
        kv_mode, attention, attn_types, spec.sliding_window, book, indexed=reads_sparsely(spec)
    )
    scale = decide_scale(spec, code, book)
    kv_heads = decide_kv_heads(spec, attn_tp_size, book)
    sliding_heads = (
        sliding_kv_heads(spec, code, attn_tp_size, book)
        if AttnType.SLIDING_WINDOW.value in attn_types
        else None
    )
    return _AttentionDesign(
        attention=attention,
        alibi=alibi,
        kv_mode=kv_mode,
        legacy_reason=legacy_reason,
        fa_version=fa_version,
        fa_reason=fa_reason,
        layout=layout,
        absorb=absorb,
        sparse_modes=modes,
        window_tokens=windows,
        scale=scale,
        kv_heads=kv_heads,
        sliding_heads=sliding_heads,
    )


# ---- stage 5: cache entries and their memory ------------------------------------------------


def _decide_cache_entries(
    source: ModelSource,
    spec: ModelSpec,
    layers: _Layers,
    design: _AttentionDesign,
    attn_tp_size: int,
    groups: list[MlaGroup],
    book: Notebook,
) -> dict[str, list[CacheEntryPlan]]:
    """The cache entries each attn_type declares (per rank), and where state sizes come from."""
    entries = cache_entries(
        spec,
        layers.attn_types,
        design.kv_heads,
        attn_tp_size,
        design.sliding_heads,
        mla_groups=groups,
    )
    cite_state_entries(entries, source, book)
    cite_state_mixer(spec, book)
    return entries


def _mla_layer_groups(spec: ModelSpec, layers: list[LayerPlan], book: Notebook) -> list[MlaGroup]:
    """The MLA layers grouped by what they are (``analyzer.layer_mla``), cited when they
    differ; layers of one attn_type with different latent dims cannot share one cache group."""
    indexed = set(indexer_layers(spec).owners) if plannable_indexer(spec) else set()
    groups = mla_groups(spec, layers, indexed)
    cite_mla_groups(groups, book, book.cfg(spec.sources.get("layer_overrides")))
    by_type: dict[str, set[tuple]] = {}
    for group in groups:
        by_type.setdefault(group.attn_type, set()).add(tuple(group.dims.items()))
    for attn_type, dims in by_type.items():
        if len(dims) > 1:
            msg = (
                f"{attn_type} MLA layers differ in latent dims ({len(dims)} kinds); the layers "
                "of one attn_type share one cache group with one entry width"
            )
            book.warn(msg)
            book.block(msg)
    return groups


def _decide_compressed_attention(
    source: ModelSource, code: CodeView, spec: ModelSpec, attn_tp_size: int, book: Notebook
) -> CompressedAttentionPlan | None:
    """Compressed layers (DeepSeek-V4): their kinds, caches, operators and sub-features; a
    one-line blocker naming the attention class, its compressor call and what stops the rewrite
    (a limit hit, a construct missing), else the evidence that it converts."""
    compressed = decide_compressed_attention(spec, source.config, book)
    if compressed is None:
        return None
    # the class that calls its compressor (a cache layer class may come first in the file)
    owners = [
        n
        for n, c in code.facts.classes.items()
        if any(a == "compressor" for a, _ in c.module_calls)
    ]
    name = (
        owners[0]
        if owners
        else code.roles.attention[0]
        if code.roles.attention
        else "the attention"
    )
    cls = code.facts.classes.get(name)
    # the forward's self.compressor(...) call (module_calls records self.<attr>(...) lines)
    calls = [line for attr, line in (cls.module_calls if cls else []) if attr == "compressor"]
    where = code.where(calls[0]) if calls else code.facts.file_name
    sinks = sinks_line(code)
    features = (
        compressed_features(
            Path(source.modeling_file).read_text(encoding="utf-8"),
            code.facts.file_name,
            name,
            head_dim=spec.head_dim,
            ratios={k.layer_type: k.compress_ratio for k in compressed.kinds},
            sinks_line=sinks,
            window=int(spec.sliding_window or 0),
        )
        if source.modeling_file and cls is not None
        else []
    )
    compressed = replace(
        compressed,
        sinks=f"{name}.sinks ({code.where(sinks)})" if sinks else None,
        sub_features=features,
    )
    cfg = text_config(source.config)[0]
    types = layer_types_of(source.config) or []
    reasons = compressed_blockers(features, types)
    done = (
        converted_attention(
            Path(source.modeling_file).read_text(encoding="utf-8"), code.facts.file_name
        )
        if source.modeling_file and not owners
        else None
    )
    if done is None and (cls is None or not source.modeling_file):
        reasons.append("no attention class with a compressor call was read")
    for limit in compressed_operator_limits(
        max(spec.num_heads // attn_tp_size, 1),
        spec.head_dim,
        cfg.get("index_topk") if "compressed_sparse_attention" in types else None,
    ):
        book.warn(limit)  # the device's sizes: a shrunk twin still verifies on the CPU
    if done is not None:
        reason = (
            f"{done} is already a converted compressed attention (win_kv read by "
            "npu_sparse_attn_sharedkv): apply converts the source model, not its output"
        )
        book.warn(reason)
        book.block(reason)
    elif reasons:
        reason = compressed_refusal(compressed, name, where, reasons)
        book.warn(reason)
        book.block(reason)
    else:
        book.cite(
            "compressed_attention",
            f"{name}: window, compressor state, CSA indexer and HCA found as the paged rewrite "
            "reads them (KVR028 / KVR029)",
            where,
        )
    return compressed


@dataclass(frozen=True)
class _Caches:
    entries: dict[str, list[CacheEntryPlan]]
    #: the memory plan (``analyzer/memory.py``)
    memory: dict[str, Any]
    kv_bytes_per_token: int


def _size_caches(
    source: ModelSource,
    code: CodeView,
    spec: ModelSpec,
    layers: _Layers,
    entries: dict[str, list[CacheEntryPlan]],
    kv_mode: KvMode,
    *,
    block_size: int,
    kv_memory_bytes: int | None,
    hbm_gb: float | None,
    book: Notebook,
) -> _Caches:
    """KV bytes per token over all layers and sublayers, and blocks for the memory budget."""
    sublayers = attention_sublayers(code, book)
    # a layer reading another's cache (cross-layer KV sharing) holds no bytes of its own
    counts = {
        t: sum(1 for layer in layers.layers if layer.attn_type == t and layer.kv_source is None)
        * (1 if t == AttnType.MAMBA.value else sublayers)
        for t in layers.attn_types
    }
    entries = _with_indexer_layers(entries, _indexer_key_layers(spec, sublayers))
    memory = plan_memory(
        spec=spec,
        config=source.config,
        cache_entries=entries,
        layer_counts=counts,
        block_size=block_size,
        kv_memory_bytes=kv_memory_bytes,
        hbm_gb=hbm_gb,
        legacy_row_tokens=(spec.max_positions or None) if kv_mode is KvMode.LEGACY else None,
    )
    if memory.get("budget_fits") is False and memory.get("kv_memory_bytes"):
        book.warn(
            f"the KV budget ({memory['kv_memory_bytes']} bytes) is smaller than the window and "
            f"state pools kvskill run reserves first ({memory['reserved_bytes']} bytes for "
            f"{memory['max_num_seqs']} requests): run refuses it; raise --kv-memory or lower "
            "--max-num-seqs"
        )
    if memory.get("kv_memory_bytes") == 0:
        book.warn(
            f"no memory left for the KV cache: the weights (~{memory['weight_bytes_estimate']} "
            "bytes) fill the usable device memory"
        )
    kv_bytes = sum(memory["bytes_per_token"].values())
    book.cite(
        "kv_bytes_per_token",
        f"{kv_bytes} bytes per token per rank over all layers ({spec.dtype})",
        "sum of cache_entries dim x num_head x dtype size x layers",
    )
    return _Caches(entries=entries, memory=memory, kv_bytes_per_token=kv_bytes)


def _indexer_key_layers(spec: ModelSpec, sublayers: int) -> dict[str, int] | None:
    """{indexer key cache: the layers keeping it} when some layers share another's top-k
    (GLM-5) or run no indexer (dots3_note) and keep no indexer keys, else None (every MLA
    layer keeps them)."""
    if not plannable_indexer(spec):
        return None
    layers = indexer_layers(spec)
    if not layers.shared and not layers.dense:
        return None
    return {INDEXER_KEY_CACHE: len(layers.owners) * sublayers}


def _with_indexer_layers(
    entries: dict[str, list[CacheEntryPlan]], counts: dict[str, int] | None
) -> dict[str, list[CacheEntryPlan]]:
    """ENTRIES with each entry of COUNTS ({cache name: layers declaring it}) carrying its own
    ``num_layers``, which the bytes per token and the pools count instead of its attn_type's."""
    if not counts:
        return entries
    return {
        attn_type: [
            replace(e, num_layers=counts[e.cache_name]) if e.cache_name in counts else e
            for e in group
        ]
        for attn_type, group in entries.items()
    }


# ---- stage 6: what the code does, and the checks that follow --------------------------------


def _read_code_facts(
    source: ModelSource,
    code: CodeView,
    read: _ConfigRead,
    sharing: KvSharing | None,
    book: Notebook,
) -> dict[str, Any]:
    """The Plan's ``code`` record (cache API, fused qkv, Legacy paths, ...) and its notes."""
    facts = code_facts(code, source)
    if read.code_sizing is not None:
        facts["kv_heads"] = read.code_sizing
    if sharing_record(sharing) is not None:
        facts["kv_sharing"] = sharing_record(sharing)
    code_notes(
        facts,
        read.spec,
        book,
        null_layer_types="layer_types" in source.config and source.config["layer_types"] is None,
    )
    _per_layer_heads(source, book)
    return facts


def _add_checks(
    spec: ModelSpec,
    code: CodeView,
    design: _AttentionDesign,
    facts: dict[str, Any],
    mode: DeployMode,
    attn_types: list[str],
    attn_tp_size: int,
    block_size: int,
    book: Notebook,
    *,
    fused_attention: bool = True,
    mla_groups: list[MlaGroup] | None = None,
) -> None:
    """The common-error table's items and the operators' limits that apply to this model
    (FUSED_ATTENTION False: a compressed attention, which reads through no FA call; its
    operators' sizes are ``compressed_features.operator_limits``; MLA_GROUPS: the MLA layers
    by their own dims, each group checked with its own)."""
    # the standalone Legacy MLA rewrite (KVR026) keeps the model's own absorbed fused call
    keeps_absorbed_prefill = bool(facts.get("legacy_standalone")) and spec.mla is not None
    add_pitfalls(
        spec=spec,
        book=book,
        kv_mode=design.kv_mode,
        deploy_mode=mode,
        attention=design.attention,
        fa_version=design.fa_version,
        attn_types=attn_types,
        kv_heads_per_rank=design.kv_heads,
        attn_tp_size=attn_tp_size,
        scale_has_mscale=design.scale.has_yarn_mscale,
        keeps_absorbed_prefill=keeps_absorbed_prefill,
    )
    if not fused_attention:
        return
    add_operator_limits(
        spec=spec,
        book=book,
        attention=design.attention,
        fa_version=design.fa_version,
        has_sinks=sinks_line(code) is not None,
        kv_heads_per_rank=design.kv_heads,
        attn_tp_size=attn_tp_size,
        block_size=block_size,
        keeps_absorbed_prefill=keeps_absorbed_prefill,
        mla_groups=mla_groups,
    )


def _cite_rope(
    source: ModelSource, code: CodeView, spec: ModelSpec, book: Notebook
) -> RopeDecision:
    """The rotary pairing style and partial rotation, as the code applies them."""
    rope = rope_style(code, spec, source.config)
    book.cite("rope_style", f"rope style: {rope.style}", rope.source)
    if rope.rotary_dim is not None:
        book.cite(
            "rope_style",
            f"partial rotary: {rope.rotary_dim} of {spec.head_dim} channels per head are "
            "rotated, the rest pass through unrotated",
            rope.rotary_source or "",
        )
    return rope


# ---- stage 7: the Plan ----------------------------------------------------------------------


def _assemble_plan(
    *,
    source: ModelSource,
    code: CodeView,
    spec: ModelSpec,
    mode: DeployMode,
    layers: _Layers,
    design: _AttentionDesign,
    caches: _Caches,
    facts: dict[str, Any],
    rope: RopeDecision,
    cache_write: str | None,
    attn_tp_size: int,
    block_size: int,
    book: Notebook,
    compressed: CompressedAttentionPlan | None = None,
) -> Plan:
    """The Plan of every stage's decisions, with the notebook's warnings and evidence."""
    attn_types = layers.attn_types
    # before the notebook is read into the Plan: the indexer cites its evidence
    indexer = (
        decide_pooled_indexer(spec, source.modeling_file, book)
        if is_pooled(spec)
        else decide_indexer(spec, book)
        if design.kv_mode is KvMode.PAGED
        else None
    )
    cite_mla_layers(spec, source.modeling_file, book)
    return Plan(
        model_type=source.model_type,
        architecture=code.roles.causal_lm,
        source=source.as_plan_source(),
        deploy_mode=mode,
        kv_mode=design.kv_mode,
        legacy_reason=design.legacy_reason,
        attention=design.attention,
        layers=layers.layers,
        attn_types=attn_types,
        mixed_attn_types=len(attn_types) > 1,
        fa_version=design.fa_version,
        fa_version_reason=design.fa_reason,
        mla_absorb=design.absorb,
        input_layout=design.layout,
        sparse_mode=design.sparse_modes,
        softmax_scale=design.scale.value,
        num_key_value_heads_per_rank=design.kv_heads,
        cache_entries=caches.entries,
        kv_bytes_per_token=caches.kv_bytes_per_token,
        warnings=list(book.warnings),
        evidence=list(book.evidence),
        num_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        attn_tp_size=attn_tp_size,
        block_size=block_size,
        window_tokens=design.window_tokens,
        has_sinks=sinks_line(code) is not None,
        rope_style=rope.style,
        rotary_dim=rope.rotary_dim,
        position_bias="alibi" if design.alibi else None,
        mla=dict(spec.mla) if spec.mla else None,
        indexer=indexer,
        compressed_attention=compressed,
        code=facts,
        config=dict(source.config),
        memory=caches.memory,
        state_cache=state_cache(spec, layers.layers, caches.entries),
        implementer_blockers=list(book.blockers),
        is_mla_backend=design.attention is AttentionKind.MLA,
        mla_cache_write=cache_write,
        mtp=mtp_plan(spec, caches.entries, caches.kv_bytes_per_token),
    )


def _mla_cache_write(source: ModelSource, spec: ModelSpec, book, *, indexed: bool) -> str:
    """Fused latent write or scatter, from the modeling code's norm/rope order (mla_write).
    INDEXED: a DSA model, whose sparse attention reads the latent as ND rows."""
    if spec.mla is not None and not spec.mla["qk_rope_head_dim"]:
        # NOTE: the fused write norms the latent and rotates a 64-wide rope key; a latent
        # without rope (glm5_next) has no key for it to rotate
        book.cite(
            "mla_cache_write",
            f"{SCATTER}: the latent has no rope key (qk_rope_head_dim 0); the fused write "
            "rotates a 64-wide one",
            book.cfg(spec.sources.get("mla")),
        )
        return SCATTER
    # the decoder's keys: a composite config holds them under text_config
    config_json = json.dumps(text_config(source.config)[0], sort_keys=True, default=str)
    decision = _mla_write_cached(source.modeling_file or "", config_json)
    reason = decision.reason
    if decision.mode == FUSED:
        reason += (
            ' with cache_mode="PA_BNSD" (ND rows: the sparse attention reads PA_BSND)'
            if indexed
            else ' with cache_mode="PA_NZ"'
        )
    book.cite("mla_cache_write", f"{decision.mode}: {reason}", decision.source)
    return decision.mode


@lru_cache(maxsize=64)
def _mla_write_cached(modeling_file: str, config_json: str):
    # NOTE: keyed on the file and the whole config, so a repeated analysis of the same model
    # does not parse the file again with position metadata.
    from kvskill.core.inputs import read_source

    text = read_source(Path(modeling_file)) if modeling_file else ""
    return decide_mla_cache_write(text, json.loads(config_json), Path(modeling_file).name)


def _code_reads_window(code: CodeView) -> bool:
    """Whether the attention code reads a sliding window at all."""
    for name in code.roles.attention:
        cls = code.facts.classes.get(name)
        if cls is None:
            continue
        if "sliding_window" in cls.self_attrs:
            return True
        if any("sliding_window" in call.keywords for call in cls.calls):
            return True
    return False


#: config lists giving each layer its own head count (laguna, sapiens2) -> the model-wide key
PER_LAYER_HEAD_KEYS = {
    "num_attention_heads_per_layer": "num_attention_heads",
    "num_key_value_heads_per_layer": "num_key_value_heads",
}


def _sized_by_code(
    source: ModelSource, code: CodeView, spec: ModelSpec, attribute_map: dict[str, str], book
) -> tuple[ModelSpec, dict[str, Any] | None]:
    """SPEC with the KV heads the primary attention's ``__init__`` sizes its key projection
    with (``kv_sizing``), the config read as transformers reads it; and the Plan's record of
    it (``code.kv_heads``: the class, line, expression and the config keys it reads), None
    when the code does not say."""
    primary = code.attention_class()
    if primary is None or spec.mla is not None or not source.modeling_file:
        return spec, None
    defaults = {}
    if source.kind == "remote_code":
        defaults = source_config_defaults(Path(source.path), source.config)
    config, _ = text_config(source.config)
    view = ConfigView(config, attribute_map, defaults)
    sizing = sizing_of_source(source.modeling_file, primary.name, view)
    if sizing is None or sizing.kv_heads is None:
        return spec, None
    owner = code.facts.classes.get(sizing.owner)
    attr = next(iter(sizing.projections.values()))
    line = owner.self_attrs.get(attr) if owner is not None else None
    record = {
        "class": sizing.owner,
        "line": line,
        "projections": dict(sizing.projections),
        "kv_heads": sizing.kv_heads,
        "head_dim": sizing.head_dim,
        "expr": sizing.kv_heads_expr,
        "config_keys": list(sizing.kv_heads_keys),
    }
    return apply_code_sizing(spec, sizing, code.where(line), book), record


def _kv_sharing(
    source: ModelSource, code: CodeView, spec: ModelSpec, attribute_map: dict[str, str]
) -> KvSharing | None:
    """Cross-layer KV sharing of the primary attention (analyzer/kv_sharing.py), None when
    its forward reuses no other layer's keys and values."""
    primary = code.attention_class()
    if primary is None or spec.mla is not None or not source.modeling_file:
        return None
    defaults = {}
    if source.kind == "remote_code":
        defaults = source_config_defaults(Path(source.path), source.config)
    config, _ = text_config(source.config)
    view = ConfigView(config, attribute_map, defaults)
    return sharing_of_source(source.modeling_file, primary.name, view, spec.num_layers)


def _per_layer_heads(source: ModelSource, book: Notebook) -> None:
    """Per-layer head counts other than the model-wide one: the converted attention sizes
    its query/KV split from the model-wide count, so it cannot run these layers."""
    for key, model_wide in PER_LAYER_HEAD_KEYS.items():
        counts = source.config.get(key)
        if not isinstance(counts, list) or not counts:
            continue
        if {repr(c) for c in counts} == {repr(source.config.get(model_wide))}:
            continue
        msg = (
            f"per-layer head counts ({key}: {sorted(set(map(str, counts)))}, {model_wide}: "
            f"{source.config.get(model_wide)}): the converted attention sizes its query/KV "
            f"split from {model_wide}"
        )
        book.warn(msg)
        book.block(msg)
        book.cite(model_wide, f"{key} differs from {model_wide}", book.cfg(key))
