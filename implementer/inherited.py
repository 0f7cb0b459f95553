"""A remote modeling file whose attention is transformers' own, converted beside it.

Some vendor files subclass transformers' classes instead of writing their attention
(``class FooAttention(LlamaAttention)`` overriding only ``__init__``, ``FooForCausalLM(
LlamaForCausalLM)``). The cache write and the kernel then live in the installed
``modeling_llama.py``. The analyzer plans the model from that file
(``PlanSource.inherits_code``); here that file is converted as for a built-in type and
written into the output directory, and the remote file's ``from
transformers.models.llama.modeling_llama import ...`` becomes ``from .modeling_llama import
...``. Everything else in the remote file (its own ``__init__`` additions, its config
class) is kept as it is.

Both deploy modes convert: the standalone runner names the model type only and loads the
remote file's class through ``auto_map``. What the converted module cannot reach is refused with the class and the reason: a subclass
whose ``__init__`` skips ``super().__init__`` (its caches would never be declared), a causal-LM
class that does not subclass the inherited module's (``get_cache_info`` would not be on it), an
``import ... as`` of the module (not redirected), a file of the same name beside the model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer import Plan
from kvskill.analyzer.gather import method
from kvskill.analyzer.plan import DeployMode
from kvskill.core.errors import UnsupportedModelError
from kvskill.core.inputs import read_source
from kvskill.implementer.convert import (
    ApplyOptions,
    Conversion,
    convert_framework,
    source_package,
)
from kvskill.implementer.executor_target import RUNTIME_TARGET
from kvskill.implementer.facts import SUPER_INIT, code, module_classes
from kvskill.implementer.standalone.convert import convert_standalone


def convert_inherited(plan: Plan, options: ApplyOptions) -> Conversion:
    """Convert the transformers file PLAN's attention comes from into the output directory
    and point the remote modeling file's import at it."""
    remote_path = Path(plan.source.modeling_file or "")
    inherits = Path(plan.source.inherits_code or "")
    where = remote_path.name
    if options.target != RUNTIME_TARGET:
        raise UnsupportedModelError(
            f"{where}: cannot convert: --target {options.target}: the executor's model-class "
            f"contract is not generated for an attention inherited from {inherits.name}"
        )
    if inherits.parent == remote_path.parent:
        return _already_converted(plan, options, remote_path, inherits)
    if (remote_path.parent / inherits.name).exists():
        raise UnsupportedModelError(
            f"{where}: cannot convert: the converted {inherits.name} is written beside it, but "
            f"the model directory already has a file of that name"
        )
    inner_source = dataclasses.replace(plan.source, modeling_file=str(inherits), inherits_code=None)
    module_name = (
        f"{source_package(dataclasses.replace(plan, source=inner_source))}.{inherits.stem}"
    )
    remote = read_source(remote_path)
    tree = cst.parse_module(remote)
    imported = _imported_from(tree, module_name)
    base = _causal_lm_base(tree, plan.architecture, imported, module_name, where)
    _check_inits(tree, imported, module_name, where)
    inner = dataclasses.replace(plan, architecture=base, source=inner_source)
    if plan.deploy_mode is DeployMode.STANDALONE:
        # the runner names the model type only and loads the remote file's class by auto_map
        converted = convert_standalone(inner, options)
    else:
        converted = convert_framework(inner, options)
    rewritten = tree.visit(_RedirectImport(module_name, inherits.stem)).code
    return dataclasses.replace(
        converted,
        # what the written code does (a standalone mode 1 conversion says Legacy) for this file
        plan=dataclasses.replace(
            converted.plan, architecture=plan.architecture, source=plan.source
        ),
        original=remote,
        converted=rewritten,
        added={inherits.name: converted.converted, **converted.added},
    )


def _already_converted(
    plan: Plan, options: ApplyOptions, remote_path: Path, inherits: Path
) -> Conversion:
    """An output of :func:`convert_inherited` applied to again: the module beside the remote
    file is the converted one (the analyzer plans from it only when it is converted code), so
    both files are kept as they are."""
    inner = dataclasses.replace(
        plan,
        source=dataclasses.replace(plan.source, modeling_file=str(inherits), inherits_code=None),
    )
    if plan.deploy_mode is DeployMode.STANDALONE:
        converted = convert_standalone(inner, options)
    else:
        converted = convert_framework(inner, options)
    assert converted.converted == converted.original, "converted code converts to itself"
    remote = read_source(remote_path)
    return dataclasses.replace(
        converted,
        plan=dataclasses.replace(
            converted.plan, architecture=plan.architecture, source=plan.source
        ),
        original=remote,
        converted=remote,
        added={inherits.name: converted.converted, **converted.added},
    )


def _imported_from(tree: cst.Module, module_name: str) -> dict[str, str]:
    """Local name -> imported name of every ``from MODULE_NAME import ...`` in TREE."""
    names: dict[str, str] = {}
    for node in m.findall(tree, m.ImportFrom()):
        imp = cst.ensure_type(node, cst.ImportFrom)
        if imp.relative or imp.module is None or code(imp.module) != module_name:
            continue
        if isinstance(imp.names, cst.ImportStar):
            continue
        for alias in imp.names:
            local = alias.asname.name if alias.asname else alias.name
            names[code(local)] = code(alias.name)
    return names


def _causal_lm_base(
    tree: cst.Module, architecture: str, imported: dict[str, str], module_name: str, where: str
) -> str:
    """The inherited module's causal-LM class ARCHITECTURE subclasses (IMPORTED: the file's
    names from MODULE_NAME): the class whose converted methods (``get_cache_info``, the paged
    forward) the model then has."""
    cls = module_classes(tree).get(architecture)
    bases = [code(b.value) for b in cls.bases] if cls is not None else []
    found = [imported[b] for b in bases if b in imported and imported[b].endswith("ForCausalLM")]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"{where}: cannot convert: {architecture} does not subclass a *ForCausalLM class "
            f"imported from {module_name} (bases: {', '.join(bases) or 'none'}); the "
            "converted module's cache methods would not reach it"
        )
    return found[0]


def _check_inits(tree: cst.Module, imported: dict[str, str], module_name: str, where: str) -> None:
    """Every class of the file that subclasses one IMPORTED from MODULE_NAME and has an
    ``__init__`` must call ``super().__init__``: the converted ``__init__`` declares the
    caches."""
    for node in m.findall(tree, m.Import()):
        for alias in cst.ensure_type(node, cst.Import).names:
            if code(alias.name) == module_name:
                raise UnsupportedModelError(
                    f"{where}: cannot convert: `import {module_name}` is not redirected to the "
                    "converted module; import its classes with `from ... import ...`"
                )
    for name, cls in module_classes(tree).items():
        if not any(code(b.value) in imported for b in cls.bases):
            continue
        init = method(cls, "__init__")
        if init is not None and not m.findall(init, SUPER_INIT):
            raise UnsupportedModelError(
                f"{where}: cannot convert: {name}.__init__ does not call super().__init__, so "
                f"the converted {module_name.rsplit('.', 1)[-1]} never declares its caches"
            )


class _RedirectImport(cst.CSTTransformer):
    """``from <module_name> import ...`` -> ``from .<stem> import ...``."""

    def __init__(self, module_name: str, stem: str) -> None:
        super().__init__()
        self.module_name = module_name
        self.stem = stem

    def leave_ImportFrom(
        self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom
    ) -> cst.ImportFrom:
        if (
            original_node.relative
            or original_node.module is None
            or code(original_node.module) != self.module_name
        ):
            return updated_node
        return updated_node.with_changes(module=cst.Name(self.stem), relative=[cst.Dot()])


__all__ = ["convert_inherited"]
