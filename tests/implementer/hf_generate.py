"""Greedy tokens of transformers' own model on the weights a kvskill LLM ran with.

The runtime tests that serve a converted directory under chunked prefill and preemption
compare against this: the family's original class, built from the directory's config, loaded
with the converted model's state dict (strict, so a renamed or missing weight fails), one
request at a time.
"""

from __future__ import annotations

import torch


def _model(directory, state_dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(state_dict, strict=True)
    return model


def transformers_tokens_uncached(directory, state_dict, prompts, max_tokens=8):
    """Greedy tokens from transformers' full forward over the whole sequence at every step
    (no cache): the model's math alone, whatever its cache classes do."""
    model = _model(directory, state_dict)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt) :])
    return out


def transformers_tokens(directory, state_dict, prompts, max_tokens=8) -> list[list[int]]:
    model = _model(directory, state_dict)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # an explicit mask: without one, generate masks every prompt token equal to the
            # config's pad_token_id, which the runtime (rightly) attends to
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                min_new_tokens=max_tokens,
            )
            out.append(generated[0, len(prompt) :].tolist())
    return out


def runtime_tokens(llm, prompts, max_tokens=8) -> list[list[int]]:
    """Greedy tokens of kvskill's runtime ``llm`` for ``prompts`` (EOS ignored), the
    counterpart of ``transformers_tokens``."""
    from kvskill.runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]
