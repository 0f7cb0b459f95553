"""``verify`` on the checkpoint the user has: which weights to check, and loading them.

A converted checkpoint directory holds the weights ``apply`` linked. When they fit in memory,
``verify`` runs them: the original through transformers' own ``from_pretrained`` (so its
load-time conversions apply, e.g. transformers 5 fusing MoE experts stored one per expert
into ``experts.gate_up_proj``), the converted model through the runtime's loader, which
``kvskill run`` uses too. Otherwise, or when asked (``--shrink``), a shrunk twin of the config
with random weights is checked, and the report's first line says so.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from kvskill.core.errors import BadInputError
from kvskill.implementer.record import ConvertedDir
from kvskill.verify.report import Checked
from torch import nn

logger = logging.getLogger(__name__)

#: bytes held per parameter while verifying real weights: the float32 anchor (4) and the
#: converted model, built in float32 before its cast (4); the low-precision original is the
#: anchor cast in place once its float32 generations are made
BYTES_PER_PARAM = 8
#: headroom over the parameters for activations, the KV cache and transformers' loading
MEMORY_MARGIN = 1.25


def checkpoint_num_params(directory: Path) -> int:
    """Elements of every tensor in the directory's ``*.safetensors`` (headers only)."""
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        total += sum(
            math.prod(info["shape"]) for name, info in header.items() if name != "__metadata__"
        )
    return total


def choose_checked(directory: Path, shrink: bool | None, dtype: str) -> tuple[Checked, str | None]:
    """(what verify checks, a note for the report or None).

    ``shrink``: True (``--shrink``) always the shrunk twin; False (``--no-shrink``) the full
    config, on the directory's weights when it has some (refused when they do not fit) and
    random weights otherwise; None (default) the real weights when present and they fit,
    else the shrunk twin.

    Raises:
        BadInputError: ``--no-shrink`` on weights that do not fit in free memory.
    """
    if shrink:
        return Checked.SHRUNK_TWIN, None
    if not any(directory.glob("*.safetensors")):
        return (Checked.SHRUNK_TWIN if shrink is None else Checked.RANDOM_WEIGHTS), None
    from kvskill.runtime.loader import available_memory_bytes

    params = checkpoint_num_params(directory)
    need = params * BYTES_PER_PARAM * MEMORY_MARGIN
    free = available_memory_bytes(torch.device("cpu"))
    if free is None or need <= free:
        return Checked.REAL_WEIGHTS, None
    why = (
        f"the weights of {directory} ({params / 1e6:,.0f}M parameters) need about "
        f"{need / 2**30:.1f} GiB to verify in {dtype} but {free / 2**30:.1f} GiB is free"
    )
    if shrink is False:
        raise BadInputError(f"{why}; verify a shrunk random-weight twin (--shrink)")
    return Checked.SHRUNK_TWIN, f"{why}: checked a shrunk random-weight twin instead"


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' "Loading weights" progress bar would land in the middle of the report."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def load_real_reference(
    converted: ConvertedDir, workdir: Path, report_notes: list[str]
) -> nn.Module:
    """The original model on the directory's weights, in float32, loaded by transformers.

    Raises:
        BadInputError: transformers cannot build it, or the checkpoint leaves parameters
            missing or unexpected (not every tensor of the model came from the file).
    """
    from kvskill.runtime.mtp import mtp_tensor_pattern
    from kvskill.verify.reference.build import (
        REFERENCE_ATTENTION,
        installed_differs_note,
        transformers_class,
    )

    plan, directory = converted.plan, converted.directory
    if plan.source.language_model_of or not converted.record.package:
        return _reference_by_name(converted, workdir, report_notes)
    cls, config = transformers_class(plan, converted.config, workdir / "reference")
    try:
        with _quiet_loading():
            model, info = cls.from_pretrained(
                str(directory),
                config=config,
                attn_implementation=REFERENCE_ATTENTION,
                output_loading_info=True,
            )
    except Exception as exc:  # the original's own code or transformers' loader refused
        raise BadInputError(
            f"transformers cannot load the original {plan.model_type} from {directory}: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        ) from exc
    tied = _tied_names(model)
    missing = [k for k in info.get("missing_keys", ()) if k not in tied]
    # the MTP layers' tensors are the checkpoint's own (the MTP chain checks those layers)
    mtp = mtp_tensor_pattern(config)
    unexpected = [k for k in info.get("unexpected_keys", ()) if not (mtp and mtp.match(k))]
    mismatched = [
        str(m[0]) if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys", ())
    ]
    if missing or unexpected or mismatched:
        raise BadInputError(
            f"weights in {directory} do not match the original {plan.model_type} as "
            f"transformers loads it: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"mismatched {mismatched[:5]}"
        )
    note = installed_differs_note(model, converted.record)
    if note:
        report_notes.append(note)
    return model.float().eval()


def _reference_by_name(
    converted: ConvertedDir, workdir: Path, report_notes: list[str]
) -> nn.Module:
    """The original built as ``verify`` builds it, given the checkpoint's tensors by name
    (with transformers' renamings and a composite's language model, as the runtime reads
    them).

    Two cases take this path instead of ``from_pretrained``:

    - model code of the directory's own (remote code): transformers applies no checkpoint
      conversions to it, and its ``from_pretrained`` (5.x) builds on the meta device and
      leaves a non-persistent buffer the model computes in ``__init__`` (a rotary
      ``inv_freq``) uninitialised;
    - the language model of a composite (vision-language) checkpoint, whose tensors are
      named ``model.language_model...``: the causal LM's ``from_pretrained`` finds none.
    """
    from kvskill.runtime.loader import load_checkpoint_tensors
    from kvskill.verify.reference.build import build_reference

    plan, directory = converted.plan, converted.directory
    reference, note = build_reference(
        plan, converted.record, converted.config, workdir / "reference", directory
    )
    if note:
        report_notes.append(note)
    try:
        load_checkpoint_tensors(reference, directory)
    except BadInputError as exc:
        raise BadInputError(
            f"weights in {directory} do not match the original {plan.model_type}: {exc}"
        ) from exc
    if plan.source.language_model_of:
        report_notes.append(
            f"the language model of a {plan.source.language_model_of} checkpoint: the "
            "original took its language-model tensors by name (transformers loads the "
            "composite model only)"
        )
    return reference.float().eval()


def load_real_converted(directory: Path, dtype: str, seed: int) -> nn.Module:
    """The converted model on the directory's weights, by the runtime's loader (as ``run``)."""
    from kvskill.runtime.loader import load_model

    return load_model(directory, dtype=dtype, device="cpu", seed=seed, trust_remote_code=True).model


def weights_differ(reference: nn.Module, converted: nn.Module) -> str | None:
    """Where the two loaders disagree on a weight (names or values), or None.

    Both models hold the original's parameter names; a tensor that differs after casting to
    the converted model's dtype means the runtime's loader read the checkpoint differently
    from transformers (a conversion it lacks), which the outputs alone would blur.
    """
    ours = converted.state_dict()
    theirs = reference.state_dict()
    missing = sorted(set(theirs) - set(ours))
    unexpected = sorted(set(ours) - set(theirs))
    if missing or unexpected:
        return (
            "the converted model's parameters differ from the original's: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    # non-persistent buffers too (a rotary inv_freq): a loader that builds on the meta
    # device can leave one uninitialised, which no state dict shows
    theirs.update((n, b) for n, b in reference.named_buffers() if n not in theirs)
    ours.update((n, b) for n, b in converted.named_buffers() if n not in ours)
    differing = [
        name
        for name, tensor in theirs.items()
        if name in ours
        and (
            tensor.shape != ours[name].shape
            or not torch.equal(tensor.to(ours[name].dtype), ours[name])
        )
    ]
    if differing:
        return (
            "the runtime's loader read other weights than the original's loader for "
            f"{len(differing)} tensor(s), e.g. {differing[:5]}"
        )
    return None


def _tied_names(model: nn.Module) -> set[str]:
    """Parameters stored under another name (an lm_head tied to the embeddings)."""
    seen: set[int] = set()
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


#: spread of the noise added to a varied module's vector parameters (``condition_weights``)
VARIED_VECTOR_STD = 0.25


def condition_weights(model: nn.Module, seed: int, varied: frozenset[str] = frozenset()) -> None:
    """Random weights with well-separated logits.

    Default initialisers (std 0.02) give near-uniform logits whose top two can tie within
    float noise, which would make a greedy comparison meaningless; fan-in scaled normals
    keep activations O(1) and the top tokens apart.

    Args:
        varied: class names of modules whose vector parameters get noise around their
            initial values too. A per-position query rescale initialised to the identity
            (Mistral Large 4's softmax scaling: scale 0, bias 1) would otherwise leave the
            position-dependent factor it adds untested.
    """
    generator = torch.Generator().manual_seed(seed)
    vectors = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if type(module).__name__ in varied
        for name, param in module.named_parameters(recurse=False)
        if param.dim() == 1
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                fan_in = param.shape[-1]
                std = 1.0 if "embed" in name else fan_in**-0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif "sink" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name in vectors:
                noise = torch.randn(param.shape, generator=generator) * VARIED_VECTOR_STD
                param.add_(noise.to(param.dtype))


def rescale_classes(directory: Path) -> frozenset[str]:
    """Classes of the per-position query rescales in DIRECTORY's modeling files (what
    ``condition_weights`` varies)."""
    from kvskill.analyzer.query_rescale import rescale_sites

    return frozenset(
        site.module_class
        for path in sorted(directory.glob("modeling_*.py"))
        for site in rescale_sites(str(path))
    )
