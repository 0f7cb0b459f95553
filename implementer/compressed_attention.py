"""Compressed attention (DeepSeek-V4): the paged rewrite of its ``__init__`` and its seam.

What the source computes is described, with its lines, in ``analyzer/compressed_features.py``.
The rewrite keeps everything above the seam (q, the window rows, q_residual) and below it (the
output's inverse rope, the grouped output projection) as written, and replaces the window's
cache update, the ``self.compressor(...)`` call and the kernel call by the paged form the
framework runs (``templates/compressed_attn_*.py.j2``):

- ``__init__``: ``win_kv`` (SlidingWindow, one K = V head, manager ``win_kv``); per compressor
  module (the compressor, and the CSA indexer's own) its pooled rows ``*_cmp_kv``
  (``compress_ratio``, manager ``c{r}a_cmp_kv``) and its float32 state rows ``*_kv_state``
  (SlidingWindow of coff x r tokens, manager ``c{r}a_cmp_state``);
- the seam: the window rows written at ``slot_mapping["win_kv"]``; ``custom.compressor`` over
  each module's weights and state rows, its entries written at their rows (block table, no
  slot mapping); CSA's top-k from ``npu_lightning_indexer`` with one batch row per query
  token; ``custom.npu_sparse_attn_sharedkv`` over the window, the entries and the sinks.

The modules' weights and settings are read by the attribute names of transformers 5's
``DeepseekV4*Compressor`` / ``DeepseekV4Indexer``; a file whose classes lack one is refused
with the class and the attribute (``problems``).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import method
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer._command import append_statements, replace_method, with_body
from kvskill.implementer.attn_forward import AttentionForwardCommand, seam_values, splice_seam
from kvskill.implementer.attn_init import AttentionInitCommand
from kvskill.implementer.facts import SeamFacts, attention_facts, code
from kvskill.implementer.rotary import cover_positions
from kvskill.implementer.snippets import methods, statements

#: the attention's attribute holding its compressor, and the compressor's holding its indexer
COMPRESSOR_ATTR, INDEXER_ATTR = "compressor", "indexer"
#: what the rewrite reads of every compressor module (the compressor, the CSA indexer's own)
COMPRESSOR_READS = (
    "compress_rate", "head_dim", "kv_proj", "gate_proj", "position_bias", "kv_norm",
    "rotary_emb",
)  # fmt: skip
#: what it reads of the indexer besides, and of the indexer's scorer
INDEXER_READS = ("q_b_proj", "scorer", "index_topk")
SCORER_READS = ("weights_proj", "weights_scaling", "softmax_scale")
_STATE_CALL = m.Call(func=m.Attribute(attr=m.Name("store_compression_weights")))
_TOPK_CALL = m.Call(func=m.Attribute(attr=m.Name("topk")))
_COMPRESSOR_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(COMPRESSOR_ATTR)))


def _assigned_attrs(cls: cst.ClassDef) -> set[str]:
    """``self.X = ...`` in ``__init__`` and class-level ``X = ...``."""
    found = set()
    init = method(cls, "__init__")
    for target in (
        m.findall(init, m.AssignTarget(target=m.Attribute(value=m.Name("self")))) if init else []
    ):
        found.add(
            cst.ensure_type(
                cst.ensure_type(target, cst.AssignTarget).target, cst.Attribute
            ).attr.value
        )
    for stmt in cst.ensure_type(cls.body, cst.IndentedBlock).body:
        for target in (
            m.findall(stmt, m.AssignTarget(target=m.Name()))
            if isinstance(stmt, cst.SimpleStatementLine)
            else []
        ):
            found.add(
                cst.ensure_type(cst.ensure_type(target, cst.AssignTarget).target, cst.Name).value
            )
    return found  # fmt: skip


def compressor_problems(module: cst.Module) -> list[str]:
    """What a compressor module, the CSA indexer or its scorer lacks of what the rewrite reads."""
    classes = [c for c in module.body if isinstance(c, cst.ClassDef)]
    stateful = [c for c in classes if m.findall(c, _STATE_CALL)]
    problems = []
    if not stateful:
        problems.append(
            "no class keeps compressor state (`.store_compression_weights(...)`): the paged "
            "rewrite replaces that state by custom.compressor's state rows"
        )
    for cls in stateful:
        reads = COMPRESSOR_READS + ((*INDEXER_READS,) if m.findall(cls, _TOPK_CALL) else ())
        missing = [a for a in (*reads, "rope_layer_type") if a not in _assigned_attrs(cls)]
        if missing:
            problems.append(
                f"{cls.name.value} sets no {', '.join(missing)}, which the paged compressor "
                "reads (custom.compressor's weights, ape, norm and rope)"
            )
    scorers = [c for c in classes if {"weights_proj", "weights_scaling"} <= _assigned_attrs(c)]
    if any(m.findall(c, _TOPK_CALL) for c in stateful) and not any(
        set(SCORER_READS) <= _assigned_attrs(c) for c in scorers
    ):
        problems.append(
            "the CSA indexer's scorer sets not all of "
            f"{', '.join(SCORER_READS)} (its weights and scales feed npu_lightning_indexer)"
        )
    functions = {f.name.value for f in module.body if isinstance(f, cst.FunctionDef)}
    if "apply_rotary_pos_emb" not in functions:
        problems.append("no module-level apply_rotary_pos_emb to rope the indexer's query")
    return problems


def _compressor_call(forward: cst.FunctionDef, seam: SeamFacts) -> cst.Call | None:
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    region = body[seam.update_index : seam.kernel_index + 1]
    calls = [c for stmt in region for c in m.findall(stmt, _COMPRESSOR_CALL)]
    return cst.ensure_type(calls[0], cst.Call) if len(calls) == 1 else None


class CompressedAttentionInitCommand(AttentionInitCommand):
    """Declare win_kv and, per compressor module, its pooled and state rows."""

    DESCRIPTION = (
        "Declare the compressed attention's caches: win_kv (K = V window) and, per compressor, "
        "its pooled rows (compress_ratio) and float32 state rows."
    )
    INIT_TEMPLATE = "compressed_attn_init.py.j2"
    METHODS_TEMPLATE = "compressed_attn_methods.py.j2"
    #: the methods __init__ needs (the forward command adds the rest)
    INIT_METHODS = frozenset({"set_win_kv", "compressed_cache_entries", "custom_operators"})

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        return compressor_problems(module)

    def template_values(self, cls: cst.ClassDef, config: str, layer_idx: str | None) -> dict:
        return {
            "config": config,
            "attn_tp_size": self.spec.attn_tp_size,
            "compressor": COMPRESSOR_ATTR,
            "indexer": INDEXER_ATTR,
        }

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = attention_facts(original, self.classes)
        assert facts.config_param is not None, "the pipeline validates attention facts first"
        config = self.parser_config()
        values = self.template_values(original, facts.config_param, facts.layer_idx_param)
        init_stmts = statements(self.INIT_TEMPLATE, config, **values)
        added = [
            f for f in methods(self.METHODS_TEMPLATE, config) if f.name.value in self.INIT_METHODS
        ]
        body = replace_method(updated, "__init__", lambda init: append_statements(init, init_stmts))
        return with_body(updated, [*body, *added])


class CompressedAttentionForwardCommand(AttentionForwardCommand):
    """Replace the window update, the compressor call and the kernel by the paged reads."""

    DESCRIPTION = (
        "Write the window rows at slot_mapping; pool with custom.compressor into the compressed "
        "rows; select CSA's entries with npu_lightning_indexer; attend with "
        "custom.npu_sparse_attn_sharedkv (window, entries, sinks)."
    )
    SEAM_TEMPLATE = "compressed_attn_seam.py.j2"
    METHODS_TEMPLATE = "compressed_attn_methods.py.j2"

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        return []  # the init command reports the compressor modules' problems once

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        seam = attention_facts(original, self.classes).seam
        assert seam is not None, "the pipeline validates attention facts first"
        self.class_name = original.name.value
        config = self.parser_config()
        forward = method(original, "forward")
        call = _compressor_call(forward, seam) if forward is not None else None
        positional = [a for a in call.args if a.keyword is None] if call is not None else []
        if len(positional) < 3:
            raise UnsupportedModelError(
                f"{self.class_name}.forward: no single `self.{COMPRESSOR_ATTR}(hidden_states, "
                "q_residual, position_ids, ...)` between the window update and the kernel"
            )
        names = {
            "hidden": code(positional[0].value),
            "q_residual": code(positional[1].value),
            "positions": code(positional[2].value),
        }
        body = replace_method(
            updated,
            "forward",
            lambda f: self._paged_forward(f, seam, names, config),
        )
        init_methods = CompressedAttentionInitCommand.INIT_METHODS
        added = [
            f for f in methods(self.METHODS_TEMPLATE, config) if f.name.value not in init_methods
        ]
        return with_body(updated, [*body, *added])

    def _paged_forward(
        self, forward: cst.FunctionDef, seam: SeamFacts, names: dict, config
    ) -> cst.FunctionDef:
        values = seam_values(seam)
        new = statements(
            self.SEAM_TEMPLATE,
            config,
            sinks=seam.sinks or "None",
            scale=seam.scale or f"{seam.query}.shape[-1] ** -0.5",
            query=values["query"],
            key=values["key"],
            output=values["output"],
            to_tnd=values["to_tnd"],
            extra_outputs=values["extra_outputs"],
            **names,
        )
        forward, sized = cover_positions(splice_seam(forward, seam, new))
        self.sized_rotary = self.sized_rotary or sized
        return forward
