"""``verify`` checks the checkpoint the user has: an MoE checkpoint whose experts are stored
one per expert (as hub checkpoints store them) verifies on its real weights.

The original is loaded by transformers' own ``from_pretrained`` (transformers 5 fuses the
per-expert tensors on load), the converted model by the runtime's loader; both must read the
same weights and give the same tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_tokens import NEW_TOKENS, PROMPTS, hf_tokens
from kvskill.cli import main
from kvskill.core.errors import BadInputError
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.report import Checked
from kvskill.verify.table import format_table
from kvskill.verify.weights import choose_checked, condition_weights

MOE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    num_experts=4,
    num_experts_per_tok=2,
)


def per_expert_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """MODEL's tensors under the names hub MoE checkpoints use: one gate, up and down
    matrix per expert. transformers 5 holds the experts fused
    (``experts.gate_up_proj`` [experts, 2 * inter, hidden], gate rows first, and
    ``experts.down_proj`` [experts, hidden, inter]); transformers 4 already per expert."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for expert, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                state[f"{prefix}{expert}.gate_proj.weight"] = gate.contiguous()
                state[f"{prefix}{expert}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for expert, down in enumerate(tensor):
                state[f"{prefix}{expert}.down_proj.weight"] = down.contiguous()
        else:
            state[name] = tensor.contiguous()
    return state


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """(converted directory, the original's greedy tokens on PROMPTS, prompts file)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "qwen3_moe" not in CONFIG_MAPPING:  # transformers 4.46 predates Qwen3
        pytest.skip("the installed transformers has no qwen3_moe")
    root = tmp_path_factory.mktemp("moe_per_expert")
    source = root / "checkpoint"
    source.mkdir()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **MOE))
    condition_weights(model, seed=7)  # random weights whose greedy tokens are not a tie
    model.config.save_pretrained(source)
    save_file(per_expert_state(model), str(source / "model.safetensors"), {"format": "pt"})
    names = set(load_file(str(source / "model.safetensors")))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    out = root / "converted"
    apply_model(str(source), out, ApplyOptions())
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(",".join(map(str, p)) for p in PROMPTS) + "\n")
    return out, hf_tokens(model.eval()), prompts


def test_verify_checks_the_real_weights_of_a_per_expert_moe_checkpoint(moe_checkpoint):
    out, expected, prompts = moe_checkpoint
    options = VerifyOptions(prompts_file=prompts, max_new_tokens=NEW_TOKENS)
    report = verify_directory(out, options)
    assert report.checked is Checked.REAL_WEIGHTS and not report.shrunk
    assert report.passed, report.failures()
    assert report.low_precision is None, "float32 keeps the exact check"
    assert report.max_logit_diff <= report.atol
    # the reference is the user's model: its tokens are those of the model that was saved
    assert [p.reference_tokens for p in report.prompts] == expected
    assert [p.runtime_tokens for p in report.prompts] == expected
    assert format_table(report).splitlines()[0] == f"checked: the real weights of {out}"


def test_no_shrink_on_the_per_expert_checkpoint_passes(moe_checkpoint, capsys):
    # issue 28: "weights ... do not match the original model: unexpected
    # ['model.layers.0.mlp.experts.0.down_proj.weight', ...]"
    out, _, _ = moe_checkpoint
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(out), "--no-shrink", "--format", "json", "--num-prompts", "2"])
    report = json.loads(capsys.readouterr().out)
    assert exc.value.code == 0, report["failures"]
    assert report["checked"] == "real_weights"
    assert report["checked_line"] == f"checked: the real weights of {out}"


def test_shrink_checks_a_random_twin_and_says_so(moe_checkpoint, capsys):
    out, _, _ = moe_checkpoint
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(out), "--shrink", "--num-prompts", "2"])
    text = capsys.readouterr().out
    assert exc.value.code == 0, text
    assert (
        text.splitlines()[0] == f"checked: a shrunk random-weight twin of {out} (not its weights)"
    )


def test_bfloat16_on_the_real_weights_gives_the_noise_floor_verdict(moe_checkpoint):
    out, _, prompts = moe_checkpoint
    report = verify_directory(out, VerifyOptions(dtype="bfloat16", prompts_file=prompts))
    verdict = report.low_precision
    assert report.checked is Checked.REAL_WEIGHTS
    assert verdict is not None and report.passed, report.failures()
    assert verdict.noise_floor > 0 and verdict.ratio < verdict.ratio_limit
    assert report.to_dict()["low_precision"]["ratio"] == pytest.approx(verdict.ratio)


def test_a_loader_reading_other_weights_is_reported(moe_checkpoint, monkeypatch):
    from kvskill.verify import weights as real_weights

    out, _, _ = moe_checkpoint
    load = real_weights.load_real_converted

    def one_expert_off(directory, dtype, seed):
        model = load(directory, dtype, seed)
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "experts" in n).mul_(1.5)
        return model

    monkeypatch.setattr("kvskill.verify.flow.load_real_converted", one_expert_off)
    report = verify_directory(out, VerifyOptions(num_prompts=1))
    assert not report.passed
    assert "read other weights than the original's loader" in report.error
    assert "experts" in report.error


def test_weights_that_do_not_fit_fall_back_to_the_twin_unless_no_shrink(
    moe_checkpoint, monkeypatch
):
    out, _, _ = moe_checkpoint
    assert choose_checked(out, None, "float32") == (Checked.REAL_WEIGHTS, None)
    monkeypatch.setattr("kvskill.runtime.loader.available_memory_bytes", lambda device: 1 << 10)
    checked, note = choose_checked(out, None, "bfloat16")
    assert checked is Checked.SHRUNK_TWIN and "checked a shrunk random-weight twin" in note
    with pytest.raises(BadInputError, match="--shrink"):
        choose_checked(out, False, "float32")
    assert choose_checked(out, True, "float32") == (Checked.SHRUNK_TWIN, None)


def test_a_directory_without_weights_is_checked_on_a_twin(tmp_path):
    directory = tmp_path  # choose_checked looks for *.safetensors only
    (directory / "config.json").write_text("{}")
    assert choose_checked(directory, None, "float32") == (Checked.SHRUNK_TWIN, None)
    assert choose_checked(directory, False, "float32") == (Checked.RANDOM_WEIGHTS, None)


def test_a_checkpoint_that_does_not_fit_the_model_is_bad_input(moe_checkpoint, tmp_path):
    import shutil

    from kvskill.runtime.loader import load_model
    from safetensors.torch import load_file, save_file

    out, _, _ = moe_checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(out, broken, symlinks=False)
    state = load_file(str(broken / "model.safetensors"))
    state["model.norm.scale"] = state.pop("model.norm.weight")
    (broken / "model.safetensors").unlink()
    save_file(state, str(broken / "model.safetensors"), {"format": "pt"})
    # the loader's retry through transformers' conversions (absent before transformers 5)
    # ends in the mismatch itself, never in an ImportError
    with pytest.raises(BadInputError, match="do not match"):
        load_model(broken, trust_remote_code=True)
    with pytest.raises(BadInputError, match="do not match the original qwen3_moe"):
        verify_directory(broken, VerifyOptions(num_prompts=1, trust_remote_code=True))


def test_a_remote_code_checkpoint_verifies_on_its_real_weights(tmp_path):
    from kvskill.runtime.loader import import_model_package
    from remote_model import write_remote_model
    from safetensors.torch import save_file

    source = write_remote_model(tmp_path / "remote")
    package = import_model_package(source.resolve())
    modeling = __import__(f"{package}.modeling_tiny_remote", fromlist=["_"])
    config = modeling.TinyRemoteConfig.from_pretrained(str(source))
    model = modeling.TinyRemoteForCausalLM(config)
    condition_weights(model, seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # tied: stored twice
    save_file(state, str(source / "model.safetensors"), {"format": "pt"})
    out = tmp_path / "converted"
    apply_model(str(source), out, ApplyOptions())
    report = verify_directory(out, VerifyOptions(trust_remote_code=True, num_prompts=2))
    assert report.checked is Checked.REAL_WEIGHTS
    assert report.passed, report.failures()


def test_a_buffer_no_state_dict_holds_is_compared_too():
    from kvskill.verify.weights import weights_differ

    class Rotary(torch.nn.Module):
        def __init__(self, base: float) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)
            self.register_buffer("inv_freq", torch.tensor([1.0, base]), persistent=False)

    reference, converted = Rotary(0.5), Rotary(0.5)
    converted.load_state_dict(reference.state_dict())
    assert weights_differ(reference, converted) is None
    # transformers 5's from_pretrained of remote code leaves such a buffer uninitialised
    reference.inv_freq.zero_()
    assert "inv_freq" in weights_differ(reference, converted)
