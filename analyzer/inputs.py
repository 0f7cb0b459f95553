"""Resolve MODEL (a directory or a transformers model type) to its config and modeling file.

Nothing here imports or executes code from a model directory: config.json is read as JSON,
and only the installed transformers' own configuration classes are instantiated (to apply
their defaults and derived keys such as ``layer_types``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from kvskill.analyzer.composite_overrides import (
    class_levels,
    merge_overrides,
    raw_levels,
    route_overrides,
)
from kvskill.analyzer.override_keys import (
    canonical_dtype_key,
    check_override_keys,
    init_parameters,
    mentioned_in,
)
from kvskill.core.config_checks import check_config_values
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.core.inputs import path_error, read_config_json, resolve_inside


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where the model's config and code come from, and the config after overrides."""

    #: "transformers" | "directory" | "remote_code"
    kind: str
    #: the MODEL argument resolved: a directory path or the model type
    path: str
    model_type: str
    #: absolute path of the modeling file that will be scanned, or None if there is none
    modeling_file: str | None
    config_file: str | None
    #: full config dict after overrides
    config: dict[str, Any]
    #: the keys the user overrode, as paths into CONFIG (for evidence): "sliding_window", or
    #: "text_config.num_hidden_layers" for a composite config's language model
    overridden: tuple[str, ...] = ()
    #: runner_*.py files shipped next to the model (standalone deployment)
    runner_files: tuple[str, ...] = ()
    #: other python files in the directory (for already-converted detection)
    extra_files: tuple[str, ...] = field(default_factory=tuple)
    #: values the config class computes but ``to_dict`` omits (e.g. ``layer_types`` as a
    #: property); read by the analyzer only, never written back to config.json
    derived: dict[str, Any] = field(default_factory=dict)
    #: the composite model type whose ``text_config`` language model this is, if any
    delegated_from: str | None = None
    #: the vision-language class that holds the text decoder in its own modeling file
    #: (qwen2_5_vl), when the model type has no causal-LM class
    vision_language_head: str | None = None
    #: the installed transformers modeling file whose attention classes the remote file
    #: subclasses or builds (``analyzer/inherited.py``); that file is planned and converted
    inherits_code: str | None = None

    def as_plan_source(self) -> dict[str, Any]:
        source = {
            "kind": self.kind,
            "path": self.path,
            "modeling_file": self.modeling_file,
            "config_file": self.config_file,
        }
        if self.delegated_from:
            source["language_model_of"] = self.delegated_from
        if self.vision_language_head:
            source["vision_language_head"] = self.vision_language_head
        if self.inherits_code:
            source["inherits_code"] = self.inherits_code
        return source


def transformers_root() -> Path:
    import transformers

    return Path(transformers.__file__).resolve().parent


@lru_cache(maxsize=1)
def known_model_types() -> frozenset[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


@lru_cache(maxsize=1)
def causal_lm_model_types() -> frozenset[str]:
    """Model types the installed transformers maps to a ``*ForCausalLM`` class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_class_name(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def image_text_to_text_class_name(model_type: str) -> str | None:
    """The ``*ForConditionalGeneration`` class of a vision-language type (qwen2_5_vl ->
    ``Qwen2_5_VLForConditionalGeneration``), or None when transformers maps it to none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def transformers_modeling_file(model_type: str) -> Path | None:
    """The installed transformers' ``models/<module>/modeling_<module>.py`` for a type."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    path = transformers_root() / "models" / module / f"modeling_{module}.py"
    if path.is_file():
        return path
    # Types that reuse another family's code (gpt-sw3 -> gpt2) or keep it under another
    # file name (data2vec-text): find the file that defines the causal-LM class.
    class_name = causal_lm_class_name(model_type)
    return _file_defining(class_name) if class_name else None


def _file_defining(class_name: str) -> Path | None:
    return _class_index().get(class_name)


@lru_cache(maxsize=1)
def _class_index() -> dict[str, Path]:
    """Top-level class name -> the installed transformers modeling file defining it."""
    index: dict[str, Path] = {}
    pattern = re.compile(r"^class (\w+)\b", re.MULTILINE)
    for candidate in sorted((transformers_root() / "models").glob("*/modeling_*.py")):
        try:
            text = candidate.read_text(encoding="utf-8")
        except OSError:
            continue
        for name in pattern.findall(text):
            index.setdefault(name, candidate)
    return index


def resolve_model(model: str, config_overrides: dict[str, Any] | None = None) -> ModelSource:
    """Resolve MODEL to a ModelSource. Raises BadInputError for unusable input."""
    overrides = dict(config_overrides or {})
    if not model or "\0" in model:
        raise BadInputError(f"MODEL {model!r} is not a usable path or model type")
    path = Path(model).expanduser()
    problem = path_error(path)
    if problem:
        raise BadInputError(f"MODEL {model}: {problem}")
    if path.is_symlink() and not path.exists():
        raise BadInputError(f"MODEL {model} is a broken symlink (or a symlink loop)")
    if path.is_dir():
        return _resolve_directory(path.resolve(), overrides)
    if path.exists():
        raise BadInputError(f"MODEL '{model}' is a file; give a model directory or a model type")
    if model in known_model_types():
        modeling = transformers_modeling_file(model)
        built = build_config(model, {}, overrides, code_files=(modeling,))
        return ModelSource(
            derived=built.derived,
            kind="transformers",
            path=model,
            model_type=model,
            modeling_file=str(modeling) if modeling else None,
            config_file=None,
            config=built.config,
            overridden=built.overridden,
        )
    raise BadInputError(
        f"MODEL '{model}' is neither a directory nor a model type of the installed "
        "transformers (examples: qwen3, llama, gpt_oss, deepseek_v3)"
    )


def _resolve_directory(path: Path, overrides: dict[str, Any]) -> ModelSource:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise BadInputError(f"model directory {path} has no config.json")
    raw = read_config_json(config_file, root=model_root(path))
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise BadInputError(f"{config_file} has no 'model_type' string")
    runners = tuple(sorted(str(p) for p in path.glob("runner_*.py")))
    extras = tuple(sorted(str(p) for p in path.glob("*.py")))
    local_modeling = _local_modeling_file(path, raw)
    if local_modeling is not None:
        kind = "remote_code"
        modeling: Path | None = local_modeling
    else:
        kind = "directory"
        if model_type not in known_model_types():
            raise BadInputError(
                f"{config_file}: model_type '{model_type}' is unknown to the installed "
                "transformers and the directory ships no modeling_*.py"
            )
        modeling = transformers_modeling_file(model_type)
    if model_type in known_model_types() and kind == "directory":
        built = build_config(model_type, raw, overrides, code_files=(modeling,))
    else:
        # Remote code: its configuration class is the directory's own code, never run.
        built = _remote_config(path, raw, overrides, where=f"the config in {config_file}")
        check_config_values(built.config, where=str(config_file))
    return ModelSource(
        kind=kind,
        path=str(path),
        model_type=model_type,
        modeling_file=str(modeling) if modeling else None,
        config_file=str(config_file),
        config=built.config,
        overridden=built.overridden,
        runner_files=runners,
        extra_files=extras,
        derived=built.derived,
    )


def _local_modeling_file(path: Path, raw: dict[str, Any]) -> Path | None:
    """The directory's own modeling file: the one auto_map names, else modeling_*.py."""
    auto_map = raw.get("auto_map") or {}
    ref = auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None
    if isinstance(ref, list):
        ref = ref[0] if ref else None
    if isinstance(ref, str) and "." in ref:
        module = ref.split("--")[-1].rsplit(".", 1)[0]
        parts = module.split(".")
        if not all(part.isidentifier() for part in parts):
            raise BadInputError(
                f"{path / 'config.json'}: auto_map.AutoModelForCausalLM {ref!r} does not name a "
                "module of the directory (dotted identifiers only)"
            )
        candidate = path.joinpath(*parts[:-1], f"{parts[-1]}.py")
        if candidate.is_file() or candidate.is_symlink():
            resolve_inside(candidate, what="modeling file", root=model_root(path))
            return candidate
    found = sorted(path.glob("modeling_*.py"))
    if not found:
        return None
    resolve_inside(found[0], what="modeling file", root=model_root(path))
    return found[0]


def model_root(path: Path) -> Path:
    """The folder MODEL's files must stay inside: MODEL itself, or for a snapshot of the
    Hugging Face cache (``models--org--name/snapshots/<rev>``, whose files are symlinks into
    ``../../blobs``) that model's cache folder."""
    path = Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent
    return path


class BuiltConfig(NamedTuple):
    """A config after overrides, what it derives, and where the overrides went."""

    #: the config dict (``to_dict()`` of its class for a transformers model type)
    config: dict[str, Any]
    #: values the config class computes but ``to_dict`` omits (``ModelSource.derived``)
    derived: dict[str, Any]
    #: the overridden keys as paths into CONFIG (``ModelSource.overridden``)
    overridden: tuple[str, ...]


def _class_default(config_class: type, base: dict[str, Any]) -> dict[str, Any] | None:
    """The config class's ``to_dict()`` for BASE without any override (None if invalid)."""
    try:
        kwargs = {key: value for key, value in base.items() if key != "model_type"}
        return config_class(**kwargs).to_dict()
    except Exception:  # noqa: BLE001 - an invalid base is reported once the overrides are merged
        return None


def _stored_override_keys(overrides: dict[str, Any], config: dict[str, Any]) -> tuple[str, ...]:
    """The override keys as the built config stores them (a dtype under its stored name)."""
    renamed, _ = canonical_dtype_key(overrides, {}, config)
    return tuple([key for key in renamed if key in config] or list(overrides))


def _remote_known_keys(path: Path, raw: dict[str, Any], overrides: dict[str, Any]) -> set[str]:
    """Keys an override of remote code may set: config.json's, every name its configuration
    and modeling files mention, and PretrainedConfig's own (looked up only when still
    missing)."""
    known = set(raw) | mentioned_in(sorted(path.glob("*.py")))
    if set(overrides) <= known:
        return known
    from transformers import PretrainedConfig

    return known | init_parameters(PretrainedConfig) | set(PretrainedConfig().to_dict())


def _remote_config(
    path: Path, raw: dict[str, Any], overrides: dict[str, Any], *, where: str
) -> BuiltConfig:
    """config.json of remote code with the overrides merged (its config class is not run)."""
    if not overrides:
        return BuiltConfig(config=dict(raw), derived={}, overridden=())
    levels = raw_levels(raw, mentioned_in(sorted(path.glob("*.py"))), where)
    if levels is not None:
        routed = route_overrides(raw, overrides, levels)
        return BuiltConfig(config=routed.config, derived={}, overridden=routed.paths)
    overrides, raw = canonical_dtype_key(overrides, raw, raw)
    check_override_keys(overrides, _remote_known_keys(path, raw, overrides), where)
    return BuiltConfig(
        config=merge_overrides(raw, overrides), derived={}, overridden=tuple(overrides)
    )


def _with_overrides(
    config_class: type,
    base: dict[str, Any],
    overrides: dict[str, Any],
    code_files: tuple[Path | None, ...],
    where: str,
) -> tuple[dict[str, Any], tuple[str, ...] | None]:
    """BASE with OVERRIDES merged, and their paths (None: the keys as the built config
    stores them). A composite config's overrides go to the level they belong to
    (``composite_overrides``)."""
    default = _class_default(config_class, base)
    code_words = mentioned_in(f for f in code_files if f is not None)
    levels = class_levels(config_class, base, default or {}, code_words, where)
    if levels is not None:
        routed = route_overrides(base, overrides, levels)
        return routed.config, routed.paths
    stored = set(default) if default is not None else set(base)
    overrides, base = canonical_dtype_key(overrides, base, stored)
    known = stored | set(base) | init_parameters(config_class) | code_words
    known |= set(getattr(config_class, "attribute_map", None) or {})
    check_override_keys(overrides, known, where)
    return merge_overrides(base, overrides), None


def build_config(
    model_type: str,
    base: dict[str, Any],
    overrides: dict[str, Any],
    code_files: tuple[Path | None, ...] = (),
) -> BuiltConfig:
    """Instantiate transformers' config class on BASE with OVERRIDES; return its
    ``to_dict()``, the values it derives and the overridden paths.

    An override must be a key the class stores, takes or maps, or a name the modeling code
    reads (CODE_FILES: ``getattr(config, "head_dim", ...)`` reads a key the class may not
    store)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    merged, paths = dict(base), ()
    if overrides:
        merged, paths = _with_overrides(
            config_class, base, overrides, code_files, f"the '{model_type}' config"
        )
    # before the config class sees them: it may derive per-layer lists from the layer count
    check_config_values(merged, where=f"config for '{model_type}'")
    merged.pop("model_type", None)
    try:
        config = config_class(**merged)
    except Exception as exc:  # noqa: BLE001 - config classes raise many validation types
        message = " ".join(str(exc).split())[:300]
        if not base and not overrides:
            raise UnsupportedModelError(
                f"the installed transformers cannot build a default '{model_type}' config: "
                f"{message}"
            ) from exc
        hint = _stale_pattern_hint(message, paths or tuple(overrides))
        raise BadInputError(f"config for '{model_type}' is not valid: {message}{hint}") from exc
    data = config.to_dict()
    data.setdefault("model_type", model_type)
    if paths is None:
        paths = _stored_override_keys(overrides, data)
    return BuiltConfig(config=data, derived=_derived_layer_pattern(config, data), overridden=paths)


def _stale_pattern_hint(message: str, paths: tuple[str, ...]) -> str:
    """How to fix a layer count overridden without the layer_types list the config gives."""
    if "layer_types" not in message or any(p.endswith("layer_types") for p in paths):
        return ""
    counts = [p for p in paths if p.rpartition(".")[2] in ("num_hidden_layers", "num_layers")]
    if not counts:
        return ""
    where = counts[0].rpartition(".")[0]
    key = f"{where}.layer_types" if where else "layer_types"
    return f" (the config lists its layer_types: override {key} too, one entry per layer)"


def _derived_layer_pattern(config: Any, data: dict[str, Any]) -> dict[str, Any]:
    """The per-layer pattern a config class derives as a property: ``layer_types``, or the
    ``layers_block_type`` of the older hybrids (bamba, granitemoehybrid, falcon_h1 in 4.x)."""
    for key in ("layer_types", "layers_block_type"):
        if isinstance(data.get(key), list) and data[key]:
            return {}
        try:
            layer_types = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a property may fail on partial configs
            layer_types = None
        if isinstance(layer_types, list) and layer_types:
            return {key: list(layer_types)}
    return {}
