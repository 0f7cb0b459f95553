"""The Legacy rewrite's codemods: static-row caches declared, the seam around the model's own
attention call (see ``convert._convert_framework_legacy`` for the design)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer import Plan
from kvskill.analyzer.config import text_config
from kvskill.analyzer.gather import INTERFACE_CALL
from kvskill.core.attn_types import AttnType
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.attn_forward import AttentionForwardCommand, seam_values, splice_seam
from kvskill.implementer.attn_init import (
    AttentionInitCommand,
    attn_type_expr,
    init_values,
)
from kvskill.implementer.facts import CacheLayout, KernelStyle, SeamFacts
from kvskill.implementer.snippets import statements
from kvskill.implementer.spec import (
    ConversionSpec,
    WindowRule,
    _layer_type_mapping,
    config_switches,
)

#: the layer kinds whose attention a Legacy mask reproduces
LEGACY_KINDS = frozenset({AttnType.FULL_ATTENTION.value, AttnType.SLIDING_WINDOW.value})
#: the Plan's layer kind of chunked-attention layers
CHUNKED_KIND = "chunked"


@dataclass(frozen=True, kw_only=True)
class LegacySpec(ConversionSpec):
    """The paged values the Legacy init reuses (heads, per-layer kinds, windows), plus the
    layers whose queries see only their own chunk."""

    #: config.layer_types values of chunked layers; () when every layer is chunked, None
    #: when none is
    chunked_layer_types: tuple[str, ...] | None = None
    keeps_model_kernel: ClassVar[bool] = True


def legacy_spec(plan: Plan, block_size: int | None = None) -> LegacySpec:
    """The values the Legacy rewrite emits: per-layer kinds, windows and chunks, heads.

    Raises:
        UnsupportedModelError: the Plan needs something the Legacy rewrite does not write.
    """
    kinds = [layer.attn_type for layer in plan.layers]
    reasons = list(plan.implementer_blockers)
    if not plan.layers:
        reasons.append("the Plan lists no layers")
    if set(kinds) - LEGACY_KINDS:
        reasons.append(
            f"layers of attn_type {sorted(set(kinds) - LEGACY_KINDS)} (Legacy rows serve "
            "FullAttention and SlidingWindow layers)"
        )
    if plan.is_mla:
        reasons.append("MLA attention (Legacy rows hold full keys and values)")
    if plan.attn_tp_size != 1:
        reasons.append(f"attn_tp_size {plan.attn_tp_size} (Legacy rows are written for one rank)")
    chunked = _chunked_layer_types(plan, reasons)
    if reasons:
        raise UnsupportedModelError(
            f"{plan.model_type}: cannot convert: Legacy KV: " + "; ".join(reasons)
        )
    uniform = kinds[0] if len(set(kinds)) == 1 else None
    windows = (
        {AttnType.SLIDING_WINDOW.value: WindowRule(pre_offset=-1, next_tokens=0)}
        if AttnType.SLIDING_WINDOW.value in kinds
        else {}
    )
    return LegacySpec(
        fa_version=plan.fa_version,
        input_layout=plan.input_layout,
        uniform_attn_type=uniform,
        layer_type_to_attn_type={} if uniform is not None else _layer_type_mapping(plan),
        windows=windows,
        block_size=block_size or plan.block_size,
        causal_lm_class=plan.architecture,
        config_has_kv_heads="num_key_value_heads" in text_config(plan.config)[0],
        chunked_layer_types=chunked,
        config_switches=config_switches(plan),
    )


def _chunked_layer_types(plan: Plan, reasons: list[str]) -> tuple[str, ...] | None:
    chunked = [layer for layer in plan.layers if layer.kind == CHUNKED_KIND]
    if not chunked:
        return None
    if len(chunked) == len(plan.layers):
        return ()
    layer_types = text_config(plan.config)[0].get("layer_types")
    if not isinstance(layer_types, list) or len(layer_types) < len(plan.layers):
        reasons.append(
            "some layers are chunked but config.layer_types does not list every layer, so "
            "the chunk cannot be written per layer"
        )
        return None
    values = {str(layer_types[layer.index]) for layer in chunked}
    others = {str(layer_types[layer.index]) for layer in plan.layers if layer not in chunked}
    if values & others:
        reasons.append(
            f"layer_types values {sorted(values & others)} name chunked and unchunked layers"
        )
    return tuple(sorted(values))


def _window_expr(spec: ConversionSpec, config: str) -> str:
    if AttnType.SLIDING_WINDOW.value not in spec.windows:
        return "None"
    if spec.uniform_attn_type is not None:
        return f"{config}.sliding_window"
    return f'{config}.sliding_window if self.attention_kind == "SlidingWindow" else None'


def _chunk_expr(spec: LegacySpec, config: str, layer_idx: str | None) -> str:
    chunked = spec.chunked_layer_types
    if chunked is None:
        return "None"
    if not chunked:
        return f"{config}.attention_chunk_size"
    quoted = ", ".join(json.dumps(v) for v in chunked)
    return (
        f"{config}.attention_chunk_size if {config}.layer_types[{layer_idx}] in ({quoted},) "
        "else None"
    )


def legacy_init_values(
    spec: LegacySpec,
    cls: cst.ClassDef,
    config: str,
    layer_idx: str | None,
    classes: dict[str, cst.ClassDef] | None = None,
) -> dict:
    """Template values for ``legacy_init.py.j2``."""
    values = init_values(replace(spec, windows={}), cls, config, layer_idx, classes)
    values["kind_expr"] = attn_type_expr(spec, config, layer_idx)
    values["window_expr"] = _window_expr(spec, config)
    values["chunk_expr"] = _chunk_expr(spec, config, layer_idx)
    return values


class LegacyAttentionInitCommand(AttentionInitCommand):
    """Declare the Legacy caches, the heads, the layer's window and chunk in every attention."""

    DESCRIPTION = "Declare Legacy (static-row) caches in every attention __init__."
    INIT_TEMPLATE = "legacy_init.py.j2"

    def template_values(self, cls: cst.ClassDef, config: str, layer_idx: str | None) -> dict:
        return legacy_init_values(self.spec, cls, config, layer_idx, self.classes)


def _kernel_mask(kernel: cst.BaseStatement) -> str | None:
    """The name the source's attention-interface call takes its mask from, or None."""
    calls = m.findall(kernel, INTERFACE_CALL)
    if not calls:
        return None
    call = cst.ensure_type(calls[0], cst.Call)
    positional = [a for a in call.args if a.keyword is None and a.star == ""]
    named = {a.keyword.value: a for a in call.args if a.keyword is not None}
    arg = positional[4] if len(positional) > 4 else named.get("attention_mask")
    if arg is None or not isinstance(arg.value, cst.Name):
        return None
    return arg.value.value


#: ``<scores>.masked_fill(<mask>, ...)``: a boolean mask, True where a key is hidden
_MASKED_FILL = m.Call(func=m.Attribute(attr=m.Name("masked_fill")))


@dataclass(frozen=True)
class KernelMask:
    """The mask the source's kernel reads, which the Legacy seam rebinds."""

    name: str
    #: True when the source hides keys with ``masked_fill(mask, ...)`` (True = hidden), False
    #: when it adds the mask to its scores (0 = visible)
    boolean: bool


def _matmul_mask(statements: list[cst.BaseStatement]) -> KernelMask | None:
    """The mask of hand-written attention: the name ``masked_fill`` takes, or the name with
    "mask" in it added to the scores."""
    for stmt in statements:
        for call in m.findall(stmt, _MASKED_FILL):
            first = cst.ensure_type(call, cst.Call).args[0].value if call.args else None
            if isinstance(first, cst.Name):
                return KernelMask(first.value, boolean=True)
        for node in m.findall(stmt, m.BinaryOperation(operator=m.Add()) | m.AugAssign()):
            term = node.right if isinstance(node, cst.BinaryOperation) else node.value
            if isinstance(term, cst.Name) and "mask" in term.value.lower():
                return KernelMask(term.value, boolean=False)
    return None


def legacy_kernel_mask(
    seam: SeamFacts, forward: cst.FunctionDef, where: str = "the attention forward"
) -> KernelMask:
    """The mask the Legacy seam rebinds for this forward's kernel (WHERE: ``X.forward``).

    Raises:
        UnsupportedModelError: the seam cannot wrap the kernel.
    """
    styles = (KernelStyle.INTERFACE, KernelStyle.MATMUL, KernelStyle.BIAS_BMM)
    if seam.style not in styles or seam.layout is not CacheLayout.BHSD:
        raise UnsupportedModelError(
            f"cannot convert: Legacy KV: {where} runs its attention as {seam.style.value} over "
            f"{seam.layout.value} tensors; the Legacy rewrite wraps an attention-interface call "
            "or hand-written matmul attention over [b, h, s, d] tensors"
        )
    body = cst.ensure_type(forward.body, cst.IndentedBlock).body
    if seam.style is not KernelStyle.INTERFACE:
        mask = _matmul_mask(list(body[seam.update_index + 1 : seam.kernel_index]))
        if mask is None:
            raise UnsupportedModelError(
                "cannot convert: Legacy KV: the hand-written attention applies no mask by name "
                "(masked_fill(<mask>, ...) or + <mask>) for the seam to rebind"
            )
        return mask
    name = _kernel_mask(body[seam.kernel_index])
    if name is None:
        raise UnsupportedModelError(
            "cannot convert: Legacy KV: the attention-interface call takes no named mask (its "
            "fifth argument)"
        )
    return KernelMask(name, boolean=False)


#: the module-level ALiBi builder a folded-batch seam rebuilds its bias with (bloom's)
ALIBI_BUILDER = "build_alibi_tensor"


def _shape_names(stmt: cst.BaseStatement) -> list[str]:
    """``a, b, ... = <x>.shape``: the names, in order ("_" included); else []."""
    if not isinstance(stmt, cst.SimpleStatementLine) or not isinstance(stmt.body[0], cst.Assign):
        return []
    assign = stmt.body[0]
    target = assign.targets[0].target
    if not m.matches(assign.value, m.Attribute(attr=m.Name("shape"))) or not isinstance(
        target, cst.Tuple
    ):
        return []
    return [e.value.value if isinstance(e.value, cst.Name) else "" for e in target.elements]


def folded_batch_names(seam: SeamFacts, forward: cst.FunctionDef, module: cst.Module) -> dict:
    """Template values of a seam whose scores fold the batch into the heads and start from a
    bias (``alibi.baddbmm``): the names the forward took its batch and query length from
    (``batch_size, q_length, _ = hidden_states.shape``), which the kept statements reshape by,
    and the bias, rebuilt for the padded batch by the file's own ALiBi builder.

    Raises:
        UnsupportedModelError: the forward or the file lacks one of them.
    """
    body = cst.ensure_type(forward.body, cst.IndentedBlock).body
    names = next((n for n in map(_shape_names, body[: seam.update_index]) if len(n) >= 2), [])
    builders = m.findall(module, m.FunctionDef(name=m.Name(ALIBI_BUILDER)))
    if len(names) < 2 or not names[0] or not names[1] or not builders:
        raise UnsupportedModelError(
            f"cannot convert: Legacy KV: the scores start from {seam.bias} over [batch * "
            "heads, s, d]; the Legacy seam rebuilds that bias for its padded batch with the "
            f"file's own {ALIBI_BUILDER}(attention_mask, num_heads, dtype) and re-reads the "
            "batch and query length the forward unpacks from a .shape before the cache "
            "write, and this file has not both"
        )
    return {"batch": names[0], "length": names[1], "bias": seam.bias, "builder": ALIBI_BUILDER}


class LegacyAttentionForwardCommand(AttentionForwardCommand):
    """Write the static rows, read them for the model's own attention call, pack its output."""

    DESCRIPTION = (
        "Write K/V into each request's static row and run the model's own attention over it."
    )
    SEAM_TEMPLATE = "legacy_seam.py.j2"

    def visit_Module(self, node: cst.Module) -> bool:
        self.source_module = node
        return super().visit_Module(node)

    def _convert_forward(
        self,
        forward: cst.FunctionDef,
        note: list[cst.EmptyLine],
        seam: SeamFacts,
        config: cst.PartialParserConfig,
    ) -> cst.FunctionDef:
        mask = legacy_kernel_mask(seam, forward, f"{self.class_name}.forward")
        body = cst.ensure_type(forward.body, cst.IndentedBlock).body
        kept = list(body[seam.update_index + 1 : seam.kernel_index + 1])
        values = seam_values(seam)
        values["folded"] = (
            folded_batch_names(seam, forward, self.source_module)
            if seam.style is KernelStyle.BIAS_BMM
            else None
        )
        prologue = statements(
            self.SEAM_TEMPLATE, config, **values, mask=mask.name, boolean_mask=mask.boolean
        )
        prologue[0] = prologue[0].with_changes(leading_lines=[*note, *prologue[0].leading_lines])
        epilogue = statements("legacy_output.py.j2", config, **values)
        return splice_seam(forward, seam, [*prologue, *kept, *epilogue])


__all__ = [
    "LegacyAttentionForwardCommand",
    "LegacyAttentionInitCommand",
    "LegacySpec",
    "legacy_init_values",
    "legacy_spec",
]
