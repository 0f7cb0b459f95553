"""Which classes of a modeling file play which role: CausalLM, model, decoder layer, attention.

The chain is followed through constructor calls (``self.model = XModel(config)``,
``self.layers = nn.ModuleList([XDecoderLayer(...) ...])``, ``self.self_attn = XAttention(...)``)
and falls back to names and cache writes when a file dispatches through a dict (transformers 4
style ``ATTENTION_CLASSES[config._attn_implementation]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvskill.analyzer.scan import ClassFacts, ModuleFacts

_LAYER_LIST_ATTRS = ("layers", "h", "blocks", "layer", "decoder_layers")
_MODEL_ATTRS = ("model", "transformer", "language_model", "gpt_neox", "decoder", "backbone")
#: a model that keeps its layer stack one module down (ChatGLM: ``transformer.encoder.layers``)
_STACK_HOLDER_ATTRS = ("encoder",)


@dataclass(kw_only=True)
class CodeRoles:
    """Class names per role (None when not found) in one modeling file."""

    causal_lm: str | None = None
    model: str | None = None
    decoder_layer: str | None = None
    #: attention classes that write a KV cache or run attention, primary first
    attention: list[str] = field(default_factory=list)
    #: linear-attention / SSM mixers (state caches instead of KV)
    linear_attention: list[str] = field(default_factory=list)


def _has_call(cls: ClassFacts, *kinds: str) -> bool:
    return any(call.kind in kinds for call in cls.calls)


def _own_or_base(facts: ModuleFacts, name: str | None, attrs: tuple[str, ...]) -> list[str]:
    """Classes instantiated for the first of ``attrs`` in ``name`` or its in-file bases."""
    seen: set[str] = set()
    while name and name in facts.classes and name not in seen:
        seen.add(name)
        cls = facts.classes[name]
        for attr in attrs:
            if attr in cls.attr_classes:
                return [c for c in cls.attr_classes[attr] if c in facts.classes]
        name = next((b for b in cls.bases if b in facts.classes), None)
    return []


def find_roles(facts: ModuleFacts, causal_lm_hint: str | None = None) -> CodeRoles:
    roles = CodeRoles()
    classes = facts.classes
    if causal_lm_hint in classes:
        roles.causal_lm = causal_lm_hint
    else:
        roles.causal_lm = next((n for n in classes if n.endswith("ForCausalLM")), None)
    models = _own_or_base(facts, roles.causal_lm, _MODEL_ATTRS)
    roles.model = models[0] if models else None
    if roles.model is None:
        roles.model = next(
            (
                n
                for n, c in classes.items()
                if n.endswith("Model")
                and not n.endswith("PreTrainedModel")
                and any(a in c.self_attrs for a in _LAYER_LIST_ATTRS)
            ),
            None,
        )
    layers = _own_or_base(facts, roles.model, _LAYER_LIST_ATTRS)
    for holder in [] if layers else _own_or_base(facts, roles.model, _STACK_HOLDER_ATTRS):
        layers = layers or _own_or_base(facts, holder, _LAYER_LIST_ATTRS)
    roles.decoder_layer = layers[0] if layers else None
    if roles.decoder_layer is None:
        roles.decoder_layer = next((n for n in classes if n.endswith("DecoderLayer")), None)
    _find_mixers(facts, roles)
    return roles


def _converted_dsa(cls: ClassFacts) -> bool:
    """A DSA attention kvskill converted: it declares its cache entries and reads them with
    the sparse fused attention (a Legacy row writer reading the same way declares none)."""
    return _has_call(cls, "sparse_fa_call") and "cache_entries" in cls.self_attrs


def _find_mixers(facts: ModuleFacts, roles: CodeRoles) -> None:
    candidates: list[str] = []
    layer = facts.classes.get(roles.decoder_layer or "")
    if layer is not None:
        for names in layer.attr_classes.values():
            for name in names:
                candidates.append(name)
                # one level down: an attention block wrapping the attention proper
                inner = facts.classes.get(name)
                if inner is not None:
                    for more in inner.attr_classes.values():
                        candidates.extend(more)
    for name in dict.fromkeys(candidates):
        cls = facts.classes.get(name)
        if cls is None:
            continue
        if _has_call(cls, "linear_attention_call"):
            roles.linear_attention.append(name)
        elif _has_call(cls, "cache_update", "attention_call", "fa_call") or _converted_dsa(cls):
            roles.attention.append(name)
    if not roles.attention:
        # Dispatch through a dict or a factory: every class that writes the KV cache.
        writers = [n for n, c in facts.classes.items() if _has_call(c, "cache_update", "fa_call")]
        roles.attention = [n for n in writers if n not in roles.linear_attention]
    if not roles.attention:
        roles.attention = [
            n
            for n, c in facts.classes.items()
            if "Attention" in n and _has_call(c, "attention_call")
        ]
