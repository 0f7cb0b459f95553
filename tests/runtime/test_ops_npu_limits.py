"""The documented torch_npu limits the reference enforces, always or under the strict NPU profile."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime import ops
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import npu_profile
from ops_golden import CAUSAL_TILE, make_paged_case, paged_fia_v1

OpInputError = npu.OpInputError


def _decode_case(dtype=torch.float32, block_size=16):
    return make_paged_case(
        [1, 1], [5, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=block_size, dtype=dtype
    )


def _prefill_case(dtype=torch.float32, block_size=4, head_dim=16):
    return make_paged_case(
        [3, 5], [3, 5], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
        dtype=dtype,
    )  # fmt: skip


# --- always checked -------------------------------------------------------------------------


def test_paged_hidden_cache_form_rejects_kv_heads_times_dim_over_65535():
    # (blocknum, blocksize, H) with H = KV_N * D = 160 * 512 = 81920
    q = torch.zeros(1, 160, 512)
    cache = torch.zeros(1, 1, 160 * 512)
    with pytest.raises(OpInputError, match=r"KV_N\*D <= 65535, got H = 81920"):
        npu.npu_fused_infer_attention_score(
            q, cache, cache, num_heads=160, num_key_value_heads=160, input_layout="TND",
            block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=1,
            actual_seq_lengths=[1], actual_seq_lengths_kv=[1],
        )  # fmt: skip


@pytest.mark.parametrize(
    "heads,dim,match",
    [(257, 16, "exceeds 256 query heads"), (2, 576, "head dim 576 exceeds 512")],
)
def test_head_count_and_head_dim_are_bounded(heads, dim, match):
    q = torch.zeros(1, 1, heads, dim)
    kv = torch.zeros(1, 2, heads, dim)
    with pytest.raises(OpInputError, match=match):
        npu.npu_fused_infer_attention_score(q, kv, kv, num_heads=heads, input_layout="BSND")


def test_bsh_prefill_needs_n_times_d_below_65535():
    # 128 heads of 512: N*D = 65536 in a BSH prompt
    q = torch.zeros(1, 2, 128 * 512)
    with pytest.raises(OpInputError, match=r"N\*D < 65535 when Q_S > 1, got 128\*512 = 65536"):
        npu.npu_fused_infer_attention_score(q, q, q, num_heads=128, input_layout="BSH")


@pytest.mark.parametrize("mode,mask", [(1, "user"), (2, "tile"), (0, "user")])
def test_packed_prefill_takes_sparse_0_without_mask_or_3_4_with_one(mode, mask):
    case = _prefill_case()
    user = torch.zeros(5, 5, dtype=torch.bool)
    with pytest.raises(OpInputError, match=f"got sparse_mode={mode} with atten_mask"):
        paged_fia_v1(
            case, num_heads=4, num_kv_heads=2, scale=0.3, mode=mode,
            mask=user if mask == "user" else CAUSAL_TILE,
        )  # fmt: skip


def test_packed_decode_ignores_sparse_mode_as_the_device_does():
    # Q_S = 1 everywhere: the decode branch ignores sparse_mode, so mode 2 is accepted
    out, _ = paged_fia_v1(_decode_case(), num_heads=4, num_kv_heads=2, scale=0.3, mode=2)
    assert out.shape == (2, 4, 16)


def _mla_call(q_lens, *, mode, mask, paged=True, kv_heads=1, heads=4, block_size=16):
    kv_len = max(q_lens)
    nb = len(q_lens) * ((kv_len + block_size - 1) // block_size)
    nope = torch.zeros(nb, block_size, kv_heads * 512)
    rope = torch.zeros(nb, block_size, kv_heads * 64)
    t = sum(q_lens)
    table = torch.arange(nb, dtype=torch.int32).view(len(q_lens), -1)
    return npu.npu_fused_infer_attention_score(
        torch.zeros(t, heads, 512), nope, nope,
        query_rope=torch.zeros(t, heads, 64), key_rope=rope,
        num_heads=heads, num_key_value_heads=kv_heads, input_layout="TND", scale=0.1,
        sparse_mode=mode, atten_mask=mask,
        block_table=table if paged else None, block_size=block_size if paged else 0,
        actual_seq_lengths=torch.tensor(q_lens).cumsum(0).tolist(),
        actual_seq_lengths_kv=q_lens,
    )  # fmt: skip


def test_mla_latent_decode_takes_sparse_0_and_prefill_sparse_3():
    # decode: sparse 0 without mask; prefill: sparse 3 with the 2048 tile (doc v1 and v2)
    out, _ = _mla_call([1, 1], mode=0, mask=None)
    assert out.shape == (2, 4, 512)
    with pytest.raises(OpInputError, match="MLA decode .* takes sparse_mode=0 without a mask"):
        _mla_call([1, 1], mode=3, mask=CAUSAL_TILE)
    with pytest.raises(OpInputError, match="MLA prefill .* takes sparse_mode=3"):
        _mla_call([4, 2], mode=0, mask=None)


def test_mla_latent_needs_one_kv_head():
    with pytest.raises(OpInputError, match="needs 1 KV head, got num_key_value_heads=2"):
        _mla_call([1, 1], mode=0, mask=None, kv_heads=2)


def test_mla_latent_takes_128_query_heads_on_one_kv_head_beyond_the_gqa_ratio_of_64():
    # DeepSeek-V3 at TP 1: 128 heads over one latent head, which the MLA section allows
    # ("N为32、64、128", "key的N为1") although plain GQA stops at a ratio of 64
    out, _ = _mla_call([1, 1], mode=0, mask=None, heads=128, block_size=128)
    assert out.shape == (2, 128, 512)
    q = torch.zeros(2, 128, 64)
    kv = torch.zeros(2, 1, 64)
    with pytest.raises(OpInputError, match="ratio <= 64"):
        npu.npu_fused_infer_attention_score(
            q, kv, kv, num_heads=128, num_key_value_heads=1, input_layout="TND",
            actual_seq_lengths=[1, 2], actual_seq_lengths_kv=[1, 2],
        )  # fmt: skip


# --- the strict NPU profile -------------------------------------------------------------------


def test_strict_profile_rejects_fp32_which_the_cpu_reference_accepts():
    case = _decode_case()
    out, _ = paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=0)
    assert out.dtype == torch.float32
    with ops.npu_limits(), pytest.raises(OpInputError, match="float16 or bfloat16 on the NPU"):
        paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=0)
    # and the profile is off again after the block
    paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=0)


@pytest.mark.parametrize("block_size,ok", [(4, False), (64, False), (128, True)])
def test_strict_profile_takes_prefill_blocks_in_multiples_of_128(block_size, ok):
    case = _prefill_case(torch.bfloat16, block_size=block_size)
    with ops.npu_limits():
        if ok:
            out, _ = paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)
            assert out.shape == (8, 4, 16)
        else:
            with pytest.raises(OpInputError, match=f"multiple of 128 .* got {block_size}"):
                paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)


@pytest.mark.parametrize("block_size,ok", [(8, False), (16, True), (128, True)])
def test_strict_profile_takes_decode_blocks_in_multiples_of_16(block_size, ok):
    case = _decode_case(torch.float16, block_size=block_size)
    with ops.npu_limits():
        if ok:
            paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=0)
        else:
            with pytest.raises(OpInputError, match=f"multiple of 16 up to 512 .* got {block_size}"):
                paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=0)


def test_strict_profile_wants_an_int32_block_table_and_16_aligned_prefill_dims():
    case = _decode_case(torch.bfloat16)
    case.block_table = case.block_table.long()
    with ops.npu_limits(), pytest.raises(OpInputError, match="block_table must be int32"):
        paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=0)
    odd = _prefill_case(torch.bfloat16, block_size=128, head_dim=24)
    with (
        ops.npu_limits(),
        pytest.raises(OpInputError, match="head dim 24 must be a multiple of 16"),
    ):
        paged_fia_v1(odd, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)


def test_strict_profile_limits_absorbed_mla_to_16_query_tokens():
    _mla_call([17, 2], mode=3, mask=CAUSAL_TILE, heads=32)  # CPU: whole-prompt prefill runs
    with (
        ops.npu_limits(),
        pytest.raises(OpInputError, match="1..16 query tokens per request, got 17"),
    ):
        _mla_call([17, 2], mode=3, mask=CAUSAL_TILE, heads=32)
    with (
        ops.npu_limits(),
        pytest.raises(OpInputError, match=r"num_heads in \(32, 64, 128\), got 4"),
    ):
        _mla_call([1, 1], mode=0, mask=None, heads=4)


def test_profile_switch_follows_context_and_setter():
    assert not ops.npu_limits_enabled()
    with ops.npu_limits():
        assert ops.npu_limits_enabled()
        with ops.npu_limits(False):
            assert not ops.npu_limits_enabled()
        assert ops.npu_limits_enabled()
    assert not ops.npu_limits_enabled()
    ops.set_npu_limits(True)
    try:
        assert npu_profile.npu_limits_enabled()
    finally:
        ops.set_npu_limits(False)


# --- gated delta rule -------------------------------------------------------------------------


def _gdn(t, nk, nv, dk, dv, dtype=torch.float32):
    q = torch.zeros(t, nk, dk, dtype=dtype)
    return q, q.clone(), torch.zeros(t, nv, dv, dtype=dtype)


def test_recurrent_rule_bounds_heads_and_dims():
    q, k, v = _gdn(1, 1, 1, 300, 8)
    with pytest.raises(OpInputError, match=r"dims \(Dk=300, Dv=8\) <= 256"):
        npu.npu_recurrent_gated_delta_rule(q, k, v, torch.zeros(1, 1, 8, 300))


def test_chunk_rule_bounds_heads_and_takes_only_128_wide_heads_on_the_npu():
    q, k, v = _gdn(2, 65, 65, 8, 8)
    with pytest.raises(OpInputError, match=r"heads \(Nk=65, Nv=65\) must be <= 64"):
        npu.npu_chunk_gated_delta_rule(q, k, v)
    q, k, v = _gdn(2, 1, 2, 8, 8, torch.bfloat16)
    out, _ = npu.npu_chunk_gated_delta_rule(q, k, v)  # CPU: tiny heads are fine
    assert out.shape == (2, 2, 8)
    with ops.npu_limits(), pytest.raises(OpInputError, match="Dk = Dv = 128 on the NPU"):
        npu.npu_chunk_gated_delta_rule(q, k, v)


def test_strict_profile_wants_bf16_recurrent_inputs_and_int32_lengths():
    q, k, v = _gdn(1, 1, 1, 8, 8, torch.bfloat16)
    state = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16)
    lens = torch.tensor([1])  # int64
    npu.npu_recurrent_gated_delta_rule(q, k, v, state, actual_seq_lengths=lens)
    with ops.npu_limits(), pytest.raises(OpInputError, match="`actual_seq_lengths` must be int32"):
        npu.npu_recurrent_gated_delta_rule(q, k, v, state, actual_seq_lengths=lens)
    with ops.npu_limits(), pytest.raises(OpInputError, match="`state` must be bfloat16"):
        npu.npu_recurrent_gated_delta_rule(q, k, v, state.float(), actual_seq_lengths=lens.int())


# --- TND without page attention (the un-absorbed MLA prefill) ---------------------------------


def _unpaged_tnd(q_d: int, v_d: int, heads: int = 32, kv_heads: int = 32, v2: bool = False):
    q = torch.zeros(6, heads, q_d, dtype=torch.bfloat16)
    k = torch.zeros(10, kv_heads, q_d, dtype=torch.bfloat16)
    v = torch.zeros(10, kv_heads, v_d, dtype=torch.bfloat16)
    if v2:
        return npu.npu_fused_infer_attention_score_v2(
            q, k, v, num_query_heads=heads, num_key_value_heads=kv_heads, input_layout="TND",
            atten_mask=CAUSAL_TILE, sparse_mode=3, actual_seq_qlen=[2, 6],
            actual_seq_kvlen=[4, 10],
        )  # fmt: skip
    return npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=heads, num_key_value_heads=kv_heads, input_layout="TND",
        atten_mask=CAUSAL_TILE, sparse_mode=3, actual_seq_lengths=[2, 6],
        actual_seq_lengths_kv=[4, 10],
    )  # fmt: skip


def test_unpaged_tnd_takes_the_mla_prefill_dims_with_a_value_dim_of_its_own():
    # chunked: 2 and 4 new queries over 4 and 10 keys; the value is 128 wide on 192-wide keys
    with ops.npu_limits():
        out, _ = _unpaged_tnd(192, 128)
        assert out.shape == (6, 32, 128)
        out, _ = _unpaged_tnd(128, 128, heads=32, kv_heads=8, v2=True)  # v2: GQA, 128/128
        assert out.shape == (6, 32, 128)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((80, 24), "takes Q_D = K_D = 192 with V_D in \\(128, 192\\), got Q_D 80, K_D 80, V_D 24"),
        ((128, 128), "got Q_D 128"),  # v1 has no 128 case
        ((192, 128, 32, 8), "query, key and value heads equal and in"),
        ((192, 128, 4, 4), "heads equal and in \\(8, 16, 32, 64, 128\\)"),
    ],
)
def test_unpaged_tnd_outside_the_docs_case_is_refused_on_the_npu_only(args, match):
    with ops.npu_limits(), pytest.raises(OpInputError, match=match):
        _unpaged_tnd(*args)
    out, _ = _unpaged_tnd(*args)  # the CPU reference runs it (verify shrinks these dims)
    assert out.size(0) == 6


# --- the kinds of the profile: what verify / run / LLM switch on by default ------------------


def test_each_kind_of_the_profile_checks_only_its_own_limits():
    shapes = ops.NpuProfile(shapes=True)
    # fp32 and a 24-wide head pass without dtypes and dims; a block of 4 does not pass shapes
    odd = _prefill_case(torch.float32, block_size=128, head_dim=24)
    with ops.use_npu_profile(shapes):
        paged_fia_v1(odd, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)
        with pytest.raises(OpInputError, match="multiple of 128 .* got 4.*npu_ops.md §9"):
            paged_fia_v1(_prefill_case(), num_heads=4, num_kv_heads=2, scale=0.3, mode=3)
    with (
        ops.use_npu_profile(ops.NpuProfile(dims=True)),
        pytest.raises(OpInputError, match="head dim 24 must be a multiple of 16"),
    ):
        paged_fia_v1(odd, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)
    with (
        ops.use_npu_profile(ops.NpuProfile(dtypes=True)),
        pytest.raises(OpInputError, match="float16 or bfloat16 on the NPU.*--cpu-only-shapes"),
    ):
        paged_fia_v1(odd, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)
    # MLA: 4 query heads (verify's shrunk twin) is a dims limit, not a shapes one
    with ops.use_npu_profile(shapes):
        _mla_call([1, 1], mode=0, mask=None, heads=4, block_size=128)


def test_run_profile_defaults_and_opt_out(monkeypatch):
    monkeypatch.delenv("KVSKILL_CPU_ONLY_SHAPES", raising=False)
    profile = ops.run_profile(cpu_only_shapes=None, dtype="float32", real_dims=True)
    assert profile == ops.NpuProfile(shapes=True, dims=True)  # fp32: no dtype limits
    twin = ops.run_profile(cpu_only_shapes=False, dtype="bfloat16", real_dims=False)
    assert twin == ops.NpuProfile(shapes=True, dtypes=True)  # a twin's dims are not the model's
    assert not ops.run_profile(cpu_only_shapes=True, dtype="bfloat16", real_dims=True).any
    monkeypatch.setenv("KVSKILL_CPU_ONLY_SHAPES", "1")
    assert not ops.run_profile(cpu_only_shapes=None, dtype="float32", real_dims=True).any
    # an explicit strict context (KVSKILL_NPU_LIMITS=1, npu_limits()) wins over the opt-out
    with ops.npu_limits():
        strict = ops.run_profile(cpu_only_shapes=True, dtype="float32", real_dims=False)
    assert strict == ops.NpuProfile(shapes=True, dims=True, dtypes=True)


def test_profile_report_says_what_was_not_checked_and_why():
    off = ops.profile_report(ops.NpuProfile(), dtype="float32", twin=True)
    assert off["checked"] is False and off["checked_kinds"] == []
    assert ops.profile_line(off).startswith(
        "NPU limits: the conversion was NOT checked against the NPU operators' limits "
        "(--cpu-only-shapes)"
    )
    fp32 = ops.profile_report(ops.NpuProfile(shapes=True, dims=True), dtype="float32", twin=False)
    assert fp32["checked"] is True and fp32["checked_kinds"] == ["shapes", "dims"]
    (reason,) = fp32["not_checked"]
    assert "float32 is a CPU-only convenience" in reason
    line = ops.profile_line(fp32)
    assert line.startswith("NPU limits: checked (block sizes") and "NOT checked: dtypes" in line
