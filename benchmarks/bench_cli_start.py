"""Start-up time of the CLI calls an agent makes most, against a bare interpreter.

Each call is a fresh process (as the agent's shell runs it); variants alternate per round so
a change in machine load touches all of them alike, and each figure is the median of the
rounds. ``python -c pass`` is the floor every call pays; ``import torch`` is what a call paid
when every verb loaded the runtime.

    .venv/bin/python benchmarks/bench_cli_start.py [--rounds 7] [--out results/bench_cli_start.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import environment, load_average  # noqa: E402

TOY = REPO_ROOT / "tests" / "fixtures" / "toy_model" / "modeling_toy.py"
#: a config-only directory of a built-in type: analyze reads transformers' modeling file as
#: source and the config class for its defaults (transformers 5 imports torch for that)
CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
}


def _calls(config_dir: Path) -> dict[str, list[str]]:
    kvskill = [sys.executable, "-m", "kvskill"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "kvskill --help": [*kvskill, "--help"],
        "kvskill lint FILE": [*kvskill, "lint", str(TOY)],
        "kvskill analyze DIR --format json": [
            *kvskill,
            "analyze",
            str(config_dir),
            "--format",
            "json",
        ],
    }


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_cli_start.json")
    args = parser.parse_args(argv)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as scratch:
        config_dir = Path(scratch)
        (config_dir / "config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
        calls = _calls(config_dir)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for command in calls.values():  # warm the file cache once
            _seconds(command)
        for _ in range(args.rounds):
            for name, command in calls.items():
                times[name].append(_seconds(command))
    floor = statistics.median(times["python -c pass"])
    rows = [
        {
            "call": name,
            "median_s": round(statistics.median(samples), 3),
            "vs_python_pass": round(statistics.median(samples) / floor, 1),
        }
        for name, samples in times.items()
    ]
    print(f"{'call':36} {'median s':>9} {'x python -c pass':>17}")
    for row in rows:
        print(f"{row['call']:36} {row['median_s']:9.3f} {row['vs_python_pass']:17.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "bench_cli_start",
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "rows": rows,
        "environment": environment(),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
