"""Which source a Plan is made from: a composite model's language model or the text decoder
its own file defines, and the refusals of what is no causal decoder."""

from __future__ import annotations

from dataclasses import replace

from kvskill.analyzer.inputs import (
    ModelSource,
    build_config,
    causal_lm_model_types,
    image_text_to_text_class_name,
    transformers_modeling_file,
)
from kvskill.core.errors import UnsupportedModelError


def _is_wrapper_without_causal_lm(source: ModelSource) -> bool:
    return (
        source.kind != "remote_code"
        and source.model_type not in causal_lm_model_types()
        and not source.config.get("is_encoder_decoder")
    )


def _is_converted_wrapper(source: ModelSource) -> bool:
    """A directory kvskill wrote for such a wrapper: its own copy of the transformers type's
    file (no auto_map), read as local code; re-applying it finds the same head."""
    return (
        source.kind == "remote_code"
        and "auto_map" not in source.config
        and source.model_type not in causal_lm_model_types()
        and transformers_modeling_file(source.model_type) is not None
        and not source.config.get("is_encoder_decoder")
    )


def text_model_type(source: ModelSource) -> str | None:
    text = source.config.get("text_config")
    text_type = text.get("model_type") if isinstance(text, dict) else None
    return text_type if isinstance(text_type, str) else None


def _with_own_text_decoder(source: ModelSource) -> ModelSource:
    """A vision-language model whose text decoder is defined in its own modeling file
    (qwen2_5_vl, qwen3_vl, glm4v, ...): its text model type has no causal-LM class, so the
    whole ``*ForConditionalGeneration`` is converted. Unchanged when the type has none."""
    head = image_text_to_text_class_name(source.model_type)
    if head is None or text_model_type(source) in (None, source.model_type):
        return source
    return replace(source, vision_language_head=head)


def _no_causal_lm_reason(source: ModelSource) -> str:
    """Why a model type without a causal-LM class is refused, naming its text model if any."""
    text_type = text_model_type(source)
    if isinstance(text_type, str) and text_type != source.model_type:
        return (
            f"'{source.model_type}' is a composite model whose language model "
            f"('{text_type}') has no causal-LM class in the installed transformers; kvskill "
            "converts language models that transformers builds as causal LMs"
        )
    return (
        f"'{source.model_type}' has no causal-LM class in the installed transformers "
        "(encoder-only or not a text decoder)"
    )


def language_model_source(source: ModelSource) -> ModelSource | None:
    """A composite model whose language model is built from ``text_config`` via AutoModel."""
    text = source.config.get("text_config")
    if not isinstance(text, dict):
        return None
    text_type = text.get("model_type")
    if not isinstance(text_type, str) or text_type == source.model_type:
        return None
    if text_type not in causal_lm_model_types():
        return None
    modeling = transformers_modeling_file(text_type)
    if modeling is None:
        return None
    # NOTE: --config-overrides of the language model's keys are in text_config already
    # (analyzer/composite_overrides.py)
    text = dict(text)
    if isinstance(source.config.get("tie_word_embeddings"), bool):
        # The composite model owns the lm_head and ties it (or not) to its language model's
        # embeddings by its own flag; the text config's flag is not the one it follows.
        text["tie_word_embeddings"] = source.config["tie_word_embeddings"]
    built = build_config(text_type, text, {})
    return replace(
        source,
        model_type=text_type,
        modeling_file=str(modeling),
        config=built.config,
        derived=built.derived,
        overridden=source.overridden,
        delegated_from=source.model_type,
    )


def refuse_non_causal(source: ModelSource) -> None:
    if source.config.get("is_encoder_decoder"):
        raise UnsupportedModelError(
            f"'{source.model_type}' is an encoder-decoder model (cross-attention); kvskill "
            "serves causal decoders only"
        )
    if (
        source.kind != "remote_code"
        and source.model_type not in causal_lm_model_types()
        and source.vision_language_head is None
    ):
        raise UnsupportedModelError(_no_causal_lm_reason(source))
    if source.modeling_file is None:
        raise UnsupportedModelError(
            f"no modeling file for '{source.model_type}' in the installed transformers"
        )


def refuse_encoder(source: ModelSource, facts) -> None:
    """Models whose attention is causal only when a config flag says so (BERT, XLM)."""
    for key in ("is_decoder", "causal"):
        line = facts.config_reads.get(key)
        if line is not None and key in source.config and not source.config.get(key):
            raise UnsupportedModelError(
                f"'{source.model_type}' attends bidirectionally unless {key}=true "
                f"({facts.where(line)} reads config.{key}, which is false): an encoder is not "
                f"served; pass --config-overrides {key}=true for its decoder variant"
            )


def wrapped_language_model(source: ModelSource) -> ModelSource | None:
    """A vision-language (or other composite) model that transformers does not map to a
    causal LM but whose language model is one: its KV cache is that model's, so that model's
    source is planned instead. None otherwise."""
    if not _is_wrapper_without_causal_lm(source):
        return None
    return language_model_source(source)


def own_text_decoder(source: ModelSource) -> ModelSource:
    """SOURCE, or a wrapper's source marked to convert the text decoder its own file defines."""
    wrapper = _is_wrapper_without_causal_lm(source) or _is_converted_wrapper(source)
    return _with_own_text_decoder(source) if wrapper else source
