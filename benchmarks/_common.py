"""Shared pieces of the serving benchmark: model specs, workloads, timing and environment."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Every system gets the same KV block granularity where it has one (kvskill block size,
#: transformers' continuous-batching page size), so paging waste is compared like for like.
BLOCK_SIZE = 16
# NOTE: a CPU benchmark at the other systems' block size, not a check against the NPU: the
# runtime's default NPU profile (block sizes of 128..512) is turned off for every benchmark.
os.environ.setdefault("KVSKILL_CPU_ONLY_SHAPES", "1")

#: Tokens one scheduler step may process (prefill chunk budget) for the systems that take one.
TOKEN_BUDGET = 1024


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A shrunk model built from its config with seeded random weights (nothing is downloaded)."""

    name: str
    #: transformers model type: the config class and the causal-LM class come from it, and it
    #: is the name `kvskill apply` converts.
    model_type: str = "qwen3"
    #: Overrides applied to transformers' default config of `model_type`.
    overrides: dict
    #: Seed for the weight init; every process that builds this spec gets the same state dict.
    seed: int = 1234
    #: One-line description for the report (what is shrunk, what is kept).
    note: str = ""

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self.overrides)

    @property
    def is_mla(self) -> bool:
        """Latent attention: the cache holds one compressed latent + rope key per token."""
        return "kv_lora_rank" in self.overrides

    @property
    def vocab_size(self) -> int:
        return int(self.overrides["vocab_size"])


_SHARED = {
    # A 4k vocabulary keeps the LM head from dominating the step, so attention, KV handling
    # and scheduling (what the systems differ in) stay visible in the numbers.
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

#: Layers of the shrunk DeepSeek-V3. Every one is dense (first_k_dense_replace = all layers):
#: the MoE block runs the same transformers code in every system (only attention and the KV
#: cache are rewritten), so tiny experts would add routing cost and near-tie expert choices
#: without telling the systems apart.
_MLA_LAYERS = 2

MODELS: dict[str, ModelSpec] = {
    "qwen3-4l-h256": ModelSpec(
        name="qwen3-4l-h256",
        overrides={
            **_SHARED,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
        },
        note="Qwen3, 4 layers, hidden 256, GQA 4/2 heads of 64",
    ),
    # The overhead regime: so little compute per token that host work shows.
    "qwen3-2l-h128": ModelSpec(
        name="qwen3-2l-h128",
        overrides={
            **_SHARED,
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
        },
        note="Qwen3, 2 layers, hidden 128, MQA 2/1 heads of 64",
    ),
    # Multi-head latent attention. The fused attention's absorbed MLA path only takes a rope
    # head dim of 64 and a latent (absorbed query head dim) of 128 or 512 (npu_ops §1.8), so
    # those two stay at the smallest accepted values; the per-head dims are small but distinct
    # (nope 32, value 48) so a wrong key/value split changes the tokens. q_lora_rank keeps the
    # query down-projection of the real model.
    "deepseek_v3-2l-h256": ModelSpec(
        name="deepseek_v3-2l-h256",
        model_type="deepseek_v3",
        overrides={
            **_SHARED,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": _MLA_LAYERS,
            "first_k_dense_replace": _MLA_LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 64,
            "kv_lora_rank": 128,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 48,
            "head_dim": 64,
            # MoE keys kept consistent although no layer is MoE (group routing needs
            # n_group to divide the experts).
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "moe_intermediate_size": 64,
        },
        note="DeepSeek-V3 (MLA), 2 dense layers, hidden 256, 4 heads, latent 128 + rope 64",
    ),
}


#: Models only the peer benchmark runs (peers_bench.py): too slow for serve_bench's plan.
PEER_ONLY_MODELS: dict[str, ModelSpec] = {
    # Qwen3-0.6B's shape (its config's widths, heads, vocabulary and tied embeddings) cut to
    # 8 of its 28 layers: the peer benchmark's model (peers_bench.py), where linear layers and
    # the LM head dominate a step as in a real small model.
    "qwen3-0.6b-8l": ModelSpec(
        name="qwen3-0.6b-8l",
        overrides={
            **_SHARED,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
        },
        note="Qwen3-0.6B shape (hidden 1024, GQA 16/8 heads of 128, vocab 151936, tied) cut "
        "to 8 layers",
    ),
}


def build_reference_model(spec: ModelSpec):
    """The transformers model for `spec`: fp32, eval, sdpa, weights from `spec.seed`."""
    from transformers import AutoModelForCausalLM

    config = spec.config()
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(torch.float32).eval()


def kv_bytes_per_token(spec: ModelSpec) -> int:
    """KV cache bytes one token occupies across all layers (fp32).

    Standard attention keeps K and V per key-value head. MLA keeps the normalised latent and
    the rotated rope key, one "head", in every system here (transformers' DeepSeek-V3 caches
    the compressed latent too and expands it on every step).
    """
    o = spec.overrides
    if spec.is_mla:
        per_layer = o["kv_lora_rank"] + o["qk_rope_head_dim"]
    else:
        per_layer = 2 * o["num_key_value_heads"] * o["head_dim"]
    return o["num_hidden_layers"] * per_layer * 4


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A fixed set of requests, all submitted at t=0; EOS is ignored so lengths are exact."""

    name: str
    description: str
    prompts: list[list[int]]
    max_tokens: list[int]
    #: KV pool capacity in tokens for the paged systems (a multiple of BLOCK_SIZE).
    kv_capacity_tokens: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)

    def warmup(self) -> Workload:
        """A short run with the first few requests, to take one-time costs out of the timings."""
        n = min(4, self.num_requests)
        return Workload(
            name=f"{self.name}-warmup",
            description="warm-up",
            prompts=self.prompts[:n],
            max_tokens=[min(4, m) for m in self.max_tokens[:n]],
            kv_capacity_tokens=self.kv_capacity_tokens,
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _demand_tokens(prompt_lens: list[int], max_tokens: list[int]) -> int:
    """Block-rounded KV tokens all requests hold when every one is at its longest."""
    return sum(_round_up(p + m, BLOCK_SIZE) for p, m in zip(prompt_lens, max_tokens, strict=True))


WORKLOADS = ("W1", "W2", "W3", "W4")


def make_workload(name: str, vocab_size: int, seed: int = 0) -> Workload:
    """Build one of W1..W4 with random prompt tokens from a fixed seed."""
    g = torch.Generator().manual_seed(seed + WORKLOADS.index(name))
    if name == "W1":
        n = 32
        prompt_lens = torch.randint(16, 257, (n,), generator=g).tolist()
        max_tokens = torch.randint(8, 129, (n,), generator=g).tolist()
        desc = "heterogeneous: 32 requests, prompts 16-256, outputs 8-128"
    elif name == "W2":
        n = 16
        prompt_lens, max_tokens = [128] * n, [64] * n
        desc = "uniform: 16 x 128 -> 64"
    elif name == "W3":
        n = 4
        prompt_lens, max_tokens = [2048] * n, [32] * n
        desc = "long context: 4 x 2048 -> 32"
    elif name == "W4":
        n = 16
        prompt_lens = torch.randint(160, 257, (n,), generator=g).tolist()
        max_tokens = [96] * n
        desc = "preemption: 16 x 160-256 -> 96, KV pool ~40% of peak demand"
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    prompts = [torch.randint(0, vocab_size, (p,), generator=g).tolist() for p in prompt_lens]
    demand = _demand_tokens(prompt_lens, max_tokens)
    if name == "W4":
        # Large enough for the longest request plus a few more, far below the total demand.
        capacity = _round_up(int(demand * 0.4), BLOCK_SIZE)
    else:
        # Every request fits at once (plus one block of slack each), so nothing is preempted.
        capacity = demand + n * BLOCK_SIZE
    return Workload(
        name=name,
        description=desc,
        prompts=prompts,
        max_tokens=max_tokens,
        kv_capacity_tokens=capacity,
    )


@dataclass(kw_only=True)
class KVStats:
    """KV memory at the moment a system held the most KV (its peak)."""

    #: Bytes of KV storage the system held for requests at its peak (blocks or dense caches).
    held_bytes: int
    #: Bytes of that storage holding tokens of requests still running at that moment.
    live_bytes: int
    #: Bytes of KV storage preallocated for the whole run (the pool), when the system has one.
    pool_bytes: int | None = None

    @property
    def utilization(self) -> float | None:
        return self.live_bytes / self.held_bytes if self.held_bytes else None


@dataclass(kw_only=True)
class RunResult:
    """One timed run of a workload by one system."""

    tokens: list[list[int]]
    wall_s: float
    ttft_s: list[float]
    kv: KVStats | None = None
    extra: dict = field(default_factory=dict)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


class Clock:
    """Wall time since a start point (perf_counter)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict:
    """Machine and software versions recorded with every result file."""
    import transformers
    from kvskill.runtime.ops import cpu_kernels

    kernel = cpu_kernels.status()
    return {
        "machine": {
            "cores": os.cpu_count(),
            "cpu": _cpu_model(),
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvskill_commit": _git("rev-parse", "--short", "HEAD"),
            "kvskill_dirty": bool(_git("status", "--porcelain", "--", ".")),
        },
        "python_executable": sys.executable,
        # whether kvskill's paged decode ran in the compiled CPU kernel or in PyTorch
        "cpu_kernels": {"available": kernel.available, "reason": kernel.reason},
    }


def write_kernel_report(
    out: Path, benchmark: str, threads: int, load_before: list[float] | None, rows: list[dict]
) -> None:
    """A per-shape kernel benchmark's result file: its rows, the load around them and the
    environment."""
    report = {
        "benchmark": benchmark,
        "threads": threads,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "rows": rows,
        "environment": environment(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


def as_dict(obj) -> dict:
    return asdict(obj)
