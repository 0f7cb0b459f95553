"""Documented limits of torch_npu 2.13.0's fused attention that a converted model can hit.

Each check cites the section of the operator's docs in the wheel (``torch_npu/_op_plugin_docs.py``,
Chinese; the section heading is quoted) and raises ``OpInputError`` naming the limit. Checks
marked *hardware-only* run only when the NPU profile (``npu_profile``) enforces their kind:
``shapes`` (block sizes, block tables, query tokens per request; on by default in verify and
run), ``dims`` (head counts and dims; off for verify's shrunk twin) or ``dtypes`` (fp16/bf16;
off for an fp32 run, a CPU-only convenience). Where the docs and the running code of
vllm-ascend disagree, the running code wins and references/npu_ops.md §9 records both.
"""

from __future__ import annotations

import torch
from kvskill.core.npu_limits import (
    DECODE_BLOCK_MULTIPLE,
    MAX_BATCH,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_PAGED_BLOCK,
    MLA_BAND_BLOCK_SIZES,
    MLA_BAND_HEADS,
    MLA_BAND_MAX_KV,
    MLA_BLOCK_SIZES,
    MLA_LATENT_DIM,
    MLA_MAX_QUERY_TOKENS,
    MLA_NZ_BLOCK_SIZES,
    MLA_V1_HEADS,
    MLA_V2_HEADS,
    PREFILL_BLOCK_MULTIPLE,
    PROMPT_HEAD_DIM_MULTIPLE,
    TND_V1_DIMS,
    TND_V1_HEADS,
    TND_V1_MAX_TOKENS,
    TND_V2_DIMS,
    TND_V2_MAX_TOKENS,
)
from torch import Tensor

from ._checks import OpInputError, describe
from .attention_inputs import Layout
from .fa_call import FaCall, Shapes
from .npu_profile import DOC, current_profile

#: dtypes the device accepts for query/key/value (int8 quantised paths are outside the reference)
NPU_FLOAT_DTYPES = (torch.float16, torch.bfloat16)
V2_MAX_PACKED_BATCH = 4096
NPU_ONLY = f"NPU-only limit, {DOC}; --cpu-only-shapes skips it on the CPU"


def check_fused_attention(call: FaCall, layout: Layout, shapes: Shapes) -> None:
    """Every documented limit of this call; raises OpInputError at the first one broken."""
    _check_sizes(call, layout, shapes)
    paged = call.block_table is not None
    if paged:
        _check_paged_cache(call, layout)
    if call.query_rope is not None and _query_head_dim(call, layout) == MLA_LATENT_DIM:
        _check_mla_latent(call, shapes, paged)
    elif layout.is_packed and _prefill(shapes):
        _check_packed_sparse(call)
    if layout.is_packed and call.names.op.endswith("_v2") and shapes.batch > V2_MAX_PACKED_BATCH:
        # doc v2, 约束说明 › TND、TND_NTD、NTD_TND场景下的综合限制: "元素个数不大于4096"
        _fail(
            call, f"packed layouts take at most {V2_MAX_PACKED_BATCH} requests, got {shapes.batch}"
        )
    _check_hardware(call, layout, shapes, paged)
    if layout.is_packed and not paged and call.query_rope is None:
        _check_unpaged_tnd(call, layout)


def _check_sizes(call: FaCall, layout: Layout, shapes: Shapes) -> None:
    # doc v1/v2, 约束说明 › 当Q_S大于1时 / 当Q_S等于1时: "B轴小于等于65536", "N轴小于等于256",
    # "D轴小于等于512"; "input_layout为BSH或者BSND时, 要求N*D小于65535" (Q_S > 1)
    d = _query_head_dim(call, layout)
    if shapes.batch > MAX_BATCH:
        _fail(call, f"batch {shapes.batch} exceeds {MAX_BATCH}")
    if call.num_heads > MAX_HEADS:
        _fail(call, f"{call.names.num_heads}={call.num_heads} exceeds {MAX_HEADS} query heads")
    if d > MAX_HEAD_DIM:
        _fail(call, f"query head dim {d} exceeds {MAX_HEAD_DIM}")
    hidden = call.num_heads * d
    if layout.query in ("BSH", "BSND") and _prefill(shapes) and hidden >= MAX_HIDDEN:
        _fail(
            call,
            f"input_layout {call.input_layout!r} needs N*D < {MAX_HIDDEN} when Q_S > 1, got "
            f"{call.num_heads}*{d} = {hidden}; use TND or BNSD",
        )


def _check_paged_cache(call: FaCall, layout: Layout) -> None:
    key = call.key
    # doc v1/v2, 约束说明 › page attention场景: with the (blocknum, blocksize, H) cache form
    # "KV_N*D超过65535时, 受硬件指令约束, 会被拦截报错"
    if key.dim() == 3 and key.size(2) > MAX_HIDDEN:
        _fail(
            call,
            f"paged cache (blocknum, blocksize, H) needs KV_N*D <= {MAX_HIDDEN}, got H = "
            f"{key.size(2)}; use the (blocknum, KV_N, blocksize, D) form or fewer KV heads",
        )
    # doc v1, 约束说明 › query_rope和key_rope参数约束 (and v2 › 当query的d等于512时):
    # "当数据格式为NZ时input_layout不支持BNSD". The docs describe an fp16/bf16 NZ cache only for
    # MLA; without rope they document it only for int8 KV (BSH/BSND/BNSD allowed), so an
    # fp16/bf16 NZ cache without MLA stays unconstrained here (unconfirmed on device).
    nz_mla = key.dim() == 5 and call.query_rope is not None
    if nz_mla and layout.query.startswith("BNSD"):
        _fail(call, f"input_layout {call.input_layout!r} does not take the NZ cache with MLA")
    if call.block_table.dim() != 2:
        # doc v1/v2, 约束说明 › page attention场景: "block_table必须为二维"
        _fail(call, f"block_table must be 2-D [B, max_blocks], got {describe(call.block_table)}")


def _check_mla_latent(call: FaCall, shapes: Shapes, paged: bool) -> None:
    """Absorbed MLA: a 512-wide latent query with a 64-wide rope part."""
    if call.sparse_mode == 4 and not call.names.op.endswith("_v2"):
        _check_mla_band(call, shapes)
        return
    # doc v2, 约束说明 › 当query的d等于512时 (v1: › query_rope和key_rope参数约束, sparse不为4时)
    if not paged:
        _fail(call, "MLA with a 512-wide query needs PageAttention (block_table)")
    kv_heads = call.num_key_value_heads or call.num_heads
    if kv_heads != 1:
        _fail(
            call, f"MLA with a 512-wide query needs 1 KV head, got num_key_value_heads={kv_heads}"
        )
    profile = current_profile()
    # hardware-only: verify's shrunk twin has 4 query heads (dims); a run with tiny blocks
    # (shapes) or absorbed MLA over whole prompts (shapes) is what the device refuses
    heads = MLA_V2_HEADS if call.names.op.endswith("_v2") else MLA_V1_HEADS
    if profile.dims and call.num_heads not in heads:
        _fail(
            call,
            f"MLA with a 512-wide query takes {call.names.num_heads} in {heads}, got {call.num_heads} ({NPU_ONLY})",
        )
    if profile.shapes:
        longest = max(shapes.q_lens, default=0)
        if longest > MLA_MAX_QUERY_TOKENS:
            _fail(
                call,
                f"MLA with a 512-wide query takes 1..{MLA_MAX_QUERY_TOKENS} query tokens per "
                f"request, got {longest}; run prefill without absorption ({NPU_ONLY})",
            )
        # "此时block_size支持16、128，其中数据格式为NZ时block_size不支持配置16"
        allowed = MLA_NZ_BLOCK_SIZES if call.key.dim() == 5 else MLA_BLOCK_SIZES
        if call.block_size not in allowed:
            _fail(
                call,
                f"MLA with a 512-wide query takes block_size in {allowed}, got {call.block_size} ({NPU_ONLY})",
            )
    # "Q_S等于1时只支持sparse=0且不传mask，Q_S大于1时只支持sparse=3且传入mask"
    if _prefill(shapes):
        if call.sparse_mode != 3 or call.atten_mask is None:
            _fail(
                call,
                f"MLA prefill (Q_S > 1) takes sparse_mode=3 with the 2048 mask, got sparse_mode={call.sparse_mode}",
            )
    elif call.sparse_mode != 0 or call.atten_mask is not None:
        _fail(
            call,
            f"MLA decode (Q_S = 1) takes sparse_mode=0 without a mask, got sparse_mode={call.sparse_mode}",
        )


def _check_mla_band(call: FaCall, shapes: Shapes) -> None:
    """A band (sliding window) on the absorbed latent: v1 only.

    doc v1, 约束说明 › query_rope和key_rope参数约束: "sparse: Q_S等于1时支持sparse=0且不传mask或
    sparse=4且传入mask, Q_S大于1时支持sparse=3或sparse=4且传入mask"; › sparse为4时: query N 128,
    D 512, per request Q_S <= KV_S; key N 1, D 512, S <= 131088; key/value ND only; input_layout
    BSND only; PageAttention block_size 64 or 128. (The v2 docs keep Q_S = 1 to sparse 0.)
    """
    if call.input_layout != "BSND":
        _fail(
            call,
            f"MLA with sparse_mode=4 takes input_layout 'BSND' only, got {call.input_layout!r}",
        )
    if call.key.dim() == 5:
        _fail(call, "MLA with sparse_mode=4 takes an ND key/value cache, not the 5-D NZ one")
    kv_heads = call.num_key_value_heads or call.num_heads
    if kv_heads != 1:
        _fail(call, f"MLA with sparse_mode=4 needs 1 KV head, got num_key_value_heads={kv_heads}")
    for b, (s1, s2) in enumerate(zip(shapes.q_lens, shapes.kv_lens, strict=True)):
        if s1 > s2:
            _fail(
                call,
                f"MLA with sparse_mode=4 needs Q_S <= KV_S per request; request {b} has {s1} > {s2}",
            )
        if s2 > MLA_BAND_MAX_KV:
            _fail(
                call,
                f"MLA with sparse_mode=4 takes KV_S <= {MLA_BAND_MAX_KV}, got {s2} (request {b})",
            )
    profile = current_profile()
    if profile.dims and call.num_heads != MLA_BAND_HEADS:
        _fail(
            call,
            f"MLA with sparse_mode=4 takes num_heads {MLA_BAND_HEADS}, got {call.num_heads} ({NPU_ONLY})",
        )
    if (
        profile.shapes
        and call.block_table is not None
        and call.block_size not in MLA_BAND_BLOCK_SIZES
    ):
        _fail(
            call,
            f"MLA with sparse_mode=4 takes block_size in {MLA_BAND_BLOCK_SIZES}, got {call.block_size} ({NPU_ONLY})",
        )


def _check_packed_sparse(call: FaCall) -> None:
    # doc v1/v2, 约束说明 › TND场景下query、key、value输入的综合限制: "sparse模式仅支持sparse=0且不传
    # mask，或sparse=3且传入mask", and "sparse_mode=4且传入mask". The decode branch (Q_S = 1
    # everywhere) ignores sparse_mode, so this applies only when a request has Q_S > 1.
    mode, mask = call.sparse_mode, call.atten_mask
    if (mode == 0 and mask is None) or (mode in (3, 4) and mask is not None):
        return
    with_mask = "with" if mask is not None else "without"
    _fail(
        call,
        f"input_layout {call.input_layout!r} with Q_S > 1 takes sparse_mode 0 without a mask or "
        f"3/4 with one, got sparse_mode={mode} {with_mask} atten_mask",
    )


def _check_unpaged_tnd(call: FaCall, layout: Layout) -> None:
    """The docs' TND case proper (no page attention): the un-absorbed MLA prefill's call.

    Hardware-only: verify's shrunk twin has other heads and head dims (profile ``dims``), an
    fp32 run other dtypes (``dtypes``); T is the run's (``shapes``). Paged TND calls are not
    held to it, as vllm-ascend's running code calls paged TND with GQA and other head dims
    (npu_ops.md §9).
    """
    profile = current_profile()
    v2 = call.names.op.endswith("_v2")
    q_d = _query_head_dim(call, layout)
    k_d, v_d = call.key.size(-1), call.value.size(-1)
    tokens = call.query.size(0 if layout.query == "TND" else 1)
    key_heads = call.key.size(1 if layout.query == "TND" else 0)
    value_heads = call.value.size(1 if layout.query == "TND" else 0)
    if v2:
        # doc v2, 约束说明 › 当query的d不等于512时: "TND场景，要求Q_D、K_D、V_D等于128，或者Q_D、K_D
        # 等于192，V_D等于128/192"; "K_N、V_N相等，Q_N整除K_N，Q_N与K_N的比值不能大于64";
        # › TND、TND_NTD、NTD_TND场景下...的综合限制: "T小于等于1M"
        dims, max_tokens = TND_V2_DIMS, TND_V2_MAX_TOKENS
        heads_ok = key_heads == value_heads and call.num_heads % max(key_heads, 1) == 0
        heads_rule = "key and value heads equal, query heads a multiple of them"
    else:
        # doc v1, 约束说明 › TND场景下query、key、value输入的综合限制: "T小于等于65536";
        # "N等于8/16/32/64/128, 且Q_N、K_N、V_N相等"; "Q_D、K_D等于192, V_D等于128/192"
        dims, max_tokens = TND_V1_DIMS, TND_V1_MAX_TOKENS
        heads_ok = call.num_heads in TND_V1_HEADS and call.num_heads == key_heads == value_heads
        heads_rule = f"query, key and value heads equal and in {TND_V1_HEADS}"
    if profile.dims and (q_d != k_d or v_d not in dims.get(q_d, ())):
        allowed = "; ".join(f"Q_D = K_D = {q} with V_D in {v}" for q, v in dims.items())
        _fail(
            call,
            f"input_layout {call.input_layout!r} without page attention takes {allowed}, got "
            f"Q_D {q_d}, K_D {k_d}, V_D {v_d} ({NPU_ONLY})",
        )
    if profile.dims and not heads_ok:
        _fail(
            call,
            f"input_layout {call.input_layout!r} without page attention needs {heads_rule}, got "
            f"{call.names.num_heads}={call.num_heads}, key {key_heads}, value {value_heads} ({NPU_ONLY})",
        )
    if profile.shapes and tokens > max_tokens:
        _fail(call, f"packed query of {tokens} tokens exceeds T <= {max_tokens} ({NPU_ONLY})")
    for name in ("query", "key", "value"):
        t = getattr(call, name)
        if profile.dtypes and t.dtype != torch.bfloat16:
            # "数据类型仅支持BFLOAT16"
            _fail(call, f"`{name}` must be bfloat16 in this TND case, got {t.dtype} ({NPU_ONLY})")


def _check_hardware(call: FaCall, layout: Layout, shapes: Shapes, paged: bool) -> None:
    """Hardware-only limits: dtypes, block sizes, alignment, each when its kind is on."""
    profile = current_profile()
    # doc v1/v2, 参数说明 › query/key/value: "数据类型支持float16、bfloat16、int8" (int8 and
    # int4 are quantised paths the reference does not model; fp32 is a CPU-only convenience)
    for name in ("query", "key", "value", "query_rope", "key_rope"):
        t = getattr(call, name)
        if profile.dtypes and t is not None and t.dtype not in NPU_FLOAT_DTYPES:
            _fail(
                call, f"`{name}` must be float16 or bfloat16 on the NPU, got {t.dtype} ({NPU_ONLY})"
            )
    sink = call.learnable_sink
    if profile.dtypes and sink is not None and sink.dtype != torch.bfloat16:
        # doc v2, 参数说明 › learnable_sink: "数据类型支持bfloat16"
        _fail(call, f"`learnable_sink` must be bfloat16 on the NPU, got {sink.dtype} ({NPU_ONLY})")
    d = _query_head_dim(call, layout)
    if profile.dims and _prefill(shapes) and d % PROMPT_HEAD_DIM_MULTIPLE:
        # doc v1/v2, 约束说明 › 当Q_S大于1时: "输入类型全为float16、bfloat16时, D轴需16对齐"
        _fail(
            call,
            f"query head dim {d} must be a multiple of {PROMPT_HEAD_DIM_MULTIPLE} when Q_S > 1 ({NPU_ONLY})",
        )
    if paged and profile.shapes:
        _check_block_size(call, shapes)


def _check_block_size(call: FaCall, shapes: Shapes) -> None:
    bt = call.block_table
    if bt.dtype != torch.int32:
        # doc v1/v2, 参数说明 › block_table: "数据类型支持int32"
        _fail(call, f"block_table must be int32 on the NPU, got {bt.dtype} ({NPU_ONLY})")
    if call.query_rope is not None:
        return  # the MLA cases carry their own block sizes
    size = call.block_size
    if _prefill(shapes):
        # doc v1/v2, 约束说明 › 当Q_S大于1时 › page attention场景: "block_size最小为128, 最大为512,
        # 且要求是128的倍数"
        ok = (
            size % PREFILL_BLOCK_MULTIPLE == 0 and PREFILL_BLOCK_MULTIPLE <= size <= MAX_PAGED_BLOCK
        )
        rule = f"a multiple of {PREFILL_BLOCK_MULTIPLE} in [{PREFILL_BLOCK_MULTIPLE}, {MAX_PAGED_BLOCK}] when Q_S > 1"
    else:
        # doc v1/v2, 约束说明 › 当Q_S等于1时 › page attention场景: "block_size需要传入非0值，且最大
        # 不超过512, key、value输入类型为float16、bfloat16时需要16对齐"
        ok = size > 0 and size % DECODE_BLOCK_MULTIPLE == 0 and size <= MAX_PAGED_BLOCK
        rule = (
            f"a non-zero multiple of {DECODE_BLOCK_MULTIPLE} up to {MAX_PAGED_BLOCK} when Q_S = 1"
        )
    if not ok:
        _fail(call, f"paged block_size must be {rule}, got {size} ({NPU_ONLY})")


def _prefill(shapes: Shapes) -> bool:
    """True when the call takes the prompt branch (some request has Q_S > 1)."""
    return not shapes.decode_branch and any(n > 1 for n in shapes.q_lens)


def _query_head_dim(call: FaCall, layout: Layout) -> int:
    if layout.query == "BSH":
        return call.query.size(2) // max(call.num_heads, 1)
    return call.query.size(-1)


def _fail(call: FaCall, message: str) -> None:
    raise OpInputError(f"{call.names.op}: {message}")


def require_npu_dtype(
    op: str, name: str, t: Tensor | None, allowed: tuple[torch.dtype, ...]
) -> None:
    """Hardware-only dtype limit of a non-attention operator (no-op unless the profile checks dtypes)."""
    if t is not None and current_profile().dtypes and t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise OpInputError(f"{op}: `{name}` must be {names} on the NPU, got {t.dtype} ({NPU_ONLY})")
