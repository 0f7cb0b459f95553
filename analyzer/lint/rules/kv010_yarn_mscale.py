"""KV010: a YaRN (mscale_all_dim) model whose softmax scale lacks mscale²."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import fa_calls
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example

_INV_SQRT = re.compile(
    r"\*\*\s*\(?\s*-\s*0?\.5\s*\)?|/\s*(math\.|torch\.|np\.)?sqrt\(|\*\*\s*0?\.5|rsqrt\("
)
_MSCALE = re.compile(r"mscale", re.IGNORECASE)


def _config_sets_mscale_all_dim(ctx: FileContext) -> bool | None:
    """Whether the config beside the file sets a non-zero mscale_all_dim; None when there is
    no config or it gives no rope scaling value at all (then the code decides)."""
    if not ctx.has_config:
        return None
    given = False
    for key in ("rope_scaling", "rope_parameters"):
        if key not in ctx.config:
            continue
        given = True
        params = ctx.config[key]
        candidates = [params] if isinstance(params, dict) else []
        if isinstance(params, dict):  # per-layer-type parameters nest one level down
            candidates += [v for v in params.values() if isinstance(v, dict)]
        if any(c.get("mscale_all_dim") for c in candidates):
            return True
    return False if given else None


def _origins(ctx: FileContext, expr: cst.BaseExpression, depth: int = 0) -> list[str]:
    """Texts of ``expr`` and of every value its name / attribute was assigned.

    An opaque binding (``self.scaling *= mscale**2``, unpacking, a parameter) leaves only
    the name's own text, which never looks like an inverse square root: no finding.
    """
    out = [ctx.code(expr)]
    if isinstance(expr, cst.Name | cst.Attribute) and depth < 4:
        for value in ctx.assigned_values(expr) or ():
            out.extend(_origins(ctx, value, depth + 1))
    return out


class YarnScaleMissingMscale(Rule):
    """The softmax scale is head_dim ** -0.5 in a YaRN mscale_all_dim model (needs mscale²).

    With YaRN rope scaling and ``mscale_all_dim`` set, the attention scale is
    head_dim ** -0.5 * mscale², mscale = 0.1 * mscale_all_dim * ln(factor) + 1. Leaving
    the factor out lowers every attention logit a little: no error, just drifting output.
    Reported when the scale reaching FA is a plain inverse square root with no mscale in
    its making and the model uses mscale_all_dim: the config beside the file decides (a
    ``config.json`` over the literal defaults of the ``configuration_*.py`` class, so a
    model shipping ``rope_scaling=None`` or ``mscale_all_dim`` 0 is never asked); with no
    config there, a file that reads ``mscale_all_dim`` is asked.
    """

    id = "KV010"
    name = "yarn-scale-missing-mscale"
    VALID = [
        example(
            """\
import math

class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.scaling = config.qk_head_dim ** -0.5
        mscale_all_dim = config.rope_parameters.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = 0.1 * mscale_all_dim * math.log(config.rope_parameters["factor"]) + 1.0
            self.scaling = self.scaling * mscale * mscale

    def forward(self, q, k, v, md):
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=self.scaling, atten_mask=md.attention_mask,
            sparse_mode=3)
"""
        ),
    ]
    INVALID = [
        example(
            """\
class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mscale_all_dim = config.rope_parameters.get("mscale_all_dim", 0)
        self.softmax_scale = config.qk_head_dim ** (-0.5)

    def forward(self, q, k, v, md):
        return torch_npu.npu_fused_infer_attention_score_v2(
            q, k, v, num_query_heads=8, softmax_scale=self.softmax_scale,
            atten_mask=md.attention_mask, sparse_mode=3)
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        from_config = _config_sets_mscale_all_dim(ctx)
        if from_config is False:
            return  # the config the model ships leaves mscale_all_dim 0 or unset
        if from_config is None and not ctx.mentions(r"mscale_all_dim"):
            return
        why = (
            "the config beside it sets mscale_all_dim"
            if from_config
            else "it reads mscale_all_dim and no config.json or configuration_*.py beside "
            "it gives the value"
        )
        for call in fa_calls(ctx):
            scale = call.kw("scale") or call.kw("softmax_scale")
            if scale is None:
                continue
            texts = _origins(ctx, scale)
            if any(_MSCALE.search(t) for t in texts):
                continue
            if not any(_INV_SQRT.search(t) for t in texts):
                continue
            yield self.finding(
                ctx,
                scale,
                f"scale `{ctx.code(scale)}` is head_dim ** -0.5 in a YaRN model ({why}): "
                "the scale must be multiplied by mscale²",
                "scale = head_dim ** -0.5 * mscale * mscale with mscale = 0.1 * "
                "mscale_all_dim * math.log(factor) + 1.0 (when mscale_all_dim is set)",
            )
