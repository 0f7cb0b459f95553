"""The opt-in fused CPU layers: the one-pass kernels agree with PyTorch's formulas to fp32
rounding, only modules that agree with their own forward are switched, inputs the kernels do
not cover fall back, and a converted model's greedy tokens are unchanged with it on."""

import pytest
import torch
from kvskill.runtime.fused_layers import fuse_layers, unavailable_reason
from kvskill.runtime.ops.cpu_kernels import build
from kvskill.runtime.ops.cpu_kernels.fused_elementwise import rms_norm, rope, silu_mul
from torch import nn

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _rms_norm_reference(x, weight, eps):
    # transformers' LlamaRMSNorm / Qwen3RMSNorm in fp32
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


@pytest.mark.parametrize("shape", [(1, 7), (5, 64), (3, 4, 130), (2, 33, 1024)])
def test_rms_norm_kernel_agrees_with_the_formula(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    weight = torch.randn(shape[-1], generator=g)
    got = rms_norm(x, weight, 1e-6)
    assert got is not None and got.is_contiguous() and got.shape == x.shape
    torch.testing.assert_close(got, _rms_norm_reference(x, weight, 1e-6), rtol=2e-6, atol=1e-6)


def test_rms_norm_reads_head_columns_of_a_fused_projection_in_place():
    # q's columns of a [tokens, q + k + v] output, viewed as heads: rows two strides deep
    fused = torch.randn(1, 9, 4 * 16 + 2 * 2 * 16)
    q = fused[..., : 4 * 16].view(1, 9, 4, 16)
    assert not q.is_contiguous()
    weight = torch.randn(16)
    got = rms_norm(q, weight, 1e-5)
    torch.testing.assert_close(got, _rms_norm_reference(q, weight, 1e-5), rtol=2e-6, atol=1e-6)


def test_rms_norm_declines_what_it_does_not_cover():
    weight = torch.ones(8)
    assert rms_norm(torch.randn(4, 8, dtype=torch.bfloat16), weight, 1e-6) is None
    assert rms_norm(torch.randn(8, 4).t(), weight, 1e-6) is None  # strided last dim
    assert rms_norm(torch.randn(4, 8), torch.ones(9), 1e-6) is None
    # three levels of strides between rows
    deep = torch.randn(2, 3, 4, 16)[:, :, :, :8][:, ::2][::1, :, ::2]
    assert rms_norm(deep, weight, 1e-6) is None
    with build.disabled():
        assert rms_norm(torch.randn(4, 8), weight, 1e-6) is None


def test_silu_mul_kernel_agrees_with_torch_over_the_whole_range():
    values = torch.tensor([-100.0, -88.0, -20.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 5.0, 20.0, 90.0])
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([values, torch.randn(1000, generator=g) * 8]).view(1, -1)
    up = torch.randn(gate.shape, generator=g)
    got = silu_mul(gate, up)
    torch.testing.assert_close(got, nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-30)


def test_silu_mul_reads_the_halves_of_one_gate_up_output():
    both = torch.randn(2, 5, 2 * 48)
    gate, up = both[..., :48], both[..., 48:]
    got = silu_mul(gate, up)
    assert got.is_contiguous() and got.shape == (2, 5, 48)
    torch.testing.assert_close(got, nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-7)
    assert silu_mul(gate, up[..., :47]) is None
    assert silu_mul(gate.double(), up.double()) is None


class _RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6, offset=0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size))
        self.variance_epsilon = eps
        self.offset = offset

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x.float() * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight + self.offset) * x


class _MLP(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.gate_proj = nn.Linear(16, 40, bias=False)
        self.up_proj = nn.Linear(16, 40, bias=False)
        self.down_proj = nn.Linear(40, 16, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _block(norm_offset=0.0, act=None):
    torch.manual_seed(0)
    return nn.ModuleDict({"norm": _RMSNorm(16, offset=norm_offset), "mlp": _MLP(act or nn.SiLU())})


@pytest.mark.parametrize("prepack", [False, True])
def test_rms_norm_and_gated_mlp_are_switched_and_agree(prepack):
    block = _block()
    x = torch.randn(3, 7, 16)
    with torch.inference_mode():
        expected = block["mlp"](block["norm"](x))
    if prepack:
        from kvskill.runtime.prepacked_linear import prepack_linears

        prepack_linears(block)
    assert fuse_layers(block) == 2
    assert "_kvskill_own_forward" in vars(block["norm"])
    with torch.inference_mode():
        got = block["mlp"](block["norm"](x))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_modules_that_compute_something_else_keep_their_own_code():
    # Gemma-style (1 + weight) norm and a GELU MLP: the same shape, other formulas
    block = _block(norm_offset=1.0, act=nn.GELU())
    assert fuse_layers(block) == 0
    assert "_kvskill_own_forward" not in vars(block["norm"])
    assert "forward" not in vars(block["mlp"])


def test_a_switched_module_runs_its_own_forward_for_other_dtypes():
    block = _block()
    fuse_layers(block)
    block.double()
    x = torch.randn(2, 16, dtype=torch.float64)
    with torch.inference_mode():
        got = block["norm"](x)
    expected = block["norm"].weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(got, expected)


def test_fusing_needs_the_kernels():
    with build.disabled():
        assert unavailable_reason() is not None
        with pytest.raises(RuntimeError, match="cannot fuse layers"):
            fuse_layers(_block())


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_reference(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rope_interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J style: rotates pairs (x0, x1), (x2, x3)... instead of halves."""

    def rotate(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


@pytest.mark.parametrize("tokens,heads,dim", [(1, 2, 8), (7, 4, 16), (300, 16, 128)])
def test_rope_kernel_is_bit_for_bit_the_formula_on_the_models_layout(tokens, heads, dim):
    q = torch.randn(1, tokens, heads, dim).transpose(1, 2)  # q_proj(x).view(..).transpose
    cos, sin = torch.randn(1, tokens, dim), torch.randn(1, tokens, dim)
    expected, _ = _rope_reference(q, q, cos, sin)
    got = rope(q, cos, sin)
    assert torch.equal(got, expected)
    # laid out as [1, T, H, D]: the model's transpose(1, 2).reshape(T, H, D) is a view
    assert got.transpose(1, 2).is_contiguous()
    # a contiguous input gives a contiguous result, as PyTorch's passes do
    q = q.contiguous()
    got = rope(q, cos, sin)
    assert torch.equal(got, _rope_reference(q, q, cos, sin)[0]) and got.is_contiguous()
    # a strided input (one head's columns of a wider output) is read in place
    wide = torch.randn(1, tokens, heads, dim + 6)[..., 3 : 3 + dim].transpose(1, 2)
    assert torch.equal(rope(wide, cos, sin), _rope_reference(wide, wide, cos, sin)[0])


def test_rope_kernel_declines_what_it_does_not_cover():
    q = torch.randn(1, 4, 5, 8)
    cos = torch.randn(1, 5, 8)
    assert rope(q.double(), cos.double(), cos.double()) is None
    assert rope(torch.randn(2, 4, 5, 8), cos, cos) is None  # a batch of two
    assert rope(q, torch.randn(2, 5, 8), torch.randn(2, 5, 8)) is None  # angles per batch row
    assert rope(torch.randn(1, 4, 5, 7), torch.randn(1, 5, 7), torch.randn(1, 5, 7)) is None
    assert rope(q, torch.randn(1, 5, 4), torch.randn(1, 5, 4)) is None  # partial rotary


def _model_of_file(monkeypatch, name, function):
    """A module namespace ``name`` holding ``function`` and an attention class using it."""
    import sys
    import types

    namespace = types.ModuleType(name)
    namespace.apply_rotary_pos_emb = function

    class Attention(nn.Module):
        head_dim = 8

        def forward(self, q, k, cos, sin):
            return namespace.apply_rotary_pos_emb(q, k, cos, sin)

    Attention.__module__ = name
    monkeypatch.setitem(sys.modules, name, namespace)
    return namespace, nn.ModuleList([Attention(), Attention()])


def test_the_files_rope_function_is_switched_when_bit_for_bit_equal(monkeypatch):
    namespace, model = _model_of_file(monkeypatch, "kvskill_test_rope_file", _rope_reference)
    assert fuse_layers(model) == 2
    switched = namespace.apply_rotary_pos_emb
    assert switched is not _rope_reference and switched._kvskill_own_rope is _rope_reference
    q = torch.randn(1, 6, 4, 8).transpose(1, 2)
    k = torch.randn(1, 6, 2, 8).transpose(1, 2)
    cos, sin = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    got, expected = model[0](q, k, cos, sin), _rope_reference(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # arguments the kernel does not take run the file's own function
    q2 = torch.randn(1, 6, 4, 8)
    got = switched(q2, q2, cos, sin, unsqueeze_dim=2)
    assert torch.equal(got[0], _rope_reference(q2, q2, cos, sin, unsqueeze_dim=2)[0])
    # a second model of the same file finds it switched and keeps it
    assert fuse_layers(model) == 2 and namespace.apply_rotary_pos_emb is switched


def test_a_rope_of_another_formula_keeps_the_files_function(monkeypatch):
    namespace, model = _model_of_file(monkeypatch, "kvskill_test_rope_gptj", _rope_interleaved)
    assert fuse_layers(model) == 0
    assert namespace.apply_rotary_pos_emb is _rope_interleaved


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("fused") / "qwen3"
    small = {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
    }  # fmt: skip
    apply_model("qwen3", out, ApplyOptions(config_overrides=small))
    return out


def test_converted_qwen3_greedy_tokens_are_the_same_with_fused_layers(qwen3_dir):
    from kvskill.runtime import LLM, SamplingParams

    prompts = [[1, 5, 9, 14, 3, 7, 2], [4, 4, 8], list(range(3, 40))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs, counts = {}, {}
    # off: the exact run; on: prepacked linears and fused layers, the head unscreened
    fast = {"prepack_linear": True, "fuse_layers": True, "screen_output_head": False}
    for on in (False, True):
        llm = LLM(
            qwen3_dir, random_weights=True, seed=0, block_size=4, cpu_only_shapes=True,
            **(fast if on else {"exact": True}),
        )  # fmt: skip
        outs[on] = [o.token_ids for o in llm.generate(prompts, params)]
        counts[on] = llm.num_fused_layers
    assert outs[True] == outs[False]
    layers = llm.config.num_hidden_layers
    # per layer: input, post-attention, q and k norms, the MLP and the attention's rotary
    # embedding; plus the final norm
    assert counts == {False: 0, True: 6 * layers + 1}


def test_fuse_layers_with_tensor_parallel_is_bad_input(qwen3_dir):
    from kvskill.core.errors import BadInputError
    from kvskill.runtime import LLM

    with pytest.raises(BadInputError, match="one process"):
        LLM(qwen3_dir, random_weights=True, fuse_layers=True, tensor_parallel_size=2)


def test_run_fuse_layers_reports_the_switched_modules_and_keeps_the_toy_tokens(tmp_path, capsys):
    import json
    import sys
    from pathlib import Path

    from kvskill.cli import main
    from kvskill.core.errors import ExitCode

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    from toy_factory import write_toy_dir

    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    common = [str(toy_dir), "--trust-remote-code", "--prompt-ids", "1,2,3,4,5;6,7,8"]
    common += ["--max-tokens", "5", "--ignore-eos"]
    reports = {}
    only = ["--fuse-layers", "--no-prepack-linear", "--no-screen-output-head"]
    for on, flags in ((False, ["--exact"]), (True, only)):
        with pytest.raises(SystemExit) as exc:
            main(["run", *common, *flags, "--format", "json"])
        out, _ = capsys.readouterr()
        assert ExitCode(exc.value.code) == ExitCode.OK, out
        reports[on] = json.loads(out)
    assert reports[False]["fused_layers"] == 0
    # the toy's RMSNorms (its MLP is not gated)
    assert reports[True]["fused_layers"] > 0
    tokens = {k: [r["token_ids"] for r in v["requests"]] for k, v in reports.items()}
    assert tokens[True] == tokens[False]
    with pytest.raises(SystemExit):
        main(["run", *common, "--fuse-layers"])
    table, _ = capsys.readouterr()
    assert "fused layers" in table
