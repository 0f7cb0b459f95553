"""The three-chain checks of a converted model in the runtime: init, runtime, release.

1. init: every declared cache entry received a tensor of the declared shape and dtype, and
   no layer still holds its empty placeholder.
2. runtime: every step's metadata has a block table and a slot mapping for every group, and
   a request's first decode step sees ``actual_seq_lengths_kv == prompt_len + 1`` (in
   general, every decode step sees ``prompt_len + tokens generated so far``).
3. release: once every request has finished, every pool is back to its initial free count
   (a block nobody holds is free, whether or not it still carries a prefix-cache hash) and
   no manager tracks a request; running the same prompts again gives identical tokens: with
   prefix caching on, once served from the cache (every full block of each prompt but the
   last hit), then once more after the cache is reset, on the reused (dirty) blocks.

``run_three_chains`` drives all three through an ``LLM``; the pieces are usable alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from kvskill.runtime.engine import StepRecord
from kvskill.runtime.request import RequestOutput, SamplingParams
from torch import nn

#: failures listed per chain at most (the count is always reported)
MAX_LISTED = 8


@dataclass(frozen=True, slots=True)
class ChainResult:
    name: str  #: "init" | "runtime" | "release"
    passed: bool
    #: one line saying what was checked
    summary: str
    failures: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "passed": self.passed,
            "summary": self.summary,
            "failures": list(self.failures),
        }


def chain_result(name: str, summary: str, failures: list[str]) -> ChainResult:
    """A chain's result listing at most MAX_LISTED failures (and how many more)."""
    listed = failures[:MAX_LISTED]
    if len(failures) > MAX_LISTED:
        listed.append(f"... and {len(failures) - MAX_LISTED} more")
    return ChainResult(name, not failures, summary, tuple(listed))


def check_init_chain(model: nn.Module, cache_info, kv_manager) -> ChainResult:
    """Every entry's tensor is injected with the declared shape/dtype; no placeholder left."""
    failures: list[str] = []
    num_entries = 0
    for layer in cache_info.layer_infos:
        for entry in layer.caches:
            if not entry.needs_block:
                continue
            num_entries += 1
            where = f"layer {layer.layer_idx} cache {entry.cache_name!r}"
            tensor = entry.tensor
            if tensor is None or tensor.numel() == 0:
                failures.append(f"{where}: no tensor was injected")
                continue
            group = kv_manager.groups[entry.group_key]
            expected = (
                kv_manager.num_blocks[entry.group_key],
                *entry.block_shape(group.block_size),
            )
            if tuple(tensor.shape) != expected or tensor.dtype != entry.dtype:
                failures.append(
                    f"{where}: got {tuple(tensor.shape)} {tensor.dtype}, declared {expected} "
                    f"{entry.dtype}"
                )
    failures += _placeholders_left(model)
    return chain_result(
        "init", f"{num_entries} cache entries checked for shape, dtype and injection", failures
    )


def _placeholders_left(model: nn.Module) -> list[str]:
    """Layers whose cache attribute is still an empty tensor after allocation."""
    found = []
    for name, module in model.named_modules():
        try:
            entries = getattr(module, "cache_entries", None)
        except Exception:  # a property that cannot be evaluated here says nothing about caches
            continue
        for entry in entries or ():
            value = getattr(module, entry.cache_name, None)
            if isinstance(value, torch.Tensor) and value.numel() == 0 and entry.needs_block:
                found.append(f"{name}.{entry.cache_name} is still the empty placeholder")
    return found


@dataclass(slots=True)
class _StepFacts:
    is_prefill: bool
    batch: int
    num_tokens: int
    request_ids: list[str]
    prompt_tokens: list[int]
    num_output_tokens: list[int]
    seq_lengths_kv: list[int]
    seq_lengths_q: list[int]
    #: group key -> (block table shape, dtype, slot mapping length)
    groups: dict[str, tuple[tuple[int, ...], torch.dtype, int]]
    preempted_ids: list[str]
    #: group key -> each request's first block id, for [B, 1] tables (state groups)
    first_blocks: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class RuntimeChainRecorder:
    """A step hook that keeps what the runtime chain needs from every step (no tensors)."""

    steps: list[_StepFacts] = field(default_factory=list)

    def __call__(self, record: StepRecord) -> None:
        md = record.metadata
        groups = {}
        first_blocks = {}
        for key, table in md.block_table.items():
            slots = md.slot_mapping.get(key)
            groups[key] = (tuple(table.shape), table.dtype, -1 if slots is None else slots.numel())
            if table.dim() == 2 and table.shape[1] == 1:
                first_blocks[key] = table[:, 0].tolist()
        self.steps.append(
            _StepFacts(
                is_prefill=md.is_prefill,
                batch=len(record.request_ids),
                num_tokens=int(md.actual_seq_lengths_q.sum()),
                request_ids=list(record.request_ids),
                prompt_tokens=list(record.prompt_lens),
                num_output_tokens=list(record.num_output_tokens),
                seq_lengths_kv=md.actual_seq_lengths_kv.tolist(),
                seq_lengths_q=md.actual_seq_lengths_q.tolist(),
                groups=groups,
                preempted_ids=list(record.preempted_ids),
                first_blocks=first_blocks,
            )
        )

    def check(
        self,
        group_keys: Sequence[str],
        state_group_keys: Sequence[str] = (),
        slotless_group_keys: Sequence[str] = (),
    ) -> ChainResult:
        """Tables of every step, and the kv lengths of decode steps.

        Args:
            group_keys: every KV group.
            state_group_keys: those of them holding one state block per request (Mamba):
                their table is ``[B, 1]`` and they have no slot mapping.
            slotless_group_keys: token groups the model addresses from the block table
                (compressed caches): a block table and no slot mapping.
        """
        failures: list[str] = []
        #: state group -> request id -> the state block it holds until it finishes or is
        #: preempted
        owners: dict[str, dict[str, int]] = {key: {} for key in state_group_keys}
        first_decode_checked = 0
        seen_decode: set[str] = set()
        preempted: set[str] = set()
        for i, step in enumerate(self.steps):
            preempted.update(step.preempted_ids)
            failures += _check_tables(
                i, step, group_keys, frozenset(state_group_keys), frozenset(slotless_group_keys)
            )
            failures += _check_state_blocks(i, step, state_group_keys, owners)
            for rid, prompt, outputs, kv, q in zip(
                step.request_ids,
                step.prompt_tokens,
                step.num_output_tokens,
                step.seq_lengths_kv,
                step.seq_lengths_q,
                strict=True,
            ):
                # In a prefill step only the decoding requests riding along are checked: one
                # token fed after at least one generated, by a request not recomputing.
                if step.is_prefill and (q != 1 or outputs == 0 or rid in preempted):
                    continue
                if rid not in seen_decode:
                    seen_decode.add(rid)
                    if rid not in preempted:
                        first_decode_checked += 1
                        if kv != prompt + 1:
                            failures.append(
                                f"step {i}: request {rid}'s first decode has "
                                f"actual_seq_lengths_kv={kv}, expected prompt_len + 1 = {prompt + 1}"
                            )
                            continue
                if kv != prompt + outputs:
                    failures.append(
                        f"step {i}: request {rid} decodes with actual_seq_lengths_kv={kv}, "
                        f"expected prompt_len + generated = {prompt + outputs}"
                    )
        summary = (
            f"{len(self.steps)} steps, groups {list(group_keys)}; first decode kv = prompt + 1 "
            f"checked for {first_decode_checked} request(s)"
        )
        if not self.steps:
            failures.append("no step was recorded")
        return chain_result("runtime", summary, failures)


def _check_tables(
    index: int,
    step: _StepFacts,
    group_keys: Sequence[str],
    state_groups: frozenset[str],
    slotless_groups: frozenset[str] = frozenset(),
) -> list[str]:
    failures = []
    for key in group_keys:
        facts = step.groups.get(key)
        if facts is None:
            failures.append(f"step {index}: block_table has no entry for group {key!r}")
            continue
        shape, dtype, num_slots = facts
        if key in state_groups:
            if shape != (step.batch, 1) or dtype != torch.int32 or num_slots != -1:
                failures.append(
                    f"step {index}: state group {key!r} has block_table {shape} {dtype} and "
                    f"{'no' if num_slots == -1 else num_slots} slots; expected "
                    f"[{step.batch}, 1] torch.int32 (one state block per request), no slots"
                )
            continue
        if len(shape) != 2 or shape[0] != step.batch or dtype != torch.int32:
            failures.append(
                f"step {index}: block_table[{key!r}] is {shape} {dtype}, expected "
                f"[{step.batch}, max_blocks] torch.int32"
            )
        if key in slotless_groups:
            if num_slots != -1:
                failures.append(
                    f"step {index}: compressed group {key!r} has {num_slots} slots; its rows "
                    "are addressed from the block table, with no slot mapping"
                )
            continue
        if num_slots != step.num_tokens:
            failures.append(
                f"step {index}: slot_mapping[{key!r}] has {num_slots} slots for "
                f"{step.num_tokens} tokens"
            )
    return failures


def _check_state_blocks(
    index: int, step: _StepFacts, state_group_keys: Sequence[str], owners: dict
) -> list[str]:
    """A request keeps one state block from its first step until it is preempted, and no
    two requests of a step share one (a shared or moved block mixes their states)."""
    failures = []
    for key in state_group_keys:
        held = owners[key]
        for rid in step.preempted_ids:
            held.pop(rid, None)
        blocks = step.first_blocks.get(key, [])
        if len(set(blocks)) != len(blocks):
            failures.append(f"step {index}: requests share a state block of group {key!r}")
        for rid, block in zip(step.request_ids, blocks, strict=False):
            if held.setdefault(rid, block) != block:
                failures.append(
                    f"step {index}: request {rid}'s state block of group {key!r} moved from "
                    f"{held[rid]} to {block} without a preemption"
                )
    return failures


def check_pools_released(kv_manager) -> list[str]:
    """Failures if any pool is not back to its initial free count or a request is tracked."""
    failures = []
    free, initial = kv_manager.num_free_blocks, kv_manager.initial_free_blocks
    tracked_by_group = kv_manager.tracked_request_ids()
    for key in kv_manager.group_keys:
        if free[key] != initial[key]:
            failures.append(
                f"group {key!r}: {free[key]} free blocks after all requests, initially {initial[key]}"
            )
        tracked = tracked_by_group[key]
        if tracked:
            failures.append(f"group {key!r} still tracks requests {sorted(tracked)[:5]}")
    return failures


def check_release_chain(
    llm,
    prompts: Sequence[Sequence[int]],
    sampling_params: SamplingParams | Sequence[SamplingParams],
    first_outputs: Sequence[RequestOutput],
) -> ChainResult:
    """Pools are back to their initial counts, and a rerun on dirty blocks repeats the tokens.

    With prefix caching on, the first rerun reads the prompts' cached blocks (the hit path
    must repeat the tokens too) and a second one runs after ``reset_prefix_cache`` on
    reused, uncached blocks. Only meaningful for reproducible sampling (greedy, or seeded).
    """
    manager = llm.kv_manager
    failures = check_pools_released(manager)
    reruns = [("rerun on reused blocks", None)]
    if manager.enable_prefix_caching:
        reruns = [("rerun from the prefix cache", None), ("rerun after a cache reset", "reset")]
    hits = 0
    for label, action in reruns:
        if action == "reset":
            manager.reset_prefix_cache()
        hits_before = llm.stats.num_prefix_hit_tokens
        rerun = llm.generate(prompts, sampling_params)
        if action is None:
            hits = llm.stats.num_prefix_hit_tokens - hits_before
        for i, (a, b) in enumerate(zip(first_outputs, rerun, strict=True)):
            if a.token_ids != b.token_ids:
                failures.append(
                    f"prompt {i}: {label} gave {b.token_ids[:8]}... instead of {a.token_ids[:8]}..."
                )
        failures += [f"after {label}: {f}" for f in check_pools_released(manager)]
    summary = (
        f"pools back to initial free counts; rerun of {len(prompts)} prompt(s) on reused blocks"
    )
    if manager.enable_prefix_caching:
        summary += f", once from the prefix cache ({hits} tokens hit) and once after a reset"
    return chain_result("release", summary, failures)


@dataclass(frozen=True, slots=True)
class ChainReport:
    results: tuple[ChainResult, ...]
    outputs: tuple[RequestOutput, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "chains": [r.to_dict() for r in self.results]}


def run_three_chains(
    llm,
    prompts: Sequence[Sequence[int]],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
) -> ChainReport:
    """Check init, run ``prompts`` recording every step, then check runtime and release."""
    params = sampling_params if sampling_params is not None else SamplingParams()
    init = check_init_chain(llm.model, llm.cache_info, llm.kv_manager)
    recorder = RuntimeChainRecorder()
    with llm.step_hook(recorder):
        outputs = llm.generate(prompts, params)
    manager = llm.kv_manager
    runtime = recorder.check(
        manager.group_keys, manager.state_group_keys, manager.slotless_group_keys
    )
    release = check_release_chain(llm, prompts, params, outputs)
    return ChainReport((init, runtime, release), tuple(outputs))
