"""The MTP chain: a converted model's MTP layer, run as the bundled runtime's drafter, against
transformers' own ``MtpModel`` on the same weights (or, for Qwen3-Next, whose MTP layer
transformers does not build, the layer written out from its modules: ``mtp_reference``).

Checked, for a model whose config declares MTP layers (and a transformers that has
``MtpModel``, or a reference here): the drafter's cache entries are injected with their declared shapes (they were
merged into the model's cache info); its logits over every pair of the first prompt, after
the paged prefill, equal ``MtpModel``'s within the verify tolerance; greedy speculative
decoding gives the reference's tokens for every prompt; and the pools are back to their
initial counts afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from kvskill.runtime.chains import chain_result, check_init_chain, check_pools_released
from kvskill.runtime.mtp import num_mtp_layers
from kvskill.verify.mtp_reference import MTP_REFERENCE_MODEL_TYPES, Qwen3NextMtpReference
from kvskill.verify.weights import condition_weights
from torch import nn


def mtp_chain(
    reference: nn.Module,
    converted: nn.Module,
    prompts: Sequence[Sequence[int]],
    reference_tokens: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    block_size: int,
    seed: int,
    atol: float,
) -> tuple[dict | None, str | None]:
    """(the chain's result as a report dict, or None when there is nothing to check; a note
    saying why it was not checked, or None)."""
    k = num_mtp_layers(converted.config)
    if not k:
        return None, None
    if k != 1:
        return None, f"MTP layers not checked: {k} layers; the runtime drafts with one"
    if reference.config.get_text_config().model_type in MTP_REFERENCE_MODEL_TYPES:
        hand = Qwen3NextMtpReference(reference).float().eval()
        condition_weights(hand, seed + 1)
        state, draft_logits, against = hand.checkpoint_state(), hand.logits, "the MTP reference"
    else:
        try:
            from transformers.modeling_layers import MtpModel
        except ImportError:
            return None, "MTP layers not checked: this transformers has no MtpModel to compare with"
        try:
            mtp = MtpModel(reference, 1).float().eval()
        except Exception as exc:  # noqa: BLE001 - transformers' own class refuses this model
            return None, f"MTP layers not checked: transformers' MtpModel refuses the model ({exc})"
        condition_weights(mtp.layers, seed + 1)
        state = _checkpoint_names(mtp, reference.config.get_text_config().num_hidden_layers)
        draft_logits, against = _mtp_model_logits(mtp), "transformers' MtpModel"
    result = _run(
        reference,
        converted,
        draft_logits,
        against,
        state,
        prompts,
        reference_tokens,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        seed=seed,
        atol=atol,
    )
    return result, None


def _checkpoint_names(mtp: nn.Module, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """MtpModel's layer tensors under the names checkpoints keep them (``model.layers.<N>.``)."""
    prefix = f"model.layers.{num_hidden_layers}."
    state = {}
    for key, value in mtp.layers[0].state_dict().items():
        if key.startswith("mtp_block."):
            state[prefix + key.removeprefix("mtp_block.")] = value
        elif key.startswith("post_norm."):
            state[prefix + "shared_head.norm." + key.removeprefix("post_norm.")] = value
        else:
            state[prefix + key] = value
    return state


def _mtp_model_logits(mtp):
    """MtpModel's logits of the pairs (hidden ``[1, T, H]``, token ids, rotary positions)."""

    def logits(hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor):
        with torch.no_grad():
            out = mtp.forward_layer(0, hidden, position_ids, None, input_ids=input_ids)
            return mtp._project_to_logits(out)

    return logits


def _run(
    reference,
    converted,
    expected_logits,
    against: str,
    state,
    prompts,
    reference_tokens,
    *,
    max_new_tokens,
    block_size,
    seed,
    atol,
) -> dict:
    from kvskill.runtime import LLM, SamplingParams
    from kvskill.runtime.ops import current_profile

    total_blocks = sum(math.ceil((len(p) + max_new_tokens + 1) / block_size) for p in prompts)
    llm = LLM(
        converted,
        exact=True,
        block_size=block_size,
        num_blocks=total_blocks + 8,
        free_block_order_seed=seed + 7,
        max_model_len=max(len(p) for p in prompts) + max_new_tokens + 1,
        seed=seed,
        npu_profile=current_profile(),
        speculative_tokens=1,
        mtp_state=state,
    )
    failures = [
        f.replace("init chain", "MTP init")
        for f in check_init_chain(converted, llm.cache_info, llm.kv_manager).failures
    ]
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    # the first prompt's prefill alone: the drafter's logits over all its pairs
    first = list(prompts[0])
    engine = llm.engine
    request = engine.add_request(first, params)
    engine.step()
    sampled = engine.get_output(request).token_ids[0]
    draft_logits = engine.speculator.last_draft_logits
    while engine.has_unfinished_requests():
        engine.step()
    with torch.no_grad():
        hidden = reference(torch.tensor([first]), output_hidden_states=True).hidden_states[-1]
    expected = expected_logits(
        hidden.float(),
        torch.tensor([first[1:] + [sampled]]),
        torch.arange(1, len(first) + 1)[None],
    )[0].float()
    diff = (draft_logits - expected).abs().max().item()
    if diff > atol:
        failures.append(f"draft logits differ from {against} by {diff:.3g} > {atol:g}")
    outputs = llm.generate([list(p) for p in prompts], params)
    for index, (out, tokens) in enumerate(zip(outputs, reference_tokens, strict=True)):
        if out.token_ids != list(tokens):
            failures.append(
                f"prompt {index}: speculative tokens {out.token_ids} differ from the "
                f"reference's {list(tokens)}"
            )
    failures += check_pools_released(llm.kv_manager)
    spec = llm.stats.speculation
    summary = (
        f"drafter logits vs {against} max diff {diff:.2e}; speculative tokens of "
        f"{len(prompts)} prompts; acceptance {spec.acceptance_rate:.2f}; pools released"
    )
    return chain_result("mtp", summary, failures).to_dict()
