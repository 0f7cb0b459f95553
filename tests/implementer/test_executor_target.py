"""``apply --target cann-recipes``: the executor's form of a conversion, and its hosting here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kvskill.analyzer.lint.runner import lint_source
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.executor_target import framework_imports
from kvskill.implementer.writer import apply_model
from kvskill.runtime.loader import load_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions

TREE = "models/qwen3_paged"
SMALL_QWEN3 = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


@pytest.fixture(scope="module")
def qwen3_executor(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("executor") / "out"
    apply_model("qwen3", out, ApplyOptions(target="cann-recipes"))
    return out


@pytest.fixture(scope="module")
def qwen3_runtime(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runtime") / "out"
    apply_model("qwen3", out, ApplyOptions())
    return out


def test_the_executor_tree_is_written_beside_the_hosted_file(qwen3_executor):
    files = sorted(str(p.relative_to(qwen3_executor)) for p in qwen3_executor.rglob("*.*"))
    assert files == [
        "config.json",
        "kvskill_plan.json",
        "modeling_qwen3.py",
        f"{TREE}/config/qwen3_paged.yaml",
        f"{TREE}/models/configuration_qwen3_paged.py",
        f"{TREE}/models/modeling_qwen3_paged.py",
        f"{TREE}/support_models_entry.txt",
    ]
    root = (qwen3_executor / "modeling_qwen3.py").read_text()
    assert (qwen3_executor / TREE / "models/modeling_qwen3_paged.py").read_text() == root
    plan = json.loads((qwen3_executor / "kvskill_plan.json").read_text())
    assert plan["conversion"]["target"] == "cann-recipes"
    config = json.loads((qwen3_executor / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_qwen3.Qwen3ForCausalLMExecutor"
    entry = (qwen3_executor / TREE / "support_models_entry.txt").read_text()
    assert '"qwen3_paged": [' in entry
    assert '("models.qwen3_paged.models.modeling_qwen3_paged", "Qwen3ForCausalLMExecutor")' in entry
    assert '("models.qwen3_paged.models.configuration_qwen3_paged", "Qwen3Config")' in entry
    settings = yaml.safe_load((qwen3_executor / TREE / "config/qwen3_paged.yaml").read_text())
    assert settings["model_config"]["model_name"] == "qwen3_paged"
    assert settings["scheduler_config"]["block_size"] == plan["block_size"]
    assert settings["parallel_config"]["attn_tp_size"] == plan["attn_tp_size"]


def test_the_executor_file_differs_from_the_runtime_one_in_imports_and_its_class_only(
    qwen3_executor, qwen3_runtime
):
    runtime = (qwen3_runtime / "modeling_qwen3.py").read_text()
    executor = (qwen3_executor / "modeling_qwen3.py").read_text()
    assert not [
        line
        for line in executor.splitlines()
        if line.startswith(("from kvskill", "import kvskill"))
    ]
    assert (
        "from executor.core.kv_cache import CacheEntry, LayerCacheInfo, ModelCacheInfo" in executor
    )
    assert "from executor.utils.forward_metadata import get_forward_metadata" in executor
    assert "\nimport torch_npu\n" in executor
    body, executor_class = executor.split("\n\nclass Qwen3ForCausalLMExecutor(Qwen3ForCausalLM):")
    assert framework_imports(runtime).rstrip("\n") == body.rstrip("\n")
    assert "def load_weights(self, weights)" in executor_class
    assert lint_source(executor, "modeling_qwen3.py") == []


def test_framework_imports_keep_what_the_framework_does_not_define():
    source = (
        "from kvskill.runtime import MambaCacheEntry, gather_ssm_states\n"
        "from kvskill.runtime.ops import fla, torch_npu\n"
    )
    assert framework_imports(source) == (
        "from executor.core.kv_cache import MambaCacheEntry\n"
        "from kvskill.runtime import gather_ssm_states\n"
        "import torch_npu\n"
        "from kvskill.runtime.ops import fla\n"
    )


def test_the_hosted_class_is_the_executor_one(tmp_path):
    out = tmp_path / "out"
    apply_model("qwen3", out, ApplyOptions(target="cann-recipes", config_overrides=SMALL_QWEN3))
    model = load_model(out, random_weights=True, read_weights=False).model
    assert type(model).__name__ == "Qwen3ForCausalLMExecutor"
    assert model.infer_config.scheduler_config.block_size == model.block_size


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (ApplyOptions(target="cann-recipes", deploy_mode="standalone"), "writes framework mode"),
        (ApplyOptions(target="cann-recipes", kv_mode="legacy"), "paged caches only"),
    ],
)
def test_what_the_executor_cannot_serve_is_refused(tmp_path, options, message):
    from kvskill.core.errors import BadInputError

    with pytest.raises(BadInputError, match=message):
        apply_model("qwen3", tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
def test_the_executor_form_verifies_in_the_bundled_runtime(tmp_path, model_type):
    out = tmp_path / "out"
    apply_model(model_type, out, ApplyOptions(target="cann-recipes"))
    report = verify_directory(out, VerifyOptions())
    assert report.passed, report.error or report.chains
