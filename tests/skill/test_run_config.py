"""``kvskill run`` builds one ``EngineConfig`` from its flags and prints the settings it changed."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.cli import main  # noqa: E402
from kvskill.commands.run import engine_config_from_options, run  # noqa: E402
from kvskill.core.errors import BadInputError  # noqa: E402
from kvskill.runtime import EngineConfig  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=5)


def config_of(*args: str) -> EngineConfig:
    """The EngineConfig run builds from ARGS (its directory and flags), without running."""
    params = dict(run.make_context("run", list(args)).params)
    kv_layout, tp = params.pop("kv_layout"), params.pop("tp")
    for name in ("directory", "output_format"):
        params.pop(name)
    return engine_config_from_options(params, kv_layout=kv_layout, tensor_parallel_size=tp or 1)


def test_default_flags_give_the_default_engine_config(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSKILL_CPU_ONLY_SHAPES", raising=False)
    config = config_of(str(tmp_path))
    # NOTE: the one field run decides itself: click has already read KVSKILL_CPU_ONLY_SHAPES
    # into the flag, so the config holds False where EngineConfig() leaves None (= read it)
    assert config.cpu_only_shapes is False
    assert replace(config, cpu_only_shapes=None) == EngineConfig()


def test_flags_map_onto_their_fields(tmp_path):
    config = config_of(
        str(tmp_path), "--kv-memory", "2MiB", "--device", "cpu", "--kv-layout", "page_pool",
        "--no-prefix-caching", "--max-num-seqs", "3", "--dtype", "bfloat16", "--seed", "7",
    )  # fmt: skip
    assert config.kv_memory_bytes == 2 * 1024 * 1024
    assert config.device == "cpu"
    assert config.use_hybrid_blocks is True
    assert config.enable_prefix_caching is False
    assert (config.max_num_seqs, config.dtype, config.seed) == (3, "bfloat16", 7)


def test_num_blocks_with_kv_memory_is_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="--num-blocks or --kv-memory, not both"):
        config_of(str(tmp_path), "--num-blocks", "8", "--kv-memory", "1MiB")


def run_cli(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code, capsys.readouterr().out


def test_the_report_names_the_settings_given_on_the_command_line(capsys, toy_dir):
    flags = (
        "--num-blocks", "12", "--block-size", "4", "--max-num-batched-tokens", "64",
        "--no-prefix-caching", "--seed", "3",
    )  # fmt: skip
    common = ("run", str(toy_dir), "--trust-remote-code", "--cpu-only-shapes", "--prompt-ids")
    code, out = run_cli(capsys, *common, "1,2,3;4,5", "--max-tokens", "3", *flags)
    assert code == 0
    (line,) = [row for row in out.splitlines() if row.startswith("engine config")]
    for given in (
        "num_blocks=12",
        "block_size=4",
        "max_num_batched_tokens=64",
        "enable_prefix_caching=False",
        "seed=3",
        "trust_remote_code=True",
    ):
        assert given in line, line
    # defaults are left out: the line lists what this run changed
    for default in ("dtype=", "max_num_seqs=", "tensor_parallel_size=", "prepack_linear="):
        assert default not in line, line

    # the JSON form holds every field, the given ones with their values
    code, out = run_cli(
        capsys, *common, "1,2,3;4,5", "--max-tokens", "3", *flags, "--format", "json"
    )
    assert code == 0
    config = json.loads(out)["engine_config"]
    assert set(config) == set(EngineConfig().to_dict())
    assert (config["num_blocks"], config["block_size"], config["seed"]) == (12, 4, 3)
    assert config["enable_prefix_caching"] is False and config["dtype"] == "float32"


def test_the_workload_sizing_shows_in_the_printed_config(capsys, toy_dir):
    # no budget and no --max-model-len: the pool is sized for these two prompts
    code, out = run_cli(
        capsys, "run", str(toy_dir), "--trust-remote-code", "--cpu-only-shapes",
        "--prompt-ids", "1,2,3;4,5", "--max-tokens", "4", "--block-size", "4",
    )  # fmt: skip
    assert code == 0
    (line,) = [row for row in out.splitlines() if row.startswith("engine config")]
    assert "max_model_len=7" in line and "max_num_seqs=2" in line, line


def test_the_report_names_each_fast_path_and_exact_names_none(capsys, toy_dir):
    common = ("run", str(toy_dir), "--trust-remote-code", "--cpu-only-shapes")
    common += ("--prompt-ids", "1,2,3;4,5", "--max-tokens", "3", "--block-size", "4")
    # a path turned off by hand is reported off with its flag as the reason
    code, out = run_cli(capsys, *common, "--no-screen-output-head", "--format", "json")
    assert code == 0
    report = json.loads(out)
    assert report["exact"] is False
    # the toy's config names no dtype: analyze sizes it at bfloat16, this run at float32
    assert report["kv_budget"]["dtype"] == {
        "pool": ["float32"],
        "run": "float32",
        "model": "bfloat16",
    }
    assert set(report["fast_paths"]) == {"prepack_linear", "fuse_layers", "screen_output_head"}
    screen = report["fast_paths"]["screen_output_head"]
    assert (screen["on"], screen["reason"]) == (
        False,
        "screen_output_head=False (--no-screen-output-head)",
    )
    code, out = run_cli(capsys, *common, "--no-screen-output-head")
    assert code == 0
    assert "screened head            off: screen_output_head=False" in out
    # the pool's dtype and the model's (what analyze sizes at) are named beside the budget
    assert (
        "sized at float32 (--dtype float32); analyze sizes at the model's bfloat16: "
        "`kvskill run --dtype bfloat16` allocates its block counts"
    ) in out

    code, out = run_cli(capsys, *common, "--exact")
    assert code == 0
    (line,) = [row for row in out.splitlines() if row.startswith("compute")]
    assert "exact (--exact)" in line
    assert "prepacked linears" not in out and "fused layers" not in out


def test_exact_with_a_fast_path_flag_is_bad_input(capsys, toy_dir):
    with pytest.raises(SystemExit) as exc:
        main(["run", str(toy_dir), "--prompt-ids", "1,2", "--exact", "--fuse-layers"])
    assert exc.value.code == 2
    assert "fuse_layers=True is a fast path" in capsys.readouterr().err
