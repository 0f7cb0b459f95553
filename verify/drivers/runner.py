"""The verify driver for standalone outputs: the generated ``runner_<model>.py``.

Same criterion as framework outputs (design §6; ``flow.py`` compares): the converted model
gets the reference's weights and runs the same variable-length prompts through the runner as
one static batch. The chains that apply to a runner-owned cache:

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
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from kvskill.implementer.record import StandaloneRecord
from kvskill.runtime.chains import ChainResult, chain_result
from kvskill.verify.drivers.base import DriverRun
from torch import nn


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


@dataclass(slots=True)
class _StepRecorder:
    """The runner's step hook: what each step's metadata said, read after the forward."""

    steps: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, md, logits: torch.Tensor) -> None:
        self.steps.append(
            {
                "is_prefill": md.is_prefill,
                "kv_len": md.kv_len.tolist(),
                "actual_seq_lengths_kv": md.actual_seq_lengths_kv.tolist(),
                "actual_seq_lengths_q": md.actual_seq_lengths_q.tolist(),
                "block_table": sorted(md.block_table),
                "slot_mapping": {k: int(v.numel()) for k, v in md.slot_mapping.items()},
                "num_tokens": int(md.actual_seq_lengths_q.sum()),
            }
        )


@dataclass(frozen=True, kw_only=True)
class RunnerDriver:
    """Drives a standalone conversion with the runner of its (staged) directory."""

    #: where the converted code (and so the runner) was loaded from
    converted_dir: Path
    record: StandaloneRecord
    failure: str = "the standalone runner failed"

    @property
    def note(self) -> str:
        r = self.record
        return f"standalone mode {r.mode} ({r.kv_mode}, {r.input_layout}) driven by {r.runner}"

    def run(
        self, model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, block_size: int
    ) -> DriverRun:
        module = import_runner(self.converted_dir / self.record.runner)
        runner = module.runner_for(model, prompts, max_new_tokens, block_size=block_size)
        init = _init_chain(model, runner, self.record.kv_mode)
        recorder = _StepRecorder()
        runner.step_hook = recorder
        first = runner.generate(prompts, max_new_tokens, return_logits=True)
        runner.step_hook = None
        again = runner.generate(prompts[::-1], max_new_tokens)
        paged = self.record.kv_mode in ("paged", "legacy")
        lengths = [len(p) for p in prompts]
        return DriverRun(
            token_ids=[list(t) for t in first.token_ids],
            # first.logits: one [batch, vocab] tensor per step -> per prompt, per step
            logits=[[step[i] for step in first.logits] for i in range(len(prompts))],
            chains=[
                init,
                _runtime_chain(recorder, lengths, runner.attn_types if paged else []),
                _release_chain(first.token_ids, again.token_ids[::-1]),
            ],
            notes=[self.note],
        )


def _init_chain(model: nn.Module, runner, kv_mode: str) -> ChainResult:
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
            if kv_mode in ("paged", "legacy"):  # Legacy: one block per row
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
    return chain_result(
        "init", f"{count} cache entries bound to runner-owned {kv_mode} tensors", failures
    )


def _runtime_chain(
    recorder: _StepRecorder, lengths: list[int], attn_types: list[str]
) -> ChainResult:
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
        before = [
            kv - q
            for kv, q in zip(
                step["actual_seq_lengths_kv"], step["actual_seq_lengths_q"], strict=True
            )
        ]
        if step["kv_len"] != before:
            # the runner builds both from one value; only the forward can have changed kv_len
            failures.append(
                f"{kind}: kv_len is {step['kv_len']} after the forward but the step was built "
                f"with {before} tokens cached before it; a layer advanced kv_len (it is the "
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
    return chain_result(
        "runtime", summary + (", tables per attn_type" if attn_types else ""), failures
    )


def _release_chain(first: list[list[int]], again: list[list[int]]) -> ChainResult:
    """Reusing the dirty caches (rows swapped) gives the same tokens."""
    failures = [
        f"prompt {i}: {a} on reused caches, {b} on fresh ones"
        for i, (a, b) in enumerate(zip(again, first, strict=True))
        if a != b
    ]
    return chain_result(
        "release", "rerun on the runner's dirty caches, rows reversed: same tokens", failures
    )
