"""SSM state gather/scatter over dense and page-padded strided views."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime import gather_ssm_states, scatter_ssm_states_, strided_view

STATE = (2, 3, 4)  # 24 fp32 = 96 bytes per state row


def _view(page_bytes: int, num_blocks: int = 8, offset_bytes: int = 0):
    """A state view over raw pages filled with recognisable bytes (so untouched = unchanged)."""
    gen = torch.Generator().manual_seed(page_bytes + offset_bytes)
    raw = torch.randint(-100, 100, (num_blocks, page_bytes), dtype=torch.int8, generator=gen)
    view = strided_view(raw, torch.float32, STATE, offset_bytes)
    view.copy_(torch.randn(num_blocks, *STATE, generator=gen))
    return raw, view


# (page bytes, offset): zero padding (rows adjacent), tail padding, head + tail padding.
LAYOUTS = [(96, 0), (128, 0), (160, 32)]


@pytest.mark.parametrize(("page_bytes", "offset"), LAYOUTS)
def test_indexed_gather_returns_dense_rows(page_bytes, offset):
    _, view = _view(page_bytes, offset_bytes=offset)
    assert view.is_contiguous() == (page_bytes == 96)
    indices = torch.tensor([5, 0, 7])
    dense = gather_ssm_states(view, indices)
    assert dense.is_contiguous() and dense.shape == (3, *STATE)
    for row, block in enumerate(indices.tolist()):
        assert torch.equal(dense[row], view[block])
    # A copy: the kernel may overwrite it without touching the cache.
    dense.zero_()
    assert view[5].abs().sum() > 0


@pytest.mark.parametrize(("page_bytes", "offset"), LAYOUTS)
def test_rows_without_initial_state_read_as_zeros(page_bytes, offset):
    _, view = _view(page_bytes, offset_bytes=offset)
    dense = gather_ssm_states(view, torch.tensor([1, 2, 3]), torch.tensor([True, False, True]))
    assert torch.equal(dense[0], view[1])
    assert torch.all(dense[1] == 0)
    assert torch.equal(dense[2], view[3])


@pytest.mark.parametrize(("page_bytes", "offset"), LAYOUTS)
def test_scatter_writes_in_place_and_leaves_the_rest(page_bytes, offset):
    raw, view = _view(page_bytes, offset_bytes=offset)
    before = raw.clone()
    indices = torch.tensor([6, 2])
    new = torch.full((2, *STATE), 0.25)
    new[1] = -3.0
    assert scatter_ssm_states_(view, indices, new) is view
    assert torch.all(view[6] == 0.25) and torch.all(view[2] == -3.0)
    # Bytes changed only inside the selected rows' payload.
    changed = (raw != before).nonzero()
    assert set(changed[:, 0].tolist()) <= {2, 6}
    assert changed[:, 1].min() >= offset and changed[:, 1].max() < offset + 96
    # Round trip: gathering the rows back gives what was written.
    assert torch.equal(gather_ssm_states(view, indices), new)


def test_scatter_casts_and_checks_shapes():
    _, view = _view(128)
    scatter_ssm_states_(view, torch.tensor([0]), torch.ones(1, *STATE, dtype=torch.float64))
    assert view.dtype == torch.float32 and torch.all(view[0] == 1.0)
    with pytest.raises(ValueError, match="does not match"):
        scatter_ssm_states_(view, torch.tensor([0, 1]), torch.ones(1, *STATE))
