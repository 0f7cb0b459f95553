"""Load a converted model directory: its config, its modeling module and its weights.

Sizing and allocating the KV cache of the loaded model is ``kv_cache_setup``'s job.

A converted directory holds ``config.json``, the converted ``modeling_*.py`` (plus any
``configuration_*.py`` it imports relatively) and, usually, ``*.safetensors`` weights.
The modeling file is imported as a submodule of a synthetic package rooted at the
directory, so ``from .configuration_x import XConfig`` works without copying anything.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import logging
import re
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from kvskill.core.config_checks import check_config_values, estimate_num_params, format_bytes
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.core.inputs import read_json_object, resolve_inside
from kvskill.core.trust import no_bytecode_writes, require_trust
from kvskill.runtime.checkpoint_names import transformers_renamed_state
from kvskill.runtime.composite_weights import language_model_state
from kvskill.runtime.device import available_memory_bytes, select_device
from kvskill.runtime.executor_host import (
    executor_infer_config,
    framework_modules,
    is_executor_model_class,
)
from kvskill.runtime.mtp import mtp_tensor_pattern
from torch import nn

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    config: object  #: the transformers PretrainedConfig the model was built from
    model_dir: Path
    module: ModuleType  #: the imported modeling module
    weights_loaded: bool  #: False when the weights are random
    #: the checkpoint's MTP-layer tensors (``model.layers.<N+i>.*``, see ``runtime/mtp.py``),
    #: set aside from the main model's; empty when it has none
    mtp_state: dict[str, torch.Tensor] = field(default_factory=dict)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise BadInputError(
            f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}"
        ) from None


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    seed: int = 0,
    random_weights: bool = False,
    trust_remote_code: bool = False,
    read_weights: bool = True,
) -> LoadedModel:
    """Import the converted modeling code in ``model_dir`` and build its ``*ForCausalLM``.

    Args:
        random_weights: allow a directory without ``*.safetensors`` (weights drawn with
            ``seed``); refused unless the parameters fit in the device's free memory.
        trust_remote_code: required unless every Python file in ``model_dir`` is one
            ``kvskill apply`` wrote from the installed transformers' own code (see
            ``kvskill.core.trust``); checked before anything in the directory is imported.
        read_weights: False builds the model (seeded random weights) without reading the
            checkpoint, for a caller that reads only its slice of it (tensor parallelism).

    Raises:
        BadInputError: missing/malformed files, weights missing or mismatched, no memory.
        UnsupportedModelError: no causal-LM class, or no ``get_cache_info`` (not converted).
    """
    model_dir = resolve_inside(Path(model_dir), what="model directory")
    if not model_dir.is_dir():
        raise BadInputError(f"{model_dir} is not a directory")
    torch_dtype = resolve_dtype(dtype)
    device = select_device(device)
    raw_config = _read_config(model_dir)
    check_config_values(raw_config, where=str(model_dir / "config.json"))
    require_trust(model_dir, trust_remote_code)
    package = import_model_package(model_dir)
    auto_map = raw_config.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        raise BadInputError(f"{model_dir / 'config.json'}: auto_map must be a JSON object")
    with no_bytecode_writes():
        module = _import_modeling_module(model_dir, package, auto_map)
    config = _build_config(model_dir, raw_config, package, module, trust_remote_code)
    model_cls = _find_causal_lm_class(module, config, auto_map)
    if not callable(getattr(model_cls, "get_cache_info", None)):
        raise UnsupportedModelError(
            f"{model_cls.__name__} in {module.__file__} has no get_cache_info(); it is not a "
            "converted model. Convert it with `kvskill apply` first"
        )
    weight_files = sorted(model_dir.glob("*.safetensors"))
    if not weight_files and not random_weights:
        raise BadInputError(
            f"{model_dir} has no *.safetensors weights; pass --random-weights "
            "(random_weights=True) to run with randomly initialised weights"
        )
    config = _config_for_class(model_cls, config)
    _check_fits_in_memory(model_cls, config, torch_dtype, device)
    torch.manual_seed(seed)
    model = _build(model_cls, config, model_dir)
    mtp_state: dict[str, torch.Tensor] = {}
    if weight_files and read_weights:
        try:
            mtp_state = _load_safetensors(model, weight_files, mtp_tensor_pattern(config))
        except WeightsMismatchError as mismatch:
            del model  # the retry builds its own; do not hold two copies
            model = _load_with_transformers_conversions(model_cls, config, model_dir, mismatch)
            # as stored: the drafter names them if they needed those conversions too
            mtp_state = _matching_tensors(weight_files, mtp_tensor_pattern(config))
    model = model.to(device=device, dtype=torch_dtype).eval()
    return LoadedModel(
        model,
        config,
        model_dir,
        module,
        weights_loaded=bool(weight_files) and read_weights,
        mtp_state=mtp_state,
    )


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise BadInputError(f"{model_dir} has no config.json; is it a converted model directory?")
    return read_json_object(path, what="config", root=model_dir)


def generation_eos_token_id(model_dir: Path | None) -> int | list[int] | None:
    """``eos_token_id`` of the directory's ``generation_config.json``, else None.

    A checkpoint's generation config is what transformers' ``generate`` stops at, and it
    often names more end tokens than ``config.json`` (an instruct model's end-of-turn).
    """
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return None
    data = read_json_object(path, what="generation config", root=model_dir)
    value = data.get("eos_token_id")
    if value is None:
        return None
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise BadInputError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return value


def import_model_package(model_dir: Path) -> str:
    """Register ``model_dir`` as a fresh package; returns its import name.

    The name is derived from the path, and any previous import of the same directory is
    dropped first, so a regenerated modeling file is always re-read.
    """
    name = "kvskill_model_" + hashlib.sha1(str(model_dir).encode()).hexdigest()[:12]
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(model_dir)]
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(model_dir)]
    sys.modules[name] = package
    return name


def _import(package: str, module_name: str, model_dir: Path) -> ModuleType:
    path = model_dir.joinpath(*module_name.split(".")).with_suffix(".py")
    # a file written for the framework's executor imports its cache classes from there
    hosted = path.is_file() and "from executor." in path.read_text(encoding="utf-8")
    try:
        with framework_modules() if hosted else nullcontext():
            return importlib.import_module(f"{package}.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith(module_name):
            raise BadInputError(f"{model_dir} has no {module_name}.py") from exc
        raise BadInputError(f"cannot import {module_name}.py from {model_dir}: {exc}") from exc
    except Exception as exc:  # the file is user code: any failure is reported as input
        raise BadInputError(
            f"cannot import {module_name}.py from {model_dir}: {type(exc).__name__}: {exc}"
        ) from exc


def _import_modeling_module(model_dir: Path, package: str, auto_map: dict) -> ModuleType:
    target = auto_map.get("AutoModelForCausalLM")
    if isinstance(target, str) and "." in target:
        return _import(package, target.rsplit(".", 1)[0], model_dir)
    candidates = sorted(p.stem for p in model_dir.glob("modeling_*.py"))
    if len(candidates) != 1:
        found = ", ".join(candidates) or "none"
        raise BadInputError(
            f"{model_dir} must hold exactly one modeling_*.py (found: {found}); or name the "
            "class in config.json auto_map.AutoModelForCausalLM"
        )
    return _import(package, candidates[0], model_dir)


def _build_config(model_dir: Path, raw: dict, package: str, module: ModuleType, trust: bool):
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    auto_config = (raw.get("auto_map") or {}).get("AutoConfig")
    model_type = raw.get("model_type")
    if isinstance(auto_config, str) and "." in auto_config:
        if not trust:
            raise BadInputError(
                f"config.json of {model_dir} takes its config class from code in the directory "
                f"({auto_config}); pass --trust-remote-code to allow running it"
            )
        module_name, cls_name = auto_config.rsplit(".", 1)
        config_cls = getattr(_import(package, module_name, model_dir), cls_name, None)
    elif model_type in CONFIG_MAPPING:
        config_cls = CONFIG_MAPPING[model_type]
    else:
        # A converted remote-code model may define its config next to the model.
        config_cls = next(
            (
                obj
                for obj in vars(module).values()
                if isinstance(obj, type)
                and issubclass(obj, PretrainedConfig)
                and getattr(obj, "model_type", None) == model_type
            ),
            None,
        )
    if config_cls is None:
        raise UnsupportedModelError(
            f"no config class for model_type {model_type!r}: the installed transformers does "
            "not know it and config.json has no usable auto_map.AutoConfig"
        )
    try:
        return config_cls.from_pretrained(str(model_dir))
    except Exception as exc:
        raise BadInputError(
            f"cannot build {config_cls.__name__} from {model_dir}/config.json: {exc}"
        ) from exc


def _find_causal_lm_class(module: ModuleType, config, auto_map: dict) -> type[nn.Module]:
    names: list[str] = []
    target = auto_map.get("AutoModelForCausalLM")
    if isinstance(target, str):
        names.append(target.rsplit(".", 1)[-1])
    names += list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    found = [
        obj
        for name, obj in vars(module).items()
        if name.endswith("ForCausalLM")
        and isinstance(obj, type)
        and issubclass(obj, nn.Module)
        and obj.__module__ == module.__name__
    ]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"cannot pick the causal-LM class in {module.__file__}: found "
            f"{[c.__name__ for c in found] or 'no *ForCausalLM class'}; list it in "
            "config.json architectures"
        )
    return found[0]


def _config_for_class(model_cls: type[nn.Module], config):
    """The config ``model_cls`` is built from: the composite's text config when the class
    takes that one.

    emu3's causal LM (``Emu3ForCausalLM``) takes an ``Emu3TextConfig`` while the model type's
    config.json is the composite ``Emu3Config``; transformers' ``AutoModelForCausalLM`` makes
    the same substitution.
    """
    wanted = getattr(model_cls, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return config
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    return text if isinstance(text, wanted) else config


def _build(model_cls: type[nn.Module], config, model_dir: Path | None) -> nn.Module:
    """``model_cls(config)``, or for a class of the executor's contract ``model_cls(config,
    infer_config, None)``; a failure of the model's own code is bad input, on one line."""
    try:
        if is_executor_model_class(model_cls):
            infer_config = executor_infer_config(
                attn_tp_size=getattr(model_cls, "converted_attn_tp_size", 1)
            )
            return model_cls(config, infer_config, None)
        return model_cls(config)
    except Exception as exc:  # the modeling file is user code: any failure is reported as input
        where = f" from {model_dir / 'config.json'}" if model_dir is not None else ""
        message = " ".join(str(exc).split())[:300]
        raise BadInputError(
            f"cannot build {model_cls.__name__}{where}: {type(exc).__name__}: {message}"
        ) from exc


def _check_fits_in_memory(model_cls, config, dtype: torch.dtype, device: torch.device) -> None:
    free = available_memory_bytes(device)
    # Arithmetic first: a config orders of magnitude too large is refused before even the
    # meta build (whose module objects alone can exhaust host memory).
    to_dict = getattr(config, "to_dict", None)
    estimate = estimate_num_params(to_dict()) if callable(to_dict) else None
    # NOTE: 4x margin over the fp32 bytes, as the estimate is rough; the meta build is exact
    if free is not None and estimate is not None and estimate * 4 > 4 * free:
        raise BadInputError(
            f"the model needs about {format_bytes(estimate * 4)} for its parameters (estimated "
            f"from its config) but only {format_bytes(free)} is free on {device}; shrink the "
            "config (fewer layers, smaller hidden size) or use a larger device"
        )
    # Build on the meta device: counting parameters costs no memory.
    with torch.device("meta"):
        shell = _build(model_cls, config, None)
    num_bytes = (
        sum(p.numel() for p in shell.parameters()) * torch.empty((), dtype=dtype).element_size()
    )
    # NOTE: on the CPU the model is built in fp32 and then cast, so the peak is larger.
    peak = (
        num_bytes + sum(p.numel() * 4 for p in shell.parameters())
        if device.type == "cpu"
        else num_bytes
    )
    if free is not None and peak > free:
        raise BadInputError(
            f"the model needs about {peak / 2**30:.2f} GiB for its parameters but only "
            f"{free / 2**30:.2f} GiB is free on {device}; shrink the config (fewer layers, "
            "smaller hidden size) or use a larger device"
        )


class WeightsMismatchError(BadInputError):
    """The checkpoint's tensors do not fit the model built from config.json."""


def _load_with_transformers_conversions(
    model_cls: type[nn.Module], config, model_dir: Path, mismatch: WeightsMismatchError
) -> nn.Module:
    """The model loaded by transformers with its load-time weight conversions, else MISMATCH.

    transformers 5 stores MoE experts fused (``experts.gate_up_proj``) while checkpoints keep
    one tensor per expert (``experts.0.gate_proj.weight``); its loader merges them with
    converters that renaming alone cannot do (qwen3_moe, mixtral, deepseek_v3 checkpoints).
    """
    try:
        from transformers.conversion_mapping import (
            USER_REGISTERED_MAPPINGS,
            get_checkpoint_conversion_mapping,
        )
    except ImportError:  # transformers 4 has no load-time conversions: the mismatch stands
        raise mismatch from None
    model_type = getattr(config, "model_type", None)
    if not model_type or get_checkpoint_conversion_mapping(model_type) is None:
        raise mismatch
    # NOTE: transformers skips its conversions for modeling code that is not its own; a
    # converted file keeps every parameter name of the file it came from, so the model
    # type's mapping holds. Registering the type is transformers' way to opt custom code in.
    USER_REGISTERED_MAPPINGS.add(model_type)
    from transformers.utils import logging as hf_logging

    # Its "Loading weights" progress bar would land in the middle of `kvskill run` output.
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model, info = model_cls.from_pretrained(
            str(model_dir), config=config, dtype=torch.float32, output_loading_info=True
        )
    except Exception as exc:  # noqa: BLE001 - any failure leaves the original mismatch
        raise mismatch from exc
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    tied = _tied_parameter_names(model)
    missing = [k for k in info.get("missing_keys", ()) if k not in tied]
    # the MTP layers' tensors are no part of the main model (runtime/mtp.py reads them)
    mtp = mtp_tensor_pattern(config)
    unexpected = [k for k in info.get("unexpected_keys", ()) if not (mtp and mtp.match(k))]
    if missing or unexpected or info.get("mismatched_keys"):
        raise mismatch
    logger.info("weights: loaded through transformers' %s checkpoint conversions", model_type)
    return model


def load_checkpoint_tensors(model: nn.Module, model_dir: Path) -> None:
    """MODEL_DIR's ``*.safetensors`` into MODEL as ``load_model`` reads them (renamings of
    transformers and a composite checkpoint's language model included, no converters).

    Raises:
        WeightsMismatchError: tensors missing, unexpected or of another shape.
    """
    _load_safetensors(model, sorted(model_dir.glob("*.safetensors")))


def _load_safetensors(
    model: nn.Module, files: list[Path], set_aside: re.Pattern | None = None
) -> dict[str, torch.Tensor]:
    """Load FILES into MODEL; returns the tensors whose names match SET_ASIDE (the MTP
    layers': the config declares them, the main model has no place for them)."""
    from kvskill.core.safetensors_check import check_safetensors
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in files:
        check_safetensors(path)
        try:
            state.update(load_file(str(path)))
        except Exception as exc:
            raise BadInputError(f"cannot read weights {path}: {exc}") from exc
    own = model.state_dict().keys() if set_aside else ()
    aside = {
        k: state.pop(k)
        for k in [k for k in state if set_aside and set_aside.match(k) and k not in own]
    }
    tied = _tied_parameter_names(model)
    needed = set(model.state_dict()) - tied
    if not needed <= state.keys():
        # Saved under names transformers renames on load (qwen2_5_vl's hub layout).
        state = transformers_renamed_state(model, state, needed) or state
    if not needed <= state.keys():
        # A composite model's checkpoint (e.g. a vision-language model whose language model
        # was converted): take the language model's tensors under their causal-LM names.
        composite = language_model_state(state, needed)
        if composite is not None:
            state, ignored = composite
            logger.info(
                "weights: the language model of a composite checkpoint; ignored %s",
                ", ".join(ignored) or "nothing",
            )
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches raise even when not strict
        mismatched = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        first = mismatched[0] if mismatched else str(exc).splitlines()[0]
        raise WeightsMismatchError(
            f"weights do not match the model built from config.json "
            f"({len(mismatched) or 1} problem(s)); first: {first}"
        ) from exc
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise WeightsMismatchError(
            f"weights do not match the model: missing {missing[:5]}"
            f"{' …' if len(missing) > 5 else ''}, unexpected {result.unexpected_keys[:5]}"
            f"{' …' if len(result.unexpected_keys) > 5 else ''}"
        )
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    return aside


def _matching_tensors(files: list[Path], pattern: re.Pattern | None) -> dict[str, torch.Tensor]:
    """The tensors of FILES whose names match PATTERN, read one by one."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    if pattern is None:
        return found
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if pattern.match(key):
                    found[key] = handle.get_tensor(key)
    return found


def _tied_parameter_names(model: nn.Module) -> set[str]:
    """Parameters stored under another name (e.g. an lm_head tied to the embeddings)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        else:
            seen[id(param)] = name
    return tied
