"""Converted models inside the real executor of a cann-recipes-infer checkout, on a CPU.

Opt-in (``make test-cann-recipes``): set KVSKILL_CANN_RECIPES to a checkout of fbc225d. The
framework's own requirements its executor imports (datasets, loguru) must be installed.

For each family, ``kvskill apply --target cann-recipes`` writes the executor's form of the
model. Under the CPU ``torch_npu`` stand-in, with the checkout first on the path, that file
imports the framework's real ``CacheEntry`` / ``ModelCacheInfo`` / forward metadata. The test
hands the model's ``get_cache_info()`` to the real ``validate_cache_info``,
``calculate_block_num`` (offline sizing) and ``allocate_cache_tensors``, builds
every step's tables with the real ``KVCacheManager``, ``prepare_block_tables`` and
``prepare_slot_mapping``, sets the real ``ForwardMetaData`` as the framework's engine does,
and decodes greedily; the tokens must equal transformers' ``generate`` on the same weights.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.writer import apply_model
from kvskill.runtime.executor_host import executor_infer_config
from kvskill.runtime.ops.npu_standin import npu_standin
from kvskill.verify.shrink import shrink_config

ROOT = os.environ.get("KVSKILL_CANN_RECIPES")
pytestmark = pytest.mark.skipif(not ROOT, reason="KVSKILL_CANN_RECIPES is not set")

FAMILIES = [
    "qwen3",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "qwen3_next",
]
#: config overrides per family: GLM-5's pattern of indexer ("full") and "shared" layers, which
#: reuse the previous full layer's top-k (the shrunk twin keeps one of each)
OVERRIDES = {
    "glm_moe_dsa": {
        "indexer_types": ["full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(78)]
    }
}
PROMPTS = [[3, 17, 5, 9, 41, 2, 8], [11, 4, 30], [7, 7, 12, 25, 1, 9, 14, 33, 6, 2, 19]]
NEW_TOKENS = 6
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def framework_root() -> Path:
    for name in ("datasets", "loguru"):
        pytest.importorskip(name, reason=f"the framework's requirement {name} is not installed")
    root = Path(ROOT)
    if not (root / "executor" / "core" / "kv_cache" / "cache_info.py").is_file():
        pytest.fail(f"KVSKILL_CANN_RECIPES={ROOT} is not a cann-recipes-infer checkout")
    return root


def _tiny_config(out: Path) -> dict:
    plan = json.loads((out / "kvskill_plan.json").read_text())
    config = json.loads((out / "config.json").read_text())
    tiny = shrink_config(config, code=plan.get("code")).config
    tiny.pop("auto_map", None)
    return tiny


def _reference(model_type: str, config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(
        model_type, **{k: v for k, v in config.items() if k != "model_type"}
    )
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model, hf_config


def _greedy_reference(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def _executor_model(out: Path, model_type: str, hf_config, reference):
    name = f"{model_type}_paged"
    module = importlib.import_module(f"models.{name}.models.modeling_{name}")
    cls = next(
        obj
        for name, obj in vars(module).items()
        if name.endswith("Executor") and isinstance(obj, type)
    )
    infer_config = executor_infer_config(block_size=BLOCK_SIZE)
    model = cls(hf_config, infer_config, None).float().eval()
    model.load_weights(reference.state_dict().items())
    return module, model, infer_config


def sizing_config(batch: int) -> SimpleNamespace:
    """The inference-config fields the framework's block sizing reads, for BATCH requests."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(batch_size_per_dp_rank=batch, mem_fraction_static=0.85),
        parallel_config=SimpleNamespace(offline_prefill_dp_group_size=1),
        model_config=SimpleNamespace(next_n=0),
    )


def _greedy_in_executor(module, model, prompts: list[list[int]]) -> list[list[int]]:
    """Prefill all prompts in one packed step, then decode them together: the tables, the
    slot mapping and the metadata come from the framework's own functions."""
    from executor.core.kv_cache import (
        KVCacheManager,
        allocate_cache_tensors,
        calculate_block_num,
        create_single_type_managers,
        prepare_block_tables,
        prepare_slot_mapping,
        validate_cache_info,
    )
    from executor.utils.forward_metadata import (
        get_forward_metadata,
        reset_forward_metadata,
        set_forward_metadata,
    )

    # the converted file's classes are the framework's own
    assert module.CacheEntry.__module__.startswith("executor.")
    info = model.get_cache_info()
    validate_cache_info(info)
    max_len = max(map(len, prompts)) + NEW_TOKENS
    # the framework's offline sizing: every request may grow to max_len
    blocks = calculate_block_num(sizing_config(len(prompts)), info, offline_max_len=max_len)
    allocate_cache_tensors(torch.device("cpu"), info, blocks)
    managers = create_single_type_managers(info, blocks, max_model_len=max_len)
    kv = KVCacheManager(max_len, managers, info)
    assert kv.is_mla_backend == info.is_mla_backend
    requests = [SimpleNamespace(request_id=i) for i in range(len(prompts))]
    lengths = [len(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    widths = kv.get_block_table_max_lens(max_len)
    reset_forward_metadata()
    for step in range(NEW_TOKENS):
        prefill = step == 0
        q = lengths if prefill else [1] * len(prompts)
        for i, n in enumerate(q):
            computed = 0 if prefill else lengths[i] + step - 1
            assert kv.allocate_slots(i, computed, n)
        if prefill:
            ids = torch.tensor([t for p in prompts for t in p])
            positions = torch.cat([torch.arange(n) for n in lengths])
            kv_lens = torch.tensor(lengths)
        else:
            ids = torch.tensor([o[-1] for o in outputs])
            positions = torch.tensor([n + step - 1 for n in lengths])
            kv_lens = positions + 1
        q_lens = torch.tensor(q)
        cu_q = q_lens.cumsum(0)
        tables = prepare_block_tables(
            requests, kv, widths, torch.device("cpu"), len(prompts), prefill
        )
        slots = prepare_slot_mapping(positions, cu_q, kv, tables)
        set_forward_metadata(
            is_prefill=prefill,
            kv_len=kv_lens - q_lens,
            actual_seq_lengths_kv=kv_lens,
            actual_seq_lengths_q=q_lens,
            actual_seq_lengths_cu_kv=kv_lens.cumsum(0),
            actual_seq_lengths_cu_q=cu_q,
            attention_mask=~torch.tril(torch.ones(2048, 2048, dtype=torch.bool)),
            prompt_tokens=int(q_lens.sum()) if prefill else 0,
            block_table=tables,
            slot_mapping=slots,
        )
        with torch.no_grad():
            logits = model(ids, positions, forward_metadata=get_forward_metadata())
        assert logits.shape[:2] == (len(prompts), 1) and logits.dtype == torch.float32
        for i, token in enumerate(logits[:, 0].argmax(-1).tolist()):
            outputs[i].append(token)
    reset_forward_metadata()
    return outputs


@pytest.mark.parametrize("model_type", FAMILIES)
def test_converted_model_runs_token_exact_in_the_real_executor(
    framework_root, model_type, tmp_path
):
    out = tmp_path / "out"
    options = ApplyOptions(target="cann-recipes", config_overrides=OVERRIDES.get(model_type, {}))
    apply_model(model_type, out, options)
    config = _tiny_config(out)
    reference, hf_config = _reference(model_type, config)
    expected = [_greedy_reference(reference, p) for p in PROMPTS]
    sys.path.insert(0, str(out))  # the output's models/<type>/ beside the checkout's models/
    try:
        with npu_standin(framework_root=framework_root):
            module, model, _ = _executor_model(out, model_type, hf_config, reference)
            got = _greedy_in_executor(module, model, PROMPTS)
    finally:
        sys.path.remove(str(out))
        for name in [n for n in sys.modules if n == "models" or n.startswith("models.")]:
            del sys.modules[name]
    assert got == expected
