"""The verify driver for ``--tp N``: the converted model on N tensor-parallel ranks.

The converted model verify built (with the reference's weights) is written to a scratch
directory as safetensors next to its code and config; every rank then loads its own slice of
it, as ``kvskill run --tp N`` would, and rank 0 runs the same engine and three chains as the
one-process driver. The report gains the split and each rank's KV bytes per token.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from kvskill.verify.drivers.base import DriverRun
from kvskill.verify.drivers.engine import MAX_BATCHED_TOKENS, LogitRecorder
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TensorParallelDriver:
    """Drives a framework conversion with ``LLM(dir, tensor_parallel_size=N)``."""

    seed: int
    use_hybrid_blocks: bool
    tensor_parallel_size: int
    backend: str
    #: the converted code and (possibly shrunk) config.json to stage next to the weights
    code_dir: Path
    dtype: str
    failure: str = "the converted model failed on the tensor-parallel ranks"

    def run(
        self, model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, block_size: int
    ) -> DriverRun:
        from kvskill.runtime import LLM, SamplingParams
        from kvskill.runtime.chains import run_three_chains
        from kvskill.runtime.distributed.report import tensor_parallel_summary
        from kvskill.runtime.ops import current_profile

        staged = Path(tempfile.mkdtemp(prefix="kvskill-verify-tp-"))
        try:
            _stage(model, self.code_dir, staged)
            total_blocks = sum(math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts)
            with LLM(
                staged,
                exact=True,  # verify judges the model's own code, never the fast paths
                dtype=self.dtype,
                device="cpu" if self.backend in ("auto", "gloo") else None,
                block_size=block_size,
                num_blocks=total_blocks + 8,
                free_block_order_seed=self.seed + 7,
                max_num_batched_tokens=MAX_BATCHED_TOKENS,
                max_model_len=max(len(p) for p in prompts) + max_new_tokens,
                seed=self.seed,
                trust_remote_code=True,  # the staged copy of a directory verify checked
                use_hybrid_blocks=self.use_hybrid_blocks,
                tensor_parallel_size=self.tensor_parallel_size,
                tp_backend=self.backend,
                npu_profile=current_profile(),  # verify's (the shrunk twin's leaves out dims)
            ) as llm:
                params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
                recorder = LogitRecorder()
                with llm.step_hook(recorder), torch.no_grad():
                    chains = run_three_chains(llm, prompts, params)
                summary = tensor_parallel_summary(llm)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        return DriverRun(
            token_ids=[list(o.token_ids) for o in chains.outputs],
            logits=[recorder.steps_of(i) for i in range(len(prompts))],
            chains=list(chains.results),
            notes=[_note(summary)],
            tensor_parallel=summary,
        )


def _stage(model: nn.Module, code_dir: Path, target: Path) -> None:
    """CODE_DIR's Python files and config.json, and MODEL's weights as safetensors."""
    from safetensors.torch import save_file

    for path in code_dir.glob("*.py"):
        shutil.copy2(path, target / path.name)
    config = json.loads((code_dir / "config.json").read_text(encoding="utf-8"))
    (target / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    # one entry per tensor, under its first name (a tied LM head is saved as the embedding,
    # which the loader ties back), as transformers saves a checkpoint
    state = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    persistent = model.state_dict(keep_vars=True)
    state.update(
        (name, b.detach().contiguous())
        for name, b in model.named_buffers()
        if name in persistent and name not in state
    )
    save_file(state, str(target / "model.safetensors"))


def _note(summary: dict) -> str:
    return (
        f"tensor parallel: {summary['size']} ranks ({summary['backend']}), "
        f"{summary['heads_per_rank']} query / {summary['kv_heads_per_rank']} KV head(s) per "
        f"rank{' (KV heads replicated)' if summary['kv_replicated'] else ''}"
        f"{' (MLA latent replicated)' if summary['mla_latent_replicated'] else ''}, KV "
        f"{summary['kv_bytes_per_token_per_rank']} B/token per rank of "
        f"{summary['kv_bytes_per_token_unsplit']} unsplit; {summary['mlps_split']} MLP(s) "
        f"and {summary['expert_modules_split']} expert module(s) split by width "
        f"({summary['moe_blocks']} MoE block(s)), {summary['all_reduces_per_forward']} "
        f"all-reduces per forward; weights read as {summary['weights']}"
    )
