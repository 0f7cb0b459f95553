"""Render ``runner_<model>.py``: the standalone runner, from the jinja2 templates.

``runner.py.j2`` holds what every KV mode shares (generate, the metadata, the CLI);
``runner_contiguous.py.j2`` and ``runner_paged.py.j2`` fill its named blocks (cache
allocation, prefill and decode inputs, last-token logits). The rendering is strict and parsed
with libcst, so a broken template fails here and never reaches a user's directory.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
from kvskill.analyzer.gather import is_causal_lm_class, method
from kvskill.analyzer.plan import Plan
from kvskill.implementer.snippets import render
from kvskill.implementer.standalone.spec import KvMode, StandaloneSpec

TEMPLATES = {KvMode.CONTIGUOUS: "runner_contiguous.py.j2", KvMode.PAGED: "runner_paged.py.j2"}


@dataclass(frozen=True, kw_only=True)
class RenderedRunner:
    file_name: str
    text: str


def runner_file_name(model_type: str) -> str:
    """``runner_<model_type>.py`` with characters a module name cannot hold replaced."""
    safe = "".join(c if c.isalnum() else "_" for c in model_type.lower())
    return f"runner_{safe}.py"


def takes_logits_to_keep(source: str, architecture: str | None) -> bool:
    """Whether the causal LM's ``forward`` in SOURCE has a ``logits_to_keep`` parameter
    (transformers >= 4.50 models; 4.46 ones take ``num_logits_to_keep: int``, vendor files
    often neither). True when the class is not found: the runner then passes it, as always."""
    module = cst.parse_module(source)
    classes = [c for c in module.body if isinstance(c, cst.ClassDef)]
    named = [c for c in classes if c.name.value == architecture]
    heads = named or [c for c in classes if is_causal_lm_class(c)]
    forward = method(heads[0], "forward") if heads else None
    if forward is None:
        return True
    params = [*forward.params.params, *forward.params.kwonly_params]
    return any(p.name.value == "logits_to_keep" for p in params)


def render_runner(
    plan: Plan, spec: StandaloneSpec, *, keeps_logit_rows: bool = True
) -> RenderedRunner:
    """The runner for ``plan``'s model in ``spec``'s KV mode, checked to parse.

    KEEPS_LOGIT_ROWS: the model's forward takes ``logits_to_keep`` (:func:`takes_logits_to_keep`);
    otherwise the runner computes every position's logits and picks the rows itself.
    """
    name = runner_file_name(plan.model_type)
    if spec.legacy:
        mode_name = "Mode 1 (Legacy: one static row per request, the model's own attention)"
        title = "mode 1, Legacy rows read by the model's own attention"
        caches = "k_cache, v_cache"
    elif spec.mla:
        mode_name = "Mode 3 (absorbed MLA over paged blocks)"
        title = "mode 3, absorbed MLA over paged caches (TND_NTD)"
        caches = "nope_cache: the latent, rope_cache: the shared rope key"
    else:
        mode_name = "Mode 2 (paged)"
        title = "mode 2, paged KV caches (TND)"
        caches = "k_cache, v_cache"
    text = render(
        TEMPLATES[KvMode.PAGED if spec.legacy else spec.kv_mode],
        model_type=plan.model_type,
        runner_file=name,
        kv_mode=spec.kv_mode.value,
        block_size=spec.block_size,
        mode_name=mode_name,
        mode_title=title,
        cache_names=caches,
        keeps_logit_rows=keeps_logit_rows,
        rows_as_blocks=spec.legacy,
    )
    cst.parse_module(text)  # a template that renders broken Python fails here, not later
    return RenderedRunner(file_name=name, text=text)
