"""Deployment mode, in seed 003's order: the explicit flag; a ``部署模式: 框架部署 | 独立部署``
line in the task prompt (``--prompt-file``) or in ``progress.md`` (beside the model, else in a
folder above it up to the working directory, where an agent's workspace keeps it); what the
model directory shows (a self-managing ``runner_*.py`` means standalone); else framework."""

from __future__ import annotations

import re
from pathlib import Path

from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.plan import DeployMode
from kvskill.analyzer.scan import ModuleFacts, scan_file
from kvskill.core.inputs import read_text

#: what a runner imports when the bundled runtime schedules requests and owns the KV cache;
#: helpers alone (ForwardMetaData, forward_context, masks, load_model) leave both to the runner
ENGINE_MODULES = ("kvskill.runtime.llm", "kvskill.runtime.engine", "kvskill.runtime.scheduler")
ENGINE_NAMES = ("LLM", "LLMEngine", "Scheduler", "KVCacheManager", "prepare_kv_cache")


#: ``部署模式: 框架部署`` (full-width colon too); the English names are accepted as well
_MARKER = re.compile(r"部署模式\s*[:：]\s*\**\s*(框架部署|独立部署|framework|standalone)", re.I)
_MARKER_MODES = {"框架部署": "framework", "独立部署": "standalone"}
#: the migrator's progress notes, read beside the model when no prompt names the mode
PROGRESS_FILE = "progress.md"


def deploy_marker(text: str) -> tuple[str, int] | None:
    """The deploy mode a ``部署模式:`` line names, and its line number (the first such line)."""
    for number, line in enumerate(text.splitlines(), start=1):
        match = _MARKER.search(line)
        if match:
            value = match.group(1)
            return _MARKER_MODES.get(value, value.lower()), number
    return None


def decide_deploy_mode(
    requested: str,
    runner_files: tuple[str, ...],
    book: Notebook,
    *,
    prompt_file: Path | None = None,
    model_dir: Path | None = None,
) -> DeployMode:
    """Flag > ``部署模式:`` in the prompt file > in progress.md beside the model, above it or
    in the workspace > a self-managing runner_*.py (standalone) > framework."""
    if requested in ("framework", "standalone"):
        book.cite("deploy_mode", f"set explicitly to {requested}", "flag --mode")
        return DeployMode(requested)
    candidates = [] if prompt_file is None else [(prompt_file, prompt_file.parent, "--prompt-file")]
    candidates += progress_files(model_dir)
    for path, root, what in candidates:
        marker = deploy_marker(read_text(path, what=what, root=root))
        if marker is not None:
            mode, line = marker
            book.cite("deploy_mode", f"{what} says 部署模式: {mode}", f"{path.name}:{line}")
            return DeployMode(mode)
    for runner in runner_files:
        facts = scan_file(runner)
        name = facts.file_name
        engine = _engine_import(facts)
        if engine is not None:
            what, line = engine
            book.cite(
                "deploy_mode",
                f"{name} drives the model through the bundled runtime's engine ({what})",
                f"{name}:{line}",
            )
            return DeployMode.FRAMEWORK
        helpers = [m for m in facts.imports if m.startswith("kvskill.runtime")]
        how = f" (it imports only helpers from {helpers[0]})" if helpers else ""
        book.cite(
            "deploy_mode",
            f"{name} manages its own inference loop and KV tensors{how}",
            name,
        )
        return DeployMode.STANDALONE
    book.cite("deploy_mode", "no runner_*.py next to the model; framework is the default", "rule")
    return DeployMode.FRAMEWORK


def progress_files(model_dir: Path | None) -> list[tuple[Path, Path, str]]:
    """progress.md files that may name the deploy mode, nearest first: beside the model, in
    each folder above it up to the working directory (the agent's workspace), then in the
    working directory itself. (path, the folder it must stay inside, how to cite it)."""
    workspace = Path.cwd().resolve()
    folders: list[tuple[Path, str]] = []
    if model_dir is not None:
        model_dir = Path(model_dir).resolve()
        folders.append((model_dir, "progress.md beside the model"))
        if model_dir.is_relative_to(workspace):
            for parent in model_dir.parents:
                if not parent.is_relative_to(workspace):
                    break
                where = (
                    "the workspace" if parent == workspace else f"{parent.name}/ above the model"
                )
                folders.append((parent, f"progress.md in {where}"))
    if all(folder != workspace for folder, _ in folders):
        folders.append((workspace, "progress.md in the workspace"))
    found = []
    for folder, what in folders:
        path = folder / PROGRESS_FILE
        if path.is_file():
            found.append((path, folder, what))
    return found


def _engine_import(facts: ModuleFacts) -> tuple[str, int] | None:
    """The first import of the runtime's engine layer: a module or an engine class name."""
    for module, line in facts.imports.items():
        if module.startswith(ENGINE_MODULES):
            return module, line
    for dotted, line in facts.imported_names.items():
        module, _, imported = dotted.rpartition(".")
        if module.startswith("kvskill.runtime") and imported in ENGINE_NAMES:
            return dotted, line
    return None
