"""Suffix decoding: a model-free draft source (pure Python, no vLLM, no torch at import).

Text that a model writes repeats itself: code, lists, answers that quote the prompt, the
same phrasing across answers to similar questions. A suffix index finds where the last
tokens of the context occurred before and what followed them, with counts, and proposes
those continuations as a draft tree. This module is the drafting counterpart of
:mod:`eagle_vllm.tree`: it only decides WHAT to draft; the runner verifies it.

Pieces
------
* :class:`SuffixIndex`: the data structure (below), over one or many token sequences.
* :class:`GlobalSuffixCache`: the responses of the last ``max_requests`` finished
  requests, one index per :data:`CacheKey`, FIFO eviction, plus an optional shared seed
  corpus.
* :class:`RequestSuffixes`: one index per running request over its prompt and output,
  updated with each step's accepted tokens; ``finish`` moves the response into the global
  cache, ``propose`` drafts from both.
* :func:`propose`: the candidate tree, :class:`SuffixCandidates`, for a context and any
  indexes (:meth:`RequestSuffixes.propose` is the fast path of the same rule);
  :func:`candidates_to_tree` pads a batch of them into a
  :class:`~eagle_vllm.tree.layout.DraftTree`.

The data structure: a depth-bounded suffix trie with implicit unique tails
-------------------------------------------------------------------------
Conceptually the index is the trie of every substring of length <= ``max_len`` of its
sequences (ArcticInference's ``max_depth``), and every node counts the positions where its
string occurs. Stored naively that is ``max_len`` nodes per token (a 2k-token prompt at
``max_len`` 32: 64k nodes). Most of those nodes lie on paths that occur once, so a node
whose string occurs exactly once is stored as a LEAF that records only where its one
occurrence starts (sequence, start); everything below it is that occurrence's own text,
read from the sequence when needed. Only strings that occur at least twice (plus, after
removals, some that dropped back to one) are explicit nodes with a child table. Invariant:
every occurrence passing through an explicit node continues into an explicit child (node
or leaf) whenever it continues at all within ``max_len``.

Why this and not a suffix tree or automaton: appending a token extends the sequence's
suffixes that are currently repeated, and those are exactly the ones at explicit nodes
(a suffix that occurs once sits in its own leaf, which grows for free). So an append costs
one dict look-up and one count increment per repeated suffix, at most ``max_len``, and
does not depend on the sequence length; the explicit nodes of the current suffixes ARE the
matches of the context against the request's own text, so matching it costs nothing. A
leaf that a second occurrence reaches is split one level at a time (each append makes at
most one node per suffix). Removing a sequence walks its suffixes down to their leaves.
A compressed suffix tree (ArcticInference) has the same update bounds and stores a repeated
stretch as one edge instead of one node per token, so it needs less memory on very
repetitive text (about 3.5 nodes per token on SmolLM2's own answers, 70-80 MB for 1000
responses of 300 tokens), but it splits and merges edges and fixes references on removal;
a suffix automaton cannot give per-node continuation counts incrementally. Storage is flat
(lists of counts and leaf pointers; children as one packed int or a small dict), so the
garbage collector tracks no per-node objects.

Counts and probabilities
------------------------
``count(s)`` is the number of positions where ``s`` occurs (only substrings of length
<= ``max_len`` are indexed). A continuation ``c`` of ``s`` has probability
``count(s + c) / count(s)``: the share of ALL occurrences of ``s`` that went on with
``c`` (ArcticInference's rule). Occurrences that end (the end of a response, or the context's
own occurrence, whose next token is what we are guessing) stay in the denominator, which
discounts thin evidence: one earlier occurrence in the request's own text gives 1/2.

Candidates: :func:`propose`
---------------------------
1. Matches. For every length ``m`` of a suffix of the context (up to ``max_len - 1`` and
   ``max_match``), every index that contains it contributes its node for it. Consecutive
   lengths whose per-index counts are equal have the same occurrences (a longer match
   cannot occur more often, and equal counts mean the same positions), hence the same
   continuations; they form one group, expanded once from its SHORTEST length ``m_lo``
   (it has the most room below ``max_len``), and credited to its LONGEST length ``m_hi``.
2. Depth. A group may draft to depth ``min(max_depth, max_len - m_lo,
   floor(spec_factor * m_hi + spec_offset))``: as in ArcticInference, a short match
   (a single common token) is trusted for few tokens, a long one for many.
3. Combination of indexes: counts are summed. The request's own index, the global index
   of its cache key and the seed corpus act as one index over all their text, so a
   continuation seen in the request's text and in past answers gets the evidence of both,
   and the context's own occurrence discounts global-only evidence too.
4. Expansion: best-first by path probability over all groups at once (ties: shallower
   node, then earlier parent, then smaller token id). A path predicted by several groups is
   one node, with the best of their probabilities (the first to be popped), and the
   children each group predicts below it. A node is kept if its path probability is at
   least ``min_prob`` (ArcticInference's ``min_token_prob`` is also a path probability), up
   to ``max_nodes`` nodes counting the root. (ArcticInference instead drafts from the one
   match length whose draft scores best; a tree can take the best of every length.)

Cost (``benchmarks/micro/suffix_cost.py``, SmolLM2's own answers, 2-core CPU): extend +
propose ~50-90 us per request per step from the request's own text, ~120-210 us with a
global cache of 1000 responses of 300 tokens, at 1 to 64 requests; indexing a 2048-token
prompt 3-13 ms (plain to very repetitive text); finishing a request (caching its response
and evicting the oldest) ~5 ms. Short global contexts have thousands of children, so nodes
with more than 16 keep the few above 1/32 of their count, maintained as counts change.

Output (:class:`SuffixCandidates`) follows :mod:`eagle_vllm.tree.layout`: node 0 is the
root (the context's last token, already accepted), the others are in the order they were
popped, which is topological (``parents[i] < i``); ``scores`` are log path probabilities
(root 0.0), non-increasing along every path; ``depths`` count edges from the root.

Isolation: why global candidates are keyed by (cache_salt, LoRA adapter)
------------------------------------------------------------------------
Speculation is lossless: whatever is drafted, the target's verification makes the output
distribution exactly that of plain decoding, so drafting from another user's responses
cannot change what a user receives. It changes HOW FAST they receive it: when the draft
(another user's text) matches what the target writes, more tokens are accepted per step.
A user who can time their own responses could thus probe whether a guessed text (a name,
a document) was recently generated for someone else, the same side channel as prefix-cache
timing, which vLLM closes with ``cache_salt``. So the global cache keeps one index per
:data:`CacheKey` ``(cache_salt, lora_name)`` and drafts only from the key's own responses;
requests without a salt share among themselves exactly as they share prefix-cache blocks.
The adapter is part of the key because different adapters may belong to different tenants
(and their texts differ, so cross-adapter drafts would mostly be rejected anyway). The seed
corpus is operator-provided text (e.g. the target's own answers to public prompts), not
any user's, so every key may draft from it; ``max_requests=0`` turns the response cache
(the only cross-request source) off.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle_vllm.tree.layout import DraftTree

__all__ = [
    "CacheKey",
    "GlobalSuffixCache",
    "RequestSuffixes",
    "SuffixCandidates",
    "SuffixIndex",
    "cache_key",
    "candidates_to_tree",
    "propose",
]

#: ``(cache_salt, lora adapter name)``; ``(None, None)`` for unsalted base-model requests.
CacheKey = tuple[str | None, str | None]

_SHIFT = 32  # leaf pointer = (sequence slot << _SHIFT) | start
_MASK = (1 << _SHIFT) - 1
_OWN = -1  # cursor node of "the context's own occurrence": count 1, no continuation yet
_TOP_MIN = 16  # nodes with more children keep a list of their heavy ones (SuffixIndex._tops)
_TOP_SHIFT = 5  # heavy: count >= 1/32 of the node's, enough for min_prob 0.1 over 3 indexes
_TOP_MAX = 128  # a heavy list grown past this is rebuilt (its cut has become too low)


def cache_key(cache_salt: str | None = None, lora_name: str | None = None) -> CacheKey:
    """The key that isolates global candidates (see the module docstring)."""
    return (cache_salt, lora_name)


class SuffixIndex:
    """Depth-bounded suffix trie with counts over several token sequences.

    ``max_len``: the longest indexed substring, i.e. match length plus draft depth
    (ArcticInference's ``max_depth``). Sequences are named by any hashable id; they are
    grown with :meth:`extend` and dropped with :meth:`remove`. Costs: :meth:`extend`
    O(r) per token, r = the number of the sequence's current suffixes that occur
    elsewhere too (<= ``max_len``); :meth:`remove` O(sum over the sequence's positions of
    how deep its suffix is repeated); :meth:`count` O(len(pattern)).

    Storage (flat, so the garbage collector tracks no per-node objects): ``_count[node]``
    and ``_ptr[node]`` (lists of ints: faster than ``array``, which boxes on every read),
    and ``_kids[node]``: None (no children), an int (one child, packed as
    ``token << 32 | child``: most explicit nodes of repetitive text have one child, and an
    int is ~6x smaller than a dict), or a dict ``token -> child``.
    """

    __slots__ = (
        "max_len",
        "_count",
        "_ptr",
        "_kids",
        "_free",
        "_seqs",
        "_slots",
        "_active",
        "_next_slot",
        "_stale",
        "_tops",
    )

    def __init__(self, max_len: int = 32) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = int(max_len)
        # Node 0 is the root; its count is the number of indexed tokens.
        self._count = [0]  # occurrences of the node's string
        self._ptr = [-1]  # leaf: (slot << 32) | start of its one occurrence; else -1
        self._kids: list[int | dict[int, int] | None] = [None]
        self._free: list[int] = []  # ids of removed nodes, reused first
        self._seqs: dict[int, array] = {}  # slot -> tokens
        self._slots: dict[Hashable, int] = {}  # sequence id -> slot
        self._next_slot = 0  # slots are never reused: a stale leaf pointer would alias
        # slot -> [root, explicit nodes of the sequence's repeated suffixes of lengths
        # 1, 2, ... < max_len]: the suffixes an append extends
        self._active: dict[int, list[int]] = {}
        # Slots whose active list another sequence's insertion made stale (see _resync).
        self._stale: set[int] = set()
        # node -> [cut, {token: child}] holding at least every child whose count is
        # >= cut, for nodes with more than _TOP_MIN children: the short contexts of a big
        # global index, which every request reads every step. Candidates need only the
        # children above min_prob of the node's count, so a query reads these few instead
        # of scanning thousands. Kept up to date as counts change (a child that reaches
        # the cut joins; one that falls below may stay: a superset is still exact, since
        # queries filter by the live counts), so the cache survives inserts and evictions.
        self._tops: dict[int, list] = {}

    # ------------------------------------------------------------------ building
    def _free_node(self, node: int) -> None:
        self._count[node] = 0
        self._ptr[node] = -1
        self._kids[node] = None
        self._tops.pop(node, None)
        self._free.append(node)

    def _unlink(self, u: int, t: int) -> None:
        """Delete u's child for token t (the child itself is freed by the caller)."""
        ku = self._kids[u]
        if ku.__class__ is int:
            self._kids[u] = None
            return
        del ku[t]  # type: ignore[union-attr]
        h = self._tops.get(u)
        if h is not None:
            h[1].pop(t, None)
        if len(ku) == 1:  # type: ignore[arg-type]
            self._tops.pop(u, None)
            ((t1, c1),) = ku.items()  # type: ignore[union-attr]
            self._kids[u] = (t1 << _SHIFT) | c1

    def extend(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created if new)."""
        slot = self._slots.get(seq_id)
        if slot is None:
            slot = self._next_slot
            self._next_slot += 1
            self._slots[seq_id] = slot
            self._seqs[slot] = array("q")
            self._active[slot] = [0]
        elif slot in self._stale:
            self._resync(slot)
        seq = self._seqs[slot]
        active = self._active[slot]  # active[d]: the node of the suffix of length d
        seqs, tops, free = self._seqs, self._tops, self._free
        count, ptr, kids = self._count, self._ptr, self._kids
        max_len = self.max_len
        base = slot << _SHIFT
        for t in tokens:
            t = int(t)
            n = len(seq)
            seq.append(t)
            count[0] += 1
            new_active = [0]
            keep = new_active.append
            # Suffix lengths before the append: d = 0 (the suffix starting at n, at the
            # root) and the repeated ones, shortest first (all shorter than max_len).
            for d, u in enumerate(active):
                ku = kids[u]
                if ku is None:
                    c = -1
                elif ku.__class__ is int:
                    c = ku & _MASK if ku >> _SHIFT == t else -1
                else:
                    c = ku.get(t, -1)  # type: ignore[union-attr]
                if c < 0:
                    # First occurrence of this string: a leaf. Every longer suffix is new too
                    # (its own suffix is this one), so the rest of the loop makes leaves.
                    if free:
                        c = free.pop()
                        count[c] = 1
                        ptr[c] = base | (n - d)
                    else:
                        c = len(kids)
                        count.append(1)
                        ptr.append(base | (n - d))
                        kids.append(None)
                    if ku is None:
                        kids[u] = (t << _SHIFT) | c
                    elif ku.__class__ is int:
                        kids[u] = {ku >> _SHIFT: ku & _MASK, t: c}
                    else:
                        ku[t] = c  # type: ignore[index]
                        h = tops.get(u)
                        if h is not None and h[0] <= 1:
                            h[1][t] = c
                            if len(h[1]) > _TOP_MAX:
                                del tops[u]
                    continue
                p = ptr[c]
                if p >= 0:
                    # A leaf reached by a second occurrence becomes explicit; its first
                    # occurrence continues one level down as a leaf (if it continues).
                    other = seqs[p >> _SHIFT]
                    q = (p & _MASK) + d + 1
                    if q < len(other):
                        if d + 2 <= max_len:
                            if free:
                                g = free.pop()
                                count[g] = 1
                                ptr[g] = p
                            else:
                                g = len(kids)
                                count.append(1)
                                ptr.append(p)
                                kids.append(None)
                            kids[c] = (other[q] << _SHIFT) | g
                    elif p >> _SHIFT != slot:
                        # That occurrence is the current end of another sequence, which
                        # has not listed this now repeated suffix among its active ones.
                        self._stale.add(p >> _SHIFT)
                    ptr[c] = -1
                k = count[c] + 1
                count[c] = k
                h = tops.get(u)
                if h is not None and k >= h[0]:
                    h[1][t] = c
                    if len(h[1]) > _TOP_MAX:
                        del tops[u]
                keep(c)
            if len(new_active) > max_len:  # a suffix of length max_len cannot grow
                del new_active[max_len:]
            active = new_active
        self._active[slot] = active

    def _resync(self, slot: int) -> None:
        """Rebuild a sequence's active list (its suffixes at explicit nodes) by walking.

        Needed only when sequences are grown in turns: another sequence's insertion can
        repeat this one's unique end, which then sits at an explicit node this sequence
        does not track. O(max_len**2), once per such extend; an index with one growing
        sequence (a request's) or with whole inserted sequences (the global cache) never
        needs it.
        """
        self._stale.discard(slot)
        seq = self._seqs[slot]
        active = [0]
        for m in range(1, min(len(seq), self.max_len - 1) + 1):
            cur = self._walk(seq[len(seq) - m :])
            if cur is None or self._ptr[cur[0]] >= 0:
                break  # a leaf: this suffix and every longer one occur only here
            active.append(cur[0])
        self._active[slot] = active

    def remove(self, seq_id: Hashable) -> None:
        """Forget sequence ``seq_id``: every count it contributed, and its nodes."""
        slot = self._slots.pop(seq_id)
        seq = self._seqs.pop(slot)
        del self._active[slot]
        self._stale.discard(slot)
        count, ptr, kids = self._count, self._ptr, self._kids
        max_len = self.max_len
        n = len(seq)
        count[0] -= n
        for start in range(n):
            u = 0
            for i in range(start, min(n, start + max_len)):
                t = seq[i]
                ku = kids[u]
                c = ku & _MASK if ku.__class__ is int else ku[t]  # type: ignore[index,operator]
                if ptr[c] >= 0:  # this occurrence's own leaf
                    self._unlink(u, t)
                    self._free_node(c)
                    break
                left = count[c] - 1
                if left == 0:
                    # Nothing else passes here: the subtree is this occurrence's chain.
                    self._unlink(u, t)
                    while c >= 0:
                        kc = kids[c]
                        self._free_node(c)
                        if kc is None:
                            c = -1
                        elif kc.__class__ is int:
                            c = kc & _MASK
                        else:
                            c = next(iter(kc.values()))  # type: ignore[union-attr]
                    break
                count[c] = left  # a heavy child may fall below its cut: still a superset
                u = c

    # ------------------------------------------------------------------ queries
    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slots

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self._slots)

    @property
    def num_tokens(self) -> int:
        return self._count[0]

    @property
    def num_nodes(self) -> int:
        """Stored nodes (explicit and leaves, root included)."""
        return len(self._kids) - len(self._free)

    def sequence(self, seq_id: Hashable) -> list[int]:
        """A copy of sequence ``seq_id``'s tokens."""
        return self._seqs[self._slots[seq_id]].tolist()

    def sequence_ids(self) -> list[Hashable]:
        """Sequence ids, oldest first."""
        return list(self._slots)

    def _walk(self, pattern: Sequence[int]) -> tuple[int, int] | None:
        """Cursor ``(node, depth)`` of ``pattern``, or None if it does not occur.

        ``node`` is the deepest stored node on the path; if it is a leaf, the cursor may
        lie below it (``depth`` > the leaf's depth) on its occurrence's own text.
        """
        if len(pattern) > self.max_len:
            return None
        ptr, kids, seqs = self._ptr, self._kids, self._seqs
        u, d = 0, 0
        for t in pattern:
            p = ptr[u]
            if p >= 0:
                seq = seqs[p >> _SHIFT]
                pos = (p & _MASK) + d
                if pos >= len(seq) or seq[pos] != t:
                    return None
            else:
                ku = kids[u]
                if ku is None:
                    return None
                if ku.__class__ is int:
                    if ku >> _SHIFT != t:
                        return None
                    u = ku & _MASK
                else:
                    c = ku.get(t)  # type: ignore[union-attr]
                    if c is None:
                        return None
                    u = c
            d += 1
        return u, d

    def _cursor_count(self, node: int) -> int:
        return 1 if node < 0 else self._count[node]

    def _children(self, node: int, depth: int, least: float) -> list[tuple[int, int, int]]:
        """``[(count, token, child node)]`` below a cursor with ``count >= least``
        (child cursor = (child node, depth + 1)); any order."""
        if node < 0 or depth >= self.max_len:
            return []
        p = self._ptr[node]
        if p >= 0:
            seq = self._seqs[p >> _SHIFT]
            pos = (p & _MASK) + depth
            return [(1, seq[pos], node)] if pos < len(seq) and least <= 1 else []
        ku = self._kids[node]
        if ku is None:
            return []
        count = self._count
        if ku.__class__ is int:
            c = ku & _MASK
            k = count[c]
            return [(k, ku >> _SHIFT, c)] if k >= least else []
        if len(ku) <= _TOP_MIN:  # type: ignore[arg-type]
            return [(k, t, c) for t, c in ku.items() if (k := count[c]) >= least]  # type: ignore[union-attr]
        entry = self._tops.get(node)
        if entry is None or least < entry[0]:
            # Scan once; keep the heavy children (cut from the node's current count).
            every = [(count[c], t, c) for t, c in ku.items()]  # type: ignore[union-attr]
            cut = max(1, count[node] >> _TOP_SHIFT)
            self._tops[node] = [cut, {t: c for k, t, c in every if k >= cut}]
            return [e for e in every if e[0] >= least]
        return [(k, t, c) for t, c in entry[1].items() if (k := count[c]) >= least]

    def _child(self, node: int, depth: int, t: int) -> tuple[int, int] | None:
        """``(count, child node)`` of token ``t`` below a cursor, or None."""
        if node < 0 or depth >= self.max_len:
            return None
        p = self._ptr[node]
        if p >= 0:
            seq = self._seqs[p >> _SHIFT]
            pos = (p & _MASK) + depth
            return (1, node) if pos < len(seq) and seq[pos] == t else None
        ku = self._kids[node]
        if ku is None:
            return None
        if ku.__class__ is int:
            return (self._count[ku & _MASK], ku & _MASK) if ku >> _SHIFT == t else None
        c = ku.get(t)  # type: ignore[union-attr]
        return None if c is None else (self._count[c], c)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the structure is inconsistent (tests, debugging).

        Checks every stored node: children's counts sum to at most the parent's, leaves
        count 1 and point at a live occurrence spelling their path, depths <= max_len,
        one-child nodes are packed, every node is reachable once, and the heavy-children
        lists hold at least every child at or above their cut, all of them live children.
        """
        count, ptr, kids, seqs = self._count, self._ptr, self._kids, self._seqs
        seen = 0
        stack = [(0, 0, ())]  # (node, depth, last max_len tokens of its path)
        while stack:
            u, d, path = stack.pop()
            seen += 1
            assert d <= self.max_len
            p = ptr[u]
            if p >= 0:
                assert count[u] == 1 and kids[u] is None, u
                seq = seqs[p >> _SHIFT]
                start = p & _MASK
                assert start + d <= len(seq) and tuple(seq[start : start + d]) == path, u
                continue
            ku = kids[u]
            items = []
            if ku.__class__ is int:
                items = [(ku >> _SHIFT, ku & _MASK)]
            elif ku is not None:
                assert len(ku) >= 2, u  # type: ignore[arg-type]
                items = list(ku.items())  # type: ignore[union-attr]
            assert u == 0 or count[u] >= 1, u
            assert sum(count[c] for _, c in items) <= count[u], u
            for t, c in items:
                assert count[c] >= 1, (u, t)
                stack.append((c, d + 1, path + (t,)))
            h = self._tops.get(u)
            if h is not None:
                assert ku.__class__ is dict, u
                live = dict(items)
                for t, c in h[1].items():
                    assert live.get(t) == c, (u, t)
                for t, c in items:
                    assert count[c] < h[0] or t in h[1], (u, t)
        assert seen == self.num_nodes, (seen, self.num_nodes)
        assert all(count[f] == 0 and kids[f] is None for f in self._free)

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (0 if longer than ``max_len``); () counts tokens."""
        cur = self._walk(pattern)
        return 0 if cur is None else self._cursor_count(cur[0])

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """``{token: count(pattern + [token])}`` for the tokens that followed ``pattern``."""
        cur = self._walk(pattern)
        if cur is None:
            return {}
        return {t: c for c, t, _ in self._children(cur[0], cur[1], 0)}

    def match_cursors(
        self, context: Sequence[int], max_match: int | None = None
    ) -> list[tuple[int, int]]:
        """Cursors of the context's suffixes that occur: entry ``m - 1`` is length ``m``.

        Stops at the first length that does not occur (longer ones cannot). Costs one walk
        per length, O(m**2) for a match of length m.
        """
        limit = min(len(context), self.max_len if max_match is None else max_match)
        out: list[tuple[int, int]] = []
        for m in range(1, limit + 1):
            cur = self._walk(context[len(context) - m :])
            if cur is None:
                break
            out.append(cur)
        return out


# ---------------------------------------------------------------------- candidates
@dataclass
class SuffixCandidates:
    """One request's candidate tree, in :mod:`eagle_vllm.tree.layout`'s node conventions.

    ``tokens[0]`` is the root (the context's last token), ``parents[0] = -1``,
    ``parents[i] < i``, ``depths[i] = depths[parents[i]] + 1``, ``scores`` = log path
    probability (root 0.0), non-increasing along every root-to-node path.
    ``match_len``: the longest context suffix whose continuation produced a node (0 if
    there are no drafts).
    """

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    depths: list[int]
    match_len: int = 0

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.tokens)

    @property
    def expected_accepted(self) -> float:
        """Sum of the drafts' path probabilities: the expected number of accepted drafts
        if the probabilities were exact (ArcticInference's draft score)."""
        return sum(math.exp(s) for s in self.scores[1:])


@dataclass
class _Group:
    """Context suffix lengths m_lo..m_hi with the same occurrences in every index."""

    m_hi: int
    limit: int  # depth bound of its drafts
    cursors: list[tuple[SuffixIndex, int, int]] = field(default_factory=list)


def _groups(
    matches: Sequence[Sequence[tuple[int, int]]],
    indexes: Sequence[SuffixIndex],
    top: int,
    max_depth: int,
    spec_factor: float | None,
    spec_offset: float,
) -> list[_Group]:
    """Group the match lengths 1..top by equal per-index counts (module docstring)."""
    max_len = max(ix.max_len for ix in indexes)
    counts = [
        [ix._cursor_count(node) for node, _ in ms[:top]] + [0] * (top - len(ms))
        for ix, ms in zip(indexes, matches)
    ]
    rows = list(zip(*counts))  # rows[m - 1]: the per-index counts of length m
    groups: list[_Group] = []
    m_lo = 1
    for m in range(1, top + 1):
        if m < top and rows[m] == rows[m - 1]:
            continue
        m_hi = m  # m_lo..m_hi have equal counts; m_hi + 1 differs (or is past top)
        limit = min(max_depth, max_len - m_lo)
        if spec_factor is not None:
            limit = min(limit, int(spec_factor * m_hi + spec_offset + 1e-6))
        if limit >= 1:
            cursors = [
                (ix, ms[m_lo - 1][0], ms[m_lo - 1][1])
                for ix, ms in zip(indexes, matches)
                if m_lo <= len(ms)
            ]
            groups.append(_Group(m_hi, limit, cursors))
        m_lo = m + 1
    return groups


def _expand(root: int, groups: list[_Group], max_nodes: int, min_prob: float) -> SuffixCandidates:
    """Best-first union of the groups' continuation trees (module docstring, step 4)."""
    tokens, parents, scores, depths = [root], [-1], [0.0], [0]
    match_len = 0
    where: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    heap: list = []
    serial = 0
    cap = max_nodes - 1  # children one expansion can usefully offer (see below)
    slack = 1.0 - 1e-9  # count pre-filters are loose; the exact test is on the probability

    def push(prob: float, cursors, parent: int, depth: int, m_hi: int, limit: int) -> None:
        nonlocal serial
        if len(cursors) == 1:
            ix, node, d = cursors[0]
            den = ix._cursor_count(node)
            least = min_prob * den / prob * slack
            items = [
                (prob * (c / den), t, [(ix, child, d + 1)])
                for c, t, child in ix._children(node, d, least)
            ]
        else:
            # Counts are summed over the indexes. A child reaching min_prob has, in at
            # least one index, a count >= its share of the threshold: collect those
            # tokens, then sum each one's counts over all the indexes.
            den = sum(ix._cursor_count(node) for ix, node, _ in cursors)
            least = min_prob * den / prob * slack / len(cursors)
            per = [
                {t: (c, child) for c, t, child in ix._children(node, d, least)}
                for ix, node, d in cursors
            ]
            items = []
            for t in set().union(*per):
                c = 0
                below = []
                for (ix, node, d), got in zip(cursors, per):
                    hit = got.get(t)
                    if hit is None:  # under this index's share: look its count up
                        hit = ix._child(node, d, t)
                    if hit is not None:
                        c += hit[0]
                        below.append((ix, hit[1], d + 1))
                items.append((prob * (c / den), t, below))
        items = [it for it in items if it[0] >= min_prob]
        if len(items) > cap:
            # A node keeps at most max_nodes - 1 children, and a child of this expansion
            # can only be kept after all its likelier siblings: the rest never matter.
            items.sort(key=lambda it: (-it[0], it[1]))
            del items[cap:]
        for p, t, below in items:
            serial += 1
            heapq.heappush(heap, (-p, depth, parent, t, -m_hi, serial, below, limit))

    for g in groups:
        push(1.0, g.cursors, 0, 1, g.m_hi, g.limit)
    while heap and len(tokens) < max_nodes:
        negp, depth, parent, t, neg_m, _, cursors, limit = heapq.heappop(heap)
        node = where.get((parent, t))
        if node is None:
            node = len(tokens)
            where[(parent, t)] = node
            tokens.append(t)
            parents.append(parent)
            scores.append(math.log(-negp))
            depths.append(depth)
            if -neg_m > match_len:
                match_len = -neg_m
        if depth < limit:
            push(-negp, cursors, node, depth + 1, -neg_m, limit)
    return SuffixCandidates(tokens, parents, scores, depths, match_len)


def _check_args(max_nodes: int, max_depth: int, min_prob: float) -> None:
    if max_nodes < 1:
        raise ValueError(f"max_nodes counts the root and must be >= 1, got {max_nodes}")
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if not 0.0 <= min_prob <= 1.0:
        raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")


def propose(
    context: Sequence[int],
    indexes: Sequence[SuffixIndex],
    *,
    max_nodes: int = 16,
    max_depth: int = 8,
    min_prob: float = 0.1,
    spec_factor: float | None = 1.0,
    spec_offset: float = 0.0,
    max_match: int | None = None,
) -> SuffixCandidates:
    """Candidate tree after ``context`` (its last token is the root) from ``indexes``.

    ``max_nodes`` counts the root (as ``DraftTree.num_nodes``; 1 = no drafts),
    ``max_depth`` bounds draft depth (independently of ``num_speculative_tokens``),
    ``min_prob`` is the least path probability of a kept node, ``spec_factor`` /
    ``spec_offset`` bound the depth drafted from a match of length m to
    ``floor(spec_factor * m + spec_offset)`` (None: no such bound), ``max_match`` caps
    the match length (cost: matching walks O(m**2) per index). The rule is in the module
    docstring. An index that holds the context itself (the request's own) counts the
    context's own occurrence like any other: :meth:`RequestSuffixes.propose` is the same
    computation with that index's matches read from its state instead of walked.
    """
    _check_args(max_nodes, max_depth, min_prob)
    if not context:
        raise ValueError("context must hold at least the root token")
    root = int(context[-1])
    indexes = [ix for ix in indexes if ix is not None]
    if max_nodes == 1 or max_depth == 0 or not indexes:
        return SuffixCandidates([root], [-1], [0.0], [0])
    if max_match is not None and max_match < 1:
        return SuffixCandidates([root], [-1], [0.0], [0])
    ctx = list(context[-max(ix.max_len for ix in indexes) :])
    matches = [ix.match_cursors(ctx, max_match) for ix in indexes]
    top = _top(matches, len(ctx), indexes, max_match)
    groups = _groups(matches, indexes, top, max_depth, spec_factor, spec_offset)
    return _expand(root, groups, max_nodes, min_prob)


def _top(matches, context_len: int, indexes, max_match: int | None) -> int:
    """The longest match length considered: some index has it, within the bounds."""
    top = min(context_len, max(ix.max_len for ix in indexes) - 1, max(map(len, matches)))
    return top if max_match is None else min(top, max_match)


def candidates_to_tree(cands: Sequence[SuffixCandidates], width: int | None = None) -> DraftTree:
    """Pad a batch of candidate trees into a :class:`~eagle_vllm.tree.layout.DraftTree`.

    ``width`` (default: the largest tree) must hold every tree. ``parent_row`` is None:
    suffix nodes come from no draft-model row. Imports torch, which this module's import
    does not.
    """
    import torch

    from eagle_vllm.tree.layout import DraftTree

    n = max((c.num_nodes for c in cands), default=1)
    width = n if width is None else int(width)
    if width < n:
        raise ValueError(f"width {width} is smaller than the largest tree ({n} nodes)")
    b = len(cands)
    tokens = torch.full((b, width), -1, dtype=torch.long)
    parents = torch.full((b, width), -1, dtype=torch.long)
    depths = torch.full((b, width), -1, dtype=torch.long)
    scores = torch.full((b, width), float("-inf"), dtype=torch.float32)
    for i, c in enumerate(cands):
        k = c.num_nodes
        tokens[i, :k] = torch.tensor(c.tokens, dtype=torch.long)
        parents[i, :k] = torch.tensor(c.parents, dtype=torch.long)
        depths[i, :k] = torch.tensor(c.depths, dtype=torch.long)
        scores[i, :k] = torch.tensor(c.scores, dtype=torch.float32)
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        num_nodes=torch.tensor([c.num_nodes for c in cands], dtype=torch.long),
        scores=scores,
        parent_row=None,
    )


# ---------------------------------------------------------------------- global cache
class GlobalSuffixCache:
    """Responses of the last ``max_requests`` finished requests, isolated by cache key.

    One :class:`SuffixIndex` per :data:`CacheKey`, holding that key's responses; eviction
    is oldest first over ALL keys, so memory is bounded by ``max_requests`` responses (and
    by ``max_tokens`` tokens if given) however many keys there are;
    ``max_requests_per_key`` additionally keeps one key from flushing the others.
    ``max_requests=0`` turns the response cache off. A seed corpus (:meth:`seed`) is one
    more index, bounded in tokens, never evicted, and shared by every key because it is
    operator text, not a user's. Why keys isolate: module docstring.
    """

    def __init__(
        self,
        max_requests: int = 1000,
        *,
        max_len: int = 32,
        max_tokens: int | None = None,
        max_requests_per_key: int | None = None,
    ) -> None:
        if max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {max_requests}")
        if max_requests_per_key is not None and max_requests_per_key < 1:
            raise ValueError("max_requests_per_key must be >= 1 (max_requests=0 turns caching off)")
        self.max_requests = int(max_requests)
        self.max_len = int(max_len)
        self.max_tokens = max_tokens
        self.max_requests_per_key = max_requests_per_key
        self._indexes: dict[CacheKey, SuffixIndex] = {}
        self._fifo: OrderedDict[int, tuple[CacheKey, int]] = OrderedDict()  # uid -> (key, n)
        self._per_key: dict[CacheKey, deque[int]] = {}
        self._next_uid = 0
        self._tokens = 0
        self._seed: SuffixIndex | None = None
        # bumped by clear(): responses of requests begun before it are not cached
        self.generation = 0

    def __len__(self) -> int:
        """Cached responses (the seed corpus not included)."""
        return len(self._fifo)

    @property
    def num_tokens(self) -> int:
        """Tokens of the cached responses (the seed corpus not included)."""
        return self._tokens

    @property
    def enabled(self) -> bool:
        return self.max_requests > 0 or self._seed is not None

    def keys(self) -> list[CacheKey]:
        return list(self._indexes)

    def add(self, key: CacheKey, tokens: Sequence[int]) -> None:
        """Cache one finished response under ``key``, then evict down to the bounds."""
        if self.max_requests == 0 or len(tokens) == 0:
            return
        uid = self._next_uid
        self._next_uid += 1
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = SuffixIndex(self.max_len)
            self._per_key[key] = deque()
        index.extend(uid, tokens)
        self._fifo[uid] = (key, len(tokens))
        self._per_key[key].append(uid)
        self._tokens += len(tokens)
        cap = self.max_requests_per_key
        if cap is not None:
            while len(self._per_key[key]) > cap:
                self._evict(self._per_key[key][0])
        while len(self._fifo) > self.max_requests or (
            self.max_tokens is not None and self._tokens > self.max_tokens and self._fifo
        ):
            self._evict(next(iter(self._fifo)))

    def _evict(self, uid: int) -> None:
        key, n = self._fifo.pop(uid)
        uids = self._per_key[key]
        assert uids[0] == uid  # a key's oldest response is also older than the others'
        uids.popleft()
        self._tokens -= n
        index = self._indexes[key]
        if uids:
            index.remove(uid)
        else:  # the key's last response: drop its whole index
            del self._indexes[key], self._per_key[key]

    def clear(self) -> None:
        """Drop every cached response, and the responses of requests already running
        (:class:`RequestSuffixes` caches a response only if its request began after the
        last clear: a finish can be reported a step after the request's last token).
        The seed corpus stays."""
        self.generation += 1
        self._indexes.clear()
        self._fifo.clear()
        self._per_key.clear()
        self._tokens = 0

    def seed(self, sequences: Iterable[Sequence[int]], max_tokens: int) -> int:
        """Add a seed corpus (e.g. the target's own answers), up to ``max_tokens`` tokens in
        all (whole sequences only). Returns the tokens added. Every key drafts from it."""
        if self._seed is None:
            self._seed = SuffixIndex(self.max_len)
        added = 0
        for seq in sequences:
            used = self._seed.num_tokens
            if used + len(seq) > max_tokens:
                break
            if len(seq):
                self._seed.extend(len(self._seed), seq)
                added += len(seq)
        return added

    def indexes_for(self, key: CacheKey) -> list[SuffixIndex]:
        """The indexes a request under ``key`` may draft from: its key's, then the seed."""
        out = []
        index = self._indexes.get(key)
        if index is not None:
            out.append(index)
        if self._seed is not None and self._seed.num_tokens:
            out.append(self._seed)
        return out

    def responses(self, key: CacheKey) -> list[list[int]]:
        """The cached responses under ``key``, oldest first (for inspection and tests)."""
        index = self._indexes.get(key)
        return [] if index is None else [index.sequence(u) for u in index.sequence_ids()]


# ---------------------------------------------------------------------- per request
@dataclass
class _Request:
    index: SuffixIndex
    prompt_len: int
    key: CacheKey
    generation: int  # the global cache's, when the request began


class RequestSuffixes:
    """Per-request suffix indexes (prompt + output) and drafting from them.

    ``add_request`` when a request is scheduled, ``extend`` with every step's accepted
    tokens (including the token sampled at prefill), ``propose`` before drafting,
    ``finish`` when it finishes (its response goes to the global cache under its key) or
    ``remove`` when it is aborted (nothing is cached). ``max_len`` defaults to the global
    cache's (32 without one). Each request's index is its own object: dropping a request
    frees it, and one request's text never reaches another's except through ``finish``.
    """

    def __init__(
        self, global_cache: GlobalSuffixCache | None = None, max_len: int | None = None
    ) -> None:
        if max_len is None:
            max_len = global_cache.max_len if global_cache is not None else 32
        self.max_len = int(max_len)
        self.global_cache = global_cache
        self._reqs: dict[Hashable, _Request] = {}

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def add_request(
        self, req_id: Hashable, prompt_ids: Sequence[int], cache_key: CacheKey = (None, None)
    ) -> None:
        """Start indexing a request: its prompt now, its output via :meth:`extend`.
        ``cache_key``: ``(cache_salt, lora_name)``, which global responses it may draft
        from and where its own response goes."""
        if req_id in self._reqs:
            raise KeyError(f"request {req_id!r} is already indexed")
        index = SuffixIndex(self.max_len)
        index.extend(0, prompt_ids)
        generation = self.global_cache.generation if self.global_cache is not None else 0
        self._reqs[req_id] = _Request(index, len(prompt_ids), cache_key, generation)

    def extend(self, req_id: Hashable, new_ids: Sequence[int]) -> None:
        """Append accepted tokens; costs O(max_len) per token at most, whatever the length."""
        self._reqs[req_id].index.extend(0, new_ids)

    def tokens(self, req_id: Hashable) -> list[int]:
        """A copy of the request's indexed text (prompt + output)."""
        return self._reqs[req_id].index.sequence(0)

    def finish(self, req_id: Hashable, response_len: int | None = None) -> None:
        """Drop the request; its response (the tokens after the prompt, the first
        ``response_len`` of them if given) is cached globally under its key."""
        req = self._reqs.pop(req_id)
        if self.global_cache is not None and req.generation == self.global_cache.generation:
            response = req.index.sequence(0)[req.prompt_len :]
            if response_len is not None:
                response = response[: max(0, response_len)]
            self.global_cache.add(req.key, response)

    def response(self, req_id: Hashable) -> list[int]:
        """A copy of the request's indexed output (the tokens after its prompt)."""
        req = self._reqs[req_id]
        return req.index.sequence(0)[req.prompt_len :]

    def remove(self, req_id: Hashable) -> None:
        """Drop the request without caching anything (aborted, or not to be shared)."""
        self._reqs.pop(req_id, None)

    def propose(
        self,
        req_id: Hashable,
        *,
        max_nodes: int = 16,
        max_depth: int = 8,
        min_prob: float = 0.1,
        spec_factor: float | None = 1.0,
        spec_offset: float = 0.0,
        max_match: int | None = None,
    ) -> SuffixCandidates:
        """Candidates after the request's last token from its own text and, if there is a
        global cache, its key's cached responses and the seed corpus (same rule and
        arguments as :func:`propose`, whose result this equals)."""
        _check_args(max_nodes, max_depth, min_prob)
        req = self._reqs[req_id]
        index = req.index
        seq = index._seqs[index._slots[0]]
        if not seq:
            raise ValueError(f"request {req_id!r} has no tokens")
        root = seq[-1]
        if max_nodes == 1 or max_depth == 0 or (max_match is not None and max_match < 1):
            return SuffixCandidates([root], [-1], [0.0], [0])
        indexes = [index]
        if self.global_cache is not None:
            indexes += self.global_cache.indexes_for(req.key)
        ctx = seq[-max(ix.max_len for ix in indexes) :].tolist()
        others = [ix.match_cursors(ctx, max_match) for ix in indexes[1:]]
        # The own index's matches are its repeated suffixes' nodes (depth m), then the
        # context's own occurrence alone (count 1, no continuation yet): needed only up to
        # the longest match elsewhere, as its share of their denominators.
        active = index._active[index._slots[0]]
        own = [(node, m) for m, node in enumerate(active) if m]
        longest = min(max(map(len, others), default=0), len(ctx), index.max_len)
        own += [(_OWN, m) for m in range(len(own) + 1, longest + 1)]
        matches = [own] + others
        top = _top(matches, len(ctx), indexes, max_match)
        groups = _groups(matches, indexes, top, max_depth, spec_factor, spec_offset)
        return _expand(root, groups, max_nodes, min_prob)
