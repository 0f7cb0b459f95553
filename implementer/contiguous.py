"""Mode 1 codemods: contiguous BSH caches written with ``scatter_update_`` at the runner's kv_len.

The attention ``__init__`` declares the same cache entries as the paged rewrite (so the runner
learns every layer's heads, head dim and dtype from ``get_cache_info()``), but the runner binds
``[batch, max_seq_len, heads * head_dim]`` tensors to them. The forward seam keeps the source's
``[B, S]`` batch: it flattens heads into BSH, writes each row from its current length on and
calls the fused attention with ``input_layout="BSH"`` over the whole per-row cache.
"""

from __future__ import annotations

import libcst as cst
from kvskill.implementer._command import (
    AttentionForwardRewrite,
    AttentionInitRewrite,
    append_statements,
    replace_method,
    with_body,
)
from kvskill.implementer.attn_forward import seam_values, splice_seam
from kvskill.implementer.attn_init import init_values
from kvskill.implementer.fa_call import FA_OPS, fa_keywords
from kvskill.implementer.facts import SeamFacts, attention_facts
from kvskill.implementer.snippets import methods, statements
from kvskill.implementer.spec import ConversionSpec

#: the contiguous layout's sparse modes: causal prefill over the 2048 tile; decode (one query
#: per row, BSH) runs the operator's decode branch, which masks by actual_seq_lengths_kv alone
#: and ignores sparse_mode (npu_ops §1.4), so it is written as what it is: 0 without a mask
CONTIGUOUS_SPARSE_MODE = {"prefill": 3, "decode": 0}


def bsh_fa_kwargs(spec: ConversionSpec, seam: SeamFacts) -> list[tuple[str, str]]:
    """Keyword arguments of the BSH fused-attention call, in the version's own names."""
    prefill, decode = CONTIGUOUS_SPARSE_MODE["prefill"], CONTIGUOUS_SPARSE_MODE["decode"]
    kwargs = [
        ("num_heads", "self.num_heads_per_rank"),
        ("num_key_value_heads", "self.num_key_value_heads_per_rank"),
        ("input_layout", '"BSH"'),
        ("scale", seam.scale or f"{seam.query}.shape[-1] ** -0.5"),
        ("atten_mask", "md.attention_mask if md.is_prefill else None"),
        ("sparse_mode", f"{prefill} if md.is_prefill else {decode}"),
        # BSH takes per-row lengths for both (npu_ops §1.3); the decode branch reads only kv
        ("actual_seq_lengths", "md.actual_seq_lengths_q"),
        ("actual_seq_lengths_kv", "md.actual_seq_lengths_kv"),
    ]
    return fa_keywords(spec.fa_version, kwargs)


class ContiguousAttentionInitCommand(AttentionInitRewrite):
    """Declare attn_type, heads per rank, cache placeholders, entries and their setters."""

    DESCRIPTION = "Declare the runner-owned contiguous caches in every attention __init__."

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = attention_facts(original)
        assert facts.config_param is not None, "the pipeline validates attention facts first"
        config = self.parser_config()
        values = init_values(self.spec, original, facts.config_param, facts.layer_idx_param)
        init_stmts = statements("contiguous_init.py.j2", config, **values)
        setters = [
            f
            for f in methods("contiguous_methods.py.j2", config)
            if f.name.value.startswith("set_")
        ]
        body = replace_method(updated, "__init__", lambda init: append_statements(init, init_stmts))
        return with_body(updated, [*body, *setters])


class ContiguousAttentionForwardCommand(AttentionForwardRewrite):
    """Replace the seam of every attention forward by the BSH write + attention; add update_cache."""

    DESCRIPTION = (
        "Write K/V with scatter_update_ at kv_len and attend with the fused BSH attention."
    )

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        seam = attention_facts(original).seam
        assert seam is not None, "the pipeline validates attention facts first"
        config = self.parser_config()
        body = replace_method(updated, "forward", lambda f: self._convert_forward(f, seam, config))
        update_cache = [
            f for f in methods("contiguous_methods.py.j2", config) if f.name.value == "update_cache"
        ]
        return with_body(updated, [*body, *update_cache])

    def _convert_forward(
        self, forward: cst.FunctionDef, seam: SeamFacts, config: cst.PartialParserConfig
    ) -> cst.FunctionDef:
        new = statements(
            "contiguous_seam.py.j2",
            config,
            **seam_values(seam),
            op=FA_OPS[self.spec.fa_version],
            kwargs=bsh_fa_kwargs(self.spec, seam),
        )
        return splice_seam(forward, seam, new)
