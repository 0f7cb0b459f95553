"""Framework models from a real cann-recipes-infer checkout, run on a CPU through the stand-in.

Opt-in: set KVSKILL_CANN_RECIPES to a checkout (the pinned commit is fbc225d). The framework's
own requirements (its models' requirements.txt: datasets, loguru, ...) must be installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kvskill.runtime.ops.npu_standin import npu_standin

ROOT = os.environ.get("KVSKILL_CANN_RECIPES")
pytestmark = pytest.mark.skipif(not ROOT, reason="KVSKILL_CANN_RECIPES is not set")

#: imported at the top of the framework's executor package
FRAMEWORK_REQUIREMENTS = ("datasets", "loguru", "yaml")


@pytest.fixture
def framework_root() -> Path:
    for name in FRAMEWORK_REQUIREMENTS:
        pytest.importorskip(name, reason=f"the framework's requirement {name} is not installed")
    root = Path(ROOT)
    if not (root / "models" / "pangu_7b").is_dir():
        pytest.fail(f"KVSKILL_CANN_RECIPES={ROOT} is not a cann-recipes-infer checkout")
    return root


@pytest.mark.parametrize(
    "module",
    [
        "models.qwen3_5.models.modeling_qwen3_5_moe",
        "models.pangu_7b.models.modeling_openpangu_dense",
    ],
)
def test_a_framework_model_imports_under_the_standin(framework_root, module):
    import importlib

    with npu_standin(framework_root=framework_root):
        imported = importlib.import_module(module)
        assert imported.torch_npu.npu_rms_norm.__module__.startswith("kvskill.runtime.ops")


def tiny_pangu(pangu, config_cls):
    config = config_cls(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        rope_theta=10000.0,
    )  # fmt: skip
    config.torch_dtype = config.dtype = torch.float32
    config.rope_scaling = None  # transformers 5 fills in a default the 4.55-era code misreads
    settings = {
        "world_size": 1,
        "exe_mode": "eager",
        "model_config": {"mm_quant_mode": "A16W16", "gmm_quant_mode": "A16W16"},
        "data_config": {"input_max_len": 16, "max_new_tokens": 4, "max_position_embeddings": 64},
        "parallel_config": {
            "attn_tp_size": 1,
            "moe_tp_size": 1,
            "embed_tp_size": 1,
            "lmhead_tp_size": 1,
        },
    }
    torch.manual_seed(0)
    model = pangu.PanguEmbeddedForCausalLM(config, settings).eval().float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        # what the runner does after loading a checkpoint: transpose the linear weights
        for m in model.modules():
            method = getattr(m, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(m)
    return model


def prefill(model, ids):
    """Logits of the last token of ``ids`` [1, S] from a fresh Legacy cache."""
    past = model.init_cache(ids)
    causal = ~torch.tril(torch.ones(2048, 2048, dtype=torch.bool))
    inputs = model.prepare_inputs_for_generation(
        ids, past_key_values=past, attention_mask=torch.ones_like(ids), is_prefill=True,
        share_mask_tril=causal,
    )  # fmt: skip
    return model(**inputs)[0, -1], past, inputs["position_ids"].max(dim=1)[0] + 1


def test_pangu_decodes_through_its_legacy_cache_as_a_full_prefill_would(framework_root):
    # prefill writes the cache with scatter_update_, decode reads it with BSH fused attention
    # (q_len 1); each decode step must give the logits of prefilling the whole sequence.
    with npu_standin(framework_root=framework_root), torch.no_grad():
        from models.pangu_7b.models import modeling_openpangu_dense as pangu
        from models.pangu_7b.models.configuration_openpangu_dense import PanguEmbeddedConfig

        model = tiny_pangu(pangu, PanguEmbeddedConfig)
        ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
        logits, past, kv_len = prefill(model, ids)
        for _ in range(3):
            ids = torch.cat((ids, logits.argmax().view(1, 1)), dim=1)
            step = model.prepare_inputs_for_generation(
                ids[:, -1:], past_key_values=past, is_prefill=False, kv_len=kv_len
            )
            logits = model(**step)[0, -1]
            kv_len = kv_len + 1
            torch.testing.assert_close(logits, prefill(model, ids)[0], rtol=1e-4, atol=1e-4)


def tiny_qwen3_5(q, config_cls, inference_config_cls, comm_manager_cls, *, batch_size=1):
    config = config_cls(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts_per_tok=2,
        num_experts=4, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=64,
    )  # fmt: skip
    # bf16 as the framework runs it: its gated-delta path casts q/k/v to bf16 for the operator
    config.torch_dtype = config.dtype = torch.bfloat16
    settings = {
        "model_config": {"model_name": "qwen3.5", "model_path": "unused", "exe_mode": "eager"},
        "data_config": {"dataset": "default", "input_truncated_len": 16},
        "parallel_config": {"world_size": 1, "attn_tp_size": 1, "moe_tp_size": 1,
                            "embed_tp_size": 1, "lmhead_tp_size": 1, "shared_tp_size": 1},
        "scheduler_config": {"max_new_tokens": 4, "batch_size": batch_size},
    }  # fmt: skip
    infer_config = inference_config_cls.from_dict(settings, global_rank=0, local_rank=0)
    comm = comm_manager_cls(infer_config.parallel_config)
    torch.manual_seed(0)
    model = q.Qwen3_5MoeForCausalLM(config, infer_config, comm).eval().to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # A_log sets the gated-delta decay: keep it in a trained model's range
            if name.endswith("A_log"):
                p.uniform_(-1.0, 0.0)
            else:
                p.normal_(0.0, 0.2)
        for m in model.modules():
            method = getattr(m, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(m)
    return model


def test_qwen3_5_state_mixers_decode_from_their_legacy_state_as_a_prefill_would(framework_root):
    # Layer 0 is gated delta (npu_chunk_gated_delta_rule, then npu_recurrent_gated_delta_rule
    # on the conv/recurrent states init_cache allocates), layer 1 Legacy attention
    # (scatter_update_ into k_cache/v_cache, BSH fused attention). The MoE blocks are not run
    # here: at one rank they take the expert-parallel path through groups the model registers
    # only above one rank (the whole model runs in test_framework_legacy_qwen3_5.py).
    with npu_standin(framework_root=framework_root), torch.no_grad():
        from executor.core.config import CommManager, InferenceConfig
        from executor.utils.forward_metadata import ForwardMetaData
        from models.qwen3_5.models import modeling_qwen3_5_moe as q
        from models.qwen3_5.models.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        model = tiny_qwen3_5(q, Qwen3_5MoeTextConfig, InferenceConfig, CommManager)
        causal = ~torch.tril(torch.ones(2048, 2048, dtype=torch.bool))

        def metadata(is_prefill: bool, start: int, length: int):
            q_lens, kv_lens = torch.tensor([length]), torch.tensor([start + length])
            return ForwardMetaData(
                is_prefill=is_prefill, attention_mask=causal,
                kv_len=torch.arange(length) if is_prefill else torch.tensor([start]),
                actual_seq_lengths_q=q_lens, actual_seq_lengths_cu_q=q_lens.cumsum(0),
                actual_seq_lengths_kv=kv_lens, actual_seq_lengths_cu_kv=kv_lens.cumsum(0),
            )  # fmt: skip

        def run(layer, x, start, is_prefill):
            md = metadata(is_prefill, start, x.size(0))
            if layer.layer_type == "linear_attention":
                return layer.linear_attn(x, forward_metadata=md)
            cos_sin = model.model.rotary_emb(x, torch.arange(start, start + x.size(0)))
            return layer.self_attn(
                x, position_embeddings=cos_sin, kv_len=md.kv_len, forward_metadata=md
            )

        x = torch.randn(6, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        for layer in model.model.layers:
            model.init_cache("cpu")
            whole = run(layer, x, 0, is_prefill=True)[-1]
            model.init_cache("cpu")
            run(layer, x[:5], 0, is_prefill=True)
            step = run(layer, x[5:], 5, is_prefill=False)[-1]
            torch.testing.assert_close(step.float(), whole.float(), rtol=1.6e-2, atol=2e-3)


def _converted_qwen3_5_package(framework_root: Path, tmp_path: Path) -> str:
    """kvskill's framework-Legacy conversion of the real qwen3_5 file, as an importable
    package under TMP_PATH; returns its name."""
    import json
    import shutil

    from kvskill.analyzer.analyze import analyze_model
    from kvskill.implementer.convert import ApplyOptions, convert_framework

    source = tmp_path / "source"
    source.mkdir()
    real = framework_root / "models" / "qwen3_5" / "models"
    for name in ("modeling_qwen3_5_moe.py", "configuration_qwen3_5_moe.py"):
        shutil.copy(real / name, source / name)
    # the sizes tiny_qwen3_5 builds (the rewrite reads structure; the analyzer needs sizes)
    config = {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
              "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "layer_types": ["linear_attention", "full_attention"],
              "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 16,
              "shared_expert_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
              "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}  # fmt: skip
    (source / "config.json").write_text(json.dumps(config))
    converted = convert_framework(analyze_model(str(source)), ApplyOptions()).converted
    package = tmp_path / "qwen3_5_paged"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "modeling_qwen3_5_moe.py").write_text(converted)
    shutil.copy(source / "configuration_qwen3_5_moe.py", package)
    return package.name


def test_the_converted_qwen3_5_gated_delta_layer_matches_its_legacy_rows(framework_root, tmp_path):
    # kvskill converts the real file (KVR020-022); its gated-delta layer then reads and writes
    # MambaCacheEntry blocks at block_table["Mamba"][:, 0]. Run side by side with the Legacy
    # layer on init_cache rows (request b = row b): two requests in blocks 4 and 2 of pools
    # holding random values, a packed prefill of 5 + 3 tokens, then three decode steps.
    import importlib
    import sys

    name = _converted_qwen3_5_package(framework_root, tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        with npu_standin(framework_root=framework_root), torch.no_grad():
            from executor.core.config import CommManager, InferenceConfig
            from executor.core.kv_cache.cache_utils import validate_cache_info
            from executor.utils import forward_metadata as fm
            from models.qwen3_5.models import modeling_qwen3_5_moe as q
            from models.qwen3_5.models.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

            converted = importlib.import_module(f"{name}.modeling_qwen3_5_moe")
            builders = (Qwen3_5MoeTextConfig, InferenceConfig, CommManager)
            legacy = tiny_qwen3_5(q, *builders, batch_size=2)
            paged = tiny_qwen3_5(converted, *builders, batch_size=2)
            paged.load_state_dict(legacy.state_dict())
            # the converted model's cache declaration passes the executor's own check
            info = paged.get_cache_info()
            validate_cache_info(info)
            kinds = [[c.attn_type for c in layer.caches] for layer in info.layer_infos]
            assert kinds == [["Mamba", "Mamba"], ["FullAttention", "FullAttention"]]

            legacy.init_cache("cpu")
            old, new = legacy.model.layers[0].linear_attn, paged.model.layers[0].linear_attn
            generator = torch.Generator().manual_seed(3)
            for entry in new.cache_entries:
                pool = torch.randn(6, *entry.shape, generator=generator)
                entry.tensor_setter(pool.to(torch.bfloat16))
            blocks = torch.tensor([[4], [2]], dtype=torch.int32)
            causal = ~torch.tril(torch.ones(2048, 2048, dtype=torch.bool))

            def step(is_prefill, q_lens, kv_lens, table):
                q_lens, kv_lens = torch.tensor(q_lens), torch.tensor(kv_lens)
                md = fm.ForwardMetaData(
                    is_prefill=is_prefill, attention_mask=causal,
                    actual_seq_lengths_q=q_lens, actual_seq_lengths_cu_q=q_lens.cumsum(0),
                    actual_seq_lengths_kv=kv_lens, actual_seq_lengths_cu_kv=kv_lens.cumsum(0),
                    block_table={"Mamba": table},
                )  # fmt: skip
                fm.set_forward_metadata(**vars(md))
                return md

            def states_agree():
                rows = blocks[:, 0].long()
                return all(
                    torch.equal(getattr(old, s), getattr(new, s)[rows])
                    for s in ("conv_state", "recurrent_state")
                )

            try:
                x = torch.randn(8, 32, generator=generator).to(torch.bfloat16)
                md = step(True, [5, 3], [5, 3], blocks)
                assert torch.equal(old(x, forward_metadata=md), new(x, forward_metadata=md))
                assert states_agree()
                kv_lens = [5, 3]
                for _ in range(3):
                    kv_lens = [n + 1 for n in kv_lens]
                    x = torch.randn(2, 32, generator=generator).to(torch.bfloat16)
                    md = step(False, [1, 1], kv_lens, blocks)
                    assert torch.equal(old(x, forward_metadata=md), new(x, forward_metadata=md))
                    assert states_agree()
                # the check can fail: each request reading the other's blocks changes the output
                kv_lens = [n + 1 for n in kv_lens]
                x = torch.randn(2, 32, generator=generator).to(torch.bfloat16)
                md = step(False, [1, 1], kv_lens, blocks.flip(0))
                expected = old(x, forward_metadata=md)
                assert not torch.allclose(expected, new(x, forward_metadata=md), atol=1e-2)
            finally:
                fm.reset_forward_metadata()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(f"{name}.modeling_qwen3_5_moe", None)
        sys.modules.pop(f"{name}.configuration_qwen3_5_moe", None)
        sys.modules.pop(name, None)
