"""One draft tree per request from two sources: EAGLE nodes and suffix candidates (pure).

The EAGLE-2 builder (``builder.py``) ranks its nodes by value = product of draft
confidences along the path; the suffix index (``eagle_vllm.drafting.suffix``) ranks its
candidates by path probability = how often past text went on that way. Both are
estimates of the same thing, the chance that verification accepts the node, but neither
is calibrated: a small head is overconfident on some text and timid on other, and a
suffix continuation seen once in the request's own text scores 1/2 whatever it is.

Merging (:func:`merge_trees`)
----------------------------
1. **Union by path.** Nodes are identified by their path from the root, so a suffix
   branch that repeats an EAGLE node (same token under the same parent) becomes one node,
   whose source is ``BOTH``. Suffix branches below an EAGLE node continue from it.
2. **Calibrated values on one scale.** Each node's raw value is its source's estimate
   (for ``BOTH``, the larger of the two). It is multiplied by the measured
   acceptance-over-prediction ratio of its source class and depth
   (``calibration[source, depth]``, kept by :class:`eagle_vllm.sizing.SourceCalibration`
   from every verified tree: accepted nodes over summed raw values). A node's value is
   capped by its parent's, since a node is accepted only if its parent is.
3. **Rerank.** Each request keeps the best ``budget - 1`` nodes by calibrated value
   (ties: shallower, then earlier), as the EAGLE-2 rerank does. Parents rank before
   their children (the cap, and the depth tie-break), so every kept set is a tree and
   the output, in rank order, is topological; its prefixes are the best smaller trees,
   which the load-aware sizer's acceptance-per-rank statistics rely on.

By default EAGLE passes do not expand suffix nodes; suffix branches are drafted to their
own depth for free. With ``suffix.expand`` they do (:class:`SuffixGuide`): a pass feeds
the draft model the best ``topk`` nodes of a depth, and a suffix child of a node the
pass before fed is offered to that choice like the head's own children
(``TreeBuilder.step(offered=...)``), valued on the head's scale by the two sources'
calibration at that depth. A suffix node the head did not rank in its beam then gets
the head's children beneath it in the next pass, in place of the beam's weakest node
(no extra draft row). Only nodes whose parent was fed can be expanded (a node's draft
feature comes from its parent's), so a suffix branch is followed one depth per pass.
It is off by default because it did not pay with the shipped head: the suffix
branch below an accepted suffix node usually goes on correctly by itself, and the
beam's weakest node's children are worth as much (BENCHMARKS.md, "Hybrid drafting").

The merged tree has no ``parent_row``: its nodes do not all come from draft rows.
Sources of nodes (``sources``): :data:`ROOT`, :data:`EAGLE`, :data:`SUFFIX`,
:data:`BOTH` (padding :data:`ROOT` too, with ``valid`` from ``num_nodes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .layout import DraftTree

ROOT, EAGLE, SUFFIX, BOTH = 0, 1, 2, 3
SOURCE_NAMES = {EAGLE: "eagle", SUFFIX: "suffix", BOTH: "both"}

__all__ = [
    "BOTH",
    "EAGLE",
    "ROOT",
    "SOURCE_NAMES",
    "SUFFIX",
    "MergedTrees",
    "SuffixGuide",
    "SuffixTree",
    "merge_trees",
]


class SuffixTree(Protocol):
    """One request's suffix candidates (``drafting.suffix.SuffixCandidates``): node 0 the
    root, ``parents[i] < i``, ``scores`` log path probabilities, ``depths`` edges from
    the root."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    depths: list[int]


@dataclass
class MergedTrees:
    """Merged trees and, per node, where it came from and its raw (uncalibrated) value."""

    tree: DraftTree
    sources: Tensor  # [B, N] int64: ROOT / EAGLE / SUFFIX / BOTH
    raw_values: Tensor  # [B, N] float32: the source's own estimate (probability)


def merge_trees(
    eagle: DraftTree | None,
    suffix: Sequence[SuffixTree | None],
    budgets: Sequence[int],
    calibration: Tensor | None = None,
    width: int | None = None,
) -> MergedTrees:
    """Merge request ``b``'s EAGLE tree (row ``b`` of ``eagle``; None: root only, taken
    from ``suffix[b]``) with ``suffix[b]`` (None: EAGLE nodes only) and keep the best
    ``budgets[b]`` nodes, root included. ``calibration``: ``[4, D + 1]`` factors per
    source and depth (depths above ``D`` use ``D``; None: all 1). ``width``: the padded
    width (default: the largest kept tree). See the module docstring."""
    batch = len(suffix)
    if eagle is not None and eagle.batch_size != batch:
        raise ValueError(f"eagle has {eagle.batch_size} trees, suffix {batch}")
    if len(budgets) != batch:
        raise ValueError(f"{len(budgets)} budgets for {batch} requests")
    factors = None if calibration is None else calibration.tolist()
    if eagle is not None:
        e_tokens = eagle.tokens.tolist()
        e_parents = eagle.parents.tolist()
        e_scores = eagle.scores.tolist()
        e_count = eagle.num_nodes.tolist()
    kept_rows = []
    for b in range(batch):
        nodes = _Union()
        if eagle is not None:
            root = e_tokens[b][0]
            nodes.start(root)
            local = [0]
            for i in range(1, e_count[b]):
                local.append(nodes.add(local[e_parents[b][i]], e_tokens[b][i], EAGLE,
                                       math.exp(e_scores[b][i])))  # fmt: skip
        cands = suffix[b]
        if eagle is not None and (cands is None or len(cands.tokens) <= 1):
            # nothing to merge: the EAGLE-2 tree as built (its own rank order)
            kept_rows.append(nodes.as_built(int(budgets[b])))
            continue
        if cands is not None:
            if eagle is None:
                nodes.start(cands.tokens[0])
            elif cands.tokens[0] != nodes.tokens[0]:
                raise ValueError(
                    f"request {b}: suffix root {cands.tokens[0]} != EAGLE root {nodes.tokens[0]}"
                )
            local = [0]
            for i in range(1, len(cands.tokens)):
                local.append(nodes.add(local[cands.parents[i]], cands.tokens[i], SUFFIX,
                                       math.exp(cands.scores[i])))  # fmt: skip
        if not nodes.tokens:
            raise ValueError(f"request {b} has neither an EAGLE tree nor suffix candidates")
        kept_rows.append(nodes.rerank(int(budgets[b]), factors))
    n = max(len(r[0]) for r in kept_rows) if kept_rows else 1
    width = n if width is None else int(width)
    if width < n:
        raise ValueError(f"width {width} is smaller than the largest kept tree ({n} nodes)")

    def pad(rows: list[list], fill, dtype) -> Tensor:
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype)

    tokens = pad([r[0] for r in kept_rows], -1, torch.int64)
    tree = DraftTree(
        tokens=tokens,
        parents=pad([r[1] for r in kept_rows], -1, torch.int64),
        depths=pad([r[2] for r in kept_rows], -1, torch.int64),
        num_nodes=torch.tensor([len(r[0]) for r in kept_rows], dtype=torch.int64),
        scores=pad([r[3] for r in kept_rows], float("-inf"), torch.float32),
        parent_row=None,
    )
    if eagle is not None:
        tree = tree.to(eagle.device)
    return MergedTrees(
        tree=tree,
        sources=pad([r[4] for r in kept_rows], ROOT, torch.int64),
        raw_values=pad([r[5] for r in kept_rows], 0.0, torch.float32),
    )


class _Union:
    """One request's nodes from both sources, keyed by (parent, token)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.eagle: list[float] = []  # raw value per source (-1: not from it)
        self.suffix: list[float] = []
        self.where: dict[tuple[int, int], int] = {}

    def start(self, root: int) -> None:
        self.tokens, self.parents, self.depths = [int(root)], [-1], [0]
        self.eagle, self.suffix = [1.0], [1.0]

    def add(self, parent: int, token: int, source: int, value: float) -> int:
        key = (parent, int(token))
        node = self.where.get(key)
        if node is None:
            node = len(self.tokens)
            self.where[key] = node
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.eagle.append(-1.0)
            self.suffix.append(-1.0)
        if source == EAGLE:
            self.eagle[node] = max(self.eagle[node], value)
        else:
            self.suffix[node] = max(self.suffix[node], value)
        return node

    def as_built(self, budget: int):
        """The EAGLE nodes in their own order, cut to ``budget`` (``rerank``'s output)."""
        keep = max(1, min(budget, len(self.tokens)))
        return (
            self.tokens[:keep], self.parents[:keep], self.depths[:keep],
            [0.0] + [math.log(v) if v > 0 else float("-inf") for v in self.eagle[1:keep]],
            [ROOT] + [EAGLE] * (keep - 1), [1.0] + [max(v, 0.0) for v in self.eagle[1:keep]],
        )  # fmt: skip

    def rerank(self, budget: int, factors: list[list[float]] | None):
        """(tokens, parents, depths, log values, sources, raw values) of the kept nodes,
        in rank order."""
        count = len(self.tokens)
        value = [1.0] * count
        source = [ROOT] * count
        raw = [1.0] * count
        for i in range(1, count):  # parents come first: values are capped top-down
            e, s = self.eagle[i], self.suffix[i]
            src = (EAGLE if e >= 0 else 0) | (SUFFIX if s >= 0 else 0)
            raw[i] = max(e, s, 0.0)
            factor = 1.0
            if factors is not None:
                row = factors[src]
                factor = row[min(self.depths[i], len(row) - 1)]
            value[i] = min(raw[i] * factor, value[self.parents[i]])
            source[i] = src
        keep = max(1, min(budget, count))
        ranked = sorted(range(1, count), key=lambda i: (-value[i], self.depths[i], i))
        order = [0, *ranked[: keep - 1]]
        out = {old: new for new, old in enumerate(order)}
        return (
            [self.tokens[i] for i in order],
            [out[self.parents[i]] if i else -1 for i in order],
            [self.depths[i] for i in order],
            [math.log(value[i]) if value[i] > 0 else float("-inf") for i in order],
            [source[i] for i in order],
            [raw[i] for i in order],
        )


class SuffixGuide:
    """The suffix candidates offered to each EAGLE-2 expansion (see the module docstring).

    Tracks, per request, which suffix node each frontier row of the builder stands on
    (-1: none). :meth:`offers` gives the suffix children of those nodes as
    ``(frontier row, token, log value)`` for ``TreeBuilder.step(offered=...)``; the value
    is the node's log path probability plus ``log(calibration[SUFFIX, depth] /
    calibration[EAGLE, depth])``, so it compares with the head's scores at that depth
    as the merge's calibrated values would. :meth:`advance` follows the builder's next
    frontier, whichever source put a node there."""

    def __init__(self, suffix: Sequence[SuffixTree | None], calibration: Tensor | None = None):
        factors = None if calibration is None else calibration.tolist()
        self._trees: list[SuffixTree | None] = []
        # per request: each node's children as (token, node), at most a few per node
        self._children: list[dict[int, list[tuple[int, int]]]] = []
        self._shift: list[list[float]] = []  # per request, per node: log value = score + shift
        self._at: list[list[int] | None] = []  # per request, the suffix node of each row
        for cands in suffix:
            if cands is None or len(cands.tokens) <= 1:
                self._trees.append(None)
                self._children.append({})
                self._shift.append([])
                self._at.append(None)
                continue
            children: dict[int, list[tuple[int, int]]] = {}
            shift = [0.0] * len(cands.tokens)
            for i in range(1, len(cands.tokens)):
                children.setdefault(cands.parents[i], []).append((int(cands.tokens[i]), i))
                if factors is not None:
                    d = min(cands.depths[i], len(factors[SUFFIX]) - 1)
                    shift[i] = math.log(factors[SUFFIX][d] / factors[EAGLE][d])
            self._trees.append(cands)
            self._children.append(children)
            self._shift.append(shift)
            self._at.append([0])  # the root frontier stands on the suffix root

    def offers(self) -> list[list[tuple[int, int, float]]] | None:
        """Per request, the suffix children of the nodes the current frontier stands on
        (None when there are none for any request)."""
        out: list[list[tuple[int, int, float]]] = []
        found = False
        for cands, children, shift, at in zip(self._trees, self._children, self._shift,
                                              self._at):  # fmt: skip
            offered: list[tuple[int, int, float]] = []
            if at is not None:
                for row, node in enumerate(at):
                    for token, child in children.get(node, ()) if node >= 0 else ():
                        offered.append((row, token, cands.scores[child] + shift[child]))
            found = found or bool(offered)
            out.append(offered)
        return out if found else None

    def advance(self, tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]) -> None:
        """The builder's next frontier: per request, its rows' tokens and parent rows in
        the frontier before (``Frontier.host_lists``)."""
        for b, at in enumerate(self._at):
            if at is None:
                continue
            children = self._children[b]
            nxt = [
                next((c for token, c in children.get(at[p], ()) if token == t), -1)
                if at[p] >= 0
                else -1
                for t, p in zip(tokens[b], parents[b])
            ]
            self._at[b] = nxt if max(nxt, default=-1) >= 0 else None
