"""The rewrite registry: stable codes, one order for every path, and each rewrite alone.

Every registered rewrite is run by itself on whole files: a file it has nothing to do in
(unchanged), the output of a full conversion (unchanged: converted code is a fixed point of
every rewrite), and a before file with aliased imports, compared with its recorded after file
(``rewrites/<code>.<path>.after.py``; regenerate with ``KVSKILL_WRITE_REWRITES=1`` after an
intended change, and read the diff before committing it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from kvskill.implementer.facts import CACHE_ENTRIES_ASSIGN
from kvskill.implementer.imports import AbsoluteImportsCommand, RuntimeImportsCommand
from kvskill.implementer.legacy_codemods import LegacySpec
from kvskill.implementer.mla import CacheWrite, MlaSpec
from kvskill.implementer.pipeline import convert, parse
from kvskill.implementer.registry import (
    REWRITES,
    ConversionPath,
    Rewrite,
    rewrite_by_code,
    rewrites_for,
)
from kvskill.implementer.spec import ConversionSpec, FaVersion
from libcst.codemod import CodemodContext
from libcst.matchers import findall

HERE = Path(__file__).resolve().parent / "rewrites"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PACKAGE = "transformers.models.mini"

PAGED_SPEC = ConversionSpec(
    fa_version=FaVersion.V1,
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)
MLA_SPEC = MlaSpec(
    fa_version=FaVersion.V1,
    input_layout="TND_NTD",
    attn_type="FullAttention",
    sparse_mode={"prefill": 3, "decode": 0},
    cache_write=CacheWrite.SCATTER,
    block_size=16,
)
LEGACY_SPEC = LegacySpec(
    fa_version=FaVersion.V1, input_layout="BSH", uniform_attn_type="FullAttention"
)
COMPRESSED_SPEC = ConversionSpec(
    fa_version=FaVersion.V2,
    input_layout="TND",
    uniform_attn_type="SlidingWindow",
    sparse_mode={"SlidingWindow": {"prefill": 4, "decode": 4}},
    has_sinks=True,
    compressed_attention=True,
)
SPECS = {
    ConversionPath.PAGED: PAGED_SPEC,
    ConversionPath.CONTIGUOUS: PAGED_SPEC,
    ConversionPath.MLA: MLA_SPEC,
    ConversionPath.LEGACY: LEGACY_SPEC,
    ConversionPath.FRAMEWORK_LEGACY: PAGED_SPEC,
    ConversionPath.STANDALONE_LEGACY: PAGED_SPEC,
    ConversionPath.COMPRESSED: COMPRESSED_SPEC,
}
BEFORE = {
    ConversionPath.PAGED: HERE / "before_paged.py",
    ConversionPath.CONTIGUOUS: HERE / "before_paged.py",
    ConversionPath.MLA: FIXTURES / "mla_toy_modeling.py",
    ConversionPath.LEGACY: HERE / "before_paged.py",
    # the framework's own Legacy attention (cache_unit rows, BSH fused attention)
    ConversionPath.FRAMEWORK_LEGACY: FIXTURES
    / "cann_legacy"
    / "gqa_dense"
    / "modeling_legacy_gqa.py",
    # the framework's standalone Legacy model (init_cache rows, its own runner)
    ConversionPath.STANDALONE_LEGACY: FIXTURES
    / "cann_legacy"
    / "dense_standalone"
    / "modeling_legacy_dense.py",
    # a K = V window with sinks, a compressor with its indexer (DeepSeek-V4's shape)
    ConversionPath.COMPRESSED: HERE / "before_compressed.py",
}
#: the paths that convert the framework's own Legacy files and keep the executor's imports
OWN_LEGACY_PATHS = {ConversionPath.FRAMEWORK_LEGACY, ConversionPath.STANDALONE_LEGACY}
#: a rewrite whose work needs a file of another shape than its path's before file
BEFORE_OF_REWRITE = {
    "KVR013": HERE / "before_runtime_imports.py",
    # the framework's Legacy gated-delta states (init_cache rows per batch slot)
    "KVR022": FIXTURES / "cann_legacy" / "gqa_gated_delta" / "modeling_legacy_gated_delta.py",
    # the framework's standalone Legacy MLA attention (latent and rope caches)
    "KVR026": FIXTURES / "cann_legacy" / "mla_standalone" / "modeling_legacy_mla.py",
}
#: rewrites that run before a lower code, and why: KVR022 reads the states' row shapes from
#: init_cache, which KVR021 removes
RUNS_BEFORE = {"KVR022": "KVR021"}
#: rewrites the before files give nothing to do; the goldens (tests/goldens) freeze what they
#: do on real files: gated delta nets (qwen3_next, kimi_linear), the MLA files' relative
#: imports and mask builders (deepseek_v3, deepseek_v2); the MLA toy has no vision wrapper;
#: Mamba-1 mixers and short convs (jamba; tests/implementer/test_mamba_mixer.py); DSA indexers
#: (the MLA toy has none: tests/implementer/test_dsa.py converts deepseek_v32's, and
#: tests/implementer/test_pooled_indexer_rewrite.py glm5_next's k-pool one)
NO_WORK_IN_FIXTURE = {
    ("KVR027", "mla"),
    ("KVR030", "mla"),
    ("KVR012", "framework_legacy"),
    ("KVR012", "standalone_legacy"),
    ("KVR008", "paged"),
    ("KVR008", "mla"),
    ("KVR014", "paged"),
    ("KVR014", "mla"),
    ("KVR015", "paged"),
    ("KVR015", "mla"),
    ("KVR016", "paged"),
    ("KVR016", "mla"),
    ("KVR017", "paged"),
    ("KVR017", "mla"),
    ("KVR001", "mla"),
    ("KVR011", "mla"),
    ("KVR012", "mla"),
    ("KVR012", "compressed"),
}
NOTHING_TO_DO = '''\
"""A module with no model in it."""

import torch as th
from torch import nn


def helper(x):
    # a comment kept as written
    return th.relu(x)  # trailing


class Block(nn.Module):
    def forward(self, x):
        return helper(x)
'''

CASES = [(rewrite, path) for rewrite in REWRITES for path in sorted(rewrite.paths)]


def _case_id(case: tuple[Rewrite, ConversionPath]) -> str:
    return f"{case[0].code}-{case[1].value}"


def run_alone(rewrite: Rewrite, path: ConversionPath, source: str) -> str:
    command = rewrite.command(CodemodContext(filename="modeling_mini.py"), SPECS[path], PACKAGE)
    return command.transform_module(parse(source)).code


def test_codes_are_unique_stable_and_in_order():
    codes = [rewrite.code for rewrite in REWRITES]
    assert all(re.fullmatch(r"KVR\d{3}", code) for code in codes)
    # the runtime imports (KVR013) run last whatever the code; rewrites added later
    # (state mixers, KVR014...) take the next codes and run before it
    assert len(codes) == len(set(codes)), "codes are unique"
    assert codes[-1] == "KVR013"
    ordered = sorted(codes[:-1])
    for early, late in RUNS_BEFORE.items():
        ordered.remove(early)
        ordered.insert(ordered.index(late), early)
    assert codes[:-1] == ordered, "codes are listed in running order"
    assert all(rewrite.summary for rewrite in REWRITES), "every rewrite says what it does"
    assert rewrite_by_code("KVR003").command.__name__ == "AttentionForwardCommand"
    with pytest.raises(KeyError):
        rewrite_by_code("KVR999")


def test_the_framework_legacy_path_keeps_the_executors_imports():
    commands = [
        rewrite.command.__name__ for rewrite in rewrites_for(ConversionPath.FRAMEWORK_LEGACY)
    ]
    # a framework file imports the executor's cache classes, never kvskill's runtime
    assert commands == [
        "AbsoluteImportsCommand",
        "LocalTextModelCommand",
        "FrameworkLegacyAttentionCommand",
        "FrameworkLegacyStatesCommand",
        "FrameworkLegacyModelCommand",
    ]


def test_the_standalone_legacy_path_keeps_the_executors_imports():
    commands = [
        rewrite.command.__name__ for rewrite in rewrites_for(ConversionPath.STANDALONE_LEGACY)
    ]
    # the runner's own model file stays on the executor's metadata, never kvskill's runtime
    assert commands == [
        "AbsoluteImportsCommand",
        "LocalTextModelCommand",
        "StandaloneLegacyAttentionCommand",
        "StandaloneLegacyModelCommand",
        "StandaloneLegacyMlaAttentionCommand",
    ]


@pytest.mark.parametrize("path", sorted(set(ConversionPath) - OWN_LEGACY_PATHS))
def test_every_path_starts_with_absolute_imports_and_ends_with_runtime_imports(path):
    commands = [rewrite.command for rewrite in rewrites_for(path)]
    assert commands[0] is AbsoluteImportsCommand
    assert commands[-1] is RuntimeImportsCommand
    # each path has its own attention __init__ and forward rewrite and a model-class rewrite
    names = {c.__name__ for c in commands}
    assert sum(n.endswith("AttentionInitCommand") for n in names) == 1
    assert sum(n.endswith("AttentionForwardCommand") for n in names) == 1
    assert sum(n.endswith("CacheInfoCommand") for n in names) == 1


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_file_with_nothing_to_convert_is_unchanged(case):
    rewrite, path = case
    assert run_alone(rewrite, path, NOTHING_TO_DO) == NOTHING_TO_DO


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_converted_code_is_a_fixed_point_of_each_rewrite(case):
    rewrite, path = case
    before = BEFORE[path].read_text(encoding="utf-8")
    converted = convert(before, SPECS[path], path, package=PACKAGE, filename="modeling_mini.py")
    if path is ConversionPath.STANDALONE_LEGACY:
        # the runner's model allocates its paged caches itself (no cache_entries)
        assert "def set_paged_step_metadata(" in converted, "the full conversion went paged"
    else:
        assert findall(parse(converted), CACHE_ENTRIES_ASSIGN), (
            "the full conversion declared caches"
        )
    assert run_alone(rewrite, path, converted) == converted


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_rewrite_alone_gives_its_recorded_after_file(case):
    rewrite, path = case
    before = BEFORE_OF_REWRITE.get(rewrite.code, BEFORE[path]).read_text(encoding="utf-8")
    produced = run_alone(rewrite, path, before)
    if (rewrite.code, path.value) in NO_WORK_IN_FIXTURE:
        assert produced == before
        return
    assert produced != before, f"{rewrite.code} changed nothing on its before file"
    after = HERE / f"{rewrite.code}.{path.value}.after.py"
    if os.environ.get("KVSKILL_WRITE_REWRITES") == "1":
        after.write_text(produced, encoding="utf-8")
    assert after.is_file(), f"no recorded output: run with KVSKILL_WRITE_REWRITES=1 ({after.name})"
    assert produced == after.read_text(encoding="utf-8")


def test_every_rewrites_refusals_are_collected_before_any_rewrite_runs():
    from kvskill.core.errors import UnsupportedModelError

    before = (HERE / "before_paged.py").read_text(encoding="utf-8")
    # a second text model makes KVR012's own check fail; dropping the head (no lm_head, no
    # Linear to the vocabulary) fails the model check
    head = "self.lm_head = tnn.Linear(config.hidden_size, config.vocab_size, bias=False)"
    assert head in before
    broken = before.replace(head, "self.head = None") + (
        "\n\nclass OtherModel(tnn.Module):\n"
        "    def __init__(self, config):\n"
        "        super().__init__()\n"
        "        self.layers = tnn.ModuleList([MiniDecoderLayer(config, 0)])\n"
    )
    with pytest.raises(UnsupportedModelError) as refused:
        convert(broken, PAGED_SPEC, ConversionPath.PAGED, filename="modeling_mini.py")
    message = str(refused.value)
    assert "AutoModel.from_config(config.text_config)" in message  # KVR012's problem
    assert "no causal-LM class found" in message  # the path's model-class check
