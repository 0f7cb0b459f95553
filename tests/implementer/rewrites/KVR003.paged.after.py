"""A transformers-5-style model written for the per-rewrite tests: GQA attention with rotary
embeddings, a dense causal mask, and a causal-LM head. Never run; only rewritten."""

import torch
import torch.nn.functional as F
from torch import nn as tnn

from ...masking_utils import create_causal_mask as causal_mask
from ...modeling_utils import ALL_ATTENTION_FUNCTIONS
from ..auto import AutoModel
from .configuration_mini import MiniConfig


def rotate_half(x):
    # a comment in an untouched function
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # trailing comment


class MiniAttention(tnn.Module):
    def __init__(self, config: MiniConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = tnn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
        self.k_proj = tnn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.v_proj = tnn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.o_proj = tnn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin

        # Paged KV: flatten to TND ([T, N, D]), write this step's keys and values at
        # slot_mapping[attn_type], then attend over this attn_type's block table.
        md = get_forward_metadata()
        query_tnd = query_states.transpose(1, 2).reshape(-1, self.num_heads_per_rank, query_states.shape[-1])
        key_tnd = key_states.transpose(1, 2).reshape(-1, self.num_key_value_heads_per_rank, key_states.shape[-1])
        value_tnd = value_states.transpose(1, 2).reshape(-1, self.num_key_value_heads_per_rank, value_states.shape[-1])
        self.update_cache(md.slot_mapping[self.attn_type], key_tnd, value_tnd)
        num_blocks, block_size = self.k_cache.shape[:2]
        attn_output, _ = torch_npu.npu_fused_infer_attention_score(
            query_tnd,
            self.k_cache.view(num_blocks, block_size, -1),
            self.v_cache.view(num_blocks, block_size, -1),
            num_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND",
            scale=self.scaling,
            atten_mask=md.attention_mask,
            sparse_mode=3,
            block_table=md.block_table[self.attn_type],
            block_size=block_size,
            actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
            actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
        )
        attn_output = attn_output.unsqueeze(0)  # [1, T, N, D], as the source kernel returns
        attn_weights = None
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def update_cache(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's keys and values ([T, num_kv_heads, head_dim]) at their slots.

        slot = block_id * block_size + offset. A contiguous cache is addressed as flat slots
        [num_blocks * block_size, heads, dim]. A page-pool view cannot be flattened (its block
        stride is the page, not block_size * heads * dim), so it is written through its own
        [num_blocks, block_size, heads, dim] form with (block_id, offset) pairs.
        """
        if self.k_cache.is_contiguous() and self.v_cache.is_contiguous():
            heads = self.num_key_value_heads_per_rank
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, heads, key.shape[-1]), slots.view(-1, 1), key)
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, heads, value.shape[-1]), slots.view(-1, 1), value)
            return
        # NOTE: whether ScatterNdUpdate accepts a strided page view on device is unconfirmed
        # (references/npu_ops.md); the contiguous layout is the safe default.
        block_size = self.k_cache.shape[1]
        where = torch.stack((slots // block_size, slots % block_size), dim=-1)
        torch_npu.npu_scatter_nd_update_(self.k_cache, where, key)
        torch_npu.npu_scatter_nd_update_(self.v_cache, where, value)


class MiniDecoderLayer(tnn.Module):
    def __init__(self, config: MiniConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MiniAttention(config, layer_idx)

    def forward(self, hidden_states, **kwargs):
        attn, _ = self.self_attn(hidden_states, **kwargs)
        return hidden_states + attn


class MiniModel(tnn.Module):
    def __init__(self, config: MiniConfig):
        super().__init__()
        self.config = config
        self.layers = tnn.ModuleList(MiniDecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, inputs_embeds, position_embeddings, past_key_values=None):
        mask = causal_mask(config=self.config, inputs_embeds=inputs_embeds, past_key_values=past_key_values)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings, attention_mask=mask)
        return F.normalize(hidden_states, dim=-1)


class MiniForCausalLM(tnn.Module):
    def __init__(self, config: MiniConfig):
        super().__init__()
        self.model = MiniModel(config)
        self.lm_head = tnn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, inputs_embeds, position_embeddings):
        return self.lm_head(self.model(inputs_embeds, position_embeddings))


class MiniVisionForConditionalGeneration(tnn.Module):
    """A vision-language wrapper that builds its text decoder through the auto classes."""

    def __init__(self, config):
        super().__init__()
        self.language_model = AutoModel.from_config(config.text_config)
