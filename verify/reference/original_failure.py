"""The one-line error when the original model cannot be built or run here, with what to try.

Vendor modeling files are written for the transformers their ``config.json`` was saved with
(DeepSeek-V3's names 4.46.3) and often fail under another one (removed helpers such as
``DynamicCache.get_usable_length``). Then the way forward is verifying under that version, and
the message names it. ``--no-shrink`` is suggested only when the shrink could be the cause:
the unshrunk config's model builds here (tried on the meta device, so nothing is allocated)
and, for a failed generation, runs a forward pass (small models only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvskill.core.errors import BadInputError, KvskillError
from kvskill.implementer.record import ConvertedDir
from kvskill.verify.reference.build import build_reference

#: the largest unshrunk original run for real to tell whether the shrink broke generation
FORWARD_PROBE_PARAMS = 50_000_000
#: the transformers versions kvskill's own compatibility locks test (``make test-compat``)
COMPAT_LOCKS = ("4.46.3", "4.55.0")


class ShrinkBrokeOriginalError(KvskillError):
    """verify's shrink wrote a config the original model cannot run, although its own
    config runs here: kvskill's error (exit 70, as any kvskill bug), not the model's."""

    code = "shrink_broke_original"


def original_failure(
    converted: ConvertedDir,
    exc: BaseException,
    *,
    stage: str,
    shrunk: bool,
    workdir: Path,
) -> KvskillError:
    """The error for an original model that failed at ``stage`` ("build" or "generate").

    When only the shrunk config fails (the model's own config builds here, and runs a
    forward pass for a failed generation), the shrink broke one of the model's invariants:
    that is reported as kvskill's error, with ``--no-shrink`` as the way to verify now, and
    no advice about the model or its transformers.
    """
    which = "the shrunk config" if shrunk else "its config"
    what = "cannot be built from" if stage == "build" else "fails to generate with"
    message = f"the original {converted.plan.model_type} model {what} {which}: {describe(exc)}"
    if shrunk and unshrunk_runs(converted, workdir, forward=stage == "generate"):
        return ShrinkBrokeOriginalError(
            f"{message}; the unshrunk config builds here, so kvskill's shrink broke a rule "
            "of the model's config (a kvskill error, not the model's): verify with "
            "--no-shrink (the real sizes), and report the config to kvskill"
        )
    hints = []
    saved = saved_transformers_version(converted.config)
    if saved is not None:
        hints.append(version_hint(saved))
    return BadInputError("; ".join([message, *hints]))


def saved_transformers_version(config: dict[str, Any]) -> str | None:
    """``transformers_version`` of config.json when it differs from the installed one."""
    import transformers

    saved = config.get("transformers_version")
    if not isinstance(saved, str) or not saved or saved == transformers.__version__:
        return None
    return saved


#: kvskill's own requirement when its installed metadata cannot be read (pyproject.toml)
DEFAULT_SUPPORTED_TRANSFORMERS = ">=4.46,<6"


def supported_transformers() -> str:
    """The transformers specifier kvskill is installed with (``>=4.46,<6``)."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requires = metadata.requires("kvskill") or []
    except metadata.PackageNotFoundError:
        return DEFAULT_SUPPORTED_TRANSFORMERS
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.name == "transformers" and requirement.marker is None:
            return str(requirement.specifier) or DEFAULT_SUPPORTED_TRANSFORMERS
    return DEFAULT_SUPPORTED_TRANSFORMERS


def version_hint(saved: str) -> str:
    """What to do about a config saved with another transformers: verify under that version
    when kvskill supports it; else say plainly that kvskill cannot run the model's code as
    its version expects, and what to do instead (kvskill never advises an install that
    pip would refuse beside it)."""
    import transformers
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    supported = supported_transformers()
    installed = transformers.__version__
    try:
        inside = Version(saved) in SpecifierSet(supported)
    except InvalidVersion:
        inside = False
    if inside:
        return (
            f"its config.json was saved with transformers {saved} (installed: {installed}): "
            f"verify it under that version, in a venv with `pip install "
            f"transformers=={saved} kvskill` (kvskill's `make test-compat` tests "
            f"{' and '.join(COMPAT_LOCKS)})"
        )
    return (
        f"its config.json was saved with transformers {saved}, which kvskill does not support "
        f"(it needs transformers{supported}; installed: {installed}): the model's code may need "
        f"that transformers, and kvskill cannot run beside it; port the modeling file's "
        f"failing import or call to a supported transformers (kvskill's `make test-compat` "
        f"tests {' and '.join(COMPAT_LOCKS)}), or verify a checkpoint of the model saved "
        "with one"
    )


def unshrunk_runs(converted: ConvertedDir, workdir: Path, *, forward: bool) -> bool:
    """Whether the unshrunk config's original model builds here (counted on the meta device)
    and, with ``forward``, runs one forward pass over a few tokens.

    The forward pass needs real tensors (transformers' masks read values), so it runs only
    for a model of at most FORWARD_PROBE_PARAMS parameters. False when anything fails, and
    when it cannot be told cheaply (a larger model, a config too large for memory).
    """
    import torch

    def build():
        return build_reference(
            converted.plan,
            converted.record,
            converted.config,
            workdir / "unshrunk",
            converted.directory,
        )[0]

    try:
        with torch.device("meta"):
            shell = build()
        if not forward:
            return True
        if sum(p.numel() for p in shell.parameters()) > FORWARD_PROBE_PARAMS:
            return False
        model = build().eval()
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 4), dtype=torch.long), use_cache=False)
    except Exception:  # noqa: BLE001 - the full size fails too, or it cannot be told
        return False
    return True


def describe(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (config validators raise several lines)."""
    text = " ".join(str(exc).split()) or repr(exc)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"
