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

        if cache is not None:
            latent, k_pe = cache.update(latent, k_pe, self.layer_idx)

        query = torch.cat((q_nope, q_pe), dim=-1)
        kv_full = (
            self.wkv_b(latent).view(b, -1, self.n_heads, self.nope + self.vdim).transpose(1, 2)
        )
        k_nope, value = torch.split(kv_full, [self.nope, self.vdim], dim=-1)
        key = torch.cat((k_nope, k_pe.expand(-1, self.n_heads, -1, -1)), dim=-1)
        out, _ = attend(self, query, key, value, mask, scaling=self.softmax_scale)
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
        self.block_size = 16  # tokens per KV block; the runtime may change it
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

    def get_cache_info(self) -> ModelCacheInfo:
        """Every attention layer's latent caches (nope + rope), in layer order.

        is_mla_backend=True: each rank holds the whole latent, so e.g. a KV transfer moves it
        from a single rank.
        """
        attentions = [module for module in self.modules() if hasattr(module, "cache_entries")]
        for module in attentions:
            # Loaders may cast the model after __init__: the latent caches hold what the layer
            # computes (the fused attention takes the query's dtype for key and value); a
            # layer may pin a cache's dtype (a float32 recurrent state in a bfloat16 model).
            param = next(module.parameters(), None)
            pinned = getattr(module, "pinned_cache_dtypes", {})
            for entry in module.cache_entries:
                entry.dtype = pinned.get(entry.cache_name, param.dtype if param is not None else entry.dtype)
                if entry.attn_type in ("FullAttention", "SlidingWindow"):
                    # The run's tokens per block (the runtime may set self.block_size).
                    entry.block_size = self.block_size
        layer_infos = [
            LayerCacheInfo(layer_idx=index, caches=list(module.cache_entries))
            for index, module in enumerate(attentions)
        ]
        return ModelCacheInfo(
            num_layers=len(layer_infos),
            layer_infos=layer_infos,
            is_mla_backend=True,
        )
