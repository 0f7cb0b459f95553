"""Cache-write operators: npu_scatter_nd_update_, scatter_update_, npu_kv_rmsnorm_rope_cache."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import OpInputError, ReferenceUnsupportedError


class TestScatterNdUpdate:
    def test_sheet_example_shapes(self):
        # input (4, 5, 6), indices (3, 2) -> updates (3, 6): input[i0, i1, :] = updates[r]
        data = torch.zeros(4, 5, 6)
        idx = torch.tensor([[0, 1], [3, 4], [2, 0]], dtype=torch.int32)
        upd = torch.arange(18, dtype=torch.float32).view(3, 6)
        out = npu.npu_scatter_nd_update_(data, idx, upd)
        assert out is data
        for r, (a, b) in enumerate(idx.tolist()):
            assert torch.equal(data[a, b], upd[r])
        assert data.abs().sum() == upd.abs().sum()  # nothing else written

    def test_out_of_place_twin_leaves_input(self):
        data = torch.zeros(3, 2)
        out = npu.npu_scatter_nd_update(data, torch.tensor([[1]]), torch.ones(1, 2))
        assert data.sum() == 0 and out[1].sum() == 2

    def test_rejects_updates_of_another_dtype_than_the_cache(self):
        # The device needs input and updates of one dtype ("数据类型需要与updates一致"): an fp32
        # key written into a bf16 cache must be cast by the model, not by the operator.
        cache = torch.zeros(4, 2, dtype=torch.bfloat16)
        with pytest.raises(OpInputError, match="updates dtype torch.float32 must equal"):
            npu.npu_scatter_nd_update_(cache, torch.tensor([[2]]), torch.tensor([[1.5, 2.5]]))
        assert torch.count_nonzero(cache) == 0
        npu.npu_scatter_nd_update_(
            cache, torch.tensor([[2]]), torch.tensor([[1.5, 2.5]]).bfloat16()
        )
        assert cache[2].tolist() == [1.5, 2.5]

    @pytest.mark.parametrize(
        "idx,upd,match",
        [
            (torch.tensor([1, 2]), torch.ones(2, 2), "rank >= 2"),
            (torch.tensor([[1.0]]), torch.ones(1, 2), "int32/int64"),
            (torch.tensor([[1]]), torch.ones(2, 2), r"updates must have shape .*\(1, 2\)"),
            (torch.tensor([[-1]]), torch.ones(1, 2), "padded slot ids"),
            (torch.tensor([[4]]), torch.ones(1, 2), "out of range"),
        ],
    )
    def test_rejects(self, idx, upd, match):
        with pytest.raises(OpInputError, match=match):
            npu.npu_scatter_nd_update_(torch.zeros(4, 2), idx, upd)


class TestScatterUpdate:
    def test_bnsd_cache_append_one_token_per_request(self):
        cache = torch.zeros(3, 2, 8, 4)  # (B, N, S_max, D)
        kv_len = torch.tensor([0, 5, 7])
        new = torch.randn(3, 2, 1, 4)
        assert npu.scatter_update_(cache, kv_len, new, -2) is cache
        for b, pos in enumerate(kv_len.tolist()):
            assert torch.equal(cache[b, :, pos], new[b, :, 0])
        assert torch.count_nonzero(cache) == torch.count_nonzero(new)

    def test_bsh_cache_multi_token_axis1(self):
        cache = torch.zeros(2, 6, 3)
        upd = torch.arange(2 * 3 * 3, dtype=torch.float32).view(2, 3, 3)
        npu.scatter_update_(cache, torch.tensor([1, 3], dtype=torch.int32), upd, 1)
        assert torch.equal(cache[0, 1:4], upd[0]) and torch.equal(cache[1, 3:6], upd[1])
        assert cache[0, 0].sum() == 0 and cache[0, 4:].sum() == 0

    def test_two_d_indices_pick_batch_and_offset(self):
        cache = torch.zeros(3, 4, 2)
        upd = torch.ones(2, 1, 2)
        npu.scatter_update_(cache, torch.tensor([[2, 3], [0, 1]]), upd, 1)
        assert cache[2, 3].sum() == 2 and cache[0, 1].sum() == 2 and cache.sum() == 4

    @pytest.mark.parametrize(
        "axis,idx,upd,match",
        [
            (0, torch.tensor([0]), torch.ones(1, 1, 2), "not 0"),
            (1, torch.tensor([3]), torch.ones(1, 2, 2), "must fit"),
            (1, torch.tensor([0]), torch.ones(1, 1, 3), "dim 2 of updates"),
        ],
    )
    def test_rejects(self, axis, idx, upd, match):
        with pytest.raises(OpInputError, match=match):
            npu.scatter_update_(torch.zeros(2, 4, 2), idx, upd, axis)

    @pytest.mark.parametrize(
        "data,idx,match",
        [
            (torch.zeros(4), torch.tensor([0]), "2..8 dims"),
            (torch.zeros(2, 4, 2), torch.tensor(0), "1-D or 2-D int32/int64"),
            (torch.zeros(2, 4, 2), torch.tensor([0.0, 1.0]), "1-D or 2-D int32/int64"),
            (torch.zeros(2, 4, 2, dtype=torch.float64), torch.tensor([0, 1]), "dtype must be"),
        ],
    )
    def test_rejects_what_the_docs_exclude(self, data, idx, match):
        upd = torch.ones(*data.shape[:1], *([1] if data.dim() > 1 else []), *data.shape[2:])
        with pytest.raises(OpInputError, match=match):
            npu.scatter_update_(data, idx, upd.to(data.dtype), 1 if data.dim() > 1 else -1)


def _rms_rope_inputs(b=2, s=3, dc=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(b, 1, s, dc + 64, generator=gen)
    gamma = torch.rand(dc, generator=gen) + 0.5
    ang = torch.rand(b, 1, s, 32, generator=gen)
    cos = torch.cat((ang.cos(), ang.cos()), -1)
    sin = torch.cat((ang.sin(), ang.sin()), -1)
    return kv, gamma, cos, sin


def _expected(kv, gamma, cos, sin, eps=1e-5):
    dc = gamma.numel()
    lat = kv[..., :dc].double()
    c = lat / torch.sqrt(lat.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()
    r = kv[..., dc:].double()
    ev, od = r[..., 0::2], r[..., 1::2]
    half_c, half_s = cos[..., :32].double(), sin[..., :32].double()
    rope = torch.cat((ev * half_c - od * half_s, od * half_c + ev * half_s), -1)
    return c.float(), rope.float()


class TestKvRmsnormRopeCache:
    def test_pa_bnsd_writes_rows_at_global_slots_and_skips_negative(self):
        kv, gamma, cos, sin = _rms_rope_inputs()
        k_cache, ckv = torch.zeros(4, 4, 1, 64), torch.zeros(4, 4, 1, 32)
        slots = torch.tensor([5, 6, -1, 12, 0, 3])
        npu.npu_kv_rmsnorm_rope_cache(
            kv, gamma, cos, sin, slots, k_cache, ckv, cache_mode="PA_BNSD"
        )
        c, rope = _expected(kv, gamma, cos, sin)
        flat_c, flat_r = c.view(6, 32), rope.view(6, 64)
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                torch.testing.assert_close(ckv[slot // 4, slot % 4, 0], flat_c[t])
                torch.testing.assert_close(k_cache[slot // 4, slot % 4, 0], flat_r[t])
        assert torch.count_nonzero(k_cache.view(16, 64).abs().sum(-1)) == 5

    def test_pa_and_pa_bnsd_are_the_same(self):
        kv, gamma, cos, sin = _rms_rope_inputs(seed=1)
        slots = torch.tensor([1, 2, 3, 9, 10, 11])
        caches = []
        for mode in ("PA", "PA_BNSD"):
            k_cache, ckv = torch.zeros(4, 4, 1, 64), torch.zeros(4, 4, 1, 32)
            npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, k_cache, ckv, cache_mode=mode)
            caches.append((k_cache, ckv))
        assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))

    def test_pa_nz_memory_order(self):
        # Logical (page, t, d) at flat offset page*D*bs + (d // 16)*bs*16 + t*16 + d % 16.
        kv, gamma, cos, sin = _rms_rope_inputs(b=1, s=2, seed=2)
        bs = 4
        k_cache, ckv = torch.zeros(3, bs, 1, 64), torch.zeros(3, bs, 1, 32)
        npu.npu_kv_rmsnorm_rope_cache(
            kv, gamma, cos, sin, torch.tensor([6, 1]), k_cache, ckv, cache_mode="PA_NZ"
        )
        c, rope = _expected(kv, gamma, cos, sin)
        flat = ckv.view(-1)
        for t_idx, slot in enumerate([6, 1]):
            page, t = divmod(slot, bs)
            for d in range(32):
                off = page * 32 * bs + (d // 16) * bs * 16 + t * 16 + d % 16
                assert abs(float(flat[off]) - float(c[0, 0, t_idx, d])) < 1e-5
        assert k_cache.view(3, 4, bs, 16)[1, 2, 2].allclose(rope[0, 0, 0, 32:48])

    def test_norm_mode_and_outputs_only_with_is_output_kv(self):
        kv, gamma, cos, sin = _rms_rope_inputs(seed=3)
        k_cache, ckv = torch.zeros(2, 1, 5, 64), torch.zeros(2, 1, 5, 32)
        index = torch.tensor([[4, 0, -1], [1, 2, 3]])
        res = npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv)
        c, rope = _expected(kv, gamma, cos, sin)
        torch.testing.assert_close(ckv[0, 0, 4], c[0, 0, 0])
        torch.testing.assert_close(k_cache[1, 0, 3], rope[1, 0, 2])
        assert ckv[0, 0, 1:4].abs().sum() == 0  # the -1 token was skipped
        assert torch.isnan(res[2]).all()  # is_output_kv is honoured only in PA modes
        res = npu.npu_kv_rmsnorm_rope_cache(
            kv,
            gamma,
            cos,
            sin,
            torch.arange(6),
            torch.zeros(2, 4, 1, 64),
            torch.zeros(2, 4, 1, 32),
            cache_mode="PA",
            is_output_kv=True,
        )
        torch.testing.assert_close(res[2], rope)
        torch.testing.assert_close(res[3], c)

    def test_pa_blk_bnsd_uses_page_start_offsets(self):
        kv, gamma, cos, sin = _rms_rope_inputs(b=2, s=3, seed=4)
        bs = 2
        k_cache, ckv = torch.zeros(6, bs, 1, 64), torch.zeros(6, bs, 1, 32)
        # ceil(3 / 2) = 2 pages per request: request 0 -> pages 5, 1; request 1 -> 2, 4.
        index = torch.tensor([10, 2, 4, 8])
        npu.npu_kv_rmsnorm_rope_cache(
            kv, gamma, cos, sin, index, k_cache, ckv, cache_mode="PA_BLK_BNSD"
        )
        c, _ = _expected(kv, gamma, cos, sin)
        torch.testing.assert_close(ckv[5, 1, 0], c[0, 0, 1])
        torch.testing.assert_close(ckv[1, 0, 0], c[0, 0, 2])
        torch.testing.assert_close(ckv[4, 0, 0], c[1, 0, 2])

    def test_int8_quantised_caches(self):
        kv, gamma, cos, sin = _rms_rope_inputs(b=1, s=2, seed=5)
        k_cache = torch.zeros(2, 4, 1, 64, dtype=torch.int8)
        ckv = torch.zeros(2, 4, 1, 32, dtype=torch.int8)
        npu.npu_kv_rmsnorm_rope_cache(
            kv,
            gamma,
            cos,
            sin,
            torch.tensor([0, 1]),
            k_cache,
            ckv,
            cache_mode="PA",
            k_rope_scale=torch.full((64,), 40.0),
            c_kv_scale=torch.full((32,), 30.0),
        )
        c, rope = _expected(kv, gamma, cos, sin)
        assert torch.equal(
            ckv[0, 1, 0], torch.round(c[0, 0, 1] * 30).clamp(-128, 127).to(torch.int8)
        )
        assert torch.equal(
            k_cache[0, 0, 0], torch.round(rope[0, 0, 0] * 40).clamp(-128, 127).to(torch.int8)
        )

    @pytest.mark.parametrize(
        "change,error,match",
        [
            ({"cache_mode": "BNSD"}, OpInputError, "cache_mode must be one of"),
            ({"v": torch.zeros(1)}, ReferenceUnsupportedError, "`v`"),
            ({"k_rope_scale": torch.ones(64)}, OpInputError, "need a PA cache_mode"),
        ],
    )
    def test_rejects(self, change, error, match):
        kv, gamma, cos, sin = _rms_rope_inputs()
        with pytest.raises(error, match=match):
            npu.npu_kv_rmsnorm_rope_cache(
                kv,
                gamma,
                cos,
                sin,
                torch.zeros(2, 3, dtype=torch.int64),
                torch.zeros(2, 1, 4, 64),
                torch.zeros(2, 1, 4, 32),
                **change,
            )

    def test_wrong_kv_width_is_rejected(self):
        kv, gamma, cos, sin = _rms_rope_inputs()
        with pytest.raises(OpInputError, match=r"gamma size \(16\) \+ 64"):
            npu.npu_kv_rmsnorm_rope_cache(
                kv,
                gamma[:16],
                cos,
                sin,
                torch.arange(6),
                torch.zeros(2, 4, 1, 64),
                torch.zeros(2, 4, 1, 16),
                cache_mode="PA",
            )


def test_interleave_rope_matches_the_rope_cached_by_kv_rmsnorm_rope_cache():
    kv, gamma, cos, sin = _rms_rope_inputs(b=2, s=3, seed=6)
    _, rope = _expected(kv, gamma, cos, sin)
    x = kv[..., 32:]  # [B, 1, S, 64] treated as one head of a query
    got = npu.npu_interleave_rope(x, cos, sin)
    torch.testing.assert_close(got, rope, atol=1e-5, rtol=1e-5)
    res = npu.npu_kv_rmsnorm_rope_cache(
        kv,
        gamma,
        cos,
        sin,
        torch.arange(6),
        torch.zeros(2, 4, 1, 64),
        torch.zeros(2, 4, 1, 32),
        cache_mode="PA",
        is_output_kv=True,
    )
    assert torch.equal(res[2], got)
    with pytest.raises(OpInputError, match="4-D"):
        npu.npu_interleave_rope(x[0], cos, sin)
