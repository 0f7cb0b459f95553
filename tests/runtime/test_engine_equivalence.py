"""The engine's greedy tokens equal the dense twin's, however requests are batched."""

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from toy_factory import toy_prompts, twin_of, write_toy_dir  # noqa: E402

BLOCK_SIZE = 4  # tokens per block in the toy model
WINDOW = 8  # the sliding layer's window


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=1)


@pytest.fixture(scope="module")
def twin(toy_dir):
    llm = LLM(toy_dir, trust_remote_code=True, num_blocks=8, exact=True)
    return twin_of(llm.model)


def make_llm(toy_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 128)
    kwargs.setdefault("free_block_order_seed", 7)
    # exact: the tokens are compared with the dense twin's
    return LLM(toy_dir, trust_remote_code=True, exact=True, **kwargs)


def assert_matches_twin(twin, prompts, outputs, max_tokens):
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        expected = twin.greedy(prompt, max_tokens)
        assert out.token_ids == expected, f"prompt {i} (len {len(prompt)}) diverged"
        assert out.finish_reason.value == "length"


def test_one_request_matches_twin(toy_dir, twin):
    # A prompt shorter than a block: one prefill, then decode steps.
    llm = make_llm(toy_dir)
    prompt = [3, 17, 42]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=12))
    assert out.token_ids == twin.greedy(prompt, 12)
    assert out.ttft_s is not None and out.ttft_s >= 0
    assert out.tokens_per_s is not None and out.tokens_per_s > 0
    assert llm.stats.num_prefill_steps == 1 and llm.stats.num_decode_steps == 11


def test_prompts_longer_than_block_and_window(toy_dir, twin):
    # 9..31 tokens: longer than a block (4) and than the window (8), so the sliding layer
    # reads through released (null) blocks and must still mask them out.
    llm = make_llm(toy_dir)
    prompts = [list(range(5, 5 + n)) for n in (9, 17, 31)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=14))
    assert_matches_twin(twin, prompts, outputs, 14)
    assert all(len(p) > WINDOW and len(p) > BLOCK_SIZE for p in prompts)


def test_many_mixed_requests_arriving_at_different_steps(toy_dir, twin):
    llm = make_llm(toy_dir, max_num_batched_tokens=48)
    engine = llm.engine
    rng = random.Random(3)
    prompts = toy_prompts(rng, 12, max_len=30)
    ids = []
    # Four requests now, then one more after every second step while the others run.
    for prompt in prompts[:4]:
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=10)))
    pending = prompts[4:]
    decode_batches = []
    engine.step_hooks.append(
        lambda r: decode_batches.append(len(r.request_ids)) if not r.metadata.is_prefill else None
    )
    step = 0
    while engine.has_unfinished_requests() or pending:
        if pending and step % 2 == 1:
            ids.append(engine.add_request(pending.pop(0), SamplingParams(max_tokens=10)))
        engine.step()
        step += 1
    outputs = [engine.get_output(rid) for rid in ids]
    assert_matches_twin(twin, prompts, outputs, 10)
    # Requests really were mixed: decode steps served several requests at once.
    assert max(decode_batches) >= 4


def test_preemption_by_tiny_pool_resumes_with_same_tokens(toy_dir, twin):
    # 10 usable blocks per group: five requests growing to ~35 tokens cannot all fit, so
    # running requests are preempted, recomputed later, and must produce the same tokens.
    llm = make_llm(toy_dir, num_blocks=11, max_num_batched_tokens=64)
    prompts = toy_prompts(random.Random(5), 5, min_len=10, max_len=20)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=15))
    assert llm.stats.num_preemptions > 0
    assert sum(o.num_preemptions for o in outputs) == llm.stats.num_preemptions
    assert_matches_twin(twin, prompts, outputs, 15)


def test_chunked_prefill_matches_twin(toy_dir, twin):
    # A budget of 6 tokens per step splits the 29-token prompt over five prefill steps,
    # with the chunk boundaries off the block and window boundaries.
    llm = make_llm(toy_dir, max_num_batched_tokens=6)
    prompts = [list(range(40, 69)), [9, 8, 7]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8))
    assert_matches_twin(twin, prompts, outputs, 8)
    assert llm.stats.num_prefill_steps >= 6


def test_unchunked_long_prompt_runs_alone(toy_dir, twin):
    llm = make_llm(toy_dir, max_num_batched_tokens=8, enable_chunked_prefill=False)
    prompts = [[1, 2, 3], list(range(60, 80)), [4, 5]]
    records = []
    with llm.step_hook(records.append):
        outputs = llm.generate(prompts, SamplingParams(max_tokens=5))
    assert_matches_twin(twin, prompts, outputs, 5)
    prefill_sizes = [r.metadata.actual_seq_lengths_list_q for r in records if r.metadata.is_prefill]
    assert [20] in prefill_sizes  # the long prompt had a prefill step to itself


def test_logits_match_twin_per_step(toy_dir, twin):
    # Not only the argmax: every step's last-token logits agree with the dense math.
    llm = make_llm(toy_dir, max_num_batched_tokens=10)
    prompts = [list(range(3, 21)), [7, 7, 7, 7, 7]]
    records = []
    with llm.step_hook(records.append):
        outputs = llm.generate(prompts, SamplingParams(max_tokens=6))
    sequences = {
        f"0-{i}": p + o.token_ids for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    }
    checked = 0
    for record in records:
        for row, (rid, kv) in enumerate(
            zip(record.request_ids, record.metadata.actual_seq_lengths_list_kv, strict=True)
        ):
            expected = twin.logits(sequences[rid][:kv])[-1]
            torch.testing.assert_close(record.logits[row], expected, atol=1e-4, rtol=0)
            checked += 1
    assert checked == sum(len(r.request_ids) for r in records) and checked > 10


def test_streaming_yields_tokens_in_order(toy_dir, twin):
    llm = make_llm(toy_dir)
    prompts = [[11, 12, 13, 14, 15], [20, 21]]
    streamed: dict[str, list[int]] = {}
    finished = []
    for item in llm.generate_stream(prompts, SamplingParams(max_tokens=6)):
        streamed.setdefault(item.request_id, []).extend(item.new_token_ids)
        if item.finish_reason is not None:
            finished.append(item.request_id)
    assert sorted(finished) == sorted(llm.last_request_ids)
    for rid, prompt in zip(llm.last_request_ids, prompts, strict=True):
        assert streamed[rid] == twin.greedy(prompt, 6)


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_decode_attention_on_either_cpu_path_matches_twin(toy_dir, twin, kernels, monkeypatch):
    # Plain decode calls (the full-attention layer) run in the compiled kernel when it is
    # available; the sliding layer, prefill, and everything with kernels off, in PyTorch.
    from kvskill.runtime.ops import cpu_kernels
    from ops_golden import spy_on_decode_kernel

    answered = spy_on_decode_kernel(monkeypatch)
    prompts = toy_prompts(random.Random(11), 6, max_len=25)
    llm = make_llm(toy_dir)
    if kernels == "off":
        with cpu_kernels.disabled():
            outputs = llm.generate(prompts, SamplingParams(max_tokens=9))
        assert not any(answered)
    else:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=9))
        assert any(answered) == cpu_kernels.status().available
    assert_matches_twin(twin, prompts, outputs, 9)


def test_decoding_requests_riding_along_with_prompts_keep_the_twins_tokens(toy_dir, twin):
    """Requests admitted early keep decoding in the budget later prompts leave (mixed steps:
    prompt chunks beside one-row decode requests) and still generate the dense twin's tokens."""
    steps = []

    def hook(record):
        # (prefill step?, whether a request that already generated fed one token in it)
        md = record.metadata
        riding = any(
            q == 1 and n > 0
            for q, n in zip(md.actual_seq_lengths_list_q, record.num_output_tokens, strict=True)
        )
        steps.append((md.is_prefill, riding))

    llm = make_llm(toy_dir, max_num_batched_tokens=16, max_num_seqs=4, step_hooks=[hook])
    prompts = [list(range(2, 2 + n)) for n in (5, 6, 23, 9, 14, 3)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10))
    assert_matches_twin(twin, prompts, outputs, 10)
    assert any(is_prefill and riding for is_prefill, riding in steps), steps
    # The same run without mixing: no generated token is fed in a prefill step.
    steps.clear()
    plain = make_llm(
        toy_dir,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        step_hooks=[hook],
        mix_decode_with_prefill=False,
    )
    again = plain.generate(prompts, SamplingParams(max_tokens=10))
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    assert not any(is_prefill and riding for is_prefill, riding in steps)
