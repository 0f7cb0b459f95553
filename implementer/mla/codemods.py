"""The MLA codemods: attention ``__init__`` (latent caches), ``forward`` (absorbed paged seam)
and the model class (``get_cache_info`` with ``is_mla_backend=True``).

Everything above the seam (projections, norms, rope) and below it (reshape, ``o_proj``) stays
as written; the seam (from the cache write of the latent to the attention kernel) becomes the
absorbed, paged attention over the latent caches.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.implementer._command import append_statements, replace_method
from kvskill.implementer.facts import (
    CACHE_ENTRIES_ASSIGN,
    FA_CALL,
    KernelStyle,
    SeamFacts,
    class_assigns,
    is_attention_class,
    is_causal_lm_class,
)
from kvskill.implementer.mla.facts import MlaAttentionFacts, mla_attention_facts
from kvskill.implementer.mla.snippets import methods, statements
from kvskill.implementer.mla.spec import CacheWrite, MlaSpec
from kvskill.implementer.model_class import GET_CACHE_INFO, add_cache_info
from kvskill.implementer.spec import FaVersion
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand

FA_OPS = {
    FaVersion.V1: "npu_fused_infer_attention_score",
    FaVersion.V2: "npu_fused_infer_attention_score_v2",
}


class MlaCommand(VisitorBasedCodemodCommand):
    """A codemod parameterised by the MLA spec and the module's class table."""

    def __init__(self, context: CodemodContext, spec: MlaSpec) -> None:
        super().__init__(context)
        self.spec = spec
        self.classes: dict[str, cst.ClassDef] = {}

    def visit_Module(self, node: cst.Module) -> bool:
        self.classes = {c.name.value: c for c in node.body if isinstance(c, cst.ClassDef)}
        return True

    def parser_config(self) -> cst.PartialParserConfig:
        module = self.context.module
        return module.config_for_parsing if module is not None else cst.PartialParserConfig()

    def facts(self, cls: cst.ClassDef) -> MlaAttentionFacts:
        facts = mla_attention_facts(cls, self.classes, self.spec.cache_write is CacheWrite.FUSED)
        assert not facts.problems, "the pipeline validates attention facts first"
        return facts


class MlaAttentionInitCommand(MlaCommand):
    """Declare attn_type, heads per rank, the latent caches and their entries."""

    DESCRIPTION = (
        "Declare nope_cache + rope_cache (one latent head) in every MLA attention __init__."
    )

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        if not is_attention_class(original_node) or class_assigns(
            original_node, CACHE_ENTRIES_ASSIGN
        ):
            return updated_node
        facts = self.facts(original_node)
        config = self.parser_config()
        cfg = facts.config_param
        values = {
            "config": cfg,
            "attn_type": self.spec.attn_type,
            "attn_tp_size": self.spec.attn_tp_size,
            "kv_b_proj": facts.kv_b_proj,
            "scatter": self.spec.cache_write is CacheWrite.SCATTER,
        }
        entries = [("nope_cache", f"{cfg}.kv_lora_rank"), ("rope_cache", f"{cfg}.qk_rope_head_dim")]
        init_stmts = statements("init", config, entries=entries, **values)
        body = replace_method(
            updated_node, "__init__", lambda init: append_statements(init, init_stmts)
        )
        body.extend(methods("methods", config, **values))
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


def fa_kwargs(spec: MlaSpec, seam: SeamFacts) -> list[tuple[str, str]]:
    """Keyword arguments of the absorbed FA call, with the version's own names (npu_ops §2.2)."""
    v2 = spec.fa_version is FaVersion.V2
    scale = seam.scale or "(q_nope_tnd.shape[-1] + q_rope_tnd.shape[-1]) ** -0.5"
    prefill, decode = spec.sparse_mode["prefill"], spec.sparse_mode["decode"]
    return [
        ("query_rope", "q_rope_tnd"),
        ("key_rope", "self.nz_view(self.rope_cache)"),
        ("num_query_heads" if v2 else "num_heads", "self.num_heads_per_rank"),
        ("num_key_value_heads", "self.num_key_value_heads_per_rank"),
        ("input_layout", f'"{spec.input_layout}"'),
        ("softmax_scale" if v2 else "scale", scale),
        ("atten_mask", "md.attention_mask if md.is_prefill else None"),
        ("sparse_mode", f"{prefill} if md.is_prefill else {decode}"),
        ("block_table", "md.block_table[self.attn_type]"),
        ("block_size", "nope_nz.shape[-2]"),
        ("actual_seq_qlen" if v2 else "actual_seq_lengths", "md.actual_seq_lengths_cu_q"),
        ("actual_seq_kvlen" if v2 else "actual_seq_lengths_kv", "md.actual_seq_lengths_kv"),
    ]


class MlaAttentionForwardCommand(MlaCommand):
    """Replace the seam of every MLA attention forward by the absorbed paged attention."""

    DESCRIPTION = "Write the latent (fused or scatter, NZ) and attend with the absorbed fused MLA."

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        if not is_attention_class(original_node) or m.findall(original_node, FA_CALL):
            return updated_node
        facts = self.facts(original_node)
        body = replace_method(updated_node, "forward", lambda f: self._convert(f, facts))
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

    def _convert(self, forward: cst.FunctionDef, facts: MlaAttentionFacts) -> cst.FunctionDef:
        seam = facts.seam
        assert seam is not None
        block = cst.ensure_type(forward.body, cst.IndentedBlock)
        old = list(block.body)
        inside = old[seam.update_index : seam.kernel_index]
        fused = facts.fused
        values = {
            "query_parts": facts.query_parts is not None,
            "q_nope": facts.query_parts[0] if facts.query_parts else "",
            "q_rope": facts.query_parts[1] if facts.query_parts else "",
            "query": seam.query,
            "scatter": fused is None,
            "latent": seam.key,
            "rope_key": seam.value,
            "raw": fused.raw_latent if fused else "",
            "norm": fused.norm if fused else "",
            "norm_weight": fused.norm_weight if fused else "",
            "norm_eps": fused.norm_eps if fused else "",
            "cos": fused.cos if fused else "",
            "sin": fused.sin if fused else "",
            "op": FA_OPS[self.spec.fa_version],
            "kwargs": fa_kwargs(self.spec, seam),
            "bnsd": seam.style is KernelStyle.SDPA,
            "output": seam.targets[0],
            "extra_outputs": [t for t in seam.targets[1:] if t != "_"],
        }
        new = statements("seam", self.parser_config(), **values)
        if facts.query_parts is None:
            # the query is built inside the seam: keep the statements that define it
            new = [*_defining(inside, seam.query), *new]
        new[0] = new[0].with_changes(
            leading_lines=[*old[seam.update_index].leading_lines, *new[0].leading_lines]
        )
        before = old[: seam.update_index]
        if fused is not None:
            before = _drop_latent_norm(before, fused.norm, old[seam.kernel_index + 1 :])
        body = [*before, *new, *old[seam.kernel_index + 1 :]]
        return forward.with_changes(body=block.with_changes(body=body))


def _drop_latent_norm(
    stmts: list[cst.BaseStatement], norm: str, after: list[cst.BaseStatement]
) -> list[cst.BaseStatement]:
    """Without ``x = self.<norm>(x)``: the fused write normalises the latent itself.

    Only that exact statement goes, and only when ``x`` is not read after the seam, so the
    latent it produced fed nothing but the (replaced) cache write.
    """
    used_after = {cst.ensure_type(n, cst.Name).value for s in after for n in m.findall(s, m.Name())}
    kept = []
    for stmt in stmts:
        match = m.matches(
            stmt,
            m.SimpleStatementLine(
                body=[
                    m.Assign(
                        targets=[m.AssignTarget(target=m.Name())],
                        value=m.Call(
                            func=m.Attribute(value=m.Name("self"), attr=m.Name(norm)),
                            args=[m.Arg(value=m.Name())],
                        ),
                    )
                ]
            ),
        )
        if match:
            assign = cst.ensure_type(
                cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign
            )
            target = cst.ensure_type(assign.targets[0].target, cst.Name).value
            source = cst.ensure_type(
                cst.ensure_type(assign.value, cst.Call).args[0].value, cst.Name
            )
            if target == source.value and target not in used_after:
                continue
        kept.append(stmt)
    return kept


def _defining(stmts: list[cst.BaseStatement], name: str) -> list[cst.BaseStatement]:
    target = m.AssignTarget(target=m.Name(name))
    return [
        s for s in stmts if m.findall(s, m.Assign(targets=[m.ZeroOrMore(), target, m.ZeroOrMore()]))
    ]


class MlaCacheInfoCommand(MlaCommand):
    """Add ``self.block_size`` and ``get_cache_info`` (``is_mla_backend=True``) to the head."""

    DESCRIPTION = "Report the latent caches through get_cache_info(is_mla_backend=True)."

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        if not is_causal_lm_class(original_node) or m.findall(original_node.body, GET_CACHE_INFO):
            return updated_node
        config = self.parser_config()
        return add_cache_info(
            updated_node, self.spec.block_size, methods("cache_info", config), config
        )
