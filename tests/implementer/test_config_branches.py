"""Attention branches the config decides (transformers' Falcon: ``if alibi is None:``).

The file proves that ``alibi`` is None exactly when ``config.alibi`` is false; the Plan
cites which branch runs and the line, and apply keeps that branch only. A file that does not
prove it (the parameter set elsewhere, handed on changed) keeps its ``if`` and is refused as
before.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import libcst as cst
import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.config_branch import config_branches
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.pipeline import convert_source
from kvskill.implementer.spec import ConversionSpec

FALCON = Path(importlib.util.find_spec("transformers.models.falcon.modeling_falcon").origin)


def _spec(alibi: bool) -> ConversionSpec:
    return ConversionSpec(
        fa_version="v1",
        input_layout="TND",
        uniform_attn_type="FullAttention",
        sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
        config_switches={"alibi": alibi},
    )


def _line(text: str, needle: str, after: str) -> int:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    return next(i for i in range(start, len(lines)) if needle in lines[i]) + 1


def test_falcons_alibi_branches_are_proved_decided_by_config_alibi():
    text = FALCON.read_text(encoding="utf-8")
    branches = config_branches(cst.parse_module(text), text)
    assert [(b.cls, b.test) for b in branches] == [
        ("FalconAttention", "alibi is None"),
        ("FalconAttention", "alibi is None"),
        ("FalconFlashAttention2", "alibi is None"),
        ("FalconFlashAttention2", "alibi is not None"),
    ]
    first = branches[0]
    assert (first.key, first.owner, first.flag) == ("alibi", "FalconModel", "use_alibi")
    # the lines are the file's own
    assert first.switch_line == _line(text, "self.use_alibi = config.alibi", "class FalconModel")
    assert first.line == _line(text, "if alibi is None:", "class FalconAttention")
    assert first.taken(False) and not first.taken(True)
    assert not branches[3].taken(False)


def test_the_plan_says_which_branch_runs_and_why_citing_the_line():
    plan = analyze_model("falcon")
    cited = [e for e in plan.evidence if e.decision == "attention_branch"]
    text = FALCON.read_text(encoding="utf-8")
    line = _line(text, "if alibi is None:", "class FalconAttention")
    assert cited[0].source == f"modeling_falcon.py:{line}"
    assert cited[0].reason.startswith(
        f"FalconAttention.forward's `if alibi is None:` (line {line}) runs its body: "
        "config.alibi is False, so alibi is None (FalconModel.__init__ sets "
        "self.use_alibi = config.alibi"
    )
    assert not plan.implementer_blockers


def test_falcon_converts_its_sdpa_branch_under_alibi_false():
    out = convert_source(FALCON.read_text(encoding="utf-8"), _spec(alibi=False))
    forward = out.split("class FalconAttention(")[1].split("\nclass ")[0].split("def forward(")[1]
    assert "        if alibi is None:" not in forward and "alibi.view(" not in forward
    assert "# config.alibi is False, so alibi is None" in forward
    assert forward.count("torch_npu.npu_fused_infer_attention_score(") == 1
    assert "scaled_dot_product_attention" not in forward
    # the rotary embedding, applied only without ALiBi, stays
    assert "apply_rotary_pos_emb(query_layer, key_layer, cos, sin)" in forward
    # multi-query Falcon keeps one KV head unless the new decoder architecture
    assert (
        "max((self.num_heads if self.new_decoder_architecture else self.num_kv_heads) "
        "// self.attn_tp_size, 1)"
    ) in out


def test_falcon_under_alibi_true_is_refused_with_the_operator_limit():
    with pytest.raises(UnsupportedModelError) as refused:
        convert_source(
            FALCON.read_text(encoding="utf-8"), _spec(alibi=True), filename="modeling_falcon.py"
        )
    message = str(refused.value)
    assert "config.alibi is True, so alibi is built" in message
    assert "the fused operator takes no ALiBi slopes" in message
    assert "\n" not in message


SOURCE = """
import torch
from torch import nn


class VendorAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(8, 8)

    def forward(self, hidden_states, bias, cache=None):
        q = k = v = hidden_states.view(1, 1, -1, 8)
        k, v = cache.update(k, v, self.layer_idx)
        if bias is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return out


class VendorModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.use_bias = config.use_bias
        self.layers = nn.ModuleList([VendorAttention(config, 0)])

    def forward(self, hidden_states, cache=None):
        bias = None
        if self.use_bias:
            bias = torch.zeros(1)
        for layer in self.layers:
            hidden_states = layer(hidden_states, bias=bias, cache=cache)
        return hidden_states
"""


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # set outside the switch
        ("        for layer in self.layers:\n", "        bias = torch.ones(1)\n        for layer in self.layers:\n"),
        # handed on changed
        ("bias=bias, cache=cache", "bias=bias * 2, cache=cache"),
        # the switch is not read from the config
        ("self.use_bias = config.use_bias", "self.use_bias = True"),
        # not initialised to None before it is built
        ("        bias = None\n", ""),
    ],
    ids=["set-elsewhere", "handed-on-changed", "switch-not-config", "not-initialised"],
)  # fmt: skip
def test_a_branch_the_file_does_not_prove_decided_is_not_read_as_decided(old, new):
    source = textwrap.dedent(SOURCE)
    assert [b.key for b in config_branches(cst.parse_module(source))] == ["use_bias"]
    assert source.count(old) == 1
    assert config_branches(cst.parse_module(source.replace(old, new))) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_falcon_verifies_token_exact_under_its_default_config(mode, tmp_path):
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "out"
    apply_model("falcon", out, ApplyOptions(deploy_mode=mode))
    report = verify_directory(out, VerifyOptions())
    assert report.passed, report.failures()
    assert report.tokens_identical and report.max_logit_diff < 1e-4
