"""``kvskill::fused_infer_attention``: FA v1 and v2 as one registered operator.

The two public signature layers (``fused_infer_attention``) route here under torch.compile.
The operator takes the version-neutral inputs of an ``FaCall`` (the version picks the keyword
names its errors use) and runs the shared body, whose checks read the lengths as ints; its
fake implementation gives the output shapes of the layout table in npu_ops.md §1.2 and §1.9.
Sequence lengths travel as ``SymInt[]`` (a list, as torch_npu types them) or, for callers that
pass a 1-D tensor (the reference accepts one), as a tensor.
"""

from __future__ import annotations

import torch
from kvskill.core.fa_keywords import FA_V1, FA_V2
from torch import Tensor

from ._checks import OpInputError
from .attention_inputs import Layout
from .fa_call import FaCall, Names
from .fused_attention import run
from .graph_ops import register

#: the version argument of the operator -> the keyword names of that version
VERSION_NAMES: dict[str, Names] = {
    "v1": Names(
        op=FA_V1,
        num_heads="num_heads",
        q_lens="actual_seq_lengths",
        kv_lens="actual_seq_lengths_kv",
        scale="scale",
    ),
    "v2": Names(
        op=FA_V2,
        num_heads="num_query_heads",
        q_lens="actual_seq_qlen",
        kv_lens="actual_seq_kvlen",
        scale="softmax_scale",
    ),
}


def _attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    query_rope: Tensor | None,
    key_rope: Tensor | None,
    pse_shift: Tensor | None,
    atten_mask: Tensor | None,
    q_lens: list[int] | None,
    kv_lens: list[int] | None,
    q_lens_tensor: Tensor | None,
    kv_lens_tensor: Tensor | None,
    block_table: Tensor | None,
    learnable_sink: Tensor | None,
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
    pre_tokens: int,
    next_tokens: int,
    input_layout: str,
    sparse_mode: int,
    block_size: int,
    inner_precise: int,
    return_lse: bool,
    version: str,
) -> tuple[Tensor, Tensor]:
    out, lse = run(
        FaCall(
            names=VERSION_NAMES[version],
            query=query,
            key=key,
            value=value,
            query_rope=query_rope,
            key_rope=key_rope,
            pse_shift=pse_shift,
            atten_mask=atten_mask,
            q_lens_arg=q_lens if q_lens_tensor is None else q_lens_tensor,
            kv_lens_arg=kv_lens if kv_lens_tensor is None else kv_lens_tensor,
            block_table=block_table,
            num_heads=num_heads,
            num_key_value_heads=num_key_value_heads,
            scale=scale,
            pre_tokens=pre_tokens,
            next_tokens=next_tokens,
            input_layout=input_layout,
            sparse_mode=sparse_mode,
            block_size=block_size,
            inner_precise=inner_precise,
            return_lse=return_lse,
            learnable_sink=learnable_sink,
        )
    )
    # a registered operator may not return an alias of an input or of another output
    return out, lse


def value_head_dim(value: Tensor, layout: Layout, paged: bool, kv_heads: int) -> int:
    """Dv as the adapter reads it from ``value`` (npu_ops.md §1.2, §1.7): per head of a
    [.., KV_N * D] row (BSH, or a 3-D paged cache), else the last dim (the NZ cache
    [blocks, N, D / 16, block_size, 16] keeps D in two dims)."""
    if value.dim() == 5:
        return value.size(2) * value.size(4)
    if value.dim() == 3 and (paged or layout.query == "BSH"):
        return value.size(2) // kv_heads
    return value.size(-1)


def _attend_fake(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    query_rope: Tensor | None,
    key_rope: Tensor | None,
    pse_shift: Tensor | None,
    atten_mask: Tensor | None,
    q_lens: list[int] | None,
    kv_lens: list[int] | None,
    q_lens_tensor: Tensor | None,
    kv_lens_tensor: Tensor | None,
    block_table: Tensor | None,
    learnable_sink: Tensor | None,
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
    pre_tokens: int,
    next_tokens: int,
    input_layout: str,
    sparse_mode: int,
    block_size: int,
    inner_precise: int,
    return_lse: bool,
    version: str,
) -> tuple[Tensor, Tensor]:
    layout = Layout.parse(input_layout)
    kv_heads = num_key_value_heads or num_heads
    dv = value_head_dim(value, layout, block_table is not None, kv_heads)
    n = num_heads
    if layout.is_packed:
        t = query.size(0 if layout.query == "TND" else 1)
        out_shape = (n, t, dv) if layout.output == "NTD" else (t, n, dv)
        lse_shape = (t, n, 1)
    else:
        b = query.size(0)
        s = query.size(2 if layout.query == "BNSD" else 1)
        out_shape = {
            "BNSD": (b, n, s, dv),
            "BSND": (b, s, n, dv),
            "BSH": (b, s, n * dv),
            "NBSD": (n, b, s, dv),
        }.get(layout.output)
        if out_shape is None:
            raise OpInputError(f"input_layout {input_layout!r}: no output shape for the fake")
        lse_shape = (b, n, s, 1)
    out = query.new_empty(out_shape)
    lse = query.new_empty(lse_shape if return_lse else (0,), dtype=torch.float32)
    return out, lse


#: kvskill::fused_infer_attention
ATTENTION_OP = register("fused_infer_attention", _attend, _attend_fake)
