"""The peer benchmark's pieces that run without vLLM: the vLLM venv reports itself missing
with a reason, W5 is the issue's workload, and the summary counts requests matching
kvskill's and vLLM's tokens and keeps each round's load average."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import peers_bench as bench_peers  # noqa: E402
import pytest  # noqa: E402
import vllm_venv  # noqa: E402


def test_missing_vllm_venv_is_reported_with_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSKILL_BENCH_CACHE", str(tmp_path))
    reason = vllm_venv.missing_reason()
    assert reason is not None and str(tmp_path) in reason
    assert vllm_venv.main(["--check"]) == 1


def test_w5_is_32_requests_sharing_a_1024_token_prefix():
    wl = bench_peers.make_w5(4096)
    assert wl.num_requests == 32 and wl.max_tokens == [32] * 32
    prefix = wl.prompts[0][:1024]
    assert all(p[:1024] == prefix and 1040 <= len(p) <= 1088 for p in wl.prompts)
    assert wl.kv_capacity_tokens % 16 == 0


def test_summary_counts_matching_requests_and_keeps_round_loads():
    wl = bench_peers.make_w5(4096, requests=3, prefix_len=16, max_tokens=2)
    run = {"wall_s": 2.0, "ttft_s": [0.1, 0.2, 0.3], "cpu_s": 4.0, "peak_rss_mb": 10.0}
    runs = {
        "kvskill": [run | {"tokens": [[1, 2], [3, 4], [5, 6]], "round": 0, "load_average": [1.5]}],
        "vllm": [run | {"tokens": [[1, 2], [3, 9], [5, 6]], "round": 0, "load_average": [2.5]}],
    }
    rows = bench_peers._summarise(
        wl, "m", 2, ["kvskill", "vllm", "hf_cb"], runs, {"hf_cb": "no continuous batching"}
    )
    by = {r["system"]: r for r in rows}
    assert by["vllm"]["match_kvskill"] == 2 and by["kvskill"]["match_kvskill"] == 3
    assert by["kvskill"]["match_vllm"] == 2 and by["vllm"]["match_vllm"] == 3
    assert by["vllm"]["tokens_per_s"] == 3.0 and by["vllm"]["tokens_per_cpu_s"] == 1.5
    assert by["vllm"]["per_round"][0]["load_average"] == [2.5]
    assert by["hf_cb"] == {
        "model": "m",
        "threads": 2,
        "workload": "W5",
        "system": "hf_cb",
        "error": "no continuous batching",
    }


@pytest.mark.slow  # saves a checkpoint, then a process converts and loads it (about 10 s)
def test_a_system_runs_in_a_process_of_its_own(tmp_path, monkeypatch):
    """kvskill's default configuration served from its own runner process: it answers a
    warm-up run and a timed run with every request's tokens and that process's own CPU time
    and peak RSS, and the timed run's tokens are what the warm-up's first requests got."""
    monkeypatch.setenv("KVSKILL_BENCH_CACHE", str(tmp_path))
    spec = bench_peers.ALL_MODELS["qwen3-4l-h256"]
    ckpt = bench_peers.ensure_checkpoint(spec)
    wl = bench_peers.Workload(
        name="tiny",
        description="two short requests",
        prompts=[[5, 6, 7, 8], [9, 10, 11]],
        max_tokens=[3, 2],
        kv_capacity_tokens=64,
    )
    peer = bench_peers.SystemPeer("kvskill", "qwen3-4l-h256", ckpt, wl, threads=1)
    try:
        warm = peer.run(wl.warmup())
        timed = peer.run(wl)
    finally:
        peer.close()
    assert peer.proc.returncode == 0
    assert [len(t) for t in timed["tokens"]] == [3, 2]
    assert warm["tokens"] == timed["tokens"][: len(warm["tokens"])]
    assert timed["cpu_s"] > 0 and timed["peak_rss_mb"] > 50
