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

This module keeps the token sets (pure torch, no vLLM) and the columns drafts use, both
updated by what changed since the last step, so that a step costs nearly nothing when no
request met a new token:

* each request's tokens outside the frequent ones, as a Python set (the new ones of a step
  are a handful) and as a row of a ``[slots, V]`` boolean matrix (to gather whole rows);
* one column table, append-only between compactions: every token some live request has
  seen gets a column when it is first seen, so a step's LM-head rows are the previous
  step's plus the new columns' (``columns`` says from which column they are new). A
  finished request's tokens stay as dead columns until they outnumber the live ones and
  the table is rebuilt.

The columns are those of every request being tracked, a superset of the batch's own;
``allowed`` says which of them each request of the batch may draft (its own context):
the others are masked out of its distribution, so a request's drafts never depend on
what other requests wrote. Which columns a draft may use cannot affect losslessness:
verification reads the target's distribution and the draft's q (zero outside the
columns) or argmax.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ContextVocabulary"]

# dead columns tolerated before the table is rebuilt: at least this many, or as many as
# the live ones (a rebuild makes the drafter gather every row again)
MIN_DEAD_COLUMNS = 256


@dataclass
class _Request:
    slot: int  # its row of ``ContextVocabulary._seen``
    read: int = 0  # output tokens read so far
    tokens: set[int] = field(default_factory=set)  # its tokens outside the base


class ContextVocabulary:
    """Per-request seen tokens over a vocabulary of ``vocab_size``, outside ``base_ids``.

    ``sync`` adds each request's new prompt and output tokens; ``columns`` gives the
    extra token ids, which of them each request of a batch has seen, and from which
    column they are new since the last call; ``forget`` drops requests.
    """

    def __init__(self, vocab_size: int, base_ids: torch.Tensor) -> None:
        self.vocab_size = int(vocab_size)
        self._in_base = bytearray(self.vocab_size)  # read per token in Python
        for token in base_ids.tolist():
            self._in_base[token] = 1
        self._requests: dict[str, _Request] = {}
        self._free_slots: list[int] = []
        self._seen = torch.zeros(0, self.vocab_size, dtype=torch.bool)
        self._pending: list[tuple[int, int]] = []  # (slot, token) not yet set in _seen
        self._live = [0] * self.vocab_size  # how many tracked requests have seen a token
        self._column_of: dict[int, int] = {}  # token -> its column
        self._column_ids = torch.empty(0, dtype=torch.int64)  # the table (capacity)
        self._num_columns = 0
        self._dead_columns = 0
        self._reported = 0  # columns ``columns`` has returned since the table was built
        self._version = 0  # moves whenever a tracked request's tokens or the table change
        self._allowed_cache: tuple[tuple, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_dead_columns(self) -> int:
        return self._dead_columns

    def sync(self, req_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Add the request's tokens not read before: its prompt the first time, then the
        output tokens past the ones already read. Ids outside the vocabulary are skipped,
        and so are placeholders (< 0: vLLM's tokens not known yet, which it later deletes
        and appends the real ones after): reading stops at the first, so the tokens that
        replace it are read next time. A list that shrank is read on from its new end."""
        request = self._requests.get(req_id)
        if request is None:
            request = self._requests[req_id] = _Request(self._take_slot())
            self._add(request, sorted(set(prompt_ids)))
        request.read = min(request.read, len(output_ids))
        new = output_ids[request.read :]
        if new:
            placeholder = next((i for i, t in enumerate(new) if t < 0), len(new))
            self._add(request, new[:placeholder])
            request.read += placeholder

    def _add(self, request: _Request, token_ids: Sequence[int]) -> None:
        in_base, vocab_size = self._in_base, self.vocab_size
        tokens, slot = request.tokens, request.slot
        for token in token_ids:
            if 0 <= token < vocab_size and not in_base[token] and token not in tokens:
                tokens.add(token)
                self._pending.append((slot, token))
                self._live[token] += 1
                column = self._column_of.get(token)
                if column is None:
                    self._append_column(token)
                elif self._live[token] == 1:  # a dead column comes back to life
                    self._dead_columns -= 1
                self._version += 1

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        slot = len(self._requests)  # slots 0..n-1 are taken when none is free
        if slot >= len(self._seen):
            grown = torch.zeros(max(8, 2 * len(self._seen)), self.vocab_size, dtype=torch.bool)
            grown[: len(self._seen)] = self._seen
            self._seen = grown
        return slot

    def _append_column(self, token: int) -> None:
        if self._num_columns == len(self._column_ids):
            grown = torch.empty(max(256, 2 * self._num_columns), dtype=torch.int64)
            grown[: self._num_columns] = self._column_ids[: self._num_columns]
            self._column_ids = grown
        self._column_ids[self._num_columns] = token
        self._column_of[token] = self._num_columns
        self._num_columns += 1

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop requests (finished ones): their ids may come back as new requests."""
        for req_id in req_ids:
            request = self._requests.pop(req_id, None)
            if request is None:
                continue
            self._flush_pending()
            self._seen[request.slot] = False
            self._free_slots.append(request.slot)
            for token in request.tokens:
                self._live[token] -= 1
                if self._live[token] == 0:
                    self._dead_columns += 1
            self._version += 1
        if self._dead_columns > max(MIN_DEAD_COLUMNS, self._num_columns - self._dead_columns):
            self._rebuild_columns()

    def _rebuild_columns(self) -> None:
        """A table of the live tokens only, ascending; every column is new again."""
        live = sorted(t for t in self._column_of if self._live[t] > 0)
        self._column_ids = torch.tensor(live, dtype=torch.int64)
        self._column_of = {t: i for i, t in enumerate(live)}
        self._num_columns, self._dead_columns, self._reported = len(live), 0, 0
        self._version += 1

    def _flush_pending(self) -> None:
        if self._pending:
            slots, tokens = zip(*self._pending)
            self._seen[torch.tensor(slots), torch.tensor(tokens)] = True
            self._pending.clear()

    def columns(self, req_ids: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The draft's extra columns: token ids ``[E]`` outside the base vocabulary, every
        token a tracked request has seen (and dead ones of finished requests, until the
        table is rebuilt); ``allowed [B, E]``, whether request b of ``req_ids`` has seen
        each (a request never synced has seen nothing); and the first column not
        returned by an earlier call (0 after a rebuild: all are new). Columns only ever
        append between rebuilds, so the caller keeps the rows of the old ones."""
        self._flush_pending()
        extra = self._column_ids[: self._num_columns]
        key = (self._version, tuple(req_ids))
        if self._allowed_cache is not None and self._allowed_cache[0] == key:
            allowed = self._allowed_cache[1]
        elif self._num_columns == 0:
            allowed = torch.zeros(len(req_ids), 0, dtype=torch.bool)
        else:
            slots = torch.tensor([
                r.slot if (r := self._requests.get(req_id)) else -1 for req_id in req_ids
            ])  # fmt: skip
            allowed = self._seen[slots.clamp(min=0)[:, None], extra[None, :]]
            allowed[slots < 0] = False  # never synced
            self._allowed_cache = (key, allowed)
        first_new, self._reported = self._reported, self._num_columns
        return extra, allowed, first_new
