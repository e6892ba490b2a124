"""Incremental EAGLE-2 dynamic draft-tree builder (selection only: torch and Python, no vLLM).

The caller runs the draft model; the builder only decides what to expand and
what to keep.  One round for ``B`` requests::

    tb = TreeBuilder(root_tokens, topk=k, nodes=m, passes=d)
    fr = tb.frontier()                      # the root only, width 1
    for _ in range(d):
        logprobs = draft(fr)                # [B, w, V] log-softmax, one row per
                                            # frontier node (its children's dist.)
        fr = tb.step(logprobs)              # next frontier, width topk
    tree = tb.finalize()                    # DraftTree (see layout.py)

Semantics (EAGLE-2 "expand + rerank", SafeAILab ``topK_genrate``):

* value(node) = product of draft confidences along the root-to-node path; kept
  in log space: ``score(child) = score(parent) + logprob(child)``, root 0.0.
* Expand: every frontier node proposes its top-``topk`` children by log-prob.
  ALL ``w * topk`` children become rerank candidates; the global top-``topk``
  of them by score form the next frontier (width ``topk``).  The first step
  expands the root only, into its top-``root_topk`` children (``topk`` unless
  given; at least ``topk``), so depth 1 has ``root_topk`` candidates and every
  later depth ``topk**2``.  A root wider than the beam costs no draft row: the
  depth-1 frontier is still its best ``topk`` children.
* Rerank (:meth:`TreeBuilder.finalize`): request ``b`` keeps the top
  ``nodes[b] - 1`` candidates over all depths (clamped to the number of
  candidates), plus the root.
* Offered children (``step(offered=...)``, suffix candidates through
  ``merge.SuffixGuide``): another source's children of the frontier nodes, with
  their own values (capped by the parent's score). One that is a top-k child raises
  that child's score; another becomes a candidate numbered after the level's
  top-k children. Both kinds compete for the next frontier and the rerank like
  the head's children. Requests offered fewer than the batch's most take padding
  slots that are never selected.

Candidate numbering.  The root is candidate 0.  Step ``s`` appends its
``w * k`` children (``k``: ``root_topk`` for the root's step, ``topk`` after) with
ids ``offset_s + row * k + rank``: ``row`` is the
frontier row of the parent and ``rank`` the child's rank among its siblings
(log-prob descending, then token id ascending).  Ids therefore increase with
depth, and a parent always has a smaller id than its children.

Total order used for every selection (frontier and rerank):
``(score descending, depth ascending, candidate id ascending)``.  Because
``logprob <= 0`` (log-probs are clamped at 0, NaN becomes -inf) a child's score
never exceeds its parent's, and on an exact tie the parent is shallower, so a
parent always ranks strictly before each of its children: the kept set is
connected for every budget, including ties such as ``log 1 = 0`` chains and
``-inf`` scores.

Since ids increase with depth, ``(depth asc, id asc)`` is the same as ``id
asc``; the depth term is spelled out because it is the property that matters.

Output order (``finalize(order=...)``), both topological (parents first):

* ``"rank"`` (default): the kept nodes in the selection order above (score
  descending, shallower first on ties).  A parent ranks before its children,
  so this is topological, and every prefix is itself the optimal EAGLE-2
  selection for the smaller budget: ``truncate(tree, k)`` (the oracle in
  :mod:`eagle_vllm.tree.reference`) equals building with ``nodes = k``.
* ``"id"``: ascending candidate id, i.e. sorted by (depth, parent's frontier
  row, sibling rank).  This is exactly the order SafeAILab emits (it sorts the
  selected indices of its flattened score list); prefixes are valid trees but
  not optimal for a smaller budget.

Rows.  Each frontier row fed to the draft model gets a global row number: the
root is row 0, the depth-1 frontier rows ``1 .. topk``, and so on (frontier
``d`` starts at ``1 + (d - 1) * topk``).  ``Frontier.rows`` gives them and
``DraftTree.parent_row[b, i]`` names the row whose distribution node ``i`` was
drawn from, so the log-probs passed to each ``step`` concatenated along dim 1
can be indexed with it to get ``q(. | parent(i))``.

Deliberate differences from SafeAILab ``topK_genrate``:

1. Ties.  SafeAILab relies on ``torch.topk`` for the beam and the rerank and
   does not define tie order (its connectivity argument silently needs
   parent-before-child on ties).  We use stable sorts with the explicit
   (score desc, depth asc, id asc) order above, and within one frontier node
   we canonicalise equal-log-prob children to ascending token id.  The only
   implementation-defined choice left is WHICH token ``torch.topk`` proposes
   when several tokens tie exactly at the k-th largest log-prob of a single
   distribution (it has no effect on losslessness).
2. ``passes``.  Ours is the number of draft forwards = the maximum node depth.
   SafeAILab runs one forward for the root and then ``depth`` more, so its
   ``depth=d`` corresponds to our ``passes=d+1``.
3. ``nodes`` counts the root (as SafeAILab's ``total_token``), but may
   differ per request (a tensor), and is clamped to the number of candidates
   instead of failing in ``torch.topk``; ``nodes=1`` means no drafts.
4. Batched: B requests, each with its own tree; SafeAILab supports B = 1.
5. NaN log-probs are treated as -inf and positive log-probs (log-softmax
   rounding) are clamped to 0, so scores are monotone along every path.
"""

from __future__ import annotations

import functools
import operator
from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from .layout import DraftTree, root_only_tree

__all__ = ["Frontier", "TreeBuilder", "depth_one_tree"]

NEG_INF = float("-inf")


class Frontier:
    """The nodes the next draft forward must expand (one row each).

    Its tensors (on the builder's device) are made on first access: a draft pass reads
    ``tokens`` and ``parent_frontier_index``, the other fields are for callers that need
    them, and after the last pass none is read."""

    def __init__(self, device, depth: int, rows: list[int], tokens, parent_index, node_ids,
                 scores, ancestors) -> None:  # fmt: skip
        self.depth = depth  # depth of the frontier nodes (0 = root); position offset
        self._device = device
        self._rows, self._tokens, self._parent_index = rows, tokens, parent_index
        self._node_ids, self._scores, self._ancestors = node_ids, scores, ancestors

    @property
    def width(self) -> int:
        return len(self._rows)

    def host_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """Per request, the rows' tokens and their parents' rows in the frontier before,
        as Python lists (no tensor made); for the root frontier, the root and -1."""
        if isinstance(self._tokens, Tensor):
            return [[t] for t in self._tokens.reshape(-1).tolist()], [[-1]] * len(self._scores)
        return self._tokens, self._parent_index

    @functools.cached_property
    def _token_and_parent(self) -> Tensor:
        if isinstance(self._tokens, Tensor):  # the root frontier
            return torch.stack((self._tokens, torch.full_like(self._tokens, -1)))
        return torch.tensor([self._tokens, self._parent_index], device=self._device)

    @property
    def tokens(self) -> Tensor:
        """[B, w] int64 tokens of the frontier nodes (input ids)."""
        return self._token_and_parent[0]

    @property
    def parent_frontier_index(self) -> Tensor:
        """[B, w] int64 row in the previous frontier; -1 for the root."""
        return self._token_and_parent[1]

    @functools.cached_property
    def node_ids(self) -> Tensor:
        """[B, w] int64 builder candidate ids (root = 0)."""
        return torch.tensor(self._node_ids, dtype=torch.int64, device=self._device)

    @functools.cached_property
    def scores(self) -> Tensor:
        """[B, w] float32 log path values."""
        return torch.tensor(self._scores, dtype=torch.float32, device=self._device)

    @functools.cached_property
    def ancestor_rows(self) -> Tensor:
        """[B, w, depth + 1] global rows of the path root..self."""
        return torch.tensor(self._ancestors, dtype=torch.int64, device=self._device)

    @functools.cached_property
    def ancestor_mask(self) -> Tensor:
        """[B, w, n] bool over the ``n`` non-root rows fed to the draft so far, these
        included (row r at index r - 1): True at the node's own row and its ancestors'
        below the root. A tree pass's attention mask over the nodes of earlier passes."""
        n = self._rows[-1]
        mask = []
        for ancestors in self._ancestors:
            rows = []
            for path in ancestors:
                row = [False] * n
                for r in path[1:]:
                    row[r - 1] = True
                rows.append(row)
            mask.append(rows)
        return torch.tensor(mask, dtype=torch.bool, device=self._device)

    @functools.cached_property
    def rows(self) -> Tensor:
        """[w] int64 global row numbers of these rows (the same for every request)."""
        return torch.tensor(self._rows, dtype=torch.int64, device=self._device)


class TreeBuilder:
    """EAGLE-2 expand + rerank, batched over B requests; see the module docstring.

    The top-k of each frontier row's distribution runs in torch, where the log-probs are;
    the bookkeeping after it (scores, candidate ids, the next frontier and the rerank)
    runs on the host over Python lists, request by request: a request holds at most
    ``topk**2`` candidates a level, and in an engine step every call runs with caches the
    target's forward emptied, so the count of calls is the cost
    (``benchmarks/micro/builder_cost.py --cold``). Scores are float32 sums, rounded as
    float32 addition rounds them (``_float32``). The frontier and the tree come
    back as tensors on the log-probs' device.

    Args:
        root_tokens: [B] last accepted tokens (the roots).
        topk: children per expanded node and beam (frontier) width, >= 1.
        root_topk: children of the root (the first step), >= ``topk``; default
            ``topk``.
        nodes: node budget per request, root included (int or [B] tensor,
            each >= 1).  ``nodes - 1`` drafts are kept.
        passes: maximum number of :meth:`step` calls, one draft forward each
            (= maximum node depth).
    """

    def __init__(
        self,
        root_tokens: Tensor,
        topk: int,
        nodes: Tensor | int,
        passes: int,
        root_topk: int | None = None,
    ) -> None:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if root_topk is not None and root_topk < topk:
            raise ValueError(f"root_topk must be >= topk {topk}, got {root_topk}")
        if passes < 0:
            raise ValueError(f"passes must be >= 0, got {passes}")
        root_tokens = root_tokens.reshape(-1).long()
        self.device = root_tokens.device
        self.batch_size = b = root_tokens.shape[0]
        self.topk = int(topk)
        self.root_topk = self.topk if root_topk is None else int(root_topk)
        self.passes = int(passes)
        if isinstance(nodes, Tensor):
            budget = nodes.detach().reshape(-1).tolist()
            if len(budget) == 1 and b != 1:
                budget = budget * b
            if len(budget) != b:
                raise ValueError("nodes must be an int or a [B] tensor")
        else:
            budget = [int(nodes)] * b
        self._budget = [max(int(n), 1) for n in budget]
        self.root_tokens = root_tokens

        # candidates per request, in id order (candidate id = position + 1)
        self._cand_tokens: list[list[int]] = [[] for _ in range(b)]
        self._cand_scores: list[list[float]] = [[] for _ in range(b)]
        self._cand_parent: list[list[int]] = [[] for _ in range(b)]  # parent candidate id
        # the same for every request: each candidate's depth and its parent's global row
        self._cand_depth: list[int] = []
        self._cand_parent_row: list[int] = []
        self._passes_done = 0
        self._next_row = 1
        # offered children (``step(offered=...)``): per request, their candidate positions'
        # parent rows, and the positions of unused offer slots (padding, never kept)
        self._extra_parent_row: list[dict[int, int]] = [{} for _ in range(b)]
        self._padding: list[set[int]] = [set() for _ in range(b)]
        # offered children that were not the head's top-k and took a frontier row
        self.offered_in_frontier = 0

        # the frontier: per request, its nodes' scores, candidate ids and ancestor rows
        self._f_scores: list[list[float]] = [[0.0] for _ in range(b)]
        self._f_node_ids: list[list[int]] = [[0] for _ in range(b)]
        self._f_ancestors: list[list[list[int]]] = [[[0]] for _ in range(b)]
        self._f_rows: list[int] = [0]
        self._frontier = Frontier(
            self.device, 0, self._f_rows, root_tokens[:, None].clone(), None,
            self._f_node_ids, self._f_scores, self._f_ancestors,
        )  # fmt: skip

    @property
    def nodes(self) -> Tensor:
        """[B] node budgets, root included (each >= 1)."""
        return torch.tensor(self._budget, dtype=torch.int64, device=self.device)

    # --------------------------------------------------------------- progress
    @property
    def passes_done(self) -> int:
        """:meth:`step` calls (draft forwards) so far."""
        return self._passes_done

    # ------------------------------------------------------------------- API
    def frontier(self) -> Frontier:
        return self._frontier

    def step(
        self,
        logprobs: Tensor,
        token_ids: Tensor | None = None,
        children: Tensor | None = None,
        offered: Sequence[Sequence[tuple[int, int, float]]] | None = None,
    ) -> Frontier:
        """Expand the current frontier with its children distributions.

        ``logprobs``: [B, w, V] log-softmax of the draft logits, row ``j`` for
        frontier node ``j``.  Any float dtype; top-k runs in that dtype and
        scores are accumulated in float32.  ``token_ids``: [V] the token id of
        each column when drafting over a reduced vocabulary (default: column j
        is token j).  ``children``: [B, w, k] columns chosen by the caller
        (e.g. sampled from the draft distribution) instead of the top-k; they
        keep the caller's order, which a sampled-draft verifier relies on.
        ``k`` is ``root_topk`` for the root's step and ``topk`` after it.
        ``offered``: per request, extra children ``(frontier row, token, log value)``
        from another source (suffix candidates, ``merge.SuffixGuide``). An offered
        token that is among its parent's top-k children raises that child's score to
        the offered value if higher; any other becomes a candidate of its own. Offered
        scores are capped by the parent's, so parents still rank first. They compete
        for the next frontier like the head's children, so the next pass expands the
        best nodes of both sources. Not with ``children``.
        Returns the next frontier.
        """
        if self._passes_done >= self.passes:
            raise RuntimeError(f"TreeBuilder.step called more than passes={self.passes} times")
        b, w = self.batch_size, self._frontier.width
        k = self.root_topk if self._passes_done == 0 else self.topk
        if logprobs.dim() != 3 or logprobs.shape[0] != b or logprobs.shape[1] != w:
            raise ValueError(f"logprobs must be [B={b}, w={w}, V], got {tuple(logprobs.shape)}")
        if logprobs.shape[2] < k:
            raise ValueError(f"vocab size {logprobs.shape[2]} < topk {k}")

        if children is None:
            vals, tokens = _ranked_children(logprobs, k, token_ids)  # [B * w][k] lists
        else:
            if children.shape != (b, w, k):
                raise ValueError(f"children must be [B={b}, w={w}, k={k}]")
            cols = children.to(logprobs.device, torch.long)
            raw = logprobs.gather(-1, cols).reshape(-1, k).tolist()
            vals = [[_clean(v) for v in row] for row in raw]
            if token_ids is not None:
                cols = token_ids.to(cols.device)[cols]
            tokens = cols.reshape(-1, k).tolist()

        # every child's score, float32 as the parent's score plus its log-prob
        parent_scores = [s for fs in self._f_scores for s in fs]
        flat = _float32([s + v for s, row in zip(parent_scores, vals) for v in row])
        n = w * k
        if offered is not None:
            if children is not None:
                raise ValueError("offered children need the top-k children, not caller-chosen")
            if len(offered) != b:
                raise ValueError(f"offered must hold one list per request ({b})")
        # offered tokens that are not top-k children take the level's slots n .. n + e - 1
        e = 0 if offered is None else max(map(len, offered), default=0)
        offset = len(self._cand_depth) + 1
        depth = self._frontier.depth + 1
        nw = min(self.topk, n)  # the beam: a wider root still feeds topk rows
        rows = list(range(self._next_row, self._next_row + nw))
        self._next_row += nw
        self._cand_depth += [depth] * (n + e)
        self._cand_parent_row += [r for r in self._f_rows for _ in range(k)] + [-1] * e
        f_tokens, f_parent, f_ids, f_scores, f_ancestors = [], [], [], [], []
        for i in range(b):
            scores = flat[i * n : (i + 1) * n]
            level = [t for row in tokens[i * w : (i + 1) * w] for t in row]
            parent_ids = self._f_node_ids[i]
            parent_index = None  # frontier row of each candidate's parent: j // k
            if e:
                parent_index = self._offer(i, offered[i], level, scores, k, offset + n, e)
            self._cand_tokens[i] += level
            self._cand_scores[i] += scores
            self._cand_parent[i] += [p for p in parent_ids for _ in range(k)]
            if parent_index is not None:
                self._cand_parent[i] += [parent_ids[j] for j in parent_index[n:]]
            # next frontier: this level's top-k, (score desc, id asc)
            best = _descending(scores)[:nw]
            if parent_index is None:
                parents = [j // k for j in best]
            else:
                parents = [parent_index[j] for j in best]
                self.offered_in_frontier += sum(j >= n for j in best)
            ancestors = self._f_ancestors[i]
            f_tokens.append([level[j] for j in best])
            f_parent.append(parents)
            f_ids.append([offset + j for j in best])
            f_scores.append([scores[j] for j in best])
            f_ancestors.append([ancestors[j] + [r] for j, r in zip(parents, rows)])
        self._passes_done += 1
        self._f_scores, self._f_node_ids, self._f_ancestors = f_scores, f_ids, f_ancestors
        self._f_rows = rows
        self._frontier = Frontier(
            self.device, depth, rows, f_tokens, f_parent, f_ids, f_scores, f_ancestors
        )
        return self._frontier

    def _offer(self, i: int, offered, level: list[int], scores: list[float], k: int,
               first_id: int, e: int) -> list[int]:  # fmt: skip
        """Adds request ``i``'s offered children to this level's ``level``/``scores``
        (in place; ``e`` slots after the ``n`` top-k children, unused ones padding that is
        never selected). Returns each slot's parent frontier row."""
        n = len(level)
        parent_index = [j // k for j in range(n)] + [0] * e
        f_scores = self._f_scores[i]
        f_rows = self._f_rows
        added = 0
        for row, token, log_value in offered:
            value = _float32([min(float(log_value), f_scores[row])])[0]
            if value != value:
                continue
            try:
                j = level.index(int(token), row * k, row * k + k)
            except ValueError:
                j = -1
            if j >= 0:
                if value > scores[j]:
                    scores[j] = value
                continue
            parent_index[n + added] = row
            level.append(int(token))
            scores.append(value)
            self._extra_parent_row[i][first_id - 1 + added] = f_rows[row]
            added += 1
        if added < e:  # padding at -inf, after the n real candidates: finalize skips it
            level += [-1] * (e - added)
            scores += [NEG_INF] * (e - added)
            self._padding[i].update(range(first_id - 1 + added, first_id - 1 + e))
        return parent_index

    def finalize(self, pad_to: int | None = None, order: str = "rank") -> DraftTree:
        """Rerank and return the DraftTree (see the module docstring).

        Request ``b`` keeps ``1 + min(nodes[b] - 1, #candidates)``
        nodes.  The padded width is the largest of these, or
        ``pad_to`` if given, in which case budgets are also clamped to
        ``pad_to`` nodes.  ``order``: ``"rank"`` (score desc, shallow first;
        prefixes are optimal smaller trees) or ``"id"`` (SafeAILab's order).
        """
        if order not in ("rank", "id"):
            raise ValueError(f"order must be 'rank' or 'id', got {order!r}")
        c = len(self._cand_depth)
        kept = [min(max(n - 1, 0), c - len(pad)) for n, pad in zip(self._budget, self._padding)]
        if pad_to is not None:
            if pad_to < 1:
                raise ValueError("pad_to must be >= 1")
            kept = [min(m, pad_to - 1) for m in kept]
            width = int(pad_to)
        else:
            width = max(kept, default=0) + 1
        if c == 0 or max(kept, default=0) == 0:
            return root_only_tree(self.root_tokens, width)

        depth_of, row_of = self._cand_depth, self._cand_parent_row
        ints: list[list[list[int]]] = [[], [], [], []]  # tokens, parents, depths, parent rows
        all_scores: list[list[float]] = []
        for i, root in enumerate(self.root_tokens.tolist()):
            m, pad = kept[i], width - 1 - kept[i]
            scores, tokens = self._cand_scores[i], self._cand_tokens[i]
            parent_ids = self._cand_parent[i]
            # positions are in (depth, id) order, so a stable descending sort on the
            # score gives (score desc, depth asc, id asc)
            sel = _descending(scores)
            padding = self._padding[i]
            sel = [p for p in sel if p not in padding][:m] if padding else sel[:m]
            if order == "id":
                sel.sort()
            out_index = {0: 0}  # candidate id -> output index (root 0 -> 0)
            for j, p in enumerate(sel):
                out_index[p + 1] = j + 1
            fill = [-1] * pad
            ints[0].append([root] + [tokens[p] for p in sel] + fill)
            ints[1].append([-1] + [out_index[parent_ids[p]] for p in sel] + fill)
            ints[2].append([0] + [depth_of[p] for p in sel] + fill)
            extra_rows = self._extra_parent_row[i]
            if extra_rows:
                ints[3].append([-1] + [extra_rows.get(p, row_of[p]) for p in sel] + fill)
            else:
                ints[3].append([-1] + [row_of[p] for p in sel] + fill)
            all_scores.append([0.0] + [scores[p] for p in sel] + [NEG_INF] * pad)
        packed = torch.tensor(ints, dtype=torch.int64, device=self.device)
        return DraftTree(
            tokens=packed[0],
            parents=packed[1],
            depths=packed[2],
            num_nodes=torch.tensor(kept, dtype=torch.int64, device=self.device) + 1,
            scores=torch.tensor(all_scores, dtype=torch.float32, device=self.device),
            parent_row=packed[3],
        )


def _descending(scores: list[float]) -> list[int]:
    """Positions by score descending, ties in position order (Python's sort is stable,
    reversed too)."""
    return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)


def _float32(values: list[float]) -> list[float]:
    """``values`` rounded to float32. For a sum of two float32 numbers this is their
    float32 sum: the float64 sum rounded again to float32 is the correctly rounded
    result, as 53 >= 2 * 24 + 2 (double rounding is innocuous for addition)."""
    return array("f", values).tolist()


def _clean(value: float) -> float:
    """NaN -> -inf, and at most 0, so scores never rise along a path."""
    if value != value:
        return NEG_INF
    return 0.0 if value > 0.0 else value


def _ranked_children(
    logprobs: Tensor, k: int, token_ids: Tensor | None
) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's top-``k`` (log-prob, token) in the canonical sibling order: log-prob
    descending, then token id ascending on ties, as ``[B * w][k]`` lists of cleaned
    log-probs and tokens. The top-k runs in torch; it orders NaN (now -inf) first and ties
    arbitrarily, so a row is cleaned and re-sorted only where it is not already clean and
    strictly descending. ``token_ids`` maps columns to tokens when drafting over a
    reduced vocabulary."""
    vals, cols = torch.topk(logprobs, k, dim=-1)
    if token_ids is not None:
        cols = token_ids.to(cols.device)[cols]
    vals, tokens = vals.reshape(-1, k).tolist(), cols.reshape(-1, k).tolist()
    for j, row in enumerate(vals):
        # NaN fails both tests, so a row that passes them is clean
        if row[0] <= 0.0 and all(map(operator.gt, row, row[1:])):
            continue
        row = [_clean(v) for v in row]
        if any(map(operator.le, row, row[1:])):
            pairs = sorted(zip(row, tokens[j]), key=lambda vt: (-vt[0], vt[1]))
            row = [v for v, _ in pairs]
            tokens[j] = [t for _, t in pairs]
        vals[j] = row
    return vals, tokens


def depth_one_tree(
    root_tokens: Tensor,
    logprobs: Tensor,
    topk: int,
    nodes: int,
    token_ids: Tensor | None = None,
) -> DraftTree:
    """The tree ``TreeBuilder(root_tokens, topk, nodes, passes=1)`` gives after one
    ``step(logprobs, token_ids)`` and ``finalize(pad_to=nodes)``, built directly.

    A one-pass tree is the root and its best ``min(topk, nodes - 1)`` children,
    in the builder's order. This is the shape the sizer picks most often at batch 1, and
    here it costs a top-k and a handful of host ops: in an engine step every op runs with
    caches the target's forward emptied, so the count of ops is the cost
    (``benchmarks/micro/builder_cost.py --cold``). ``logprobs``: [B, 1, V] or [B, V], the
    root's draft log-probs.
    """
    if topk < 1 or nodes < 1:
        raise ValueError(f"topk and nodes must be >= 1, got {topk}, {nodes}")
    root_tokens = root_tokens.reshape(-1).long()
    b, dev = root_tokens.shape[0], root_tokens.device
    logprobs = logprobs.reshape(b, 1, -1)
    if logprobs.shape[2] < topk:
        raise ValueError(f"vocab size {logprobs.shape[2]} < topk {topk}")
    m = min(topk, nodes - 1)
    width = int(nodes)
    if m == 0:
        return root_only_tree(root_tokens, width)
    vals, tokens = _ranked_children(logprobs, topk, token_ids)
    # tokens, parents, depths and parent rows: the root's parent and parent row are -1
    # and its depth 0; the children's parent and parent row are 0 (the root's)
    pad = [-1] * (width - 1 - m)
    children = [0] * m
    ints = [
        [[root] + row[:m] + pad for root, row in zip(root_tokens.tolist(), tokens)],
        [[-1] + children + pad] * b,
        [[0] + [1] * m + pad] * b,
        [[-1] + children + pad] * b,
    ]
    scores = [[0.0] + row[:m] + [NEG_INF] * len(pad) for row in vals]
    packed = torch.tensor(ints, dtype=torch.int64, device=dev)
    return DraftTree(
        tokens=packed[0],
        parents=packed[1],
        depths=packed[2],
        num_nodes=torch.full((b,), m + 1, dtype=torch.long, device=dev),
        scores=torch.tensor(scores, dtype=torch.float32, device=dev),
        parent_row=packed[3],
    )
