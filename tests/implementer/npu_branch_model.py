"""A remote-code model whose attention already carries an Ascend NPU branch, written for the tests.

The shape vendors ship for Ascend: the attention forward asks a flag (set in ``__init__``) and
whether ``torch_npu`` imported, and then either calls ``npu_fused_infer_attention_score`` on
this step's keys and values (BNSD, no cache at all) or writes ``past_key_values.update(...)``
and calls ``scaled_dot_product_attention`` (the transformers 5 path). On a machine without
``torch_npu`` the original runs the SDPA branch. Nothing here comes from a real checkpoint.

``KV_FIRST`` is the variant whose cache write sits before the ``if``, which then only picks
the kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIGURATION = """\
from transformers import PretrainedConfig


class TinyNpuConfig(PretrainedConfig):
    model_type = "tiny_npu"

    def __init__(
        self,
        vocab_size=256,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        use_npu_fused_attention=True,
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
        self.max_position_embeddings = max_position_embeddings
        self.use_npu_fused_attention = use_npu_fused_attention
        super().__init__(**kwargs)
"""

MODELING = '''\
"""Tiny causal LM with an Ascend fast path in its attention."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_tiny_npu import TinyNpuConfig

try:
    import torch_npu

    NPU_AVAILABLE = True
except ImportError:  # not an Ascend machine: the SDPA path runs
    torch_npu = None
    NPU_AVAILABLE = False


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class TinyNpuRMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class TinyNpuRotary(nn.Module):
    def __init__(self, config):
        super().__init__()
        exponent = torch.arange(0, config.head_dim, 2).float() / config.head_dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta**exponent), persistent=False)

    def forward(self, x, position_ids):
        angles = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class TinyNpuAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.use_npu_fa = config.use_npu_fused_attention
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin

        # Ascend fast path: fused attention over this step's keys and values
        if self.use_npu_fa and NPU_AVAILABLE:
            attn_output = torch_npu.npu_fused_infer_attention_score(
                query_states,
                key_states,
                value_states,
                num_heads=self.num_heads,
                num_key_value_heads=self.num_key_value_heads,
                input_layout="BNSD",
                scale=self.scaling,
                atten_mask=attention_mask,
                sparse_mode=0,
            )[0]
            attn_output = attn_output.transpose(1, 2)
        else:
            if past_key_values is not None:
                key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
            attn_output = F.scaled_dot_product_attention(
                query_states,
                key_states,
                value_states,
                attn_mask=attention_mask,
                is_causal=attention_mask is None and q_len > 1,
                scale=self.scaling,
                enable_gqa=True,
            )
            attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class TinyNpuDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = TinyNpuAttention(config, layer_idx)
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = TinyNpuRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = TinyNpuRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, past_key_values
        )
        hidden_states = residual + hidden_states
        gate, up = self.gate_up(self.post_attention_layernorm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.down(F.silu(gate) * up)


class TinyNpuPreTrainedModel(PreTrainedModel):
    config_class = TinyNpuConfig
    base_model_prefix = "model"
    _supports_sdpa = True


class TinyNpuModel(TinyNpuPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([TinyNpuDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = TinyNpuRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = TinyNpuRotary(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None, use_cache=None, **kwargs):
        # transformers 5 hands the cache over as `cache`, earlier releases as `past_key_values`
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


class TinyNpuForCausalLM(TinyNpuPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyNpuModel(config)
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
        # an int keeps the last rows (0: all); a tensor names the rows to keep
        if isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
        else:
            hidden_states = hidden_states[:, logits_to_keep, :]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states), cache=past_key_values)
'''

#: the same model with the cache write before the ``if``, which then only picks the kernel
KV_FIRST = MODELING.replace(
    """        # Ascend fast path: fused attention over this step's keys and values
        if self.use_npu_fa and NPU_AVAILABLE:""",
    """        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        # Ascend fast path: fused attention over the (dense) cached keys and values
        if self.use_npu_fa and NPU_AVAILABLE:""",
).replace(
    """        else:
            if past_key_values is not None:
                key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
            attn_output""",
    """        else:
            attn_output""",
)

CONFIG = {
    "model_type": "tiny_npu",
    "architectures": ["TinyNpuForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_tiny_npu.TinyNpuConfig",
        "AutoModelForCausalLM": "modeling_tiny_npu.TinyNpuForCausalLM",
    },
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "use_npu_fused_attention": True,
}


def write_npu_branch_model(directory: Path, modeling: str = MODELING) -> Path:
    """Write the tiny model with an NPU branch into DIRECTORY; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "configuration_tiny_npu.py").write_text(CONFIGURATION, encoding="utf-8")
    (directory / "modeling_tiny_npu.py").write_text(modeling, encoding="utf-8")
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2), encoding="utf-8")
    return directory
