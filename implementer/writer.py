"""``apply``: plan, convert (either deploy mode), and write the output directory atomically.

The codemods are pure ``str -> str``; this module owns all I/O. Everything is staged in a
temporary sibling of ``--out`` and moved into place in one rename, so a failure (or an
unsupported model) leaves nothing behind, and the input files are never touched.

Output directory:
    modeling_<x>.py      the converted modeling code
    config.json          the model's config (after overrides), with its architecture
    kvskill_plan.json    the Plan, plus the original modeling source so ``verify`` can rebuild
                         the reference model exactly
    *.py                 other Python files of a model directory (configuration_*.py, ...)
    *.safetensors[.index.json]   weights of a model directory, linked (or copied)
    runner_<model>.py    standalone mode only: the runner that owns the KV cache
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvskill.analyzer import Plan, analyze_model
from kvskill.analyzer.plan import SourceKind
from kvskill.core.errors import BadInputError, KvskillError
from kvskill.core.inputs import path_error, resolve_inside
from kvskill.core.trust import sign_written_code
from kvskill.implementer.convert import (
    ApplyOptions,
    Conversion,
    source_package,
)
from kvskill.implementer.executor_target import (
    CANN_RECIPES_TARGET,
    RUNTIME_TARGET,
    check_executor_target,
    to_executor_target,
)
from kvskill.implementer.preflight import convert_plan
from kvskill.implementer.record import (
    CONVERSION_FORMAT,
    PLAN_FILE,
    ConversionRecord,
    ConvertedDir,
    dump_json,
    plan_file_text,
)
from kvskill.implementer.reviewed_plan import plan_from_review

logger = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")

__all__ = [
    "PLAN_FILE",
    "ApplyOptions",
    "ApplyResult",
    "apply_model",
    "check_out_before_work",
    "convert_model",
    "write_conversion",
]


@dataclass(frozen=True, kw_only=True)
class ApplyResult:
    """What was (or, with --dry-run, would be) written."""

    plan: Plan
    out_dir: Path | None
    modeling_file: str
    #: file name -> "written" | "linked" | "copied"
    files: dict[str, str]
    #: unified diff of the modeling file (empty when the source was already converted)
    diff: str
    changed: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.plan.model_type,
            "architecture": self.plan.architecture,
            "out_dir": str(self.out_dir) if self.out_dir else None,
            "modeling_file": self.modeling_file,
            "files": self.files,
            "changed": self.changed,
            "attn_types": self.plan.attn_types,
            "fa_version": self.plan.fa_version,
        }


def convert_model(model: str, options: ApplyOptions) -> Conversion:
    """Plan MODEL and convert it for the Plan's deploy mode.

    The Plan is a fresh analysis, or with ``options.plan_file`` the reviewed plan (checked
    against a fresh analysis, see ``reviewed_plan.py``).
    """
    reviewed = None
    if options.plan_file is not None:
        planned = plan_from_review(model, options)
        plan, options, reviewed = planned.plan, planned.options, planned.reviewed
    else:
        plan = analyze_model(
            model,
            deploy_mode=options.deploy_mode,
            config_overrides=options.config_overrides or None,
            attn_tp_size=options.attn_tp_size,
            block_size=options.block_size,
            prompt_file=options.prompt_file,
        )
    if options.target == CANN_RECIPES_TARGET:
        check_executor_target(plan, options.kv_mode)
    conversion = convert_plan(plan, options)
    if options.target == CANN_RECIPES_TARGET:
        conversion = to_executor_target(conversion)
    return dataclasses.replace(conversion, reviewed=reviewed)


def modeling_diff(name: str, original: str, converted: str) -> str:
    """Unified diff of the modeling file NAME (empty when nothing changed)."""
    return "".join(
        difflib.unified_diff(
            original.splitlines(keepends=True),
            converted.splitlines(keepends=True),
            fromfile=f"a/{name}",
            tofile=f"b/{name}",
        )
    )


def config_json(plan: Plan, conversion: Conversion | None = None) -> dict[str, Any]:
    """The config.json written next to the converted code (with its architecture; for the
    executor target, ``auto_map`` names the class in the executor's contract)."""
    config = dict(plan.config)
    if not config.get("architectures"):
        config["architectures"] = [plan.architecture]
    config.setdefault("model_type", plan.model_type)
    if conversion is not None and conversion.executor_class is not None:
        stem = Path(conversion.modeling_file).stem
        auto_map = dict(config.get("auto_map") or {})
        auto_map["AutoModelForCausalLM"] = f"{stem}.{conversion.executor_class}"
        config["auto_map"] = auto_map
    return config


def _previous_conversion(plan: Plan) -> ConvertedDir | None:
    """The earlier conversion when MODEL is itself a converted directory.

    Re-applying to converted code changes nothing, and verify must still compare against
    the code the first conversion started from, so that record (and its source) carry over.
    """
    model_dir = _model_dir(plan)
    if model_dir is None or not (model_dir / PLAN_FILE).is_file():
        return None
    try:
        previous = ConvertedDir.read(model_dir)
    except KvskillError:
        return None  # not a record apply wrote: this conversion starts its own
    if previous.record.modeling_file != Path(plan.source.modeling_file).name:
        return None
    return previous


def plan_record(conversion: Conversion, options: ApplyOptions) -> tuple[Plan, ConversionRecord]:
    """The Plan and conversion record kvskill_plan.json holds."""
    plan, original = conversion.plan, conversion.original
    previous = _previous_conversion(plan) if conversion.converted == original else None
    if previous is not None:
        return dataclasses.replace(plan, source=previous.plan.source), previous.record
    record = ConversionRecord(
        format=CONVERSION_FORMAT,
        mode=plan.deploy_mode,
        fa_version=options.fa_version,
        modeling_file=conversion.modeling_file,
        package=source_package(plan),
        original_sha256=hashlib.sha256(original.encode("utf-8")).hexdigest(),
        original_source=original,
        standalone=conversion.standalone,
        reviewed_plan=conversion.reviewed,
        target=CANN_RECIPES_TARGET if conversion.executor_class else RUNTIME_TARGET,
    )
    return plan, record


def _python_files(files: dict[str, str]) -> dict[str, str]:
    return {name: text for name, text in files.items() if name.endswith(".py")}


def sign_conversion(
    record: ConversionRecord, plan: Plan, files: dict[str, str]
) -> ConversionRecord:
    """Record the Python files kvskill writes, so ``run``/``verify`` may import them without
    ``--trust-remote-code`` (``kvskill.core.trust``): only when they derive from the
    installed transformers' own modeling file, never from a model directory's code."""
    if source_package(plan) is None:
        return record
    written = sign_written_code(files)
    return record if written is None else dataclasses.replace(record, written_code=written)


def _model_dir(plan: Plan) -> Path | None:
    if plan.source.kind is SourceKind.TRANSFORMERS:
        return None
    return Path(plan.source.path).resolve()


def check_out_dir(out_dir: Path, plan: Plan, force: bool) -> None:
    """Every check of ``--out``: not a file, empty unless ``force``, not inside the model."""
    _check_out_dir_usable(out_dir, force)
    _check_not_inside_model(out_dir, plan)


def check_out_vs_model(out_dir: Path, model: str) -> None:
    """Refuse an ``--out`` that is MODEL, lies inside it or contains it (before any work).

    NOTE: with ``--force`` the output replaces ``--out`` whole; a parent of MODEL would take
    the model (and everything beside it) with it.
    """
    source = Path(model).expanduser()
    if not source.is_dir():
        return  # a model type of the installed transformers
    source, out = _resolved(source, "MODEL"), _resolved(out_dir, "--out")
    if out == source or source in out.parents:
        raise BadInputError(
            f"--out {out_dir} is the model directory (or inside it); apply never writes into "
            "its input, choose another directory"
        )
    if out in source.parents:
        raise BadInputError(
            f"--out {out_dir} contains the model directory {source}; apply replaces --out as a "
            "whole, choose a directory outside it"
        )


def _resolved(path: Path, what: str) -> Path:
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as exc:
        raise BadInputError(f"{what} {path} cannot be used: {exc}") from None


def _check_out_dir_usable(out_dir: Path, force: bool) -> None:
    """Refuse a file, or a non-empty directory without --force (before any work)."""
    out = _resolved(out_dir, "--out")
    problem = path_error(out)
    if problem:
        raise BadInputError(f"--out {out_dir} cannot be used: {problem}")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise BadInputError(f"--out {out_dir}: {parent} is a file, not a folder")
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out {out_dir} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadInputError(f"--out {out_dir} exists and is not empty; pass --force to replace it")


def _check_not_inside_model(out_dir: Path, plan: Plan) -> None:
    source = _model_dir(plan)
    if source is not None:
        check_out_vs_model(out_dir, str(source))


def apply_model(model: str, out_dir: Path | None, options: ApplyOptions) -> ApplyResult:
    """Convert MODEL and write it to ``out_dir`` (or only diff it with ``dry_run``).

    One writer for both deploy modes: a standalone conversion adds its runner to the same
    output set.

    Raises:
        BadInputError: bad MODEL, unreadable files, or an existing non-empty ``out_dir``
            without ``force``.
        UnsupportedModelError: the rewrite cannot handle this model; nothing is written.
    """
    if out_dir is None and not options.dry_run:
        raise BadInputError("--out DIR is required (or pass --dry-run to see the diff)")
    if out_dir is not None and not options.dry_run:
        check_out_before_work(out_dir, model, options.force)
    return write_conversion(convert_model(model, options), out_dir, options)


def check_out_before_work(out_dir: Path, model: str, force: bool) -> None:
    """Refuse an unusable ``--out`` (a file, non-empty without ``force``, MODEL itself,
    inside or around it) before anything is analysed or converted."""
    _check_out_dir_usable(out_dir, force)
    check_out_vs_model(out_dir, model)


def write_conversion(
    conversion: Conversion, out_dir: Path | None, options: ApplyOptions
) -> ApplyResult:
    """Write CONVERSION to ``out_dir`` (nothing with ``dry_run``): the modeling file, the
    files its deploy mode adds, config.json, kvskill_plan.json and the model's own files."""
    plan, record = plan_record(conversion, options)
    name = conversion.modeling_file
    record = sign_conversion(
        record, plan, {name: conversion.converted, **_python_files(conversion.added)}
    )
    texts = {
        name: conversion.converted,
        **conversion.added,
        "config.json": dump_json(config_json(plan, conversion)),
        PLAN_FILE: plan_file_text(plan, record),
    }
    output = OutputFiles.collect(plan, name, texts, copy_weights=options.copy_weights)
    if out_dir is not None and not options.dry_run:
        _check_not_inside_model(out_dir, plan)
    if not options.dry_run:
        assert out_dir is not None
        output.write(out_dir)
    return ApplyResult(
        plan=plan,
        out_dir=out_dir,
        modeling_file=name,
        files=output.report(),
        diff=modeling_diff(name, conversion.original, conversion.converted),
        changed=conversion.converted != conversion.original,
    )


@dataclass(frozen=True, kw_only=True)
class OutputFiles:
    """Everything an output directory receives: generated texts, then the model's own files."""

    #: file name -> text, in the order they are reported
    texts: dict[str, str]
    #: other Python files of a model directory, copied unchanged
    extras: dict[str, Path]
    weights: list[Path]
    copy_weights: bool

    @classmethod
    def collect(
        cls, plan: Plan, modeling_name: str, texts: dict[str, str], *, copy_weights: bool
    ) -> OutputFiles:
        model_dir = _model_dir(plan)
        return cls(
            texts=texts,
            extras={**_extra_files(model_dir, modeling_name), **_generation_config(model_dir)},
            weights=_weight_files(model_dir),
            copy_weights=copy_weights,
        )

    def report(self) -> dict[str, str]:
        """File name -> "written" | "linked" | "copied"."""
        files = {n: "written" for n in [*self.texts, *self.extras]}
        files.update({w.name: "copied" if self.copy_weights else "linked" for w in self.weights})
        return files

    def write(self, out_dir: Path) -> None:
        """Stage every file next to ``out_dir`` and move it into place in one rename."""
        _write_atomically(out_dir, self.texts, self.extras, self.weights, self.copy_weights)


def _extra_files(model_dir: Path | None, modeling_name: str) -> dict[str, Path]:
    """Python files of a model directory other than the modeling file (kept unchanged)."""
    if model_dir is None:
        return {}
    return {
        p.name: _inside_model(p, model_dir)
        for p in sorted(model_dir.glob("*.py"))
        if p.name != modeling_name and not p.name.startswith("runner_")
    }


def _inside_model(path: Path, model_dir: Path) -> Path:
    """``path`` after checking that it (through its symlinks) stays inside MODEL: apply never
    copies or links a file from elsewhere."""
    from kvskill.analyzer.inputs import model_root

    resolve_inside(path, what="file", root=model_root(model_dir))
    return path


def _generation_config(model_dir: Path | None) -> dict[str, Path]:
    """The checkpoint's ``generation_config.json`` (its end tokens), kept unchanged."""
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return {}
    return {path.name: _inside_model(path, model_dir)}


def _weight_files(model_dir: Path | None) -> list[Path]:
    if model_dir is None:
        return []
    found = {p for pattern in WEIGHT_PATTERNS for p in model_dir.glob(pattern)}
    return [_inside_model(p, model_dir) for p in sorted(found)]


def _write_atomically(
    out_dir: Path,
    texts: dict[str, str],
    extras: dict[str, Path],
    weights: list[Path],
    copy_weights: bool,
) -> None:
    out = out_dir.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_stages(out)
        stage = Path(tempfile.mkdtemp(prefix=_stage_prefix(out), dir=out.parent))
        os.chmod(stage, 0o755)  # mkdtemp creates 0700; the result is an ordinary directory
    except OSError as exc:
        raise BadInputError(f"cannot write --out {out_dir}: {exc.strerror or exc}") from None
    try:
        for name, text in texts.items():
            (stage / name).parent.mkdir(parents=True, exist_ok=True)  # the executor tree
            (stage / name).write_text(text, encoding="utf-8")
        for name, path in extras.items():
            shutil.copy2(path, stage / name)
        for path in weights:
            target = stage / path.name
            if copy_weights:
                shutil.copy2(path, target)
            else:
                # relative to the output folder (the stage is its sibling, so the link still
                # resolves after the rename): MODEL and --out can move together
                os.symlink(os.path.relpath(path.resolve(), out), target)
        _swap_in(stage, out)
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise BadInputError(f"cannot write --out {out_dir}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _stage_prefix(out: Path, kind: str = "stage") -> str:
    """``.<out>.kvskill-<kind>-<pid>-``: hidden, and names the process that owns it."""
    return f".{out.name}.kvskill-{kind}-{os.getpid()}-"


def clean_stale_stages(out: Path) -> list[Path]:
    """Remove the stage directories a killed ``apply`` left beside ``out`` (their process is
    gone); put back a previous output that a kill left moved aside. Returns what was removed.
    """
    removed = []
    for path in sorted(out.parent.glob(f".{out.name}.kvskill-*-*-*")):
        kind, _, rest = path.name[len(f".{out.name}.kvskill-") :].partition("-")
        pid = rest.partition("-")[0]
        if kind not in ("stage", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not out.exists():
            os.rename(path, out)  # killed between the two renames of _swap_in
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        logger.warning("removed %s, left by an interrupted kvskill apply", path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _swap_in(stage: Path, out: Path) -> None:
    """Move the staged directory to ``out`` (replacing an old one) with renames only."""
    if not out.exists():
        os.rename(stage, out)
        return
    old = Path(tempfile.mkdtemp(prefix=_stage_prefix(out, "old"), dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(stage, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
