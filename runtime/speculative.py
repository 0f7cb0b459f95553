"""Speculative decoding with the model's MTP layers: draft, verify in one forward, accept.

A step runs the main model over the scheduled tokens, keeping every token's final hidden
state (``mtp.last_hidden_states``). Prefill steps sample as usual. A decode (verify) step
feeds each request its last token and its drafts, ``1 + d`` tokens (TND, causal within the
request: the metadata marks it a prefill-shaped step, ``sparse_mode`` 3, as the framework's
MTP verify with ``sq = next_n + 1``), takes the target token at every position and accepts
the longest run of drafts equal to them plus the token after the run (the bonus). Each
accepted token is what decoding one token at a time would have produced: greedy requests
get the same tokens; a sampled request draws each position from the target distribution.

Then the drafter runs over the pairs whose main K/V were kept (hidden state of position p,
token p+1, at rotary position p+1, cache row p) and drafts the token after each request's
last one; with ``speculative_tokens`` k > 1 the same layer then runs over its own output and
its last draft for the others (``Speculator._chain``).

Recurrent states advance over accepted tokens only, as in the framework (``MambaCacheEntry
.next_n``: its manager keeps ``1 + next_n`` state blocks per request). A verify step hands the
state layers every request's ``1 + d`` state blocks (``MambaManager.verify_state_table``);
the layer starts from block 0 and writes the state after its token t into block t; once the
drafts are checked, the block of the last accepted token becomes block 0
(``MambaManager.keep_state_after``, a swap of two block ids). A rejected token's state sits in
a spare block the next verify step overwrites: it leaves no trace. Only state layers that
write those rows (``verify_state_rows``: the converted gated delta nets) are served.

Sliding windows release blocks by the accepted length only (``get_num_skipped_tokens`` of
the computed tokens), so a rejected draft never evicts a block an accepted token reads; the
window pools keep the framework's margin of ``2 * next_n`` tokens.

Prefix caching shares the MTP rows with the blocks: a cached block's last row pairs its last
token with the token after it in the request that filled it, which another request may
continue differently. Such a row can only lower acceptance (drafts are checked against the
main model); it never changes a token.

Rollback is the computed length: only accepted positions count as computed, so the K/V a
rejected draft wrote (main and MTP layers) sits past the computed length, where no
attention reads it (``actual_seq_lengths_kv`` stops before), and the next step writes those
slots again before reading them. The blocks reserved for the drafts stay with the request
and serve its next tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from itertools import accumulate

import torch
from kvskill.core.attn_types import AttnType
from kvskill.core.errors import BadInputError
from kvskill.runtime.forward_context import forward_context, step_metadata
from kvskill.runtime.mtp import MtpDrafter, last_hidden_states
from kvskill.runtime.request import Request, RequestStatus
from kvskill.runtime.sampler import greedy_tokens
from kvskill.runtime.scheduler import SchedulerOutput
from kvskill.runtime.step_inputs import build_step_inputs
from kvskill.runtime.tables import int64_tensor
from torch import Tensor


@dataclass(slots=True)
class SpeculationStats:
    num_verify_steps: int = 0
    #: requests verified, summed over verify steps
    num_verified_requests: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    #: tokens emitted by verify steps (accepted drafts + one per verified request)
    num_verify_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return (
            self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        )

    @property
    def tokens_per_step(self) -> float:
        """Tokens one request gains per decode step (1.0 without speculation)."""
        if not self.num_verified_requests:
            return 0.0
        return self.num_verify_tokens / self.num_verified_requests

    def to_dict(self) -> dict:
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_step": self.tokens_per_step,
        }


#: cache group kinds a verify step serves (states only through layers that write a state
#: row per token, see ``speculation_refusal``)
_SERVED_KINDS = {
    AttnType.FULL_ATTENTION.value,
    AttnType.SLIDING_WINDOW.value,
    AttnType.MAMBA.value,
}


def speculation_refusal(
    cache_groups: dict[str, str], state_layers_without_rows: list[str] = ()
) -> str | None:
    """Why the pools cannot serve speculative steps (None: they can). CACHE_GROUPS: group
    key -> attn_type; STATE_LAYERS_WITHOUT_ROWS: names of the state layers that keep one
    state per request only (no ``verify_state_rows``)."""
    others = sorted({t for t in cache_groups.values() if t not in _SERVED_KINDS})
    if others:
        return (
            f"cache groups of kind {others}: a verify step serves full-attention, window and "
            "gated-delta state groups only"
        )
    if state_layers_without_rows:
        names = list(state_layers_without_rows)
        return (
            f"state layer {names[0]} (and {len(names) - 1} more) keeps one state per request: "
            "a verify step needs the state after every token (the gated delta nets' converted "
            "forward writes them)"
        )
    return None


class Speculator:
    """The draft/verify half of an engine step (see the module doc)."""

    def __init__(self, drafter: MtpDrafter, num_speculative_tokens: int) -> None:
        if len(drafter.layers) != 1 or num_speculative_tokens < 1:
            raise BadInputError(
                f"speculative_tokens={num_speculative_tokens}: the runtime drafts with one MTP "
                f"layer, reused for every draft after the first (the model has "
                f"{len(drafter.layers)})"
            )
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.stats = SpeculationStats()
        #: the drafter's logits of the last step, one row per pair it ran over (tests and
        #: verify compare them); None before the first step
        self.last_draft_logits: Tensor | None = None

    def run(self, engine, output: SchedulerOutput) -> tuple[list, int, float]:
        """Forward, sample/accept, hand the result to the scheduler, draft.

        Returns (the step outputs, the tokens generated, the forward seconds)."""
        scheduled = output.scheduled
        inputs = build_step_inputs(
            output, engine.kv_manager, attention_mask=engine.attention_mask, device=engine.device
        )
        q_lens = [s.num_new_tokens for s in scheduled]
        ends = list(accumulate(q_lens))
        md = inputs.metadata
        if output.is_prefill:
            rows = inputs.logits_indices
        else:
            # every fed token is scored; causal within each request's 1 + d tokens (a step
            # without drafts keeps the one-token decode call)
            if ends[-1] > len(scheduled):
                md = replace(
                    md,
                    is_prefill=True,
                    prompt_tokens=ends[-1],
                    block_table=self._with_state_blocks(engine, scheduled, q_lens, md),
                )
            rows = torch.arange(ends[-1], device=engine.device)
        started = time.perf_counter()
        with last_hidden_states(engine.model) as captured:
            logits = engine._forward(inputs.input_ids, inputs.position_ids, rows, md)
        hidden = captured[0]
        if output.is_prefill:
            entries: list = engine._sample(output, logits)
            kept = q_lens
        else:
            entries = self._verify(engine, scheduled, logits, ends)
            kept = [len(tokens) for tokens in entries]
            if ends[-1] > len(scheduled):
                self._keep_accepted_states(engine, scheduled, kept)
        step_outputs, _ = engine.scheduler.update_from_output(output, entries, time.perf_counter())
        self._draft(engine, scheduled, hidden, kept, ends)
        generated = sum(len(o.new_token_ids) for o in step_outputs)
        return step_outputs, generated, time.perf_counter() - started

    @staticmethod
    def _with_state_blocks(engine, scheduled, q_lens: list[int], md) -> dict[str, Tensor]:
        """The step's block tables with every state group's ``1 + d`` blocks per request."""
        if not engine.kv_manager.state_group_keys:
            return md.block_table
        ids = [s.request.request_id for s in scheduled]
        tables = dict(md.block_table)
        for key in engine.kv_manager.state_group_keys:
            manager = engine.kv_manager.managers[key]
            tables[key] = manager.verify_state_table(ids, q_lens).to(engine.device)
        return tables

    @staticmethod
    def _keep_accepted_states(engine, scheduled, kept: list[int]) -> None:
        """Each request keeps the state after its last accepted token (token ``kept - 1`` of
        the verify step): that block becomes its block 0."""
        for key in engine.kv_manager.state_group_keys:
            manager = engine.kv_manager.managers[key]
            for s, n in zip(scheduled, kept, strict=True):
                manager.keep_state_after(s.request.request_id, n - 1)

    def _verify(self, engine, scheduled, logits: Tensor, ends: list[int]) -> list[list[int]]:
        """Per request, the accepted drafts and the token after them."""
        requests = [s.request for s in scheduled]
        if all(r.sampling_params.is_greedy for r in requests):
            targets = greedy_tokens(logits).tolist()
        else:
            targets = []
            for s, end in zip(scheduled, ends, strict=True):
                r = s.request
                n = s.num_new_tokens
                targets += engine.sampler(
                    logits[end - n : end],
                    [r.sampling_params] * n,
                    [engine._generators[r.request_id]] * n,
                )
        stats = self.stats
        accepted: list[list[int]] = []
        for s, end in zip(scheduled, ends, strict=True):
            row = targets[end - s.num_new_tokens : end]
            drafts = s.request.draft_token_ids
            m = 0
            while m < len(drafts) and drafts[m] == row[m]:
                m += 1
            accepted.append(row[: m + 1])
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_draft_tokens += m
            stats.num_verify_tokens += m + 1
            drafts.clear()
        stats.num_verify_steps += 1
        stats.num_verified_requests += len(scheduled)
        return accepted

    def _draft(self, engine, scheduled, hidden: Tensor, kept: list[int], ends: list[int]) -> None:
        """Run the MTP layer over each running request's kept pairs; draft after the last."""
        picks = [
            (s, n, end)
            for s, n, end in zip(scheduled, kept, ends, strict=True)
            if s.request.status is RequestStatus.RUNNING and n > 0
        ]
        if not picks:
            return
        requests: list[Request] = [s.request for s, _, _ in picks]
        starts = [s.start for s, _, _ in picks]
        counts = [n for _, n, _ in picks]
        rows: list[int] = []
        token_ids: list[int] = []
        positions: list[int] = []
        for (s, n, end), r in zip(picks, requests, strict=True):
            first = end - s.num_new_tokens
            rows.extend(range(first, first + n))
            # pair p reads token p+1: a later prompt token, or the one just sampled/accepted
            token_ids.extend(r.token_ids_slice(s.start + 1, s.start + n + 1))
            positions.extend(range(s.start + 1, s.start + n + 1))
        device = engine.device
        tables = engine.kv_manager.step_tables(
            [r.request_id for r in requests], starts=starts, num_new_tokens=counts
        )
        md = step_metadata(
            is_prefill=True,
            q_lens=counts,
            kv_lens=[a + n for a, n in zip(starts, counts, strict=True)],
            block_table={k: t.to(device) for k, t in tables.block_table.items()},
            slot_mapping={k: t.to(device) for k, t in tables.slot_mapping.items()},
            attention_mask=engine.attention_mask,
            device=device,
        )
        previous = hidden[:, int64_tensor(rows).to(device)]
        ids = int64_tensor(token_ids).to(device).unsqueeze(0)
        pos = int64_tensor(positions).to(device).unsqueeze(0)
        with torch.inference_mode(), forward_context(md):
            out = self.drafter(ids, previous, pos)
            logits = self.drafter.logits(out[0]).float()
        self.last_draft_logits = logits
        last_rows = [i - 1 for i in accumulate(counts)]
        guesses = greedy_tokens(logits[last_rows]).tolist()
        wanted: dict[int, int] = {}
        for i, (r, guess) in enumerate(zip(requests, guesses, strict=True)):
            n = 0 if r.is_prefilling else self._num_drafts(engine, r)
            if n:
                r.draft_token_ids[:] = [guess]
                wanted[i] = n
        self._chain(engine, requests, wanted, out[0, last_rows])

    def _chain(self, engine, requests: list[Request], wanted: dict[int, int], hidden) -> None:
        """Drafts after the first: the same MTP layer over its own output and its last draft
        (pair j+1 reads the layer's output for pair j), one row per request per round, until
        each request has what it wants. Row P+j of the MTP cache takes the round's pair (P =
        the request's last kept pair); the next step's drafter pass writes the kept rows
        again with the main model's hidden states before any later round reads them."""
        previous = {i: hidden[k] for k, i in enumerate(wanted)}
        active = [i for i, n in wanted.items() if n > 1]
        device = engine.device
        while active:
            rows, keep = [], []
            for i in active:
                r = requests[i]
                row = r.num_computed_tokens - 1 + len(r.draft_token_ids)
                # the slot of row ``row`` (drafts only: a full pool ends the chain early)
                grown = engine.kv_manager.allocate_slots(
                    r.request_id, row + 1, num_computed_tokens=r.num_computed_tokens
                )
                if grown is not None:
                    rows.append(row)
                    keep.append(i)
            if not keep:
                return
            ids = [requests[i].request_id for i in keep]
            tables = engine.kv_manager.step_tables(ids, starts=rows, num_new_tokens=[1] * len(keep))
            md = step_metadata(
                is_prefill=False,
                q_lens=[1] * len(keep),
                kv_lens=[row + 1 for row in rows],
                block_table={k: t.to(device) for k, t in tables.block_table.items()},
                slot_mapping={k: t.to(device) for k, t in tables.slot_mapping.items()},
                attention_mask=engine.attention_mask,
                device=device,
            )
            tokens = [requests[i].draft_token_ids[-1] for i in keep]
            with torch.inference_mode(), forward_context(md):
                out = self.drafter(
                    int64_tensor(tokens).to(device).unsqueeze(0),
                    torch.stack([previous[i] for i in keep]).unsqueeze(0),
                    int64_tensor([row + 1 for row in rows]).to(device).unsqueeze(0),
                )
                guesses = greedy_tokens(self.drafter.logits(out[0]).float()).tolist()
            for k, (i, guess) in enumerate(zip(keep, guesses, strict=True)):
                requests[i].draft_token_ids.append(guess)
                previous[i] = out[0, k]
            active = [i for i in keep if len(requests[i].draft_token_ids) < wanted[i]]

    def _num_drafts(self, engine, request: Request) -> int:
        """Drafts worth feeding: up to speculative_tokens, and never past the request's last
        token (a verify step emits at most one token more than it drafts)."""
        params = request.sampling_params
        left = min(
            params.max_tokens - len(request.output_token_ids),
            engine.config.max_model_len - request.num_tokens,
        )
        return max(0, min(self.num_speculative_tokens, left - 1))
