"""verify's note when the original's own cache path disagrees with a full recompute."""

from __future__ import annotations

import torch
from kvskill.verify.reference.recompute import cache_path_note


class _Generator:
    """A model whose ``generate`` answers CACHED with its cache and RECOMPUTED without."""

    def __init__(self, cached: list[int], recomputed: list[int] | None) -> None:
        from types import SimpleNamespace

        self.cached, self.recomputed = cached, recomputed
        self.generation_config = SimpleNamespace(eos_token_id=2)

    def generate(self, input_ids, attention_mask, generation_config):
        assert attention_mask.shape == input_ids.shape
        assert generation_config.max_new_tokens == len(self.cached)
        if generation_config.use_cache:
            new = self.cached
        elif self.recomputed is None:
            raise RuntimeError("this model cannot run without its cache")
        else:
            new = self.recomputed
        return torch.cat([input_ids, torch.tensor([new])], dim=1)


def test_a_cache_path_agreeing_with_the_recompute_gives_no_note():
    assert (
        cache_path_note(_Generator([4, 5, 6], [4, 5, 6]), 0, [1, 2], [4, 5, 6], [4, 7, 7]) is None
    )


def test_a_broken_cache_path_is_named_with_its_step_and_the_runtime_side():
    model = _Generator(cached=[4, 9, 9], recomputed=[4, 5, 6])
    note = cache_path_note(model, 2, [1, 2, 3], [4, 9, 9], runtime=[4, 5, 6])
    assert note is not None
    assert note.startswith("prompt 2: the original's own cached generate disagrees")
    assert "from step 1" in note and "the runtime's tokens equal the recompute" in note
    other = cache_path_note(model, 2, [1, 2, 3], [4, 9, 9], runtime=[4, 5, 7])
    assert other is not None and "the runtime's tokens differ from both" in other


def test_a_source_that_cannot_run_without_its_cache_gives_no_note():
    assert cache_path_note(_Generator([4, 5], None), 0, [1], [4, 5], [4, 6]) is None
