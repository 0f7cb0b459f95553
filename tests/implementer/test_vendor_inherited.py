"""Attention classes a remote file imports from transformers (subclassed or used as they are).

A file whose attention is transformers' own (``class FooAttention(LlamaAttention)`` with only
an ``__init__``) is planned from that transformers file, which apply converts into the output
directory; the file then imports it from there and keeps its own code. A subclass that brings
its own forward converts like any attention class, and one without an ``__init__`` of its own
is refused with what to add.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.pipeline import convert_source
from kvskill.implementer.spec import ConversionSpec
from kvskill.implementer.writer import apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import VENDOR_ROOT, convert_and_verify  # noqa: E402

SPEC = ConversionSpec(
    fa_version="v1",
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)


INHERITED = VENDOR_ROOT / "inherited_llama_attention"
MODELING = "modeling_vendor_sub.py"
IMPORT = "from transformers.models.llama.modeling_llama import ("


def test_the_plan_comes_from_the_transformers_file_the_attention_is_taken_from():
    plan = analyze_model(str(INHERITED))
    assert plan.architecture == "VendorSubForCausalLM"
    assert Path(plan.source.modeling_file).name == MODELING
    assert Path(plan.source.inherits_code).parts[-3:] == ("models", "llama", "modeling_llama.py")
    assert plan.source.to_dict()["inherits_code"] == plan.source.inherits_code
    assert (plan.num_attention_heads, plan.num_key_value_heads, plan.head_dim) == (4, 2, 16)
    assert not plan.implementer_blockers
    cited = next(e for e in plan.evidence if e.decision == "source")
    assert "VendorSubAttention subclasses LlamaAttention from" in cited.reason
    assert cited.source.startswith(f"{MODELING}:")


def test_apply_writes_the_converted_module_beside_the_file_and_redirects_its_import(tmp_path):
    out = tmp_path / "out"
    apply_model(str(INHERITED), out, ApplyOptions())
    original = (INHERITED / MODELING).read_text(encoding="utf-8")
    written = (out / MODELING).read_text(encoding="utf-8")
    # the file's own code is kept; only the import moves to the converted module
    assert written == original.replace(IMPORT, "from .modeling_llama import (")
    assert 'self.vendor_tag = "sub"' in written
    module = (out / "modeling_llama.py").read_text(encoding="utf-8")
    assert "self.cache_entries = [" in module and "def get_cache_info(" in module
    assert "torch_npu.npu_fused_infer_attention_score(" in module
    # transformers' relative imports are absolute in the copy written outside the package
    assert "from ...utils" not in module and "from transformers." in module
    # the input directory is untouched
    assert sorted(p.name for p in INHERITED.iterdir()) == sorted(
        ["config.json", "configuration_vendor_sub.py", MODELING]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", [("framework", "paged"), ("standalone", "paged"), ("standalone", "contiguous")]
)
def test_the_inherited_attention_converts_and_verifies_token_exact(mode, tmp_path):
    out = tmp_path / "out"
    report = convert_and_verify("inherited_llama_attention", out, *mode)
    assert report.passed, report.failures()
    assert report.tokens_identical and report.max_logit_diff < 1e-4


@pytest.mark.slow
def test_the_file_left_importing_transformers_own_attention_fails_verify(tmp_path):
    out = tmp_path / "out"
    apply_model(str(INHERITED), out, ApplyOptions())
    modeling = out / MODELING
    text = modeling.read_text(encoding="utf-8")
    modeling.write_text(text.replace("from .modeling_llama import (", IMPORT), encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match="has no get_cache_info"):
        verify_directory(out, VerifyOptions(trust_remote_code=True))


def _variant(tmp_path: Path, old: str, new: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(INHERITED, model)
    path = model / MODELING
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return model


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        (
            "        super().__init__(config, layer_idx)\n        self.vendor_tag",
            "        nn.Module.__init__(self)\n        self.vendor_tag",
            "VendorSubAttention.__init__ does not call super().__init__",
        ),
        (
            "class VendorSubForCausalLM(LlamaForCausalLM):",
            "class VendorSubForCausalLM(LlamaModel):",
            "VendorSubForCausalLM does not subclass a *ForCausalLM class imported from "
            "transformers.models.llama.modeling_llama",
        ),
        (
            "from torch import nn\n",
            "from torch import nn\nimport transformers.models.llama.modeling_llama\n",
            "`import transformers.models.llama.modeling_llama` is not redirected",
        ),
    ],
    ids=["init-without-super", "causal-lm-not-subclassed", "plain-import"],
)
def test_what_the_converted_module_cannot_reach_is_refused_naming_it(tmp_path, old, new, reason):
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(_variant(tmp_path, old, new)), out, ApplyOptions())
    assert reason in str(refused.value) and "\n" not in str(refused.value)
    assert not out.exists()


def test_a_file_of_the_converted_module_name_beside_the_model_is_refused(tmp_path):
    model = _variant(tmp_path, "from torch import nn", "from torch import nn")
    (model / "modeling_llama.py").write_text("# a vendor's own file\n", encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match="already has a file of that name"):
        apply_model(str(model), tmp_path / "out", ApplyOptions())


def test_the_executor_target_is_refused_for_an_inherited_attention(tmp_path):
    with pytest.raises(UnsupportedModelError, match="--target cann-recipes"):
        apply_model(str(INHERITED), tmp_path / "out", ApplyOptions(target="cann-recipes"))


OWN_FORWARD = """
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb
from torch import nn


class VendorAttention(LlamaAttention):
{init}
    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_value=None):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


class VendorForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([VendorAttention(config, 0)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
"""


def test_a_subclass_with_its_own_forward_but_no_init_is_refused_with_what_to_add():
    with pytest.raises(UnsupportedModelError) as refused:
        convert_source(OWN_FORWARD.format(init=""), SPEC, filename="modeling_vendor.py")
    assert (
        "VendorAttention has no __init__ (it inherits LlamaAttention's, defined outside the "
        "file: give it one that calls super().__init__(...)" in str(refused.value)
    )


def test_a_subclass_with_its_own_forward_and_init_converts():
    init = (
        "    def __init__(self, config, layer_idx):\n        super().__init__(config, layer_idx)\n"
    )
    converted = convert_source(OWN_FORWARD.format(init=init), SPEC, filename="modeling_vendor.py")
    init_text = converted[converted.index("def __init__") : converted.index("def forward")]
    assert "super().__init__(config, layer_idx)" in init_text
    assert "self.cache_entries = [" in init_text
    assert "torch_npu.npu_fused_infer_attention_score(" in converted
    assert "past_key_value.update(" not in converted


def test_reapplying_to_an_inherited_output_recognises_it_as_converted(tmp_path):
    first = tmp_path / "first"
    apply_model(str(INHERITED), first, ApplyOptions())
    # analyze reads the converted module beside the file and says so
    plan = analyze_model(str(first))
    assert Path(plan.source.inherits_code).resolve() == (first / "modeling_llama.py").resolve()
    assert plan.code["already_converted"]
    cited = next(e for e in plan.evidence if e.decision == "source")
    assert "VendorSubAttention subclasses LlamaAttention from modeling_llama.py beside it" in (
        cited.reason
    )
    assert "already converted" in cited.reason
    # a dry run changes nothing
    dry = apply_model(str(first), None, ApplyOptions(dry_run=True))
    assert not dry.changed and dry.diff == ""
    # a second output holds the same code and the first conversion's record
    second = tmp_path / "second"
    apply_model(str(first), second, ApplyOptions())
    for name in (MODELING, "modeling_llama.py", "configuration_vendor_sub.py"):
        assert (second / name).read_text(encoding="utf-8") == (first / name).read_text(
            encoding="utf-8"
        )
    first_record = json.loads((first / "kvskill_plan.json").read_text(encoding="utf-8"))
    second_record = json.loads((second / "kvskill_plan.json").read_text(encoding="utf-8"))
    assert second_record["conversion"] == first_record["conversion"]


def test_a_module_beside_the_file_that_is_not_converted_code_is_still_refused(tmp_path):
    first = tmp_path / "first"
    apply_model(str(INHERITED), first, ApplyOptions())
    # the module beside the file replaced by transformers' own, unconverted text
    plan = analyze_model(str(INHERITED))
    (first / "modeling_llama.py").write_text(
        Path(plan.source.inherits_code).read_text(encoding="utf-8"), encoding="utf-8"
    )
    with pytest.raises(UnsupportedModelError, match="no attention class"):
        apply_model(str(first), tmp_path / "second", ApplyOptions())


@pytest.mark.slow
def test_a_reapplied_inherited_output_verifies_token_exact(tmp_path):
    first = tmp_path / "first"
    apply_model(str(INHERITED), first, ApplyOptions())
    second = tmp_path / "second"
    apply_model(str(first), second, ApplyOptions())
    report = verify_directory(second, VerifyOptions(trust_remote_code=True))
    assert report.passed, report.failures()
    assert report.tokens_identical and report.max_logit_diff < 1e-4
