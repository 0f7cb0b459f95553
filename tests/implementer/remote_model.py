"""A transformers-4-style remote-code model written for the tests.

Its attention reads the cache through ``past_key_value.update(...)``, repeats K/V and calls
``scaled_dot_product_attention`` with a YaRN-style softmax scale (``mscale**2``); the model
builds its mask with ``masking_utils.create_causal_mask``. Nothing here comes from a real
checkpoint.

The text is written for transformers 5; :func:`for_installed_transformers` adapts the few
calls whose API differs in the installed version (found by feature detection), so the same
model runs under every transformers the project supports while its 5.x text, and so its
golden conversion, stays as it is.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
from pathlib import Path

CONFIGURATION = """\
from transformers import PretrainedConfig


class TinyRemoteConfig(PretrainedConfig):
    model_type = "tiny_remote"

    def __init__(
        self,
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        mscale=1.3,
        max_position_embeddings=512,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.mscale = mscale
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)
"""

MODELING = '''\
"""Tiny remote-code causal LM (transformers 4 style)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_tiny_remote import TinyRemoteConfig


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    # x: [B, Nkv, S, D] -> [B, Nkv * n_rep, S, D]
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class TinyRMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        # keep this comment: untouched code keeps its comments
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class TinyRotary(nn.Module):
    def __init__(self, config):
        super().__init__()
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class TinyAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        # YaRN-style attention temperature: the softmax scale carries mscale squared
        self.softmax_scale = self.head_dim**-0.5 * config.mscale * config.mscale
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_value=None, **kwargs):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_value is not None:
            cache_kwargs = {"sin": sin, "cos": cos}
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, cache_kwargs)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]

        attn_output = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=causal_mask,
            is_causal=causal_mask is None and q_len > 1,
            scale=self.softmax_scale,
        )
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class TinyDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = TinyAttention(config, layer_idx)
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = TinyRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = TinyRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, past_key_value
        )
        hidden_states = residual + hidden_states
        gate, up = self.gate_up(self.post_attention_layernorm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.down(F.silu(gate) * up)


class TinyRemotePreTrainedModel(PreTrainedModel):
    config_class = TinyRemoteConfig
    base_model_prefix = "model"
    _supports_sdpa = True


class TinyRemoteModel(TinyRemotePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([TinyDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = TinyRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = TinyRotary(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None, use_cache=None, **kwargs):
        past_key_values = past_key_values if past_key_values is not None else cache
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(past, past + inputs_embeds.shape[1]).unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, causal_mask, past_key_values)
        return self.norm(hidden_states), past_key_values


class TinyRemoteForCausalLM(TinyRemotePreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyRemoteModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None, use_cache=None, logits_to_keep=0, **kwargs):
        hidden_states, past_key_values = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values if past_key_values is not None else cache,
            use_cache=use_cache,
        )
        if isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
        else:
            hidden_states = hidden_states[:, logits_to_keep, :]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states), cache=past_key_values)
'''

CONFIG = {
    "model_type": "tiny_remote",
    "architectures": ["TinyRemoteForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
        "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
    },
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "mscale": 1.3,
    "max_position_embeddings": 512,
}


#: the mask builder call of MODELING, as transformers 5 spells it
_MASK_CALL = """\
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=past_key_values,
            position_ids=position_ids,
        )
"""
_MASK_IMPORT = "from transformers.masking_utils import create_causal_mask\n"


def _params(func) -> set[str]:
    return set(inspect.signature(func).parameters)


def for_installed_transformers(modeling: str) -> str:
    """MODELING adapted to the installed transformers (unchanged under transformers 5)."""
    from transformers import modeling_outputs
    from transformers.cache_utils import DynamicCache

    if importlib.util.find_spec("transformers.masking_utils") is None:
        # before masking_utils (4.46): no mask builder; SDPA's is_causal masks the prompt
        modeling = modeling.replace(_MASK_IMPORT, "").replace(
            _MASK_CALL, "        causal_mask = None\n"
        )
    else:
        from transformers.masking_utils import create_causal_mask

        params = _params(create_causal_mask)
        call = _MASK_CALL
        if "inputs_embeds" not in params:  # 4.5x: input_embeds, past_key_values, cache_position
            call = call.replace("inputs_embeds=", "input_embeds=")
        if "cache" not in params:
            call = call.replace("cache=past_key_values,", "past_key_values=past_key_values,")
        if "cache_position" in params:
            call = call.replace(
                "position_ids=position_ids,",
                "cache_position=position_ids[0],\n            position_ids=position_ids,",
            )
        modeling = modeling.replace(_MASK_CALL, call)
    init = inspect.signature(DynamicCache.__init__).parameters
    if "config" not in init and not any(p.kind is p.VAR_KEYWORD for p in init.values()):
        modeling = modeling.replace("DynamicCache(config=self.config)", "DynamicCache()")
    output_fields = {f.name for f in dataclasses.fields(modeling_outputs.CausalLMOutputWithPast)}
    if "cache" not in output_fields:
        modeling = modeling.replace("cache=past_key_values)", "past_key_values=past_key_values)")
    return modeling


def write_remote_model(directory: Path, modeling: str = MODELING) -> Path:
    """Write the tiny remote-code model directory (its modeling code adapted to the installed
    transformers); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "configuration_tiny_remote.py").write_text(CONFIGURATION, encoding="utf-8")
    modeling = for_installed_transformers(modeling)
    (directory / "modeling_tiny_remote.py").write_text(modeling, encoding="utf-8")
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2), encoding="utf-8")
    return directory
