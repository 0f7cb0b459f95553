"""A compressed cache (``compress_ratio`` r): blocks of block_size tokens store block_size // r
rows; the runtime sizes and allocates them so, and gives the group a block table only.

The fixture model has one layer with two caches: ``k_cache`` (one row per token) and
``c_cache`` (ratio 4, its own manager_key): when a request's token 4c + 3 arrives, row c becomes
the mean of the k rows of tokens 4c .. 4c + 3, read back from ``k_cache``. A token's logits
read its own k row plus every complete row of its request, so wrong row addressing changes
the tokens. ``naive_greedy`` computes the same without any cache.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvskill.runtime import LLM, CacheEntry, LayerCacheInfo, ModelCacheInfo, SamplingParams
from kvskill.runtime.cache_info import CacheInfoError, fill_block_sizes, validate_cache_info
from kvskill.runtime.chains import run_three_chains
from kvskill.runtime.forward_context import get_forward_metadata
from kvskill.runtime.tables import prepare_slot_mapping
from torch import nn

RATIO = 4
BLOCK_SIZE = 8
ROWS_PER_BLOCK = BLOCK_SIZE // RATIO
DIM = 8
VOCAB = 32
COMPRESSED_KEY = "c4_cmp"


class CompressedToy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=64)
        self.block_size = BLOCK_SIZE
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.k_cache = self.c_cache = None

    def get_cache_info(self) -> ModelCacheInfo:
        def setter(name):
            return lambda tensor: setattr(self, name, tensor)

        caches = [
            CacheEntry("k_cache", "FullAttention", DIM, 1, torch.float32, True,
                       tensor_setter=setter("k_cache")),
            CacheEntry("c_cache", "FullAttention", DIM, 1, torch.float32, True,
                       manager_key=COMPRESSED_KEY, compress_ratio=RATIO,
                       tensor_setter=setter("c_cache")),
        ]  # fmt: skip
        return ModelCacheInfo(num_layers=1, layer_infos=[LayerCacheInfo(0, caches)])

    def forward(self, input_ids, position_ids, use_cache=False, logits_to_keep=None):
        md = get_forward_metadata()
        pos = position_ids[0]
        k = self.embed(input_ids[0])  # [T, D]
        request = torch.repeat_interleave(
            torch.arange(md.actual_seq_lengths_q.numel()), md.actual_seq_lengths_q.long()
        )  # [T]
        self.k_cache[at(md.slot_mapping["FullAttention"], BLOCK_SIZE)] = k
        # rows completed by this step's tokens: the mean of their RATIO k rows
        done = pos % RATIO == RATIO - 1
        rows, owner = pos[done] // RATIO, request[done]
        token_pos = (rows[:, None] * RATIO + torch.arange(RATIO)).reshape(-1)
        token_slots = prepare_slot_mapping(
            md.block_table["FullAttention"], owner.repeat_interleave(RATIO), token_pos, BLOCK_SIZE
        )
        row_slots = prepare_slot_mapping(
            md.block_table[COMPRESSED_KEY], owner, rows, ROWS_PER_BLOCK
        )
        means = self.k_cache[at(token_slots, BLOCK_SIZE)].view(-1, RATIO, DIM).mean(1)
        self.c_cache[at(row_slots, ROWS_PER_BLOCK)] = means
        # every token reads its request's complete rows c < (pos + 1) // RATIO
        visible = (pos + 1) // RATIO  # [T]
        width = int(visible.max()) if visible.numel() else 0
        row_ids = torch.arange(width).expand(pos.numel(), width)
        seen = row_ids < visible[:, None]
        slots = prepare_slot_mapping(
            md.block_table[COMPRESSED_KEY], request[:, None].expand_as(row_ids)[seen],
            row_ids[seen], ROWS_PER_BLOCK,
        )  # fmt: skip
        summed = torch.zeros_like(k).index_add_(
            0, torch.nonzero(seen)[:, 0], self.c_cache[at(slots, ROWS_PER_BLOCK)]
        )
        logits = self.head(k + summed)
        return logits[logits_to_keep].unsqueeze(0)


def at(slots, rows_per_block):
    """(block, row, head 0) indices of flat slots: a page-pool view cannot be flattened."""
    return slots // rows_per_block, slots % rows_per_block, 0


def naive_greedy(model: CompressedToy, prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            emb = model.embed(torch.tensor(tokens))
            t = len(tokens) - 1
            rows = [emb[c * RATIO : (c + 1) * RATIO].mean(0) for c in range((t + 1) // RATIO)]
            hidden = emb[t] + (torch.stack(rows).sum(0) if rows else 0)
            tokens.append(int(model.head(hidden).argmax()))
            out.append(tokens[-1])
    return out


def rows_in_place(llm: LLM):
    """A step hook: after each step, every complete row of each stepped request sits at
    ``table[c // rows_per_block] * rows_per_block + c % rows_per_block`` of its c-block table."""
    model, failures = llm.model, []

    def check(record) -> None:
        table = record.metadata.block_table[COMPRESSED_KEY]
        if COMPRESSED_KEY in record.metadata.slot_mapping:  # the model addresses rows itself
            failures.append((record.step_index, "a slot mapping for the compressed group"))
        kv_lens = record.metadata.actual_seq_lengths_kv.tolist()
        for b, (rid, kv) in enumerate(zip(record.request_ids, kv_lens, strict=True)):
            output = llm.engine.get_output(rid)
            fed = (list(output.prompt_token_ids) + list(output.token_ids))[:kv]
            emb = model.embed(torch.tensor(fed))
            for c in range(kv // RATIO):
                block = int(table[b, c // ROWS_PER_BLOCK])
                stored = model.c_cache[block, c % ROWS_PER_BLOCK, 0]
                if not torch.allclose(stored, emb[c * RATIO : (c + 1) * RATIO].mean(0)):
                    failures.append((record.step_index, rid, c))

    return check, failures


PROMPTS = [list(range(1, 12)), list(range(1, 10)) + [20, 21, 22], [5, 6, 7], list(range(3, 20))]


def test_compressed_entry_shapes_and_bytes():
    llm = LLM(CompressedToy(), num_blocks=6)
    k, c = llm.model.k_cache, llm.model.c_cache
    assert tuple(k.shape) == (6, BLOCK_SIZE, 1, DIM)
    assert tuple(c.shape) == (6, ROWS_PER_BLOCK, 1, DIM)
    groups = llm.kv_manager.usage()["groups"]
    assert groups["FullAttention"]["bytes_per_block"] == BLOCK_SIZE * DIM * 4
    assert groups[COMPRESSED_KEY]["bytes_per_block"] == ROWS_PER_BLOCK * DIM * 4
    assert groups[COMPRESSED_KEY]["block_size"] == BLOCK_SIZE  # tokens, as every group
    # a byte budget pays each block's rows: 10 blocks of (256 + 64) B
    budget = LLM(CompressedToy(), kv_memory_bytes=10 * (BLOCK_SIZE + ROWS_PER_BLOCK) * DIM * 4)
    assert budget.kv_manager.num_blocks == {"FullAttention": 10, COMPRESSED_KEY: 10}
    # the page pool: each layer's c rows are a strided view into pages of the k payload
    pooled = LLM(CompressedToy(), num_blocks=6, use_hybrid_blocks=True)
    assert pooled.kv_manager.layout.page_size_bytes == BLOCK_SIZE * DIM * 4
    assert tuple(pooled.model.c_cache.shape) == (6, ROWS_PER_BLOCK, 1, DIM)
    assert pooled.model.c_cache.stride(0) == BLOCK_SIZE * DIM


@pytest.mark.parametrize("use_hybrid_blocks", [False, True])
def test_compressed_rows_land_at_their_slots_with_preemption_and_prefix_hits(use_hybrid_blocks):
    params = SamplingParams(max_tokens=9)
    expected = [naive_greedy(CompressedToy(), p, 9) for p in PROMPTS]
    roomy = LLM(CompressedToy(), num_blocks=64, use_hybrid_blocks=use_hybrid_blocks)
    assert [o.token_ids for o in roomy.generate(PROMPTS, params)] == expected

    tight = LLM(
        CompressedToy(),
        # 7 blocks per group; the page pool's blocks serve both groups
        num_blocks=15 if use_hybrid_blocks else 8,
        use_hybrid_blocks=use_hybrid_blocks,
        enable_prefix_caching=True,
        free_block_order_seed=3,
    )
    hook, failures = rows_in_place(tight)
    with tight.step_hook(hook):
        # the repeated prompts hit the prefix cache
        outputs = [o.token_ids for o in tight.generate(PROMPTS + PROMPTS[:2], params)]
    assert not failures
    assert outputs == expected + expected[:2]
    assert tight.stats.num_preemptions > 0
    assert tight.stats.num_prefix_hit_tokens >= BLOCK_SIZE
    assert tight.kv_manager.num_free_blocks == tight.kv_manager.initial_free_blocks


def test_three_chains_hold_with_a_compressed_group():
    llm = LLM(CompressedToy(), num_blocks=16)
    report = run_three_chains(llm, PROMPTS[:2], SamplingParams(max_tokens=4))
    assert [r.passed for r in report.results] == [True, True, True], report.to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(compress_ratio=3), "block_size 8, which compress_ratio 3 does not divide"),
        (
            dict(manager_key=None),
            "group 'FullAttention' already uses (None, 8, 'FullAttention', 1)",
        ),
    ],
)
def test_compressed_declarations_that_no_manager_can_serve(change, message):
    info = CompressedToy().get_cache_info()
    entry = info.layer_infos[0].caches[1]
    for name, value in change.items():
        setattr(entry, name, value)
    fill_block_sizes(info, BLOCK_SIZE)
    with pytest.raises(CacheInfoError) as error:
        validate_cache_info(info)
    assert message in str(error.value)


# -- the compressor's state: a SlidingWindow entry of per-token rows ----------------------------

#: DeepSeek-V4's CSA compressor pools 2 * RATIO tokens per entry (the previous window's first
#: series with the current window's second), so the framework keeps its per-token projections
#: in a SlidingWindow entry of 2 * RATIO rows (``sfa_kv_state``, dim [2, D], two heads: kv and
#: score, float32; cann-recipes-infer models/deepseek_v4/models/modeling_deepseek.py:932-955)
STATE_WINDOW = 2 * RATIO
STATE_KEY, POOLED_KEY = "c4a_cmp_state", "c4a_cmp_kv"


class CompressorStateToy(nn.Module):
    """Entry w = sum over the 2 * RATIO slots of softmax(score + ape) * kv, where slots
    0..RATIO-1 are tokens of window w - 1 (series a) and RATIO.. those of window w (series b),
    as transformers' DeepseekV4CSACompressor pools; the tokens' projections are read back
    from the state entry when the window closes, possibly steps after they were written."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=64)
        self.block_size = BLOCK_SIZE
        self.embed = nn.Embedding(VOCAB, DIM)
        self.kv_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.gate_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.ape = nn.Parameter(torch.randn(RATIO, 2, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.state = self.pooled = None

    def get_cache_info(self) -> ModelCacheInfo:
        def setter(name):
            return lambda tensor: setattr(self, name, tensor)

        caches = [
            CacheEntry("state", "SlidingWindow", [2, DIM], 2, torch.float32, True,
                       manager_key=STATE_KEY, sliding_window=STATE_WINDOW,
                       tensor_setter=setter("state")),
            CacheEntry("pooled", "FullAttention", DIM, 1, torch.float32, True,
                       manager_key=POOLED_KEY, compress_ratio=RATIO,
                       tensor_setter=setter("pooled")),
        ]  # fmt: skip
        return ModelCacheInfo(num_layers=1, layer_infos=[LayerCacheInfo(0, caches)])

    def projections(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[T, 2 (kv, score), 2 (series a, b), D]"""
        kv = self.kv_proj(x).view(-1, 2, DIM)
        score = self.gate_proj(x).view(-1, 2, DIM) + self.ape[pos % RATIO]
        return torch.stack([kv, score], dim=1)

    def forward(self, input_ids, position_ids, use_cache=False, logits_to_keep=None):
        md = get_forward_metadata()
        pos = position_ids[0]
        x = self.embed(input_ids[0])
        request = torch.repeat_interleave(
            torch.arange(md.actual_seq_lengths_q.numel()), md.actual_seq_lengths_q.long()
        )
        self.state[at(md.slot_mapping[STATE_KEY], BLOCK_SIZE)[:2]] = self.projections(
            x, pos
        )  # both heads
        done = pos % RATIO == RATIO - 1
        entries, owner = pos[done] // RATIO, request[done]
        if entries.numel():
            # the 2 * RATIO tokens each closing window pools, all inside the state's window
            first = entries[:, None] * RATIO - RATIO + torch.arange(STATE_WINDOW)
            present = first >= 0
            slots = prepare_slot_mapping(
                md.block_table[STATE_KEY], owner[:, None].expand_as(first)[present],
                first[present], BLOCK_SIZE,
            )  # fmt: skip
            rows = torch.zeros(*first.shape, 2, 2, DIM)
            rows[..., 1, :, :] = float("-inf")  # an absent token weighs nothing
            rows[present] = self.state[at(slots, BLOCK_SIZE)[:2]]
            self.pooled[
                at(
                    prepare_slot_mapping(
                        md.block_table[POOLED_KEY], owner, entries, ROWS_PER_BLOCK
                    ),
                    ROWS_PER_BLOCK,
                )
            ] = pool(rows)
        visible = (pos + 1) // RATIO
        width = int(visible.max()) if visible.numel() else 0
        row_ids = torch.arange(width).expand(pos.numel(), width)
        seen = row_ids < visible[:, None]
        slots = prepare_slot_mapping(
            md.block_table[POOLED_KEY], request[:, None].expand_as(row_ids)[seen],
            row_ids[seen], ROWS_PER_BLOCK,
        )  # fmt: skip
        summed = torch.zeros_like(x).index_add_(
            0, torch.nonzero(seen)[:, 0], self.pooled[at(slots, ROWS_PER_BLOCK)]
        )
        logits = self.head(x + summed)
        return logits[logits_to_keep].unsqueeze(0)


def pool(rows: torch.Tensor) -> torch.Tensor:
    """[E, 2 * RATIO, 2, 2, D] token rows -> [E, D]: series a of the first RATIO slots, b of
    the last, softmax-gated over the slots."""
    kv = torch.cat([rows[:, :RATIO, 0, 0], rows[:, RATIO:, 0, 1]], dim=1)
    score = torch.cat([rows[:, :RATIO, 1, 0], rows[:, RATIO:, 1, 1]], dim=1)
    return (kv * score.softmax(dim=1)).sum(dim=1)


def naive_state_greedy(model: CompressorStateToy, prompt: list[int], max_tokens: int):
    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            pos = torch.arange(len(tokens))
            x = model.embed(torch.tensor(tokens))
            proj = model.projections(x, pos)
            entries = []
            for w in range(len(tokens) // RATIO):
                rows = torch.zeros(STATE_WINDOW, 2, 2, DIM)
                rows[:, 1] = float("-inf")
                lo = w * RATIO - RATIO
                rows[max(0, -lo) :] = proj[max(0, lo) : w * RATIO + RATIO]
                entries.append(pool(rows[None])[0])
            hidden = x[-1] + (torch.stack(entries).sum(0) if entries else 0)
            tokens.append(int(model.head(hidden).argmax()))
            out.append(tokens[-1])
    return out


@pytest.mark.parametrize("use_hybrid_blocks", [False, True])
def test_compressor_state_rows_survive_steps_preemption_and_prefix_hits(use_hybrid_blocks):
    params = SamplingParams(max_tokens=9)
    expected = [naive_state_greedy(CompressorStateToy(), p, 9) for p in PROMPTS]
    roomy = LLM(CompressorStateToy(), num_blocks=64, use_hybrid_blocks=use_hybrid_blocks)
    assert [o.token_ids for o in roomy.generate(PROMPTS, params)] == expected
    # the state group holds a bounded window per request; the pooled group every row
    assert roomy.kv_manager.usage()["groups"][STATE_KEY]["bytes_per_block"] == (
        BLOCK_SIZE * 2 * 2 * DIM * 4
    )
    tight = LLM(
        CompressorStateToy(),
        num_blocks=15 if use_hybrid_blocks else 8,
        use_hybrid_blocks=use_hybrid_blocks,
        enable_prefix_caching=True,
        free_block_order_seed=3,
    )
    outputs = [o.token_ids for o in tight.generate(PROMPTS + PROMPTS[:2], params)]
    assert outputs == expected + expected[:2]
    assert tight.stats.num_preemptions > 0
    assert tight.stats.num_prefix_hit_tokens >= BLOCK_SIZE
    assert tight.kv_manager.num_free_blocks == tight.kv_manager.initial_free_blocks
