"""``--kv-mode``: which KV design ``apply`` writes, honoured or refused, never ignored.

Each deploy mode can write two designs. Framework mode writes Paged (``get_cache_info`` +
block tables) or Legacy (``cache_unit`` caches the runtime pre-allocates, one static row per
request, written with ``scatter_update_``); standalone mode writes mode 2 (paged, mode 3 over
it for MLA) or mode 1 (contiguous BSH caches, the Legacy layout). ``auto`` follows the Plan:
Paged unless the analyzer chose Legacy. A value the deploy mode cannot write is bad input
(exit 2); a design the model cannot take (Paged for a soft-capping model) is refused later by
the conversion with its reason (exit 3).
"""

from __future__ import annotations

from kvskill.analyzer.plan import DeployMode, KvMode, Plan
from kvskill.core.errors import BadInputError

#: every value ``--kv-mode`` accepts
KV_MODE_CHOICES = ("auto", "paged", "legacy", "contiguous")

#: what each deploy mode writes for each accepted value
_FRAMEWORK = {"paged": "paged", "legacy": "legacy"}
#: standalone mode 1 IS the Legacy layout, so "legacy" and "contiguous" name the same output
_STANDALONE = {"paged": "paged", "legacy": "contiguous", "contiguous": "contiguous"}


def resolve_kv_mode(plan: Plan, requested: str) -> str:
    """The KV design to write for PLAN's deploy mode: framework "paged" | "legacy",
    standalone "paged" | "contiguous".

    Raises:
        BadInputError: REQUESTED is not a value of ``--kv-mode`` or names a design the deploy
            mode does not write (``contiguous`` in framework mode).
    """
    standalone = plan.deploy_mode is DeployMode.STANDALONE
    table = _STANDALONE if standalone else _FRAMEWORK
    if requested == "auto":
        requested = "legacy" if plan.kv_mode is KvMode.LEGACY else "paged"
    if requested not in table:
        mode = "standalone" if standalone else "framework"
        raise BadInputError(
            f"--kv-mode {requested}: {mode} mode writes "
            + " or ".join(sorted(table))
            + (
                " (contiguous BSH caches are standalone mode 1; the framework's contiguous "
                "design is --kv-mode legacy)"
                if requested == "contiguous"
                else ""
            )
        )
    return table[requested]


__all__ = ["KV_MODE_CHOICES", "resolve_kv_mode"]
