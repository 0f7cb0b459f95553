"""The verify driver for framework outputs: the bundled runtime's engine.

Continuous batching with verify's block size (128 under the NPU profile, small with
``--cpu-only-shapes``), a shuffled free-block order and chunked prefill, inside the runtime's
three-chain checks (``kvskill.runtime.chains``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from kvskill.verify.drivers.base import DriverRun
from torch import nn

#: small enough that long prompts are prefilled in several chunks
MAX_BATCHED_TOKENS = 32


@dataclass(slots=True)
class LogitRecorder:
    """Step hook keeping each request's logits per generated token (first batch only)."""

    #: (prompt index, output position) -> logits [vocab]
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    batch: str | None = None

    def __call__(self, record) -> None:
        for row, (rid, done, token) in enumerate(
            zip(record.request_ids, record.num_output_tokens, record.sampled, strict=True)
        ):
            batch, index = rid.split("-")
            self.batch = self.batch or batch
            if token is None or batch != self.batch:
                continue
            self.logits.setdefault((int(index), done), record.logits[row].detach().float().cpu())

    def steps_of(self, index: int) -> list[torch.Tensor]:
        """Prompt ``index``'s logits for outputs 0, 1, ... up to the first one not recorded."""
        found: list[torch.Tensor] = []
        while (index, len(found)) in self.logits:
            found.append(self.logits[(index, len(found))])
        return found


@dataclass(frozen=True, kw_only=True)
class EngineDriver:
    """Drives a framework conversion with ``kvskill.runtime.LLM``."""

    seed: int
    #: the page pool (strided views over shared pages) instead of one tensor per cache
    use_hybrid_blocks: bool
    failure: str = "the converted model failed in the runtime"
    #: split a prompt over steps when it exceeds the token budget (off: whole-prompt prefill
    #: steps, as the executor at fbc225d runs them; it has no chunked prefill)
    chunked_prefill: bool = True
    #: tokens per step; a model built for a static decode batch needs every prompt prefilled
    #: in one step, so that each decode step holds all of them
    max_batched_tokens: int = MAX_BATCHED_TOKENS
    #: decode steps through the graph captured per batch bucket
    graph: bool = False

    def run(
        self, model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, block_size: int
    ) -> DriverRun:
        from kvskill.runtime import LLM, SamplingParams
        from kvskill.runtime.chains import run_three_chains
        from kvskill.runtime.ops import current_profile

        total_blocks = sum(math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts)
        llm = LLM(
            model,
            exact=True,  # verify judges the model's own code, never the fast paths
            block_size=block_size,
            num_blocks=total_blocks + 8,
            free_block_order_seed=self.seed + 7,
            max_num_batched_tokens=self.max_batched_tokens,
            max_model_len=max(len(p) for p in prompts) + max_new_tokens,
            seed=self.seed,
            use_hybrid_blocks=self.use_hybrid_blocks,
            enable_chunked_prefill=self.chunked_prefill,
            npu_profile=current_profile(),  # verify's (the shrunk twin's leaves out dims)
            graph=self.graph,
        )
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        recorder = LogitRecorder()
        with llm.step_hook(recorder), torch.no_grad():
            chains = run_three_chains(llm, prompts, params)
        return DriverRun(
            token_ids=[list(o.token_ids) for o in chains.outputs],
            logits=[recorder.steps_of(i) for i in range(len(prompts))],
            chains=list(chains.results),
        )
