"""The fused-attention call every attention rewrite emits: operator name and keyword names.

v1 (``npu_fused_infer_attention_score``) and v2 (``..._v2``) take the same inputs under partly
different keywords (npu_ops §2.2). Rewrites list their keywords once, in v1 names;
:func:`fa_keywords` renames them for the version the Plan chose.
"""

from __future__ import annotations

from kvskill.core.fa_keywords import FA_V1, FA_V2, V1_TO_V2
from kvskill.implementer.spec import FaVersion

FA_OPS = {FaVersion.V1: FA_V1, FaVersion.V2: FA_V2}


def fa_keywords(version: FaVersion, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """PAIRS of (v1 keyword, expression) under VERSION's keyword names, order kept."""
    if version is FaVersion.V1:
        return list(pairs)
    return [(V1_TO_V2.get(name, name), expr) for name, expr in pairs]


#: each length tensor of the step metadata and its host-list twin (runtime/forward_context.py)
LENGTH_LIST_TWINS: dict[str, str] = {
    "actual_seq_lengths_q": "actual_seq_lengths_list_q",
    "actual_seq_lengths_kv": "actual_seq_lengths_list_kv",
    "actual_seq_lengths_cu_q": "actual_seq_lengths_cu_list_q",
    "actual_seq_lengths_cu_kv": "actual_seq_lengths_cu_list_kv",
}


def host_lengths(field: str) -> str:
    """The expression a converted FA call passes for the metadata's length tensor FIELD.

    The fused-attention operators type their lengths ``SymInt[]?``. ``torch_npu.*`` binds them
    through torch's Python argument parser, which takes a list of ints and refuses a tensor;
    the framework's own models pass tensors only through ``torch.ops.npu.*`` and lists to
    ``torch_npu.*``. The executor fills the list twins only for captured decode steps, so the
    tensor is read back to the host when the twin is missing (one sync per call, eager only).
    """
    return f"(md.{LENGTH_LIST_TWINS[field]} or md.{field}.tolist())"


def sparse_mode_expr(modes: dict[str, int]) -> str:
    """The ``sparse_mode`` a converted call passes for MODES (``{"prefill": p, "decode": d}``):
    one number, or the step's choice between the two."""
    prefill, decode = modes["prefill"], modes["decode"]
    return str(prefill) if prefill == decode else f"({prefill} if md.is_prefill else {decode})"


def tnd_paged_kwargs(
    version: FaVersion,
    modes: dict[str, int],
    *,
    num_heads: str,
    num_kv_heads: str,
    scale: str,
    block_table: str,
    block_size: str,
) -> list[tuple[str, str]]:
    """Keywords of a TND fused-attention call over paged caches, under VERSION's names: the
    step's mask, block table and host lengths (cumulative query, per-request key)."""
    return fa_keywords(
        version,
        [
            ("num_heads", num_heads),
            ("num_key_value_heads", num_kv_heads),
            ("input_layout", '"TND"'),
            ("scale", scale),
            ("atten_mask", "md.attention_mask"),
            ("sparse_mode", sparse_mode_expr(modes)),
            ("block_table", block_table),
            ("block_size", block_size),
            ("actual_seq_lengths", host_lengths("actual_seq_lengths_cu_q")),
            ("actual_seq_lengths_kv", host_lengths("actual_seq_lengths_kv")),
        ],
    )
