"""Deployment mode: explicit flag > a self-managing ``runner_*.py`` (standalone) > framework."""

from __future__ import annotations

from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.scan import scan_file


def decide_deploy_mode(requested: str, runner_files: tuple[str, ...], book: Notebook) -> str:
    """Explicit flag > a self-managing runner_*.py (standalone) > framework."""
    if requested in ("framework", "standalone"):
        book.cite("deploy_mode", f"set explicitly to {requested}", "flag --mode")
        return requested
    for runner in runner_files:
        facts = scan_file(runner)
        framework_imports = [m for m in facts.imports if m.startswith("kvskill.runtime")]
        name = facts.file_name
        if framework_imports:
            line = facts.imports[framework_imports[0]]
            book.cite(
                "deploy_mode",
                f"{name} drives the model through the bundled runtime ({framework_imports[0]})",
                f"{name}:{line}",
            )
            return "framework"
        book.cite(
            "deploy_mode",
            f"{name} manages its own inference loop and KV tensors (no framework import)",
            name,
        )
        return "standalone"
    book.cite("deploy_mode", "no runner_*.py next to the model; framework is the default", "rule")
    return "framework"
