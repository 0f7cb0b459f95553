"""MTP layers transformers does not build, written out from its own modules for ``verify``.

Qwen3-Next's checkpoints carry one MTP layer under ``mtp.*`` (see ``runtime/mtp.py``) that
transformers' ``Qwen3NextForCausalLM`` ignores and its ``MtpModel`` refuses (the config has
no ``num_mtp_layers``). ``Qwen3NextMtpReference`` is that layer as vLLM's
``qwen3_next_mtp.py`` runs it, made of transformers' Qwen3-Next modules: ``fc`` over
cat[``pre_fc_norm_embedding``(embed(token p+1)), ``pre_fc_norm_hidden``(hidden of p)], one
full-attention decoder layer at the token's position (causal), ``norm`` and the model's head.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

#: model types with an MTP reference here
MTP_REFERENCE_MODEL_TYPES = ("qwen3_next",)


class Qwen3NextMtpReference(nn.Module):
    """Qwen3-Next's MTP layer over REFERENCE (a transformers ``Qwen3NextForCausalLM``)."""

    def __init__(self, reference: nn.Module) -> None:
        super().__init__()
        config = reference.config.get_text_config()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        mtp_config = copy.deepcopy(config)
        mtp_config.layer_types = list(config.layer_types) + ["full_attention"]
        self.layer = type(reference.model.layers[-1])(mtp_config, config.num_hidden_layers)
        norm_cls = type(reference.model.norm)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.norm = norm_cls(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # held by reference, not as a submodule: its weights are the main model's
        object.__setattr__(self, "reference", reference)

    def checkpoint_state(self) -> dict[str, Tensor]:
        """This layer's tensors under the names Qwen3-Next's checkpoints use."""
        state = {}
        for key, value in self.state_dict().items():
            name = "layers.0." + key.removeprefix("layer.") if key.startswith("layer.") else key
            state[f"mtp.{name}"] = value
        return state

    @torch.no_grad()
    def logits(self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Logits ``[1, T, V]`` of the pairs (HIDDEN ``[1, T, H]`` of position p, token p+1
        of INPUT_IDS) at the rotary positions POSITION_IDS (p+1)."""
        model = self.reference.model
        embeds = model.embed_tokens(input_ids)
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)
        t = x.size(1)
        causal = torch.full((t, t), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        out = self.layer(
            x, model.rotary_emb(x, position_ids), causal[None, None], position_ids=position_ids
        )
        out = out[0] if isinstance(out, tuple) else out
        return self.reference.lm_head(self.norm(out))
