"""``kvskill verify``: the converted model computes the same tokens as the original.

Stages (design §6):
  1. read ``kvskill_plan.json`` and ``config.json`` from the converted directory; code that
     does not come from the installed transformers needs ``trust_remote_code``;
  2. shrink the config (default) keeping every structural feature, see ``shrink.py``;
  3. build the reference (transformers with the *original* modeling code, eager attention)
     and the converted model (imported from the directory by the runtime's loader) with
     identical weights;
  4. pick variable-length prompts: some longer than several blocks and than the window;
  5. reference: ``generate`` greedy, one request at a time, raw logits of every step;
     converted: its driver (the engine with small blocks, a shuffled free list and chunked
     prefill, or a standalone output's runner) inside the three-chain checks (init, runtime,
     release);
  6. compare tokens (identical) and per-step logits (within ``atol`` plus ``LOGIT_RTOL`` of the
     largest reference logit).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvskill.analyzer.config import text_config
from kvskill.analyzer.plan import Plan
from kvskill.core.attn_types import AttnType
from kvskill.core.config_checks import check_config_values
from kvskill.core.errors import BadInputError, KvskillError, UnsupportedModelError
from kvskill.core.safetensors_check import check_safetensors
from kvskill.core.trust import require_trust
from kvskill.implementer.mla.spec import MLA_BLOCK_SIZE
from kvskill.implementer.record import ConvertedDir
from kvskill.implementer.reference import build_reference, load_original_weights
from kvskill.implementer.reference_drive import drives_own_tuple_cache, tuple_cache_generate
from kvskill.implementer.shrink import SLIDING_WINDOW, ShrinkResult, shrink_config
from kvskill.implementer.verify_driver import VerifyDriver
from kvskill.runtime.layout import KV_LAYOUTS
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_ATOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
#: On top of atol, a prompt's logits may differ by this many float32 spacings (ulps) of its
#: largest reference logit. NOTE: logits are compared in float32, where one ulp is about
#: eps * |logit|, so a fixed atol is stricter for a model with large logits than float32
#: can be. granite_swa (tied embeddings of std 1 and an unscaled q.k, attention_multiplier
#: 1.0) has logits near 170, where one ulp is 1.5e-5: there the original differs from its
#: own float64 run by up to 1.6e-4 and from itself with an equal sink formula by 4.2e-5,
#: while the conversion differs by 1.8e-4 (12 ulps; 3 with the usual 1/sqrt(d) scale). A
#: real error (a window off by one, a wrong scale) moves logits by 0.1 or more, far above
#: 16 ulps (3.3e-4 at 170); for logits of order 1 the term adds under 1e-5 to atol.
LOGIT_ULPS = 16
LOGIT_RTOL = LOGIT_ULPS * torch.finfo(torch.float32).eps
DEFAULT_BLOCK_SIZE = 4


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    shrink: bool = True
    num_prompts: int = 4
    max_new_tokens: int = 8
    atol: float | None = None
    #: relative logit tolerance (of the largest reference logit); None: LOGIT_RTOL
    rtol: float | None = None
    block_size: int | None = None
    dtype: str = "float32"
    seed: int = 0
    trust_remote_code: bool = False
    #: the runtime's cache layout for the converted model: "contiguous" (one dense tensor per
    #: cache) or "page_pool" (one pool of pages, strided views; references/
    #: noncontiguous_kv_reference.md)
    kv_layout: str = "contiguous"


@dataclass(kw_only=True)
class PromptResult:
    index: int
    prompt_len: int
    reference_tokens: list[int]
    runtime_tokens: list[int]
    #: largest |reference - runtime| over the vocabulary and every compared step
    max_logit_diff: float
    #: first step whose token differs, or None
    first_mismatch: int | None
    #: largest |reference logit| over the compared steps: the scale of the relative tolerance
    logit_scale: float = 0.0
    #: the differing step was a near tie: the reference scored both tokens within atol
    #: (low-precision rounding may flip it; greedy continuations differ from there on)
    near_tie: bool = False

    @property
    def passed_tokens(self) -> bool:
        return self.reference_tokens == self.runtime_tokens or self.near_tie


@dataclass(kw_only=True)
class VerifyReport:
    model_type: str
    directory: str
    shrunk: bool
    config_changes: dict[str, list[Any]]
    dtype: str
    atol: float
    block_size: int
    rtol: float = 0.0
    kv_layout: str = "contiguous"
    prompts: list[PromptResult] = field(default_factory=list)
    chains: list[dict[str, Any]] = field(default_factory=list)
    #: a failure that stopped the comparison (e.g. the converted forward raised)
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def max_logit_diff(self) -> float:
        return max((p.max_logit_diff for p in self.prompts), default=math.inf)

    @property
    def tokens_identical(self) -> bool:
        return bool(self.prompts) and all(p.passed_tokens for p in self.prompts)

    def logit_tolerance(self, prompt: PromptResult) -> float:
        """atol plus rtol times the prompt's largest reference logit (see LOGIT_RTOL)."""
        return self.atol + self.rtol * prompt.logit_scale

    @property
    def logits_within(self) -> bool:
        return bool(self.prompts) and all(
            p.max_logit_diff <= self.logit_tolerance(p) for p in self.prompts
        )

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.tokens_identical
            and self.logits_within
            and bool(self.chains)
            and all(c["passed"] for c in self.chains)
        )

    def failures(self) -> list[str]:
        """One line per failed check."""
        lines = [f"error: {self.error}"] if self.error else []
        for p in self.prompts:
            if not p.passed_tokens:
                lines.append(
                    f"prompt {p.index} (len {p.prompt_len}): tokens differ from step "
                    f"{p.first_mismatch}: reference {p.reference_tokens} vs runtime "
                    f"{p.runtime_tokens}"
                )
            elif p.max_logit_diff > self.logit_tolerance(p):
                lines.append(
                    f"prompt {p.index} (len {p.prompt_len}): logits differ by "
                    f"{p.max_logit_diff:.3g} > {self.logit_tolerance(p):.3g} (atol "
                    f"{self.atol:g} + rtol {self.rtol:.2g} x largest logit {p.logit_scale:.3g})"
                )
        for chain in self.chains:
            lines += [f"{chain['name']} chain: {f}" for f in chain["failures"]]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "model_type": self.model_type,
            "directory": self.directory,
            "shrunk": self.shrunk,
            "config_changes": self.config_changes,
            "dtype": self.dtype,
            "atol": self.atol,
            "rtol": self.rtol,
            "block_size": self.block_size,
            "kv_layout": self.kv_layout,
            "tokens_identical": self.tokens_identical,
            "max_logit_diff": None if math.isinf(self.max_logit_diff) else self.max_logit_diff,
            "prompts": [
                {
                    "index": p.index,
                    "prompt_len": p.prompt_len,
                    "tokens_identical": p.reference_tokens == p.runtime_tokens,
                    "first_mismatch": p.first_mismatch,
                    "near_tie": p.near_tie,
                    "max_logit_diff": p.max_logit_diff,
                    "logit_scale": p.logit_scale,
                    "logit_tolerance": self.logit_tolerance(p),
                    "reference_tokens": p.reference_tokens,
                    "runtime_tokens": p.runtime_tokens,
                }
                for p in self.prompts
            ],
            "chains": self.chains,
            "error": self.error,
            "failures": self.failures(),
            "notes": self.notes,
        }


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


def choose_prompt_lengths(
    num_prompts: int, block_size: int, window: int | None, limit: int
) -> list[int]:
    """Variable lengths: short, several blocks long, and past the window when there is one.

    Example (block 4, window 8): 3, 21, 19, 33 for four prompts.
    """
    span = max(window or 0, 2 * block_size)
    base = [3, span + 2 * block_size + 5, 4 * block_size + 3, 6 * block_size + 1 + (window or 0)]
    lengths = [base[i % len(base)] + (i // len(base)) * 2 for i in range(num_prompts)]
    return [max(1, min(n, limit)) for n in lengths]


def make_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def condition_weights(model: nn.Module, seed: int) -> None:
    """Random weights with well-separated logits.

    Default initialisers (std 0.02) give near-uniform logits whose top two can tie within
    float noise, which would make a greedy comparison meaningless; fan-in scaled normals
    keep activations O(1) and the top tokens apart.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                fan_in = param.shape[-1]
                std = 1.0 if "embed" in name else fan_in**-0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif "sink" in name:
                param.copy_(torch.randn(param.shape, generator=generator))


def reference_generate(
    model: nn.Module, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and raw logits ``[steps, vocab]`` from transformers ``generate``."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # NOTE: both sides generate exactly max_new_tokens; the model's own EOS must not stop
    # the reference early (the runtime runs with ignore_eos).
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt])
    # NOTE: an explicit all-ones mask: without one, generate masks out every prompt token
    # equal to pad_token_id (0), which the runtime attends to (seed 2 draws token 0).
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack([step[0].float() for step in out.logits])
    return tokens, logits


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
    if plan.attn_tp_size != 1:
        raise BadInputError(
            f"{directory} was converted for attn_tp_size={plan.attn_tp_size}; a single "
            "process cannot run a tensor-parallel split, convert with --attn-tp-size 1 to verify"
        )
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
) -> VerifyReport:
    """An empty report of what is about to be compared, and with which tolerance."""
    return VerifyReport(
        model_type=plan.model_type,
        directory=str(directory),
        shrunk=options.shrink,
        config_changes={k: list(v) for k, v in (shrunk.changes if shrunk else {}).items()},
        dtype=options.dtype,
        atol=options.atol if options.atol is not None else DEFAULT_ATOL[options.dtype],
        rtol=options.rtol if options.rtol is not None else LOGIT_RTOL,
        block_size=block_size,
        kv_layout=options.kv_layout,
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
    try:
        reference, note = build_reference(
            plan, converted.record, config, workdir / "reference", directory
        )
    except KvskillError:
        raise
    except Exception as exc:  # the original model's own code refused the config
        which = "the shrunk config (try --no-shrink)" if options.shrink else "its config"
        raise BadInputError(
            f"the original {plan.model_type} model cannot be built from {which}: "
            f"{type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    if note:
        report.notes.append(note)
    if options.shrink or not load_original_weights(reference, directory):
        condition_weights(reference, options.seed)
    reference = reference.to(dtype).eval()
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


def prompt_lengths_for(
    plan: Plan, config: dict[str, Any], options: VerifyOptions, block_size: int
) -> list[int]:
    """Prompt lengths that cross block (and window) edges and leave room for the new tokens."""
    text = text_config(config)[0]  # a vision-language model's decoder keeps these
    window = text.get("sliding_window") if is_windowed(plan) else None
    limit = int(text.get("max_position_embeddings") or 4096) - options.max_new_tokens
    return choose_prompt_lengths(options.num_prompts, block_size, window, limit)


def verify_directory(directory: Path, options: VerifyOptions) -> VerifyReport:
    """Run the original and the converted model on the same prompts and compare.

    One verify for both deploy modes: a framework output runs in the bundled runtime's
    engine, a standalone output in its own runner (the driver, see ``verify_driver.py``);
    prompts, comparison, report and exit code are the same.

    Raises:
        BadInputError: not a converted directory, untrusted remote code, bad options.
    """
    directory = directory.resolve()
    converted = ConvertedDir.read(directory)
    plan, config = converted.plan, converted.config
    check_trust(converted, options.trust_remote_code)
    check_inputs(converted)
    check_verifiable(converted, options)
    shrunk = shrink_config(config, shrink_window=is_windowed(plan)) if options.shrink else None
    run_config = shrunk.config if shrunk else config
    block_size = options.block_size or DEFAULT_BLOCK_SIZE
    if plan.is_mla:  # the MLA NZ caches need 16-token-aligned blocks
        block_size = max(MLA_BLOCK_SIZE, -(-block_size // MLA_BLOCK_SIZE) * MLA_BLOCK_SIZE)
    report = start_report(directory, plan, options, shrunk, block_size)
    with scratch_dir() as workdir:
        _verify(converted, workdir, run_config, options, report)
    return report


def driver_for(
    converted: ConvertedDir, converted_dir: Path, options: VerifyOptions
) -> VerifyDriver:
    """The runner of a standalone output, else the bundled engine."""
    standalone = converted.record.standalone
    if standalone is not None:
        from kvskill.implementer.standalone.verify import RunnerDriver

        return RunnerDriver(converted_dir=converted_dir, record=standalone)
    from kvskill.implementer.verify_engine import EngineDriver

    return EngineDriver(seed=options.seed, use_hybrid_blocks=options.kv_layout == "page_pool")


def _verify(
    converted_dir: ConvertedDir,
    workdir: Path,
    config: dict[str, Any],
    options: VerifyOptions,
    report: VerifyReport,
) -> None:
    plan = converted_dir.plan
    pair = load_model_pair(converted_dir, workdir, config, options, report)
    if pair is None:
        return
    driver = driver_for(converted_dir, pair.converted_dir, options)
    lengths = prompt_lengths_for(plan, config, options, report.block_size)
    vocab = int(text_config(config)[0]["vocab_size"])
    prompts = make_prompts(lengths, vocab, options.seed)
    drive = tuple_cache_generate if drives_own_tuple_cache(plan.code) else reference_generate
    try:
        references = [drive(pair.reference, p, options.max_new_tokens) for p in prompts]
    except Exception as exc:  # the original model's own code fails on this config
        which = "the shrunk config (try --no-shrink)" if options.shrink else "its config"
        raise BadInputError(
            f"the original {plan.model_type} model fails to generate with {which}: "
            f"{type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    try:
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
    report.chains = [c.to_dict() for c in run.chains]
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
        if result.near_tie:
            report.notes.append(
                f"prompt {index}: near tie at step {result.first_mismatch} (the "
                f"reference scores both tokens within atol {report.atol:g}); compared up to it"
            )


def is_windowed(plan: Plan) -> bool:
    """Whether any layer of the plan attends over a sliding window."""
    return AttnType.SLIDING_WINDOW in plan.layer_attn_types()


def compare_prompt(
    index: int,
    prompt: list[int],
    tokens: list[int],
    ref_logits: torch.Tensor,
    runtime_tokens: list[int],
    runtime_logits: list[torch.Tensor],
    atol: float,
) -> PromptResult:
    """One prompt's reference against what the driver generated.

    Tokens must be identical, or differ first where the reference scored both tokens within
    ``atol`` (a near tie); logits are compared up to and including the first differing step.
    """
    mismatch = next(
        (i for i, (a, b) in enumerate(zip(tokens, runtime_tokens, strict=False)) if a != b),
        None if len(tokens) == len(runtime_tokens) else min(len(tokens), len(runtime_tokens)),
    )
    # logits are comparable up to and including the first differing step
    steps = len(tokens) if mismatch is None else mismatch + 1
    steps = min(steps, len(ref_logits))
    diff = 0.0
    for step in range(steps):
        if step >= len(runtime_logits):  # the driver recorded no logits for this step
            diff = math.inf
            break
        diff = max(diff, (runtime_logits[step] - ref_logits[step]).abs().max().item())
    near_tie = False
    if mismatch is not None and mismatch < min(len(ref_logits), len(runtime_tokens)):
        scores = ref_logits[mismatch]
        margin = (scores[tokens[mismatch]] - scores[runtime_tokens[mismatch]]).item()
        near_tie = margin <= atol
    return PromptResult(
        index=index,
        prompt_len=len(prompt),
        reference_tokens=tokens,
        runtime_tokens=runtime_tokens,
        max_logit_diff=diff,
        first_mismatch=mismatch,
        near_tie=near_tie,
        logit_scale=logit_scale(ref_logits, steps),
    )


def logit_scale(ref_logits: torch.Tensor, steps: int) -> float:
    """Largest |reference logit| over the first ``steps`` steps (0.0 for none)."""
    return ref_logits[:steps].abs().max().item() if steps > 0 else 0.0


__all__ = [
    "LOGIT_RTOL",
    "SLIDING_WINDOW",
    "VerifyOptions",
    "VerifyReport",
    "choose_prompt_lengths",
    "verify_directory",
]


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """The exception's message on one line (config validators raise several lines)."""
    text = " ".join(str(exc).split())
    if not text:
        return repr(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."
