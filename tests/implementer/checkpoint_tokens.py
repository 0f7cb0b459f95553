"""Tokens of a saved checkpoint: transformers' model against its converted directory.

Shared by the checkpoint-directory tests: both sides run the same prompts greedily for the
same number of new tokens on the checkpoint's own weights.
"""

from __future__ import annotations

import torch
from kvskill.runtime import LLM, SamplingParams
from kvskill.verify.weights import condition_weights

PROMPTS = [[3, 14, 15, 92, 65], list(range(20, 57))]
NEW_TOKENS = 8


def save_checkpoint(model, path):
    """Save MODEL with conditioned random weights; returns it in eval mode."""
    condition_weights(model, seed=7)  # random weights whose greedy tokens are not a tie
    model.save_pretrained(path)
    return model.eval()


def hf_tokens(model) -> list[list[int]]:
    """transformers ``generate``, greedy, one prompt at a time."""
    tokens = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def kvskill_tokens(directory) -> list[list[int]]:
    """The converted directory in the bundled runtime, all prompts batched."""
    # exact: compared with transformers' tokens
    llm = LLM(directory, exact=True, num_blocks=16, block_size=8)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outputs]
