"""Incremental EAGLE-2 dynamic draft-tree builder (selection only: torch and numpy, no vLLM).

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
  expands the root only, so depth 1 has ``topk`` candidates and every later
  depth ``topk**2``.
* Rerank (:meth:`TreeBuilder.finalize`): request ``b`` keeps the top
  ``nodes[b] - 1`` candidates over all depths (clamped to the number of
  candidates), plus the root.

Candidate numbering.  The root is candidate 0.  Step ``s`` appends its
``w * topk`` children with ids ``offset_s + row * topk + rank``: ``row`` is the
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

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .layout import DraftTree, root_only_tree

__all__ = ["Frontier", "TreeBuilder", "depth_one_tree"]


@dataclass
class Frontier:
    """The nodes the next draft forward must expand (one row each)."""

    tokens: Tensor  # [B, w] int64 tokens of the frontier nodes (input ids)
    node_ids: Tensor  # [B, w] int64 builder candidate ids (root = 0)
    scores: Tensor  # [B, w] float32 log path values
    parent_frontier_index: Tensor  # [B, w] int64 row in the previous frontier; -1 for root
    ancestor_rows: Tensor  # [B, w, depth + 1] global rows of the path root..self
    rows: Tensor  # [w] int64 global row numbers of these rows (same for all b)
    depth: int  # depth of the frontier nodes (0 = root); position offset

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


class TreeBuilder:
    """EAGLE-2 expand + rerank, batched over B requests; see the module docstring.

    The top-k of each frontier row's distribution runs in torch, where the log-probs are;
    the bookkeeping after it (scores, candidate ids, the next frontier and the rerank)
    runs on the host in numpy: its arrays hold at most ``B x topk**2`` candidates a
    level, and numpy's per-call cost is a fraction of torch's at these sizes, which is
    what the builder's time is made of. The frontier and the tree come back as tensors
    on the log-probs' device.

    Args:
        root_tokens: [B] last accepted tokens (the roots).
        topk: children per expanded node and beam (frontier) width, >= 1.
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
    ) -> None:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if passes < 0:
            raise ValueError(f"passes must be >= 0, got {passes}")
        root_tokens = root_tokens.reshape(-1).long()
        self.device = root_tokens.device
        self.batch_size = b = root_tokens.shape[0]
        self.topk = int(topk)
        self.passes = int(passes)
        if isinstance(nodes, Tensor):
            budget = nodes.detach().cpu().long().reshape(-1).numpy()
            if budget.size == 1 and b != 1:
                budget = np.broadcast_to(budget, (b,))
            if budget.shape != (b,):
                raise ValueError("nodes must be an int or a [B] tensor")
        else:
            budget = np.full(b, int(nodes), dtype=np.int64)
        self._budget = np.maximum(budget, 1)
        self.root_tokens = root_tokens
        self._batch_rows = np.arange(b)[:, None]  # fancy-indexes one column per row

        # candidate store (one entry per step), each [B, w * topk]
        self._cand_tokens: list[np.ndarray] = []
        self._cand_scores: list[np.ndarray] = []
        self._cand_parent: list[np.ndarray] = []  # parent candidate id
        self._cand_parent_row: list[np.ndarray] = []  # global row of the parent
        self._num_cands = 0
        self._passes_done = 0
        self._next_row = 1

        # the frontier on the host (the tensors of ``Frontier`` are views of these)
        self._f_scores = np.zeros((b, 1), dtype=np.float32)
        self._f_node_ids = np.zeros((b, 1), dtype=np.int64)
        self._f_rows = np.zeros(1, dtype=np.int64)
        self._f_ancestors = np.zeros((b, 1, 1), dtype=np.int64)
        self._frontier = Frontier(
            tokens=root_tokens[:, None].clone(),
            node_ids=self._tensor(self._f_node_ids),
            scores=self._tensor(self._f_scores),
            parent_frontier_index=self._tensor(np.full((b, 1), -1, dtype=np.int64)),
            ancestor_rows=self._tensor(self._f_ancestors),
            rows=self._tensor(self._f_rows),
            depth=0,
        )

    @property
    def nodes(self) -> Tensor:
        """[B] node budgets, root included (each >= 1)."""
        return self._tensor(self._budget.copy())

    def _tensor(self, array: np.ndarray) -> Tensor:
        return torch.from_numpy(array).to(self.device)

    # --------------------------------------------------------------- progress
    @property
    def passes_done(self) -> int:
        """:meth:`step` calls (draft forwards) so far."""
        return self._passes_done

    # ------------------------------------------------------------------- API
    def frontier(self) -> Frontier:
        return self._frontier

    def step(
        self, logprobs: Tensor, token_ids: Tensor | None = None, children: Tensor | None = None
    ) -> Frontier:
        """Expand the current frontier with its children distributions.

        ``logprobs``: [B, w, V] log-softmax of the draft logits, row ``j`` for
        frontier node ``j``.  Any float dtype; top-k runs in that dtype and
        scores are accumulated in float32.  ``token_ids``: [V] the token id of
        each column when drafting over a reduced vocabulary (default: column j
        is token j).  ``children``: [B, w, topk] columns chosen by the caller
        (e.g. sampled from the draft distribution) instead of the top-k; they
        keep the caller's order, which a sampled-draft verifier relies on.
        Returns the next frontier.
        """
        if self._passes_done >= self.passes:
            raise RuntimeError(f"TreeBuilder.step called more than passes={self.passes} times")
        fr = self._frontier
        b, w, k = self.batch_size, fr.width, self.topk
        if logprobs.dim() != 3 or logprobs.shape[0] != b or logprobs.shape[1] != w:
            raise ValueError(f"logprobs must be [B={b}, w={w}, V], got {tuple(logprobs.shape)}")
        if logprobs.shape[2] < k:
            raise ValueError(f"vocab size {logprobs.shape[2]} < topk {k}")

        if children is None:
            vals, idx = _ranked_children_host(logprobs, k, token_ids)  # [B, w, k]
        else:
            if children.shape != (b, w, k):
                raise ValueError(f"children must be [B={b}, w={w}, topk={k}]")
            cols = children.to(logprobs.device, torch.long)
            vals = _clean_host(logprobs.gather(-1, cols))
            if token_ids is not None:
                cols = token_ids.to(cols.device)[cols]
            idx = cols.cpu().numpy()

        child_scores = (self._f_scores[:, :, None] + vals).reshape(b, w * k)
        child_tokens = idx.reshape(b, w * k)
        offset = self._num_cands + 1
        child_ids = offset + np.arange(w * k, dtype=np.int64)
        self._cand_tokens.append(child_tokens)
        self._cand_scores.append(child_scores)
        self._cand_parent.append(np.repeat(self._f_node_ids, k, axis=1))
        self._cand_parent_row.append(np.broadcast_to(np.repeat(self._f_rows, k), (b, w * k)))
        self._num_cands += w * k
        self._passes_done += 1

        # next frontier: global top-k of this level, (score desc, id asc)
        nw = min(k, w * k)
        order = _descending(child_scores)[:, :nw]
        pfi = order // k
        rows = self._next_row + np.arange(nw, dtype=np.int64)
        self._next_row += nw
        at = (self._batch_rows, order)
        ancestors = self._f_ancestors[self._batch_rows, pfi]
        ancestors = np.concatenate([ancestors, np.broadcast_to(rows, (b, nw))[:, :, None]], 2)
        self._f_scores = child_scores[at]
        self._f_node_ids = child_ids[order]
        self._f_rows = rows
        self._f_ancestors = ancestors
        self._frontier = Frontier(
            tokens=self._tensor(child_tokens[at]),
            node_ids=self._tensor(self._f_node_ids),
            scores=self._tensor(self._f_scores),
            parent_frontier_index=self._tensor(pfi),
            ancestor_rows=self._tensor(ancestors),
            rows=self._tensor(rows),
            depth=fr.depth + 1,
        )
        return self._frontier

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
        b = self.batch_size
        c = self._num_cands
        m = np.clip(self._budget - 1, 0, c)
        if pad_to is not None:
            if pad_to < 1:
                raise ValueError("pad_to must be >= 1")
            m = np.minimum(m, pad_to - 1)
            width = int(pad_to)
            mm = min(pad_to - 1, c)
        else:
            mm = int(m.max()) if b > 0 else 0
            width = mm + 1
        if c == 0 or mm == 0:
            return root_only_tree(self.root_tokens, width)

        scores = np.concatenate(self._cand_scores, axis=1)  # [B, C], position p <-> id p+1
        # positions are already in (depth, id) order, so a stable descending
        # sort on the score gives (score desc, depth asc, id asc)
        ranked = _descending(scores)[:, :mm]
        valid = np.arange(mm)[None, :] < m[:, None]
        sel = np.where(valid, ranked, c)  # valid entries form a prefix
        if order == "id":
            sel = np.sort(sel, axis=1)
        ok = sel < c
        at = (self._batch_rows, np.minimum(sel, c - 1))

        def pick(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts, axis=1)[at]

        # candidate id -> output index (root 0 -> 0; unselected -> -1)
        inv = np.full((b, c + 2), -1, dtype=np.int64)
        inv[:, 0] = 0
        out_idx = np.broadcast_to(np.arange(1, mm + 1, dtype=np.int64), (b, mm))
        inv[self._batch_rows, np.where(ok, sel + 1, c + 1)] = out_idx
        par_out = inv[self._batch_rows, pick(self._cand_parent)]
        depths = [np.full(x.shape, i + 1, dtype=np.int64) for i, x in enumerate(self._cand_tokens)]

        def padded(first, body: np.ndarray, fill) -> Tensor:
            out = np.full((b, width), fill, dtype=body.dtype)
            out[:, 0] = first
            out[:, 1 : mm + 1] = np.where(ok, body, fill)
            return self._tensor(out)

        root = self.root_tokens.cpu().numpy()
        return DraftTree(
            tokens=padded(root, pick(self._cand_tokens), -1),
            parents=padded(-1, par_out, -1),
            depths=padded(0, pick(depths), -1),
            num_nodes=self._tensor(m + 1),
            scores=padded(0.0, scores[at], -np.inf),
            parent_row=padded(-1, pick(self._cand_parent_row), -1),
        )


def _descending(scores: np.ndarray) -> np.ndarray:
    """Per row, the positions by score descending, ties in position order (stable)."""
    return np.argsort(-scores, axis=1, kind="stable")


def _clean_host(vals: Tensor) -> np.ndarray:
    """float32 on the host, NaN -> -inf, and at most 0, so scores never rise along a path."""
    vals = vals.detach().float().cpu().numpy()
    return np.minimum(np.where(np.isnan(vals), -np.inf, vals), 0.0).astype(np.float32)


def _ranked_children_host(
    logprobs: Tensor, k: int, token_ids: Tensor | None
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top-``k`` (log-prob, token) in the canonical sibling order: log-prob
    descending, then token id ascending on ties. The top-k runs in torch, the order on the
    host; float32 log-probs and int64 tokens, ``[B, w, k]`` arrays. ``token_ids`` maps
    columns to tokens when drafting over a reduced vocabulary."""
    vals, cols = torch.topk(logprobs, k, dim=-1)
    if token_ids is not None:
        cols = token_ids.to(cols.device)[cols]
    shape = vals.shape
    vals, tokens = _canonical_order(
        _clean_host(vals).reshape(-1, k), cols.cpu().numpy().reshape(-1, k)
    )
    return vals.reshape(shape), tokens.reshape(shape)


def _canonical_order(vals: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a top-k (``[R, k]`` cleaned log-probs, tokens) in the canonical sibling
    order: log-prob descending, token ascending. Top-k orders NaN (now -inf) first and
    ties arbitrarily, so rows are re-sorted only where its order is not already that."""
    if vals.shape[1] > 1 and bool((vals[:, 1:] >= vals[:, :-1]).any()):
        order = np.lexsort((tokens, -vals), axis=-1)
        at = (np.arange(order.shape[0])[:, None], order)
        vals, tokens = vals[at], tokens[at]
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
    (``benchmarks/micro/builder_cost.py --cold``). The children are re-sorted into the
    canonical order (equal log-probs by token id) only where the top-k's order is not
    it. ``logprobs``: [B, 1, V] or [B, V], the root's draft log-probs.
    """
    if topk < 1 or nodes < 1:
        raise ValueError(f"topk and nodes must be >= 1, got {topk}, {nodes}")
    root_tokens = root_tokens.reshape(-1).long()
    b, dev = root_tokens.shape[0], root_tokens.device
    logprobs = logprobs.reshape(b, -1)
    if logprobs.shape[1] < topk:
        raise ValueError(f"vocab size {logprobs.shape[1]} < topk {topk}")
    m = min(topk, nodes - 1)
    width = int(nodes)
    if m == 0:
        return root_only_tree(root_tokens, width)
    vals, cols = torch.topk(logprobs, topk, dim=-1)  # log-prob descending
    if token_ids is not None:
        cols = token_ids.to(cols.device)[cols]
    vals, tokens = _canonical_order(_clean_host(vals), cols.cpu().numpy())
    # tokens, parents, depths and parent rows in one array: the root's parent and parent
    # row are -1 and its depth 0; the children's parent and parent row are 0 (the root's)
    ints = np.full((4, b, width), -1, dtype=np.int64)
    ints[0, :, 0] = root_tokens.cpu().numpy()
    ints[0, :, 1 : m + 1] = tokens[:, :m]
    ints[1:, :, 1 : m + 1] = 0
    ints[2, :, 0] = 0
    ints[2, :, 1 : m + 1] = 1
    scores = np.full((b, width), -np.inf, dtype=np.float32)
    scores[:, 0] = 0.0
    scores[:, 1 : m + 1] = vals[:, :m]
    packed = torch.from_numpy(ints).to(dev)
    return DraftTree(
        tokens=packed[0],
        parents=packed[1],
        depths=packed[2],
        num_nodes=torch.full((b,), m + 1, dtype=torch.long, device=dev),
        scores=torch.from_numpy(scores).to(dev),
        parent_row=packed[3],
    )
