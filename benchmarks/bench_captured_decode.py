"""Captured decode per family: graph breaks, and per decode step the host syncs, operator
calls and copies in eager and captured modes.

What it measures, for each family (a small converted model with seeded random weights, fp32,
block size 16, three requests decoding together = bucket 4 with one padded row):

- graph breaks: ``torch._dynamo.explain`` over the padded decode step, with its reasons; a
  family with breaks cannot be captured whole and is listed with them.
- eager, per decode step (the model forward): host syncs (``Tensor.item`` / ``tolist`` /
  ``__bool__`` / ``__int__`` / ``__float__`` / ``numpy`` calls: each waits for the device on
  an NPU), operator calls (non-view ATen operators dispatched; each reference operator
  counts once, as the one kernel it is on an NPU) and copies (``copy_``, ``_to_copy``,
  ``clone``).
- captured: the same three counts read off the ATen graph the capture compiles (host syncs
  are its ``_local_scalar_dense`` nodes: the lengths the converted attention reads as ints),
  and the host launches per step: one graph replay.
- token-exact: the captured run's tokens and per-step logits against the eager run's.
- compile time and decode step time of ``--inductor-family`` with inductor (the CPU default).

Run: ``.venv/bin/python benchmarks/bench_captured_decode.py [--families llama,qwen3]
[--out PATH] [--inductor-family llama]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "fixtures"))

import torch  # noqa: E402
from mla_models import tiny_config  # noqa: E402
from small_configs import SMALL_JAMBA, SMALL_QWEN3_NEXT  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

_DENSE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}

#: a 2-layer DSA model in the sparse operators' shapes: 512 latent, the indexer's 16 heads of
#: 128 keeping 8 positions (fewer than the longer prompts hold)
_DSA = {"kv_lora_rank": 512, "index_n_heads": 16, "index_head_dim": 128, "index_topk": 8}

#: a 3-layer DeepSeek-V4, one layer of each kind
_V4 = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "head_dim": 32, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "index_n_heads": 8, "index_head_dim": 16, "index_topk": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["moe"] * 3,
}  # fmt: skip

#: family -> (model type, config overrides)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", _DENSE),
    "qwen3": ("qwen3", {**_DENSE, "head_dim": 16}),
    "deepseek_v3": ("deepseek_v3", tiny_config("deepseek_v3")),
    # one full-attention and one sliding-window layer (window 12)
    "qwen3 (sliding)": (
        "qwen3",
        {
            **_DENSE,
            "head_dim": 16,
            "use_sliding_window": True,
            "sliding_window": 12,
            "max_window_layers": 1,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ),
    "qwen2": ("qwen2", _DENSE),
    # every layer sliding, window 12 (prompt + output reach 15 tokens)
    "mistral (sliding)": ("mistral", {**_DENSE, "sliding_window": 12}),
    "qwen3_moe": (
        "qwen3_moe",
        {
            **_DENSE,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
    ),  # fmt: skip
    "mixtral": ("mixtral", {**_DENSE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # FA v2 with learnable sinks (value head dim 64 to 128); a sliding (window 8) and a full layer
    "gpt_oss (sliding+sinks)": (
        "gpt_oss",
        {
            **_DENSE,
            "head_dim": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),  # fmt: skip
    "deepseek_v2": ("deepseek_v2", tiny_config("deepseek_v2")),
    "qwen3_next (hybrid)": ("qwen3_next", {**SMALL_QWEN3_NEXT, "max_position_embeddings": 256}),
    "jamba (hybrid)": ("jamba", {**SMALL_JAMBA, "max_position_embeddings": 256}),
    "deepseek_v32 (dsa)": ("deepseek_v32", tiny_config("deepseek_v3", **_DSA)),
    # GLM-5's DSA: layer 0 runs its indexer, layer 1 reuses its top-k
    "glm_moe_dsa (dsa+shared)": (
        "glm_moe_dsa",
        tiny_config("glm_moe_dsa", **_DSA, indexer_types=["full", "shared"]),
    ),
    # DeepSeek-V4: a sliding, a CSA (ratio 4, the indexer's top-4) and an HCA (ratio 128)
    # layer over the 128-token window the conversion requires
    "deepseek_v4 (compressed)": ("deepseek_v4", _V4),
}

PROMPTS = [[1, 5, 9, 33, 7], [4, 4, 100, 3, 2, 8, 9, 10, 11], [17, 3]]
MAX_TOKENS = 6
#: tokens per request of the timed runs (the median is over their decode steps)
TIMED_TOKENS = 40

_SYNC_METHODS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}
_COPY_OPS = {"copy_", "_to_copy", "clone"}


class _SyncCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS:
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _convert(family: str, root: Path) -> Path:
    from kvskill.implementer.writer import ApplyOptions, apply_model

    model_type, overrides = FAMILIES[family]
    out = root / family.replace(" ", "_").strip("()").replace("(", "").replace(")", "")
    apply_model(model_type, out, ApplyOptions(config_overrides=overrides))
    return out


def _llm(model_dir: Path, *, graph: bool, backend=None):
    from kvskill.runtime import LLM

    # exact: the model's own code in both modes, as LLM(graph=True) runs it (the fast paths
    # stay off under graph capture)
    llm = LLM(
        model_dir,
        exact=True,
        random_weights=True,
        seed=1,
        block_size=16,
        num_blocks=64,
        max_num_seqs=4,
        max_model_len=128,
        cpu_only_shapes=True,
        trust_remote_code=True,
    )
    if graph:
        from kvskill.runtime.captured_decode import CapturedDecode

        llm.engine.captured_decode = CapturedDecode(
            llm.model, llm.kv_manager, max_num_seqs=4, max_model_len=128, backend=backend
        )
    return llm


def _generate(llm, max_tokens: int = MAX_TOKENS):
    from kvskill.runtime import SamplingParams

    logits = []
    llm.engine.step_hooks.append(
        lambda r: logits.append(r.logits) if not r.metadata.is_prefill else None
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], logits


def _eager_counts(llm) -> dict:
    """Counts over the first decode step's forward, eager."""
    from kvskill.runtime.ops.reference.graph_ops import dispatched_operators

    engine = llm.engine
    counted = {}
    forward = engine._forward

    def counting_forward(*args, **kwargs):
        if counted or args[3].is_prefill:
            return forward(*args, **kwargs)
        syncs, ops = _SyncCounter(), _OpCounter()
        with dispatched_operators(), syncs, ops:
            out = forward(*args, **kwargs)
        counted.update(
            host_syncs=sum(syncs.syncs.values()),
            sync_kinds=dict(syncs.syncs),
            operator_calls=sum(ops.ops.values()),
            copies=sum(n for name, n in ops.ops.items() if name in _COPY_OPS),
        )
        return out

    engine._forward = counting_forward
    try:
        tokens, logits = _generate(llm)
    finally:
        engine._forward = forward
    return {"counts": counted, "tokens": tokens, "logits": logits}


class _AtenGraphs:
    """A torch.compile backend that keeps the ATen graph it is given and runs it as is."""

    def __init__(self) -> None:
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(aten_gm, _inputs):
            self.graphs.append(aten_gm)
            return make_boxed_func(aten_gm.forward)

        return aot_autograd(fw_compiler=keep)(gm, example_inputs)


def _graph_counts(gm) -> dict:
    ops = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
        if name is None:
            name = getattr(target, "__name__", str(target))
            if name == "getitem":
                continue
        if getattr(target, "is_view", False):
            continue
        ops[name] += 1
    return {
        "host_syncs": ops["_local_scalar_dense"],
        "operator_calls": sum(ops.values()),
        "copies": sum(n for name, n in ops.items() if name in _COPY_OPS),
        "host_launches": 1,
    }


def _graph_breaks(llm) -> dict:
    """torch._dynamo.explain over one padded decode step of LLM (a fresh engine state)."""
    from kvskill.runtime import SamplingParams
    from kvskill.runtime.captured_decode import CapturedDecode, traced_scalar_reads

    captured = CapturedDecode(llm.model, llm.kv_manager, max_num_seqs=4, max_model_len=128)
    found = {}

    def explain(inputs):
        padded = captured._pad(inputs, captured.bucket_for(inputs.input_ids.size(1)))
        torch._dynamo.reset()
        with torch.inference_mode(), traced_scalar_reads():
            report = torch._dynamo.explain(captured._forward)(*padded)
        found["graph_breaks"] = report.graph_break_count
        found["reasons"] = sorted({_short(r.reason) for r in report.break_reasons})
        return None  # then the step runs eagerly

    class _Probe:
        stats = captured.stats

        def __call__(self, inputs):
            return None if found else explain(inputs)

    llm.engine.captured_decode = _Probe()
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.captured_decode = None
    return found


def _short(reason: str) -> str:
    line = reason.strip().splitlines()[0]
    return line[:160]


def measure(family: str, root: Path) -> dict:
    model_dir = _convert(family, root)
    row: dict = {"family": family}
    row.update(_graph_breaks(_llm(model_dir, graph=False)))
    eager = _eager_counts(_llm(model_dir, graph=False))
    row["eager"] = eager["counts"]
    if row["graph_breaks"]:
        return row
    torch._dynamo.reset()
    backend = _AtenGraphs()
    llm = _llm(model_dir, graph=True, backend=backend)
    tokens, logits = _generate(llm)
    row["captured"] = _graph_counts(backend.graphs[0])
    row["captured_buckets"] = llm.engine.captured_decode.stats.compiled_buckets
    row["tokens_identical"] = tokens == eager["tokens"]
    row["max_logit_diff"] = max(
        (g - e).abs().max().item() for g, e in zip(logits, eager["logits"], strict=True)
    )
    return row


def inductor_timing(family: str, root: Path) -> dict:
    """Compile time and median decode step time, eager vs inductor (CPU)."""
    model_dir = root / family.replace(" ", "_").strip("()").replace("(", "").replace(")", "")
    if not model_dir.exists():
        _convert(family, root)
    times = {}
    for graph in (False, True):
        torch._dynamo.reset()
        llm = _llm(model_dir, graph=graph, backend="inductor")
        steps = []
        step = llm.engine.step

        def timed_step(step=step, steps=steps):
            started = time.perf_counter()
            out = step()
            steps.append(time.perf_counter() - started)
            return out

        llm.engine.step = timed_step
        _generate(llm, max_tokens=TIMED_TOKENS)
        decode = steps[2:]  # after the prefill and the first (compiling) decode step
        times["graph" if graph else "eager"] = {
            "median_decode_step_ms": statistics.median(decode) * 1000,
            "compile_s": llm.engine.captured_decode.stats.compile_s if graph else 0.0,
        }
    return {"family": family, **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--inductor-family", default="llama")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family in filter(None, args.families.split(",")):
            try:
                row = measure(family, root)
            except Exception as exc:  # a family that fails to convert or run is reported
                row = {"family": family, "error": f"{type(exc).__name__}: {_short(str(exc))}"}
            print(json.dumps(row), flush=True)
            rows.append(row)
        timing = inductor_timing(args.inductor_family, root) if args.inductor_family else None
    if timing:
        print(json.dumps(timing), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"families": rows, "inductor": timing}, indent=2))


if __name__ == "__main__":
    main()
