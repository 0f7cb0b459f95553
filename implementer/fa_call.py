"""The fused-attention call every attention rewrite emits: operator name and keyword names.

v1 (``npu_fused_infer_attention_score``) and v2 (``..._v2``) take the same inputs under partly
different keywords (npu_ops §2.2). Rewrites list their keywords once, in v1 names;
:func:`fa_keywords` renames them for the version the Plan chose.
"""

from __future__ import annotations

from kvskill.core.fa_keywords import FA_V1, FA_V2, V1_TO_V2
from kvskill.implementer.spec import FaVersion

FA_OPS = {FaVersion.V1: FA_V1, FaVersion.V2: FA_V2}


def fa_keywords(version: FaVersion, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """PAIRS of (v1 keyword, expression) under VERSION's keyword names, order kept."""
    if version is FaVersion.V1:
        return list(pairs)
    return [(V1_TO_V2.get(name, name), expr) for name, expr in pairs]
