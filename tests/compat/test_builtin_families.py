"""The installed transformers' own families: apply -> verify token-exact, in both deploy modes.

Under transformers 4.46 these are the hand-written eager attention (matmul, softmax, matmul),
the ``XSdpaAttention`` / ``XFlashAttention2`` variants sharing ``XAttention.__init__`` and
``num_logits_to_keep``; under 4.5x the attention interface; under 5.x what the main suite
checks too.
"""

from __future__ import annotations

import json

import pytest

from tests.compat.roundtrip import assert_token_exact, family_exists, round_trip

pytestmark = [pytest.mark.compat, pytest.mark.slow]

#: families with a causal LM in every supported transformers (qwen3 from 4.51 on); a family
#: missing from the installed version is skipped, and at least six must run. Each adds a
#: shape of its own (MoE, biases, fused qkv, layer norms, GeGLU, head_dim); mistral and olmo,
#: llama-shaped, are left to the main suite to keep .ci/run inside its budget.
FAMILIES = (
    "llama",
    "mixtral",
    "qwen2",
    "phi3",
    "starcoder2",
    "granite",
    "gemma",
    "qwen3",
)
PRESENT = [f for f in FAMILIES if family_exists(f)]
#: standalone mode 1 (contiguous BSH caches) on one family, to keep the suite short
STANDALONE = ("llama",)


def test_at_least_six_families_are_installed():
    assert len(PRESENT) >= 6, PRESENT


@pytest.mark.parametrize("family", PRESENT)
def test_framework_conversion_is_token_exact(family, tmp_path):
    assert_token_exact(round_trip(family, tmp_path / family))


@pytest.mark.parametrize("family", [f for f in STANDALONE if f in PRESENT])
def test_standalone_conversion_is_token_exact(family, tmp_path):
    assert_token_exact(round_trip(family, tmp_path / family, "standalone"))


def _attention_classes() -> dict[str, str]:
    """llama's ``{attn_implementation: class name}`` when it picks its attention class from a
    dict (transformers 4.46), else {} (one class with an attention interface)."""
    from transformers.models.llama import modeling_llama

    table = getattr(modeling_llama, "LLAMA_ATTENTION_CLASSES", None) or {}
    return {impl: cls.__name__ for impl, cls in table.items()}


@pytest.mark.skipif(not _attention_classes(), reason="llama has one attention class here")
def test_every_attention_variant_of_a_family_is_converted_and_runs(tmp_path):
    # The variants share LlamaAttention.__init__: it alone declares the caches; each variant's
    # forward gets its seam, and the converted model runs token-exact whichever is chosen.
    classes = _attention_classes()
    out = tmp_path / "llama"
    assert_token_exact(round_trip("llama", out))
    source = (out / "modeling_llama.py").read_text()
    assert source.count("self.cache_entries = [") == 1
    assert source.count("torch_npu.npu_fused_infer_attention_score(") == len(classes)
    assert ".update(key_states, value_states, self.layer_idx" not in source
    for impl in classes:
        if impl == "eager":
            continue  # the default when the runtime builds the model from its config
        variant = tmp_path / impl
        variant.mkdir()
        for path in out.iterdir():
            (variant / path.name).write_bytes(path.read_bytes())
        config = json.loads((variant / "config.json").read_text())
        config["attn_implementation"] = impl
        (variant / "config.json").write_text(json.dumps(config))
        from kvskill.verify.flow import verify_directory
        from kvskill.verify.options import VerifyOptions

        assert_token_exact(verify_directory(variant, VerifyOptions(trust_remote_code=True)))
