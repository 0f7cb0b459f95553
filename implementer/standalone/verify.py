"""``kvskill verify`` for standalone outputs: drive the generated runner instead of the engine.

Same criterion as framework verify (design §6): the reference is transformers ``generate``
(greedy, one prompt at a time) on the original code; the converted model gets identical
weights and runs the same variable-length prompts through ``runner_<model>.py`` as one static
batch. Tokens must be identical and every step's logits within ``atol`` (plus ``LOGIT_RTOL`` of
the largest reference logit, see ``verify.py``). The chains that apply to a runner-owned
cache:

1. init: every cache entry is bound to the tensor the runner allocated, with the mode's shape
   ([batch, max_seq_len, heads * dim] contiguous, [total_blocks, block_size, heads, dim] paged)
   and the entry's dtype; no placeholder is left;
2. runtime: each step's metadata has kv_len and actual_seq_lengths_kv equal to the prompt
   length plus the tokens generated so far (so the first decode step sees prompt_len + 1),
   also *after* the forward (no layer may advance kv_len), and paged steps carry a block table
   and a slot mapping for every attn_type;
3. release (dirty reuse): a second generate on the same runner, whose caches still hold the
   first run, with the prompts in reverse row order gives the same tokens per prompt.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from kvskill.core.errors import BadInputError, KvskillError
from kvskill.implementer.mla.spec import MLA_BLOCK_SIZE
from kvskill.implementer.record import ConvertedDir, StandaloneRecord
from kvskill.implementer.shrink import shrink_config
from kvskill.implementer.verify import (
    DEFAULT_BLOCK_SIZE,
    PromptResult,
    VerifyOptions,
    VerifyReport,
    check_trust,
    check_verifiable,
    is_windowed,
    load_model_pair,
    logit_scale,
    make_prompts,
    prompt_lengths_for,
    reference_generate,
    scratch_dir,
    start_report,
)
from torch import nn

RUNNER_GLOB = "runner_*.py"


def find_runner(directory: Path) -> Path | None:
    """The ``runner_*.py`` of a standalone output directory, or None (framework output)."""
    found = sorted(directory.glob(RUNNER_GLOB))
    return found[0] if found else None


def standalone_record(converted: ConvertedDir) -> StandaloneRecord:
    """The conversion's standalone record (ConvertedDir.read checked its runner exists)."""
    record = converted.record.standalone
    if record is None:
        raise BadInputError(
            f"{converted.directory} holds {RUNNER_GLOB} but its kvskill_plan.json has no "
            "standalone record; re-run `kvskill apply --mode standalone`"
        )
    return record


def import_runner(path: Path) -> ModuleType:
    """Import a runner file as a fresh module (never cached between runs)."""
    name = f"kvskill_runner_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path} is not importable"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def verify_standalone(directory: Path, options: VerifyOptions) -> VerifyReport:
    """Run the original model and the standalone runner on the same prompts and compare.

    Raises:
        BadInputError: not a standalone output, untrusted remote code, bad options.
    """
    directory = directory.resolve()
    converted = ConvertedDir.read(directory)
    plan, config = converted.plan, converted.config
    record = standalone_record(converted)
    check_trust(converted, options.trust_remote_code)
    check_verifiable(directory, plan, options)
    shrunk = shrink_config(config, shrink_window=is_windowed(plan)) if options.shrink else None
    block_size = options.block_size or DEFAULT_BLOCK_SIZE
    if record.mla_absorb:  # the MLA NZ caches need 16-token-aligned blocks
        block_size = -(-block_size // MLA_BLOCK_SIZE) * MLA_BLOCK_SIZE
    report = start_report(directory, plan, options, shrunk, block_size)
    report.notes.append(
        f"standalone mode {record.mode} ({record.kv_mode}, "
        f"{record.input_layout}) driven by {record.runner}"
    )
    with scratch_dir() as workdir:
        run_config = shrunk.config if shrunk else config
        _verify(converted, workdir, record, run_config, options, report)
    return report


@dataclass(slots=True)
class _StepRecorder:
    """The runner's step hook: what each step's metadata said, read after the forward."""

    steps: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, md, logits: torch.Tensor) -> None:
        self.steps.append(
            {
                "is_prefill": md.is_prefill,
                "kv_len": md.kv_len.tolist(),
                "actual_seq_lengths_kv": list(md.actual_seq_lengths_kv),
                "block_table": sorted(md.block_table),
                "slot_mapping": {k: int(v.numel()) for k, v in md.slot_mapping.items()},
                "num_tokens": md.num_tokens,
            }
        )


def _verify(
    converted: ConvertedDir,
    workdir: Path,
    record: StandaloneRecord,
    config: dict[str, Any],
    options: VerifyOptions,
    report: VerifyReport,
) -> None:
    plan = converted.plan
    pair = load_model_pair(converted, workdir, config, options, report)
    if pair is None:
        return
    reference, model, converted_dir = pair.reference, pair.converted, pair.converted_dir
    lengths = prompt_lengths_for(plan, config, options, report.block_size)
    prompts = make_prompts(lengths, int(config["vocab_size"]), options.seed)
    references = [reference_generate(reference, p, options.max_new_tokens) for p in prompts]
    try:
        runner_module = import_runner(converted_dir / record.runner)
        runner = runner_module.runner_for(
            model, prompts, options.max_new_tokens, block_size=report.block_size
        )
        init = _init_chain(model, runner, record.kv_mode)
        recorder = _StepRecorder()
        runner.step_hook = recorder
        first = runner.generate(prompts, options.max_new_tokens, return_logits=True)
        runner.step_hook = None
        again = runner.generate(prompts[::-1], options.max_new_tokens)
    except KvskillError as exc:
        report.error = f"the runtime refused the converted model: {exc}"
        return
    except Exception as exc:  # the converted code or the runner failed: a failed check
        report.error = f"the standalone runner failed: {type(exc).__name__}: {exc}"
        return
    paged = record.kv_mode == "paged"
    report.chains = [
        init,
        _runtime_chain(recorder, lengths, runner.attn_types if paged else []),
        _release_chain(first.token_ids, again.token_ids[::-1]),
    ]
    for index, (prompt, (tokens, ref_logits)) in enumerate(zip(prompts, references, strict=True)):
        got = [step[index] for step in first.logits]
        report.prompts.append(
            _compare(index, prompt, tokens, ref_logits, first.token_ids[index], got)
        )


def _chain(name: str, summary: str, failures: list[str]) -> dict[str, Any]:
    shown = failures[:8] + ([f"... and {len(failures) - 8} more"] if len(failures) > 8 else [])
    return {"name": name, "passed": not failures, "summary": summary, "failures": shown}


def _init_chain(model: nn.Module, runner, kv_mode: str) -> dict[str, Any]:
    """Every entry holds the runner's own tensor, of the mode's shape and the entry's dtype."""
    failures: list[str] = []
    layers = [m for m in model.modules() if hasattr(m, "cache_entries")]
    if len(layers) != len(runner.kv_caches):
        failures.append(
            f"{len(layers)} attention layers but the runner owns {len(runner.kv_caches)}"
        )
    count = 0
    for index, (layer, owned) in enumerate(zip(layers, runner.kv_caches, strict=False)):
        for entry in layer.cache_entries:
            count += 1
            bound = getattr(layer, entry.cache_name, None)
            if kv_mode == "paged":
                blocks = runner.batch_size * runner.max_seq_len // runner.block_size
                shape = (blocks, runner.block_size, entry.num_head, entry.dim)
            else:
                shape = (runner.batch_size, runner.max_seq_len, entry.num_head * entry.dim)
            where = f"layer {index} {entry.cache_name}"
            if bound is None or bound.numel() == 0:
                failures.append(f"{where}: still the empty placeholder")
            elif bound is not owned.get(entry.cache_name):
                failures.append(f"{where}: the layer's tensor is not the one the runner allocated")
            elif tuple(bound.shape) != shape or bound.dtype != entry.dtype:
                failures.append(
                    f"{where}: {tuple(bound.shape)} {bound.dtype}, declared {shape} {entry.dtype}"
                )
    return _chain(
        "init", f"{count} cache entries bound to runner-owned {kv_mode} tensors", failures
    )


def _runtime_chain(
    recorder: _StepRecorder, lengths: list[int], attn_types: list[str]
) -> dict[str, Any]:
    """kv_len / actual_seq_lengths_kv follow prompt + generated, untouched by the layers."""
    failures: list[str] = []
    for index, step in enumerate(recorder.steps):
        expected = [n + index for n in lengths]  # step 0 is the prefill
        kind = "prefill" if index == 0 else f"decode step {index}"
        if step["is_prefill"] != (index == 0):
            failures.append(f"{kind}: is_prefill is {step['is_prefill']}")
        if step["actual_seq_lengths_kv"] != expected:
            failures.append(
                f"{kind}: actual_seq_lengths_kv {step['actual_seq_lengths_kv']}, expected "
                f"{expected} (prompt + generated): the runner's kv_len went wrong"
            )
        if step["kv_len"] != step["actual_seq_lengths_kv"]:
            # the runner builds both from one value; only the forward can have changed kv_len
            failures.append(
                f"{kind}: kv_len is {step['kv_len']} after the forward but the step was built "
                f"with {step['actual_seq_lengths_kv']}; a layer advanced kv_len (it is the "
                "runner's variable, layers only read it)"
            )
        missing = sorted(set(attn_types) - set(step["block_table"]))
        if missing:
            failures.append(f"{kind}: no block_table for {missing}")
        wrong = {k: n for k, n in step["slot_mapping"].items() if n != step["num_tokens"]}
        if sorted(step["slot_mapping"]) != sorted(attn_types) or wrong:
            failures.append(
                f"{kind}: slot_mapping {step['slot_mapping']} for {step['num_tokens']} tokens"
            )
    if len(recorder.steps) < 2:
        failures.append(
            f"{len(recorder.steps)} steps recorded; expected a prefill and decode steps"
        )
    summary = f"{len(recorder.steps)} steps: kv_len and actual_seq_lengths_kv = prompt + generated"
    return _chain("runtime", summary + (", tables per attn_type" if attn_types else ""), failures)


def _release_chain(first: list[list[int]], again: list[list[int]]) -> dict[str, Any]:
    """Reusing the dirty caches (rows swapped) gives the same tokens."""
    failures = [
        f"prompt {i}: {a} on reused caches, {b} on fresh ones"
        for i, (a, b) in enumerate(zip(again, first, strict=True))
        if a != b
    ]
    return _chain(
        "release", "rerun on the runner's dirty caches, rows reversed: same tokens", failures
    )


def _compare(index, prompt, tokens, ref_logits, runner_tokens, runner_logits) -> PromptResult:
    mismatch = next(
        (i for i, (a, b) in enumerate(zip(tokens, runner_tokens, strict=False)) if a != b),
        None if len(tokens) == len(runner_tokens) else min(len(tokens), len(runner_tokens)),
    )
    steps = min(len(tokens) if mismatch is None else mismatch + 1, len(ref_logits))
    diff = 0.0
    for step in range(steps):
        if step >= len(runner_logits):
            diff = math.inf
            break
        diff = max(diff, (runner_logits[step] - ref_logits[step]).abs().max().item())
    return PromptResult(
        index=index,
        prompt_len=len(prompt),
        reference_tokens=tokens,
        runtime_tokens=list(runner_tokens),
        max_logit_diff=diff,
        first_mismatch=mismatch,
        logit_scale=logit_scale(ref_logits, steps),
    )
