"""Bad input gives one clear error and leaves other requests alone; loader errors; packing."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.core.errors import BadInputError, UnsupportedModelError  # noqa: E402
from kvskill.runtime import (  # noqa: E402
    ATTN_TYPE_MANAGER_MAP,
    LLM,
    FullAttentionManager,
    KVCacheManager,
    SamplingParams,
    load_model,
)
from kvskill.runtime.request import Request  # noqa: E402
from kvskill.runtime.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from kvskill.runtime.step_inputs import build_step_inputs  # noqa: E402
from runtime_factories import Sink, attn_layer, model_info  # noqa: E402
from toy_factory import twin_of, write_toy_dir  # noqa: E402


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=4)


@pytest.fixture(scope="module")
def llm(toy_dir):
    return LLM(toy_dir, trust_remote_code=True, num_blocks=64, max_model_len=40)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "the prompt is empty"),
        ([1, 128, 3], SamplingParams(), "prompt[1] = 128 is outside the vocabulary [0, 128)"),
        ([1, -1], SamplingParams(), "prompt[1] = -1 is outside the vocabulary"),
        ([1, 2.5], SamplingParams(), "prompt[1] = 2.5 is not an integer token id"),
        (list(range(40)), SamplingParams(), "has 40 tokens, which leaves no room"),
        ("hello", SamplingParams(), "token id lists"),
    ],
)
def test_bad_prompt_is_rejected_and_others_unaffected(llm, prompt, params, message):
    good = [7, 8, 9, 10]
    expected = llm.generate([good], SamplingParams(max_tokens=5))[0].token_ids
    with pytest.raises(BadInputError) as info:
        llm.generate([good, prompt], params)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert "prompt #1" in str(info.value)
    # Nothing of the rejected batch was queued; the engine serves the next batch as before.
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([good], SamplingParams(max_tokens=5))[0].token_ids == expected


def test_engine_add_request_rejects_without_disturbing_running_requests(llm):
    engine = llm.engine
    good = engine.add_request([3, 4, 5], SamplingParams(max_tokens=6))
    engine.step()
    with pytest.raises(BadInputError, match="vocabulary"):
        engine.add_request([500])
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_output(good)
    assert len(out.token_ids) == 6
    assert out.token_ids == twin_of(llm.model).greedy([3, 4, 5], 6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_k=-2), "top_k must be an integer >= 0"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(BadInputError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_params_count_must_match_prompts(llm):
    with pytest.raises(BadInputError, match="got 2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])


def test_max_model_len_beyond_kv_capacity_is_refused(toy_dir):
    # 5 usable blocks of 4 tokens hold 20 tokens of full attention for one request.
    with pytest.raises(BadInputError, match="holds at most 20 tokens for one request"):
        LLM(toy_dir, trust_remote_code=True, num_blocks=6, max_model_len=64)
    # Without an explicit limit, the capacity caps it.
    assert LLM(toy_dir, trust_remote_code=True, num_blocks=6).max_model_len == 20


def test_loader_errors(tmp_path, toy_dir):
    with pytest.raises(BadInputError, match="no config.json"):
        load_model(tmp_path)
    no_weights = write_toy_dir(tmp_path / "bare", weights=False)
    with pytest.raises(BadInputError, match="no \\*.safetensors weights; pass --random-weights"):
        load_model(no_weights, trust_remote_code=True)
    with pytest.raises(BadInputError, match="pass --trust-remote-code"):
        load_model(toy_dir)
    # A model without get_cache_info is not converted.
    plain = write_toy_dir(tmp_path / "plain", weights=False)
    source = (plain / "modeling_toy.py").read_text()
    (plain / "modeling_toy.py").write_text(source.replace("def get_cache_info", "def _unused"))
    with pytest.raises(UnsupportedModelError, match="has no get_cache_info"):
        load_model(plain, random_weights=True, trust_remote_code=True)
    # The model's own code fails to build from the config: one line, exit 2, no traceback.
    failing = write_toy_dir(tmp_path / "failing", weights=False)
    source = (failing / "modeling_toy.py").read_text()
    (failing / "modeling_toy.py").write_text(
        source.replace(
            "    def __init__(self, config: ToyConfig) -> None:\n",
            "    def __init__(self, config: ToyConfig) -> None:\n        config.no_such_key\n",
            1,
        )
    )
    with pytest.raises(BadInputError, match="cannot build .*: AttributeError: .*no_such_key"):
        load_model(failing, random_weights=True, trust_remote_code=True)
    broken = write_toy_dir(tmp_path / "broken", weights=False)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(BadInputError, match="config.json is not valid JSON"):
        load_model(broken)


def test_loader_rejects_mismatched_weights(tmp_path):
    src = write_toy_dir(tmp_path / "a", seed=0)
    config = json.loads((src / "config.json").read_text())
    # Same weights file, a wider model: shapes no longer match.
    (src / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(BadInputError, match=r"\(4 problem\(s\)\); first: size mismatch"):
        load_model(src, trust_remote_code=True)


def test_loaded_weights_round_trip(tmp_path):
    # The directory's safetensors, not the seed, decide the weights.
    path = write_toy_dir(tmp_path / "w", seed=9)
    a = load_model(path, seed=0, trust_remote_code=True)
    b = load_model(path, seed=1, trust_remote_code=True)
    assert a.weights_loaded
    for (name, p), q in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name


def test_llm_accepts_a_built_module(toy_dir):
    # verify hands the runtime a model object that shares weights with its reference.
    model = load_model(toy_dir, trust_remote_code=True).model
    llm = LLM(model, num_blocks=16, block_size=8, free_block_order_seed=1)
    assert llm.kv_manager.block_size_of("FullAttention") == 8
    assert model.model.layers[0].self_attn.k_cache.shape[:2] == (16, 8)
    out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == twin_of(model).greedy(list(range(1, 11)), 4)


class _SpelledOutManager(FullAttentionManager):
    """Same coverage rule, restated: the step tables take their general path for it."""

    attn_type = "SpelledOutFull"

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size


@pytest.fixture(params=["FullAttention", "SpelledOutFull"])
def attn_type(request, monkeypatch):
    """The built-in full-attention manager, and a registered one with its own block rule."""
    monkeypatch.setitem(ATTN_TYPE_MANAGER_MAP, "SpelledOutFull", _SpelledOutManager)
    return request.param


def _allocated(allocations, attn_type="FullAttention") -> KVCacheManager:
    """A KV manager (one layer, block size 4) that served ``(request_id, num_tokens)`` in
    order. A fresh free queue hands out blocks 1, 2, 3, ..., so the ids below are exact."""
    info = model_info([attn_layer(Sink(), 0, attn_type)], block_size=4)
    manager = KVCacheManager(info, num_blocks=16)
    for request_id, num_tokens in allocations:
        assert manager.allocate_slots(request_id, num_tokens) is not None
    return manager


def test_step_inputs_pack_requests_as_documented(attn_type):
    # Request a: 4 tokens cached, 3 new (positions 4..6) in blocks [1, 2]; request b: a
    # fresh 2-token prompt in block [3].
    a = Request("a", list(range(10, 17)), SamplingParams(), 0.0)
    b = Request("b", [20, 21], SamplingParams(), 0.0)
    output = SchedulerOutput(
        is_prefill=True, scheduled=[ScheduledRequest(a, 3, 4), ScheduledRequest(b, 2, 0)]
    )
    inputs = build_step_inputs(
        output,
        _allocated([("a", 7), ("b", 2)], attn_type),
        attention_mask=None,
        device=torch.device("cpu"),
    )
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [[14, 15, 16, 20, 21]]
    assert inputs.position_ids.tolist() == [[4, 5, 6, 0, 1]]
    assert inputs.logits_indices.tolist() == [2, 4]
    assert (md.actual_seq_lengths_q.tolist(), md.actual_seq_lengths_cu_q.tolist()) == (
        [3, 2],
        [3, 5],
    )
    assert (md.actual_seq_lengths_kv.tolist(), md.actual_seq_lengths_cu_kv.tolist()) == (
        [7, 2],
        [7, 9],
    )
    # the list twins say the same; kv_len is what each request had cached before the step
    assert (md.actual_seq_lengths_list_q, md.actual_seq_lengths_cu_list_kv) == ([3, 2], [7, 9])
    assert md.kv_len.tolist() == [4, 0] and md.prompt_tokens == 5
    assert md.block_table[attn_type].tolist() == [[1, 2], [3, 0]]
    assert md.block_table[attn_type].dtype == torch.int32
    # slot = block * 4 + pos % 4: positions 4,5,6 in block 2; 0,1 in block 3.
    assert md.slot_mapping[attn_type].tolist() == [8, 9, 10, 12, 13]


def test_decode_step_inputs(attn_type):
    # a: prompt of 7 and one generated token, feeds position 7 (its output 40) from block 2;
    # b: prompt of 4 and two outputs, feeds position 5 (its output 51) from block 4.
    a = Request("a", list(range(10, 17)), SamplingParams(), 0.0, output_token_ids=[40])
    b = Request("b", [20, 21, 22, 23], SamplingParams(), 0.0, output_token_ids=[50, 51])
    output = SchedulerOutput(
        is_prefill=False, scheduled=[ScheduledRequest(a, 1, 7), ScheduledRequest(b, 1, 5)]
    )
    inputs = build_step_inputs(
        output,
        _allocated([("a", 8), ("b", 6)], attn_type),
        attention_mask=None,
        device=torch.device("cpu"),
    )
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [[40, 51]]
    assert inputs.position_ids.tolist() == [[7, 5]]
    assert inputs.logits_indices.tolist() == [0, 1]
    assert md.actual_seq_lengths_kv.tolist() == [8, 6] and md.kv_len.tolist() == [7, 5]
    assert md.actual_seq_lengths_cu_q.tolist() == [1, 2]
    assert md.actual_seq_lengths_cu_kv.tolist() == [8, 14]
    assert md.block_table[attn_type].tolist() == [[1, 2], [3, 4]]
    assert md.slot_mapping[attn_type].tolist() == [2 * 4 + 3, 4 * 4 + 1]
    assert not md.is_prefill and md.prompt_tokens == 0
    # b's position 5 needs a second block; with one the step is refused.
    with pytest.raises(AssertionError, match="do not cover its tokens"):
        build_step_inputs(
            output,
            _allocated([("a", 8), ("b", 4)], attn_type),
            attention_mask=None,
            device=torch.device("cpu"),
        )


def test_token_at_reads_prompt_then_output():
    r = Request("r", [1, 2, 3], SamplingParams(), 0.0, output_token_ids=[7, 8])
    assert [r.token_at(p) for p in range(5)] == [1, 2, 3, 7, 8]
    assert [r.token_at(p) for p in range(5)] == r.token_ids_slice(0, 5)


def test_device_selection():
    from kvskill.runtime.device import select_device

    assert select_device(None).type in ("cpu", "cuda", "npu")
    assert select_device("cpu") == torch.device("cpu")
    with pytest.raises(BadInputError, match="is not a device name"):
        select_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(BadInputError, match="CUDA is not available"):
            select_device("cuda")


def test_step_inputs_refuse_blocks_that_do_not_cover_the_tokens(attn_type):
    # Request a was allocated 4 tokens (one block) but the step feeds positions 4..6.
    a = Request("a", list(range(10, 17)), SamplingParams(), 0.0)
    output = SchedulerOutput(is_prefill=True, scheduled=[ScheduledRequest(a, 3, 4)])
    with pytest.raises(AssertionError, match=f"group '{attn_type}': .*do not cover its tokens"):
        build_step_inputs(
            output,
            _allocated([("a", 4)], attn_type),
            attention_mask=None,
            device=torch.device("cpu"),
        )


def test_inconsistent_cache_entries_are_refused(toy_dir):
    model = load_model(toy_dir, trust_remote_code=True).model
    attn = model.model.layers[1].self_attn
    # A sliding layer that forgot its window cannot be served.
    attn.sliding_window = None
    with pytest.raises(BadInputError, match="is SlidingWindow but sliding_window=None"):
        LLM(model, num_blocks=8)
    # An object that is not a ModelCacheInfo is named in the error.
    model.get_cache_info = lambda: {"layers": []}
    with pytest.raises(BadInputError, match="expected kvskill.runtime.ModelCacheInfo"):
        LLM(model, num_blocks=8)


def test_a_request_without_new_tokens_adds_none():
    # a is in the batch with no token this step; b feeds one. Not a decode step.
    a = Request("a", list(range(10, 17)), SamplingParams(), 0.0)
    b = Request("b", [20, 21], SamplingParams(), 0.0)
    output = SchedulerOutput(
        is_prefill=True, scheduled=[ScheduledRequest(a, 0, 4), ScheduledRequest(b, 1, 1)]
    )
    inputs = build_step_inputs(
        output,
        _allocated([("a", 4), ("b", 2)]),  # a in block 1, b in block 2
        attention_mask=None,
        device=torch.device("cpu"),
    )
    assert inputs.input_ids.tolist() == [[21]] and inputs.position_ids.tolist() == [[1]]
    assert inputs.metadata.slot_mapping["FullAttention"].tolist() == [2 * 4 + 1]
    assert inputs.metadata.actual_seq_lengths_cu_q.tolist() == [0, 1]
