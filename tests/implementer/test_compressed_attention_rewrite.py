"""DeepSeek-V4's compressed attention converted in framework mode (KVR028 / KVR029), slow: what
apply writes, and that a sliding + CSA + HCA model verifies token-exact against
transformers with prompts whose CSA entries outnumber the indexer's top-k, and that attending
every entry instead of the selection fails verify."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from kvskill.analyzer.compressed_features import converted_attention
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.shrink import COMPRESSED_INDEX_TOPK

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from captured_runs import decode_eager_and_captured  # noqa: E402

MODEL = "deepseek_v4"
#: one layer of each kind
LAYERS = {
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
}  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("v4") / "out"
    apply_model(MODEL, out, ApplyOptions(config_overrides=LAYERS))
    return out


@pytest.mark.slow  # apply analyzes and rewrites V4's 1555-line file: about 20 s
def test_apply_writes_the_paged_compressed_attention(converted):
    text = (converted / f"modeling_{MODEL}.py").read_text()
    forward = text[text.index("class DeepseekV4Attention") : text.index("class DeepseekV4Hyper")]
    # the source's cache update, compressor call and kernel are gone from the forward
    assert "cache.update(kv, kv" not in forward and "attention_interface(" not in forward
    for call in (
        'self.update_cache(md.slot_mapping["win_kv"]',
        "torch.ops.custom.npu_sparse_attn_sharedkv(",
        "ori_kv=self.win_kv",
        "sinks=self.sinks",
        "softmax_scale=self.scaling",
        ".compressor(",  # custom.compressor over the state rows
        "torch_npu.npu_lightning_indexer(",
        'manager_key=f"c{ratio}a_cmp_state"',
    ):
        assert call in forward, call
    # compressed entries hold block_size rows of compress_ratio tokens, as the framework declares
    assert "entry.block_size = self.block_size * entry.compress_ratio" in text
    # analyze knows its own output (apply on it is refused, naming the converted class)
    assert converted_attention(text, "m.py").startswith("DeepseekV4Attention (m.py:")


@pytest.mark.slow
def test_verify_passes_and_fails_when_every_entry_is_attended(tmp_path, converted):
    options = VerifyOptions(num_prompts=2, max_new_tokens=4)
    report = verify_directory(converted, options)
    assert report.error is None, report.error
    assert report.passed, report.failures
    # the prompts' CSA entries (one per 4 tokens) outnumber the shrunk top-k
    assert max(r.prompt_len for r in report.prompts) // 4 > COMPRESSED_INDEX_TOPK
    mutant = tmp_path / "all-entries"
    shutil.copytree(converted, mutant)
    path = mutant / f"modeling_{MODEL}.py"
    text = path.read_text()
    selection = "self.select_entries(hidden, q_residual, positions, md)"
    assert text.count(selection) == 1
    path.write_text(text.replace(selection, "None"))
    bad = verify_directory(
        mutant, VerifyOptions(num_prompts=2, max_new_tokens=4, trust_remote_code=True)
    )
    assert not bad.passed
    assert bad.max_logit_diff > 100 * bad.atol


#: the converted file's dims shrunk for a runtime test (the code does not depend on them)
TINY_DIMS = {
    "vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32,
    "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": 32,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "index_n_heads": 8, "index_head_dim": 16,
    "index_topk": 4,
}  # fmt: skip


@pytest.mark.slow  # dynamo traces the 3-layer decode step once: about 15 s
def test_the_decode_step_is_captured_whole_and_decodes_as_eager(tmp_path, converted, monkeypatch):
    import json

    from kvskill.runtime import LLM, SamplingParams
    from kvskill.runtime.captured_decode import BACKEND_ENV

    tiny = tmp_path / "tiny"
    shutil.copytree(converted, tiny)
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, **TINY_DIMS}))
    monkeypatch.setenv(BACKEND_ENV, "eager")
    # two requests decoding together (bucket 2): the first crosses positions 127 (an HCA
    # entry closes) and 131 (a CSA entry), so the captured step pools and writes both kinds
    prompts = [[(7 * i) % 63 + 1 for i in range(125)], [5, 9, 33, 7, 2, 8, 11]]

    def make_llm(graph: bool):
        return LLM(tiny, random_weights=True, seed=1, block_size=16, num_blocks=64,
                   max_num_seqs=2, max_model_len=256, cpu_only_shapes=True,
                   trust_remote_code=True, graph=graph)  # fmt: skip

    runs = decode_eager_and_captured(
        make_llm, prompts, SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert runs.graph_tokens == runs.eager_tokens
    assert runs.worst_logit_diff <= 1e-5
    stats = runs.graph_llm.engine.captured_decode.stats
    assert stats.compiled_buckets == [2]
    assert stats.num_replays == 6 and stats.num_eager_decode_steps == 0
