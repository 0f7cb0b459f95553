"""Speculative decoding on a hybrid model: Qwen3-Next (gated-delta and full-attention
layers) with its MTP layer in the ``mtp.*`` layout, converted by apply (framework mode).

A verify step writes the recurrent states after every fed token into the request's
``1 + k`` state blocks and the request keeps the block of its last accepted token. With
random weights the MTP layer's drafts are almost never accepted, so the drafts are also
replaced by the tokens one-token-per-step decoding produces, one in three spoiled: every
accepted count from 0 to k occurs, and the tokens must still equal the reference's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvskill.runtime import LLM, SamplingParams
from kvskill.runtime.managers import MambaManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from mtp_checkpoints import (  # noqa: E402
    convert_checkpoint,
    oracle_drafts,
    qwen3_next_mtp_state,
)

# one apply of the gated-delta codemods over qwen3_next's modeling file
pytestmark = pytest.mark.slow

SETTINGS = dict(exact=True, block_size=4, num_blocks=200, cpu_only_shapes=True)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 33, 7, 100, 3, 41, 8, 77], list(range(20, 43)), [200, 4, 17] * 5]


@pytest.fixture(scope="module")
def checkpoint():
    return qwen3_next_mtp_state()


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, checkpoint):
    return convert_checkpoint(tmp_path_factory.mktemp("qwen3_next_mtp"), *checkpoint)


def _tokens(directory, **settings):
    llm = LLM(directory, **{**SETTINGS, **settings})
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


def test_gated_delta_states_follow_the_accepted_tokens(qwen3_next, monkeypatch):
    expected, _ = _tokens(qwen3_next)
    # the MTP layer's own drafts (random weights: nearly all rejected)
    got, llm = _tokens(qwen3_next, speculative_tokens=2)
    assert got == expected and llm.stats.speculation.num_draft_tokens > 0
    assert llm.engine.speculator.last_draft_logits is not None
    oracle_drafts(monkeypatch, {tuple(p): e for p, e in zip(PROMPTS, expected, strict=True)})
    for k in (1, 2):
        got, llm = _tokens(qwen3_next, speculative_tokens=k)
        assert got == expected, k
        spec = llm.stats.speculation
        assert 0 < spec.num_accepted_draft_tokens < spec.num_draft_tokens
        assert llm.kv_manager.num_free_blocks == llm.kv_manager.initial_free_blocks
    # preemption: 14 blocks of 4 tokens cannot hold the three requests grown by 8 tokens
    got, llm = _tokens(qwen3_next, speculative_tokens=2, num_blocks=14, max_model_len=40)
    assert got == expected and llm.stats.num_preemptions > 0
    # the state of the last accepted token is what makes them equal: keeping block 0 (the
    # state after the verify step's first token) changes the tokens
    monkeypatch.setattr(MambaManager, "keep_state_after", lambda self, rid, t: None)
    got, _ = _tokens(qwen3_next, speculative_tokens=2)
    assert got != expected


def test_drafter_reads_the_mtp_tensors_as_qwen3_next_lays_them_out(qwen3_next, checkpoint):
    """The drafter's logits over a prompt's pairs after its prefill equal Qwen3-Next's MTP
    layer written out from transformers' modules (verify's reference) over the same
    ``mtp.*`` tensors."""
    import torch
    from kvskill.verify.mtp_reference import Qwen3NextMtpReference
    from transformers import AutoModelForCausalLM

    config, state = checkpoint
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")})
    hand = Qwen3NextMtpReference(reference).eval()
    names = hand.checkpoint_state()
    hand.load_state_dict(dict(zip(hand.state_dict(), (state[k] for k in names), strict=True)))

    prompt = PROMPTS[1]
    llm = LLM(qwen3_next, **SETTINGS, speculative_tokens=1)
    request = llm.engine.add_request(prompt, GREEDY)
    llm.engine.step()  # the prefill: main forward, then the drafter over every pair
    sampled = llm.engine.get_output(request).token_ids[0]
    draft_logits = llm.engine.speculator.last_draft_logits
    with torch.no_grad():
        hidden = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
    expected = hand.logits(
        hidden, torch.tensor([prompt[1:] + [sampled]]), torch.arange(1, len(prompt) + 1)[None]
    )[0]
    assert draft_logits.shape == expected.shape == (len(prompt), config.vocab_size)
    # fp32; the main model's paged gated-delta path and transformers' differ by ~1e-4 in the
    # hidden states the pairs read (measured max logit difference 1.1e-4)
    torch.testing.assert_close(draft_logits, expected, atol=5e-4, rtol=0)


def test_verify_checks_the_hybrid_mtp_chain(qwen3_next, checkpoint):
    from kvskill.runtime.loader import load_model
    from kvskill.verify.mtp_chain import mtp_chain
    from transformers import AutoModelForCausalLM

    config, state = checkpoint
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")})
    expected, _ = _tokens(qwen3_next)
    result, note = mtp_chain(
        reference,
        load_model(qwen3_next).model,
        PROMPTS,
        expected,
        max_new_tokens=GREEDY.max_tokens,
        block_size=4,
        seed=0,
        atol=5e-4,
    )
    assert note is None
    assert result["passed"], result["failures"]
    assert "drafter logits vs the MTP reference" in result["summary"]
