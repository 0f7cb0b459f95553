"""An attention block several decoder layers share (zamba2) keeps one cache pair per layer.

transformers 5 builds one block per hybrid layer with tied weights; 4.x and vendor files hold
one instance in every hybrid layer. Both must serve the same tokens from the runtime."""

from __future__ import annotations

import pytest
from hf_generate import runtime_tokens

#: two hybrid layers, so the shared block is called from two sites
SMALL_ZAMBA2 = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_mamba_heads": 8,
    "mamba_d_state": 16,
    "mamba_ngroups": 1,
    "intermediate_size": 128,
    "vocab_size": 256,
    "num_hidden_layers": 4,
    "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
    "num_mem_blocks": 1,
}


@pytest.mark.slow
def test_one_block_held_by_two_layers_serves_each_layer_its_own_cache(tmp_path):
    import torch
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.runtime import LLM

    out = tmp_path / "zamba2"
    apply_model("zamba2", out, ApplyOptions(config_overrides=SMALL_ZAMBA2))
    code = (out / "modeling_zamba2.py").read_text()
    assert "self.use_call_site(layer_idx)" in code
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 6, 13)]
    # exact: the two forms are compared bit for bit
    tied = LLM(out, exact=True, random_weights=True, seed=3, block_size=4, num_blocks=64)
    expected = runtime_tokens(tied, prompts)

    # the same weights with one block instance in both hybrid layers (the transformers 4 form)
    shared = type(tied.model)(tied.model.config)
    shared.load_state_dict(tied.model.state_dict())
    layers = shared.model.layers
    layers[3].shared_transformer = layers[1].shared_transformer
    info = shared.get_cache_info()
    attention = [i for i in info.layer_infos if i.caches[0].attn_type == "FullAttention"]
    assert len(attention) == 2  # one per calling layer, not one per module
    llm = LLM(shared, exact=True, seed=3, block_size=4, num_blocks=64)
    block = layers[1].shared_transformer.self_attn
    assert sorted(block.site_caches) == [1, 3]
    assert block.site_caches[1]["k_cache"].data_ptr() != block.site_caches[3]["k_cache"].data_ptr()
    assert runtime_tokens(llm, prompts) == expected
    with pytest.raises(KeyError, match="called for layer 2"):
        block.use_call_site(2)
