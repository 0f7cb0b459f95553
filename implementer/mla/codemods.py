"""The MLA codemods: attention ``__init__`` (latent caches), ``forward`` (paged seam) and the
model class (``get_cache_info`` with ``is_mla_backend=True``).

Everything above the seam (projections, norms, rope) and below it (reshape, ``o_proj``) stays
as written; the seam (from the cache write of the latent to the attention kernel) becomes the
latent cache write, then the attention: on prefill steps un-absorbed over the context read back
from the cache and decompressed with the layer's ``kv_b_proj`` (the operator takes the absorbed
latent query only for 1..16 tokens per request), on decode steps absorbed over the paged latent.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.pooled_indexer import POOL_KEY_CACHE, POOL_STATE
from kvskill.implementer._command import (
    AttentionForwardRewrite,
    AttentionInitRewrite,
    ClassRewriteCommand,
    ModelClassRewrite,
    append_statements,
    replace_method,
    with_body,
)
from kvskill.implementer.attn_forward import seam_values
from kvskill.implementer.fa_call import FA_OPS, fa_keywords, host_lengths
from kvskill.implementer.facts import SeamFacts, init_owner, seam_forward
from kvskill.implementer.mla.facts import MlaAttentionFacts, mla_attention_facts
from kvskill.implementer.mla.indexer import KEY_CACHE_ATTR
from kvskill.implementer.mla.pooled_indexer import POOL_KEY_ATTR, POOL_STATE_ATTR
from kvskill.implementer.mla.spec import CacheWrite, IndexerSpec, MlaSpec
from kvskill.implementer.model_class import add_cache_info
from kvskill.implementer.rotary import cover_positions, with_helper
from kvskill.implementer.snippets import methods, statements


class MlaCommand(ClassRewriteCommand):
    """A class rewrite that reads MLA facts, which need the module's class table."""

    spec: MlaSpec

    def visit_Module(self, node: cst.Module) -> bool:
        self.classes = {c.name.value: c for c in node.body if isinstance(c, cst.ClassDef)}
        #: whether a converted forward sizes a rotary table with seq_len= (rotary.py)
        self.sized_rotary = False
        return True

    def facts(self, cls: cst.ClassDef) -> MlaAttentionFacts:
        facts = mla_attention_facts(
            cls,
            self.classes,
            self.spec.cache_write is CacheWrite.FUSED,
            indexed=self.spec.indexer is not None,
            shared_layers=self.spec.indexer is not None and self.spec.indexer.shared_layers,
            own_latent_only=self.spec.own_latent_only,
        )
        assert not facts.problems, "the pipeline validates attention facts first"
        return facts


class MlaAttentionInitCommand(MlaCommand, AttentionInitRewrite):
    """Declare attn_type, heads per rank, the latent caches and their entries."""

    DESCRIPTION = (
        "Declare nope_cache + rope_cache (one latent head) in every MLA attention __init__."
    )

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        if init_owner(original, self.classes) is not original:
            # a variant of an attention family (XFlashAttention2(XAttention)) runs its base's
            # __init__ and inherits its methods: the caches and helpers are declared there, once
            return updated
        facts = self.facts(original)
        config = self.parser_config()
        cfg = facts.config_param
        values = {
            "config": cfg,
            "attn_type": self.spec.attn_type,
            "attn_tp_size": self.spec.attn_tp_size,
            "kv_b_proj": facts.kv_b_proj,
            "scatter": self.spec.cache_write is CacheWrite.SCATTER,
            "nope_layers": self.spec.nope_layers,
            "rope_less": self.spec.rope_less,
            "indexer_attr": "",
            "indexer_key_cache": "",
            "indexer_setters": [],
            "optional_entries": [],
        }
        entries = [("nope_cache", f"{cfg}.kv_lora_rank", {})]
        if not self.spec.rope_less:
            entries.append(("rope_cache", f"{cfg}.qk_rope_head_dim", {}))
        indexer = self.spec.indexer
        if indexer is not None:
            indexer_entries = indexer_cache_entries(indexer, cfg)
            if facts.indexer is not None and facts.indexer.shared_from is not None:
                # a layer without an indexer module (it reuses another layer's top-k) has no
                # indexer keys: the entries are declared only where the module exists
                values["optional_entries"] = indexer_entries
            else:
                entries.extend(indexer_entries)
            values["indexer_attr"] = facts.indexer.attr if facts.indexer else ""
            values["indexer_key_cache"] = indexer.key_cache
            values["indexer_setters"] = indexer_setters(indexer)
        values["pooled"] = indexer is not None and indexer.pool_size > 1
        init_stmts = statements("mla_init.py.j2", config, entries=entries, **values)
        body = replace_method(updated, "__init__", lambda init: append_statements(init, init_stmts))
        return with_body(updated, [*body, *methods("mla_methods.py.j2", config, **values)])


def indexer_cache_entries(indexer: IndexerSpec, cfg: str) -> list[tuple[str, str, dict]]:
    """(cache name, dim, extra CacheEntry fields) of the indexer's caches: its paged keys, one
    per token; or, for a k-pool indexer, one pooled key per closed pool (a compressed entry,
    ``compress_ratio`` = the pool size, in a group of its own) and the open pool's [key |
    gate] rows (a window of one pool per request: what a closing pool reads)."""
    if indexer.pool_size == 1:
        return [(indexer.key_cache, f"{cfg}.index_head_dim", {})]
    return [
        (
            POOL_KEY_CACHE,
            f"{cfg}.index_head_dim",
            {"manager_key": f'"{POOL_KEY_CACHE}"', "compress_ratio": f"{cfg}.index_kpool"},
        ),
        (
            POOL_STATE,
            f"{cfg}.index_head_dim",
            {
                "attn_type": '"SlidingWindow"',
                "num_head": "2",  # the key and the gate score
                "manager_key": f'"{POOL_STATE}"',
                "sliding_window": f"{cfg}.index_kpool",
            },
        ),
    ]


def indexer_setters(indexer: IndexerSpec) -> list[tuple[str, str]]:
    """(cache entry, the indexer module's attribute its setter hands the tensor to)."""
    if indexer.pool_size == 1:
        return [(indexer.key_cache, KEY_CACHE_ATTR)]
    return [(POOL_KEY_CACHE, POOL_KEY_ATTR), (POOL_STATE, POOL_STATE_ATTR)]


def _scale(seam: SeamFacts) -> str:
    return seam.scale or "(q_nope_tnd.shape[-1] + q_rope_tnd.shape[-1]) ** -0.5"


def prefill_fa_kwargs(spec: MlaSpec, seam: SeamFacts) -> list[tuple[str, str]]:
    """Keywords of the un-absorbed prefill call: decompressed per-head K/V, packed TND.

    The docs' TND case (npu_ops §9): no page attention, one key/value head per query head,
    cumulative query and key lengths, causal through ``sparse_mode`` 3 and the 2048 tile.

    NOTE (open, npu_ops §9): that case takes Q_D = K_D = 192 with V_D 128/192 (v2 also 128);
    MLA models with 256-wide heads (nope 192 + rope 64, V_D 256: glm4_moe_lite, glm_moe_dsa,
    hy_v4) have no documented prefill case. The analyzer warns (``op_limits._mla``) and the
    NPU profile refuses the call at their real size; no other prefill path is generated.
    """
    kwargs = [
        ("num_heads", "self.num_heads_per_rank"),
        ("num_key_value_heads", "self.num_heads_per_rank"),
        ("input_layout", '"TND"'),
        ("scale", _scale(seam)),
        ("atten_mask", "md.attention_mask"),
        ("sparse_mode", str(spec.sparse_mode["prefill"])),
        ("actual_seq_lengths", host_lengths("actual_seq_lengths_cu_q")),
        ("actual_seq_lengths_kv", host_lengths("actual_seq_lengths_cu_kv")),
    ]
    return fa_keywords(spec.fa_version, kwargs)


def decode_fa_kwargs(spec: MlaSpec, seam: SeamFacts) -> list[tuple[str, str]]:
    """Keywords of the absorbed decode call, with the version's own names (npu_ops §2.2)."""
    kwargs = [
        ("query_rope", "q_rope_tnd.contiguous()"),
        ("key_rope", "self.nz_view(self.rope_cache)"),
        ("num_heads", "self.num_heads_per_rank"),
        ("num_key_value_heads", "self.num_key_value_heads_per_rank"),
        ("input_layout", f'"{spec.input_layout}"'),
        ("scale", _scale(seam)),
        ("atten_mask", "None"),
        ("sparse_mode", str(spec.sparse_mode["decode"])),
        ("block_table", "md.block_table[self.attn_type]"),
        ("block_size", "nope_nz.shape[-2]"),
        ("actual_seq_lengths", host_lengths("actual_seq_lengths_cu_q")),
        ("actual_seq_lengths_kv", host_lengths("actual_seq_lengths_kv")),
    ]
    return fa_keywords(spec.fa_version, kwargs)


class MlaAttentionForwardCommand(MlaCommand, AttentionForwardRewrite):
    """Replace the seam of every MLA attention forward by the paged latent attention."""

    DESCRIPTION = (
        "Write the latent (fused or scatter, NZ); prefill attends un-absorbed (TND), decode "
        "absorbed."
    )

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if not self.sized_rotary:
            return updated_node
        return with_helper(updated_node, self.parser_config())

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = self.facts(original)
        return with_body(
            updated,
            replace_method(
                updated, "forward", lambda f: self._convert(*seam_forward(updated, f), facts)
            ),
        )

    def _convert(
        self, forward: cst.FunctionDef, note: list[cst.EmptyLine], facts: MlaAttentionFacts
    ) -> cst.FunctionDef:
        seam = facts.seam
        assert seam is not None
        block = cst.ensure_type(forward.body, cst.IndentedBlock)
        old = list(block.body)
        inside = old[seam.update_index : seam.kernel_index]
        fused = facts.fused
        decompressed = facts.decompressed
        values = {
            **seam_values(seam),
            "query_parts": facts.query_parts is not None,
            "q_nope": facts.query_parts[0] if facts.query_parts else "",
            "q_rope": facts.query_parts[1] if facts.query_parts else "",
            "scatter": fused is None,
            # the source's cache write takes the latent, or it caches decompressed K/V and the
            # latent it fed kv_b_proj is named here (evaluated once)
            "latent_expr": decompressed.latent if decompressed else "",
            "latent": "mla_latent" if decompressed else seam.key,
            "rope_key": decompressed.rope_key if decompressed else seam.value,
            "raw": fused.raw_latent if fused else "",
            "norm": fused.norm if fused else "",
            "norm_weight": fused.norm_weight if fused else "",
            "norm_eps": fused.norm_eps if fused else "",
            "cos": fused.cos if fused else "",
            "sin": fused.sin if fused else "",
            "kv_b_proj": facts.kv_b_proj,
            "nope_layers": self.spec.nope_layers,
            "rope_less": self.spec.rope_less,
        }
        if facts.indexer is not None:
            # the sparse attention's keywords are the DSA template's own
            values["topk"] = facts.indexer.target
            values["scale"] = _scale(seam)
            assert self.spec.indexer is not None
            # a k-pool selection names pools: one entry reads a block of one pool's tokens
            values["sparse_block_size"] = (
                "self.mla_sparse_block_size" if self.spec.indexer.pool_size > 1 else "1"
            )
            new = statements("mla_dsa_seam.py.j2", self.parser_config(), **values)
            # the indexer runs after the latent write, as in the source, on the same step
            new.insert(_after_write(new), facts.indexer.statement)
        else:
            values["op"] = FA_OPS[self.spec.fa_version]
            values["prefill_kwargs"] = prefill_fa_kwargs(self.spec, seam)
            values["decode_kwargs"] = decode_fa_kwargs(self.spec, seam)
            new = statements("mla_seam.py.j2", self.parser_config(), **values)
        if facts.query_in_seam:
            # the query is built inside the seam: keep the statements that define it
            new = [*_defining(inside, seam.query), *new]
        new[0] = new[0].with_changes(
            leading_lines=[*old[seam.update_index].leading_lines, *note, *new[0].leading_lines]
        )
        if not facts.query_in_seam:
            # after the seam's opening comment and metadata line, before the query is read
            new[1:1] = _rescaled(facts, seam)
        before = old[: seam.update_index]
        if fused is not None:
            before = _drop_latent_norm(before, fused.norm, old[seam.kernel_index + 1 :])
        body = [*before, *new, *old[seam.kernel_index + 1 :]]
        converted, sized = cover_positions(forward.with_changes(body=block.with_changes(body=body)))
        self.sized_rotary = self.sized_rotary or sized
        return converted


def _rescaled(facts: MlaAttentionFacts, seam: SeamFacts) -> list[cst.BaseStatement]:
    """The source's per-position query rescales (verified in facts), applied to the query
    parts the seam reads: one factor per query vector scales each part as it scaled their
    concatenation."""
    scaled = facts.query_parts or (seam.query,)
    found = [r.applied_to(name) for r in facts.query_rescales for name in scaled]
    if found:
        notes = (
            "# The query's per-position rescale, as the source applies it after the cache",
            "# write: one factor per query vector, so each part takes it.",
        )
        lines = [cst.EmptyLine(comment=cst.Comment(n)) for n in notes]
        found[0] = found[0].with_changes(leading_lines=lines)
    return found


def _after_write(stmts: list[cst.BaseStatement]) -> int:
    """Index right after the DSA seam's latent write (the fused operator's call, or the
    scatter write's update_latent_cache)."""
    write = m.Call(
        func=m.Attribute(attr=m.Name("npu_kv_rmsnorm_rope_cache") | m.Name("update_latent_cache"))
    )
    writes = [i for i, s in enumerate(stmts) if m.findall(s, write)]
    return writes[0] + 1


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


class MlaCacheInfoCommand(ModelClassRewrite):
    """Add ``self.block_size`` and ``get_cache_info`` (``is_mla_backend=True``) to the head."""

    DESCRIPTION = "Report the latent caches through get_cache_info(is_mla_backend=True)."

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        config = self.parser_config()
        cache_info = methods("mla_cache_info.py.j2", config)
        return add_cache_info(updated, self.spec.block_size, cache_info, config)
