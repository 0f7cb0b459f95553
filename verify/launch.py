"""``kvskill run`` for standalone outputs: load the converted model and drive its runner.

The runner in the directory is the code that runs, exactly as a user would run it
(``runner_for(model, prompts, max_new_tokens).generate(...)``); this module only loads the
model, times the call and reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvskill.core.errors import BadInputError
from kvskill.implementer.record import ConvertedDir, StandaloneRecord
from kvskill.verify.drivers.runner import import_runner


@dataclass(kw_only=True)
class StandaloneRun:
    """A converted model loaded next to the runner module of its directory."""

    directory: Path
    record: StandaloneRecord
    loaded: Any  #: kvskill.runtime.loader.LoadedModel
    runner_module: Any

    @classmethod
    def load(
        cls,
        directory: Path,
        *,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        random_weights: bool = False,
        trust_remote_code: bool = False,
    ) -> StandaloneRun:
        """Import the runner and build the model (weights from the directory, or random).

        Raises:
            BadInputError: not a standalone output, or the model cannot be loaded.
        """
        from kvskill.runtime.loader import load_model

        directory = directory.resolve()
        converted = ConvertedDir.read(directory)
        record = converted.record.standalone
        if record is None:
            raise BadInputError(f"{directory} is a framework output: it has no runner to drive")
        if converted.plan.code.get("legacy_standalone"):
            raise BadInputError(
                f"{directory} is a framework standalone model converted in place: it runs under "
                f"its own runner ({record.runner or 'none found'}), which kvskill run does not "
                "drive; prove it with kvskill verify, run it with that runner"
            )
        loaded = load_model(
            directory,
            dtype=dtype,
            device=device,
            seed=seed,
            random_weights=random_weights,
            trust_remote_code=trust_remote_code,
        )
        module = import_runner(directory / record.runner)
        return cls(directory=directory, record=record, loaded=loaded, runner_module=module)

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.config.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.loaded.config, "max_position_embeddings", None) or 4096)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        block_size: int | None = None,
        ignore_eos: bool = False,
    ) -> dict[str, Any]:
        """Run the prompts as one static batch; a report dict (JSON-ready)."""
        if not prompts or not all(prompts):
            raise BadInputError("every prompt needs at least one token id")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.max_model_len:
            raise BadInputError(
                f"a prompt plus --max-tokens needs {longest} positions; the model allows "
                f"{self.max_model_len}"
            )
        vocab = self.vocab_size
        bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
        if bad:
            raise BadInputError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        eos = None if ignore_eos else _eos_token_id(self.loaded.config)
        runner = self.runner_module.runner_for(
            self.loaded.model,
            prompts,
            max_new_tokens,
            block_size=block_size or self.runner_module.BLOCK_SIZE,
        )
        started = time.perf_counter()
        output = runner.generate(prompts, max_new_tokens, eos_token_id=eos)
        wall_s = time.perf_counter() - started
        generated = sum(len(t) for t in output.token_ids)
        return {
            "model_dir": str(self.directory),
            "runner": self.record.runner,
            "mode": self.record.mode,
            "kv_mode": self.record.kv_mode,
            "device": str(runner.device),
            "batch_size": runner.batch_size,
            "max_seq_len": runner.max_seq_len,
            "summary": {
                "requests": len(prompts),
                "prompt_tokens": sum(len(p) for p in prompts),
                "generated_tokens": generated,
                "wall_s": wall_s,
                "throughput_tok_s": generated / wall_s if wall_s > 0 else None,
            },
            "requests": [
                {
                    "request_id": str(index),
                    "prompt_len": len(prompt),
                    "token_ids": tokens,
                    "finish_reason": "stop"
                    if eos is not None and tokens[-1:] == [eos]
                    else "length",
                }
                for index, (prompt, tokens) in enumerate(
                    zip(prompts, output.token_ids, strict=True)
                )
            ],
        }


def _eos_token_id(config) -> int | None:
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, list):
        # NOTE: the runner stops on one id; the first is the model's primary end token.
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)


def render_table(report: dict[str, Any]) -> str:
    """The run report as aligned lines, then one line per request."""
    s = report["summary"]
    rows = [
        ("model", report["model_dir"]),
        ("runner", f"{report['runner']} (mode {report['mode']}, {report['kv_mode']})"),
        ("device", report["device"]),
        ("static batch", f"{report['batch_size']} x max_seq_len {report['max_seq_len']}"),
        ("prompt tokens", str(s["prompt_tokens"])),
        ("generated tokens", str(s["generated_tokens"])),
        ("wall time", f"{s['wall_s']:.3f} s"),
        ("throughput", f"{s['throughput_tok_s'] or 0:.1f} tok/s"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    lines.append("")
    for r in report["requests"][:16]:
        ids = r["token_ids"]
        text = ",".join(map(str, ids[:24])) + (",…" if len(ids) > 24 else "")
        lines.append(
            f"request {r['request_id']}: prompt {r['prompt_len']} tokens -> {len(ids)} tokens "
            f"({r['finish_reason']}): {text}"
        )
    if len(report["requests"]) > 16:
        lines.append(f"... {len(report['requests']) - 16} more (use --format json)")
    return "\n".join(lines)
