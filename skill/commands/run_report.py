"""What ``kvskill run`` prints: the report of one generation (a table, or one JSON object)
and the token counter shown while it runs."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click


class Progress:
    """A one-line token counter on stderr, shown only on a terminal and after a moment."""

    DELAY_S = 1.0

    def __init__(self, total_tokens: int, enabled: bool) -> None:
        self.total = total_tokens
        self.enabled = enabled
        self.done = 0
        self.started = time.perf_counter()
        self.last_draw = 0.0
        self.drawn = False

    def update(self, step_outputs) -> None:
        self.done += sum(len(o.new_token_ids) for o in step_outputs)
        now = time.perf_counter()
        if not self.enabled or now - self.started < self.DELAY_S or now - self.last_draw < 0.1:
            return
        self.last_draw, self.drawn = now, True
        width = 30
        filled = int(width * min(self.done / max(self.total, 1), 1.0))
        rate = self.done / (now - self.started)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} tokens "
            f"{rate:8.1f} tok/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")


def run_report(llm, outputs, *, wall_s: float, directory: Path, sizing_note: str | None) -> dict:
    """The report of one ``llm.generate`` over OUTPUTS: what ran, where, how fast, the KV
    pools and the operators' backends (the JSON form; ``render_table`` prints it)."""
    from kvskill.runtime.ops import backend, fla, profile_report

    report = _report(llm, outputs, wall_s, directory, backend().name)
    report["kv_budget"]["workload"] = sizing_note
    report["kv_budget"]["dtype"] = _pool_dtype(llm)
    report["cpu_decode_kernel"] = _cpu_decode_kernel(report["ops_backend"])
    report["npu_limits"] = profile_report(
        llm.npu_profile, dtype=llm.engine_config.dtype_name, twin=False
    )
    # which backend ran each recurrent-state entry point (conv, delta rule, scan), and why
    report["state_ops"] = fla.dispatch_report()
    captured = llm.engine.captured_decode
    if captured is not None:
        report["captured_decode"] = captured.stats.to_dict()
    if llm.tensor_parallel is not None:
        from kvskill.runtime.distributed.report import tensor_parallel_summary

        report["tensor_parallel"] = tensor_parallel_summary(llm)
    return report


def print_report(report: dict, output_format: str) -> None:
    """REPORT on stdout: one JSON object, or the table."""
    click.echo(json.dumps(report) if output_format == "json" else render_table(report))


def engine_config_line(engine_config: dict) -> str:
    """The settings that differ from ``EngineConfig()``'s defaults, as ``name=value``."""
    from kvskill.runtime.engine_config import EngineConfig

    default = EngineConfig().to_dict()
    changed = [
        f"{name}={value}" for name, value in engine_config.items() if value != default.get(name)
    ]
    return ", ".join(changed) if changed else "the defaults (EngineConfig())"


#: the dtype analyze sizes a model at when its config names none (``analyzer/config.py``)
ANALYZE_DEFAULT_DTYPE = "bfloat16"


def _pool_dtype(llm) -> dict:
    """The dtypes the pool was sized at, the run's --dtype, and the model's (what analyze
    sizes at: the config's dtype, else bfloat16), so the two verbs' block counts can be told
    apart."""
    pool = sorted(
        {str(entry.dtype).removeprefix("torch.") for _, entry in llm.cache_info.entries()}
    )
    config = llm.text_config
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    model = str(named).removeprefix("torch.") if named else ANALYZE_DEFAULT_DTYPE
    return {"pool": pool, "run": llm.engine_config.dtype_name, "model": model}


def _pool_dtype_line(dtype: dict) -> str:
    line = f"sized at {', '.join(dtype['pool'])} (--dtype {dtype['run']})"
    if dtype["model"] != dtype["run"]:
        line += (
            f"; analyze sizes at the model's {dtype['model']}: `kvskill run --dtype "
            f"{dtype['model']}` allocates its block counts"
        )
    return line


def _cpu_decode_kernel(ops_backend: str) -> dict | None:
    """Whether the reference ops ran plain decode attention in the compiled CPU kernel (None
    on the NPU, which runs the real operator)."""
    if ops_backend != "reference":
        return None
    from kvskill.runtime.ops import cpu_kernels

    state = cpu_kernels.status()
    return {"in_use": state.available, "reason": state.reason}


def _report(llm, outputs, wall_s: float, directory: Path, ops_backend: str) -> dict:
    stats = llm.stats
    generated = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.ttft_s for o in outputs if o.ttft_s is not None]
    reasons: dict[str, int] = {}
    for o in outputs:
        key = o.finish_reason.value if o.finish_reason else "unfinished"
        reasons[key] = reasons.get(key, 0) + 1
    kv = {
        key: {
            "block_size": llm.kv_manager.block_size_of(key),
            "blocks_total": llm.kv_manager.initial_free_blocks[key],
            "blocks_peak": stats.peak_blocks_used.get(key, 0),
            "blocks_used_now": llm.kv_manager.initial_free_blocks[key]
            - llm.kv_manager.num_free_blocks[key],
        }
        for key in llm.kv_manager.group_keys
    }
    return {
        "model_dir": str(directory),
        "device": str(llm.device),
        "ops_backend": ops_backend,
        "max_model_len": llm.max_model_len,
        #: every setting the engine ran with (``EngineConfig``)
        "engine_config": llm.engine_config.to_dict(),
        "summary": {
            "requests": len(outputs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
            "generated_tokens": generated,
            "wall_s": wall_s,
            "throughput_tok_s": generated / wall_s if wall_s > 0 else None,
            "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
            "steps": stats.num_steps,
            "prefill_steps": stats.num_prefill_steps,
            "decode_steps": stats.num_decode_steps,
            "preemptions": stats.num_preemptions,
            "finish_reasons": reasons,
        },
        "kv_budget": {
            "rule": llm.kv_budget.rule,
            "num_blocks_per_group": llm.kv_budget.num_blocks,
            "kv_memory_bytes": llm.kv_budget.kv_memory_bytes,
            "reason": llm.kv_budget.reason,
        },
        "kv_cache": kv,
        "prefix_cache": _prefix_cache_report(llm),
        #: speculative decoding with the MTP layers (None when off): drafts accepted / drafted,
        #: tokens a request gains per decode step
        "speculation": None if stats.speculation is None else stats.speculation.to_dict(),
        #: exact run (--exact) or fast paths; each path on or off, and why it is off
        "exact": llm.engine_config.exact,
        "fast_paths": llm.fast_paths.to_dict() if llm.fast_paths is not None else {},
        #: fp32 CPU linear layers run through oneDNN (prepack_linear; 0 = off)
        "prepacked_linear_layers": llm.num_prepacked_linears,
        #: RMSNorm and gated-MLP modules, and attention modules whose rotary embedding runs on
        #: the fused kernels (fuse_layers; 0 = off)
        "fused_layers": llm.num_fused_layers,
        #: rows of greedy steps decided by the output head's bf16 screen (screen_output_head;
        #: None = off)
        "output_head_screen": (
            None if llm.output_head_screen is None else llm.output_head_screen.stats.to_dict()
        ),
        "requests": [o.to_dict() for o in outputs],
    }


def _prefix_cache_report(llm) -> dict:
    """On or off and why; the hit rate is tokens found cached / tokens looked up at every
    admission (a preempted request's readmission looks its tokens up again)."""
    stats = llm.stats
    return {
        "enabled": llm.prefix_caching,
        "disabled_reason": llm.prefix_caching_disabled_reason,
        "query_tokens": stats.num_prefix_query_tokens,
        "hit_tokens": stats.num_prefix_hit_tokens,
        "hit_rate": stats.prefix_cache_hit_rate,
        "cached_blocks": stats.num_cached_blocks,
    }


#: the table's name of each fast path, and what its count counts
_FAST_PATH_ROWS = {
    "prepack_linear": ("prepacked linears", "{count} layers (oneDNN)"),
    "fuse_layers": ("fused layers", "{count} modules (RMSNorm, SiLU x up, rope)"),
    "screen_output_head": ("screened head", "bf16 screen of the output head"),
}


def _fast_path_rows(report: dict) -> list[tuple[str, str]]:
    """One row for an exact run; else one row per fast path: on with what it covered, or off
    with the reason."""
    if report["exact"]:
        return [("compute", "exact (--exact): the model's own code bit for bit, no fast path")]
    rows = []
    screen = report.get("output_head_screen")
    for name, path in report["fast_paths"].items():
        title, covered = _FAST_PATH_ROWS[name]
        if not path["on"]:
            rows.append((title, f"off: {path['reason']}"))
            continue
        line = "on: " + covered.format(count=path["count"])
        if name == "screen_output_head" and screen is not None:
            line += (
                f"; {screen['num_screened_rows']} rows screened, "
                f"{screen['candidates_per_row']:.1f} fp32 candidates a row, "
                f"{screen['num_fallback_rows']} rows on the plain head"
            )
        rows.append((title, line))
    return rows


def _prefix_cache_line(prefix: dict) -> str:
    if prefix["enabled"]:
        return (
            f"on: hit rate {prefix['hit_rate']:.1%} ({prefix['hit_tokens']}/"
            f"{prefix['query_tokens']} tokens), {prefix['cached_blocks']} cached blocks"
        )
    if prefix["disabled_reason"]:
        return f"off: {prefix['disabled_reason']}"
    return "off (--no-prefix-caching)"


def _kernel_note(report: dict) -> str:
    kernel = report.get("cpu_decode_kernel")
    if kernel is None:
        return ""
    return " (decode in the CPU kernel)" if kernel["in_use"] else " (decode in PyTorch)"


def _tp_line(tp: dict) -> str:
    per_step = tp["comm_s_per_step"]
    comm = f"{per_step * 1e3:.1f} ms/step" if per_step is not None else "n/a"
    return (
        f"{tp['size']} ranks ({tp['backend']}), {tp['kv_heads_per_rank']} KV head(s) per rank, "
        f"KV {tp['kv_bytes_per_token_per_rank']} B/token per rank (unsplit "
        f"{tp['kv_bytes_per_token_unsplit']}), rank-0 communication {comm}"
    )


def render_table(report: dict) -> str:
    from kvskill.runtime.ops import fla, profile_line

    s = report["summary"]
    rows = [
        ("model", report["model_dir"]),
        ("device / ops", f"{report['device']} / {report['ops_backend']}{_kernel_note(report)}"),
        ("engine config", engine_config_line(report["engine_config"])),
        ("requests", str(s["requests"])),
        ("prompt tokens", str(s["prompt_tokens"])),
        ("generated tokens", str(s["generated_tokens"])),
        ("wall time", f"{s['wall_s']:.3f} s"),
        ("throughput", f"{s['throughput_tok_s'] or 0:.1f} tok/s"),
        ("mean TTFT", f"{(s['mean_ttft_s'] or 0) * 1000:.1f} ms"),
        ("steps (prefill/decode)", f"{s['steps']} ({s['prefill_steps']}/{s['decode_steps']})"),
        ("preemptions", str(s["preemptions"])),
        ("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items()))),
    ]
    rows.append(("KV budget", report["kv_budget"]["reason"]))
    if report["kv_budget"].get("workload"):
        rows.append(("", report["kv_budget"]["workload"]))
    if report["kv_budget"].get("dtype"):
        rows.append(("", _pool_dtype_line(report["kv_budget"]["dtype"])))
    rows.append(("NPU limits", profile_line(report["npu_limits"]).removeprefix("NPU limits: ")))
    rows.append(("prefix cache", _prefix_cache_line(report["prefix_cache"])))
    spec = report.get("speculation")
    if spec is not None:
        rows.append(
            (
                "speculative (MTP)",
                f"acceptance {spec['acceptance_rate']:.2f} "
                f"({spec['num_accepted_draft_tokens']}/{spec['num_draft_tokens']} drafts), "
                f"{spec['tokens_per_step']:.2f} tokens per request per decode step",
            )
        )
    rows.extend(_fast_path_rows(report))
    captured = report.get("captured_decode")
    if captured is not None:
        rows.append(("captured decode", _captured_line(captured)))
    if "tensor_parallel" in report:
        rows.append(("tensor parallel", _tp_line(report["tensor_parallel"])))
    rows.extend(("state ops", line) for line in fla.dispatch_lines(report.get("state_ops", [])))
    for key, kv in report["kv_cache"].items():
        rows.append(
            (
                f"KV {key} blocks",
                f"peak {kv['blocks_peak']}/{kv['blocks_total']} (block size {kv['block_size']}), "
                f"in use now {kv['blocks_used_now']}",
            )
        )
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    shown = report["requests"][:16]
    if shown:
        lines.append("")
        for r in shown:
            ids = r["token_ids"]
            text = ",".join(map(str, ids[:24])) + (",…" if len(ids) > 24 else "")
            lines.append(
                f"request {r['request_id']}: prompt {r['prompt_len']} tokens -> "
                f"{len(ids)} tokens ({r['finish_reason']}): {text}"
            )
        if len(report["requests"]) > len(shown):
            lines.append(f"... {len(report['requests']) - len(shown)} more (use --format json)")
    return "\n".join(lines)


def _captured_line(captured: dict) -> str:
    buckets = ", ".join(map(str, captured["compiled_buckets"])) or "none"
    return (
        f"buckets {buckets} compiled in {captured['compile_s']:.1f} s, "
        f"{captured['num_replays']} replays, {captured['num_eager_decode_steps']} decode steps eager"
        + (f" ({captured['eager_reason']})" if captured.get("eager_reason") else "")
    )
