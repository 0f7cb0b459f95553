"""The conversion of one modeling file as ``str -> str``: parse, check, run the registry.

One pipeline serves every path (paged, MLA, contiguous): the path picks the module check and
the rewrites of ``registry.REWRITES`` that serve it. Every class is checked before any rewrite
runs, so a model the rewrite cannot handle fails with the exact reasons; the converted module
is checked again after the rewrites (``self_check.py``), so a file that slipped past the first
check is refused too and never written half-converted.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import libcst as cst
from kvskill.analyzer.gather import parsed_module
from kvskill.core.errors import BadInputError
from kvskill.implementer.checks import (
    check_attention_module,
    check_framework_legacy_module,
    check_mla_module,
)
from kvskill.implementer.decided_branches import take_decided_branches
from kvskill.implementer.mla.spec import MlaSpec
from kvskill.implementer.registry import ConversionPath, rewrites_for
from kvskill.implementer.self_check import self_check
from kvskill.implementer.spec import ConversionSpec
from kvskill.implementer.standalone_legacy_checks import (
    check_standalone_legacy_module,
    standalone_legacy_self_check,
)
from libcst.codemod import CodemodContext

#: the check of each path's attention and model classes, given the other rewrites' problems
#: (raises UnsupportedModelError with all of them)
_CHECKS: dict[ConversionPath, Callable[[cst.Module, Any, str, list[str]], object]] = {
    # only the paged seam keeps one cache pair per call site of a shared attention block
    ConversionPath.PAGED: partial(check_attention_module, serves_call_sites=True),
    ConversionPath.MLA: check_mla_module,
    ConversionPath.CONTIGUOUS: check_attention_module,
    ConversionPath.COMPRESSED: check_attention_module,
    ConversionPath.LEGACY: check_attention_module,
    ConversionPath.FRAMEWORK_LEGACY: check_framework_legacy_module,
    ConversionPath.STANDALONE_LEGACY: check_standalone_legacy_module,
}


def parse(source: str, filename: str = "<modeling file>") -> cst.Module:
    """Parse model code; a syntax error is bad input (exit 2)."""
    try:
        return parsed_module(source)
    except cst.ParserSyntaxError as exc:
        message = str(exc).splitlines()[0]
        raise BadInputError(
            f"{filename}: cannot parse the modeling code (line {exc.raw_line}, column "
            f"{exc.raw_column}): {message}"
        ) from exc


def convert(
    source: str,
    spec: ConversionSpec | MlaSpec,
    path: ConversionPath,
    *,
    package: str | None = None,
    filename: str = "<modeling file>",
) -> str:
    """The conversion of one modeling file on PATH (``str -> str``, no I/O).

    Args:
        source: the modeling file's text.
        spec: the analyzer's decisions, validated (``MlaSpec`` on the MLA path).
        path: which attention rewrite to take.
        package: dotted package the file was read from (``transformers.models.qwen3``), to
            make relative imports absolute; None for a model directory.
        filename: for messages only.

    Raises:
        BadInputError: the source does not parse.
        UnsupportedModelError: the structure cannot be rewritten; nothing is produced.
    """
    key = (source, repr(spec), path, package, filename)
    if key not in _CONVERTED:
        _CONVERTED[key] = _convert(source, spec, path, package, filename)
        while len(_CONVERTED) > _MEMO_SIZE:
            _CONVERTED.pop(next(iter(_CONVERTED)))
    return _CONVERTED[key]


#: NOTE: the conversion is a pure function of its inputs and libcst takes seconds on a large
#: modeling file, so repeated conversions (apply with other config overrides, verify loops,
#: the two standalone modes) reuse the last results. Failures are not kept: they raise.
_MEMO_SIZE = 8
_CONVERTED: dict[tuple[Any, ...], str] = {}


def _convert(
    source: str, spec: Any, path: ConversionPath, package: str | None, filename: str
) -> str:
    # the branches the config decides (Falcon's ``if alibi is None:``) become the one that
    # runs before anything is read: the checks and rewrites then see one kernel
    original = module = take_decided_branches(
        parse(source, filename),
        getattr(spec, "config_switches", {}),
        replaces_kernel=not getattr(spec, "keeps_model_kernel", False),
        filename=filename,
    )
    rewrites = rewrites_for(path)
    problems = [p for rewrite in rewrites for p in rewrite.command.problems(module, spec)]
    _CHECKS[path](module, spec, filename, problems)
    for rewrite in rewrites:
        command = rewrite.command(CodemodContext(filename=filename), spec, package)
        module = command.transform_module(module)
    # what was emitted, whatever the rewrites meant: every path of every attention forward
    # writes and reads the declared caches, or nothing is written
    self_check(original, module, filename, path.value)
    if path is ConversionPath.STANDALONE_LEGACY:
        # its attention writes in a helper method, which the generic self-check does not see
        standalone_legacy_self_check(original, module, filename)
    return module.code


def convert_source(
    source: str,
    spec: ConversionSpec,
    *,
    package: str | None = None,
    filename: str = "<modeling file>",
) -> str:
    """The paged (framework-mode) conversion: :func:`convert` on ``ConversionPath.PAGED``."""
    return convert(source, spec, ConversionPath.PAGED, package=package, filename=filename)


def convert_framework_legacy_source(
    source: str, spec: ConversionSpec, *, filename: str = "<modeling file>"
) -> str:
    """The framework's own Legacy model to its Paged contract: :func:`convert` on
    ``ConversionPath.FRAMEWORK_LEGACY``."""
    return convert(source, spec, ConversionPath.FRAMEWORK_LEGACY, filename=filename)


def convert_standalone_legacy_source(
    source: str, spec: ConversionSpec, *, filename: str = "<modeling file>"
) -> str:
    """The framework's standalone Legacy model (mode 1) to standalone mode 2: :func:`convert`
    on ``ConversionPath.STANDALONE_LEGACY``."""
    return convert(source, spec, ConversionPath.STANDALONE_LEGACY, filename=filename)


def convert_mla_source(
    source: str,
    spec: MlaSpec,
    *,
    package: str | None = None,
    filename: str = "<modeling file>",
) -> str:
    """The absorbed-MLA conversion: :func:`convert` on ``ConversionPath.MLA``."""
    return convert(source, spec, ConversionPath.MLA, package=package, filename=filename)
