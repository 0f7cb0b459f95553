"""Move recurrent-state rows between strided cache views and dense kernel tensors.

A Mamba state view ``[num_blocks, *shape]`` may step a whole physical page per block, so
its rows are not adjacent. Kernels want a dense ``[B, *shape]`` batch: gather the rows the
step uses, run the kernel, scatter the new rows back in place. Rows that are not selected
and the page padding between rows are never touched.

    state indices (one block id per request)
          |
    strided physical state --gather--> dense [B, *shape] --kernel--> new states
          ^                                                              |
          +-------------------------- scatter (in place) <---------------+
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_ssm_states(
    state_view: Tensor, indices: Tensor, has_initial_state: Tensor | None = None
) -> Tensor:
    """Dense copy of the selected state rows.

    Args:
        state_view: ``[num_blocks, *shape]``, any strides (e.g. a page-pool view).
        indices: int ``[B]``, the state block of each request.
        has_initial_state: optional bool ``[B]``; rows with False read as zeros (a new
            request must not see a previous owner's state in a reused block).

    Returns:
        contiguous ``[B, *shape]`` in the view's dtype.
    """
    indices = indices.to(state_view.device, torch.int64)
    dense = state_view.index_select(0, indices)  # [B, *shape], a new dense tensor
    if has_initial_state is not None:
        keep = has_initial_state.to(dense.device, torch.bool)
        keep = keep.view(-1, *([1] * (dense.dim() - 1)))
        dense = torch.where(keep, dense, torch.zeros((), dtype=dense.dtype, device=dense.device))
    return dense.contiguous()


def scatter_ssm_states_(state_view: Tensor, indices: Tensor, new_states: Tensor) -> Tensor:
    """Write ``new_states[b]`` into row ``indices[b]`` of ``state_view`` in place.

    Writes through the view into its storage (``index_copy_`` honours the strides), so the
    page padding and every unselected row keep their bytes.

    Args:
        state_view: ``[num_blocks, *shape]``, any strides.
        indices: int ``[B]``, distinct state blocks.
        new_states: ``[B, *shape]``; cast to the view's dtype.

    Returns:
        ``state_view``.
    """
    indices = indices.to(state_view.device, torch.int64)
    if new_states.shape[1:] != state_view.shape[1:] or new_states.shape[0] != indices.numel():
        raise ValueError(
            f"new_states {tuple(new_states.shape)} does not match {indices.numel()} rows of "
            f"state shape {tuple(state_view.shape[1:])}"
        )
    state_view.index_copy_(0, indices, new_states.to(state_view.dtype))
    return state_view
