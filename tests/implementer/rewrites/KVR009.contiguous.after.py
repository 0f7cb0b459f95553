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
        self.block_size = 128  # tokens per KV block; the runtime may change it

    def forward(self, inputs_embeds, position_embeddings):
        return self.lm_head(self.model(inputs_embeds, position_embeddings))

    def get_cache_info(self) -> ModelCacheInfo:
        """Every attention layer's cache entries, in layer order, for the paged runtime.

        Walks all submodules, so layers held in a ModuleList, a ModuleDict or as sublayers are
        all reported; layer_idx is the position in that walk. A block several decoder layers
        share (zamba's attention) is reported once per layer with its own caches: the layer's
        index is the first number in the path it is found under, the index its forward is
        called with.
        """
        found = [
            (name, module)
            for name, module in self.named_modules(remove_duplicate=False)
            if hasattr(module, "cache_entries")
        ]
        uses = {}
        for _, module in found:
            uses[id(module)] = uses.get(id(module), 0) + 1
        for module in {id(module): module for _, module in found}.values():
            # Loaders may cast the model after __init__: the caches hold what the layer computes.
            # A layer may pin a cache's dtype (a float32 recurrent state in a bfloat16 model).
            param = next(module.parameters(), None)
            pinned = getattr(module, "pinned_cache_dtypes", {})
            for entry in module.cache_entries:
                entry.dtype = pinned.get(entry.cache_name, param.dtype if param is not None else entry.dtype)
                if entry.attn_type in ("FullAttention", "SlidingWindow"):
                    # The run's tokens per block (the runtime may set self.block_size).
                    entry.block_size = self.block_size
        layer_caches, reported = [], set()
        for name, module in found:
            if uses[id(module)] > 1 and hasattr(module, "site_cache_entries"):
                site = next(int(part) for part in name.split(".") if part.isdigit())
                layer_caches.append(module.site_cache_entries(site))
            elif id(module) not in reported:
                layer_caches.append(list(module.cache_entries))
            reported.add(id(module))
        layer_infos = [
            LayerCacheInfo(layer_idx=index, caches=caches) for index, caches in enumerate(layer_caches)
        ]
        return ModelCacheInfo(num_layers=len(layer_infos), layer_infos=layer_infos)


class MiniVisionForConditionalGeneration(tnn.Module):
    """A vision-language wrapper that builds its text decoder through the auto classes."""

    def __init__(self, config):
        super().__init__()
        self.language_model = AutoModel.from_config(config.text_config)
