"""Run the rules over files and folders: one result per file, keep going past failures."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import libcst as cst
from kvskill.analyzer.lint.context import FileContext, sibling_config
from kvskill.analyzer.lint.model import FileError, Finding, LintReport
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules import RULES
from kvskill.core.errors import BadInputError
from kvskill.core.inputs import read_source

_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "build", "dist"}
#: files and folders a folder walk visits before it stops: a model folder holds a few dozen;
#: a walk of a home directory or a filesystem root is a mistake, not a lint run
MAX_WALK_ENTRIES = 20_000


def select_rules(disable: Iterable[str] = ()) -> list[Rule]:
    """The rules to run, minus those disabled by id (``KV001``) or name.

    Raises:
        BadInputError: an unknown rule id or name.
    """
    known = {r.id.upper(): r for r in RULES} | {r.name: r for r in RULES}
    off = set()
    for item in disable:
        for token in (t.strip() for t in item.split(",")):
            if not token:
                continue
            rule = known.get(token.upper()) or known.get(token)
            if rule is None:
                ids = ", ".join(r.id for r in RULES)
                raise BadInputError(f"--disable {token}: no such rule; known rules: {ids}")
            off.add(rule)
    return [rule() for rule in RULES if rule not in off]


def lint_source(
    source: str,
    path: str = "<string>",
    *,
    rules: Sequence[Rule] | None = None,
    config: dict | None = None,
) -> list[Finding]:
    """Findings for one source text, sorted by line. Raises libcst's ParserSyntaxError."""
    ctx = FileContext(source, path, config)
    return _run(ctx, rules if rules is not None else select_rules())


def _run(ctx: FileContext, rules: Sequence[Rule]) -> list[Finding]:
    findings = {f for rule in rules for f in rule.check(ctx)}
    return sorted(findings, key=lambda f: (f.line, f.column, f.rule))


def python_files(paths: Iterable[Path], *, max_entries: int = MAX_WALK_ENTRIES) -> list[Path]:
    """The files to lint: every path given, and every ``*.py`` under a folder given
    (hidden folders and caches skipped, symlinked folders not followed), in a stable order
    without duplicates.

    Raises:
        BadInputError: a folder with no Python file in it, or a walk past ``max_entries``
            files and folders (lint a smaller folder, e.g. the model's own).
    """
    out: list[Path] = []
    seen = 0
    for path in paths:
        if not path.is_dir():
            out.append(path)
            continue
        found: list[Path] = []
        for folder, dirs, files in os.walk(path):
            seen += len(dirs) + len(files)
            if seen > max_entries:
                raise BadInputError(
                    f"{path}: more than {max_entries} files and folders to walk; lint the "
                    "model's own folder or files"
                )
            # pruned in place, so os.walk never descends into them
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
            found.extend(Path(folder) / f for f in files if f.endswith(".py"))
        if not found:
            raise BadInputError(f"{path}: no Python files in this folder")
        out.extend(sorted(found))
    return list(dict.fromkeys(out))


def lint_paths(paths: Iterable[Path], *, disable: Iterable[str] = ()) -> LintReport:
    """Lint files and folders. An unreadable or unparsable file becomes a ``FileError``
    and the run goes on with the others."""
    rules = select_rules(disable)
    report = LintReport()
    for path in python_files(paths):
        report.files += 1
        try:
            source = read_source(path, what="file")
        except BadInputError as exc:
            report.errors.append(FileError(path=str(path), line=0, message=f"cannot read: {exc}"))
            continue
        try:
            ctx = FileContext(source, str(path), sibling_config(path))
        except cst.ParserSyntaxError as exc:
            report.errors.append(_syntax_error(path, source, exc))
            continue
        except RecursionError:
            report.errors.append(
                FileError(path=str(path), line=0, message="cannot parse: nested too deeply")
            )
            continue
        findings, crashes = _run_guarded(ctx, rules)
        report.findings.extend(findings)
        report.errors.extend(crashes)
    return report


def _run_guarded(ctx: FileContext, rules: Sequence[Rule]) -> tuple[list[Finding], list[FileError]]:
    """Run each rule on its own, so a rule that trips over unusual code costs that file
    that rule only, reported as an error, never the whole run."""
    findings: set[Finding] = set()
    crashes: list[FileError] = []
    for rule in rules:
        try:
            findings.update(rule.check(ctx))
        except Exception as exc:  # a bug in the rule: report it, keep checking
            crashes.append(
                FileError(
                    path=ctx.path,
                    line=0,
                    message=f"rule {rule.id} failed on this file ({type(exc).__name__}: "
                    f"{exc}); this is a bug in kvskill, please report it",
                )
            )
    ordered = sorted(findings, key=lambda f: (f.line, f.column, f.rule))
    return ordered, crashes


def _syntax_error(path: Path, source: str, exc: cst.ParserSyntaxError) -> FileError:
    """Python's own message and line when it has one (libcst's native parser points at
    where it gave up, often a line late), else libcst's."""
    try:
        ast.parse(source, filename=str(path))
    except SyntaxError as py_exc:
        return FileError(
            path=str(path), line=py_exc.lineno or 0, message=f"cannot parse: {py_exc.msg}"
        )
    except (ValueError, RecursionError):
        pass
    return FileError(path=str(path), line=exc.raw_line, message=f"cannot parse: {exc.message}")
