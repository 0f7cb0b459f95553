"""Rebuild the original (unconverted) model that ``verify`` compares against.

For a model of the installed transformers, the reference is that package's own class. For a
model directory, the original modeling source recorded in ``kvskill_plan.json`` is written
next to the directory's other Python files and imported as a package, exactly as the
converted code is. The reference always runs eager attention.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from kvskill.analyzer.plan import Plan, SourceKind
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.record import ConversionRecord
from torch import nn

logger = logging.getLogger(__name__)

REFERENCE_ATTENTION = "eager"


def build_reference(
    plan: Plan,
    record: ConversionRecord,
    config: dict[str, Any],
    workdir: Path,
    converted_dir: Path,
) -> tuple[nn.Module, str | None]:
    """(reference model with random weights, a note for the report or None).

    ``converted_dir`` holds the model directory's other Python files (configuration_*.py),
    copied unchanged by ``apply``; the caller has checked that running them is trusted.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    # A model directory without modeling code of its own runs the installed transformers'
    # class, like a model type given by name.
    if plan.source.kind is SourceKind.TRANSFORMERS or record.package:
        return _transformers_reference(plan, workdir, record)
    return _directory_reference(plan, workdir, record, converted_dir), None


def transformers_class(plan: Plan, config: dict[str, Any], workdir: Path) -> tuple[Any, Any]:
    """(transformers' auto class, the config object) of a conversion of the installed
    transformers' code, for ``from_pretrained`` on real weights (which then runs the model
    type's checkpoint conversions)."""
    from transformers import AutoConfig

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    auto_config = AutoConfig.from_pretrained(str(workdir))
    auto_config._attn_implementation = REFERENCE_ATTENTION
    return _auto_class(plan), auto_config


def installed_differs_note(model: nn.Module, record: ConversionRecord) -> str | None:
    """A note when the installed modeling file is not the one ``apply`` converted."""
    installed = Path(importlib.import_module(type(model).__module__).__file__ or "")
    digest = hashlib.sha256(installed.read_bytes()).hexdigest() if installed.is_file() else ""
    if digest == record.original_sha256:
        return None
    return (
        f"the installed {installed.name} differs from the file converted by apply; the "
        "reference uses the installed one"
    )


def _auto_class(plan: Plan):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language model
    converted as a whole (its text model type has no causal-LM class: qwen2_5_vl)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if plan.source.vision_language_head:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _transformers_reference(
    plan: Plan, workdir: Path, record: ConversionRecord
) -> tuple[nn.Module, str | None]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(workdir))
    config._attn_implementation = REFERENCE_ATTENTION
    auto_cls = _auto_class(plan)
    _check_fits(auto_cls, config, plan.model_type)
    model = auto_cls.from_config(config, attn_implementation=REFERENCE_ATTENTION)
    return model, installed_differs_note(model, record)


def _check_fits(auto_cls, config, model_type: str | None) -> None:
    """Refuse a config whose two models (original and converted, fp32) exceed free memory.

    Counted on the meta device, so asking costs nothing; building them would instead end in
    the kernel's out-of-memory kill with no message.
    """
    import torch
    from kvskill.core.config_checks import estimate_num_params
    from kvskill.runtime.loader import available_memory_bytes

    free = available_memory_bytes(torch.device("cpu"))
    estimate = estimate_num_params(config.to_dict())
    if free is not None and estimate is not None and 2 * 4 * estimate > 4 * free:
        raise BadInputError(
            f"verify would build the original and the converted {model_type} with about "
            f"{estimate / 1e6:,.0f}M parameters each (estimated from the config) but "
            f"{free / 2**30:.1f} GiB is free; verify with the default shrink, or a smaller config"
        )
    try:
        with torch.device("meta"):
            shell = auto_cls.from_config(config, attn_implementation=REFERENCE_ATTENTION)
    except Exception:  # some model code cannot run on the meta device: build it for real
        return
    params = sum(p.numel() for p in shell.parameters())
    need = 2 * 4 * params
    if free is not None and need > free:
        raise BadInputError(
            f"verify would build the original and the converted {model_type} with "
            f"{params / 1e6:,.0f}M parameters each (~{need / 2**30:.1f} GiB in fp32) but "
            f"{free / 2**30:.1f} GiB is free; verify with the default shrink, or a smaller "
            "config"
        )


def _directory_reference(
    plan: Plan, workdir: Path, record: ConversionRecord, converted_dir: Path
) -> nn.Module:
    from kvskill.runtime.loader import import_model_package
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    name = record.modeling_file
    (workdir / name).write_text(record.original_source, encoding="utf-8")
    for path in converted_dir.glob("*.py"):
        if path.name != name:
            shutil.copy2(path, workdir / path.name)
    raw = json.loads((workdir / "config.json").read_text(encoding="utf-8"))
    package = import_model_package(workdir.resolve())
    module = importlib.import_module(f"{package}.{Path(name).stem}")
    auto_map = raw.get("auto_map") or {}
    config_cls = None
    target = auto_map.get("AutoConfig")
    if isinstance(target, str) and "." in target:
        module_name, cls_name = target.rsplit(".", 1)
        config_cls = getattr(importlib.import_module(f"{package}.{module_name}"), cls_name, None)
    elif raw.get("model_type") in CONFIG_MAPPING:
        config_cls = CONFIG_MAPPING[raw["model_type"]]
    else:
        config_cls = next(
            (
                obj
                for obj in vars(module).values()
                if isinstance(obj, type)
                and issubclass(obj, PretrainedConfig)
                and getattr(obj, "model_type", None) == raw.get("model_type")
            ),
            None,
        )
    if config_cls is None:
        raise UnsupportedModelError(
            f"cannot rebuild the reference: no config class for model_type {raw.get('model_type')!r}"
        )
    config = config_cls.from_pretrained(str(workdir))
    config._attn_implementation = REFERENCE_ATTENTION
    cls = getattr(module, plan.architecture, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise BadInputError(
            f"the original {name} has no class {plan.architecture}; cannot rebuild the reference"
        )
    return cls(config)
