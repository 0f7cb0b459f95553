"""`kvskill apply` then `kvskill verify` for every causal-LM model type of the installed
transformers, each in its own process, and a summary of the outcomes.

    .venv/bin/python scripts/verify_corpus.py --jobs 2 --json corpus.json
    .venv/bin/python scripts/verify_corpus.py llama beam laguna
    .venv/bin/python scripts/verify_corpus.py --vision-language --json corpus.json

Configs are transformers' defaults (verify shrinks them); nothing is downloaded. A process
per model keeps one model's crash or memory from touching the others. Outcomes:

    verified       apply exit 0, verify exit 0 (token-exact, logits within atol, chains hold)
    verify_failed  verify exit 1: the conversion runs but differs from the original
    refused        apply exit 3 with its reason (not a causal decoder, a blocker, ...)
    bad_input      apply or verify exit 2 (e.g. the original cannot be built from the config)
    crashed        any other exit: a bug in kvskill, reported with its message

The whole corpus takes about an hour with two jobs on a 2-core machine.

Every model's processes run with the same settings whatever ``--jobs`` is: ``--threads``
torch threads (1 by default: the thread count changes the order of float32 sums, so a
verdict near its tolerance would otherwise depend on how many jobs share the machine) and
a fixed ``PYTHONHASHSEED``; verify seeds its own random weights and prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

APPLY_TIMEOUT_S = 180
VERIFY_TIMEOUT_S = 600


@dataclass
class Outcome:
    model_type: str
    outcome: str
    apply_exit: int | None
    verify_exit: int | None
    #: the refusal, error or first failure, on one line
    message: str = ""


def child_env(threads: int) -> dict[str, str]:
    """The environment of every kvskill process: THREADS threads, a fixed hash seed."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    env["PYTHONHASHSEED"] = "0"
    return env


def _kvskill(args: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str, str]:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvskill", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return -1, "", f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout, done.stderr


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_one(model_type: str, workdir: Path, env: dict[str, str]) -> Outcome:
    out = workdir / model_type
    code, _, err = _kvskill(
        ["apply", model_type, "--out", str(out), "--force"], APPLY_TIMEOUT_S, env
    )
    if code != 0:
        kind = {3: "refused", 2: "bad_input"}.get(code, "crashed")
        return Outcome(model_type, kind, code, None, _last_line(err))
    code, stdout, err = _kvskill(["verify", str(out), "--format", "json"], VERIFY_TIMEOUT_S, env)
    message = _last_line(err)
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError:
        report = {}
    if isinstance(report.get("error"), dict):  # the CLI's error object
        message = report["error"].get("message", message)[:300]
    elif report.get("failures"):
        message = report["failures"][0][:300]
    kind = {0: "verified", 1: "verify_failed", 2: "bad_input"}.get(code, "crashed")
    return Outcome(model_type, kind, 0, code, message)


def _vision_language_types() -> list[str]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return sorted(
        set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="default: every causal-LM model type")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of each model's processes"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every outcome here")
    parser.add_argument(
        "--vision-language",
        action="store_true",
        help="also the image-text-to-text types transformers maps to no causal-LM class",
    )
    args = parser.parse_args(argv)

    from kvskill.analyzer.corpus import corpus_model_types

    types = list(args.model_types or corpus_model_types())
    if args.vision_language:
        types += [t for t in _vision_language_types() if t not in types]
    with (
        tempfile.TemporaryDirectory(prefix="kvskill-corpus-") as tmp,
        ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool,
    ):
        env = child_env(max(1, args.threads))

        def run_and_tell(model_type: str) -> Outcome:
            outcome = run_one(model_type, Path(tmp), env)
            # one stderr line per model as it ends: a run cut short still says what it found
            print(f"{model_type}: {outcome.outcome}", file=sys.stderr, flush=True)
            return outcome

        outcomes = list(pool.map(run_and_tell, types))
    counts = Counter(o.outcome for o in outcomes)
    print(f"{len(outcomes)} model types: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    for o in outcomes:
        if o.outcome in ("verify_failed", "bad_input", "crashed"):
            print(f"  {o.model_type}: {o.outcome}: {o.message}")
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")
    return 1 if counts["crashed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
