"""Mode 1 codemods: contiguous BSH caches written with ``scatter_update_`` at the runner's kv_len.

The attention ``__init__`` declares the same cache entries as the paged rewrite (so the runner
learns every layer's heads, head dim and dtype from ``get_cache_info()``), but the runner binds
``[batch, max_seq_len, heads * head_dim]`` tensors to them. The forward seam keeps the source's
``[B, S]`` batch: it flattens heads into BSH, writes each row from its current length on and
calls the fused attention with ``input_layout="BSH"`` over the whole per-row cache.
"""

from __future__ import annotations

import libcst as cst
from kvskill.implementer._command import FrameworkCommand, append_statements, replace_method
from kvskill.implementer.attn_forward import FA_OPS, splice_seam
from kvskill.implementer.attn_init import init_values
from kvskill.implementer.facts import (
    CACHE_ENTRIES_ASSIGN,
    FA_CALL,
    KernelStyle,
    SeamFacts,
    attention_facts,
    class_assigns,
    is_attention_class,
    m,
)
from kvskill.implementer.spec import ConversionSpec, FaVersion
from kvskill.implementer.standalone.snippets import methods, statements
from kvskill.implementer.standalone.spec import CONTIGUOUS_SPARSE_MODE


def bsh_fa_kwargs(spec: ConversionSpec, seam: SeamFacts) -> list[tuple[str, str]]:
    """Keyword arguments of the BSH fused-attention call, in the version's own names."""
    v2 = spec.fa_version is FaVersion.V2
    prefill, decode = CONTIGUOUS_SPARSE_MODE["prefill"], CONTIGUOUS_SPARSE_MODE["decode"]
    return [
        ("num_query_heads" if v2 else "num_heads", "self.num_heads_per_rank"),
        ("num_key_value_heads", "self.num_key_value_heads_per_rank"),
        ("input_layout", '"BSH"'),
        ("softmax_scale" if v2 else "scale", seam.scale or f"{seam.query}.shape[-1] ** -0.5"),
        ("atten_mask", "md.attention_mask if md.is_prefill else None"),
        ("sparse_mode", f"{prefill} if md.is_prefill else {decode}"),
        # BSH takes per-row lengths for both (npu_ops §1.3); the decode branch reads only kv
        ("actual_seq_qlen" if v2 else "actual_seq_lengths", "md.actual_seq_lengths_q"),
        ("actual_seq_kvlen" if v2 else "actual_seq_lengths_kv", "md.actual_seq_lengths_kv"),
    ]


class ContiguousAttentionInitCommand(FrameworkCommand):
    """Declare attn_type, heads per rank, cache placeholders, entries and their setters."""

    DESCRIPTION = "Declare the runner-owned contiguous caches in every attention __init__."

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        if not is_attention_class(original_node) or class_assigns(
            original_node, CACHE_ENTRIES_ASSIGN
        ):
            return updated_node
        facts = attention_facts(original_node)
        assert facts.config_param is not None, "the pipeline validates attention facts first"
        config = self.parser_config()
        values = init_values(self.spec, original_node, facts.config_param, facts.layer_idx_param)
        init_stmts = statements("init", config, **values)
        setters = [f for f in methods("methods", config) if f.name.value.startswith("set_")]
        body = replace_method(
            updated_node, "__init__", lambda init: append_statements(init, init_stmts)
        )
        body.extend(setters)
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


class ContiguousAttentionForwardCommand(FrameworkCommand):
    """Replace the seam of every attention forward by the BSH write + attention; add update_cache."""

    DESCRIPTION = (
        "Write K/V with scatter_update_ at kv_len and attend with the fused BSH attention."
    )

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        if not is_attention_class(original_node) or m.findall(original_node, FA_CALL):
            return updated_node
        seam = attention_facts(original_node).seam
        assert seam is not None, "the pipeline validates attention facts first"
        config = self.parser_config()
        body = replace_method(
            updated_node, "forward", lambda f: self._convert_forward(f, seam, config)
        )
        body.extend(f for f in methods("methods", config) if f.name.value == "update_cache")
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

    def _convert_forward(
        self, forward: cst.FunctionDef, seam: SeamFacts, config: cst.PartialParserConfig
    ) -> cst.FunctionDef:
        new = statements(
            "seam",
            config,
            query=seam.query,
            key=seam.key,
            value=seam.value,
            output=seam.targets[0],
            op=FA_OPS[self.spec.fa_version],
            kwargs=bsh_fa_kwargs(self.spec, seam),
            bnsd=seam.style is KernelStyle.SDPA,
            extra_outputs=[t for t in seam.targets[1:] if t != "_"],
        )
        return splice_seam(forward, seam, new)
