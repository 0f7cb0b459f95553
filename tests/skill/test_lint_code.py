"""Lint on whole files: converted model code lints clean, the operator is recognised
however it is reached, and findings point at the right line."""

from __future__ import annotations

import textwrap

import pytest
from kvskill.analyzer.lint import lint_source

# A converted GQA / sliding-window attention and model in framework mode, written the way
# the converted code calls the runtime (the FA call at the seam after RoPE).
CONVERTED_GQA = textwrap.dedent(
    """\
    import torch
    from torch import nn
    from kvskill.runtime import CacheEntry, LayerCacheInfo, ModelCacheInfo, get_forward_metadata
    from kvskill.runtime.ops import torch_npu


    class Attention(nn.Module):
        def __init__(self, config, layer_idx, block_size=128, attn_tp_size=1):
            super().__init__()
            self.block_size = block_size
            self.head_dim = config.head_dim
            self.num_heads = config.num_attention_heads
            self.num_key_value_heads_per_rank = max(config.num_key_value_heads // attn_tp_size, 1)
            self.scaling = self.head_dim**-0.5
            sliding = config.layer_types[layer_idx] == "sliding_attention"
            self.sliding_window = config.sliding_window if sliding else None
            self.attn_type = "SlidingWindow" if sliding else "FullAttention"
            # pre_tokens = W - 1 admits W keys including the diagonal (band mode 4)
            self.sparse_mode = 4 if sliding else 3
            self.pre_tokens = config.sliding_window - 1 if sliding else 2147483647
            self.k_cache = torch.Tensor([])
            self.v_cache = torch.Tensor([])
            self.cache_entries = [
                CacheEntry(
                    cache_name="k_cache",
                    attn_type=self.attn_type,
                    dim=self.head_dim,
                    num_head=self.num_key_value_heads_per_rank,
                    dtype=torch.float32,
                    needs_block=True,
                    block_size=self.block_size,
                    tensor_setter=self._set_k,
                    sliding_window=self.sliding_window,
                ),
                CacheEntry(
                    cache_name="v_cache",
                    attn_type=self.attn_type,
                    dim=self.head_dim,
                    num_head=self.num_key_value_heads_per_rank,
                    dtype=torch.float32,
                    needs_block=True,
                    block_size=self.block_size,
                    tensor_setter=self._set_v,
                    sliding_window=self.sliding_window,
                ),
            ]

        def _set_k(self, tensor):
            self.k_cache = tensor

        def _set_v(self, tensor):
            self.v_cache = tensor

        def forward(self, hidden_states, query_states, key_states, value_states):
            md = get_forward_metadata()
            n, nkv, d = self.num_heads, self.num_key_value_heads_per_rank, self.head_dim
            q = query_states.transpose(1, 2).reshape(-1, n, d)
            k = key_states.transpose(1, 2).reshape(-1, nkv, d)
            v = value_states.transpose(1, 2).reshape(-1, nkv, d)
            slots = md.slot_mapping[self.attn_type]
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, nkv, d), slots.view(-1, 1), k)
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, nkv, d), slots.view(-1, 1), v)
            nb, bs = self.k_cache.shape[:2]
            attn, _ = torch_npu.npu_fused_infer_attention_score(
                q,
                self.k_cache.view(nb, bs, -1),
                self.v_cache.view(nb, bs, -1),
                num_heads=n,
                num_key_value_heads=nkv,
                input_layout="TND",
                scale=self.scaling,
                atten_mask=md.attention_mask,
                sparse_mode=self.sparse_mode,
                pre_tokens=self.pre_tokens,
                next_tokens=0,
                block_table=md.block_table[self.attn_type],
                block_size=bs,
                actual_seq_lengths=md.actual_seq_lengths_cu_q,
                actual_seq_lengths_kv=md.actual_seq_lengths_kv,
            )
            return attn.reshape(1, md.num_tokens, n * d)


    class ForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList()

        def get_cache_info(self):
            layer_infos = [
                LayerCacheInfo(layer_idx=i, caches=list(layer.self_attn.cache_entries))
                for i, layer in enumerate(self.model.layers)
            ]
            return ModelCacheInfo(num_layers=len(layer_infos), layer_infos=layer_infos)
    """
)

# MLA absorb with FA v2 and YaRN mscale: prefill 3 + mask, decode 0 + None.
CONVERTED_MLA = textwrap.dedent(
    """\
    import math

    import torch
    from torch import nn
    from kvskill.runtime import CacheEntry, LayerCacheInfo, ModelCacheInfo, get_forward_metadata
    from kvskill.runtime.ops import torch_npu


    def yarn_mscale(factor, mscale_all_dim):
        return 0.1 * mscale_all_dim * math.log(factor) + 1.0


    class MlaAttention(nn.Module):
        def __init__(self, config, infer_config):
            super().__init__()
            self.attn_type = "FullAttention"
            self.block_size = infer_config.scheduler_config.block_size
            self.num_heads = config.num_attention_heads
            self.scaling = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
            rope = config.rope_parameters
            if rope.get("mscale_all_dim"):
                mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
                self.scaling = self.scaling * mscale * mscale
            self.nope_cache = torch.Tensor([])
            self.rope_cache = torch.Tensor([])
            self.cache_entries = [
                CacheEntry("nope_cache", "FullAttention", config.kv_lora_rank, 1,
                           torch.bfloat16, True, self.block_size, tensor_setter=self._set_nope),
                CacheEntry("rope_cache", "FullAttention", config.qk_rope_head_dim, 1,
                           torch.bfloat16, True, self.block_size, tensor_setter=self._set_rope),
            ]

        def _set_nope(self, tensor):
            self.nope_cache = tensor

        def _set_rope(self, tensor):
            self.rope_cache = tensor

        def forward(self, q_nope, q_pe, latent, k_pe):
            md = get_forward_metadata()
            nb, bs = self.nope_cache.shape[:2]
            slots = md.slot_mapping[self.attn_type].view(-1, 1)
            torch_npu.npu_scatter_nd_update_(self.nope_cache.view(nb * bs, 1, -1), slots, latent)
            torch_npu.npu_scatter_nd_update_(self.rope_cache.view(nb * bs, 1, -1), slots, k_pe)
            if md.is_prefill:
                sparse_mode = 3
                mask = md.attention_mask
            else:
                sparse_mode = 0
                mask = None
            out, _ = torch_npu.npu_fused_infer_attention_score_v2(
                q_nope,
                self.nope_cache.view(nb, bs, -1),
                self.nope_cache.view(nb, bs, -1),
                query_rope=q_pe,
                key_rope=self.rope_cache.view(nb, bs, -1),
                num_query_heads=self.num_heads,
                num_key_value_heads=1,
                softmax_scale=self.scaling,
                input_layout="TND_NTD",
                atten_mask=mask,
                sparse_mode=sparse_mode,
                block_table=md.block_table[self.attn_type],
                block_size=bs,
                actual_seq_qlen=md.actual_seq_lengths_cu_q,
                actual_seq_kvlen=md.actual_seq_lengths_kv,
            )
            return out


    class ForCausalLM(nn.Module):
        def get_cache_info(self):
            layer_infos = []
            for idx, layer in enumerate(self.model.layers):
                layer_infos.append(
                    LayerCacheInfo(layer_idx=idx, caches=list(layer.self_attn.cache_entries))
                )
            return ModelCacheInfo(
                num_layers=len(layer_infos), layer_infos=layer_infos, is_mla_backend=True
            )
    """
)

# Standalone mode: the runner owns kv_len, block_table and the caches.
STANDALONE = textwrap.dedent(
    """\
    import torch
    from torch import nn
    import torch_npu


    class Attention(nn.Module):
        def forward(self, q, k, v, k_cache, v_cache, block_table, slots, md):
            torch_npu.npu_scatter_nd_update_(k_cache.view(-1, 2, 64), slots.view(-1, 1), k)
            torch_npu.npu_scatter_nd_update_(v_cache.view(-1, 2, 64), slots.view(-1, 1), v)
            nb, bs = k_cache.shape[:2]
            out, _ = torch.ops.npu.npu_fused_infer_attention_score(
                q, k_cache.view(nb, bs, -1), v_cache.view(nb, bs, -1),
                num_heads=8, num_key_value_heads=2, input_layout="TND", scale=0.125,
                atten_mask=md.attention_mask, sparse_mode=3,
                block_table=block_table, block_size=bs,
                actual_seq_lengths=md.actual_seq_lengths_cu_q,
                actual_seq_lengths_kv=md.kv_len.tolist())
            return out


    class Runner:
        def __init__(self, model):
            self.model = model
            self.kv_len = torch.zeros(4, dtype=torch.int64)
            self.mask = torch.triu(torch.ones(2048, 2048), diagonal=1).bool()

        def decode_step(self, tokens):
            out = self.model(tokens, kv_len=self.kv_len, mask=self.mask)
            self.kv_len += 1
            return out
    """
)


@pytest.mark.parametrize(
    "source", [CONVERTED_GQA, CONVERTED_MLA, STANDALONE], ids=["gqa-sliding", "mla", "standalone"]
)
def test_correct_converted_code_lints_clean(source):
    assert lint_source(source) == []


@pytest.mark.parametrize(
    ("broken", "rule"),
    [
        ("self.sparse_mode = 4 if sliding else 3", "self.sparse_mode = 3"),
        ("md.block_table[self.attn_type]", "md.block_table"),
        ("scale=self.scaling,", ""),
        ("num_head=self.num_key_value_heads_per_rank", "num_head=config.num_key_value_heads"),
        (
            "num_layers=len(layer_infos), layer_infos",
            "num_layers=len(layer_infos), block_size=128, layer_infos",
        ),
        ("needs_block=True,", ""),
    ],
    ids=["KV002", "KV007", "KV006", "KV009", "KV012", "KV014"],
)
def test_one_mistake_in_converted_code_is_found_once(request, broken, rule):
    # Introduce exactly one mistake of the common-error table into correct code.
    expected = request.node.callspec.id
    assert broken in CONVERTED_GQA
    source = CONVERTED_GQA.replace(broken, rule, 1)
    found = lint_source(source)
    assert {f.rule for f in found} == {expected}, found


def test_mla_mistakes_in_converted_code():
    decode_three = CONVERTED_MLA.replace("sparse_mode = 0\n", "sparse_mode = 3\n")
    assert [f.rule for f in lint_source(decode_three)] == ["KV011"]
    no_mscale = CONVERTED_MLA.replace("self.scaling = self.scaling * mscale * mscale", "pass")
    assert [f.rule for f in lint_source(no_mscale)] == ["KV010"]
    v1_names = CONVERTED_MLA.replace("softmax_scale=", "scale=")
    assert {f.rule for f in lint_source(v1_names)} == {"KV005"}


def test_yarn_from_the_config_beside_the_file():
    # No mscale in the code, but the config says the model uses it.
    source = CONVERTED_MLA.replace("self.scaling = self.scaling * mscale * mscale", "pass")
    source = source.replace("mscale_all_dim", "m_all")
    assert lint_source(source) == []
    config = {"rope_parameters": {"rope_type": "yarn", "factor": 40, "mscale_all_dim": 1.0}}
    assert [f.rule for f in lint_source(source, config=config)] == ["KV010"]


BAD_CALL = "{callee}(q, k, v, num_heads=8, softmax_scale=0.1, atten_mask=m, sparse_mode=3)"


@pytest.mark.parametrize(
    ("prologue", "callee"),
    [
        ("import torch_npu", "torch_npu.npu_fused_infer_attention_score"),
        ("import torch_npu as tnpu", "tnpu.npu_fused_infer_attention_score"),
        ("import torch", "torch.ops.npu.npu_fused_infer_attention_score"),
        ("import torch", "torch.ops.npu.npu_fused_infer_attention_score.default"),
        ("from torch_npu import npu_fused_infer_attention_score as fia", "fia"),
        ("from kvskill.runtime.ops import torch_npu", "torch_npu.npu_fused_infer_attention_score"),
        ("import torch_npu\nFA = torch_npu.npu_fused_infer_attention_score", "FA"),
        ("", "self.fa_ops.npu_fused_infer_attention_score"),
    ],
)
def test_the_operator_is_recognised_however_it_is_reached(prologue, callee):
    source = f"{prologue}\n\ndef attend(self, q, k, v, m):\n    return {BAD_CALL.format(callee=callee)}\n"
    found = lint_source(source)
    assert [(f.rule, f.line) for f in found] == [
        ("KV005", source.splitlines().index(f"    return {BAD_CALL.format(callee=callee)}") + 1)
    ]


def test_self_attribute_alias_set_in_init():
    source = textwrap.dedent(
        """\
        import torch_npu

        class Attn:
            def __init__(self):
                self.fa = torch_npu.npu_fused_infer_attention_score_v2

            def forward(self, q, k, v, m):
                return self.fa(q, k, v, num_query_heads=8, scale=0.1, atten_mask=m,
                               sparse_mode=3)
        """
    )
    found = lint_source(source)
    assert [(f.rule, f.line) for f in found] == [("KV005", 8)]
    assert "softmax_scale" in found[0].fix


def test_an_unrelated_function_with_similar_keywords_is_ignored():
    source = (
        "def attend(q, k, v):\n    return my_attention(q, k, v, sparse_mode=0, softmax_scale=1)\n"
    )
    assert lint_source(source) == []


def test_decode_after_an_early_prefill_return_is_a_decode_branch():
    source = textwrap.dedent(
        """\
        import torch_npu

        def attend(q, k, v, md):
            if md.is_prefill:
                return torch_npu.npu_fused_infer_attention_score(
                    q, k, v, num_heads=8, scale=0.1, atten_mask=md.attention_mask,
                    sparse_mode=3)
            return torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=8, scale=0.1)
        """
    )
    assert lint_source(source) == []
    # The same decode call without the prefill guard also serves prefill.
    unguarded = source.replace("if md.is_prefill:", "if md.trace:")
    assert [f.rule for f in lint_source(unguarded)] == ["KV001"]


# Remote-code style MLA (DeepSeek): YaRN mscale applied after the fact, the operator
# reached through ``self.fa_ops``, a decode-only BSH helper without a mask.
REMOTE_MLA = textwrap.dedent(
    """\
    import math
    import torch
    import torch_npu
    from torch import nn


    def yarn_get_mscale(scale=1, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0


    class DeepseekAttention(nn.Module):
        def __init__(self, config, attn_tp_size):
            super().__init__()
            self.num_heads_per_rank = config.num_attention_heads // attn_tp_size
            self.kv_lora_rank = config.kv_lora_rank
            self.softmax_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** (-0.5)
            if config.rope_scaling is not None:
                mscale_all_dim = config.rope_scaling.get("mscale_all_dim", 0)
                scaling_factor = config.rope_scaling["factor"]
                if mscale_all_dim:
                    mscale = yarn_get_mscale(scaling_factor, mscale_all_dim)
                    self.softmax_scale = self.softmax_scale * mscale * mscale
            self.fa_ops = torch_npu
            self.attn_type = "FullAttention"

        def forward_absorb(self, q_nope, q_pe, nope_cache, rope_cache, forward_metadata):
            is_prefill = forward_metadata.is_prefill
            block_table = forward_metadata.block_table[self.attn_type]
            if is_prefill:
                sparse_mode = 3
                attention_mask = forward_metadata.attention_mask
            else:
                sparse_mode = 0
                attention_mask = None
            nb, bs = nope_cache.shape[:2]
            attn_output, _ = self.fa_ops.npu_fused_infer_attention_score_v2(
                q_nope, nope_cache, nope_cache,
                query_rope=q_pe, key_rope=rope_cache,
                num_query_heads=self.num_heads_per_rank, num_key_value_heads=1,
                input_layout="TND_NTD", atten_mask=attention_mask, sparse_mode=sparse_mode,
                softmax_scale=self.softmax_scale,
                block_table=block_table, block_size=bs,
                actual_seq_qlen=forward_metadata.actual_seq_lengths_cu_q,
                actual_seq_kvlen=forward_metadata.actual_seq_lengths_kv,
            )
            return attn_output

        def forward_decode_bsh(self, q, k_cache, v_cache, kv_len):
            return torch.ops.npu.npu_fused_infer_attention_score(
                q, k_cache, v_cache, num_heads=self.num_heads_per_rank, input_layout="BSH",
                scale=self.softmax_scale, actual_seq_lengths_kv=kv_len.tolist())
    """
)


def test_remote_code_mla_is_clean_and_its_mistakes_are_found():
    assert lint_source(REMOTE_MLA) == []
    no_mscale = REMOTE_MLA.replace(
        "self.softmax_scale = self.softmax_scale * mscale * mscale", "pass"
    )
    assert [(f.rule, f.line) for f in lint_source(no_mscale)] == [("KV010", 43), ("KV010", 53)]
    decode_three = REMOTE_MLA.replace("sparse_mode = 0", "sparse_mode = 3")
    assert [(f.rule, f.line) for f in lint_source(decode_three)] == [("KV011", 38)]
