"""Mode 1 codemods: contiguous BSH caches written with ``scatter_update_`` at the runner's kv_len.

The attention ``__init__`` declares the same cache entries as the paged rewrite (so the runner
learns every layer's heads, head dim and dtype from ``get_cache_info()``), but the runner binds
``[batch, max_seq_len, heads * head_dim]`` tensors to them. The forward seam keeps the source's
``[B, S]`` batch: it flattens heads into BSH, writes each row from its current length on and
calls the fused attention with ``input_layout="BSH"`` over the whole per-row cache.
"""

from __future__ import annotations

from kvskill.implementer.attn_forward import AttentionForwardCommand
from kvskill.implementer.attn_init import AttentionInitCommand
from kvskill.implementer.fa_call import fa_keywords, host_lengths
from kvskill.implementer.facts import SeamFacts
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
        ("actual_seq_lengths", host_lengths("actual_seq_lengths_q")),
        ("actual_seq_lengths_kv", host_lengths("actual_seq_lengths_kv")),
    ]
    return fa_keywords(spec.fa_version, kwargs)


class ContiguousAttentionInitCommand(AttentionInitCommand):
    """Declare attn_type, heads per rank, cache placeholders, entries and their setters."""

    DESCRIPTION = "Declare the runner-owned contiguous caches in every attention __init__."
    INIT_TEMPLATE = "contiguous_init.py.j2"
    METHODS_TEMPLATE = "contiguous_methods.py.j2"


class ContiguousAttentionForwardCommand(AttentionForwardCommand):
    """Replace the seam of every attention forward by the BSH write + attention; add update_cache."""

    DESCRIPTION = (
        "Write K/V with scatter_update_ at kv_len and attend with the fused BSH attention."
    )
    SEAM_TEMPLATE = "contiguous_seam.py.j2"
    METHODS_TEMPLATE = "contiguous_methods.py.j2"

    def fa_kwargs(self, seam: SeamFacts) -> list[tuple[str, str]]:
        return bsh_fa_kwargs(self.spec, seam)
