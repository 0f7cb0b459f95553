"""Checkpoint tensor names that transformers renames when it loads a model.

transformers saves some models under their original (hub) names and renames them on load:
a ``Qwen2_5_VLForConditionalGeneration`` checkpoint holds ``model.layers.0...`` and
``visual.blocks.0...`` for the module's ``model.language_model.layers.0...`` and
``model.visual.blocks.0...``. The runtime loads ``*.safetensors`` itself, so it applies the
same renamings, taken from transformers' own conversion mapping for the model.
"""

from __future__ import annotations

import logging

from torch import Tensor, nn

logger = logging.getLogger(__name__)


def transformers_renamed_state(
    model: nn.Module, state: dict[str, Tensor], needed: set[str]
) -> dict[str, Tensor] | None:
    """STATE under the names transformers' load-time renamings give them, or None when
    there are none or they do not provide every tensor in NEEDED.

    Only renamings apply; converters that fuse or split tensors (MoE experts) are not run,
    and a checkpoint that needs them is reported as mismatched by the caller.
    """
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        # NOTE: looked up by class name, then model_type, for the model as a whole.
        # transformers' own loader skips models whose code is not its own (a converted file
        # is custom code to it), but the conversion keeps every parameter name of the file
        # it started from, so that file's mapping holds.
        transforms = extract_weight_conversions_for_model(model) or []
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    except Exception as exc:  # noqa: BLE001 - an older transformers or a model it cannot map
        logger.debug("no transformers conversion mapping: %s", exc)
        return None
    if not renamings:
        return None
    renamed = {rename_source_key(key, renamings, [])[0]: tensor for key, tensor in state.items()}
    return renamed if needed <= renamed.keys() else None
