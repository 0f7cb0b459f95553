"""A transformers-4.46-style attention family written for the rewrite tests: an eager class
with hand-written matmul attention, an SDPA variant that overrides only forward, a flash
variant with its own __init__ calling super, chosen through a dict. Never run; only rewritten."""

import math

import torch
from torch import nn

from ...modeling_flash_attention_utils import _flash_attention_forward


def repeat_kv(x, n_rep):
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class MiniAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.dropout = config.attention_dropout
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def split(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        q, k, v = self.qkv(hidden_states).view(bsz, q_len, 3, -1, self.head_dim).unbind(2)
        return bsz, q_len, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, output_attentions=False, **kwargs):
        bsz, q_len, query_states, key_states, value_states = self.split(hidden_states)

        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, {})

        key_states = repeat_kv(key_states, self.groups)
        value_states = repeat_kv(value_states, self.groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask

        # upcast to fp32 for the softmax
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        if not output_attentions:
            attn_weights = None
        return self.out(attn_output), attn_weights, past_key_value


class MiniSdpaAttention(MiniAttention):
    def forward(self, hidden_states, attention_mask=None, past_key_value=None, output_attentions=False, **kwargs):
        if output_attentions:
            return super().forward(hidden_states, attention_mask, past_key_value, output_attentions)
        bsz, q_len, query_states, key_states, value_states = self.split(hidden_states)

        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, {})

        key_states = repeat_kv(key_states, self.groups)
        value_states = repeat_kv(value_states, self.groups)
        attn_output = torch.nn.functional.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, is_causal=attention_mask is None and q_len > 1
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.out(attn_output), None, past_key_value


class MiniFlashAttention2(MiniAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.top_left = False

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, output_attentions=False, **kwargs):
        bsz, q_len, query_states, key_states, value_states = self.split(hidden_states)

        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, {})

        # the flash helper takes [B, S, N, D]
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        attn_output = _flash_attention_forward(
            query_states, key_states, value_states, attention_mask, q_len, dropout=0.0, use_top_left_mask=self.top_left
        )
        attn_output = attn_output.reshape(bsz, q_len, -1)
        return self.out(attn_output), None, past_key_value


MINI_ATTENTION_CLASSES = {
    "eager": MiniAttention,
    "sdpa": MiniSdpaAttention,
    "flash_attention_2": MiniFlashAttention2,
}


class MiniForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [MINI_ATTENTION_CLASSES[config._attn_implementation](config, i) for i in range(config.num_hidden_layers)]
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
