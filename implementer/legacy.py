"""Framework-mode Legacy output: what ``apply`` does when the Plan (or ``--kv-mode legacy``)
asks for ``cache_unit`` caches instead of paged ones.

Seed 003 keeps Legacy for models the fused operator cannot serve (logit soft-capping, chunked
attention, ALiBi): each attention declares ``cache_unit``, the framework pre-allocates one
``[max_batch, max_seq_len, *cache_unit]`` row store per cache, the layer writes it with
``scatter_update_`` at the runner's ``kv_len`` and attends with the model's own math. This
release does not generate that code in framework mode, and says so instead of writing a paged
model the operators would serve wrongly: an explicit ``--kv-mode legacy`` is a value framework
mode cannot produce (exit 2), a Plan that chose Legacy is a model ``apply`` cannot convert
(exit 3, with the analyzer's reason).
"""

from __future__ import annotations

from kvskill.analyzer import Plan
from kvskill.analyzer.plan import KvMode
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions, Conversion

#: what is missing, in one clause both refusals share
NOT_GENERATED = (
    "framework mode does not write Legacy caches (cache_unit + scatter_update_, static rows) "
    "yet; convert it by hand from the workspace of kvskill analyze --out "
    "(references/framework_kv_reference.md §7)"
)


def convert_framework_legacy(plan: Plan, options: ApplyOptions) -> Conversion:
    """Refuse: framework Legacy output is not generated (see the module docstring).

    Raises:
        BadInputError: ``--kv-mode legacy`` was asked for explicitly.
        UnsupportedModelError: the Plan chose Legacy (``--kv-mode auto``).
    """
    if options.kv_mode == "legacy":
        raise BadInputError(f"--kv-mode legacy: {NOT_GENERATED}")
    assert plan.kv_mode is KvMode.LEGACY, "auto resolves to legacy only for a Legacy Plan"
    raise UnsupportedModelError(
        f"{plan.model_type}: cannot convert: Legacy KV ({plan.legacy_reason}); {NOT_GENERATED}"
    )


__all__ = ["NOT_GENERATED", "convert_framework_legacy"]
