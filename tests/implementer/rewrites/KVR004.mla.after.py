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
        # Paged MLA KV cache: each token caches one latent head, shared by every query
        # head: the normalised latent (kv_lora_rank) in nope_cache and the rotated shared key
        # (qk_rope_head_dim) in rope_cache. The runtime allocates each as
        # [num_blocks, block_size, 1, dim] and injects it through tensor_setter; writes and the
        # fused attention address that memory in the NZ layout [num_blocks, dim // C0, block_size, C0].
        self.attn_type = "FullAttention"
        self.attn_tp_size = 1  # attention tensor-parallel size the query heads are split over
        self.num_heads_per_rank = config.num_attention_heads // self.attn_tp_size
        # The latent is not split across attention tensor-parallel ranks: one head on every rank.
        self.num_key_value_heads_per_rank = 1
        self.mla_nope_head_dim = config.qk_nope_head_dim
        self.mla_v_head_dim = config.v_head_dim
        self.nope_cache = torch.Tensor([])
        self.rope_cache = torch.Tensor([])
        # (weights key, W_uk, W_uv) split from wkv_b by absorbed_kv_b_proj() once the weights
        # are loaded; never here, where the weights are still uninitialised.
        self.mla_absorbed = None
        self.cache_entries = [
            CacheEntry(
                cache_name="nope_cache",
                attn_type=self.attn_type,
                dim=config.kv_lora_rank,
                num_head=self.num_key_value_heads_per_rank,
                # NOTE: models are built under their compute dtype (torch.set_default_dtype).
                dtype=torch.get_default_dtype(),
                needs_block=True,
                tensor_setter=self.set_nope_cache,
            ),
            CacheEntry(
                cache_name="rope_cache",
                attn_type=self.attn_type,
                dim=config.qk_rope_head_dim,
                num_head=self.num_key_value_heads_per_rank,
                # NOTE: models are built under their compute dtype (torch.set_default_dtype).
                dtype=torch.get_default_dtype(),
                needs_block=True,
                tensor_setter=self.set_rope_cache,
            ),
        ]

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

    def set_nope_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of nope_cache: [num_blocks, block_size, 1, kv_lora_rank]."""
        self.nope_cache = tensor

    def set_rope_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of rope_cache: [num_blocks, block_size, 1, qk_rope_head_dim]."""
        self.rope_cache = tensor

    def absorbed_kv_b_proj(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [N, nope, rank] and W_uv [N, v, rank], split from wkv_b.weight.

        The weight is [N * (nope + v), rank]: per head, nope rows that turn the latent into
        the key and v rows that turn it into the value. The split is made on the first
        forward and again only when the weight is replaced or written in place (its storage,
        version counter, dtype or device changes), i.e. once after the weights are loaded.
        A captured (compiled) decode step reuses the split of the eager prefill before it:
        a data pointer cannot be traced.
        """
        if self.mla_absorbed is not None and torch.compiler.is_compiling():
            return self.mla_absorbed[1], self.mla_absorbed[2]
        weight = self.wkv_b.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self.mla_absorbed is None or self.mla_absorbed[0] != key:
            per_head = weight.detach().view(-1, self.mla_nope_head_dim + self.mla_v_head_dim, weight.shape[-1])
            w_uk = per_head[:, : self.mla_nope_head_dim].contiguous()
            w_uv = per_head[:, self.mla_nope_head_dim :].contiguous()
            self.mla_absorbed = (key, w_uk, w_uv)
        return self.mla_absorbed[1], self.mla_absorbed[2]

    def decompress_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [S, N, nope] and values [S, N, v] of latents [S, rank], by wkv_b.

        The layer's own projection (weights, bias, any wrapper), as the source model applies
        it; the value is made contiguous because the fused attention takes no strided input.
        """
        per_head = self.wkv_b(latent).view(latent.shape[0], -1, self.mla_nope_head_dim + self.mla_v_head_dim)
        return per_head[..., : self.mla_nope_head_dim], per_head[..., self.mla_nope_head_dim :].contiguous()

    def cached_latent(self, md) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent [S, rank] and rope key [S, rope] of every context token, read from the caches.

        Requests are packed in batch order, each with its actual_seq_lengths_kv tokens (earlier
        chunks and this step, which is written first): S = sum of them. Token t of request b sits
        in block block_table[b, t // block_size], row t % block_size. Example: kv lengths [3, 2],
        block_size 4, block_table [[5], [2]] -> (block, row) (5, 0) (5, 1) (5, 2) (2, 0) (2, 1).
        """
        block_table = md.block_table[self.attn_type]
        device = block_table.device
        kv_lens = md.actual_seq_lengths_kv.to(device=device, dtype=torch.int64)
        request = torch.repeat_interleave(torch.arange(kv_lens.numel(), device=device), kv_lens)  # [S]
        starts = torch.cumsum(kv_lens, 0) - kv_lens
        position = torch.arange(request.numel(), device=device) - starts[request]  # [S]
        block_size = self.nope_cache.shape[1]
        block = block_table[request, position // block_size].long()
        row = position % block_size
        # NZ: token (block, row) holds its dim channels at [block, 0, :, row, :] (see nz_view)
        return tuple(
            self.nz_view(cache)[block, 0, :, row].reshape(request.numel(), cache.shape[-1])
            for cache in (self.nope_cache, self.rope_cache)
        )

    @staticmethod
    def nz_view(cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, block_size, 1, dim] -> the fused attention's 5-D NZ view.

        Element (block, t, d) of an NZ cache lives at [block, 0, d // C0, t, d % C0] with
        C0 = 16 for fp16/bf16 (32 for int8): a plain view of the same memory, no copy.
        unconfirmed: C0 for fp32 caches on the device (16 is used, as for fp16).
        """
        num_blocks, block_size, _, dim = cache.shape
        c0 = 32 if cache.dtype == torch.int8 else 16
        return cache.view(num_blocks, 1, dim // c0, block_size, c0)

    def update_latent_cache(self, slots: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        """Write this step's latent [T, rank] and rotated key [T, rope] at their slots, NZ.

        A token's dim channels sit in dim // C0 rows of C0 elements, block_size rows apart:
        slot = block * block_size + t  ->  row block * (dim // C0) * block_size + c * block_size + t
        for chunk c, in the cache viewed as [rows, C0]. Example: block_size 16, dim 64, slot 35
        (block 2, t 3): rows 131, 147, 163, 179.
        """
        for cache, value in ((self.nope_cache, latent), (self.rope_cache, rope_key)):
            num_blocks, block_size, _, dim = cache.shape
            c0 = 32 if cache.dtype == torch.int8 else 16
            chunks = torch.arange(dim // c0, device=slots.device).view(1, -1)
            block, offset = (slots // block_size).view(-1, 1), (slots % block_size).view(-1, 1)
            rows = block * (dim // c0 * block_size) + chunks * block_size + offset  # [T, dim // C0]
            torch_npu.npu_scatter_nd_update_(
                cache.view(-1, c0), rows.view(-1, 1), value.reshape(-1, c0).to(cache.dtype)
            )


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
