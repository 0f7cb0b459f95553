"""Lint against the executor's own model shapes (hicann/cann-recipes-infer at fbc225d).

The fixtures are written here in the shapes the executor's correct Paged models use (reads
in helper methods, a forward that dispatches to one method per phase, per-entry block sizes,
keyword-only Mamba entries); they must lint clean, and one contract mistake each must be
found. With ``KVSKILL_CANN_RECIPES=<checkout>`` the real model files are linted too.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from kvskill.analyzer.lint import FileContext, lint_paths, lint_source
from kvskill.analyzer.lint.fa import Phase, fa_calls, phase_of

HEADER = """\
import math

import torch
import torch_npu
from torch import nn
from executor.core.kv_cache.cache_info import (
    CacheEntry, LayerCacheInfo, MambaCacheEntry, ModelCacheInfo,
)

"""

# GQA with the cache write and the cached read in helpers: the forward calls exec_qkv, which
# reads the caches kv_cache_update hands back.
QWEN3_MOE = HEADER + textwrap.dedent(
    """\
    class MoeAttention(nn.Module):
        def __init__(self, config, infer_config, attn_tp_size=1):
            super().__init__()
            self.attn_type = "FullAttention"
            self.head_dim = config.head_dim
            self.num_heads_per_rank = config.num_attention_heads // attn_tp_size
            self.num_key_value_heads_per_rank = max(config.num_key_value_heads // attn_tp_size, 1)
            self.block_size = infer_config.scheduler_config.block_size
            self.scale_fa = 1 / (self.head_dim ** 0.5)
            self.k_cache = torch.Tensor([])
            self.v_cache = torch.Tensor([])
            self.cache_entries = [
                CacheEntry(
                    cache_name="k_cache", attn_type=self.attn_type, dim=self.head_dim,
                    num_head=self.num_key_value_heads_per_rank, dtype=config.torch_dtype,
                    needs_block=True, block_size=self.block_size,
                    tensor_setter=lambda t, layer=self: setattr(layer, "k_cache", t),
                ),
                CacheEntry(
                    cache_name="v_cache", attn_type=self.attn_type, dim=self.head_dim,
                    num_head=self.num_key_value_heads_per_rank, dtype=config.torch_dtype,
                    needs_block=True, block_size=self.block_size,
                    tensor_setter=lambda t, layer=self: setattr(layer, "v_cache", t),
                ),
            ]

        def kv_cache_update(self, slot_mapping, key_states, value_states):
            k_cache, v_cache = self.k_cache, self.v_cache
            slots = slot_mapping.view(-1, 1)
            nkv, d = self.num_key_value_heads_per_rank, self.head_dim
            torch_npu.npu_scatter_nd_update_(k_cache.view(-1, nkv, d), slots, key_states)
            torch_npu.npu_scatter_nd_update_(v_cache.view(-1, nkv, d), slots, value_states)
            return k_cache, v_cache

        def exec_qkv(self, query, key, value, forward_metadata, slot_mapping, block_table):
            common = dict(
                num_query_heads=self.num_heads_per_rank,
                num_key_value_heads=self.num_key_value_heads_per_rank,
                softmax_scale=self.scale_fa,
                input_layout="TND",
                sparse_mode=3,
                atten_mask=forward_metadata.attention_mask,
                actual_seq_qlen=forward_metadata.actual_seq_lengths_cu_q,
            )
            if forward_metadata.is_prefill:
                out, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(
                    query, key, value,
                    actual_seq_kvlen=forward_metadata.actual_seq_lengths_cu_kv, **common)
                self.kv_cache_update(slot_mapping, key, value)
            else:
                k_cache, v_cache = self.kv_cache_update(slot_mapping, key, value)
                out, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(
                    query,
                    k_cache.view(*k_cache.shape[:2], -1),
                    v_cache.view(*v_cache.shape[:2], -1),
                    actual_seq_kvlen=forward_metadata.actual_seq_lengths_kv,
                    block_table=block_table,
                    block_size=self.block_size,
                    **common,
                )
            return out

        def forward(self, query, key, value, forward_metadata, slot_mapping, block_table):
            return self.exec_qkv(
                query, key, value, forward_metadata,
                slot_mapping=slot_mapping[self.attn_type],
                block_table=block_table[self.attn_type],
            )


    class MoeForCausalLM(nn.Module):
        def get_cache_info(self) -> ModelCacheInfo:
            layer_infos = []
            for layer_idx, layer in enumerate(self.model.layers):
                layer_infos.append(
                    LayerCacheInfo(layer_idx=layer_idx, caches=list(layer.self_attn.cache_entries))
                )
            return ModelCacheInfo(num_layers=len(layer_infos), layer_infos=layer_infos)
    """
)

# Sliding window + learnable sinks: prefill attends over this step's keys, then writes;
# decode writes, then reads the paged cache.
GPT_OSS = HEADER + textwrap.dedent(
    """\
    class SinkAttention(nn.Module):
        def __init__(self, config, infer_config, layer_idx):
            super().__init__()
            sliding = config.layer_types[layer_idx] == "sliding_attention"
            self.sliding_window = config.sliding_window if sliding else None
            self.attn_type = "SlidingWindow" if self.sliding_window is not None else "FullAttention"
            self.head_dim = config.head_dim
            self.num_heads = config.num_attention_heads
            self.num_key_value_heads_per_rank = config.num_key_value_heads
            self.block_size = infer_config.scheduler_config.block_size
            self.scaling = self.head_dim ** -0.5
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
            self.k_cache = torch.Tensor([])
            self.v_cache = torch.Tensor([])
            self.cache_entries = [
                CacheEntry(
                    cache_name="k_cache", attn_type=self.attn_type, dim=self.head_dim,
                    num_head=self.num_key_value_heads_per_rank, dtype=config.torch_dtype,
                    needs_block=True, block_size=self.block_size,
                    tensor_setter=lambda t, layer=self: setattr(layer, "k_cache", t),
                    sliding_window=self.sliding_window,
                ),
                CacheEntry(
                    cache_name="v_cache", attn_type=self.attn_type, dim=self.head_dim,
                    num_head=self.num_key_value_heads_per_rank, dtype=config.torch_dtype,
                    needs_block=True, block_size=self.block_size,
                    tensor_setter=lambda t, layer=self: setattr(layer, "v_cache", t),
                    sliding_window=self.sliding_window,
                ),
            ]

        def update_cache(self, slot_mapping, key_states, value_states):
            slots = slot_mapping[self.attn_type].view(-1, 1)
            nkv, d = self.num_key_value_heads_per_rank, self.head_dim
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, nkv, d), slots, key_states)
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, nkv, d), slots, value_states)

        def forward(self, query, key, value, forward_metadata, slot_mapping, block_table):
            window = dict(
                num_query_heads=self.num_heads,
                num_key_value_heads=self.num_key_value_heads_per_rank,
                input_layout="TND",
                softmax_scale=self.scaling,
                sparse_mode=4 if self.sliding_window else 3,
                pre_tokens=self.sliding_window - 1 if self.sliding_window else 2147483647,
                next_tokens=0,
                atten_mask=forward_metadata.attention_mask,
                learnable_sink=self.sinks,
                actual_seq_qlen=forward_metadata.actual_seq_lengths_cu_q,
            )
            if forward_metadata.is_prefill:
                out, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(
                    query, key, value,
                    actual_seq_kvlen=forward_metadata.actual_seq_lengths_cu_q, **window)
                self.update_cache(slot_mapping, key, value)
            else:
                self.update_cache(slot_mapping, key, value)
                out, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(
                    query,
                    self.k_cache.view(*self.k_cache.shape[:2], -1),
                    self.v_cache.view(*self.v_cache.shape[:2], -1),
                    actual_seq_kvlen=forward_metadata.actual_seq_lengths_kv,
                    block_table=block_table[self.attn_type],
                    block_size=self.block_size,
                    **window,
                )
            return out
    """
)

# MLA: the forward picks one method per phase (fn = self.<path>), the latent is written by
# the _v2 norm-rope-cache operator, multi-token (MTP) decode keeps mode 3, YaRN mscale².
DEEPSEEK = HEADER + textwrap.dedent(
    """\
    class MlaAttention(nn.Module):
        def __init__(self, config, infer_config):
            super().__init__()
            self.attn_type = "FullAttention"
            self.num_heads_per_rank = config.num_attention_heads
            self.kv_lora_rank = config.kv_lora_rank
            self.softmax_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
            mscale_all_dim = config.rope_scaling.get("mscale_all_dim", 0)
            if mscale_all_dim:
                mscale = 0.1 * mscale_all_dim * math.log(config.rope_scaling["factor"]) + 1.0
                self.softmax_scale = self.softmax_scale * mscale * mscale
            self.block_size = infer_config.scheduler_config.block_size
            self.nope_cache = torch.Tensor([])
            self.rope_cache = torch.Tensor([])
            self.cache_entries = [
                CacheEntry(
                    cache_name="nope_cache", attn_type=self.attn_type, dim=config.kv_lora_rank,
                    num_head=1, dtype=config.torch_dtype, block_size=self.block_size,
                    needs_block=True,
                    tensor_setter=lambda t, layer=self: setattr(layer, "nope_cache", t),
                ),
                CacheEntry(
                    cache_name="rope_cache", attn_type=self.attn_type,
                    dim=config.qk_rope_head_dim, num_head=1, dtype=config.torch_dtype,
                    block_size=self.block_size, needs_block=True,
                    tensor_setter=lambda t, layer=self: setattr(layer, "rope_cache", t),
                ),
            ]

        def write_latent(self, latent, norm_weight, cos, sin, slot_mapping):
            return torch_npu.npu_kv_rmsnorm_rope_cache_v2(
                latent, norm_weight, cos, sin, slot_mapping, self.rope_cache, self.nope_cache,
                cache_mode="PA_NZ", is_output_kv=True)

        def forward_normal(self, q_nope, q_pe, latent, cos, sin, slot_mapping, block_table,
                           attention_mask, actual_seq_lengths_kv, actual_seq_lengths_q):
            k_rope, k_nope = self.write_latent(latent, self.norm_weight, cos, sin, slot_mapping)
            k_up = torch.matmul(k_nope, self.w_uk)
            v_up = torch.matmul(k_nope, self.w_uv)
            out, _ = torch.ops.npu.npu_fused_infer_attention_score(
                q_nope, k_up, v_up, query_rope=q_pe, key_rope=k_rope,
                num_heads=self.num_heads_per_rank, num_key_value_heads=self.num_heads_per_rank,
                input_layout="NTD_TND", scale=self.softmax_scale,
                atten_mask=attention_mask, sparse_mode=3,
                actual_seq_lengths=actual_seq_lengths_q,
                actual_seq_lengths_kv=actual_seq_lengths_kv)
            return out

        def forward_absorb(self, q_nope, q_pe, latent, cos, sin, slot_mapping, block_table,
                           attention_mask, actual_seq_lengths_kv, actual_seq_lengths_q):
            self.write_latent(latent, self.norm_weight, cos, sin, slot_mapping)
            k_rope, k_nope = self.rope_cache, self.nope_cache
            q_len = q_nope.shape[0] // len(actual_seq_lengths_kv)
            if q_len > 1:  # MTP: several query tokens per request stay causal
                sparse_mode = 3
            else:
                sparse_mode = 0
                attention_mask = None
            out, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(
                q_nope, k_nope, k_nope, query_rope=q_pe, key_rope=k_rope,
                num_query_heads=self.num_heads_per_rank, num_key_value_heads=1,
                softmax_scale=self.softmax_scale, input_layout="TND_NTD",
                atten_mask=attention_mask, sparse_mode=sparse_mode,
                block_table=block_table, block_size=self.block_size,
                actual_seq_qlen=actual_seq_lengths_q, actual_seq_kvlen=actual_seq_lengths_kv)
            return out

        def forward(self, is_prefill, slot_mapping, block_table, **kwargs):
            kwargs["slot_mapping"] = slot_mapping[self.attn_type]
            kwargs["block_table"] = block_table[self.attn_type]
            if is_prefill:
                fn = self.forward_normal
            else:
                fn = self.forward_absorb
            return fn(**kwargs)


    class MlaForCausalLM(nn.Module):
        def get_cache_info(self) -> ModelCacheInfo:
            layer_infos = [
                LayerCacheInfo(layer_idx=i, caches=list(layer.self_attn.cache_entries))
                for i, layer in enumerate(self.model.layers)
            ]
            return ModelCacheInfo(
                num_layers=len(layer_infos), layer_infos=layer_infos, is_mla_backend=True
            )
    """
)

# A gated delta layer's recurrent states: keyword-only entries with list shapes.
GATED_DELTA = HEADER + textwrap.dedent(
    """\
    class GatedDeltaNet(nn.Module):
        def __init__(self, config, attn_tp_size=1):
            super().__init__()
            heads = config.linear_num_value_heads // attn_tp_size
            self.conv_state = torch.Tensor([])
            self.ssm_state = torch.Tensor([])
            self.cache_entries = [
                MambaCacheEntry(
                    cache_name="conv_state", dtype=config.torch_dtype, needs_block=True,
                    shape=[config.conv_dim // attn_tp_size, config.linear_conv_kernel_dim - 1],
                    tensor_setter=lambda t, layer=self: setattr(layer, "conv_state", t),
                ),
                MambaCacheEntry(
                    cache_name="ssm_state", dtype=torch.float32, needs_block=True,
                    shape=[heads, config.linear_key_head_dim, config.linear_value_head_dim],
                    tensor_setter=lambda t, layer=self: setattr(layer, "ssm_state", t),
                ),
            ]
    """
)

SHAPES = {"qwen3_moe": QWEN3_MOE, "gpt_oss": GPT_OSS, "deepseek": DEEPSEEK, "gdn": GATED_DELTA}


@pytest.mark.parametrize("name", SHAPES)
def test_the_executors_model_shapes_lint_clean(name):
    assert lint_source(SHAPES[name]) == []


@pytest.mark.parametrize(
    ("name", "before", "after", "rule"),
    [
        # the skill text's ModelCacheInfo: a TypeError in the executor
        (
            "qwen3_moe",
            "layer_infos=layer_infos)",
            "block_size=128, layer_infos=layer_infos)",
            "KV012",
        ),
        ("qwen3_moe", "needs_block=True,", "", "KV014"),
        ("gpt_oss", "block_size=self.block_size,\n", "\n", "KV014"),
        (
            "gdn",
            "shape=[heads, config.linear_key_head_dim, config.linear_value_head_dim]",
            "shape=(heads, config.linear_key_head_dim, config.linear_value_head_dim)",
            "KV014",
        ),
        (
            "gdn",
            'cache_name="ssm_state", dtype=torch.float32',
            '"ssm_state", torch.float32',
            "KV014",
        ),
        # the helper no longer hands back the caches: decode attends to this step's keys only
        (
            "qwen3_moe",
            "k_cache.view(*k_cache.shape[:2], -1),\n                v_cache.view(*v_cache.shape[:2], -1),",
            "key, value,",
            "KV013",
        ),
        # the latent is never written (the only write sits in a helper)
        (
            "deepseek",
            "torch_npu.npu_kv_rmsnorm_rope_cache_v2(",
            "torch_npu.npu_kv_rmsnorm_rope(",
            "KV013",
        ),
        ("deepseek", "            sparse_mode = 0\n", "            sparse_mode = 3\n", "KV011"),
    ],
)
def test_one_contract_mistake_in_an_executor_shape_is_found(name, before, after, rule):
    source = SHAPES[name]
    assert before in source
    found = lint_source(source.replace(before, after, 1))
    assert {f.rule for f in found} == {rule}, found


def test_a_helper_called_through_an_attribute_counts():
    # the executor's Kimi attention sets self.attn_func = self.<method> in __init__
    through_attr = QWEN3_MOE.replace("return self.exec_qkv(", "return self.attn_func(")
    assert lint_source(through_attr) != []  # an unknown callee touches nothing
    bound = through_attr.replace(
        "        self.k_cache = torch.Tensor([])\n",
        "        self.attn_func = self.exec_qkv\n        self.k_cache = torch.Tensor([])\n",
        1,
    )
    assert bound != through_attr
    assert lint_source(bound) == []


def test_a_method_the_forward_picks_under_a_phase_runs_in_that_phase():
    ctx = FileContext(DEEPSEEK)
    phases = [phase_of(ctx, call.node) for call in fa_calls(ctx)]
    assert phases == [Phase.PREFILL, Phase.DECODE]


# A Legacy-style dense model whose rotary class can read mscale_all_dim (YaRN) but whose
# attention scale is a plain inverse square root, as the executor's pangu_7b.
YARN_READER = textwrap.dedent(
    """\
    import torch_npu


    class Rotary:
        def __init__(self, dim, scaling_factor=1.0, mscale=1, mscale_all_dim=0):
            self.mscale_all_dim = mscale_all_dim


    class Attention:
        def __init__(self, config):
            self.scale_fa = 1 / (config.head_dim ** 0.5)

        def forward(self, q, k, v, mask):
            return torch_npu.npu_fused_infer_attention_score(
                q, k, v, num_heads=8, input_layout="BSH", scale=self.scale_fa,
                atten_mask=mask, sparse_mode=3)
    """
)
CONFIG_CLASS = textwrap.dedent(
    """\
    from transformers import PretrainedConfig


    class DenseConfig(PretrainedConfig):
        model_type = "dense"

        def __init__(self, hidden_size=4096, rope_theta=1e6, rope_scaling={ROPE}, **kwargs):
            self.rope_scaling = rope_scaling
            super().__init__(**kwargs)
    """
)


@pytest.mark.parametrize(
    ("config_class_rope", "config_json", "expected"),
    [
        (None, None, ["KV010"]),  # nothing beside the file: the code reads it, so ask
        ("None", None, []),  # the class ships rope_scaling=None
        ('{"type": "yarn", "factor": 4.0, "mscale_all_dim": 0}', None, []),
        ('{"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}', None, ["KV010"]),
        # a checkpoint's config.json wins over the class default
        ("None", {"rope_scaling": {"type": "yarn", "factor": 4, "mscale_all_dim": 1}}, ["KV010"]),
        (None, {"rope_scaling": None}, []),
        # the class default is an expression and config.json says nothing: the code decides
        ("dict(type='yarn')", {"hidden_size": 8}, ["KV010"]),
    ],
)
def test_yarn_mscale_reads_the_config_the_model_ships(
    tmp_path, config_class_rope, config_json, expected
):
    (tmp_path / "modeling_dense.py").write_text(YARN_READER, encoding="utf-8")
    if config_class_rope is not None:
        text = CONFIG_CLASS.replace("{ROPE}", config_class_rope)
        (tmp_path / "configuration_dense.py").write_text(text, encoding="utf-8")
    if config_json is not None:
        (tmp_path / "config.json").write_text(json.dumps(config_json), encoding="utf-8")
    report = lint_paths([tmp_path / "modeling_dense.py"])
    assert [f.rule for f in report.findings] == expected
    assert report.errors == []


CHECKOUT = os.environ.get("KVSKILL_CANN_RECIPES")
PAGED_MODELS = [
    "models/qwen3_moe/models/modeling_qwen3_moe.py",
    "models/gpt_oss/models/modeling_gpt_oss.py",
    "models/deepseek_r1/models/modeling_deepseek.py",
]
LEGACY_YARN = "models/pangu_7b/models/modeling_openpangu_dense.py"


@pytest.mark.skipif(not CHECKOUT, reason="set KVSKILL_CANN_RECIPES=<cann-recipes-infer checkout>")
@pytest.mark.parametrize("relative", PAGED_MODELS)
def test_the_executors_paged_models_lint_clean(relative):
    path = Path(CHECKOUT) / relative
    report = lint_paths([path])
    assert report.files == 1 and report.errors == [], report.errors
    assert report.findings == [], [f"{f.rule} {f.line}: {f.message}" for f in report.findings]


@pytest.mark.skipif(not CHECKOUT, reason="set KVSKILL_CANN_RECIPES=<cann-recipes-infer checkout>")
def test_the_executors_legacy_pangu_gets_no_yarn_finding():
    report = lint_paths([Path(CHECKOUT) / LEGACY_YARN])
    assert report.errors == []
    assert [f for f in report.findings if f.rule == "KV010"] == []
