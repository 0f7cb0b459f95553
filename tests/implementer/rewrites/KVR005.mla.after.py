"""A small latent-attention (MLA) language model with its own names, for kvskill's tests.

Same structure as DeepSeek's attention (latent down-projection with a separate rope key,
RMSNorm of the latent, a latent up-projection into per-head keys and values, interleaved
rope) but none of its attribute names: the MLA rewrite must find it by structure.
``forward`` takes ``cache`` like a transformers-5 attention and caches the latent.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class LatentToyConfig(SimpleNamespace):
    def __init__(self, **values) -> None:
        defaults = dict(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            kv_lora_rank=128,
            qk_nope_head_dim=8,
            qk_rope_head_dim=64,
            v_head_dim=12,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
        )
        defaults.update(values)
        super().__init__(**defaults)


class Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.gain * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (0, 1), (2, 3), ...; the result lists the even halves first."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


def attend(module, query, key, value, mask, scaling=None):
    """Dense attention: [B, N, S, D] inputs, [B, S, N, Dv] output."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask
    return torch.matmul(scores.softmax(-1), value).transpose(1, 2), None


class LatentAttention(nn.Module):
    def __init__(self, config: LatentToyConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.nope, self.rope, self.vdim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.wq = nn.Linear(config.hidden_size, self.n_heads * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(
            config.hidden_size, config.kv_lora_rank + config.qk_rope_head_dim, bias=False
        )
        self.kv_norm = Norm(config.kv_lora_rank, config.rms_norm_eps)
        self.wkv_b = nn.Linear(
            config.kv_lora_rank, self.n_heads * (self.nope + self.vdim), bias=False
        )
        self.wo = nn.Linear(self.n_heads * self.vdim, config.hidden_size, bias=False)
        self.softmax_scale = (self.nope + self.rope) ** -0.5

    def forward(self, x, cos, sin, mask=None, cache=None):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        kv = self.wkv_a(x)
        latent, k_pe = torch.split(kv, [self.config.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_norm(latent).view(b, 1, s, -1)
        k_pe = k_pe.view(b, 1, s, self.rope)
        q_pe = rotate_pairs(q_pe, cos, sin)
        k_pe = rotate_pairs(k_pe, cos, sin)

        # Paged MLA: each token caches one latent head (the normalised latent in nope_cache, the
        # rotated shared key in rope_cache). Prefill attends un-absorbed, decode absorbed (npu_ops §9).
        md = get_forward_metadata()
        q_nope_tnd = q_nope.transpose(1, 2).reshape(-1, self.num_heads_per_rank, q_nope.shape[-1])  # [T, N, nope]
        q_rope_tnd = q_pe.transpose(1, 2).reshape(-1, self.num_heads_per_rank, q_pe.shape[-1])  # [T, N, rope]
        slots = md.slot_mapping[self.attn_type]
        self.update_latent_cache(slots, latent.reshape(-1, latent.shape[-1]), k_pe.reshape(-1, k_pe.shape[-1]))
        if md.is_prefill:
            # Un-absorbed (the operator takes the 512-wide latent query for 1..16 tokens per request
            # only): every context token of each request, the earlier chunks' and this step's, is read
            # back from the latent caches and decompressed by wkv_b into per-head keys and
            # values; the query is nope + rope wide (TND, Q_D = K_D = nope + rope, V_D = v).
            ctx_latent, ctx_rope = self.cached_latent(md)  # [S, rank], [S, rope]; S = sum of kv lengths
            ctx_key_nope, ctx_value = self.decompress_latent(ctx_latent)  # [S, N, nope], [S, N, v]
            ctx_key = torch.cat((ctx_key_nope, ctx_rope.unsqueeze(1).expand(-1, ctx_key_nope.shape[1], -1)), dim=-1)
            query_full = torch.cat((q_nope_tnd, q_rope_tnd), dim=-1)  # [T, N, nope + rope]
            attn_tnd, _ = torch_npu.npu_fused_infer_attention_score(
                query_full,
                ctx_key,
                ctx_value,
                num_heads=self.num_heads_per_rank,
                num_key_value_heads=self.num_heads_per_rank,
                input_layout="TND",
                scale=self.softmax_scale,
                atten_mask=md.attention_mask,
                sparse_mode=3,
                actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
                actual_seq_lengths_kv=(md.actual_seq_lengths_cu_list_kv or md.actual_seq_lengths_cu_kv.tolist()),
            )
            out = attn_tnd.unsqueeze(0)  # [1, T, N, v], as the source kernel returns
        else:
            # Absorbed, one query per request: q_nope . k_nope = (q_nope W_uk) . latent, so the query
            # absorbs W_uk and attends on the latent cache (key = value = nope_cache, the rope key
            # passed apart); the output is the latent mix, projected per head by W_uv.
            w_uk, w_uv = self.absorbed_kv_b_proj()
            # contiguous, as the rope part below: the fused attention takes no strided query
            query_latent = torch.bmm(q_nope_tnd.transpose(0, 1), w_uk).transpose(0, 1).contiguous()  # [T, N, rank]
            nope_nz = self.nz_view(self.nope_cache)
            attn_latent, _ = torch_npu.npu_fused_infer_attention_score(
                query_latent,
                nope_nz,
                nope_nz,
                query_rope=q_rope_tnd.contiguous(),
                key_rope=self.nz_view(self.rope_cache),
                num_heads=self.num_heads_per_rank,
                num_key_value_heads=self.num_key_value_heads_per_rank,
                input_layout="TND_NTD",
                scale=self.softmax_scale,
                atten_mask=None,
                sparse_mode=0,
                block_table=md.block_table[self.attn_type],
                block_size=nope_nz.shape[-2],
                actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
                actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
            )
            out = torch.bmm(attn_latent, w_uv.transpose(1, 2)).transpose(0, 1).unsqueeze(0)  # [1, T, N, v], as the source kernel returns
        return self.wo(out.reshape(b, s, -1))


class LatentBlock(nn.Module):
    def __init__(self, config: LatentToyConfig, layer_idx: int) -> None:
        super().__init__()
        self.norm1 = Norm(config.hidden_size, config.rms_norm_eps)
        self.attn = LatentAttention(config, layer_idx)
        self.norm2 = Norm(config.hidden_size, config.rms_norm_eps)
        self.up = nn.Linear(config.hidden_size, 2 * config.hidden_size, bias=False)
        self.down = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.down(torch.nn.functional.silu(self.up(self.norm2(x))))


class LatentToyForCausalLM(nn.Module):
    def __init__(self, config: LatentToyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LatentBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = Norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        dim = config.qk_rope_head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids, position_ids=None, use_cache=False, logits_to_keep=None):
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s).unsqueeze(0)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((s, s), float("-inf")).triu(1)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.norm(x)
        if logits_to_keep is not None:
            x = x[:, logits_to_keep]
        return (self.lm_head(x),)
