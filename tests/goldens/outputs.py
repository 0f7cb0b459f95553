"""What ``kvskill apply`` writes for one model type of the installed transformers, as text.

The golden files under ``tests/goldens/<transformers version>/`` freeze these outputs so a
refactor of the implementer cannot change a conversion unnoticed. Each model type gets:

    <type>.framework.diff      unified diff of the framework conversion of its modeling file
    <type>.contiguous.diff     the standalone mode-1 (contiguous, BSH) conversion
    <type>.runner.py           the standalone runner rendered for the paged mode

A refusal (exit 3) or bad input (exit 2) is recorded as a one-line ``<type>.<output>.refused``
file holding the message, so a refactor cannot silently turn a refusal into a conversion
either. Regenerate after an intended change with ``scripts/record_goldens.py`` and say why in
the commit.
"""

from __future__ import annotations

from pathlib import Path

import transformers
from kvskill.core.errors import KvskillError

GOLDEN_ROOT = Path(__file__).resolve().parent / transformers.__version__

#: model types frozen: the README's supported families, refusals that must stay refusals
#: (Legacy-only, Mamba mixers, encoders) and hybrids of other shapes
GOLDEN_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5",
    "kimi_linear",
    "deepseek_v3",
    "deepseek_v2",
    "olmo_hybrid",
    "gemma3_text",
    "gemma2",
    "jamba",
    "bert",
    "tiny_remote",
)
#: the transformers-4-style remote-code model of tests/implementer/remote_model.py
REMOTE = "tiny_remote"


def model_argument(model_type: str, scratch: Path) -> str:
    """What ``apply`` is given for MODEL_TYPE: the type itself, or the remote model's folder."""
    if model_type != REMOTE:
        return model_type
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "implementer"))
    from remote_model import write_remote_model

    return str(write_remote_model(scratch / REMOTE))


def _convert(model: str, **options):
    from kvskill.implementer.writer import ApplyOptions, convert_model

    return convert_model(model, ApplyOptions(**options))


def _diff(conversion) -> str:
    from kvskill.implementer.writer import modeling_diff

    return modeling_diff(conversion.modeling_file, conversion.original, conversion.converted)


def _refusal(exc: KvskillError) -> tuple[str, str]:
    return "refused", f"exit {int(exc.exit_code)}: {exc.message}"


def framework_output(model: str) -> tuple[str, str]:
    """("diff", text) of the framework conversion, or ("refused", message)."""
    try:
        return "diff", _diff(_convert(model))
    except KvskillError as exc:
        return _refusal(exc)


def standalone_outputs(model: str) -> dict[str, tuple[str, str]]:
    """The contiguous conversion's diff and the paged runner, or the refusal of each."""
    outputs: dict[str, tuple[str, str]] = {}
    try:
        contiguous = _convert(model, deploy_mode="standalone", kv_mode="contiguous")
        outputs["contiguous"] = ("diff", _diff(contiguous))
    except KvskillError as exc:
        outputs["contiguous"] = _refusal(exc)
    try:
        paged = _convert(model, deploy_mode="standalone")
        (runner,) = [text for name, text in paged.added.items() if name.startswith("runner_")]
        outputs["runner"] = ("py", runner)
    except KvskillError as exc:
        outputs["runner"] = _refusal(exc)
    return outputs


def golden_files(model_type: str, scratch: Path) -> dict[str, str]:
    """File name -> text of every golden of MODEL_TYPE (SCRATCH: a folder for model files)."""
    model = model_argument(model_type, scratch)
    outputs = {"framework": framework_output(model), **standalone_outputs(model)}
    files = {}
    for output, (kind, text) in outputs.items():
        files[f"{model_type}.{output}.{kind}"] = text if kind != "refused" else text + "\n"
    return files


def recorded_files(model_type: str) -> dict[str, str]:
    """The golden files recorded for MODEL_TYPE under this transformers version."""
    return {
        path.name: path.read_text(encoding="utf-8")
        for path in sorted(GOLDEN_ROOT.glob(f"{model_type}.*"))
        if path.name.split(".")[0] == model_type
    }
