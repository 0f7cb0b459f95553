"""``kvskill run`` on the toy converted model: summary table, JSON, prompt files, errors."""

import json
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.cli import main  # noqa: E402
from kvskill.commands.run import parse_prompt_ids, parse_size  # noqa: E402
from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=5)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_run_prints_summary_table(capsys, toy_dir):
    code, out, _ = run_cli(
        capsys, "run", str(toy_dir), "--trust-remote-code", "--num-requests", "5",
        "--prompt-len", "12", "--max-tokens", "6", "--num-blocks", "12", "--block-size", "4",
    )  # fmt: skip
    assert code == 0
    for label in ("requests", "generated tokens", "throughput", "preemptions"):
        assert label in out
    assert "KV FullAttention blocks  peak" in out and "/11 (block size 4)" in out
    assert out.count("request 0-") == 5
    assert "/ reference (decode in " in out


def test_run_json_matches_python_api(capsys, toy_dir):
    code, out, _ = run_cli(
        capsys, "run", str(toy_dir), "--trust-remote-code", "--prompt-ids", "1,2,3;9,8,7,6,5",
        "--max-tokens", "4", "--num-blocks", "32", "--format", "json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    llm = LLM(toy_dir, trust_remote_code=True, num_blocks=32)
    expected = llm.generate([[1, 2, 3], [9, 8, 7, 6, 5]], SamplingParams(max_tokens=4))
    assert [r["token_ids"] for r in report["requests"]] == [o.token_ids for o in expected]
    assert report["summary"]["generated_tokens"] == 8
    assert report["kv_cache"]["SlidingWindow"]["blocks_used_now"] == 0
    from kvskill.runtime.ops import cpu_kernels

    # on the reference ops the report says where plain decode attention ran, and why
    assert report["ops_backend"] == "reference"
    assert report["cpu_decode_kernel"] == {
        "in_use": cpu_kernels.status().available,
        "reason": cpu_kernels.status().reason,
    }


def test_run_reads_prompt_files(tmp_path):
    (tmp_path / "p.jsonl").write_text("[1, 2]\n\n[3]\n")
    (tmp_path / "p.json").write_text("[[4, 5], [6]]")
    (tmp_path / "one.json").write_text("[7, 8, 9]")
    assert parse_prompt_ids(str(tmp_path / "p.jsonl")) == [[1, 2], [3]]
    assert parse_prompt_ids(str(tmp_path / "p.json")) == [[4, 5], [6]]
    assert parse_prompt_ids(str(tmp_path / "one.json")) == [[7, 8, 9]]
    assert parse_prompt_ids("1, 2,3;4") == [[1, 2, 3], [4]]


def test_parse_size():
    assert parse_size("256MiB") == 256 * 2**20
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size("2k") == 2048  # a bare letter is binary (kvskill.core.sizes)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-ids", "1,x"], "neither a comma list"),
        (["--prompt-ids", "1,500"], "outside the vocabulary"),
        ([], "give --prompt-ids or --num-requests"),
        (["--num-requests", "2", "--prompt-len", "600"], "leaves no room to generate"),
        (["--prompt-ids", "1", "--num-blocks", "8", "--kv-memory", "1MiB"], "not both"),
        (["--prompt-ids", "1", "--kv-memory", "lots"], "is not a size"),
        (["--prompt-ids", "1", "--speculative-tokens", "1"], "has no MTP layers"),
    ],
)
def test_run_bad_input_exits_2(capsys, toy_dir, args, message):
    code, _, err = run_cli(capsys, "run", str(toy_dir), "--trust-remote-code", *args)
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_run_json_error_shape(capsys, toy_dir):
    code, out, _ = run_cli(capsys, "run", str(toy_dir), "--prompt-ids", "1", "--format", "json")
    assert code == 2
    assert json.loads(out)["error"]["code"] == "bad_input"
    assert "--trust-remote-code" in json.loads(out)["error"]["message"]


def test_run_without_weights_needs_random_weights(capsys, tmp_path):
    bare = write_toy_dir(tmp_path / "bare", weights=False)
    code, _, err = run_cli(capsys, "run", str(bare), "--trust-remote-code", "--prompt-ids", "1")
    assert code == 2 and "--random-weights" in err
    code, out, _ = run_cli(
        capsys, "run", str(bare), "--trust-remote-code", "--random-weights", "--prompt-ids",
        "1,2", "--max-tokens", "3", "--num-blocks", "8", "--format", "json",
    )  # fmt: skip
    assert code == 0 and len(json.loads(out)["requests"][0]["token_ids"]) == 3


def _layout_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "[non-contiguous-kv-cache]" in r.getMessage()]


def test_llm_log_layout_parameter_switches_the_layout_lines(caplog, toy_dir):
    with caplog.at_level(logging.DEBUG, logger="kvskill.runtime.layout"):
        LLM(toy_dir, trust_remote_code=True, num_blocks=12, block_size=4)
    assert _layout_lines(caplog) == []
    with caplog.at_level(logging.DEBUG, logger="kvskill.runtime.layout"):
        llm = LLM(toy_dir, trust_remote_code=True, num_blocks=12, block_size=4, log_layout=True)
    lines = _layout_lines(caplog)
    # one line per cache tensor of every layer, in the contiguous layout
    num_tensors = sum(len(layer.caches) for layer in llm.cache_info.layer_infos)
    assert len(lines) == num_tensors
    assert all(" mode=contiguous " in line for line in lines)


@pytest.mark.parametrize(
    ("flag", "env", "expect_lines"),
    [
        (True, None, True),  # --log-layout
        (False, "1", True),  # KVSKILL_LOG_LAYOUT=1 is the flag's default
        (False, "0", False),
        (False, None, False),
    ],
)
def test_run_log_layout_flag_and_its_environment_default(
    capsys, caplog, monkeypatch, toy_dir, flag, env, expect_lines
):
    if env is None:
        monkeypatch.delenv("KVSKILL_LOG_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("KVSKILL_LOG_LAYOUT", env)
    args = ["--log-layout"] if flag else []
    with caplog.at_level(logging.DEBUG, logger="kvskill.runtime.layout"):
        code, _, _ = run_cli(
            capsys, "run", str(toy_dir), "--trust-remote-code", "--prompt-ids", "1,2,3",
            "--max-tokens", "2", "--num-blocks", "12", "--block-size", "4", *args,
        )  # fmt: skip
    assert code == 0
    assert bool(_layout_lines(caplog)) is expect_lines


def test_default_budget_repeats_and_says_why(capsys, toy_dir, monkeypatch):
    """Two identical runs get the same pools: the default budget does not follow free memory."""
    from kvskill.runtime import kv_cache_setup

    budgets = []
    for free in (3 << 30, 17 << 30):
        monkeypatch.setattr(kv_cache_setup, "available_memory_bytes", lambda _d, f=free: f)
        code, out, _ = run_cli(
            capsys, "run", str(toy_dir), "--trust-remote-code", "--prompt-ids", "1,2,3",
            "--max-tokens", "2", "--max-num-seqs", "4", "--max-model-len", "64",
            "--format", "json",
        )  # fmt: skip
        assert code == 0
        report = json.loads(out)
        budgets.append((report["kv_budget"], report["kv_cache"]["FullAttention"]["blocks_total"]))
    assert budgets[0] == budgets[1]
    budget = budgets[0][0]
    assert budget["rule"] == "default" and budget["num_blocks_per_group"] is None
    assert budget["reason"].startswith("default: 4 requests x 64 tokens (16 block(s) of 4 each)")


def test_without_a_budget_or_length_run_sizes_the_pool_for_its_own_prompts(capsys, toy_dir):
    """Three short prompts get what they need, not --max-num-seqs requests of the model's
    whole context; the report says what sized it. A given --max-model-len still decides."""
    code, out, _ = run_cli(
        capsys, "run", str(toy_dir), "--trust-remote-code", "--prompt-ids", "1,2,3;4,5;6",
        "--max-tokens", "5", "--format", "json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["max_model_len"] == 3 + 5
    budget = report["kv_budget"]
    assert budget["rule"] == "default"
    # 8 tokens rounded up to whole blocks of the toy's 4 tokens
    assert budget["reason"].startswith("default: 3 requests x 8 tokens (2 block(s) of 4 each)")
    assert "the longest 3 tokens + --max-tokens 5 = max_model_len 8" in budget["workload"]
    assert all(len(r["token_ids"]) == 5 for r in report["requests"])
    code, out, _ = run_cli(
        capsys, "run", str(toy_dir), "--trust-remote-code", "--num-requests", "2",
        "--prompt-len", "6", "--max-tokens", "3", "--max-model-len", "64", "--format", "json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["max_model_len"] == 64 and report["kv_budget"]["workload"] is None
    assert report["kv_budget"]["reason"].startswith("default: 128 requests x 64 tokens")


def test_default_budget_is_capped_by_total_memory(monkeypatch, toy_dir):
    from kvskill.runtime import kv_cache_setup

    monkeypatch.setattr(kv_cache_setup, "total_memory_bytes", lambda _d: 2 << 30)
    llm = LLM(toy_dir, trust_remote_code=True, max_num_seqs=64, max_model_len=16384)
    assert llm.kv_budget.kv_memory_bytes == (2 << 30) // 10
    assert "capped at 10% of 2.00 GiB total" in llm.kv_budget.reason


def test_given_block_count_is_per_cache_group(capsys, toy_dir):
    code, out, _ = run_cli(
        capsys, "run", str(toy_dir), "--trust-remote-code", "--prompt-ids", "1,2,3",
        "--max-tokens", "2", "--num-blocks", "9", "--format", "json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["kv_budget"]["reason"] == "9 blocks per cache group, as given"
    # the null block is one of the nine, in every group
    assert {kv["blocks_total"] for kv in report["kv_cache"].values()} == {8}
