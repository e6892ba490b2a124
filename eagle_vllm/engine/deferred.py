"""Deferred drafting: skip the drafter in plain decode steps while drafts are off.

When the sizer chooses no drafts after a plain decode step, the drafter's first pass
(which writes the draft KV of the tokens just verified) is skipped and its inputs, one
token and one target feature per request, are kept here (``defer``). The draft KV of
those positions is written later in one batched forward (``catch_up``):

* before any first pass of that request (drafting resumes; its first pass reads it);
* when a request has ``MAX_DEFERRED_TOKENS`` waiting (memory);
* when the request finishes or is preempted, for its full KV blocks only, if prefix
  caching may serve them to a later request (``leaving_catch_up``).

A request that finishes while drafts are off never pays for them without prefix
caching. Each deferred position attends to the draft KV before its run (paged cache)
and to the run's earlier positions (causal), exactly as the first pass would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_vllm import vllm_surface

# Deferred positions a request may collect before they are written anyway. Large, so a
# request that finishes while drafts are off (high load) usually never pays for them;
# bounded, for memory (one feature per position) and because KV blocks filled meanwhile
# may be shared by prefix caching, without their draft KV (drafts only: never outputs).
MAX_DEFERRED_TOKENS = 128


@dataclass
class DeferredRun:
    """First-pass inputs of skipped steps: the draft KV of position ``start + i`` needs
    ``tokens[i]`` (the token at the next position) and ``features[i]`` (the target's
    feature at this one)."""

    start: int
    tokens: list[int]
    features: list[torch.Tensor]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class DeferredDrafts:
    """Per request, the run of positions whose draft KV waits to be written."""

    def __init__(self, max_tokens: int = MAX_DEFERRED_TOKENS):
        self.max_tokens = max_tokens
        self.runs: dict[str, DeferredRun] = {}
        self.written_positions = 0  # draft KV positions written by catch_up, in all

    def __bool__(self) -> bool:
        """Whether any request has deferred positions (cheap: checked every step)."""
        return bool(self.runs)

    def end(self, req_id: str) -> int | None:
        """The first position after a request's deferred run (None: nothing deferred)."""
        run = self.runs.get(req_id)
        return None if run is None else run.end

    def defer(
        self,
        req_ids: list[str],
        positions: torch.Tensor,
        next_tokens: torch.Tensor,
        features: torch.Tensor,
        live_req_ids,
    ) -> bool:
        """Keep a skipped first pass's inputs: request b's draft KV at ``positions[b]``
        needs ``next_tokens[b]`` and ``features[b]``. Requests not in ``live_req_ids``
        are dropped (finished or aborted: their blocks are gone). True when a request
        now has ``max_tokens`` waiting (the caller should ``catch_up``)."""
        for req_id in [r for r in self.runs if r not in live_req_ids]:
            del self.runs[req_id]
        features = features.detach().clone()  # the runner reuses its buffers
        full = False
        for b, (req_id, pos, token) in enumerate(
            zip(req_ids, positions.tolist(), next_tokens.tolist())
        ):
            run = self.runs.get(req_id)
            if run is None or run.end != pos:
                # nothing kept, or positions recomputed since (preemption): the first
                # pass of the recomputation wrote the draft KV before ``pos``
                run = self.runs[req_id] = DeferredRun(pos, [], [])
            run.tokens.append(int(token))
            run.features.append(features[b])
            full |= len(run.tokens) >= self.max_tokens
        return full

    @torch.inference_mode()
    def catch_up(
        self,
        drafter,
        req_ids: list[str],
        next_positions: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        limits: torch.Tensor | None = None,
    ) -> int:
        """Write the draft KV of every deferred position of these requests (batch rows)
        in one forward of ``drafter``'s layers; ``next_positions[b]``: request b's first
        position not deferred (a request whose deferred run does not end there was
        recomputed and is dropped); ``limits[b]``: write only positions below it (the
        rest is dropped). Returns the number of positions written."""
        rows, kept = [], []
        ends = limits.tolist() if limits is not None else [None] * len(req_ids)
        for b, (req_id, nxt, limit) in enumerate(zip(req_ids, next_positions.tolist(), ends)):
            run = self.runs.pop(req_id, None)
            if run is None or run.end != nxt:
                continue
            if limit is not None:
                keep = max(0, limit - run.start)
                run = DeferredRun(run.start, run.tokens[:keep], run.features[:keep])
            if run.tokens:
                rows.append(b)
                kept.append(run)
        if not rows:
            return 0
        device = kept[0].features[0].device
        lengths = torch.tensor([len(r.tokens) for r in kept], dtype=torch.int64)
        starts = torch.tensor([r.start for r in kept], dtype=torch.int64)
        width = int(lengths.max())
        tokens = torch.zeros(len(kept), width, dtype=torch.int64)
        features = torch.zeros(len(kept), width, kept[0].features[0].shape[-1],
                               dtype=kept[0].features[0].dtype, device=device)  # fmt: skip
        for i, run in enumerate(kept):
            tokens[i, : len(run.tokens)] = torch.tensor(run.tokens)
            features[i, : len(run.tokens)] = torch.stack(run.features)
        valid = torch.arange(width)[None, :] < lengths[:, None]  # [R, W]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = (causal[None] & valid[:, None, :]).to(device)
        positions = (starts[:, None] + torch.arange(width)[None, :]).clamp(
            max=drafter.max_model_len - 1
        )
        table = block_table[torch.tensor(rows)]
        node_kv = drafter.forward_runs(tokens, features, positions, table, starts, mask)
        written = positions[valid]
        table_rows = torch.arange(len(rows))[:, None].expand_as(positions)[valid]
        slots = vllm_surface.slots_of(table, table_rows, written, block_size).to(device)
        valid_rows = valid.to(device)
        for attn, (node_k, node_v) in node_kv:
            drafter.platform.write_kv(attn, node_k[valid_rows], node_v[valid_rows], slots)
        self.written_positions += int(valid.sum())
        return int(valid.sum())

    def leaving(self, finished: set[str], req_id_to_index: dict[str, int]):
        """Requests leaving this step with deferred positions, and their batch rows."""
        req_ids = [r for r in sorted(finished) if r in req_id_to_index and r in self.runs]
        return req_ids, [req_id_to_index[r] for r in req_ids]
