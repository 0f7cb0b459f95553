"""Fused q/k/v projections end to end: the Plan cites the cut, the converted attention
declares the row order, and a tensor-parallel split keeps each rank's own heads by it."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.analyzer.analyze import analyze_model  # noqa: E402
from kvskill.core.errors import UnsupportedModelError  # noqa: E402
from kvskill.implementer.convert import ApplyOptions  # noqa: E402
from kvskill.implementer.writer import apply_model  # noqa: E402
from kvskill.runtime.distributed.shard import Slice, plan_shards  # noqa: E402
from kvskill.runtime.loader import load_model  # noqa: E402
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from vendor_fixtures import VENDOR_ROOT  # noqa: E402

#: fixture -> (modeling file, projection, layout, the cut the evidence cites)
FUSED = {
    "grouped_wqkv_bhsd": (
        "modeling_vendor_wqkv.py",
        "wqkv",
        "per_kv_group",
        "self.wqkv(hidden_states).view(bsz, q_len, self.num_key_value_heads, "
        "self.num_key_value_groups + 2, self.head_dim)",
    ),
    "group_split_helper_bhsd": (
        "modeling_vendor_groupqkv.py",
        "query_key_value",
        "per_kv_group",
        "fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_key_value_heads + 2, "
        "self.head_dim)",
    ),
    "per_head_qkv_bhsd": (
        "modeling_vendor_headqkv.py",
        "query_key_value",
        "per_head",
        "qkv.view(*per_head_shape)",
    ),
    "c_attn_bshd": (
        "modeling_vendor_cattn.py",
        "c_attn",
        "contiguous",
        "mixed_x_layer.split(self.split_size, dim=2)",
    ),
}


def _line_of(name: str, text: str) -> int:
    modeling = (VENDOR_ROOT / name / FUSED[name][0]).read_text(encoding="utf-8")
    head = text.split("(")[0]
    return next(i for i, line in enumerate(modeling.splitlines(), 1) if head + "(" in line)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_the_plan_cites_the_line_that_cuts_the_projection(name):
    modeling, attr, layout, cut = FUSED[name]
    plan = analyze_model(str(VENDOR_ROOT / name))
    fused = plan.code["fused_qkv"]
    assert (fused["attr"], fused["layout"], fused["split"]) == (attr, layout, cut)
    (evidence,) = [e for e in plan.evidence if e.decision == "fused_qkv"]
    assert evidence.source == f"{modeling}:{_line_of(name, cut)}"
    assert f"cut by `{cut}`" in evidence.reason
    contiguous_words = "all query heads, then all key heads, then all value heads"
    assert (contiguous_words in evidence.reason) == (layout == "contiguous")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Framework conversions of the fixtures, each applied once."""
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for name in FUSED:
        apply_model(str(VENDOR_ROOT / name), root / name, ApplyOptions())
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", sorted(FUSED))
def test_the_converted_attention_declares_the_row_order(name, converted):
    modeling, attr, layout, _ = FUSED[name]
    text = (converted[name] / modeling).read_text(encoding="utf-8")
    assert f'self.fused_qkv_layout = {{"{attr}": "{layout}"}}' in text


def test_a_rank_keeps_whole_kv_groups_of_a_per_group_weight(converted):
    """4 query heads, 2 KV heads, head_dim 32: a group is (2 + 2) x 32 = 128 rows, rank 1
    keeps the second group whole (rows 128..255), not the second third of the rows."""
    model = load_model(
        converted["group_split_helper_bhsd"], trust_remote_code=True, random_weights=True
    ).model
    plan = plan_shards(model, 1, 2)
    attention = "model.layers.0.attention"
    assert plan.attention_roles[attention]["query_key_value"] == "column(fused qkv, per_kv_group)"
    assert plan.slices[f"{attention}.query_key_value.weight"] == Slice(0, ((128, 256),))


def test_a_fused_projection_without_a_declared_order_is_refused(converted, tmp_path):
    """A directory converted before the declaration existed (or edited): the rows of a
    rank's heads are unknown, so the split refuses instead of cutting by thirds."""
    old = tmp_path / "undeclared"
    shutil.copytree(converted["grouped_wqkv_bhsd"], old)
    modeling = old / "modeling_vendor_wqkv.py"
    text = modeling.read_text(encoding="utf-8")
    modeling.write_text(text.replace("self.fused_qkv_layout = ", "_ = "), encoding="utf-8")
    model = load_model(old, trust_remote_code=True, random_weights=True).model
    with pytest.raises(UnsupportedModelError, match="wqkv projects query, key and value in one"):
        plan_shards(model, 0, 2)


def test_a_legacy_conversion_with_a_fused_projection_stays_refused(tmp_path):
    """Bloom converts Legacy (its ALiBi bias keeps the model's own math) and declares no
    row order. Its bias is built for every head outside the attention, so a rank would add
    another head's slopes: with the order declared, --tp 2 ran to the end with logits off
    by 59 and the same greedy tokens. The missing declaration keeps it refused."""
    out = tmp_path / "bloom"
    apply_model("bloom", out, ApplyOptions())
    text = (out / "modeling_bloom.py").read_text(encoding="utf-8")
    assert 'self.attn_type = "Legacy"' in text and "fused_qkv_layout" not in text
    model = load_model(out, trust_remote_code=True, random_weights=True).model
    with pytest.raises(UnsupportedModelError, match="declares no row order"):
        plan_shards(model, 0, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["group_split_helper_bhsd", "per_head_qkv_bhsd", "c_attn_bshd"])
def test_two_ranks_verify_token_exact(name, converted):
    """One fixture per layout. Before the split read the declared order, the fused Linear
    was replicated whole while the heads were halved, and no rank could run."""
    report = verify_directory(
        converted[name], VerifyOptions(trust_remote_code=True, tensor_parallel_size=2)
    )
    assert report.passed, report.failures()
    assert report.tokens_identical
