"""The framework rewrite as one ``str -> str`` transform: validate, then run the codemods in order.

Facts are gathered and checked for every class before any codemod runs, so a model the
rewrite cannot handle fails with the exact reason and never yields a half-converted file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.attn_forward import AttentionForwardCommand
from kvskill.implementer.attn_init import AttentionInitCommand
from kvskill.implementer.facts import (
    FA_CALL,
    attention_facts,
    is_attention_class,
    is_causal_lm_class,
    m,
)
from kvskill.implementer.gated_delta import (
    GatedDeltaCommand,
    gated_delta_facts,
    is_gated_delta_class,
    state_layer_problems,
)
from kvskill.implementer.imports import AbsoluteImportsCommand, RuntimeImportsCommand
from kvskill.implementer.masks import SkipDenseMasksCommand
from kvskill.implementer.model_class import CacheInfoCommand
from kvskill.implementer.spec import ConversionSpec
from kvskill.implementer.text_model import LocalTextModelCommand, text_model_problems
from libcst.codemod import CodemodContext

#: Order matters only at the ends: imports are made absolute first so every later command
#: sees final module names; the runtime imports are added last, once the codemods that use
#: them have run (AddImportsVisitor deduplicates, so rerunning changes nothing).
COMMANDS = (
    AbsoluteImportsCommand,
    AttentionInitCommand,
    AttentionForwardCommand,
    GatedDeltaCommand,
    CacheInfoCommand,
    SkipDenseMasksCommand,
    LocalTextModelCommand,
    RuntimeImportsCommand,
)


@dataclass(frozen=True, kw_only=True)
class ModuleSummary:
    """What the rewrite found in a module."""

    attention_classes: list[str]
    causal_lm_classes: list[str]
    already_converted: bool
    #: gated delta net classes (recurrent-state layers of the Mamba group)
    state_classes: list[str] = field(default_factory=list)


def parse(source: str, filename: str = "<modeling file>") -> cst.Module:
    """Parse model code; a syntax error is bad input (exit 2)."""
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        message = str(exc).splitlines()[0]
        raise BadInputError(
            f"{filename}: cannot parse the modeling code (line {exc.raw_line}, column "
            f"{exc.raw_column}): {message}"
        ) from exc


def summarize(module: cst.Module, spec: ConversionSpec, filename: str) -> ModuleSummary:
    """Check every class the rewrite would touch.

    Raises:
        UnsupportedModelError: with every reason found, before anything is rewritten.
    """
    classes = [c for c in m.findall(module, m.ClassDef()) if isinstance(c, cst.ClassDef)]
    attention = [c for c in classes if is_attention_class(c)]
    heads = [c for c in classes if is_causal_lm_class(c)]
    state = [c for c in classes if is_gated_delta_class(c)]
    problems: list[str] = text_model_problems(module)
    problems.extend(state_layer_problems(state, spec.has_state_layers))
    if not attention:
        problems.append(
            "no attention class found (a module whose forward writes `<cache>.update(key, "
            "value, self.layer_idx, ...)` and then calls an attention interface or "
            "scaled_dot_product_attention)"
        )
    if not heads:
        problems.append("no causal-LM class found (a class whose __init__ assigns self.lm_head)")
    for cls in attention:
        facts = attention_facts(cls)
        problems.extend(facts.problems)
        if facts.converted or m.findall(cls, FA_CALL):
            continue
        if spec.uniform_attn_type is None and facts.layer_idx_param is None:
            problems.append(
                f"{facts.name}.__init__ takes no layer index, but the model mixes attention "
                "types per layer"
            )
        if spec.has_sinks and facts.seam is not None and facts.seam.sinks is None:
            problems.append(
                f"{facts.name}.forward passes no sinks (s_aux=/sinks=) to the attention "
                "kernel, but the Plan says the model has learnable sinks"
            )
    if problems:
        raise UnsupportedModelError(f"{filename}: cannot convert: " + "; ".join(problems))
    converted = all(attention_facts(c).converted and m.findall(c, FA_CALL) for c in attention)
    converted = converted and all(gated_delta_facts(c).converted for c in state)
    return ModuleSummary(
        attention_classes=[c.name.value for c in attention],
        causal_lm_classes=[c.name.value for c in heads],
        already_converted=converted,
        state_classes=[c.name.value for c in state],
    )


def convert_source(
    source: str,
    spec: ConversionSpec,
    *,
    package: str | None = None,
    filename: str = "<modeling file>",
) -> str:
    """The framework-mode conversion of one modeling file (``str -> str``, no I/O).

    Args:
        source: the modeling file's text.
        spec: the analyzer's decisions, validated.
        package: dotted package the file was read from (``transformers.models.qwen3``), to
            make relative imports absolute; None for a model directory.
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


#: NOTE: the conversion is a pure function of its inputs and libcst takes seconds on a large
#: modeling file, so repeated conversions (apply with other config overrides, verify loops)
#: reuse the last results, as the MLA rewrite does. Failures are not kept: they raise.
_MEMO_SIZE = 8
_CONVERTED: dict[tuple[str, str, str | None, str], str] = {}


def _convert(source: str, spec: ConversionSpec, package: str | None, filename: str) -> str:
    module = parse(source, filename)
    summarize(module, spec, filename)
    for command in COMMANDS:
        context = CodemodContext(filename=filename)
        if command is AbsoluteImportsCommand:
            module = command(context, spec, package).transform_module(module)
        else:
            module = command(context, spec).transform_module(module)
    return module.code
