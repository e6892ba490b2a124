"""Each request's own tokens beside a reduced draft vocabulary (``draft_vocab_context``).

A head drafting over the N most frequent tokens (``draft_vocab: N``) cannot propose a
token outside them, and the tokens it misses most are the names and identifiers a
request takes from its own prompt: of the target's greedy answers' tokens outside the
4096 most frequent, 58% on MT-bench and 79% on HumanEval already occur earlier in the
same conversation. Drafting over the N frequent tokens plus every token the request has
seen (prompt and output so far) raises the SmolLM2 head's depth-1 agreement with the
target from 0.446 to 0.467 (MT-bench) and 0.495 to 0.528 (HumanEval), within 0.002 of
drafting the whole vocabulary, for a few hundred more LM-head rows
(``benchmarks/results/head-agreement-context-cpu.md`` and ``-fullvocab-cpu.md``).

This module keeps the token sets (pure torch, no vLLM): one boolean row over the
vocabulary per request, updated with only the tokens added since the last call. A batch
drafts over one set of extra columns, the union of its requests' tokens outside the
frequent ones, and ``allowed`` says which of them each request may draft (its own
context): the others are masked out of its distribution, so a request's drafts never
depend on what the other requests in the batch wrote. Which columns a draft may use
cannot affect losslessness: verification reads the target's distribution and the
draft's q (zero outside the columns) or argmax.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["ContextVocabulary"]


class ContextVocabulary:
    """Per-request seen tokens over a vocabulary of ``vocab_size``, outside ``base_ids``.

    ``sync`` adds each request's new prompt and output tokens; ``columns`` gives a batch's
    extra token ids and which of them each request has seen; ``forget`` drops requests.
    """

    def __init__(self, vocab_size: int, base_ids: torch.Tensor) -> None:
        self.vocab_size = int(vocab_size)
        self.in_base = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.in_base[base_ids.to("cpu", torch.int64)] = True
        # req id -> (seen tokens [V] bool, output tokens read so far)
        self._seen: dict[str, tuple[torch.Tensor, int]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def sync(self, req_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Add the request's tokens not read before: its prompt the first time, then the
        output tokens past the ones already read. Ids outside the vocabulary are skipped,
        and so are placeholders (< 0: vLLM's tokens not known yet, which it later deletes
        and appends the real ones after): reading stops at the first, so the tokens that
        replace it are read next time. A list that shrank is read on from its new end."""
        entry = self._seen.get(req_id)
        if entry is None:
            seen = torch.zeros(self.vocab_size, dtype=torch.bool)
            self._mark(seen, prompt_ids)
            read = 0
        else:
            seen, read = entry
        read = min(read, len(output_ids))
        new = output_ids[read:]
        if len(new):
            self._mark(seen, new)
            placeholder = next((i for i, t in enumerate(new) if t < 0), len(new))
            read += placeholder
        self._seen[req_id] = (seen, read)

    def _mark(self, seen: torch.Tensor, token_ids: Sequence[int]) -> None:
        if len(token_ids) == 0:
            return
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        seen[ids] = True

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop requests (finished ones): their ids may come back as new requests."""
        for req_id in req_ids:
            self._seen.pop(req_id, None)

    def columns(self, req_ids: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's extra columns: token ids ``[E]`` (ascending) that some request of
        ``req_ids`` has seen and the base vocabulary lacks, and ``allowed [B, E]``, whether
        request b has seen each. A request never synced has seen nothing."""
        rows = [self._seen[r][0] for r in req_ids if r in self._seen]
        if not rows:
            return torch.empty(0, dtype=torch.int64), torch.zeros(len(req_ids), 0, dtype=torch.bool)
        union = rows[0].clone() if len(rows) == 1 else torch.stack(rows).any(dim=0)
        extra = torch.nonzero(union & ~self.in_base).flatten()
        empty = torch.zeros(len(extra), dtype=torch.bool)
        allowed = torch.stack(
            [self._seen[r][0][extra] if r in self._seen else empty for r in req_ids]
        )
        return extra, allowed
