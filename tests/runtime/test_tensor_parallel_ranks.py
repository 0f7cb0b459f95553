"""Tensor parallelism with real processes (gloo on the CPU): tokens equal to one process,
each rank's KV pool sized for its heads, a dead rank reported and no process left behind.

Slow: every group spawns a Python process that imports torch; one group is shared.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.cli import main  # noqa: E402
from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from kvskill.runtime.distributed import RankFailedError  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6], list(range(10, 31))]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    # one KV head: at 2 ranks it is replicated, each rank keeps one query head pair
    return write_toy_dir(tmp_path_factory.mktemp("tp") / "toy", seed=11, num_key_value_heads=1)


@pytest.fixture(scope="module")
def single(toy_dir):
    llm = LLM(toy_dir, trust_remote_code=True, num_blocks=40, block_size=4)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def group(toy_dir):
    before = os.environ.get("KVSKILL_TP_TIMEOUT_S")
    os.environ["KVSKILL_TP_TIMEOUT_S"] = "60"  # bound every wait of this group
    try:
        llm = LLM(
            toy_dir, trust_remote_code=True, num_blocks=40, block_size=4, tensor_parallel_size=2
        )
    finally:
        if before is None:
            del os.environ["KVSKILL_TP_TIMEOUT_S"]
        else:
            os.environ["KVSKILL_TP_TIMEOUT_S"] = before
    yield llm
    llm.close()


def test_two_ranks_generate_what_one_process_does(group, single):
    assert [o.token_ids for o in group.generate(PROMPTS, PARAMS)] == single
    report = group.tensor_parallel.report(group.stats.num_steps)
    assert report["kv_heads_per_rank"] == 1 and report["kv_replicated"] is True
    assert report["weights"] == "slices"
    assert report["comm_rank0"]["all_reduces"] > 0 and report["comm_s_per_step"] > 0


def test_a_dead_rank_is_reported_and_nothing_is_left(group):
    (proc,) = group.tensor_parallel.procs
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1"):
        group.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert time.monotonic() - started < 60
    group.close()
    assert not proc.is_alive()


def test_cli_run_tp2_halves_kv_bytes_per_rank(tmp_path, capsys):
    toy = write_toy_dir(tmp_path / "toy2", seed=2)  # 2 KV heads: one per rank
    args = ["run", str(toy), "--trust-remote-code", "--prompt-ids", "1,2,3;7,8", "--max-tokens",
            "3", "--num-blocks", "16", "--block-size", "4", "--format", "json"]  # fmt: skip
    outputs = []
    for extra in ([], ["--tp", "2"]):
        with pytest.raises(SystemExit) as exc:
            main(args + extra)
        assert exc.value.code == 0
        outputs.append(json.loads(capsys.readouterr().out))
    one, two = outputs
    assert [r["token_ids"] for r in two["requests"]] == [r["token_ids"] for r in one["requests"]]
    tp = two["tensor_parallel"]
    assert tp["kv_bytes_per_token_per_rank"] * 2 == tp["kv_bytes_per_token_unsplit"]


def test_cli_refuses_splits_and_backends_in_one_line(tmp_path, capsys):
    toy = write_toy_dir(tmp_path / "toy3", seed=2, weights=False)
    base = ["run", str(toy), "--trust-remote-code", "--random-weights", "--prompt-ids", "1,2"]
    for extra, message in (
        (["--tp", "3"], "4 attention heads do not divide by tensor parallel size 3"),
        (["--tp", "2", "--tp-backend", "hccl"], "backend hccl is not available"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(base + extra)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
