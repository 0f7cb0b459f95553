"""The framework codemods on small before/after strings (no model is built or run)."""

from __future__ import annotations

import textwrap

import pytest
from conftest import FAMILIES
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.imports import AbsoluteImportsCommand
from kvskill.implementer.masks import SkipDenseMasksCommand
from kvskill.implementer.pipeline import convert_source, parse
from kvskill.implementer.spec import ConversionSpec, FaVersion, WindowRule
from libcst.codemod import CodemodContext
from remote_model import MODELING

FULL = ConversionSpec(
    fa_version=FaVersion.V1,
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)
MIXED_SINKS = ConversionSpec(
    fa_version=FaVersion.V2,
    input_layout="TND",
    uniform_attn_type=None,
    layer_type_to_attn_type={
        "full_attention": "FullAttention",
        "sliding_attention": "SlidingWindow",
    },
    sparse_mode={
        "FullAttention": {"prefill": 3, "decode": 3},
        "SlidingWindow": {"prefill": 4, "decode": 4},
    },
    windows={"SlidingWindow": WindowRule(pre_offset=-1, next_tokens=0)},
    has_sinks=True,
)

# A transformers-5-style model reduced to what the codemods look at.
MINI = textwrap.dedent(
    """\
    import torch
    from torch import nn

    from ...masking_utils import create_causal_mask
    from ...modeling_utils import ALL_ATTENTION_FUNCTIONS
    from .configuration_mini import MiniConfig


    def helper(x):
        # a comment in an untouched function
        return x  # trailing comment


    class MiniAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            self.head_dim = config.head_dim
            self.scaling = self.head_dim**-0.5
            self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads))

        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
            query_states, key_states, value_states = self.qkv(hidden_states)

            if cache is not None:
                key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface("eager", None)
            attn_output, attn_weights = attention_interface(
                self, query_states, key_states, value_states, attention_mask, scaling=self.scaling, s_aux=self.sinks
            )
            return self.o_proj(attn_output.reshape(1, -1, 8)), attn_weights


    class MiniModel(nn.Module):
        def forward(self, inputs_embeds, cache=None):
            mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, cache=cache)
            return self.layers(inputs_embeds, mask)


    class MiniForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = MiniModel(config)
            self.lm_head = nn.Linear(8, 8)
            self.post_init()
    """
)


def run(command, source: str, *args) -> str:
    module = parse(source)
    return command(CodemodContext(), FULL, *args).transform_module(module).code


def test_relative_imports_of_transformers_become_absolute():
    before = "from ...activations import ACT2FN\nfrom . import configuration_x\nfrom .configuration_x import XConfig\nimport torch\n"
    after = (
        "from transformers.activations import ACT2FN\n"
        "from transformers.models.x import configuration_x\n"
        "from transformers.models.x.configuration_x import XConfig\n"
        "import torch\n"
    )
    assert run(AbsoluteImportsCommand, before, "transformers.models.x") == after
    # a model directory keeps its relative imports (the files are copied next to it)
    assert run(AbsoluteImportsCommand, before, None) == before


def test_mask_builders_are_guarded_directly_and_through_aliases():
    before = textwrap.dedent(
        """\
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask as sliding


        def forward(self, x, windowed):
            mask_function = create_causal_mask if not windowed else sliding
            # build the mask
            mask = mask_function(config=self.config, inputs_embeds=x)
            other = sliding(x)
            return unrelated(x)
        """
    )
    out = run(SkipDenseMasksCommand, before)
    assert (
        "mask = (None if _in_paged_runtime() else mask_function(config=self.config, inputs_embeds=x))"
        in out
    )
    assert "other = (None if _in_paged_runtime() else sliding(x))" in out
    assert "return unrelated(x)" in out
    assert "    # build the mask\n" in out
    assert "def _in_paged_runtime() -> bool:" in out
    # already guarded: unchanged
    assert run(SkipDenseMasksCommand, out) == out


def test_file_without_mask_builders_is_unchanged():
    source = "import torch\n\n\ndef f(x):\n    return torch.ones(x)  # note\n"
    assert run(SkipDenseMasksCommand, source) == source


def test_attention_seam_is_replaced_and_everything_else_kept():
    out = convert_source(MINI, FULL, package="transformers.models.mini")
    # untouched code and its comments are byte-identical
    assert (
        "def helper(x):\n    # a comment in an untouched function\n    return x  # trailing comment\n"
        in out
    )
    assert "        query_states, key_states, value_states = self.qkv(hidden_states)\n" in out
    assert "return self.o_proj(attn_output.reshape(1, -1, 8)), attn_weights" in out
    # the cache write and the kernel call are gone, the paged seam is in
    assert "cache.update(" not in out and "attention_interface(" not in out
    assert "self.update_cache(md.slot_mapping[self.attn_type], key_tnd, value_tnd)" in out
    assert "attn_output, _ = torch_npu.npu_fused_infer_attention_score(\n" in out
    for keyword in (
        "num_heads=self.num_heads_per_rank,",
        "scale=self.scaling,",
        "sparse_mode=3,",
        "block_table=md.block_table[self.attn_type],",
        "actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),",
        "actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),",
    ):
        assert keyword in out
    assert "attn_output = attn_output.unsqueeze(0)" in out and "attn_weights = None" in out
    # __init__ declares the caches, the model class reports them
    assert 'self.attn_type = "FullAttention"' in out
    assert (
        "self.num_key_value_heads_per_rank = max(config.num_key_value_heads // self.attn_tp_size, 1)"
        in out
    )
    assert "tensor_setter=self.set_k_cache," in out and "def set_v_cache(self, tensor" in out
    assert out.index("self.lm_head = nn.Linear(8, 8)\n        self.block_size = 128") > 0
    assert "def get_cache_info(self) -> ModelCacheInfo:" in out
    assert (
        "from kvskill.runtime import CacheEntry, LayerCacheInfo, ModelCacheInfo, get_forward_metadata"
        in out
    )
    assert "from kvskill.runtime.ops import torch_npu" in out
    assert "from transformers.models.mini.configuration_mini import MiniConfig" in out


def test_v2_with_sinks_and_mixed_layers_uses_v2_names_and_per_layer_types():
    out = convert_source(MINI, MIXED_SINKS, package="transformers.models.mini")
    assert "torch_npu.npu_fused_infer_attention_score_v2(" in out
    for keyword in (
        "num_query_heads=self.num_heads_per_rank,",
        "softmax_scale=self.scaling,",
        'sparse_mode=3 if self.attn_type == "FullAttention" else 4,',
        "pre_tokens=self.pre_tokens,",
        "next_tokens=self.next_tokens,",
        "actual_seq_qlen=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),",
        "actual_seq_kvlen=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),",
        "learnable_sink=self.sinks,",
    ):
        assert keyword in out
    assert "scale=self.scaling" not in out.replace("softmax_scale=self.scaling", "")
    assert (
        'self.attn_type = "FullAttention" if config.layer_types[layer_idx] == "full_attention" '
        'else "SlidingWindow"'
    ) in out
    assert (
        'self.pre_tokens = 2147483647 if self.attn_type == "FullAttention" else config.sliding_window - 1'
        in out
    )
    assert "self.next_tokens = 0\n" in out


def test_sdpa_through_an_aliased_import_is_recognised():
    out = convert_source(MODELING, FULL, package=None)
    assert "F.scaled_dot_product_attention(" not in out
    assert "scale=self.softmax_scale," in out
    # sdpa returns [B, N, S, D]: the seam hands the same layout back
    assert "attn_output = attn_output.unsqueeze(0).transpose(1, 2)" in out
    assert "from .configuration_tiny_remote import TinyRemoteConfig" in out


@pytest.mark.parametrize("spec", [FULL, MIXED_SINKS], ids=["v1", "v2-mixed"])
def test_converting_converted_code_changes_nothing(spec):
    once = convert_source(MINI, spec, package="transformers.models.mini")
    assert convert_source(once, spec, package="transformers.models.mini") == once


@pytest.mark.parametrize("family", FAMILIES)
def test_every_converted_family_is_a_fixed_point(converted, family):
    import json

    from kvskill.analyzer import Plan

    directory = converted.directory(family)
    record = json.loads((directory / "kvskill_plan.json").read_text())
    spec = ConversionSpec.from_plan(Plan.from_dict(record))
    code = (directory / record["conversion"]["modeling_file"]).read_text()
    assert code != record["conversion"]["original_source"]
    assert convert_source(code, spec, package=record["conversion"]["package"]) == code


def test_no_attention_class_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="no attention class"):
        convert_source("class A:\n    pass\n", FULL)


def test_mixed_layers_need_a_layer_index():
    source = MINI.replace("def __init__(self, config, layer_idx):", "def __init__(self, config):")
    with pytest.raises(UnsupportedModelError, match="takes no layer index"):
        convert_source(source, MIXED_SINKS)


def test_sinks_in_the_plan_must_reach_the_kernel():
    source = MINI.replace(", s_aux=self.sinks", "")
    with pytest.raises(UnsupportedModelError, match="passes no sinks"):
        convert_source(source, MIXED_SINKS)


def test_syntax_error_is_bad_input():
    with pytest.raises(BadInputError, match="cannot parse"):
        convert_source("def broken(:\n", FULL, filename="modeling_x.py")
