"""A transformers-5-style model written for the per-rewrite tests: GQA attention with rotary
embeddings, a dense causal mask, and a causal-LM head. Never run; only rewritten."""

import torch
import torch.nn.functional as F
from torch import nn as tnn

from ...masking_utils import create_causal_mask as causal_mask
from ...modeling_utils import ALL_ATTENTION_FUNCTIONS
from ..auto import AutoModel
from .configuration_mini import MiniConfig


def _in_paged_runtime() -> bool:
    """True inside a paged step (the host set its block tables), where the fused attention
    masks by itself (sparse_mode + actual sequence lengths) and dense masks would cost O(T^2)."""
    return get_forward_metadata().block_table is not None


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

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


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
        mask = (None if _in_paged_runtime() else causal_mask(config=self.config, inputs_embeds=inputs_embeds, past_key_values=past_key_values))
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
