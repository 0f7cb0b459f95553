"""The language model's weights inside the checkpoint of a composite model.

A vision-language model (llava, mistral3, internvl, ...) builds its language model from
``text_config``; ``kvskill apply`` converts that language model alone, but the directory's
``*.safetensors`` still name every tensor as the composite model does:

    model.language_model.layers.0.self_attn.q_proj.weight   (transformers >= 4.52)
    language_model.model.layers.0.self_attn.q_proj.weight   (older checkpoints)
    model.vision_tower....  model.multi_modal_projector....  (not the language model's)

``language_model_state`` renames the language model's tensors to the causal LM's own names
(``model.layers...``, ``lm_head...``) and sets the others aside.
"""

from __future__ import annotations

from torch import Tensor

#: (checkpoint prefix, causal-LM prefix), tried as whole sets: the first set under which
#: every tensor the model needs is found wins
_RENAMINGS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
    (("language_model.", "model."), ("lm_head.", "lm_head.")),
)


def language_model_state(
    state: dict[str, Tensor], needed: set[str]
) -> tuple[dict[str, Tensor], list[str]] | None:
    """(the renamed language-model tensors, the top-level parts set aside), or None.

    Args:
        state: every tensor of the checkpoint, by its name there.
        needed: names the causal LM must receive (tied copies excluded).

    Returns None when no renaming provides every needed tensor: the checkpoint is not a
    composite model's, and the caller reports the mismatch as it is.
    """
    for renaming in _RENAMINGS:
        renamed: dict[str, Tensor] = {}
        ignored: set[str] = set()
        for key, tensor in state.items():
            new_key = _rename(key, renaming)
            if new_key is None:
                ignored.add(_part(key))
            else:
                renamed[new_key] = tensor
        if needed <= renamed.keys():
            return renamed, sorted(ignored)
    return None


def _rename(key: str, renaming: tuple[tuple[str, str], ...]) -> str | None:
    for old, new in renaming:
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def _part(key: str) -> str:
    """``model.vision_tower`` for ``model.vision_tower.blocks.0.weight``."""
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "model" and len(parts) > 2 else parts[0]
