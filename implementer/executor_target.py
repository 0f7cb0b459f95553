"""``apply --target cann-recipes``: a framework-mode conversion as the Ascend framework's
executor takes it (hicann/cann-recipes-infer at ``fbc225d``).

The converted modeling file is written twice. At the output's root it runs in kvskill's
runtime; under ``models/<name>/models/`` it differs only in its import lines (the
framework's cache classes, forward metadata and ``torch_npu`` instead of kvskill's) and one
more class at its end, the model in the executor's model-class contract. Beside it go its
configuration module, a YAML config derived from the Plan and the entry to add to
``executor/core/support_models.py``. Nothing here decides how the model is converted.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import libcst as cst
from kvskill.analyzer.plan import DeployMode, Plan
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.convert import Conversion, source_package
from kvskill.implementer.kv_mode import resolve_kv_mode
from kvskill.implementer.snippets import render
from kvskill.implementer.standalone.runner import takes_logits_to_keep

#: where kvskill's runtime is the default host
RUNTIME_TARGET = "runtime"
CANN_RECIPES_TARGET = "cann-recipes"
TARGETS = (RUNTIME_TARGET, CANN_RECIPES_TARGET)
#: the framework commit whose contract the output follows
FRAMEWORK_COMMIT = "fbc225d"

#: name a converted file imports from kvskill.runtime -> the framework module defining it
FRAMEWORK_MODULES: dict[str, str] = {
    "CacheEntry": "executor.core.kv_cache",
    "LayerCacheInfo": "executor.core.kv_cache",
    "ModelCacheInfo": "executor.core.kv_cache",
    "MambaCacheEntry": "executor.core.kv_cache",
    "get_forward_metadata": "executor.utils.forward_metadata",
}


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    node = cst.ensure_type(node, cst.Attribute)
    return f"{_dotted(node.value)}.{node.attr.value}"


class _FrameworkImports(cst.CSTTransformer):
    """``from kvskill.runtime import CacheEntry, ...`` -> the framework's modules;
    ``from kvskill.runtime.ops import torch_npu`` -> ``import torch_npu``. Names the framework
    does not define (the state kernels' helpers) keep their kvskill import."""

    def leave_ImportFrom(
        self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom
    ) -> cst.ImportFrom | cst.FlattenSentinel | cst.RemovalSentinel:
        if updated_node.relative or updated_node.module is None:
            return updated_node
        module = _dotted(updated_node.module)
        if module not in ("kvskill.runtime", "kvskill.runtime.ops") or isinstance(
            updated_node.names, cst.ImportStar
        ):
            return updated_node
        kept: list[cst.ImportAlias] = []
        moved: dict[str, list[str]] = {}
        plain: list[str] = []
        for alias in updated_node.names:
            name = _dotted(alias.name)
            if alias.asname is not None:
                kept.append(alias)
            elif module == "kvskill.runtime" and name in FRAMEWORK_MODULES:
                moved.setdefault(FRAMEWORK_MODULES[name], []).append(name)
            elif module == "kvskill.runtime.ops" and name == "torch_npu":
                plain.append(name)
            else:
                kept.append(alias)
        statements: list[cst.BaseSmallStatement] = [
            cst.parse_statement(f"import {name}\n").body[0] for name in plain
        ]
        statements += [
            cst.parse_statement(f"from {target} import {', '.join(names)}\n").body[0]
            for target, names in moved.items()
        ]
        if kept:
            names = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in kept]
            statements.append(updated_node.with_changes(names=names))
        if not statements:
            return cst.RemovalSentinel.REMOVE
        return cst.FlattenSentinel(statements)

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.FlattenSentinel:
        # one import per line, as the source had them
        if len(updated_node.body) <= 1:
            return updated_node
        return cst.FlattenSentinel(
            [
                updated_node.with_changes(
                    body=[statement.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]
                )
                if i == 0
                else cst.SimpleStatementLine(body=[statement])
                for i, statement in enumerate(updated_node.body)
            ]
        )


def framework_imports(source: str) -> str:
    """SOURCE with kvskill's runtime imports replaced by the framework's (see the module doc)."""
    return cst.parse_module(source).visit(_FrameworkImports()).code


def executor_model_name(plan: Plan) -> str:
    """The folder and registry name under the framework's ``models/``: the model type with
    ``_paged``, so it never lands on a model the framework ships under the type's own name
    (the framework has its own ``qwen3_moe``, ``gpt_oss``, ...)."""
    return f"{plan.model_type}_paged"


def executor_class_name(causal_lm: str) -> str:
    return f"{causal_lm}Executor"


def executor_files(
    plan: Plan, converted: str, *, configuration: tuple[str, str], keeps_logit_rows: bool
) -> dict[str, str]:
    """The files under ``models/<name>/`` the framework user commits, by relative path.

    Args:
        converted: the framework-mode modeling file kvskill's runtime runs.
        configuration: (module text, config class name) of the model's configuration module.
    """
    causal_lm = plan.architecture
    if not causal_lm:
        raise BadInputError(
            f"--target {CANN_RECIPES_TARGET}: the Plan names no causal-LM class to wrap"
        )
    name = executor_model_name(plan)
    executor_class = executor_class_name(causal_lm)
    modeling = framework_imports(converted)
    modeling = (
        modeling.rstrip("\n")
        + "\n"
        + render(
            "executor_model_class.py.j2",
            executor_class=executor_class,
            causal_lm=causal_lm,
            commit=FRAMEWORK_COMMIT,
            attn_tp_size=plan.attn_tp_size,
            keeps_logit_rows=keeps_logit_rows,
        )
    )
    config_text, config_class = configuration
    root = f"models/{name}"
    registration = (
        f'    "{name}": [\n'
        f'        ("models.{name}.models.modeling_{name}", "{executor_class}"),\n'
        f'        ("models.{name}.models.configuration_{name}", "{config_class}"),\n'
        "    ],\n"
    )
    return {
        f"{root}/models/modeling_{name}.py": modeling,
        f"{root}/models/configuration_{name}.py": config_text,
        f"{root}/config/{name}.yaml": render(
            "executor_config.yaml.j2",
            model_type=plan.model_type,
            model_name=name,
            commit=FRAMEWORK_COMMIT,
            dtype="bfloat16",  # the framework's default compute dtype
            input_len=4096,
            attn_tp_size=plan.attn_tp_size,
            block_size=plan.block_size,
        ),
        f"{root}/support_models_entry.txt": (
            f"# Add to _specs in executor/core/support_models.py ({FRAMEWORK_COMMIT}):\n"
            + registration
        ),
    }


def configuration_module(plan: Plan) -> tuple[str, str]:
    """(text, class name) of the configuration module the executor builds the config with:
    the model directory's own ``configuration_*.py``, else a re-export of the installed
    transformers' config class for the model type."""
    model_dir = Path(plan.source.modeling_file).parent
    # a modeling file of the installed transformers: its configuration is imported, not copied
    local = [] if source_package(plan) is not None else sorted(model_dir.glob("configuration_*.py"))
    for path in local:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"^class (\w+)\(", text, flags=re.MULTILINE):
            body = text[match.end() :].split("\nclass ", 1)[0]
            if re.search(rf"model_type\s*=\s*[\"']{re.escape(plan.model_type)}[\"']", body):
                return text, match.group(1)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[plan.model_type]
    except KeyError:
        raise BadInputError(
            f"--target {CANN_RECIPES_TARGET}: no configuration module for model type "
            f"{plan.model_type!r} (none in {model_dir}, none in transformers)"
        ) from None
    name = config_class.__name__
    text = (
        f'"""The {plan.model_type} configuration: transformers\' own {name}."""\n\n'
        f"from {config_class.__module__} import {name}\n\n"
        f'__all__ = ["{name}"]\n'
    )
    return text, name


def check_executor_target(plan: Plan, kv_mode: str) -> None:
    """Refuse, before converting, what the executor cannot host: standalone mode (it runs
    framework-mode files) and any cache but paged (its managers allocate blocks only)."""
    if plan.deploy_mode is not DeployMode.FRAMEWORK:
        raise BadInputError(
            f"--target {CANN_RECIPES_TARGET} writes framework mode; drop --mode standalone"
        )
    if plan.compressed_attention is not None:
        raise UnsupportedModelError(
            f"--target {CANN_RECIPES_TARGET}: compressed attention (DeepSeek-V4) is written for "
            "kvskill's runtime only; the executor runs its own models/deepseek_v4: use the "
            "default target"
        )
    resolved = resolve_kv_mode(plan, kv_mode)
    if resolved != "paged":
        raise BadInputError(
            f"--target {CANN_RECIPES_TARGET}: the executor serves paged caches only, and this "
            f"conversion is {resolved}; drop --kv-mode {kv_mode} or use the default target"
        )


def to_executor_target(conversion: Conversion) -> Conversion:
    """CONVERSION for the executor: its modeling file in the framework's form (written at the
    output's root, where kvskill's runtime hosts it, and under ``models/<name>/``) and the
    framework files beside it."""
    plan = conversion.plan
    files = executor_files(
        plan,
        conversion.converted,
        configuration=configuration_module(plan),
        keeps_logit_rows=takes_logits_to_keep(conversion.converted, plan.architecture),
    )
    name = executor_model_name(plan)
    modeling = files[f"models/{name}/models/modeling_{name}.py"]
    return dataclasses.replace(
        conversion,
        converted=modeling,
        added={**conversion.added, **files},
        executor_class=executor_class_name(plan.architecture),
    )
