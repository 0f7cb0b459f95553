"""Stops (EOS, stop ids, max tokens, max_model_len) and seeded sampling."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from kvskill.runtime.sampler import Sampler, greedy_tokens, make_generator  # noqa: E402
from toy_factory import twin_of, write_toy_dir  # noqa: E402


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=2)


@pytest.fixture(scope="module")
def twin(toy_dir):
    return twin_of(LLM(toy_dir, trust_remote_code=True, num_blocks=8).model)


def make_llm(toy_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 96)
    return LLM(toy_dir, trust_remote_code=True, **kwargs)


PROMPT = [5, 9, 33, 70, 2, 18]


def test_eos_stops_and_is_kept(toy_dir, twin):
    # Make the 4th greedy token the EOS id: generation stops right there.
    free_run = twin.greedy(PROMPT, 10)
    eos = free_run[3]
    cut = free_run.index(eos) + 1
    llm = make_llm(toy_dir, eos_token_id=eos)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=10))
    assert out.token_ids == free_run[:cut]
    assert out.finish_reason.value == "stop"
    # ignore_eos runs on to max_tokens.
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))
    assert out.token_ids == free_run and out.finish_reason.value == "length"


def test_stop_token_ids_and_max_tokens(toy_dir, twin):
    free_run = twin.greedy(PROMPT, 8)
    llm = make_llm(toy_dir)
    stop = free_run[5]
    outs = llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(max_tokens=8, stop_token_ids=[stop]), SamplingParams(max_tokens=3)],
    )
    assert outs[0].token_ids == free_run[: free_run.index(stop) + 1]
    assert outs[0].finish_reason.value == "stop"
    assert outs[1].token_ids == free_run[:3] and outs[1].finish_reason.value == "length"
    # max_tokens=1: the only token comes from the prefill step.
    [one] = llm.generate([PROMPT], SamplingParams(max_tokens=1))
    assert one.token_ids == free_run[:1] and one.finish_reason.value == "length"


def test_max_model_len_stops_generation(toy_dir, twin):
    llm = make_llm(toy_dir, max_model_len=10)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=50))
    # prompt 6 + 4 generated = max_model_len 10
    assert out.token_ids == twin.greedy(PROMPT, 4) and out.finish_reason.value == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(toy_dir):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    alone = make_llm(toy_dir).generate([PROMPT], params)[0].token_ids
    # Same seed, different company: two other sampled requests share every step.
    others = [SamplingParams(max_tokens=12, temperature=1.3, seed=s) for s in (1, 2)]
    crowded = make_llm(toy_dir, free_block_order_seed=4).generate(
        [[1, 2, 3], PROMPT, list(range(40, 60))], [others[0], params, others[1]]
    )
    assert crowded[1].token_ids == alone
    # A different seed gives a different continuation; greedy differs from sampling.
    other_seed = make_llm(toy_dir).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=99)
    )[0]
    assert other_seed.token_ids != alone


def test_unseeded_sampling_follows_engine_seed(toy_dir):
    params = SamplingParams(max_tokens=10, temperature=1.0)
    a = make_llm(toy_dir, seed=5).generate([PROMPT, PROMPT], params)
    b = make_llm(toy_dir, seed=5).generate([PROMPT, PROMPT], params)
    c = make_llm(toy_dir, seed=6).generate([PROMPT, PROMPT], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    # The two requests of a batch draw from different streams.
    assert a[0].token_ids != a[1].token_ids


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=2.0, top_k=1, seed=1),
        SamplingParams(temperature=2.0, top_p=1e-6, seed=2),
        SamplingParams(),
    ]
    gens = [make_generator(p, engine_seed=0, index=i, device="cpu") for i, p in enumerate(params)]
    assert gens[2] is None
    assert Sampler()(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_k_restricts_draws_to_the_k_best():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    best5 = set(logits[0].topk(5).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=5, seed=3)
    gen = make_generator(params, engine_seed=0, index=0, device="cpu")
    draws = {Sampler()(logits, [params], [gen])[0] for _ in range(200)}
    assert draws <= best5 and len(draws) > 1


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8).
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    gen = make_generator(params, engine_seed=0, index=0, device="cpu")
    draws = [Sampler()(probs.log(), [params], [gen])[0] for _ in range(300)]
    assert set(draws) == {0, 1}
    assert 0.5 < draws.count(0) / 300 < 0.75  # renormalised 0.5 / 0.8 = 0.625


def test_seeded_sampling_survives_preemption(toy_dir):
    # A pool too small for all requests forces recomputation; the seeded draws continue
    # from the request's own generator, so the tokens equal an unconstrained run's.
    prompts = [list(range(10 + i, 24 + i)) for i in range(4)]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=s) for s in range(4)]
    roomy = make_llm(toy_dir).generate(prompts, params)
    tight_llm = make_llm(toy_dir, num_blocks=12, free_block_order_seed=2)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.stats.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


@pytest.mark.parametrize(("rows", "vocab"), [(1, 4096), (5, 256), (32, 4096), (9, 320), (6, 100)])
def test_greedy_tokens_equal_argmax_with_ties_nan_and_inf(rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    for trial in range(20):
        # Few distinct values, so rows have many tied maxima, often in different tiles.
        logits = torch.randint(-3, 3, (rows, vocab), generator=gen).float()
        if trial % 4 == 1:
            logits[rows // 2, vocab - 1] = float("nan")
            logits[rows // 2, vocab // 3] = float("nan")
        if trial % 4 == 2:
            logits[0] = float("-inf")
        if trial % 4 == 3:
            logits[-1, vocab // 2] = float("inf")
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1)), trial


def test_greedy_rows_of_a_mixed_batch_are_argmax():
    logits = torch.randn(8, 512, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=1.0, seed=i) if i % 3 == 0 else SamplingParams()
        for i in range(8)
    ]
    gens = [make_generator(p, engine_seed=0, index=i, device="cpu") for i, p in enumerate(params)]
    tokens = Sampler()(logits, params, gens)
    best = logits.argmax(-1).tolist()
    assert [t for i, t in enumerate(tokens) if i % 3] == [b for i, b in enumerate(best) if i % 3]
