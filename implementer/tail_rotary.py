"""Rotary angles taken as the tail of a table sized by the cache length (Qwen-7B's shape).

Qwen(-7B)'s remote model builds its rotary table for ``kv_seq_len`` = this step's tokens plus
the cached ones, and its attention takes the *last* ``cur_len`` rows
(``[t[:, -cur_len:] for t in rotary_pos_emb]``): the positions are implied by the past length,
no ``position_ids`` reach the attention. The paged runtime runs a packed step of several
requests with no cache passed, so those rows are positions ``0 .. T-1`` of one sequence, not
the tokens' own positions. No rewrite of the seam can fix that (the table is cut before the
cache write, in another class's data flow), so such an attention is refused with that reason.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

_EMPTY = cst.Module(body=[])
#: ``x[..., -n:, ...]``: a slice from a negative bound to the end
_TAIL_SLICE = m.Slice(lower=m.UnaryOperation(operator=m.Minus()), upper=None)
#: words that mark a rotary table in the sliced expression
_ROTARY_WORDS = ("rotary", "rope", "pos_emb", "cos", "sin", "freqs")
#: a forward taking one of these reads positions explicitly
_POSITION_PARAMS = ("position_ids", "position_embeddings", "cache_position")


def tail_rotary_problem(name: str, forward: cst.FunctionDef, upto: int) -> str | None:
    """Why NAME's forward cannot be paged when, before statement UPTO of its body, it slices
    rotary angles from the tail of a table and takes no positions; else None."""
    params = [p.name.value for p in forward.params.params]
    if any(p in _POSITION_PARAMS for p in params):
        return None
    body = cst.ensure_type(forward.body, cst.IndentedBlock).body[:upto]
    for stmt in body:
        for node in m.findall(
            stmt,
            m.Subscript(
                slice=[m.ZeroOrMore(), m.SubscriptElement(slice=_TAIL_SLICE), m.ZeroOrMore()]
            ),
        ):
            text = _EMPTY.code_for_node(stmt)
            if any(word in text.lower() for word in _ROTARY_WORDS):
                sliced = _EMPTY.code_for_node(node).strip()
                return (
                    f"{name}.forward takes its rotary angles as the last rows of a table sized "
                    f"by the cache length (`{sliced}`), not by position ids: in the paged "
                    "runtime's packed step (several requests, no cache passed) those rows are "
                    "not the tokens' positions; build the angles from position_ids, which the "
                    "runtime passes as [1, T]"
                )
    return None


__all__ = ["tail_rotary_problem"]
