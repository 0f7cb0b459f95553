"""Deployment mode: explicit flag > a self-managing ``runner_*.py`` (standalone) > framework."""

from __future__ import annotations

from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.plan import DeployMode
from kvskill.analyzer.scan import ModuleFacts, scan_file

#: what a runner imports when the bundled runtime schedules requests and owns the KV cache;
#: helpers alone (ForwardMetaData, forward_context, masks, load_model) leave both to the runner
ENGINE_MODULES = ("kvskill.runtime.llm", "kvskill.runtime.engine", "kvskill.runtime.scheduler")
ENGINE_NAMES = ("LLM", "LLMEngine", "Scheduler", "KVCacheManager", "prepare_kv_cache")


def decide_deploy_mode(requested: str, runner_files: tuple[str, ...], book: Notebook) -> DeployMode:
    """Explicit flag > a self-managing runner_*.py (standalone) > framework."""
    if requested in ("framework", "standalone"):
        book.cite("deploy_mode", f"set explicitly to {requested}", "flag --mode")
        return DeployMode(requested)
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
