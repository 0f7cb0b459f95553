"""``apply --plan``: convert what a reviewed plan says, and refuse a plan that went stale.

The plan file is what ``kvskill analyze MODEL --format json > plan.json`` printed (or a
converted directory's ``kvskill_plan.json``). Its fields are of four sorts (``analyzer/plan.py``):

* choices (``CHOICE_FIELDS``: deploy_mode, fa_version, block_size, attn_tp_size) may be edited
  by hand; the conversion uses the plan's values and records them;
* facts (``fact_fields()``: layers, heads, head_dim, attention kind, kv_mode, layout, sparse
  modes, windows, scale, sinks, rope, MLA dims, the code scan, the config, the source, ...)
  must equal a fresh analysis of MODEL: a plan whose facts differ is refused (exit 2) naming
  them;
* derived fields (KV heads per rank, cache entries, their bytes, the memory plan) and notes
  (reasons, warnings, evidence, blockers) are taken from the fresh analysis run with the plan's
  choices.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvskill.analyzer import analyze_model
from kvskill.analyzer.plan import CHOICE_FIELDS, Evidence, Plan, fact_fields
from kvskill.core.errors import BadInputError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.record import ReviewedPlan

#: differing fields named in a refusal before "and N more"
SHOWN_DIFFERENCES = 8


class StalePlanError(BadInputError):
    """The reviewed plan's facts no longer match the model."""


@dataclass(frozen=True, kw_only=True)
class PlannedApply:
    """The Plan to convert, the options it implies, and the record of the review."""

    plan: Plan
    options: ApplyOptions
    reviewed: ReviewedPlan


def plan_from_review(model: str, options: ApplyOptions) -> PlannedApply:
    """Read ``options.plan_file``, re-analyze MODEL with its choices and compare the facts.

    Raises:
        BadInputError: unreadable or invalid plan file.
        StalePlanError: a fact of the plan differs from MODEL as it is now.
    """
    assert options.plan_file is not None, "plan_from_review needs a plan file"
    path = Path(options.plan_file)
    reviewed = Plan.from_json(path)
    _refuse_choice_flags(options, reviewed, path)
    analyze = functools.partial(
        analyze_model,
        model,
        config_overrides=options.config_overrides or None,
        attn_tp_size=reviewed.attn_tp_size,
        block_size=reviewed.block_size,
        prompt_file=options.prompt_file,
    )
    # the deploy mode as analyze decides it, so an unedited plan converts with the same
    # evidence as plain apply; an edited deploy_mode is then set explicitly
    current = analyze(deploy_mode="auto")
    if current.deploy_mode is not reviewed.deploy_mode:
        current = analyze(deploy_mode=reviewed.deploy_mode.value)
    stale = stale_fields(reviewed, current)
    if stale:
        shown = stale[:SHOWN_DIFFERENCES]
        more = f" and {len(stale) - len(shown)} more" if len(stale) > len(shown) else ""
        raise StalePlanError(
            f"{path} no longer matches {model}: {', '.join(shown)}{more} differ; re-run "
            f"`kvskill analyze` (only {', '.join(CHOICE_FIELDS)} may be edited by hand)"
        )
    mine, theirs = reviewed.to_dict(), current.to_dict()
    edited = [name for name in CHOICE_FIELDS if mine[name] != theirs[name]]
    plan = _with_choices(current, reviewed, edited, path)
    effective = dataclasses.replace(
        options,
        deploy_mode=plan.deploy_mode.value,
        # "auto": the Plan's fa_version, which is now the reviewed one
        fa_version="auto",
        attn_tp_size=plan.attn_tp_size,
        block_size=plan.block_size,
    )
    record = ReviewedPlan(
        path=str(path),
        choices={name: mine[name] for name in CHOICE_FIELDS},
        edited=edited,
    )
    return PlannedApply(plan=plan, options=effective, reviewed=record)


def _refuse_choice_flags(options: ApplyOptions, reviewed: Plan, path: Path) -> None:
    """A flag that would override a choice of the plan is refused: the plan decides."""
    given = {
        "--fa-version": ("fa_version", options.fa_version, "auto", reviewed.fa_version.value),
        "--block-size": ("block_size", options.block_size, None, reviewed.block_size),
        "--attn-tp-size": ("attn_tp_size", options.attn_tp_size, 1, reviewed.attn_tp_size),
    }
    for flag, (name, value, default, planned) in given.items():
        if value != default and value != planned:
            raise BadInputError(
                f"{flag} {value} contradicts {name}={planned} in {path}; with --plan the plan "
                f"decides it, edit {name} there instead"
            )


def stale_fields(reviewed: Plan, current: Plan) -> list[str]:
    """Fact fields (``config.<key>`` for a key of a dict field) where the plans differ.

    Scalar differences carry both values: ``num_layers (plan 4, model 2)``.
    """
    mine, theirs = reviewed.to_dict(), current.to_dict()
    found: list[str] = []
    for name in fact_fields():
        a, b = mine.get(name), theirs.get(name)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
            found += [f"{name}.{k}{_values(a.get(k), b.get(k))}" for k in keys]
        else:
            found.append(f"{name}{_values(a, b)}")
    return found


def _with_choices(current: Plan, reviewed: Plan, edited: list[str], path: Path) -> Plan:
    """The fresh analysis with the reviewed fa_version, and evidence for each edited choice.

    deploy_mode, block_size and attn_tp_size went into the analysis already; fa_version is
    the one choice the analysis decides itself, so the plan's value replaces it.
    """
    if "fa_version" not in edited:
        return current
    note = Evidence(
        decision="fa_version",
        reason=(
            f"{reviewed.fa_version} set in the reviewed plan (the analysis decides "
            f"{current.fa_version}: {current.fa_version_reason})"
        ),
        source=f"--plan {path}",
    )
    # the reviewer's own reason when they wrote one, else what was done
    reason = reviewed.fa_version_reason
    if reason == current.fa_version_reason:
        reason = f"{reviewed.fa_version} set by hand in the reviewed plan {path}"
    return dataclasses.replace(
        current,
        fa_version=reviewed.fa_version,
        fa_version_reason=reason,
        evidence=[*current.evidence, note],
    )


def _values(a: Any, b: Any) -> str:
    """`` (plan A, model B)`` for short scalars; nothing for structures or long text."""
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return ""
    text = f" (plan {a!r}, model {b!r})"
    return text if len(text) <= 60 else ""
