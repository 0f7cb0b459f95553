"""What ``apply`` would refuse, found before anything is written, for the Plan to say.

The analyzer decides the KV design from the config and a scan of the code; whether the
rewrite can express that design in this file's code is the implementer's to say. A Plan that
lists no blockers for a model ``apply`` then refuses misleads its reader (a person planning
the work, an agent choosing between ``apply`` and a conversion by hand), so ``kvskill
analyze`` runs the conversion ``apply`` would run, writes nothing, and puts its refusal in
``implementer_blockers``.
"""

from __future__ import annotations

import dataclasses

from kvskill.analyzer import Plan
from kvskill.analyzer.plan import DeployMode
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions, Conversion, convert_framework
from kvskill.implementer.inherited import convert_inherited
from kvskill.implementer.standalone.convert import convert_standalone


def convert_plan(plan: Plan, options: ApplyOptions) -> Conversion:
    """The conversion ``apply`` writes for PLAN (its deploy mode picks the flow).

    The one function both ``apply`` (``writer.convert_model``) and ``analyze``
    (:func:`apply_refusal`) run, so the Plan's blockers and apply's exit code cannot disagree.

    Raises:
        BadInputError: an option the deploy mode cannot honour (``--kv-mode``).
        UnsupportedModelError: the model cannot be converted; the message says why.
    """
    if plan.source.inherits_code:
        return convert_inherited(plan, options)
    if plan.deploy_mode is DeployMode.STANDALONE:
        return convert_standalone(plan, options)
    return convert_framework(plan, options)


def apply_refusal(plan: Plan, options: ApplyOptions | None = None) -> str | None:
    """Why ``kvskill apply`` (OPTIONS, by default apply's defaults, in PLAN's deploy mode)
    refuses the model, or None when it converts. The conversion is the one ``apply``
    memoises, so an ``apply`` after ``analyze`` in one process does not redo it."""
    if options is None:
        options = ApplyOptions(deploy_mode=plan.deploy_mode.value)
    try:
        convert_plan(plan, options)
    except UnsupportedModelError as exc:
        return str(exc)
    return None


def with_apply_blockers(plan: Plan) -> Plan:
    """PLAN, with apply's refusal among its ``implementer_blockers`` when the analysis found
    none of its own (a Plan that already lists blockers already says apply refuses)."""
    if plan.implementer_blockers:
        return plan
    refusal = apply_refusal(plan)
    if refusal is None:
        return plan
    return dataclasses.replace(plan, implementer_blockers=[f"apply refuses: {refusal}"])


__all__ = ["apply_refusal", "convert_plan", "with_apply_blockers"]
