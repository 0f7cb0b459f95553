"""``kvskill apply --mode standalone`` end to end: apply -> verify token-exact, refusals, mutations.

Modes: 1 contiguous (qwen3), 2 paged (qwen3, gpt_oss with sliding layers and sinks), 3 MLA
absorb over paged (deepseek_v3). Each output directory is converted once per module; tests
that change one work on a copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.lint import lint_source
from kvskill.cli import main
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.convert import source_package
from kvskill.implementer.standalone import StandaloneSpec, convert_standalone_source
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.shrink import shrink_config

pytestmark = pytest.mark.slow

PAGED = [("qwen3", 2), ("gpt_oss", 2), ("deepseek_v3", 3)]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


class Outputs:
    """Standalone outputs per (model, kv_mode), applied on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs: dict[tuple[str, str], Path] = {}

    def directory(self, model: str, kv_mode: str) -> Path:
        key = (model, kv_mode)
        if key not in self.dirs:
            out = self.root / f"{model}_{kv_mode}"
            apply_model(model, out, ApplyOptions(deploy_mode="standalone", kv_mode=kv_mode))
            self.dirs[key] = out
        return self.dirs[key]

    def copy(self, model: str, kv_mode: str, dest: Path) -> Path:
        shutil.copytree(self.directory(model, kv_mode), dest, symlinks=True)
        return dest


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Outputs:
    return Outputs(tmp_path_factory.mktemp("standalone"))


def _plan(directory: Path) -> dict:
    return json.loads((directory / "kvskill_plan.json").read_text(encoding="utf-8"))


def test_qwen3_contiguous_through_the_cli(capsys, outputs, tmp_path):
    out = tmp_path / "qwen3_contiguous"
    code, _, err = run_cli(
        capsys,
        "apply",
        "qwen3",
        "--mode",
        "standalone",
        "--kv-mode",
        "contiguous",
        "--out",
        str(out),
    )
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "kvskill_plan.json",
        "modeling_qwen3.py",
        "runner_qwen3.py",
    ]
    outputs.dirs[("qwen3", "contiguous")] = out

    # verify finds the runner and drives it: token-exact, all three chains.
    code, stdout, err = run_cli(capsys, "verify", str(out), "--format", "json")
    report = json.loads(stdout)
    assert code == 0, report["failures"]
    assert report["passed"] and report["tokens_identical"]
    assert report["max_logit_diff"] <= report["atol"]
    assert [c["name"] for c in report["chains"]] == ["init", "runtime", "release"]
    assert any("mode 1 (contiguous, BSH)" in n for n in report["notes"])

    # The runner allocates its own dense cache: a page-pool layout cannot be asked of it.
    code, _, err = run_cli(capsys, "verify", str(out), "--kv-layout", "page_pool")
    assert code == 2 and "applies to framework outputs" in err


def test_contiguous_modeling_file_is_the_legacy_bsh_path(outputs):
    directory = outputs.directory("qwen3", "contiguous")
    code = (directory / "modeling_qwen3.py").read_text(encoding="utf-8")
    assert "torch_npu.scatter_update_(self.k_cache, write_start, key, 1)" in code
    assert 'input_layout="BSH"' in code
    # no paged cache: no paged write, no block table read (the mask helper only tests for one)
    assert "npu_scatter_nd_update_" not in code and "block_table[" not in code
    assert "sparse_mode=3 if md.is_prefill else 0" in code
    assert lint_source(code, "modeling_qwen3.py") == []
    plan = _plan(directory)
    assert (plan["kv_mode"], plan["input_layout"]) == ("legacy", "BSH")
    assert plan["conversion"]["mode"] == "standalone"
    assert plan["conversion"]["standalone"]["mode"] == 1


def test_contiguous_conversion_is_idempotent(outputs):
    directory = outputs.directory("qwen3", "contiguous")
    code = (directory / "modeling_qwen3.py").read_text(encoding="utf-8")
    plan = analyze_model("qwen3", deploy_mode="standalone")
    spec = StandaloneSpec.from_plan(plan, kv_mode="contiguous")
    assert convert_standalone_source(code, spec, package=source_package(plan)) == code


@pytest.mark.parametrize(("model", "mode"), PAGED, ids=[m for m, _ in PAGED])
def test_paged_modes_verify_token_exact(outputs, model, mode):
    directory = outputs.directory(model, "paged")
    assert _plan(directory)["conversion"]["standalone"]["mode"] == mode
    code = next(directory.glob("modeling_*.py")).read_text(encoding="utf-8")
    assert "md.block_table[self.attn_type]" in code and "md.slot_mapping[self.attn_type]" in code
    if mode == 3:
        assert "self.nope_cache" in code and "self.rope_cache" in code
    report = verify_directory(directory, VerifyOptions())
    assert report.passed, report.failures()
    assert report.tokens_identical and report.max_logit_diff <= report.atol


def test_gpt_oss_contiguous_is_refused_with_the_operator_constraints(capsys, tmp_path):
    out = tmp_path / "gpt_oss_contiguous"
    code, _, err = run_cli(
        capsys,
        "apply",
        "gpt_oss",
        "--mode",
        "standalone",
        "--kv-mode",
        "contiguous",
        "--out",
        str(out),
    )
    assert code == 3
    assert "learnable_sink" in err and "TND" in err
    assert "decode branch" in err and "pre_tokens" in err
    assert not out.exists()


def test_mla_refusals_and_absorb_flag():
    deepseek = analyze_model("deepseek_v3", deploy_mode="standalone")
    with pytest.raises(UnsupportedModelError, match="--kv-mode paged"):
        StandaloneSpec.from_plan(deepseek, kv_mode="contiguous")
    with pytest.raises(UnsupportedModelError, match="--mla-absorb off"):
        StandaloneSpec.from_plan(deepseek, kv_mode="paged", mla_absorb="off")
    assert StandaloneSpec.from_plan(deepseek, mla_absorb="on").mode_number == 3
    qwen3 = analyze_model("qwen3", deploy_mode="standalone")
    with pytest.raises(BadInputError, match="not MLA"):
        StandaloneSpec.from_plan(qwen3, mla_absorb="on")


def _insert_after(path: Path, anchor: str, line: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(anchor) == 1, anchor
    path.write_text(text.replace(anchor, anchor + line), encoding="utf-8")


def test_attention_advancing_kv_len_fails_verify_contiguous(outputs, tmp_path):
    directory = outputs.copy("qwen3", "contiguous", tmp_path / "mutant")
    modeling = directory / "modeling_qwen3.py"
    # The seed's classic mistake: every layer bumps the shared kv_len after its write.
    _insert_after(
        modeling,
        "self.update_cache(md.kv_len, key_bsh, value_bsh)\n",
        "        md.kv_len += 1\n",
    )
    assert "KV008" in {f.rule for f in lint_source(modeling.read_text(encoding="utf-8"))}
    report = verify_directory(directory, VerifyOptions(trust_remote_code=True))
    assert not report.passed
    assert not report.tokens_identical  # later layers wrote at shifted positions
    runtime = next(c for c in report.chains if c["name"] == "runtime")
    assert not runtime["passed"]
    assert any("a layer advanced kv_len" in f for f in runtime["failures"])


def test_attention_advancing_kv_len_fails_verify_paged(outputs, tmp_path):
    directory = outputs.copy("qwen3", "paged", tmp_path / "mutant")
    # Paged layers address the cache by slot_mapping, so tokens survive: the chain catches it.
    _insert_after(
        directory / "modeling_qwen3.py",
        "self.update_cache(md.slot_mapping[self.attn_type], key_tnd, value_tnd)\n",
        "        md.kv_len += 1\n",
    )
    report = verify_directory(directory, VerifyOptions(trust_remote_code=True))
    assert not report.passed
    assert report.tokens_identical
    assert any("a layer advanced kv_len" in f for f in report.failures())


def test_runner_advancing_kv_len_twice_fails_verify(outputs, tmp_path):
    directory = outputs.copy("qwen3", "paged", tmp_path / "mutant")
    runner = directory / "runner_qwen3.py"
    text = runner.read_text(encoding="utf-8")
    anchor = "self.kv_len += 1  # the one place kv_len grows"
    assert anchor in text
    runner.write_text(text.replace(anchor, "self.kv_len += 2  # one too many"), encoding="utf-8")
    # Three tokens: the second decode step is already one position off, still inside the rows.
    report = verify_directory(directory, VerifyOptions(max_new_tokens=3, trust_remote_code=True))
    assert not report.passed and report.max_logit_diff > report.atol
    failures = report.failures()
    assert any("the runner's kv_len went wrong" in f for f in failures)
    assert not any("a layer advanced kv_len" in f for f in failures)


def test_run_drives_the_runner_and_modes_agree(capsys, outputs, tmp_path):
    tokens = {}
    for kv_mode in ("contiguous", "paged"):
        directory = outputs.copy("qwen3", kv_mode, tmp_path / kv_mode)
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        tiny = shrink_config(config).config
        (directory / "config.json").write_text(json.dumps(tiny), encoding="utf-8")
        code, stdout, err = run_cli(
            capsys,
            "run",
            str(directory),
            "--random-weights",
            "--prompt-ids",
            "1,2,3;4,5,6,7,8",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--format",
            "json",
        )
        assert code == 0, err
        report = json.loads(stdout)
        assert report["kv_mode"] == kv_mode and report["runner"] == "runner_qwen3.py"
        assert [len(r["token_ids"]) for r in report["requests"]] == [4, 4]
        tokens[kv_mode] = [r["token_ids"] for r in report["requests"]]
    # Same seeded weights, same prompts: the contiguous and paged caches give the same tokens.
    assert tokens["contiguous"] == tokens["paged"]


def test_run_refuses_sampling_flags(capsys, outputs):
    directory = outputs.directory("qwen3", "paged")
    code, _, err = run_cli(
        capsys,
        "run",
        str(directory),
        "--random-weights",
        "--prompt-ids",
        "1,2",
        "--temperature",
        "0.7",
    )
    assert code == 2 and "greedily" in err


@pytest.mark.parametrize("flag", ["--prepack-linear", "--fuse-layers"])
def test_run_refuses_runtime_only_speed_flags(capsys, outputs, flag):
    directory = outputs.directory("qwen3", "paged")
    code, _, err = run_cli(
        capsys, "run", str(directory), "--random-weights", "--prompt-ids", "1,2", flag
    )
    assert code == 2 and f"{flag} is a runtime option" in err
