"""Absorbed MLA over paged NZ latent caches equals the source attention (ops + absorb math).

Written by hand, independently of the codemods: the source transformers attention runs
dense and causal on each request alone; the absorbed version packs two requests, writes the
latent into shuffled paged blocks (through npu_kv_rmsnorm_rope_cache PA_NZ, or by hand in
NZ order), and attends with the fused operator in TND_NTD with key = value = the latent.
"""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime import get_init_attn_mask
from kvskill.runtime.ops import torch_npu
from transformers import AutoConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3

BLOCK = 16
C0 = 16


def make_attention(interleave: bool, yarn: bool) -> tuple[ds3.DeepseekV3Attention, object]:
    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    if yarn:
        rope = {
            "rope_theta": 10000.0,
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    config = AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=128,
        qk_nope_head_dim=16,
        qk_rope_head_dim=64,
        v_head_dim=24,
        rope_interleave=interleave,
        rope_parameters=rope,
        max_position_embeddings=128,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = ds3.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(
                torch.randn_like(p) / max(p.shape[-1], 1) ** 0.5
                if p.dim() > 1
                else 1 + 0.1 * torch.randn_like(p)
            )
    return attn, config


def source_output(attn, config, hidden: torch.Tensor) -> torch.Tensor:
    """The unconverted attention on one request: [S, H] -> [S, H], dense causal."""
    s = hidden.shape[0]
    pos = torch.arange(s).unsqueeze(0)
    cos, sin = ds3.DeepseekV3RotaryEmbedding(config)(hidden, pos)
    mask = torch.full((s, s), float("-inf")).triu(1).view(1, 1, s, s)
    out, _ = attn(hidden.unsqueeze(0), (cos, sin), mask)
    return out[0]


def nz_write(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Element (block, t, d) at flat [block, d // C0, t, d % C0] (npu_ops §4 NZ formula)."""
    nb, bs, _, d = cache.shape
    storage = cache.view(nb, d // C0, bs, C0)
    storage[slots // bs, :, slots % bs, :] = rows.view(-1, d // C0, C0)


def nz_read(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    nb, bs, _, d = cache.shape
    return cache.view(nb, d // C0, bs, C0)[slots // bs, :, slots % bs, :].reshape(-1, d)


class Absorbed:
    """Paged, absorbed MLA for one attention module; caches shared across steps."""

    def __init__(self, attn, config, fused: bool) -> None:
        self.attn, self.config, self.fused = attn, config, fused
        self.rank, self.rope = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_cache = torch.zeros(12, BLOCK, 1, self.rank)
        self.rope_cache = torch.zeros(12, BLOCK, 1, self.rope)
        w = attn.kv_b_proj.weight.view(config.num_attention_heads, -1, self.rank)
        self.w_uk, self.w_uv = w[:, : config.qk_nope_head_dim], w[:, config.qk_nope_head_dim :]

    def step(self, hidden, positions, slots, block_table, q_lens, kv_lens, prefill: bool):
        attn, cfg = self.attn, self.config
        t, n = hidden.shape[0], cfg.num_attention_heads
        cos, sin = ds3.DeepseekV3RotaryEmbedding(cfg)(hidden, positions.unsqueeze(0))
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden))).view(t, n, -1)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, self.rope], dim=-1)
        kv = attn.kv_a_proj_with_mqa(hidden)  # [T, rank + rope]
        latent, k_rot = kv.split([self.rank, self.rope], dim=-1)
        rope_fn = (
            ds3.apply_rotary_pos_emb_interleave if cfg.rope_interleave else ds3.apply_rotary_pos_emb
        )
        q_rot, k_rot = rope_fn(
            q_rot.transpose(0, 1).unsqueeze(0), k_rot.view(1, 1, t, -1), cos, sin
        )
        q_rot = q_rot[0].transpose(0, 1)  # [T, N, rope]
        if self.fused:
            torch_npu.npu_kv_rmsnorm_rope_cache(
                kv.view(t, 1, 1, -1),
                attn.kv_a_layernorm.weight,
                cos.view(t, 1, 1, -1),
                sin.view(t, 1, 1, -1),
                slots,
                self.rope_cache,
                self.nope_cache,
                epsilon=attn.kv_a_layernorm.variance_epsilon,
                cache_mode="PA_NZ",
            )
        else:
            nz_write(self.nope_cache, slots, attn.kv_a_layernorm(latent))
            nz_write(self.rope_cache, slots, k_rot.reshape(t, -1))
        q_latent = torch.einsum("tnd,ndr->tnr", q_nope, self.w_uk)
        nb = self.nope_cache.shape[0]
        nope_nz = self.nope_cache.view(nb, 1, self.rank // C0, BLOCK, C0)
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q_latent,
            nope_nz,
            nope_nz,
            query_rope=q_rot,
            key_rope=self.rope_cache.view(nb, 1, self.rope // C0, BLOCK, C0),
            num_heads=n,
            num_key_value_heads=1,
            input_layout="TND_NTD",
            scale=attn.scaling,
            atten_mask=get_init_attn_mask(2048) if prefill else None,
            sparse_mode=3 if prefill else 0,
            block_table=block_table,
            block_size=BLOCK,
            actual_seq_lengths=torch.tensor(q_lens).cumsum(0).tolist(),
            actual_seq_lengths_kv=kv_lens,
        )
        assert out.shape == (n, t, self.rank)  # NTD output of TND_NTD
        values = torch.einsum("ntr,nvr->tnv", out, self.w_uv)
        return attn.o_proj(values.reshape(t, -1))


@pytest.mark.parametrize(
    ("interleave", "yarn", "fused"),
    [(True, True, True), (True, False, False), (False, True, False), (False, False, False)],
)
def test_absorbed_paged_mla_matches_source_attention(interleave, yarn, fused):
    attn, config = make_attention(interleave, yarn)
    absorbed = Absorbed(attn, config, fused)
    gen = torch.Generator().manual_seed(1)
    lens = [7, 21]
    hidden = [torch.randn(n + 2, 64, generator=gen) for n in lens]  # prompt + 2 decode steps
    # shuffled physical blocks; block 0 is the null block
    table = torch.tensor([[5, 0], [9, 2]], dtype=torch.int32)
    with torch.no_grad():
        expected = [source_output(attn, config, h) for h in hidden]

        def slots(req: int, positions: torch.Tensor) -> torch.Tensor:
            return table[req, positions // BLOCK].long() * BLOCK + positions % BLOCK

        # Prefill both prompts packed into one TND step.
        pos = [torch.arange(n) for n in lens]
        out = absorbed.step(
            torch.cat([h[:n] for h, n in zip(hidden, lens, strict=True)]),
            torch.cat(pos),
            torch.cat([slots(r, p) for r, p in enumerate(pos)]),
            table,
            lens,
            lens,
            prefill=True,
        )
        torch.testing.assert_close(out[: lens[0]], expected[0][: lens[0]], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out[lens[0] :], expected[1][: lens[1]], atol=1e-5, rtol=1e-4)
        # Two decode steps: one token per request, sparse_mode 0 without a mask.
        for step in range(2):
            p = torch.tensor([lens[0] + step, lens[1] + step])
            out = absorbed.step(
                torch.stack([hidden[0][p[0]], hidden[1][p[1]]]),
                p,
                torch.stack([slots(0, p[:1])[0], slots(1, p[1:])[0]]),
                table,
                [1, 1],
                (p + 1).tolist(),
                prefill=False,
            )
            torch.testing.assert_close(out[0], expected[0][p[0]], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(out[1], expected[1][p[1]], atol=1e-5, rtol=1e-4)


def test_fused_write_stores_the_source_latent_and_rotated_key_in_nz_order():
    """PA_NZ write of the raw down-projection = the source's RMSNorm-ed latent and its
    interleaved rope, in the same channel order the source's query uses."""
    attn, config = make_attention(interleave=True, yarn=False)
    t = 5
    hidden = torch.randn(t, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cos, sin = ds3.DeepseekV3RotaryEmbedding(config)(hidden, torch.arange(t).unsqueeze(0))
        kv = attn.kv_a_proj_with_mqa(hidden)
        latent, k_rot = kv.split([128, 64], dim=-1)
        _, k_rot = ds3.apply_rotary_pos_emb_interleave(
            k_rot.view(1, 1, t, 64), k_rot.view(1, 1, t, 64), cos, sin
        )
        nope, rope = torch.zeros(3, BLOCK, 1, 128), torch.zeros(3, BLOCK, 1, 64)
        slots = torch.tensor([33, 17, 18, 40, 47])
        torch_npu.npu_kv_rmsnorm_rope_cache(
            kv.view(t, 1, 1, -1),
            attn.kv_a_layernorm.weight,
            cos.view(t, 1, 1, -1),
            sin.view(t, 1, 1, -1),
            slots,
            rope,
            nope,
            epsilon=attn.kv_a_layernorm.variance_epsilon,
            cache_mode="PA_NZ",
        )
        torch.testing.assert_close(nz_read(nope, slots), attn.kv_a_layernorm(latent))
        torch.testing.assert_close(nz_read(rope, slots), k_rot.reshape(t, 64))
        # nothing else was written: exactly the 5 token columns of the NZ storage are set
        written = nope.view(3, 128 // C0, BLOCK, C0).ne(0).any(dim=3).any(dim=1)  # [blocks, t]
        assert written.nonzero()[:, 0].mul(BLOCK).add(written.nonzero()[:, 1]).tolist() == sorted(
            slots.tolist()
        )
