"""The standalone rewrite of one modeling file (``str -> str``, no I/O), per KV mode.

Modes 2 and 3 emit exactly the framework rewrite's modeling code (paged TND seam, or the
absorbed MLA seam): the layer reads ``slot_mapping``/``block_table`` from the forward metadata
whoever builds it, so the generated runner simply plays the framework's part. Mode 1 swaps the
attention codemods for the contiguous BSH ones and keeps the shared import, model-class and
mask codemods.
"""

from __future__ import annotations

from kvskill.implementer.imports import AbsoluteImportsCommand, RuntimeImportsCommand
from kvskill.implementer.masks import SkipDenseMasksCommand
from kvskill.implementer.mla import convert_mla_source
from kvskill.implementer.model_class import CacheInfoCommand
from kvskill.implementer.pipeline import convert_source, parse, summarize
from kvskill.implementer.standalone.contiguous import (
    ContiguousAttentionForwardCommand,
    ContiguousAttentionInitCommand,
)
from kvskill.implementer.standalone.spec import KvMode, StandaloneSpec
from libcst.codemod import CodemodContext

#: mode 1: imports absolute first (later commands see final names), runtime imports last
CONTIGUOUS_COMMANDS = (
    ContiguousAttentionInitCommand,
    ContiguousAttentionForwardCommand,
    CacheInfoCommand,
    SkipDenseMasksCommand,
    RuntimeImportsCommand,
)


def convert_standalone_source(
    source: str,
    spec: StandaloneSpec,
    *,
    package: str | None = None,
    filename: str = "<modeling file>",
) -> str:
    """The standalone conversion of one modeling file.

    Raises:
        BadInputError: the source does not parse.
        UnsupportedModelError: the structure cannot be rewritten; nothing is produced.
    """
    if spec.mla:
        return convert_mla_source(source, spec.base, package=package, filename=filename)  # type: ignore[arg-type]
    if spec.kv_mode is KvMode.PAGED:
        return convert_source(source, spec.base, package=package, filename=filename)  # type: ignore[arg-type]
    module = parse(source, filename)
    summarize(module, spec.base, filename)  # type: ignore[arg-type]
    module = AbsoluteImportsCommand(
        CodemodContext(filename=filename), spec.base, package
    ).transform_module(module)  # type: ignore[arg-type]
    for command in CONTIGUOUS_COMMANDS:
        module = command(CodemodContext(filename=filename), spec.base).transform_module(module)  # type: ignore[arg-type]
    return module.code
