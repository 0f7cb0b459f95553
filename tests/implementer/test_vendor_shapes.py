"""The code shapes vendors' own modeling files use, read and rewritten (fast, no model runs).

Tuple caches grown with ``torch.cat`` in three layouts, fused projections, heads not named
``lm_head``, rotary tables sized by ``kv_seq_len``; the whole model directories of these shapes
are converted and verified in test_vendor_fixtures.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import libcst as cst
import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.gather import cache_cat_growth, causal_lm_classes, is_attention_class
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.facts import CacheLayout, attention_facts
from kvskill.implementer.pipeline import convert_source
from kvskill.implementer.spec import ConversionSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import VENDOR_FIXTURES, VENDOR_ROOT  # noqa: E402


def _assign(text: str) -> cst.Assign:
    return cst.ensure_type(cst.parse_statement(text).body[0], cst.Assign)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("k = torch.cat([past_key_value[0], k], dim=2)", ("k", 2)),
        ("key = torch.cat((past_key, key), dim=1)", ("key", 1)),
        ("key_layer = torch.cat((cache_k, key_layer), dim=0)", ("key_layer", 0)),
        ("k = torch.cat([layer_past[0], k], -2)", ("k", -2)),
        # partial rotary joins features (the last axis): never a cache
        ("q = torch.cat((q_rot, q), dim=-1)", None),
        # the name first is an append of something else, not a past grown by new tokens
        ("k = torch.cat([k, extra], dim=2)", None),
        ("k = torch.cat([k[:, :1], k], dim=2)", None),
        # a dimension that is not a literal cannot name a layout
        ("k = torch.cat([past, k], dim=axis)", None),
    ],
)
def test_a_tuple_cache_write_is_a_name_grown_after_its_past(text, expected):
    assert cache_cat_growth(_assign(text)) == expected


ATTENTION = """
class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x, layer_past=None, use_cache=False):
        q, k, v = self.qkv(x).view(1, x.shape[1], 3, self.num_heads, self.head_dim).unbind(2)
        if layer_past is not None:
            k = torch.cat([layer_past[0], k], dim=DIM)
            v = torch.cat([layer_past[1], v], dim=DIM)
        present = (k, v) if use_cache else None
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(1, x.shape[1], -1), present
"""


def _attention(dim: str, source: str = ATTENTION) -> cst.ClassDef:
    module = cst.parse_module(source.replace("DIM", dim))
    return next(c for c in module.body if isinstance(c, cst.ClassDef))


@pytest.mark.parametrize(
    ("dim", "layout"),
    [
        ("2", CacheLayout.BHSD),
        ("-2", CacheLayout.BHSD),
        ("1", CacheLayout.BSHD),
        ("-3", CacheLayout.BSHD),
        ("0", CacheLayout.SBHD),
    ],
)
def test_the_concatenation_axis_is_the_sequence_axis_and_names_the_layout(dim, layout):
    cls = _attention(dim)
    assert is_attention_class(cls)
    facts = attention_facts(cls)
    assert facts.problems == []
    seam = facts.seam
    assert seam is not None
    assert (seam.key, seam.value, seam.query, seam.layout) == ("k", "v", "q", layout)
    # the tuple handed back under use_cache is read after the kernel: it becomes None
    assert seam.nulled == ["present"]


def test_key_and_value_grown_along_different_axes_are_refused():
    source = ATTENTION.replace(
        "v = torch.cat([layer_past[1], v], dim=DIM)", "v = torch.cat([layer_past[1], v], dim=1)"
    )
    facts = attention_facts(_attention("2", source))
    assert facts.seam is None
    assert any("not as one key and one value along the same axis" in p for p in facts.problems)


def test_a_name_the_seam_defines_that_is_not_the_cache_still_blocks_the_rewrite():
    source = ATTENTION.replace(
        "present = (k, v) if use_cache else None",
        "present = (k, v) if use_cache else None\n        width = k.shape[-1]",
    ).replace("return out.transpose", "return width, out.transpose")
    facts = attention_facts(_attention("2", source))
    # a limit of the fused replacement (Legacy keeps the statements that define it)
    assert any("['width']" in p for p in facts.fused_limits)


HEADS = """
class Inner(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)

class Outer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = Inner(config)

class Named(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
"""


def test_the_causal_lm_class_is_found_by_structure_and_by_the_config():
    module = cst.parse_module(HEADS)
    # a Linear to the vocabulary under any name
    assert causal_lm_classes(module) == ["Inner", "Named"]
    # the class auto_map names wins when it is in the file (the head sits in an inner module)
    assert causal_lm_classes(module, "Outer") == ["Outer"]
    # an assignment of self.lm_head is the head whatever the config says
    with_lm_head = HEADS.replace("self.output =", "self.lm_head =")
    assert causal_lm_classes(cst.parse_module(with_lm_head), "Outer") == ["Named"]


def _converted(name: str) -> str:
    plan = analyze_model(str(VENDOR_ROOT / name))
    spec = ConversionSpec.from_plan(plan)
    modeling = next((VENDOR_ROOT / name).glob("modeling_*.py"))
    return convert_source(modeling.read_text(encoding="utf-8"), spec, filename=modeling.name)


@pytest.mark.parametrize(
    ("name", "flatten"),
    [
        ("grouped_wqkv_bhsd", "key_tnd = key_states.transpose(1, 2).reshape("),
        ("c_attn_bshd", "key_tnd = key.reshape("),
        ("mqa_groups_sbhd", "key_tnd = key_layer.transpose(0, 1).reshape("),
        ("w_pack_matmul_bhsd", "key_tnd = key_states.transpose(1, 2).reshape("),
    ],
)
def test_each_layout_is_flattened_to_tnd_from_its_own_axes(name, flatten):
    converted = _converted(name)
    assert flatten in converted
    assert "torch.cat(" not in converted.split("class ")[-1]  # no cache growth left
    assert converted.count("npu_fused_infer_attention_score(") == 1
    compile(converted, name, "exec")


def test_the_rotary_table_is_sized_to_the_positions_of_the_packed_step():
    converted = _converted("grouped_wqkv_bhsd")
    assert "self.rotary_emb(value_states, seq_len=_paged_seq_len(kv_seq_len))" in converted
    assert converted.count("def _paged_seq_len(") == 1
    # the cache handed back under use_cache is None under the runtime
    assert "past_key_value = None" in converted


def test_block_size_follows_the_head_whatever_its_name():
    converted = _converted("grouped_wqkv_bhsd")
    head = "self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)\n"
    assert head + "        self.block_size = 128" in converted
    glm = _converted("mqa_groups_sbhd")
    outer = glm.split("class VendorGlmForConditionalGeneration")[1]
    assert "self.block_size = 128" in outer and "def get_cache_info(" in outer
    inner = glm.split("class VendorGlmModel(")[1].split("class ")[0]
    assert "get_cache_info" not in inner


def test_mha_configs_without_kv_heads_read_the_query_heads():
    converted = _converted("c_attn_bshd")
    assert (
        '(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)' in converted
    )


@pytest.mark.parametrize("name", sorted(VENDOR_FIXTURES))
def test_the_plan_records_the_fused_projection_and_the_tuple_cache(name):
    plan = analyze_model(str(VENDOR_ROOT / name))
    fused = plan.code["fused_qkv"]
    expected = {
        "grouped_wqkv_bhsd": ("wqkv", "per_kv_group"),
        "c_attn_bshd": ("c_attn", "contiguous"),
        "mqa_groups_sbhd": ("query_key_value", "contiguous"),
        "w_pack_matmul_bhsd": ("W_pack", "contiguous"),
        "per_head_qkv_bhsd": ("query_key_value", "per_head"),
        "group_split_helper_bhsd": ("query_key_value", "per_kv_group"),
        "attn_method_bshd": ("c_attn", "contiguous"),
        "core_attention_sbhd": ("query_key_value", "contiguous"),
    }[name]
    assert (fused["attr"], fused["layout"]) == expected
    assert plan.code["cache_api"] == "tuple_cat"
    assert any(e.decision == "fused_qkv" for e in plan.evidence)
    assert plan.model_type == VENDOR_FIXTURES[name][0]


def test_attention_run_by_another_module_is_refused_naming_the_class(tmp_path):
    """ChatGLM3 keeps the kernel in a CoreAttention submodule: the class that grows the
    cache never calls attention itself, so the seam has no end; refused, nothing written."""
    import shutil

    source = VENDOR_ROOT / "mqa_groups_sbhd"
    model = tmp_path / "core_attention"
    shutil.copytree(source, model)
    modeling = model / "modeling_vendor_glm.py"
    text = modeling.read_text(encoding="utf-8")
    start = text.index("        if attention_mask is None and query_layer.shape[2]")
    end = text.index("        # [b, np, sq, hn] -> [sq, b, hp]")
    text = (
        text[:start]
        + "        context_layer = self.core_attention(query_layer, key_layer, value_layer)\n\n"
        + text[end:]
    )
    modeling.write_text(text, encoding="utf-8")
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model

    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(model), out, ApplyOptions())
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "VendorGlmSelfAttention.forward writes the KV cache but calls no attention kernel "
        "itself" in message
    )
    # the module the kernel runs in is named (the fixture builds no core_attention, so its
    # class is unknown and only the attribute is)
    assert "it hands query, key and value to self.core_attention, which runs the kernel" in (
        message
    )
    assert not out.exists()


CACHE_API_43X = """
import torch
import torch.nn.functional as F
from torch import nn


class OldAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.rotary_emb = Rotary(self.head_dim)

    def forward(self, x, position_ids, past_key_value=None):
        q = self.q_proj(x).view(1, x.shape[1], -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, x.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, x.shape[1], -1, self.head_dim).transpose(1, 2)
        kv_seq_len = k.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value.get_usable_length(kv_seq_len, self.layer_idx)
        cos, sin = self.rotary_emb(v, seq_len=kv_seq_len)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx, {"sin": sin, "cos": cos})
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(1, x.shape[1], -1)


class OldForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([OldAttention(config, 0)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
"""

SPEC = ConversionSpec(
    fa_version="v1",
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)


def test_the_43x_cache_api_bookkeeping_gets_its_rotary_table_sized_too():
    converted = convert_source(CACHE_API_43X, SPEC, filename="modeling_old.py")
    assert "self.rotary_emb(v, seq_len=_paged_seq_len(kv_seq_len))" in converted
    assert converted.count("def _paged_seq_len(") == 1
    # converting the converted file changes nothing (the call is sized once)
    assert convert_source(converted, SPEC, filename="modeling_old.py") == converted


def test_paged_seq_len_is_the_source_length_outside_the_runtime_and_the_longest_request_inside():
    import ast

    from kvskill.runtime import forward_context, get_forward_metadata, step_metadata

    converted = convert_source(CACHE_API_43X, SPEC, filename="modeling_old.py")
    helper = next(
        node
        for node in ast.parse(converted).body
        if isinstance(node, ast.FunctionDef) and node.name == "_paged_seq_len"
    )
    scope = {"get_forward_metadata": get_forward_metadata}
    exec(compile(ast.Module(body=[helper], type_ignores=[]), "helper", "exec"), scope)  # noqa: S102
    paged_seq_len = scope["_paged_seq_len"]
    assert paged_seq_len(7) == 7
    # a decode step of three requests: T = 3 tokens, positions up to 40
    md = step_metadata(
        is_prefill=False,
        q_lens=[1, 1, 1],
        kv_lens=[12, 41, 5],
        block_table={},
        slot_mapping={},
        attention_mask=None,
        device="cpu",
    )
    with forward_context(md):
        assert paged_seq_len(3) == 41
        assert paged_seq_len(64) == 64


def test_the_43x_mask_builders_are_skipped_under_the_runtime():
    source = CACHE_API_43X.replace(
        "from torch import nn\n",
        "from torch import nn\n"
        "from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask\n",
    ) + (
        "\n\ndef build_mask(mask, shape, embeds, past):\n"
        "    return _prepare_4d_causal_attention_mask(mask, shape, embeds, past)\n"
    )
    converted = convert_source(source, SPEC, filename="modeling_old.py")
    assert (
        "return (None if _in_paged_runtime() else "
        "_prepare_4d_causal_attention_mask(mask, shape, embeds, past))" in converted
    )


def test_rotary_angles_cut_from_the_tail_of_a_cache_sized_table_are_refused(tmp_path):
    """Qwen-7B's real rotary: the model builds the table for kv_seq_len and the attention keeps
    its last cur_len rows; with no position_ids the packed step's rows are not the tokens'
    positions. Refused with that reason, nothing written."""
    import shutil

    model = tmp_path / "tail_rotary"
    shutil.copytree(VENDOR_ROOT / "c_attn_bshd", model)
    modeling = model / "modeling_vendor_cattn.py"
    text = modeling.read_text(encoding="utf-8")
    rotate = "        query = apply_rotary_pos_emb(query, rotary_pos_emb)\n"
    assert rotate in text
    text = text.replace(
        rotate,
        "        cur_len = query.shape[1]\n"
        "        rotary_pos_emb = [t[:, -cur_len:] for t in rotary_pos_emb]\n" + rotate,
    )
    modeling.write_text(text, encoding="utf-8")
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model

    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(model), out, ApplyOptions())
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "VendorCattnAttention.forward takes its rotary angles as the last rows of a table "
        "sized by the cache length (`t[:, -cur_len:]`), not by position ids" in message
    )
    assert not out.exists()


def test_an_attention_if_whose_branches_return_is_not_one_kernel_call():
    # falcon: `if alibi is None: ... return` / `else: ... return`, each branch its own
    # kernel and output projection; replacing the whole if would drop the returns
    import inspect

    from kvskill.implementer.facts import module_classes
    from transformers.models.falcon import modeling_falcon

    classes = module_classes(cst.parse_module(inspect.getsource(modeling_falcon)))
    facts = attention_facts(classes["FalconAttention"], classes)
    assert facts.seam is None
    assert any("each branch returns its own output" in p for p in facts.problems)
