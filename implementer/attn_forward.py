"""Attention ``forward``: replace the cache write and the attention kernel by the paged seam.

Everything above the seam (projections, norms, RoPE) and below it (reshape, ``o_proj``) stays
as written. The seam flattens query/key/value to TND, writes the new keys and values with
``npu_scatter_nd_update_`` at ``slot_mapping[self.attn_type]`` and calls the fused attention
with the Plan's version, layout, sparse mode, window, scale and sinks over
``block_table[self.attn_type]``; its output is handed back in the layout the source kernel
returned, so the code after the seam runs unchanged.
"""

from __future__ import annotations

import libcst as cst
from kvskill.implementer._command import AttentionForwardRewrite, replace_method, with_body
from kvskill.implementer.attn_init import _by_type
from kvskill.implementer.fa_call import (
    FA_OPS,
    fa_keywords,
    host_lengths,
    sparse_mode_expr,
)
from kvskill.implementer.facts import (
    BNSD_STYLES,
    CacheLayout,
    SeamFacts,
    attention_facts,
    module_classes,
    seam_forward,
)
from kvskill.implementer.rotary import cover_positions, with_helper
from kvskill.implementer.snippets import methods, statements
from kvskill.implementer.spec import ConversionSpec


def _sparse_mode_expr(spec: ConversionSpec) -> str:
    per_type = {}
    for kind in spec.attn_types:
        per_type[kind] = sparse_mode_expr(spec.sparse_mode[kind])
    return _by_type(spec, per_type)


def fa_kwargs(spec: ConversionSpec, seam: SeamFacts) -> list[tuple[str, str]]:
    """Keyword arguments of the FA call, with the version's own names (npu_ops §2.2)."""
    scale = seam.scale or f"{seam.query}.shape[-1] ** -0.5"
    kwargs = [
        ("num_heads", "self.num_heads_per_rank"),
        ("num_key_value_heads", "self.num_key_value_heads_per_rank"),
        ("input_layout", f'"{spec.input_layout}"'),
        ("scale", scale),
        ("atten_mask", "md.attention_mask"),
        ("sparse_mode", _sparse_mode_expr(spec)),
    ]
    if spec.windows:
        kwargs += [("pre_tokens", "self.pre_tokens"), ("next_tokens", "self.next_tokens")]
    kwargs += [
        ("block_table", "md.block_table[self.attn_type]"),
        ("block_size", "block_size"),
        ("actual_seq_lengths", host_lengths("actual_seq_lengths_cu_q")),
        ("actual_seq_lengths_kv", host_lengths("actual_seq_lengths_kv")),
    ]
    if spec.has_sinks:
        assert seam.sinks is not None, "the pipeline checks sinks are passed to the kernel"
        kwargs.append(("learnable_sink", seam.sinks))
    return fa_keywords(spec.fa_version, kwargs)


def splice_seam(
    forward: cst.FunctionDef, seam: SeamFacts, new: list[cst.BaseStatement]
) -> cst.FunctionDef:
    """FORWARD with the statements from the cache update through the kernel replaced by NEW,
    followed by what a callee kernel did to its output (``seam.after``)."""
    block = cst.ensure_type(forward.body, cst.IndentedBlock)
    old = list(block.body)
    # keep the blank lines / comments that led into the seam
    new = [
        new[0].with_changes(
            leading_lines=[*old[seam.update_index].leading_lines, *new[0].leading_lines]
        ),
        *new[1:],
    ]
    body = [*old[: seam.update_index], *new, *seam.after, *old[seam.kernel_index + 1 :]]
    return forward.with_changes(body=block.with_changes(body=body))


class AttentionForwardCommand(AttentionForwardRewrite):
    """Replace the seam of every attention forward and add ``update_cache``."""

    DESCRIPTION = "Write K/V with npu_scatter_nd_update_ and attend with the fused paged attention."
    #: the seam that replaces the cache write through the kernel call
    SEAM_TEMPLATE = "framework_attn_seam.py.j2"
    #: the template whose ``update_cache`` method the class receives
    METHODS_TEMPLATE = "framework_attn_methods.py.j2"

    def fa_kwargs(self, seam: SeamFacts) -> list[tuple[str, str]]:
        return fa_kwargs(self.spec, seam)

    def visit_Module(self, node: cst.Module) -> bool:
        self.classes = module_classes(node)
        #: whether a converted forward sizes a rotary table with seq_len= (rotary.py)
        self.sized_rotary = False
        return True

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if not self.sized_rotary:
            return updated_node
        return with_helper(updated_node, self.parser_config())

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        seam = attention_facts(original, self.classes).seam
        assert seam is not None, "the pipeline validates attention facts first"
        #: the class being rewritten, for the messages of the forward rewrites
        self.class_name = original.name.value
        config = self.parser_config()
        body = replace_method(
            updated,
            "forward",
            lambda f: self._convert_forward(*seam_forward(updated, f), seam, config),
        )
        wanted = {"update_cache"} | (
            {"site_cache_entries", "use_call_site"} if seam.site is not None else set()
        )
        update_cache = [f for f in methods(self.METHODS_TEMPLATE, config) if f.name.value in wanted]
        return with_body(updated, [*body, *update_cache])

    def _convert_forward(
        self,
        forward: cst.FunctionDef,
        note: list[cst.EmptyLine],
        seam: SeamFacts,
        config: cst.PartialParserConfig,
    ) -> cst.FunctionDef:
        new = statements(
            self.SEAM_TEMPLATE,
            config,
            **seam_values(seam),
            op=FA_OPS[self.spec.fa_version],
            kwargs=self.fa_kwargs(seam),
            shared_kv=self.spec.reads_shared_kv is not None,
        )
        new[0] = new[0].with_changes(leading_lines=[*note, *new[0].leading_lines])
        forward, sized = cover_positions(splice_seam(forward, seam, new))
        self.sized_rotary = self.sized_rotary or sized
        return forward


#: what brings a tensor of each layout to ``[b, s, h, d]``, ready for ``.reshape(-1, N, D)``
#: (TND) or ``.reshape(b, s, -1)`` (BSH).
#: NOTE (unconfirmed on device, npu_ops §9): the runtime's batch is one, so the reshape of a
#: transposed BHSD tensor stays a view and the TND query reaches the operator strided (the
#: fake-NPU dry run records gpt_oss, qwen3_next and qwen3_5, ``STRIDED_QUERY``). The docs say
#: the query "不支持非连续的Tensor"; whether the device copies or refuses it is not settled,
#: and a ``.contiguous()`` here would change those conversions (and goldens): left open.
TO_TOKENS_FIRST = {
    CacheLayout.BHSD: ".transpose(1, 2)",
    CacheLayout.BSHD: "",
    CacheLayout.SBHD: ".transpose(0, 1)",
}
#: (batch axis, sequence axis) of each layout
BATCH_SEQ_AXES = {CacheLayout.BHSD: (0, 2), CacheLayout.BSHD: (0, 1), CacheLayout.SBHD: (1, 0)}


def seam_values(seam: SeamFacts) -> dict:
    """The template values every attention seam takes from the source's kernel call."""
    return {
        "query": seam.query,
        "key": seam.key,
        "value": seam.value,
        "output": seam.targets[0],
        "bnsd": seam.style in BNSD_STYLES,
        "to_tnd": TO_TOKENS_FIRST[seam.layout],
        "batch_axis": BATCH_SEQ_AXES[seam.layout][0],
        "seq_axis": BATCH_SEQ_AXES[seam.layout][1],
        "extra_outputs": [t for t in seam.targets[1:] if t != "_"] + list(seam.nulled),
        "site": seam.site,
    }


__all__ = ["AttentionForwardCommand", "fa_kwargs", "seam_values", "splice_seam"]
