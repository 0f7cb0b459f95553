"""The serving benchmark's cell: systems take turns in one process, and one system failing
(at construction or in a timed run) leaves the others' records whole."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _cell  # noqa: E402
from _common import KVStats, RunResult  # noqa: E402
from _hf_systems import NotRunnableError  # noqa: E402


class _FakeSystem:
    """A system whose runs take a fixed time and answer each request with its own index."""

    def __init__(self, name: str, log: list[str], *, wall_s: float, fail_on_run: int = 0):
        self.name, self.log, self.wall_s = name, log, wall_s
        self.fail_on_run = fail_on_run
        self.timed_runs = 0
        self.closed = False

    def run(self, workload) -> RunResult:
        warmup = workload.name.endswith("-warmup")
        self.log.append(f"{self.name}:{'warmup' if warmup else 'run'}")
        if not warmup:
            self.timed_runs += 1
            if self.timed_runs == self.fail_on_run:
                raise RuntimeError("lost its cache")
        tokens = [[i] * m for i, m in enumerate(workload.max_tokens)]
        kv = KVStats(held_bytes=100, live_bytes=90)
        return RunResult(tokens=tokens, wall_s=self.wall_s, ttft_s=[0.1] * len(tokens), kv=kv)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def systems(monkeypatch):
    log: list[str] = []
    made: dict[str, _FakeSystem] = {}

    def make_runner(system, model, spec, workload):
        if system == "cannot_build":
            raise NotRunnableError("its cache cannot hold this model")
        if system == "cannot_close":
            fake = _FakeSystem(system, log, wall_s=1.0)
            made[system] = fake

            def close():
                raise OSError("its worker thread did not stop")

            return fake.run, close
        fake = _FakeSystem(
            system,
            log,
            wall_s=2.0 if system == "slow" else 1.0,
            fail_on_run=2 * (system == "flaky"),
        )
        made[system] = fake
        return fake.run, fake.close

    monkeypatch.setattr(_cell, "make_runner", make_runner)
    return log, made


def _run(names: list[str], repeats: int = 3) -> dict[str, dict]:
    from _common import MODELS

    spec = MODELS["qwen3-2l-h128"]
    records = _cell.run_workload(names, dict.fromkeys(names, repeats), None, spec, "W2")
    assert [r["system"] for r in records] == names
    return {r["system"]: r for r in records}


def test_timed_runs_take_turns_after_every_warm_up_in_a_rotating_order(systems):
    log, made = systems
    records = _run(["fast", "slow"])
    assert log == ["fast:warmup", "slow:warmup"] + ["fast:run", "slow:run", "slow:run"] + [
        "fast:run",
        "fast:run",
        "slow:run",
    ]
    assert records["fast"]["wall_s_runs"] == [1.0] * 3
    assert records["slow"]["wall_s"] == 2.0
    assert records["fast"]["tokens_per_s"] == 2 * records["slow"]["tokens_per_s"]
    assert records["fast"]["lengths_ok"] and records["fast"]["deterministic"]
    assert records["fast"]["kv"]["utilization"] == 0.9
    assert all(fake.closed for fake in made.values())


def test_a_system_that_cannot_be_built_is_reported_and_the_others_still_run(systems):
    log, made = systems
    records = _run(["fast", "cannot_build", "slow"])
    assert records["cannot_build"] == {
        "system": "cannot_build",
        "workload": "W2",
        "error": "its cache cannot hold this model",
        "not_runnable": True,
    }
    assert len(records["fast"]["wall_s_runs"]) == len(records["slow"]["wall_s_runs"]) == 3
    assert all(fake.closed for fake in made.values())


def test_a_system_failing_mid_run_drops_out_and_is_closed(systems):
    log, made = systems
    records = _run(["flaky", "fast"])
    assert records["flaky"]["error"] == "RuntimeError: lost its cache"
    assert not records["flaky"]["not_runnable"]
    assert "wall_s" not in records["flaky"]
    assert log.count("flaky:run") == 2  # not run again after it failed
    assert records["fast"]["wall_s_runs"] == [1.0] * 3
    assert made["flaky"].closed


def test_a_runner_that_fails_to_close_keeps_its_numbers_and_the_others_close(systems):
    log, made = systems
    records = _run(["cannot_close", "fast"])
    assert records["cannot_close"]["close_error"] == "OSError: its worker thread did not stop"
    assert records["cannot_close"]["wall_s_runs"] == [1.0] * 3
    assert "close_error" not in records["fast"]
    assert made["fast"].closed
