"""The MLA framework rewrite as one ``str -> str`` transform: validate, then run the codemods.

The import and mask codemods are the framework rewrite's own; only the attention and model
class codemods are MLA-specific. Every class is checked before any codemod runs, so a model
the rewrite cannot handle fails with the exact reason and never yields a half-converted file.
"""

from __future__ import annotations

import libcst as cst
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.facts import (
    CACHE_ENTRIES_ASSIGN,
    class_assigns,
    is_attention_class,
    is_causal_lm_class,
)
from kvskill.implementer.gated_delta import (
    GatedDeltaCommand,
    is_gated_delta_class,
    state_layer_problems,
)
from kvskill.implementer.imports import AbsoluteImportsCommand, RuntimeImportsCommand
from kvskill.implementer.masks import SkipDenseMasksCommand
from kvskill.implementer.mla.codemods import (
    MlaAttentionForwardCommand,
    MlaAttentionInitCommand,
    MlaCacheInfoCommand,
)
from kvskill.implementer.mla.facts import mla_attention_facts
from kvskill.implementer.mla.spec import CacheWrite, MlaSpec
from kvskill.implementer.pipeline import parse
from libcst.codemod import CodemodContext

#: Imports are made absolute first so later commands see final module names; the runtime
#: imports come last, after the codemods that use them (AddImportsVisitor deduplicates).
COMMANDS = (
    MlaAttentionInitCommand,
    MlaAttentionForwardCommand,
    GatedDeltaCommand,
    MlaCacheInfoCommand,
    SkipDenseMasksCommand,
    RuntimeImportsCommand,
)


def check_module(module: cst.Module, spec: MlaSpec, filename: str) -> list[str]:
    """Names of the MLA attention classes to convert.

    Raises:
        UnsupportedModelError: with every reason found, before anything is rewritten.
    """
    classes = {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}
    attention = [c for c in classes.values() if is_attention_class(c)]
    state = [c for c in classes.values() if is_gated_delta_class(c)]
    problems: list[str] = state_layer_problems(state, spec.has_state_layers)
    if not attention:
        problems.append(
            "no attention class found (a module whose forward writes the latent with "
            "`<cache>.update(latent, rope_key, self.layer_idx, ...)` and then calls attention)"
        )
    if not any(is_causal_lm_class(c) for c in classes.values()):
        problems.append("no causal-LM class found (a class whose __init__ assigns self.lm_head)")
    for cls in attention:
        if class_assigns(cls, CACHE_ENTRIES_ASSIGN):
            continue
        fused = spec.cache_write is CacheWrite.FUSED
        problems.extend(mla_attention_facts(cls, classes, fused).problems)
    if problems:
        raise UnsupportedModelError(f"{filename}: cannot convert: " + "; ".join(problems))
    return [c.name.value for c in attention]


def convert_mla_source(
    source: str,
    spec: MlaSpec,
    *,
    package: str | None = None,
    filename: str = "<modeling file>",
) -> str:
    """The framework-mode MLA conversion of one modeling file (``str -> str``, no I/O).

    Args:
        source: the modeling file's text.
        spec: the analyzer's MLA decisions, validated (``MlaSpec.from_plan``).
        package: dotted package the file was read from (``transformers.models.deepseek_v3``)
            to make relative imports absolute; None for a model directory.
        filename: for messages only.

    Raises:
        BadInputError: the source does not parse.
        UnsupportedModelError: the structure cannot be rewritten; nothing is produced.
    """
    key = (source, repr(spec), package, filename)
    if key not in _CONVERTED:
        _CONVERTED[key] = _convert(source, spec, package, filename)
        while len(_CONVERTED) > _MEMO_SIZE:
            _CONVERTED.pop(next(iter(_CONVERTED)))
    return _CONVERTED[key]


#: NOTE: the conversion is a pure function of its inputs and libcst is slow on a large
#: modeling file, so repeated conversions (apply with different config overrides, verify
#: loops) reuse the last results.
_MEMO_SIZE = 8
_CONVERTED: dict[tuple[str, str, str | None, str], str] = {}


def _convert(source: str, spec: MlaSpec, package: str | None, filename: str) -> str:
    module = parse(source, filename)
    check_module(module, spec, filename)
    module = AbsoluteImportsCommand(
        CodemodContext(filename=filename), spec, package
    ).transform_module(module)  # type: ignore[arg-type]
    for command in COMMANDS:
        module = command(CodemodContext(filename=filename), spec).transform_module(module)  # type: ignore[arg-type]
    return module.code


__all__ = ["COMMANDS", "check_module", "convert_mla_source"]
