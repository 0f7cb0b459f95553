"""A refusal names constructs that are in the file it refuses.

A refusal that names a method, an attribute or a statement the file does not have sends the
user looking for something that is not there (issue 47: einsum attention was refused as "no
attention class that writes a KV cache or runs attention"). Every refusal of the vendor
fixtures, of the seam's refusal cases and of transformers' own Falcon file is read for what
it names, and each of those is looked up in the refused source.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.pipeline import convert_source
from kvskill.implementer.writer import apply_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_seam_callee import SUBMODULE_REFUSALS  # noqa: E402
from test_seam_method import EINSUM_BMM, SOURCE, SPEC  # noqa: E402
from vendor_fixtures import VENDOR_ROOT  # noqa: E402

#: ``Class.member`` (``VendorCoreAttention.forward``, ``XAttention.__init__``)
_MEMBER = re.compile(r"\b([A-Z]\w*)\.(\w+)\b")
#: ``self.attr`` paths
_SELF_PATH = re.compile(r"\bself(?:\.\w+)+")
#: ``torch.einsum`` and the like
_TORCH = re.compile(r"\btorch(?:\.\w+)+")
#: ``['query', 'key']``: a list of names
_NAME_LIST = re.compile(r"\[('[\w.]+'(?:, '[\w.]+')*)\]")
#: code quoted in backticks; those with ``...`` or ``<...>`` are templates, not quotations
_QUOTED = re.compile(r"`([^`]+)`")


def named_constructs(message: str) -> list[str]:
    """What MESSAGE names as being in the refused file, as lookup keys (see
    :func:`missing_constructs`)."""
    found = [f"member:{c}.{m}" for c, m in _MEMBER.findall(message)]
    found += [f"text:{p}" for p in _SELF_PATH.findall(message)]
    found += [f"text:{p}" for p in _TORCH.findall(message)]
    for names in _NAME_LIST.findall(message):
        found += [f"word:{n.strip(chr(39))}" for n in names.split(", ")]
    for quoted in _QUOTED.findall(message):
        if "..." not in quoted and "<" not in quoted:
            found.append(f"text:{quoted}")
    return found


def _class_block(source: str, name: str) -> str | None:
    match = re.search(rf"^class {re.escape(name)}\b.*?(?=^class |\Z)", source, re.M | re.S)
    return match.group(0) if match else None


def missing_constructs(message: str, source: str) -> list[str]:
    """The constructs MESSAGE names that SOURCE does not have."""
    flat = " ".join(source.split())
    missing = []
    for construct in named_constructs(message):
        kind, _, value = construct.partition(":")
        if kind == "member":
            cls, member = value.split(".")
            block = _class_block(source, cls)
            if block is None or not re.search(rf"\b{re.escape(member)}\b", block):
                missing.append(construct)
        elif kind == "word":
            if not re.search(rf"\b{re.escape(value)}\b", source):
                missing.append(construct)
        elif " ".join(value.split()) not in flat:
            missing.append(construct)
    return missing


def _assert_true_refusal(message: str, source: str) -> None:
    assert "\n" not in message
    # every refusal here names something, or the test would hold for any message
    assert named_constructs(message), message
    assert missing_constructs(message, source) == [], message


def test_the_check_finds_a_construct_the_file_lacks():
    source = "class A:\n    def forward(self):\n        return self.x\n"
    assert missing_constructs("A.forward reads self.x", source) == []
    assert missing_constructs("A._attn reads self.y", source) == ["member:A._attn", "text:self.y"]
    assert missing_constructs("B.forward does `return self.z`", source) == [
        "member:B.forward",
        "text:self.z",
        "text:return self.z",
    ]
    # a template in backticks is not a quotation of the file
    assert named_constructs("writes `<cache>.update(key, value, ...)`") == []


MODES = (
    ("framework", "paged"),
    ("standalone", "paged"),
    ("standalone", "contiguous"),
    ("framework", "legacy"),
)


def _refusal(model: Path, out: Path, deploy_mode: str, kv_mode: str) -> str | None:
    try:
        apply_model(str(model), out, ApplyOptions(deploy_mode=deploy_mode, kv_mode=kv_mode))
    except UnsupportedModelError as refused:
        return str(refused)
    return None


def _modeling_text(model: Path) -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(model.glob("modeling_*.py")))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in VENDOR_ROOT.iterdir() if p.is_dir()))
def test_every_refusal_of_a_vendor_fixture_names_what_is_in_it(name, tmp_path):
    model = VENDOR_ROOT / name
    source = _modeling_text(model)
    for deploy_mode, kv_mode in MODES:
        message = _refusal(model, tmp_path / f"{deploy_mode}-{kv_mode}", deploy_mode, kv_mode)
        if message is not None:
            assert "\n" not in message
            assert missing_constructs(message, source) == [], message


@pytest.mark.parametrize(("old", "new", "reason"), SUBMODULE_REFUSALS)
def test_a_submodule_refusal_names_what_is_in_the_file(old, new, reason, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(VENDOR_ROOT / "core_attention_sbhd", model)
    modeling = model / "modeling_vendor_coreattn.py"
    source = modeling.read_text(encoding="utf-8").replace(old, new)
    modeling.write_text(source, encoding="utf-8")
    message = _refusal(model, tmp_path / "out", "framework", "paged")
    assert message is not None
    _assert_true_refusal(message, source)


METHOD_MUTATIONS = [
    (
        "            attn_weights = attn_weights + attention_mask\n",
        "            attn_weights = attn_weights + attention_mask + self.alibi\n",
    ),
    (
        "        attn_weights = torch.matmul(query, key.transpose(-1, -2))",
        "        query = query * 2\n        attn_weights = torch.matmul(query, key.transpose(-1, -2))",
    ),
    (
        "        attn_weights = nn.functional.softmax(attn_weights, dim=-1)\n",
        "        attn_weights = torch.tanh(attn_weights)\n"
        "        attn_weights = nn.functional.softmax(attn_weights, dim=-1)\n",
    ),
    ("self._attn(query, key, value, attention_mask)", "self._attn(query, key.float(), value)"),
]


@pytest.mark.parametrize(("old", "new"), METHOD_MUTATIONS)
def test_a_method_refusal_names_what_is_in_the_file(old, new):
    source = SOURCE.replace(old, new)
    assert source != SOURCE
    with pytest.raises(UnsupportedModelError) as refused:
        convert_source(source, SPEC, filename="modeling_vendor.py")
    _assert_true_refusal(str(refused.value), source)


def test_einsum_attention_refusal_names_what_is_in_the_file(tmp_path):
    """The einsum attention converts in the paged seam; Legacy (which wraps [b, h, s, d]
    kernels only) and an einsum contracting the positions are refused naming what is there."""
    model = tmp_path / "model"
    shutil.copytree(VENDOR_ROOT / "mqa_groups_sbhd", model)
    modeling = model / "modeling_vendor_glm.py"
    text = modeling.read_text(encoding="utf-8")
    start = text.index("        query_layer, key_layer, value_layer = [\n")
    end = text.index("        # [b, np, sq, hn] -> [sq, b, hp]\n")
    source = text[:start] + EINSUM_BMM + text[end:]
    modeling.write_text(source, encoding="utf-8")
    assert _refusal(model, tmp_path / "paged", "framework", "paged") is None
    message = _refusal(model, tmp_path / "legacy", "framework", "legacy")
    assert message is not None
    _assert_true_refusal(message, source)
    wrong = source.replace('"sbhd,tbhd->bhst"', '"sbhd,tbhd->bhsd"')
    modeling.write_text(wrong, encoding="utf-8")
    message = _refusal(model, tmp_path / "wrong", "framework", "paged")
    assert message is not None and '"sbhd,tbhd->bhsd"' in message
    _assert_true_refusal(message, wrong)


def test_falcons_alibi_branches_convert_under_its_config_and_refusals_name_the_branch(tmp_path):
    """transformers' own Falcon: ``if alibi is None:`` SDPA, else matmul scores plus the
    ALiBi bias, each branch with its own output projection and return. With config.alibi
    false the seam keeps the SDPA branch and converts; Legacy (which wraps no SDPA over
    [b, h, s, d] from a class that is not an interface call) and config.alibi true are
    refused naming what is in the file."""
    spec = importlib.util.find_spec("transformers.models.falcon.modeling_falcon")
    source = Path(spec.origin).read_text(encoding="utf-8")
    assert _refusal(Path("falcon"), tmp_path / "paged", "framework", "paged") is None
    message = _refusal(Path("falcon"), tmp_path / "legacy", "framework", "legacy")
    assert message is not None
    _assert_true_refusal(message, source)
    for kv_mode in ("legacy", "auto"):
        try:
            apply_model(
                "falcon",
                tmp_path / f"alibi-{kv_mode}",
                ApplyOptions(config_overrides={"alibi": True}, kv_mode=kv_mode),
            )
        except UnsupportedModelError as refused:
            message = str(refused)
        else:
            raise AssertionError("a Falcon config with alibi true converted")
        assert "config.alibi is True, so alibi is built" in message
        assert "FalconModel.forward folds alibi into the attention mask" in message
        _assert_true_refusal(message, source)
