"""``EngineConfig``: the one record of an LLM's settings, and how ``LLM`` takes it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.core.errors import BadInputError  # noqa: E402
from kvskill.runtime import LLM, EngineConfig, SamplingParams  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=5)


def test_an_llm_runs_with_the_config_it_was_given(toy_dir):
    config = EngineConfig(
        trust_remote_code=True, num_blocks=24, block_size=4, max_num_seqs=2, cpu_only_shapes=True
    )
    llm = LLM(toy_dir, config)
    assert llm.engine_config == config
    # the pool and the scheduler follow the config
    assert llm.kv_manager.initial_free_blocks["FullAttention"] == 23  # null block excluded
    assert llm.kv_manager.block_size_of("FullAttention") == 4
    assert llm.engine.config.max_num_seqs == 2


def test_keyword_settings_replace_the_config_fields(toy_dir):
    base = EngineConfig(trust_remote_code=True, num_blocks=24, cpu_only_shapes=True)
    by_keyword = LLM(toy_dir, trust_remote_code=True, num_blocks=24, cpu_only_shapes=True)
    assert by_keyword.engine_config == base
    # and both generate the same tokens
    prompts, params = [[1, 2, 3], [9, 8, 7, 6]], SamplingParams(max_tokens=4)
    expected = [o.token_ids for o in LLM(toy_dir, base).generate(prompts, params)]
    assert [o.token_ids for o in by_keyword.generate(prompts, params)] == expected
    overridden = LLM(toy_dir, base, num_blocks=40)
    assert overridden.engine_config.num_blocks == 40
    assert overridden.engine_config.trust_remote_code is True


def test_an_unknown_setting_is_a_type_error(toy_dir):
    with pytest.raises(TypeError, match="num_block"):
        LLM(toy_dir, EngineConfig(trust_remote_code=True), num_block=8)


@pytest.mark.parametrize("flag", ["prepack_linear", "fuse_layers", "screen_output_head"])
def test_one_process_settings_refuse_tensor_parallel(flag):
    with pytest.raises(BadInputError, match=f"{flag} runs in one process"):
        EngineConfig(tensor_parallel_size=2, **{flag: True})


def test_to_dict_is_json_values():
    import torch

    config = EngineConfig(dtype=torch.bfloat16, eos_token_id=[2, 7])
    data = config.to_dict()
    assert data["dtype"] == "bfloat16" and data["eos_token_id"] == [2, 7]
    assert config.eos_token_id == (2, 7)  # a list is kept as a tuple: the record is frozen
    assert list(data) == list(EngineConfig().to_dict())
