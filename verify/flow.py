"""``kvskill verify``: the converted model computes the same tokens as the original.

Stages (design §6):
  1. read ``kvskill_plan.json`` and ``config.json`` from the converted directory; code that
     does not come from the installed transformers needs ``trust_remote_code``;
  2. choose what to check (``weights.py``): the directory's own weights when it has
     some and they fit in memory, else a shrunk config keeping every structural feature
     (``shrink.py``) with random weights;
  3. build the reference (transformers with the *original* modeling code, eager attention,
     float32: the anchor) and the converted model (imported from the directory by the
     runtime's loader) with identical weights;
  4. pick variable-length prompts (some longer than several blocks and than the window), or
     read them from ``--prompts FILE``;
  5. reference: ``generate`` greedy, one request at a time, raw logits of every step;
     converted: its driver (the engine with a shuffled free list and chunked prefill, or a
     standalone output's runner) inside the three-chain checks (init, runtime, release), under
     the NPU profile (``verify_profile``: blocks of 128, the NPU's shape limits on every
     operator call; ``cpu_only_shapes``: tiny blocks, nothing checked against the NPU);
  6. float32: compare tokens (identical) and per-step logits (within ``atol`` plus
     ``LOGIT_RTOL`` of the largest reference logit); float16 / bfloat16: the noise-floor
     verdict of ``verdict.py`` (the original in the low dtype gives the rounding scale).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from kvskill.analyzer.config import text_config
from kvskill.analyzer.config_keys import attribute_map_for, lookup
from kvskill.analyzer.plan import Plan, SourceKind
from kvskill.core.config_checks import check_config_values
from kvskill.core.errors import BadInputError, KvskillError, UnsupportedModelError
from kvskill.core.kv_layouts import KV_LAYOUTS
from kvskill.core.safetensors_check import check_safetensors
from kvskill.core.trust import require_trust
from kvskill.implementer.mla.spec import MLA_BLOCK_SIZE
from kvskill.implementer.record import ConvertedDir
from kvskill.runtime.ops.reference.npu_profile import (
    NPU_BLOCK_SIZE,
    NpuProfile,
    check_run_block_size,
    profile_report,
    run_profile,
    use_npu_profile,
)
from kvskill.verify.cache_widths import check_cache_widths
from kvskill.verify.compare import DEFAULT_ATOL, LOGIT_RTOL, compare_prompt
from kvskill.verify.drivers import OWN_FLOWS, DriverRun, OutputKind, driver_for, output_kind
from kvskill.verify.drivers.engine import EngineDriver
from kvskill.verify.options import VerifyOptions
from kvskill.verify.prompts import is_windowed, make_prompts, prompt_lengths_for, read_prompts
from kvskill.verify.reference.build import build_reference
from kvskill.verify.reference.drive import (
    drives_own_tuple_cache,
    reference_generate,
    tuple_cache_generate,
)
from kvskill.verify.reference.original_failure import original_failure
from kvskill.verify.reference.recompute import cache_path_note
from kvskill.verify.report import Checked, VerifyReport
from kvskill.verify.shrink import ShrinkResult, shrink_config
from kvskill.verify.verdict import LOW_PRECISION, Generation, judge
from kvskill.verify.weights import (
    choose_checked,
    condition_weights,
    load_real_converted,
    load_real_reference,
    rescale_classes,
    weights_differ,
)
from torch import nn

logger = logging.getLogger(__name__)

#: tokens per block with --cpu-only-shapes: tiny, so short prompts span several blocks. Under
#: the NPU profile (the default) the block size is NPU_BLOCK_SIZE (128) and the prompts grow
#: with it (``choose_prompt_lengths``).
DEFAULT_BLOCK_SIZE = 4


def check_trust(converted: ConvertedDir, trust_remote_code: bool) -> None:
    """Code kvskill did not write runs only when trusted (``kvskill.core.trust``).

    Besides the directory's own files, verify runs the original model: transformers' class
    when the conversion came from transformers' code (``conversion.package``), else the
    source recorded in the plan, which is the model's own code and needs the flag.
    """
    if trust_remote_code:
        return
    require_trust(converted.directory, False, action="verify")
    if not converted.record.package:
        source = converted.plan.source
        raise BadInputError(
            f"{converted.directory} was converted from model code outside the installed "
            f"transformers ({source.kind}: {source.path}); verify runs that code, pass "
            "--trust-remote-code to allow it"
        )


def check_inputs(converted: ConvertedDir) -> None:
    """The config's values and every weight file's header, before anything is built."""
    check_config_values(converted.config, where=str(converted.directory / "config.json"))
    # NOTE: the default (shrunk) verify never loads the weights; a checkpoint cut short must
    # still not pass, so every file's header is checked against its size.
    for weights in sorted(converted.directory.glob("*.safetensors")):
        check_safetensors(weights)


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """A scratch directory for the reference and the staged code, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvskill-verify-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def stage_converted(directory: Path, workdir: Path, config: dict[str, Any]) -> Path:
    """A copy of the converted code with the (shrunk) config; no weights."""
    target = workdir / "converted"
    target.mkdir()
    for path in directory.glob("*.py"):
        shutil.copy2(path, target / path.name)
    (target / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return target


def check_verifiable(converted: ConvertedDir, options: VerifyOptions) -> None:
    """Refuse a tensor-parallel conversion (one process runs it), an unknown dtype or layout,
    MLA on the page pool, and any layout but the default for a standalone runner."""
    directory, plan = converted.directory, converted.plan
    tp = options.tensor_parallel_size
    if tp is not None and plan.attn_tp_size not in (1, tp):
        raise BadInputError(
            f"{directory} was converted for attn_tp_size={plan.attn_tp_size}; verify it with "
            f"--tp {plan.attn_tp_size}"
        )
    if (tp or plan.attn_tp_size) > 1 and converted.is_standalone:
        raise BadInputError("--tp runs the bundled runtime; a standalone runner is one process")
    if options.dtype not in DEFAULT_ATOL:
        raise BadInputError(f"dtype {options.dtype!r} is not one of {sorted(DEFAULT_ATOL)}")
    if options.kv_layout not in KV_LAYOUTS:
        raise BadInputError(f"kv layout {options.kv_layout!r} is not one of {list(KV_LAYOUTS)}")
    check_layout_fits(plan, options.kv_layout, directory)
    converted.check_layout(options.kv_layout)


def check_layout_fits(plan: Plan, kv_layout: str, directory: Path) -> None:
    """Refuse the page pool for an MLA conversion (UnsupportedModelError, exit 3)."""
    if kv_layout == "page_pool" and plan.is_mla:
        # npu_kv_rmsnorm_rope_cache writes the latent caches in NZ blocks, which need one
        # dense tensor; a page view's block stride is the page.
        raise UnsupportedModelError(
            f"{directory} is an MLA conversion: its NZ latent caches need the contiguous "
            "layout (--kv-layout contiguous)"
        )


def start_report(
    directory: Path,
    plan: Plan,
    options: VerifyOptions,
    shrunk: ShrinkResult | None,
    block_size: int,
    checked: Checked = Checked.SHRUNK_TWIN,
) -> VerifyReport:
    """An empty report of what is about to be compared, and with which tolerance."""
    return VerifyReport(
        model_type=plan.model_type,
        directory=str(directory),
        shrunk=bool(options.shrink),
        checked=checked,
        config_changes={k: list(v) for k, v in (shrunk.changes if shrunk else {}).items()},
        dtype=options.dtype,
        atol=options.atol if options.atol is not None else DEFAULT_ATOL[options.dtype],
        rtol=options.rtol if options.rtol is not None else LOGIT_RTOL,
        block_size=block_size,
        kv_layout=options.kv_layout,
        graph=options.graph,
    )


@dataclass(frozen=True, kw_only=True)
class ModelPair:
    """The original model and the converted one, holding the same weights."""

    reference: nn.Module
    converted: nn.Module
    #: where the converted code was loaded from (a staged copy when the config is shrunk)
    converted_dir: Path


def load_model_pair(
    converted: ConvertedDir,
    workdir: Path,
    config: dict[str, Any],
    options: VerifyOptions,
    report: VerifyReport,
) -> ModelPair | None:
    """Build the reference, load the converted model and give it the reference's weights.

    None (with ``report.error`` set) when the two models do not have the same parameters.
    """
    from kvskill.runtime.loader import load_model, resolve_dtype

    dtype = resolve_dtype(options.dtype)
    directory, plan = converted.directory, converted.plan
    converted_dir = stage_converted(directory, workdir, config) if options.shrink else directory
    # NOTE: condition_weights redraws the matrices only; the other parameters keep the
    # model's own initialiser, which draws from the global generator (nemotron_h's and
    # zamba2's dt_bias). Unseeded, that generator starts from a random seed in every
    # process, so the same verify compared other weights on each run.
    torch.manual_seed(options.seed)
    try:
        reference, note = build_reference(
            plan, converted.record, config, workdir / "reference", directory
        )
    except KvskillError:
        raise
    except Exception as exc:  # the original model's own code refused the config
        raise original_failure(
            converted, exc, stage="build", shrunk=options.shrink, workdir=workdir
        ) from exc
    if note:
        report.notes.append(note)
    # random: real weights go load_real_pair's way
    condition_weights(reference, options.seed, varied=rescale_classes(directory))
    # float32 whatever the dtype: in float16 / bfloat16 it is the anchor of the verdict
    reference = reference.float().eval()
    loaded = load_model(
        converted_dir,
        dtype=dtype,
        device="cpu",
        seed=options.seed,
        random_weights=True,
        trust_remote_code=True,  # checked on DIRECTORY above; the staged copy has no plan
    )
    model = loaded.model
    result = model.load_state_dict(reference.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        report.error = (
            f"the converted model's parameters differ from the original's: missing "
            f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
        return None
    return ModelPair(reference=reference, converted=model, converted_dir=converted_dir)


def config_names(converted: ConvertedDir) -> dict[str, str]:
    """The attribute_map of the config class that builds the model (the directory's own,
    read without running it, for remote code), so vendor key names are found."""
    plan = converted.plan
    remote = plan.source.kind is not SourceKind.TRANSFORMERS and not converted.record.package
    return attribute_map_for(plan.model_type, converted.config, converted.directory, remote=remote)


def verify_directory(directory: Path, options: VerifyOptions) -> VerifyReport:
    """Run the original and the converted model on the same prompts and compare.

    One verify for both deploy modes: a framework output runs in the bundled runtime's
    engine, a standalone output in its own runner (the driver of its output kind, ``drivers/``);
    prompts, comparison, report and exit code are the same.

    Raises:
        BadInputError: not a converted directory, untrusted remote code, bad options.
    """
    directory = directory.resolve()
    converted = ConvertedDir.read(directory)
    plan, config = converted.plan, converted.config
    check_trust(converted, options.trust_remote_code)
    check_inputs(converted)
    kind = output_kind(converted, options.tensor_parallel_size or plan.attn_tp_size)
    if options.graph and kind is not OutputKind.FRAMEWORK:
        raise BadInputError(
            f"--graph captures the bundled runtime's decode step; this output is run as "
            f"{kind.value}"
        )
    if kind in OWN_FLOWS:
        # the original is the framework's own model, not a transformers reference
        return OWN_FLOWS[kind](converted, options)
    check_verifiable(converted, options)
    options = replace(
        options, tensor_parallel_size=options.tensor_parallel_size or plan.attn_tp_size
    )
    names = config_names(converted)
    checked, checked_note = choose_checked(directory, options.shrink, options.dtype)
    options = replace(options, shrink=checked is Checked.SHRUNK_TWIN)
    shrunk = (
        shrink_config(
            config,
            # compressed attention's window is an operator limit (npu_sparse_attn_sharedkv
            # takes a 128-token window only): kept
            shrink_window=is_windowed(plan) and plan.compressed_attention is None,
            attribute_map=names,
            code=plan.code,
        )
        if options.shrink
        else None
    )
    run_config = shrunk.config if shrunk else config
    profile = verify_profile(options, checked)
    block_size = choose_block_size(options.block_size, profile, is_mla=plan.is_mla)
    report = start_report(directory, plan, options, shrunk, block_size, checked)
    report.npu_limits = profile_report(
        profile, dtype=options.dtype, twin=checked is Checked.SHRUNK_TWIN
    )
    if profile.shapes and not profile.dims:
        # the twin's dims are not the model's: the analyzer checked the model's own config
        report.npu_limits["model_limits"] = [
            w for w in plan.warnings if w.startswith("operator limit:")
        ]
    if checked_note:
        report.notes.append(checked_note)
    with scratch_dir() as workdir:
        _verify(converted, workdir, run_config, options, report, profile)
    return report


def verify_profile(options: VerifyOptions, checked: Checked) -> NpuProfile:
    """The NPU profile of this verify: shapes unless opted out; head dims only when the model
    runs at its real size (the shrunk twin's are not the model's); dtypes in float16/bfloat16
    (the float32 anchor is a CPU-only convenience)."""
    return run_profile(
        cpu_only_shapes=options.cpu_only_shapes,
        dtype=options.dtype,
        real_dims=checked is not Checked.SHRUNK_TWIN,
    )


def choose_block_size(requested: int | None, profile: NpuProfile, *, is_mla: bool) -> int:
    """The block size verify runs: an NPU one under the profile (a requested size that is not
    is refused, exit 2), else the requested or tiny default; MLA rounded up to 16 tokens."""
    if profile.shapes:
        if requested is not None:
            check_run_block_size(requested)
        return requested or NPU_BLOCK_SIZE
    block_size = requested or DEFAULT_BLOCK_SIZE
    if is_mla:  # the MLA NZ caches need 16-token-aligned blocks
        block_size = max(MLA_BLOCK_SIZE, -(-block_size // MLA_BLOCK_SIZE) * MLA_BLOCK_SIZE)
    return block_size


def _verify(
    converted_dir: ConvertedDir,
    workdir: Path,
    config: dict[str, Any],
    options: VerifyOptions,
    report: VerifyReport,
    profile: NpuProfile,
) -> None:
    # before any model is built: a bad prompts file is refused at once (when the config
    # names the vocabulary; else the original's output head gives it, once built)
    names = config_names(converted_dir)  # parses a remote config class: once per verify
    vocab = vocabulary_size(config, names)
    prompts = None
    if vocab is not None:
        prompts = prompts_for(converted_dir, config, options, report.block_size, vocab, names)
    if report.checked is Checked.REAL_WEIGHTS:
        pair = load_real_pair(converted_dir, workdir, options, report)
    else:
        pair = load_model_pair(converted_dir, workdir, config, options, report)
    if pair is None:
        return
    # before anything runs: every k/v cache holds what its projection writes (exit 3 if not)
    check_cache_widths(pair.converted)
    if prompts is None:
        vocab = vocabulary_size(config, names, pair.reference)
        assert vocab is not None, "vocabulary_size raises when the head names none"
        prompts = prompts_for(converted_dir, config, options, report.block_size, vocab, names)
    driver = driver_for(converted_dir, pair.converted_dir, options)
    drive = (
        tuple_cache_generate
        if drives_own_tuple_cache(converted_dir.plan.code)
        else reference_generate
    )
    try:
        references = [drive(pair.reference, p, options.max_new_tokens) for p in prompts]
    except Exception as exc:  # the original model's own code fails on this config
        raise original_failure(
            converted_dir, exc, stage="generate", shrunk=options.shrink, workdir=workdir
        ) from exc
    try:
        with use_npu_profile(profile):  # the engine driver hands it to its LLM
            run = driver.run(
                pair.converted,
                prompts,
                max_new_tokens=options.max_new_tokens,
                block_size=report.block_size,
            )
    except KvskillError as exc:
        report.error = f"the runtime refused the converted model: {exc}"
        return
    except Exception as exc:  # the converted code failed while running: a failed check
        report.error = f"{driver.failure}: {type(exc).__name__}: {exc}"
        return
    report.notes += run.notes
    report.tensor_parallel = run.tensor_parallel
    report.chains = [c.to_dict() for c in run.chains]
    if isinstance(driver, EngineDriver) and options.dtype not in LOW_PRECISION:
        _check_mtp(pair, prompts, references, options, report)
    if options.dtype in LOW_PRECISION:
        report.low_precision = low_precision_verdict(
            pair.reference, prompts, references, run, options, drive=drive
        )
        report.notes += [
            f"judged against the float32 original: {line}"
            for line in report.low_precision.excuses()
        ]
    for index, (prompt, (tokens, ref_logits)) in enumerate(zip(prompts, references, strict=True)):
        result = compare_prompt(
            index,
            prompt,
            tokens,
            ref_logits,
            run.token_ids[index],
            run.logits[index],
            report.atol,
        )
        report.prompts.append(result)
        if result.near_tie and report.low_precision is None:  # else judged by top-k
            report.notes.append(
                f"prompt {index}: near tie at step {result.first_mismatch} (the "
                f"reference scores both tokens within atol {report.atol:g}); compared up to it"
            )
    differing = [r for r in report.prompts if not r.passed_tokens]
    if differing and drive is reference_generate:
        first = min(differing, key=lambda r: r.prompt_len)
        note = cache_path_note(
            pair.reference,
            first.index,
            prompts[first.index],
            first.reference_tokens,
            first.runtime_tokens,
        )
        if note:
            report.notes.append(note)


def _check_mtp(pair: ModelPair, prompts, references, options, report: VerifyReport) -> None:
    """The MTP chain (``mtp_chain``) when the model has MTP layers."""
    from kvskill.verify.mtp_chain import mtp_chain

    try:
        chain, note = mtp_chain(
            pair.reference,
            pair.converted,
            prompts,
            [tokens for tokens, _ in references],
            max_new_tokens=options.max_new_tokens,
            block_size=report.block_size,
            seed=options.seed,
            atol=report.atol,
        )
    except KvskillError as exc:
        chain, note = None, f"MTP layers not checked: the runtime refused them ({exc})"
    if chain is not None:
        report.chains.append(chain)
    if note is not None:
        report.notes.append(note)


def vocabulary_size(
    config: dict[str, Any], names: dict[str, str], reference: nn.Module | None = None
) -> int | None:
    """The prompts' token range: the config's vocabulary (``vocab_size``, ChatGLM's
    ``padded_vocab_size``, ...), else the width of the original's output head (None until
    the original is built)."""
    vocab = lookup(text_config(config)[0], "vocab_size", names)[0]
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    if reference is None:
        return None
    head = (
        reference.get_output_embeddings() if hasattr(reference, "get_output_embeddings") else None
    )
    width = getattr(head, "out_features", None)
    if not isinstance(width, int):
        raise BadInputError("cannot tell the vocabulary size: the config names none")
    return width


def load_real_pair(
    converted: ConvertedDir, workdir: Path, options: VerifyOptions, report: VerifyReport
) -> ModelPair | None:
    """The original by transformers' ``from_pretrained`` and the converted model by the
    runtime's loader, both on the directory's weights.

    None (with ``report.error`` set) when the two loaders disagree on a weight.
    """
    reference = load_real_reference(converted, workdir, report.notes)
    model = load_real_converted(converted.directory, options.dtype, options.seed)
    report.error = weights_differ(reference, model)
    if report.error:
        return None
    return ModelPair(reference=reference, converted=model, converted_dir=converted.directory)


def prompts_for(
    converted: ConvertedDir,
    config: dict[str, Any],
    options: VerifyOptions,
    block_size: int,
    vocab: int,
    names: dict[str, str],
) -> list[list[int]]:
    """The prompts of ``--prompts FILE``, else generated ones of varied lengths (NAMES: the
    config's key aliases, ``config_names``)."""
    if options.prompts_file is None:
        lengths = prompt_lengths_for(converted.plan, config, options, block_size, names)
        return make_prompts(lengths, vocab, options.seed)
    positions = lookup(text_config(config)[0], "max_positions", names)[0]
    limit = int(positions or 4096) - options.max_new_tokens
    source = converted.plan.source.path
    tokenizer_dirs = [converted.directory] + ([Path(source)] if source else [])
    return read_prompts(
        options.prompts_file, vocab_size=vocab, max_len=limit, tokenizer_dirs=tokenizer_dirs
    )


def low_precision_verdict(
    anchor: nn.Module,
    prompts: list[list[int]],
    references: list[tuple[list[int], torch.Tensor]],
    run: DriverRun,
    options: VerifyOptions,
    drive=None,
):
    """The noise-floor verdict: the original in the low dtype gives the rounding scale.

    ANCHOR is the original in float32 (REFERENCES its generations, already made); it is cast
    to the low dtype in place (no second copy of the weights), generates the same prompts,
    and both low-precision runs are measured against the float32 generations.
    """
    from kvskill.runtime.loader import resolve_dtype

    low = anchor.to(resolve_dtype(options.dtype))
    generate = drive or reference_generate  # the original's own generation (e.g. tuple caches)
    originals = [generate(low, p, options.max_new_tokens) for p in prompts]

    def generations(pairs) -> list[Generation]:
        return [Generation(tokens=list(t), logits=list(logits)) for t, logits in pairs]

    return judge(
        options.dtype,
        anchor=generations(references),
        original=generations(originals),
        converted=generations(zip(run.token_ids, run.logits, strict=True)),
        ratio_limit=options.drift_ratio,
        floor_atol=options.atol,
    )


__all__ = ["VerifyOptions", "VerifyReport", "check_layout_fits", "verify_directory"]
