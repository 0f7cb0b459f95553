"""The MTP drafter: the model's multi-token-prediction layers, built from its own converted
decoder layer class, with their caches in the model's paged pools.

One MTP layer maps the pair (final hidden state of position p, token p+1) to a guess of
token p+2: ``eh_proj(cat[enorm(embed(token)), hnorm(hidden)])`` through one decoder layer
(``block``, the model's own class built with ``layer_idx = N + i``, so its attention is the
converted paged one and declares cache entries), then ``post_norm`` and the model's head.
The embedding and the head are the main model's. A pair's rotary position is p+1 (the
token's), as transformers' ``MtpModel`` runs it; its cache row is p, so row p of a request
holds pair p and the drafter's cache covers exactly the positions the main cache does.

Checkpoints keep an MTP layer's tensors at ``model.layers.<N+i>.*``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` (the post-norm), the decoder layer's own tensors, and copies
of the embedding and head (``embed_tokens``, ``shared_head.head``) that are not read here.

Qwen3-Next keeps them under ``mtp.*`` instead (the names vLLM's ``qwen3_next_mtp.py`` loads,
and the ``mtp.`` prefix the framework's ``qwen3_5/models/modeling_qwen3_5_moe.py:2860``
skips): ``mtp.pre_fc_norm_embedding`` and ``mtp.pre_fc_norm_hidden`` (enorm, hnorm; the
embedding half comes first as in DeepSeek's), ``mtp.fc`` (eh_proj), ``mtp.layers.<i>.*`` (a
full-attention decoder layer: vLLM builds it with ``layer_type="full_attention"``) and
``mtp.norm`` (the post-norm). Its config counts them with ``mtp_num_hidden_layers``; its
``layer_types`` name no MTP kind, so the MTP layers are full attention (``_MTP_LAYER_KIND``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from kvskill.core.errors import BadInputError
from kvskill.runtime.cache_info import ModelCacheInfo
from torch import Tensor, nn

#: config keys that count the MTP layers (the analyzer reads the same ones)
MTP_COUNT_KEYS = (
    "num_mtp_layers",
    "num_nextn_predict_layers",
    "mtp_num_layers",
    "mtp_num_hidden_layers",
)
#: tensors of an MTP layer stored beside its decoder layer's, by checkpoint name
_OWN_TENSORS = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj."}
_POST_NORM = "shared_head.norm."
#: the main model's embedding and head, repeated in the checkpoint; the drafter shares them
_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")
#: the ``mtp.*`` layout (Qwen3-Next): checkpoint prefix -> the MTP layer's own module
_MTP_PREFIX_NAMES = {
    "fc.": "eh_proj.",
    "pre_fc_norm_embedding.": "enorm.",
    "pre_fc_norm_hidden.": "hnorm.",
    "norm.": "post_norm.",
}
#: model types whose config lists ``layer_types`` but no ``mtp_layer_types``: the kind of
#: their MTP layers (vLLM's qwen3_next_mtp.py builds them as full attention)
_MTP_LAYER_KIND = {"qwen3_next": "full_attention"}


def num_mtp_layers(config) -> int:
    """MTP layers the config declares (0 when it declares none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in MTP_COUNT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return max(value, 0)
    return 0


def mtp_tensor_pattern(config) -> re.Pattern | None:
    """The checkpoint keys of the MTP layers (``model.layers.<N+i>.``), None without any."""
    k = num_mtp_layers(config)
    if not k:
        return None
    n = _text(config).num_hidden_layers
    indices = "|".join(str(i) for i in range(n, n + k))
    return re.compile(rf"^(model\.layers\.({indices})\.|mtp\.)")


class MtpLayer(nn.Module):
    """One MTP layer over the converted decoder layer class."""

    def __init__(self, config, layer_cls: type[nn.Module], norm_cls: type[nn.Module], index: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_first = bool(getattr(config, "mtp_hidden_states_first", False))
        self.enorm = norm_cls(hidden, eps=eps)
        self.hnorm = norm_cls(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = layer_cls(config, index)
        self.post_norm = norm_cls(hidden, eps=eps)

    def forward(
        self, embeds: Tensor, previous_hidden: Tensor, position_ids: Tensor, position_embeddings
    ) -> Tensor:
        parts = [self.enorm(embeds), self.hnorm(previous_hidden)]
        if self.hidden_first:
            parts.reverse()
        hidden = self.eh_proj(torch.cat(parts, dim=-1))
        out = self.block(
            hidden,
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            use_cache=False,
        )
        out = out[0] if isinstance(out, tuple) else out
        return self.post_norm(out)


class MtpDrafter(nn.Module):
    """The model's MTP layers. The main model is held by reference, not as a submodule, so
    its parameters and caches are never counted twice."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        k = num_mtp_layers(config)
        if not k:
            raise BadInputError(
                f"{type(model).__name__} has no MTP layers (its config sets none of "
                f"{', '.join(MTP_COUNT_KEYS)}); speculative decoding drafts with them"
            )
        decoder = _decoder(model)
        last = decoder.layers[-1]
        norm_cls = next(type(m) for name, m in last.named_modules() if "norm" in name)
        layer_config = _mtp_layer_config(config)
        n = _text(config).num_hidden_layers
        self.num_hidden_layers = n
        self.layers = nn.ModuleList(
            MtpLayer(layer_config, type(last), norm_cls, n + i) for i in range(k)
        )
        object.__setattr__(self, "main", model)
        object.__setattr__(self, "decoder", decoder)
        param = next(model.parameters())
        self.to(device=param.device, dtype=param.dtype).eval()

    @property
    def block_size(self) -> int:
        return self.main.block_size

    def get_cache_info(self) -> ModelCacheInfo:
        """The MTP layers' caches, declared by the converted model's own ``get_cache_info``
        code run over this module (it walks the modules that carry ``cache_entries``)."""
        return type(self.main).get_cache_info(self)

    def forward(self, input_ids: Tensor, previous_hidden: Tensor, position_ids: Tensor) -> Tensor:
        """Hidden states of the first MTP layer over packed pairs ``[1, T]``: token p+1 (its
        id), the main model's final hidden state of p, and the rotary position p+1."""
        embeds = self.main.get_input_embeddings()(input_ids)
        rotary = getattr(self.decoder, "rotary_emb", None)
        position_embeddings = rotary(embeds, position_ids) if rotary is not None else None
        return self.layers[0](embeds, previous_hidden, position_ids, position_embeddings)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.main.get_output_embeddings()(hidden)

    def load_checkpoint_state(self, state: dict[str, Tensor]) -> None:
        """Take the MTP layers' tensors (checkpoint names ``model.layers.<N+i>.*``).

        Raises:
            BadInputError: a tensor missing, of another shape, or not one an MTP
                layer has.
        """
        own: dict[str, Tensor] = {}
        unknown: list[str] = []
        for key, tensor in _from_mtp_layout(state, self.num_hidden_layers).items():
            match = re.match(r"^model\.layers\.(\d+)\.(.*)$", key)
            i = int(match.group(1)) - self.num_hidden_layers if match else -1
            if not 0 <= i < len(self.layers):
                unknown.append(key)
                continue
            rest = match.group(2)
            if rest.startswith(_SHARED_COPIES):
                continue
            if rest.startswith(_POST_NORM):
                own[f"layers.{i}.post_norm.{rest[len(_POST_NORM) :]}"] = tensor
            elif rest.startswith(tuple(_OWN_TENSORS)):
                own[f"layers.{i}.{rest}"] = tensor
            else:
                own[f"layers.{i}.block.{rest}"] = tensor
        expected = set(self.state_dict())
        own = _fuse_experts(own, expected)
        missing = sorted(expected - own.keys())
        unknown += sorted(own.keys() - expected)
        if missing or unknown:
            raise BadInputError(
                f"MTP weights do not match the MTP layers built from the model's decoder layer "
                f"class: missing {missing[:4]}, unexpected {unknown[:4]} (MTP tensors are read "
                "under the layer's own names, per-expert MoE tensors fused; no other "
                "load-time conversion)"
            )
        try:
            self.load_state_dict({k: own[k] for k in expected}, strict=True)
        except RuntimeError as exc:
            raise BadInputError(
                f"MTP weights do not match: {str(exc).splitlines()[-1].strip()}"
            ) from None


def _from_mtp_layout(state: dict[str, Tensor], num_hidden_layers: int) -> dict[str, Tensor]:
    """``mtp.*`` tensors (Qwen3-Next's layout, see the module doc) under the
    ``model.layers.<N+i>.*`` names of the other layout; other keys unchanged. The fc and the
    norms around the block belong to MTP layer 0 (the runtime drafts with one layer)."""
    renamed: dict[str, Tensor] = {}
    for key, tensor in state.items():
        if not key.startswith("mtp."):
            renamed[key] = tensor
            continue
        rest = key[len("mtp.") :]
        match = re.match(r"^layers\.(\d+)\.(.*)$", rest)
        if match:
            i, inner = int(match.group(1)), match.group(2)
            renamed[f"model.layers.{num_hidden_layers + i}.{inner}"] = tensor
            continue
        for prefix, own in _MTP_PREFIX_NAMES.items():
            if rest.startswith(prefix):
                name = "shared_head.norm." if own == "post_norm." else own
                renamed[f"model.layers.{num_hidden_layers}.{name}{rest[len(prefix) :]}"] = tensor
                break
        else:
            renamed[key] = tensor  # reported as unexpected by the caller
    return renamed


def _fuse_experts(state: dict[str, Tensor], expected: set[str]) -> dict[str, Tensor]:
    """Per-expert MoE tensors (``experts.<j>.gate_proj.weight`` ..., as checkpoints store
    them) stacked into the fused parameters the decoder layer holds (transformers 5:
    ``experts.gate_up_proj`` ``[E, 2I, H]``, gate rows first, and ``experts.down_proj``
    ``[E, H, I]``), where the layer expects those and the checkpoint has every expert."""
    fused = dict(state)
    for name in expected:
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")) or name in state:
            continue
        base = name.rsplit(".", 1)[0]  # ...mlp.experts
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        pattern = re.compile(rf"^{re.escape(base)}\.(\d+)\.({'|'.join(parts)})\.weight$")
        found: dict[int, dict[str, Tensor]] = {}
        for key, tensor in state.items():
            match = pattern.match(key)
            if match:
                found.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        experts = sorted(found)
        if not experts or experts != list(range(len(experts))):
            continue
        if any(set(found[j]) != set(parts) for j in experts):
            continue
        fused[name] = torch.stack([torch.cat([found[j][p] for p in parts], dim=0) for j in experts])
        for j in experts:
            for part in parts:
                del fused[f"{base}.{j}.{part}.weight"]
    return fused


@contextmanager
def last_hidden_states(model: nn.Module) -> Iterator[list[Tensor]]:
    """Inside the block, ``captured[0]`` is the main model's final hidden state ``[1, T, H]``
    of its last forward (after the final norm, what the MTP layers read), taken from the
    decoder's output: the head keeps only a few rows, the drafter needs every token's."""
    captured: list[Tensor] = []

    def keep(_module, _args, output) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
        captured[:] = [hidden]

    handle = _decoder(model).register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _decoder(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise BadInputError(
            f"{type(model).__name__} has no decoder with .layers to build MTP layers from"
        )
    return decoder


def _mtp_layer_config(config):
    """The config the MTP layers' decoder layers are built with: indexed at N+i, always a
    MoE layer where the model distinguishes (``first_k_dense_replace`` 0, as transformers'
    ``get_mtp_config``), with the MTP layers' own types appended to per-layer type lists."""
    text = copy.deepcopy(_text(config))
    if hasattr(text, "first_k_dense_replace"):
        text.first_k_dense_replace = 0
    k = num_mtp_layers(text)
    for key, mtp_key in (
        ("layer_types", "mtp_layer_types"),
        ("mlp_layer_types", "mtp_mlp_layer_types"),
    ):
        types = getattr(text, key, None)
        if types is None:
            continue
        extra = getattr(text, mtp_key, None)
        kind = _MTP_LAYER_KIND.get(getattr(text, "model_type", ""))
        if extra is None and key == "layer_types" and kind is not None:
            extra = [kind] * k
        if extra is None:
            raise BadInputError(
                f"the config has {key} but no {mtp_key}: the kind of its MTP layers is unknown"
            )
        setattr(text, key, list(types) + list(extra))
    return text
