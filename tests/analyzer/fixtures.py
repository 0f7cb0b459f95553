"""Model directories written by tests: remote code in transformers 4 style, runners, configs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

REMOTE_CONFIG = {
    "model_type": "tiny_remote",
    "architectures": ["TinyForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
    },
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "torch_dtype": "float16",
}

#: A transformers-4 style modeling file. Importing it would create SIDE_EFFECT next to it.
REMOTE_MODELING = textwrap.dedent(
    '''
    """Tiny model in transformers 4 style (remote code)."""
    import pathlib

    import torch
    from torch import nn
    from transformers.cache_utils import Cache

    from .configuration_tiny import TinyConfig

    pathlib.Path(__file__).with_name("SIDE_EFFECT").write_text("imported")


    class TinyAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            self.head_dim = config.hidden_size // config.num_attention_heads
            self.scaling = self.head_dim ** -0.5
            self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)

        def forward(self, hidden_states, attention_mask=None, past_key_value=None, **kwargs):
            query_states, key_states, value_states = self.project(hidden_states)
            if past_key_value is not None:
                cache_kwargs = {"cache_position": kwargs.get("cache_position")}
                cache_kwargs.update({"extra": None})
                key_states, value_states = past_key_value.update(
                    key_states, value_states, self.layer_idx, cache_kwargs
                )
            attn_output = torch.nn.functional.scaled_dot_product_attention(
                query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling
            )
            return attn_output, None, past_key_value


    ATTENTION_CLASSES = {"eager": TinyAttention, "sdpa": TinyAttention}


    class TinyDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.self_attn = ATTENTION_CLASSES[config._attn_implementation](config, layer_idx)


    class TinyPreTrainedModel(nn.Module):
        pass


    class TinyModel(TinyPreTrainedModel):
        def __init__(self, config):
            super().__init__()
            self.layers = nn.ModuleList(
                [TinyDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
            )


    class TinyForCausalLM(TinyPreTrainedModel):
        def __init__(self, config):
            super().__init__()
            self.model = TinyModel(config)
    '''
)

REMOTE_CONFIGURATION = textwrap.dedent(
    """
    import pathlib

    pathlib.Path(__file__).with_name("SIDE_EFFECT_CONFIG").write_text("imported")


    class TinyConfig:
        model_type = "tiny_remote"
    """
)


def write_remote_model(root: Path, modeling: str = REMOTE_MODELING, **config) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**REMOTE_CONFIG, **config}), encoding="utf-8")
    (root / "modeling_tiny.py").write_text(modeling, encoding="utf-8")
    (root / "configuration_tiny.py").write_text(REMOTE_CONFIGURATION, encoding="utf-8")
    return root


def write_checkpoint(root: Path, config: dict) -> Path:
    """A directory as transformers saves a checkpoint: config.json (weights not needed)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return root
