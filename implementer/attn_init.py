"""Attention ``__init__``: declare the paged caches.

Appends to every attention class's ``__init__`` its ``attn_type`` (a conditional on
``config.layer_types[layer_idx]`` when the model mixes sliding and full layers), the heads per
rank, the window bounds of sliding layers, empty cache placeholders and ``cache_entries``
whose ``tensor_setter`` methods receive the runtime's tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import libcst as cst
from kvskill.analyzer.gather import method
from kvskill.analyzer.kv_sizing import ConfigView, kv_sizing
from kvskill.implementer._command import (
    AttentionInitRewrite,
    append_statements,
    replace_method,
    with_body,
)
from kvskill.implementer.facts import (
    CACHE_UPDATE_CALL,
    attention_facts,
    class_assigns,
    code,
    init_owner,
    m,
    module_classes,
)
from kvskill.implementer.snippets import methods, statements
from kvskill.implementer.spec import FA_UNBOUNDED_TOKENS, ConversionSpec

#: ``self.head_dim = ...`` in __init__
HEAD_DIM_ASSIGN = m.Assign(
    targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("head_dim")))]
)
#: ``self.v_head_dim = ...`` in __init__ (values narrower or wider than keys, e.g. MiMo)
V_HEAD_DIM_ASSIGN = m.Assign(
    targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("v_head_dim")))]
)


def _local_assign(name: str) -> m.Assign:
    """``name = ...`` (a local of ``__init__``, e.g. a per-layer head count)."""
    return m.Assign(targets=[m.AssignTarget(target=m.Name(name))])


def head_count_expr(cls: cst.ClassDef, config: str, key: str) -> str:
    """The layer's own head count: a local ``key`` that ``__init__`` computes (MiMo-V2-Flash
    doubles the KV heads of its sliding layers) when there is one, else ``config.key``.

    The statements that use it are appended to ``__init__``, where the local is in scope.
    """
    return key if class_assigns(cls, _local_assign(key)) else f"{config}.{key}"


def _offset(expr: str, offset: int) -> str:
    if offset == 0:
        return expr
    return f"{expr} - {-offset}" if offset < 0 else f"{expr} + {offset}"


def _by_type(spec: ConversionSpec, values: dict[str, str]) -> str:
    """One expression choosing ``values[attn_type]`` for this layer's ``self.attn_type``."""
    if spec.uniform_attn_type is not None:
        return values[spec.uniform_attn_type]
    if len({values[k] for k in spec.attn_types}) == 1:
        return values[spec.attn_types[0]]
    kinds = spec.attn_types
    expr = values[kinds[-1]]
    for kind in reversed(kinds[:-1]):
        expr = f'{values[kind]} if self.attn_type == "{kind}" else {expr}'
    return expr


def attn_type_expr(spec: ConversionSpec, config: str, layer_idx: str | None) -> str:
    """``"FullAttention"`` or a conditional on ``config.layer_types[layer_idx]``."""
    if spec.uniform_attn_type is not None or not spec.layer_type_to_attn_type:
        return f'"{spec.attn_types[0]}"'
    by_type: dict[str, list[str]] = {}
    for layer_type, kind in sorted(spec.layer_type_to_attn_type.items()):
        by_type.setdefault(kind, []).append(layer_type)
    kinds = sorted(by_type)
    lookup = f"{config}.layer_types[{layer_idx}]"
    expr = f'"{kinds[-1]}"'
    for kind in reversed(kinds[:-1]):
        values = by_type[kind]
        quoted = [json.dumps(v) for v in values]
        test = (
            f"{lookup} == {quoted[0]}" if len(quoted) == 1 else f"{lookup} in ({', '.join(quoted)})"
        )
        expr = f'"{kind}" if {test} else {expr}'
    return expr


def kv_heads_expr(
    spec: ConversionSpec,
    cls: cst.ClassDef,
    config: str,
    classes: Mapping[str, cst.ClassDef] | None = None,
) -> str:
    """The KV heads CLS's caches hold: the factor its own ``__init__`` sizes the key (or
    fused qkv) projection with (``analyzer.kv_sizing``: ``self.num_key_value_heads`` set from
    ``config.num_query_groups``), valid where the statements are appended; else the config's
    ``num_key_value_heads``, or every head for an MHA config without that key."""
    sizing = kv_sizing(cls, classes or {cls.name.value: cls}, ConfigView({}))
    if sizing is not None and sizing.kv_heads_expr and sizing.owner == cls.name.value:
        return sizing.kv_heads_expr
    reshaped = _forward_kv_heads(cls)
    if reshaped is not None:
        return reshaped
    if spec.config_has_kv_heads:
        return head_count_expr(cls, config, "num_key_value_heads")
    # MHA vendor configs (Qwen-7B, Baichuan) have no KV-head count: every head has its own
    return f'(getattr({config}, "num_key_value_heads", None) or {config}.num_attention_heads)'


def _forward_kv_heads(cls: cst.ClassDef) -> str | None:
    """The head count the forward lays out the keys it writes with, ``key.reshape(b, H, s,
    d)`` before ``<cache>.update(key, ...)``, when H reads only attributes ``__init__`` sets
    (Falcon: ``num_kv_heads = self.num_heads if self.new_decoder_architecture else
    self.num_kv_heads``, its multi-query configs keeping one KV head); else None."""
    forward, init = method(cls, "forward"), method(cls, "__init__")
    if forward is None or init is None:
        return None
    updates = m.findall(forward, CACHE_UPDATE_CALL)
    if len(updates) != 1:
        return None
    key = cst.ensure_type(updates[0], cst.Call).args[0].value
    if not isinstance(key, cst.Name):
        return None
    reshape = m.Call(func=m.Attribute(attr=m.Name("reshape") | m.Name("view")))
    heads = {
        code(cst.ensure_type(call, cst.Call).args[1].value)
        for a in m.findall(forward, m.Assign(targets=[m.AssignTarget(target=m.Name(key.value))]))
        for call in m.findall(cst.ensure_type(a, cst.Assign).value, reshape)
        if len(cst.ensure_type(call, cst.Call).args) == 4
    }
    if len(heads) != 1:
        return None
    (count,) = heads
    locals_ = [
        cst.ensure_type(a, cst.Assign).value
        for a in m.findall(forward, m.Assign(targets=[m.AssignTarget(target=m.Name(count))]))
    ]
    expr = locals_[0] if len(locals_) == 1 else cst.parse_expression(count)
    set_in_init = {
        cst.ensure_type(cst.ensure_type(t, cst.AssignTarget).target, cst.Attribute).attr.value
        for t in m.findall(init, m.AssignTarget(target=m.Attribute(value=m.Name("self"))))
    }
    names = [cst.ensure_type(n, cst.Name).value for n in m.findall(expr, m.Name())]
    attrs = [
        cst.ensure_type(a, cst.Attribute).attr.value
        for a in m.findall(expr, m.Attribute(value=m.Name("self")))
    ]
    # every name is ``self`` (reading an attribute __init__ sets) or the attribute's own
    if not attrs or not set(attrs) <= set_in_init or set(names) - {"self", *attrs}:
        return None
    return f"({code(expr)})"


def init_values(
    spec: ConversionSpec,
    cls: cst.ClassDef,
    config: str,
    layer_idx: str | None,
    classes: Mapping[str, cst.ClassDef] | None = None,
) -> dict:
    """Template values for ``framework_attn_init.py.j2``."""
    windowed = bool(spec.windows)
    values: dict = {
        "attn_type_expr": attn_type_expr(spec, config, layer_idx),
        "config": config,
        "attn_tp_size": spec.attn_tp_size,
        "heads_expr": head_count_expr(cls, config, "num_attention_heads"),
        "kv_heads_expr": kv_heads_expr(spec, cls, config, classes),
        "fused_qkv": _fused_qkv_literal(spec, cls, classes),
        "windowed": windowed,
        "window_expr": "",
        "head_dim_expr": "self.head_dim"
        if class_assigns(cls, HEAD_DIM_ASSIGN)
        else f'getattr({config}, "head_dim", None) or {config}.hidden_size // {config}.num_attention_heads',
    }
    # the value cache holds the value head dim when the layer has its own
    values["dim_exprs"] = {
        "k_cache": values["head_dim_expr"],
        "v_cache": "self.v_head_dim"
        if class_assigns(cls, V_HEAD_DIM_ASSIGN)
        else values["head_dim_expr"],
    }
    if windowed:
        full = {k: str(FA_UNBOUNDED_TOKENS) for k in spec.attn_types}
        pre = dict(full)
        nxt = {k: "0" for k in spec.attn_types}
        window = {k: "None" for k in spec.attn_types}
        for kind, rule in spec.windows.items():
            pre[kind] = _offset(f"{config}.sliding_window", rule.pre_offset)
            nxt[kind] = str(rule.next_tokens)
            window[kind] = f"{config}.sliding_window"
        values["pre_tokens_expr"] = _by_type(spec, pre)
        values["next_tokens_expr"] = _by_type(spec, nxt)
        values["window_expr"] = _by_type(spec, window)
    return values


def _fused_qkv_literal(
    spec: ConversionSpec, cls: cst.ClassDef, classes: Mapping[str, cst.ClassDef] | None
) -> str:
    """``{"wqkv": "per_kv_group"}`` for a class (or the family base it inherits the
    projection from) the Plan found a fused projection in; "" for none."""
    layouts = spec.fused_qkv.get(cls.name.value)
    if layouts is None and classes:
        for base in cls.bases:
            name = getattr(base.value, "value", None)
            if isinstance(name, str) and name in spec.fused_qkv:
                layouts = spec.fused_qkv[name]
                break
    if not layouts:
        return ""
    return "{" + ", ".join(f'"{attr}": "{layout}"' for attr, layout in layouts.items()) + "}"


class AttentionInitCommand(AttentionInitRewrite):
    """Declare attn_type, heads per rank, window bounds, cache placeholders and entries."""

    DESCRIPTION = "Declare the paged cache entries in every attention __init__."
    #: the statements appended to ``__init__``
    INIT_TEMPLATE = "framework_attn_init.py.j2"
    #: the template whose ``set_*`` methods (the entries' tensor setters) the class receives
    METHODS_TEMPLATE = "framework_attn_methods.py.j2"

    def visit_Module(self, node: cst.Module) -> bool:
        self.classes = module_classes(node)
        return True

    def selects(self, cls: cst.ClassDef) -> bool:
        # a variant of an attention family whose __init__ is its base's (XSdpaAttention(
        # XAttention), or one calling super().__init__) gets its caches there, once
        return super().selects(cls) and init_owner(cls, self.classes) is cls

    def template_values(self, cls: cst.ClassDef, config: str, layer_idx: str | None) -> dict:
        """The values INIT_TEMPLATE is rendered with for CLS."""
        return init_values(self.spec, cls, config, layer_idx, self.classes)

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = attention_facts(original, self.classes)
        assert facts.config_param is not None, "the pipeline validates attention facts first"
        config = self.parser_config()
        values = self.template_values(original, facts.config_param, facts.layer_idx_param)
        values["call_sites"] = facts.seam is not None and facts.seam.site is not None
        values["reads_shared_kv"] = self.spec.reads_shared_kv
        init_stmts = statements(self.INIT_TEMPLATE, config, **values)
        setters = [
            f for f in methods(self.METHODS_TEMPLATE, config) if f.name.value.startswith("set_")
        ]
        body = replace_method(updated, "__init__", lambda init: append_statements(init, init_stmts))
        return with_body(updated, [*body, *setters])
