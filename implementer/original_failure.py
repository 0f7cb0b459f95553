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

from kvskill.core.errors import BadInputError
from kvskill.implementer.record import ConvertedDir
from kvskill.implementer.reference import build_reference

#: the largest unshrunk original run for real to tell whether the shrink broke generation
FORWARD_PROBE_PARAMS = 50_000_000
#: the transformers versions kvskill's own compatibility locks test (``make test-compat``)
COMPAT_LOCKS = ("4.46.3", "4.55.0")


def original_failure(
    converted: ConvertedDir,
    exc: BaseException,
    *,
    stage: str,
    shrunk: bool,
    workdir: Path,
) -> BadInputError:
    """The error for an original model that failed at ``stage`` ("build" or "generate")."""
    which = "the shrunk config" if shrunk else "its config"
    what = "cannot be built from" if stage == "build" else "fails to generate with"
    message = f"the original {converted.plan.model_type} model {what} {which}: {describe(exc)}"
    hints = []
    saved = saved_transformers_version(converted.config)
    if saved is not None:
        hints.append(version_hint(saved))
    if shrunk and unshrunk_runs(converted, workdir, forward=stage == "generate"):
        hints.append(
            "the unshrunk config builds here, so the shrink may be the cause: try --no-shrink"
        )
    return BadInputError("; ".join([message, *hints]))


def saved_transformers_version(config: dict[str, Any]) -> str | None:
    """``transformers_version`` of config.json when it differs from the installed one."""
    import transformers

    saved = config.get("transformers_version")
    if not isinstance(saved, str) or not saved or saved == transformers.__version__:
        return None
    return saved


def version_hint(saved: str) -> str:
    import transformers

    return (
        f"its config.json was saved with transformers {saved} (installed: "
        f"{transformers.__version__}): verify it under that version, in a venv with "
        f"`pip install transformers=={saved} kvskill` (kvskill's `make test-compat` tests "
        f"{' and '.join(COMPAT_LOCKS)})"
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
