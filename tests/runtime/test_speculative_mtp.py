"""Speculative decoding with the MTP layer of DeepSeek-V3 (MLA) and GLM-4-MoE (GQA), each
converted by apply (framework mode).

Greedy speculative output equals greedy one-token-per-step output for every request, through
chunked prefill, preemption and prefix-cache hits; the drafter's logits equal transformers'
``MtpModel`` on the same weights; a model built to agree accepts every draft.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from kvskill.core.errors import BadInputError
from kvskill.runtime import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from mtp_checkpoints import (  # noqa: E402
    GLM4_MOE,
    agreeing_state,
    convert_checkpoint,
    deepseek_mtp_state,
    mtp_state,
    with_weights,
)

# apply's MLA codemods over deepseek_v3's modeling file take most of the module's time
# (10-20 s on a shared CPU); every test below shares the one conversion
pytestmark = pytest.mark.slow

SETTINGS = dict(exact=True, block_size=16, num_blocks=32, free_block_order_seed=7)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 33, 7, 100, 3], list(range(20, 45)), [200, 4, 17] * 6]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_mtp")
    config, state = deepseek_mtp_state()
    return convert_checkpoint(root, config, state), config, state


def _tokens(directory, prompts, **settings):
    llm = LLM(directory, **{**SETTINGS, **settings})
    return [o.token_ids for o in llm.generate(prompts, GREEDY)], llm


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_tokens_equal_one_token_per_step(deepseek, k):
    directory, _, _ = deepseek
    # chunked prefill: the longest prompt takes three steps of 8 tokens
    expected, _ = _tokens(directory, PROMPTS, max_num_batched_tokens=8)
    got, llm = _tokens(directory, PROMPTS, max_num_batched_tokens=8, speculative_tokens=k)
    assert got == expected
    spec = llm.stats.speculation
    assert spec.num_verify_steps > 0 and spec.num_draft_tokens > 0
    assert llm.stats.to_dict()["speculation"]["acceptance_rate"] == spec.acceptance_rate
    # every block back in the pool: the MTP caches share the main layers' blocks
    free = llm.kv_manager.num_free_blocks
    assert free == llm.kv_manager.initial_free_blocks


def test_preempted_and_prefix_cached_requests_keep_their_tokens(deepseek):
    k = 2  # the second draft's MTP row takes a slot of its own: the tightest pool
    directory, _, _ = deepseek
    # three prompts of 14 tokens take a block each; grown by 12 tokens they need 6 blocks of
    # 16 and the pool has 5: preemption
    first = [list(range(60 + 20 * i, 74 + 20 * i)) for i in range(3)]
    tight = dict(num_blocks=6, max_model_len=64)
    expected_first, _ = _tokens(directory, first)
    # then two prompts that continue the first two requests: their first block is cached
    second = [first[0] + expected_first[0][:4], first[1] + expected_first[1][:3]]
    expected_second, _ = _tokens(directory, second)
    llm = LLM(directory, **{**SETTINGS, **tight, "speculative_tokens": k})
    assert [o.token_ids for o in llm.generate(first, GREEDY)] == expected_first
    assert llm.stats.num_preemptions > 0
    assert [o.token_ids for o in llm.generate(second, GREEDY)] == expected_second
    assert llm.stats.num_prefix_hit_tokens >= 32  # a block for each second prompt


def test_drafter_logits_equal_transformers_mtp_model(deepseek):
    _assert_draft_logits_match(*deepseek)


def test_glm4_moe_speculative_tokens_and_draft_logits(tmp_path_factory):
    config, state = mtp_state("glm4_moe", GLM4_MOE)
    directory = convert_checkpoint(tmp_path_factory.mktemp("glm4_moe_mtp"), config, state)
    expected, _ = _tokens(directory, PROMPTS)
    got, llm = _tokens(directory, PROMPTS, speculative_tokens=1)
    assert got == expected and llm.stats.speculation.num_draft_tokens > 0
    _assert_draft_logits_match(directory, config, state)


def _assert_draft_logits_match(directory, config, state) -> None:
    """The drafter's logits over a prompt's pairs, after its prefill in the paged runtime,
    equal transformers' MtpModel on the same weights (fp32)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    n = config.num_hidden_layers
    prefix = f"model.layers.{n}."
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.load_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)})
    mtp = MtpModel(reference, 1).eval()
    renamed = {}
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            renamed[f"layers.0.{rest}"] = value
        elif rest.startswith("shared_head.norm."):
            renamed["layers.0.post_norm." + rest.removeprefix("shared_head.norm.")] = value
        else:
            renamed[f"layers.0.mtp_block.{rest}"] = value
    result = mtp.load_state_dict(renamed, strict=False)
    assert not result.unexpected_keys
    assert all(k.startswith(("embed_tokens", "shared_head")) for k in result.missing_keys)

    prompt = list(range(20, 45))
    llm = LLM(directory, **SETTINGS, speculative_tokens=1)
    request = llm.engine.add_request(prompt, GREEDY)
    llm.engine.step()  # the prefill: main forward, then the drafter over every pair
    sampled = llm.engine.get_output(request).token_ids[0]
    draft_logits = llm.engine.speculator.last_draft_logits
    with torch.no_grad():
        hidden = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
        # pair p = (hidden of p, token p+1) at position p+1
        out = mtp.forward_layer(
            0,
            hidden,
            torch.arange(1, len(prompt) + 1)[None],
            None,
            input_ids=torch.tensor([prompt[1:] + [sampled]]),
        )
        expected = mtp._project_to_logits(out)[0]
    assert draft_logits.shape == expected.shape == (len(prompt), config.vocab_size)
    torch.testing.assert_close(draft_logits, expected, atol=1e-4, rtol=0)


def test_an_agreeing_mtp_layer_has_every_draft_accepted(deepseek, tmp_path):
    directory, config, state = deepseek
    agreeing = with_weights(directory, tmp_path / "agreeing", agreeing_state(config, state))
    expected, _ = _tokens(agreeing, PROMPTS)
    got, llm = _tokens(agreeing, PROMPTS, speculative_tokens=1)
    assert got == expected
    spec = llm.stats.speculation
    assert spec.acceptance_rate == 1.0
    assert spec.tokens_per_step > 1.5
    # three drafts a step, the last two from the MTP layer reused over its own output
    got, llm = _tokens(agreeing, PROMPTS, speculative_tokens=3)
    assert got == expected
    assert llm.stats.speculation.acceptance_rate == 1.0
    assert llm.stats.speculation.tokens_per_step > 3.0
    # fewer decode steps than tokens generated after the prefill
    assert llm.stats.num_decode_steps < sum(len(t) - 1 for t in got)


def test_speculation_without_mtp_layers_is_refused(deepseek, tmp_path):
    directory, config, state = deepseek
    prefix = f"model.layers.{config.num_hidden_layers}."
    main_only = {k: v for k, v in state.items() if not k.startswith(prefix)}
    plain = with_weights(directory, tmp_path / "plain", main_only)
    config = json.loads((plain / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError, match="has no MTP layers"):
        LLM(plain, **SETTINGS, speculative_tokens=1)


def test_the_mtp_chain_of_verify_passes_and_catches_a_drafter_paired_one_off(deepseek, monkeypatch):
    from kvskill.runtime.loader import load_model
    from kvskill.runtime.mtp import MtpDrafter
    from kvskill.verify.mtp_chain import mtp_chain
    from transformers import AutoModelForCausalLM

    directory, config, state = deepseek
    prefix = f"model.layers.{config.num_hidden_layers}."
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.load_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)})
    converted = load_model(directory).model
    prompts = PROMPTS[:2]
    tokens, _ = _tokens(directory, prompts)

    def chain():
        result, note = mtp_chain(
            reference,
            converted,
            prompts,
            tokens,
            max_new_tokens=12,
            block_size=16,
            seed=0,
            atol=1e-4,
        )
        assert note is None
        return result

    good = chain()
    assert good["name"] == "mtp" and good["passed"], good["failures"]
    # token p+1 paired with the hidden state of p-1 (a one-off pairing of the packed rows)
    forward = MtpDrafter.forward
    monkeypatch.setattr(
        MtpDrafter,
        "forward",
        lambda self, ids, hidden, pos: forward(self, ids, torch.roll(hidden, 1, dims=1), pos),
    )
    bad = chain()
    assert not bad["passed"]
    assert any("draft logits differ from transformers' MtpModel" in f for f in bad["failures"])


def test_only_the_mtp_layers_tensors_are_set_aside(deepseek, tmp_path):
    directory, config, state = deepseek
    n = config.num_hidden_layers
    stray = dict(state)
    stray[f"model.layers.{n + 1}.enorm.weight"] = state[f"model.layers.{n}.enorm.weight"].clone()
    with pytest.raises(BadInputError, match=rf"unexpected \['model.layers.{n + 1}.enorm.weight'\]"):
        LLM(with_weights(directory, tmp_path / "stray", stray), **SETTINGS, speculative_tokens=1)
