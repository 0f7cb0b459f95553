"""``analyze --out``: a workspace for converting a model by hand, that ``verify`` accepts.

Where ``apply`` refuses a model (or an agent wants to write part of the conversion itself),
the conversion is done by hand. ``verify`` needs two things to judge it: the Plan, and the
original modeling source to rebuild the reference model from. The workspace holds both,
exactly as ``apply`` would write them, next to an *unconverted* copy of the modeling file
(relative imports of transformers internals made absolute, so it imports from the
workspace) and the model's other files. The person or agent then edits that copy following
``references/framework_kv_reference.md``; ``kvskill verify DIR --trust-remote-code`` compares
the edited model with the original.
"""

from __future__ import annotations

from pathlib import Path

from kvskill.analyzer import Plan
from kvskill.analyzer.plan import DeployMode
from kvskill.core.errors import BadInputError
from kvskill.implementer.convert import ApplyOptions, Conversion, read_source, source_package
from kvskill.implementer.imports import AbsoluteImportsCommand
from kvskill.implementer.pipeline import parse
from kvskill.implementer.writer import ApplyResult, write_conversion
from libcst.codemod import CodemodContext


def write_workspace(plan: Plan, out_dir: Path, options: ApplyOptions) -> ApplyResult:
    """Write the hand-conversion workspace of PLAN's model to ``out_dir`` (checked first with
    ``check_out_before_work``; ``options`` gives ``force`` and ``copy_weights``).

    Raises:
        BadInputError: a Plan for standalone mode (a hand conversion is checked in framework
            mode, against the bundled runtime), unreadable files, an unwritable ``out_dir``.
    """
    if plan.deploy_mode is not DeployMode.FRAMEWORK:
        raise BadInputError(
            f"{plan.model_type}: the Plan says {plan.deploy_mode} mode; a hand-conversion "
            "workspace is checked against the bundled runtime, pass --mode framework"
        )
    return write_conversion(workspace_conversion(plan), out_dir, options)


def workspace_conversion(plan: Plan) -> Conversion:
    """The Plan's modeling file, unconverted but importable from a folder of its own."""
    path = Path(plan.source.modeling_file)
    original = read_source(path)
    package = source_package(plan)
    module = parse(original, path.name)
    copy = AbsoluteImportsCommand(CodemodContext(filename=path.name), None, package)
    return Conversion(plan=plan, original=original, converted=copy.transform_module(module).code)


__all__ = ["workspace_conversion", "write_workspace"]
