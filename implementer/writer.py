"""``apply`` in framework mode: analyze, convert, and write the output directory atomically.

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
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvskill.analyzer import Plan, analyze_model
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.core.inputs import path_error, resolve_inside
from kvskill.core.inputs import read_source as checked_read_source
from kvskill.core.trust import sign_written_code
from kvskill.implementer.mla import MlaSpec, convert_mla_source
from kvskill.implementer.pipeline import convert_source
from kvskill.implementer.spec import ConversionSpec

logger = logging.getLogger(__name__)

PLAN_FILE = "kvskill_plan.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
#: bumped when the layout of kvskill_plan.json's "conversion" block changes
CONVERSION_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class ApplyOptions:
    """What ``kvskill apply`` was asked to do."""

    deploy_mode: str = "framework"
    fa_version: str = "auto"
    attn_tp_size: int = 1
    block_size: int | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    force: bool = False
    copy_weights: bool = False
    #: "auto" | "on" | "off"; MLA is converted absorbed only, so "off" is refused for it
    mla_absorb: str = "auto"


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


def source_package(plan: Plan) -> str | None:
    """Dotted package of a modeling file inside the installed transformers, else None.

    A model directory without its own modeling code (config and weights only) is converted
    from the installed transformers' file too, so its relative imports become absolute.
    """
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).resolve().parent.parent
    path = Path(plan.source["modeling_file"]).resolve()
    try:
        parts = path.relative_to(root).with_suffix("").parts
    except ValueError:
        return None
    return ".".join(parts[:-1])


def read_source(path: Path) -> str:
    """The text of a modeling file; an unreadable file is bad input."""
    return checked_read_source(path)


def convert_model(model: str, options: ApplyOptions) -> tuple[Plan, str, str]:
    """Analyze MODEL and convert its modeling file: (plan, original source, converted)."""
    assert options.deploy_mode == "framework", "standalone conversions go through apply_standalone"
    plan = analyze_model(
        model,
        deploy_mode="framework",
        config_overrides=options.config_overrides or None,
        attn_tp_size=options.attn_tp_size,
        block_size=options.block_size,
    )
    # MLA: latent caches and absorbed attention (kvskill.implementer.mla)
    mla = plan.attention == "mla"
    _check_mla_absorb(plan, options.mla_absorb)
    spec = (MlaSpec if mla else ConversionSpec).from_plan(
        plan, fa_version=options.fa_version, block_size=options.block_size
    )
    modeling_file = Path(plan.source["modeling_file"])
    original = read_source(modeling_file)
    converted = (convert_mla_source if mla else convert_source)(
        original, spec, package=source_package(plan), filename=modeling_file.name
    )
    return plan, original, converted


def _check_mla_absorb(plan: Plan, choice: str) -> None:
    """``--mla-absorb on`` needs an MLA model; ``off`` is refused for one (absorbed only)."""
    mla = plan.attention == "mla"
    if choice == "on" and not mla:
        raise BadInputError(
            f"--mla-absorb on: {plan.model_type} has {plan.attention} attention, not MLA; "
            "use --mla-absorb auto or off"
        )
    if choice == "off" and mla:
        raise UnsupportedModelError(
            f"{plan.model_type}: cannot convert: --mla-absorb off: the MLA conversion caches "
            "only the latent (nope + rope caches) and attends absorbed; un-absorbed MLA is not "
            "generated, use --mla-absorb auto or on"
        )


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


def config_json(plan: Plan) -> dict[str, Any]:
    """The config.json written next to the converted code (with its architecture)."""
    config = dict(plan.config)
    if not config.get("architectures"):
        config["architectures"] = [plan.architecture]
    config.setdefault("model_type", plan.model_type)
    return config


def _previous_record(plan: Plan, original: str) -> dict[str, Any] | None:
    """The record of an earlier conversion when MODEL is itself a converted directory.

    Re-applying to converted code changes nothing, and verify must still compare against
    the code the first conversion started from, so that record (and its source) carry over.
    """
    model_dir = _model_dir(plan)
    path = model_dir / PLAN_FILE if model_dir else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    conversion = data.get("conversion") if isinstance(data, dict) else None
    if not isinstance(conversion, dict) or "original_source" not in conversion:
        return None
    if conversion.get("modeling_file") != Path(plan.source["modeling_file"]).name:
        return None
    return data


def plan_json(plan: Plan, original: str, converted: str, options: ApplyOptions) -> dict[str, Any]:
    """kvskill_plan.json: the Plan plus the conversion record (a framework-mode record)."""
    data = plan.to_dict()
    previous = _previous_record(plan, original) if converted == original else None
    if previous is not None:
        data["source"] = previous["source"]
        data["conversion"] = previous["conversion"]
        return data
    data["conversion"] = {
        "format": CONVERSION_FORMAT,
        "mode": "framework",
        "fa_version": options.fa_version,
        "modeling_file": Path(plan.source["modeling_file"]).name,
        "package": source_package(plan),
        "original_sha256": hashlib.sha256(original.encode("utf-8")).hexdigest(),
        "original_source": original,
    }
    return data


def sign_conversion(data: dict[str, Any], plan: Plan, files: dict[str, str]) -> dict[str, Any]:
    """Record the Python files kvskill writes, so ``run``/``verify`` may import them without
    ``--trust-remote-code`` (``kvskill.core.trust``): only when they derive from the
    installed transformers' own modeling file, never from a model directory's code."""
    if source_package(plan) is not None:
        written = sign_written_code(files)
        if written is not None:
            data["conversion"]["written_code"] = written
    return data


def dump_json(data: Any) -> str:
    """The JSON text of a written file."""
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"


def _model_dir(plan: Plan) -> Path | None:
    if plan.source.get("kind") == "transformers":
        return None
    return Path(plan.source["path"]).resolve()


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

    Raises:
        BadInputError: bad MODEL, unreadable files, or an existing non-empty ``out_dir``
            without ``force``.
        UnsupportedModelError: the rewrite cannot handle this model; nothing is written.
    """
    if out_dir is None and not options.dry_run:
        raise BadInputError("--out DIR is required (or pass --dry-run to see the diff)")
    if out_dir is not None and not options.dry_run:
        _check_out_dir_usable(out_dir, options.force)
        check_out_vs_model(out_dir, model)
    plan, original, converted = convert_model(model, options)
    name = Path(plan.source["modeling_file"]).name
    record = sign_conversion(plan_json(plan, original, converted, options), plan, {name: converted})
    texts = {
        name: converted,
        "config.json": dump_json(config_json(plan)),
        PLAN_FILE: dump_json(record),
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
        diff=modeling_diff(name, original, converted),
        changed=converted != original,
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
            (stage / name).write_text(text, encoding="utf-8")
        for name, path in extras.items():
            shutil.copy2(path, stage / name)
        for path in weights:
            target = stage / path.name
            if copy_weights:
                shutil.copy2(path, target)
            else:
                os.symlink(path.resolve(), target)
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
