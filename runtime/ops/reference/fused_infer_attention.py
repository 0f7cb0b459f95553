"""torch_npu.npu_fused_infer_attention_score (v1) and _v2: keyword-exact signature layers.

Both translate their own keyword names into one ``FaCall`` and run the shared body in
``fused_attention``. Signatures follow op-plugin master (npu_ops.md §1.1, §2.1): query, key,
value positional-or-keyword, everything else keyword-only, same defaults (note ``scale`` and
``softmax_scale`` default to 1.0, not 1/sqrt(D)).
"""

from __future__ import annotations

from kvskill.core.fa_keywords import FA_V1, FA_V2, V1_ONLY, V1_TO_V2, V2_TO_V1
from torch import Tensor

from ._checks import INT_MAX, reject_if_used, strict_keywords
from .fa_call import FaCall
from .fa_graph_op import ATTENTION_OP, VERSION_NAMES
from .fa_lengths import graph_lengths
from .fused_attention import run
from .graph_ops import compiling

V1_NAME, V2_NAME = FA_V1, FA_V2

_V1_HINTS = {v2: f"v1 takes `{v1}` (`{v2}` is the v2 name)" for v2, v1 in V2_TO_V1.items()}
_V1_HINTS.update(
    {
        "learnable_sink": f"learnable_sink exists only in {V2_NAME}",
        "scale_value": "v1 takes `scale` (`scale_value` belongs to the older PFA/IFA ops)",
    }
)
_V2_HINTS = {v1: f"v2 takes `{v2}` (`{v1}` is the v1 name)" for v1, v2 in V1_TO_V2.items()}
_V2_HINTS["scale_value"] = "v2 takes `softmax_scale`"
for _v1_only in sorted(V1_ONLY):
    _V2_HINTS[_v1_only] = f"`{_v1_only}` exists only in {V1_NAME}"


@strict_keywords(V1_NAME, _V1_HINTS)
def npu_fused_infer_attention_score(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    pse_shift: Tensor | None = None,
    atten_mask: Tensor | None = None,
    actual_seq_lengths: list[int] | None = None,
    actual_seq_lengths_kv: list[int] | None = None,
    dequant_scale1: Tensor | None = None,
    quant_scale1: Tensor | None = None,
    dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None,
    quant_offset2: Tensor | None = None,
    antiquant_scale: Tensor | None = None,
    antiquant_offset: Tensor | None = None,
    key_antiquant_scale: Tensor | None = None,
    key_antiquant_offset: Tensor | None = None,
    value_antiquant_scale: Tensor | None = None,
    value_antiquant_offset: Tensor | None = None,
    block_table: Tensor | None = None,
    query_padding_size: Tensor | None = None,
    kv_padding_size: Tensor | None = None,
    key_shared_prefix: Tensor | None = None,
    value_shared_prefix: Tensor | None = None,
    actual_shared_prefix_len: list[int] | None = None,
    query_rope: Tensor | None = None,
    key_rope: Tensor | None = None,
    key_rope_antiquant_scale: Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
) -> tuple[Tensor, Tensor]:
    """Fused inference attention, v1 keyword names. Returns (attention_out, softmax_lse)."""
    reject_if_used(
        V1_NAME,
        dequant_scale1=dequant_scale1,
        quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2,
        quant_scale2=quant_scale2,
        quant_offset2=quant_offset2,
        antiquant_scale=antiquant_scale,
        antiquant_offset=antiquant_offset,
        key_antiquant_scale=key_antiquant_scale,
        key_antiquant_offset=key_antiquant_offset,
        value_antiquant_scale=value_antiquant_scale,
        value_antiquant_offset=value_antiquant_offset,
        query_padding_size=query_padding_size,
        kv_padding_size=kv_padding_size,
        key_shared_prefix=key_shared_prefix,
        value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len,
        key_rope_antiquant_scale=key_rope_antiquant_scale,
        antiquant_mode=antiquant_mode,
        key_antiquant_mode=key_antiquant_mode,
        value_antiquant_mode=value_antiquant_mode,
    )
    return _attend(
        "v1",
        query,
        key,
        value,
        query_rope=query_rope,
        key_rope=key_rope,
        pse_shift=pse_shift,
        atten_mask=atten_mask,
        q_lens=actual_seq_lengths,
        kv_lens=actual_seq_lengths_kv,
        block_table=block_table,
        learnable_sink=None,
        num_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        scale=scale,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        input_layout=input_layout,
        sparse_mode=sparse_mode,
        block_size=block_size,
        inner_precise=inner_precise,
        return_lse=softmax_lse_flag,
    )


@strict_keywords(V2_NAME, _V2_HINTS)
def npu_fused_infer_attention_score_v2(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    query_rope: Tensor | None = None,
    key_rope: Tensor | None = None,
    pse_shift: Tensor | None = None,
    atten_mask: Tensor | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    block_table: Tensor | None = None,
    dequant_scale_query: Tensor | None = None,
    dequant_scale_key: Tensor | None = None,
    dequant_offset_key: Tensor | None = None,
    dequant_scale_value: Tensor | None = None,
    dequant_offset_value: Tensor | None = None,
    dequant_scale_key_rope: Tensor | None = None,
    quant_scale_out: Tensor | None = None,
    quant_offset_out: Tensor | None = None,
    quant_scale_p: Tensor | None = None,
    learnable_sink: Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    sparse_mode: int = 0,
    block_size: int = 0,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    value_quant_mode: int = 0,
    inner_precise: int = 0,
    return_softmax_lse: bool = False,
    query_dtype: int | None = None,
    key_dtype: int | None = None,
    value_dtype: int | None = None,
    query_rope_dtype: int | None = None,
    key_rope_dtype: int | None = None,
    key_shared_prefix_dtype: int | None = None,
    value_shared_prefix_dtype: int | None = None,
    dequant_scale_query_dtype: int | None = None,
    dequant_scale_key_dtype: int | None = None,
    dequant_scale_value_dtype: int | None = None,
    dequant_scale_key_rope_dtype: int | None = None,
    out_dtype: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused inference attention, v2 keyword names. Returns (attention_out, softmax_lse).

    ``learnable_sink`` ([num_query_heads]) adds one value-less logit per head to the softmax
    denominator, in score units (not multiplied by ``softmax_scale``).
    """
    # The *_dtype arguments are reserved on device; quant ones are outside the reference.
    reject_if_used(
        V2_NAME,
        dequant_scale_query=dequant_scale_query,
        dequant_scale_key=dequant_scale_key,
        dequant_offset_key=dequant_offset_key,
        dequant_scale_value=dequant_scale_value,
        dequant_offset_value=dequant_offset_value,
        dequant_scale_key_rope=dequant_scale_key_rope,
        quant_scale_out=quant_scale_out,
        quant_offset_out=quant_offset_out,
        quant_scale_p=quant_scale_p,
        query_quant_mode=query_quant_mode,
        key_quant_mode=key_quant_mode,
        value_quant_mode=value_quant_mode,
        query_dtype=query_dtype,
        key_dtype=key_dtype,
        value_dtype=value_dtype,
        query_rope_dtype=query_rope_dtype,
        key_rope_dtype=key_rope_dtype,
        key_shared_prefix_dtype=key_shared_prefix_dtype,
        value_shared_prefix_dtype=value_shared_prefix_dtype,
        dequant_scale_query_dtype=dequant_scale_query_dtype,
        dequant_scale_key_dtype=dequant_scale_key_dtype,
        dequant_scale_value_dtype=dequant_scale_value_dtype,
        dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype,
        out_dtype=out_dtype,
    )
    return _attend(
        "v2",
        query,
        key,
        value,
        query_rope=query_rope,
        key_rope=key_rope,
        pse_shift=pse_shift,
        atten_mask=atten_mask,
        q_lens=actual_seq_qlen,
        kv_lens=actual_seq_kvlen,
        block_table=block_table,
        learnable_sink=learnable_sink,
        num_heads=num_query_heads,
        num_key_value_heads=num_key_value_heads,
        scale=softmax_scale,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        input_layout=input_layout,
        sparse_mode=sparse_mode,
        block_size=block_size,
        inner_precise=inner_precise,
        return_lse=return_softmax_lse,
    )


def _attend(
    version: str, query: Tensor, key: Tensor, value: Tensor, **fields
) -> tuple[Tensor, Tensor]:
    """The shared body in eager mode; the registered operator while torch.compile traces."""
    if compiling():
        q_lens, q_tensor = graph_lengths(fields.pop("q_lens"))
        kv_lens, kv_tensor = graph_lengths(fields.pop("kv_lens"))
        return ATTENTION_OP(
            query, key, value, q_lens=q_lens, kv_lens=kv_lens, q_lens_tensor=q_tensor,
            kv_lens_tensor=kv_tensor, version=version, **fields,
        )  # fmt: skip
    names = VERSION_NAMES[version]
    q_lens, kv_lens = fields.pop("q_lens"), fields.pop("kv_lens")
    return run(
        FaCall(names=names, query=query, key=key, value=value, q_lens_arg=q_lens,
               kv_lens_arg=kv_lens, **fields)
    )  # fmt: skip
