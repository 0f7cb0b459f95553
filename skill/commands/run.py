"""``kvskill run``: generate with a converted model in the bundled runtime."""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
from kvskill.core.errors import BadInputError
from kvskill.core.inputs import (
    MAX_JSON_BYTES,
    MAX_TEXT_BYTES,
    loads_json,
    read_text,
)
from kvskill.core.kv_blocks import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from kvskill.core.sizes import parse_size as core_parse_size
from kvskill.options import (
    block_size_option,
    cpu_only_shapes_option,
    dtype_option,
    existing_dir,
    format_option,
    kv_layout_option,
    log_layout_option,
    seed_option,
    tp_backend_option,
    tp_option,
    trust_remote_code_option,
)

EPILOG = """\b
Examples:
  kvskill run converted/ --random-weights --num-requests 16 --prompt-len 64 --max-tokens 32
  kvskill run converted/ --prompt-ids 1,2,3,4 --max-tokens 8 --format json
  kvskill run converted/ --prompt-ids '1,2,3;7,8' --num-blocks 64 --block-size 16
  kvskill run converted/ --prompt-ids prompts.jsonl --kv-memory 256MiB
  kvskill run converted/ --random-weights --num-requests 2 --dtype bfloat16   # NPU dtypes too
  kvskill run converted/ --prompt-ids 1,2,3 --block-size 16 --cpu-only-shapes

\b
--prompt-ids takes one comma list, several separated by ';', or a .json file (a list of id
lists) / .jsonl file (one id list per line).

\b
Every step's operator calls are checked against the NPU's limits (block sizes, head dims;
dtypes in float16/bfloat16) unless --cpu-only-shapes; the report says what was checked.

\b
Exit codes: 0 success, 1 an operator call the NPU refuses, 2 bad input (e.g. a block
size the NPU does not take), 3 unsupported model.
"""


def parse_size(text: str) -> int:
    """``--kv-memory``: the size parser every verb uses (``kvskill.core.sizes``)."""
    size = core_parse_size(text, option="--kv-memory")
    assert size is not None
    return size


def parse_prompt_ids(value: str) -> list[list[int]]:
    """Prompts from a comma list (';' between prompts) or a .json / .jsonl file of id lists."""
    path = Path(value)
    if path.suffix in (".json", ".jsonl"):
        text = read_text(path, what="--prompt-ids file", max_bytes=MAX_JSON_BYTES)
        if path.suffix == ".jsonl":
            prompts = [
                loads_json(line, what="--prompt-ids file", path=f"{path}:{number}")
                for number, line in enumerate(text.splitlines(), 1)
                if line.strip()
            ]
        else:
            prompts = loads_json(text, what="--prompt-ids file", path=path)
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]  # a single id list
        if not isinstance(prompts, list) or not all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompts
        ):
            raise BadInputError(f"--prompt-ids file {path} must hold lists of integer token ids")
        return prompts
    if len(value) > MAX_TEXT_BYTES:
        raise BadInputError("--prompt-ids is too long; put the prompts in a .json/.jsonl file")
    try:
        return [[int(t) for t in part.split(",") if t.strip()] for part in value.split(";")]
    except ValueError as exc:
        raise BadInputError(
            f"--prompt-ids {value!r} is neither a comma list of ids nor a .json/.jsonl file"
        ) from exc


class _Progress:
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


@click.command(epilog=EPILOG)
@click.argument("directory", type=existing_dir)
@click.option(
    "--prompt-ids",
    default=None,
    help="Prompt token ids: a comma list ('1,2,3'; ';' separates prompts), or a .json/.jsonl "
    "file of id lists.",
)
@click.option("--num-requests", type=click.IntRange(min=1), default=None, help="Synthetic load.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option(
    "--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables top-k."
)
@click.option(
    "--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True
)
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@block_size_option
@cpu_only_shapes_option
@click.option(
    "--num-blocks",
    type=click.IntRange(min=2),
    default=None,
    help="KV blocks of EACH cache group (null block included); instead of --kv-memory.",
)
@click.option(
    "--kv-memory",
    default=None,
    help="KV memory budget shared by the cache groups, e.g. '512M' or '2GiB' (K/M/G and "
    "KiB/MiB/GiB are powers of 1024, KB/MB/GB powers of 1000). Default: what --max-num-seqs "
    "requests of --max-model-len tokens need, capped at 10% of the device's total memory and "
    "at 4 GiB (the same on every run).",
)
@click.option(
    "--max-model-len", type=click.IntRange(min=2), default=None, help="Tokens per request at most."
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
    show_default=True,
    help="Tokens per step at most (longer prompts are chunked).",
)
@click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=DEFAULT_MAX_NUM_SEQS, show_default=True
)
@click.option(
    "--prefix-caching/--no-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse the KV of full blocks of prompt prefixes already computed (shared by "
    "requests, evicted least recently used). Off by itself for models with state layers.",
)
@click.option(
    "--prepack-linear",
    is_flag=True,
    help="Run fp32 linear layers on the CPU through oneDNN with weights reordered once (q/k/v "
    "and gate/up as one weight each): about 2x faster than the default MKL path on the CPUs "
    "measured, but not bit-exact against it. One process only (not with --tp).",
)
@click.option(
    "--fuse-layers",
    is_flag=True,
    help="Run fp32 RMSNorm and gated-MLP (SiLU x up) modules and the rotary embedding on the "
    "CPU through one-pass compiled kernels, each only if it agrees with the model's own code "
    "on a probe input. "
    "Within fp32 rounding of the default path, not bit-exact. Best with --prepack-linear. One "
    "process only (not with --tp).",
)
@click.option(
    "--screen-output-head",
    is_flag=True,
    help="On greedy steps, read the fp32 output head in bf16 first (oneDNN, CPUs with "
    "AVX512-BF16 or AMX) and compute fp32 logits only for the tokens a proven rounding bound "
    "cannot rule out: each token is the exact argmax of fp32 dot products, in another "
    "summation order than the default head, so not bit-exact. One process only (not with --tp).",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda[:N] or npu[:N].")
@click.option("--random-weights", is_flag=True, help="Initialise random weights when DIR has none.")
@tp_option
@tp_backend_option
@kv_layout_option
@log_layout_option
@dtype_option
@seed_option
@trust_remote_code_option
@format_option()
def run(directory: Path, **options) -> None:
    """Generate with the converted model in DIRECTORY (continuous batching, paged KV).

    A standalone output (it holds runner_<model>.py) is run by its own runner instead: one
    static batch, greedy."""
    from kvskill.implementer.record import PLAN_FILE, ConvertedDir
    from kvskill.runtime import LLM
    from kvskill.runtime.ops import check_run_block_size, run_profile

    profile = run_profile(
        cpu_only_shapes=options["cpu_only_shapes"], dtype=options["dtype"], real_dims=True
    )
    if profile.shapes and options["block_size"] is not None:  # before the model is loaded
        check_run_block_size(options["block_size"])

    # a directory apply wrote says who runs it; one without a record is framework code
    if (directory / PLAN_FILE).is_file():
        from kvskill.verify.flow import check_layout_fits

        converted = ConvertedDir.read(directory)
        converted.check_layout(options["kv_layout"])
        if converted.is_standalone:
            _run_standalone(directory, options, profile)
            return
        options["tp"] = tp_size_for(converted.plan.attn_tp_size, options["tp"], directory)
        check_layout_fits(converted.plan, options["kv_layout"], directory)
    if options["num_blocks"] is not None and options["kv_memory"] is not None:
        raise BadInputError("give --num-blocks or --kv-memory, not both")
    sized = size_for_workload(options, directory)
    llm = LLM(
        directory,
        dtype=options["dtype"],
        device=options["device"],
        seed=options["seed"],
        random_weights=options["random_weights"],
        trust_remote_code=options["trust_remote_code"],
        block_size=options["block_size"],
        num_blocks=options["num_blocks"],
        kv_memory_bytes=None if options["kv_memory"] is None else parse_size(options["kv_memory"]),
        max_model_len=sized.max_model_len,
        max_num_batched_tokens=options["max_num_batched_tokens"],
        max_num_seqs=sized.max_num_seqs,
        log_layout=options["log_layout"],
        use_hybrid_blocks=options["kv_layout"] == "page_pool",
        enable_prefix_caching=options["prefix_caching"],
        prepack_linear=options["prepack_linear"],
        fuse_layers=options["fuse_layers"],
        screen_output_head=options["screen_output_head"],
        tensor_parallel_size=options["tp"] or 1,
        tp_backend=options["tp_backend"],
        npu_profile=profile,
    )
    with llm:
        _generate_and_report(llm, directory, options, sized.note)


@dataclass(frozen=True)
class WorkloadSizing:
    """What ``run`` passes to ``LLM`` for the pool's size, and the one line saying why."""

    max_model_len: int | None
    max_num_seqs: int
    #: None when the flags decided (an explicit budget or --max-model-len)
    note: str | None


def size_for_workload(options: dict, directory: Path) -> WorkloadSizing:
    """With no --num-blocks, --kv-memory or --max-model-len, the pool holds what this run's
    prompts and --max-tokens need: max_model_len is the longest prompt plus --max-tokens and
    at most one request per prompt runs at once, instead of --max-num-seqs requests of the
    model's full context (a 4-layer Jamba: 128 x 262,144 tokens, 2.35 GiB zeroed to serve
    three short prompts)."""
    as_given = WorkloadSizing(options["max_model_len"], options["max_num_seqs"], None)
    if any(options[k] is not None for k in ("num_blocks", "kv_memory", "max_model_len")):
        return as_given
    lengths = _prompt_lengths(options)
    if not lengths:
        return as_given
    longest = max(lengths)
    need = longest + options["max_tokens"]
    limit = _position_limit(directory)
    # never past the model's positions: a prompt that leaves no room there stays an error
    max_model_len = need if limit is None else min(need, limit)
    max_num_seqs = min(options["max_num_seqs"], len(lengths))
    capped = "" if max_model_len == need else f", capped at the model's {limit} positions"
    note = (
        f"sized for this run: {len(lengths)} prompt(s), the longest {longest} tokens + "
        f"--max-tokens {options['max_tokens']} = max_model_len {max_model_len}{capped} "
        "(--max-model-len, --kv-memory or --num-blocks size it otherwise)"
    )
    return WorkloadSizing(max_model_len, max_num_seqs, note)


def _position_limit(directory: Path) -> int | None:
    """The decoder's position count from DIR's config.json (its text_config for a
    vision-language model), when it names one."""
    from kvskill.analyzer.config import text_config
    from kvskill.analyzer.config_keys import lookup
    from kvskill.core.inputs import read_config_json

    path = directory / "config.json"
    if not path.is_file():
        return None
    decoder, _ = text_config(read_config_json(path, root=directory))
    value, _ = lookup(decoder, "max_positions")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def _prompt_lengths(options: dict) -> list[int]:
    """The prompts' lengths, known before the model loads (synthetic prompts need the
    vocabulary only for their ids). Empty when the flags do not name prompts; the error for
    that comes from _prompts."""
    if options["prompt_ids"] is not None and options["num_requests"] is None:
        return [len(p) for p in parse_prompt_ids(options["prompt_ids"])]
    if options["num_requests"] is not None and options["prompt_ids"] is None:
        return [options["prompt_len"]] * options["num_requests"]
    return []


def _generate_and_report(llm, directory: Path, options: dict, sizing_note: str | None) -> None:
    from kvskill.runtime import SamplingParams
    from kvskill.runtime.ops import backend, fla, profile_report

    prompts = _prompts(options, vocab_size=llm.engine.vocab_size, max_model_len=llm.max_model_len)
    params = SamplingParams(
        max_tokens=options["max_tokens"],
        temperature=options["temperature"],
        top_k=options["top_k"],
        top_p=options["top_p"],
        ignore_eos=options["ignore_eos"],
    )
    progress = _Progress(len(prompts) * params.max_tokens, enabled=sys.stderr.isatty())
    fla.reset_dispatch_report()
    started = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, on_step=progress.update)
    finally:
        progress.close()
    wall_s = time.perf_counter() - started
    report = _report(llm, outputs, wall_s, directory, backend().name)
    report["kv_budget"]["workload"] = sizing_note
    report["cpu_decode_kernel"] = _cpu_decode_kernel(report["ops_backend"])
    report["npu_limits"] = profile_report(llm.npu_profile, dtype=options["dtype"], twin=False)
    # which backend ran each recurrent-state entry point (conv, delta rule, scan), and why
    report["state_ops"] = fla.dispatch_report()
    if llm.tensor_parallel is not None:
        from kvskill.runtime.distributed.report import tensor_parallel_summary

        report["tensor_parallel"] = tensor_parallel_summary(llm)
    if options["output_format"] == "json":
        click.echo(json.dumps(report))
    else:
        click.echo(_render_table(report))


def tp_size_for(plan_tp: int, requested: int | None, directory: Path) -> int:
    """--tp, defaulting to the size the directory was converted for; the two must agree
    unless the conversion kept one rank's view (attn_tp_size 1), which any size can split."""
    if requested is None:
        return plan_tp
    if plan_tp not in (1, requested):
        raise BadInputError(
            f"{directory} was converted for attn_tp_size={plan_tp}; run it with --tp {plan_tp} "
            "(or convert with --attn-tp-size 1 to choose the size at run time)"
        )
    return requested


def _run_standalone(directory: Path, options: dict, profile) -> None:
    from kvskill.runtime.ops import (
        check_run_block_size,
        profile_line,
        profile_report,
        use_npu_profile,
    )
    from kvskill.verify.launch import StandaloneRun, render_table

    if options["temperature"] > 0 or options["top_k"] or options["top_p"] < 1.0:
        raise BadInputError(
            "the standalone runner decodes greedily; drop --temperature/--top-k/--top-p"
        )
    for flag in ("prepack_linear", "fuse_layers", "screen_output_head"):
        if options[flag]:
            raise BadInputError(
                f"--{flag.replace('_', '-')} is a runtime option; a standalone output runs its "
                "own runner"
            )
    run = StandaloneRun.load(
        directory,
        dtype=options["dtype"],
        device=options["device"],
        seed=options["seed"],
        random_weights=options["random_weights"],
        trust_remote_code=options["trust_remote_code"],
    )
    prompts = _prompts(options, vocab_size=run.vocab_size, max_model_len=run.max_model_len)
    if profile.shapes and run.record.kv_mode == "paged":  # the runner's own default too
        check_run_block_size(options["block_size"] or run.runner_module.BLOCK_SIZE)
    with use_npu_profile(profile):
        report = run.generate(
            prompts,
            max_new_tokens=options["max_tokens"],
            block_size=options["block_size"],
            ignore_eos=options["ignore_eos"],
        )
    report["npu_limits"] = profile_report(profile, dtype=options["dtype"], twin=False)
    if options["output_format"] == "json":
        click.echo(json.dumps(report))
    else:
        click.echo(render_table(report) + "\n" + profile_line(report["npu_limits"]))


def _prompts(options: dict, *, vocab_size: int, max_model_len: int) -> list[list[int]]:
    if options["prompt_ids"] is not None and options["num_requests"] is not None:
        raise BadInputError("give --prompt-ids or --num-requests, not both")
    if options["prompt_ids"] is not None:
        return parse_prompt_ids(options["prompt_ids"])
    if options["num_requests"] is None:
        raise BadInputError(
            "nothing to generate: give --prompt-ids or --num-requests (synthetic prompts)"
        )
    # Synthetic prompts: seeded, uniform over the vocabulary.
    length = options["prompt_len"]
    if length >= max_model_len:
        raise BadInputError(
            f"--prompt-len {length} leaves no room to generate under max_model_len={max_model_len}"
        )
    rng = random.Random(options["seed"])
    return [
        [rng.randrange(vocab_size) for _ in range(length)] for _ in range(options["num_requests"])
    ]


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
        #: fp32 CPU linear layers run through oneDNN (--prepack-linear; 0 = the default path)
        "prepacked_linear_layers": llm.num_prepacked_linears,
        #: RMSNorm and gated-MLP modules, and attention modules whose rotary embedding runs on
        #: the fused kernels (--fuse-layers; 0 = default)
        "fused_layers": llm.num_fused_layers,
        #: rows of greedy steps decided by the output head's bf16 screen (--screen-output-head;
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


def _render_table(report: dict) -> str:
    from kvskill.runtime.ops import fla, profile_line

    s = report["summary"]
    rows = [
        ("model", report["model_dir"]),
        ("device / ops", f"{report['device']} / {report['ops_backend']}{_kernel_note(report)}"),
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
    rows.append(("NPU limits", profile_line(report["npu_limits"]).removeprefix("NPU limits: ")))
    rows.append(("prefix cache", _prefix_cache_line(report["prefix_cache"])))
    if report.get("prepacked_linear_layers"):
        rows.append(("linear layers", f"{report['prepacked_linear_layers']} prepacked (oneDNN)"))
    if report.get("fused_layers"):
        rows.append(("fused layers", f"{report['fused_layers']} (RMSNorm, SiLU x up, rope)"))
    screen = report.get("output_head_screen")
    if screen is not None:
        rows.append(
            (
                "output head screen",
                f"{screen['num_screened_rows']} rows screened in bf16, "
                f"{screen['candidates_per_row']:.1f} fp32 candidates a row, "
                f"{screen['num_fallback_rows']} rows on the plain head",
            )
        )
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
