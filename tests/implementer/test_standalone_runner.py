"""The generated standalone runner: rendering, and what it feeds the model step by step.

The runner is exercised on a recording stand-in model (no transformers), so every metadata
field the layers would read - slot mapping, block table, kv_len, actual sequence lengths,
positions - is checked against the formulas of the static layout, and the greedy tokens
against a next-token rule that reveals which position's logits the runner picked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jinja2
import libcst as cst
import pytest
import torch
from kvskill.analyzer import analyze_model
from kvskill.analyzer.lint import lint_source
from kvskill.implementer.snippets import render
from kvskill.implementer.standalone import StandaloneSpec, render_runner
from kvskill.runtime import (
    CacheEntry,
    LayerCacheInfo,
    ModelCacheInfo,
    get_forward_metadata,
    prepare_slot_mapping,
)
from kvskill.verify.drivers.runner import import_runner
from torch import nn

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64
#: (model, kv_mode) pairs whose runner is rendered: modes 1, 2 (full and sliding) and 3
RENDERED = [
    ("qwen3", "contiguous"),
    ("qwen3", "paged"),
    ("gpt_oss", "paged"),
    ("deepseek_v3", "paged"),
]


class _Attention(nn.Module):
    def __init__(self, attn_type: str) -> None:
        super().__init__()
        self.k_cache = torch.Tensor([])
        self.v_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(
                cache_name=name,
                attn_type=attn_type,
                dim=4,
                num_head=2,
                dtype=torch.float32,
                needs_block=True,
                block_size=4,
                tensor_setter=lambda t, name=name: setattr(self, name, t),
                sliding_window=3 if attn_type == "SlidingWindow" else None,
            )
            for name in ("k_cache", "v_cache")
        ]


class RecordingModel(nn.Module):
    """Records each step's inputs and metadata; next token = (token at the kept index) + 1."""

    def __init__(self, attn_types: tuple[str, ...] = ("FullAttention",)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention(t) for t in attn_types)
        self.anchor = nn.Linear(1, 1)  # the runner reads the device from the parameters
        self.steps: list[dict] = []

    def get_cache_info(self) -> ModelCacheInfo:
        infos = [
            LayerCacheInfo(layer_idx=i, caches=list(layer.cache_entries))
            for i, layer in enumerate(self.layers)
        ]
        return ModelCacheInfo(num_layers=len(infos), layer_infos=infos)

    def forward(self, *, input_ids, position_ids, use_cache, logits_to_keep):
        assert use_cache is False
        md = get_forward_metadata()
        self.steps.append(
            {
                "input_ids": input_ids.clone(),
                "position_ids": position_ids.clone(),
                "md": md,
                "slots": {k: v.clone() for k, v in md.slot_mapping.items()},
                "kv_len": md.kv_len.clone(),
            }
        )
        picked = input_ids[:, logits_to_keep]  # [rows, kept]
        logits = nn.functional.one_hot((picked + 1) % VOCAB, VOCAB).float()
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def plans():
    return {m: analyze_model(m, deploy_mode="standalone") for m in {m for m, _ in RENDERED}}


@pytest.fixture(scope="module")
def runners(plans, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("runners")
    paths = {}
    for model, kv_mode in RENDERED:
        rendered = render_runner(
            plans[model], StandaloneSpec.from_plan(plans[model], kv_mode=kv_mode)
        )
        path = root / f"{model}_{kv_mode}" / rendered.file_name
        path.parent.mkdir()
        path.write_text(rendered.text, encoding="utf-8")
        paths[(model, kv_mode)] = path
    return paths


def _runner_module(runners, kv_mode: str):
    return import_runner(runners[("qwen3", kv_mode)])


@pytest.mark.parametrize("key", RENDERED, ids=lambda k: "-".join(k) if isinstance(k, tuple) else k)
def test_rendered_runner_parses_lints_and_passes_ruff(runners, key):
    path = runners[key]
    text = path.read_text(encoding="utf-8")
    cst.parse_module(text)
    assert "class Runner" in text and "def generate(" in text
    assert lint_source(text, path.name) == []
    config = REPO / "pyproject.toml"
    for args in (["check"], ["format", "--check"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *args, "--no-cache", "--config", str(config), str(path)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_runner_templates_render_strictly():
    # A template value left out is an error, never an empty string in a user's file.
    with pytest.raises(jinja2.UndefinedError):
        render("runner_paged.py.j2", model_type="qwen3", runner_file="runner_qwen3.py")


def test_paged_runner_static_block_table_and_slots(runners):
    module = _runner_module(runners, "paged")
    model = RecordingModel().eval()
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15]]
    runner = module.runner_for(model, prompts, 3, block_size=4)

    # max_seq_len 6 + 3 = 9 rounds up to 12: 3 blocks per row, 6 blocks in all.
    assert runner.max_seq_len == 12
    assert runner.block_table.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert runner.block_table.dtype == torch.int32
    layer = model.layers[0]
    assert layer.k_cache is runner.kv_caches[0]["k_cache"]
    assert tuple(layer.k_cache.shape) == (6, 4, 2, 4)

    out = runner.generate(prompts, 3)
    # Greedy tokens continue each prompt's own last token: the right logits were kept.
    assert out.token_ids == [[8, 9, 10], [16, 17, 18]]
    prefill, decode1, decode2 = model.steps
    md = prefill["md"]
    assert md.is_prefill and md.prompt_tokens == 9
    assert prefill["input_ids"].tolist() == [[5, 6, 7, 10, 11, 12, 13, 14, 15]]
    assert prefill["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5]]
    # Concatenated ranges at batch_idx * max_seq_len ...
    slots = prefill["slots"]["FullAttention"]
    assert slots.tolist() == [0, 1, 2, 12, 13, 14, 15, 16, 17]
    # ... which is the paged formula over the static table.
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1])
    positions = prefill["position_ids"][0]
    assert torch.equal(slots, prepare_slot_mapping(runner.block_table, rows, positions, 4))
    assert md.actual_seq_lengths_cu_q.tolist() == [3, 9]
    assert md.actual_seq_lengths_kv.tolist() == [3, 6]
    assert torch.equal(md.block_table["FullAttention"], runner.block_table)

    # Decode: one token per row at kv_len, slot kv_len + kv_len_offset; kv_len grows once per step.
    # The metadata's kv_len is the tokens cached before the step: the new token's position.
    assert decode1["position_ids"].tolist() == [[3, 6]]
    assert decode1["slots"]["FullAttention"].tolist() == [3, 18]
    assert decode1["kv_len"].tolist() == [3, 6]
    assert decode1["md"].actual_seq_lengths_kv.tolist() == [4, 7]
    assert decode1["md"].actual_seq_lengths_list_kv == [4, 7]
    assert decode1["md"].actual_seq_lengths_cu_q.tolist() == [1, 2]
    assert decode1["md"].prompt_tokens == 0
    assert decode2["slots"]["FullAttention"].tolist() == [4, 19]
    assert decode2["kv_len"].tolist() == [4, 7]
    assert runner.kv_len.tolist() == [5, 8]


def test_paged_runner_tables_for_every_attn_type(runners):
    module = _runner_module(runners, "paged")
    model = RecordingModel(("FullAttention", "SlidingWindow")).eval()
    runner = module.runner_for(model, [[1, 2], [3]], 2, block_size=2)
    runner.generate([[1, 2], [3]], 2)
    md = model.steps[-1]["md"]
    assert sorted(md.block_table) == ["FullAttention", "SlidingWindow"]
    assert sorted(md.slot_mapping) == ["FullAttention", "SlidingWindow"]


def test_contiguous_runner_pads_rows_and_writes_at_kv_len(runners):
    module = _runner_module(runners, "contiguous")
    model = RecordingModel().eval()
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15]]
    runner = module.runner_for(model, prompts, 3)
    layer = model.layers[0]
    # [batch, max_seq_len, num_head * dim], owned by the runner
    assert tuple(layer.v_cache.shape) == (2, 9, 8)
    assert layer.v_cache is runner.kv_caches[0]["v_cache"]

    out = runner.generate(prompts, 3)
    assert out.token_ids == [[8, 9, 10], [16, 17, 18]]
    prefill, decode1, _ = model.steps
    # Right-padded [batch, longest]; positions restart at 0 in every row.
    assert prefill["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0], [10, 11, 12, 13, 14, 15]]
    assert prefill["position_ids"].tolist() == [list(range(6))] * 2
    assert prefill["md"].actual_seq_lengths_q.tolist() == [3, 6]
    assert prefill["kv_len"].tolist() == [0, 0] and prefill["md"].block_table == {}
    assert decode1["input_ids"].tolist() == [[8], [16]]
    assert decode1["position_ids"].tolist() == [[3], [6]]
    assert decode1["kv_len"].tolist() == [3, 6]


def test_runner_stops_rows_at_eos_and_refuses_bad_batches(runners):
    module = _runner_module(runners, "paged")
    model = RecordingModel().eval()
    runner = module.runner_for(model, [[1], [20]], 4, block_size=4)
    out = runner.generate([[1], [20]], 4, eos_token_id=3)
    assert out.token_ids == [[2, 3], [21, 22, 23, 24]]
    with pytest.raises(ValueError, match="static batch holds 2 prompts"):
        runner.generate([[1]], 2)
    with pytest.raises(ValueError, match="max_seq_len"):
        runner.generate([[1] * 7, [2]], 4)


def test_return_logits_gives_one_row_per_request_per_step(runners):
    module = _runner_module(runners, "contiguous")
    model = RecordingModel().eval()
    runner = module.runner_for(model, [[4, 5], [9]], 2)
    out = runner.generate([[4, 5], [9]], 2, return_logits=True)
    assert [tuple(step.shape) for step in out.logits] == [(2, VOCAB), (2, VOCAB)]
    assert out.logits[0].argmax(-1).tolist() == [6, 10]
