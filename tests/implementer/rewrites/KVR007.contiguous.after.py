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

        # Contiguous KV (BSH): write this step's keys and values into each row's cache, then attend
        # over the row's whole cache; actual_seq_lengths_kv says how much of each row is valid.
        md = get_forward_metadata()
        batch, q_len = query_states.shape[0], query_states.shape[2]
        query_bsh = query_states.transpose(1, 2).reshape(batch, q_len, -1)  # [B, S, N * D]
        key_bsh = key_states.transpose(1, 2).reshape(batch, q_len, -1)  # [B, S, N_kv * D]
        value_bsh = value_states.transpose(1, 2).reshape(batch, q_len, -1)  # [B, S, N_kv * D]
        # kv_len belongs to the runner (tokens per row before this step); layers only read it.
        # This step's tokens are written from there: position 0 for a prefill, the new token's
        # position for a decode step.
        self.update_cache(md.kv_len, key_bsh, value_bsh)
        # Prefill: causal over the 2048 tile (sparse_mode 3). Decode: one query per row, which the
        # operator runs in its decode branch, masked by actual_seq_lengths_kv alone (sparse_mode 0).
        attn_output, _ = torch_npu.npu_fused_infer_attention_score(
            query_bsh,
            self.k_cache,
            self.v_cache,
            num_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="BSH",
            scale=self.scaling,
            atten_mask=md.attention_mask if md.is_prefill else None,
            sparse_mode=3 if md.is_prefill else 0,
            actual_seq_lengths=(md.actual_seq_lengths_list_q or md.actual_seq_lengths_q.tolist()),
            actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
        )
        attn_output = attn_output.view(batch, q_len, self.num_heads_per_rank, -1)  # [B, S, N, D], as the source kernel returns
        attn_weights = None
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def update_cache(self, write_start: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's keys and values ([B, S, num_kv_heads * head_dim]) into each row.

        Row b receives its S new tokens at cache positions write_start[b] .. write_start[b] + S - 1
        (axis 1 of the [batch, max_seq_len, H] cache).
        """
        torch_npu.scatter_update_(self.k_cache, write_start, key, 1)
        torch_npu.scatter_update_(self.v_cache, write_start, value, 1)


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
