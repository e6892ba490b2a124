"""Incremental EAGLE-2 dynamic draft-tree builder (selection only, pure torch).

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
            budget = nodes.to(self.device).long().reshape(-1)
            if budget.numel() == 1 and b != 1:
                budget = budget.expand(b)
            if budget.shape != (b,):
                raise ValueError("nodes must be an int or a [B] tensor")
        else:
            budget = torch.full((b,), int(nodes), dtype=torch.long, device=self.device)
        self.nodes = budget.clamp(min=1)
        self.root_tokens = root_tokens

        # candidate store (one entry per step), each [B, w * topk]
        self._cand_tokens: list[Tensor] = []
        self._cand_scores: list[Tensor] = []
        self._cand_parent: list[Tensor] = []  # parent candidate id
        self._cand_parent_row: list[Tensor] = []  # global row of the parent
        self._num_cands = 0
        self._passes_done = 0
        self._next_row = 1

        dev = self.device
        self._frontier = Frontier(
            tokens=root_tokens[:, None].clone(),
            node_ids=torch.zeros((b, 1), dtype=torch.long, device=dev),
            scores=torch.zeros((b, 1), dtype=torch.float32, device=dev),
            parent_frontier_index=torch.full((b, 1), -1, dtype=torch.long, device=dev),
            ancestor_rows=torch.zeros((b, 1, 1), dtype=torch.long, device=dev),
            rows=torch.zeros(1, dtype=torch.long, device=dev),
            depth=0,
        )

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
        dev = self.device

        if children is None:
            vals, idx = _ranked_children(logprobs, k, token_ids)  # [B, w, k]
        else:
            if children.shape != (b, w, k):
                raise ValueError(f"children must be [B={b}, w={w}, topk={k}]")
            idx = children.to(dev, torch.long)
            vals = _clean_logprobs(logprobs.gather(-1, idx))
            if token_ids is not None:
                idx = token_ids.to(idx.device)[idx]

        child_scores = (fr.scores[:, :, None] + vals).reshape(b, w * k)
        child_tokens = idx.reshape(b, w * k).long()
        offset = self._num_cands + 1
        child_ids = offset + torch.arange(w * k, device=dev)
        self._cand_tokens.append(child_tokens)
        self._cand_scores.append(child_scores)
        self._cand_parent.append(fr.node_ids.repeat_interleave(k, dim=1))
        self._cand_parent_row.append(fr.rows.repeat_interleave(k).expand(b, w * k))
        self._num_cands += w * k
        self._passes_done += 1

        # next frontier: global top-k of this level, (score desc, id asc)
        nw = min(k, w * k)
        order = torch.sort(child_scores, dim=1, descending=True, stable=True).indices[:, :nw]
        pfi = order // k
        rows = self._next_row + torch.arange(nw, device=dev)
        self._next_row += nw
        anc = fr.ancestor_rows.gather(1, pfi[:, :, None].expand(b, nw, fr.depth + 1))
        anc = torch.cat([anc, rows.expand(b, nw)[:, :, None]], dim=2)
        self._frontier = Frontier(
            tokens=child_tokens.gather(1, order),
            node_ids=child_ids.expand(b, w * k).gather(1, order),
            scores=child_scores.gather(1, order),
            parent_frontier_index=pfi,
            ancestor_rows=anc,
            rows=rows,
            depth=fr.depth + 1,
        )
        return self._frontier

    def finalize(self, pad_to: int | None = None, order: str = "rank") -> DraftTree:
        """Rerank and return the DraftTree (see the module docstring).

        Request ``b`` keeps ``1 + min(nodes[b] - 1, #candidates)``
        nodes.  The padded width is the largest of these (host sync), or
        ``pad_to`` if given, in which case budgets are also clamped to
        ``pad_to`` nodes.  ``order``: ``"rank"`` (score desc, shallow first;
        prefixes are optimal smaller trees) or ``"id"`` (SafeAILab's order).
        """
        if order not in ("rank", "id"):
            raise ValueError(f"order must be 'rank' or 'id', got {order!r}")
        b, dev = self.batch_size, self.device
        c = self._num_cands
        m = (self.nodes - 1).clamp(min=0, max=c)
        if pad_to is not None:
            if pad_to < 1:
                raise ValueError("pad_to must be >= 1")
            m = m.clamp(max=pad_to - 1)
            width = int(pad_to)
            mm = min(pad_to - 1, c)
        else:
            mm = int(m.max().item()) if b > 0 else 0
            width = mm + 1
        if c == 0 or mm == 0:
            tree = root_only_tree(self.root_tokens, width)
            return tree

        scores = torch.cat(self._cand_scores, dim=1)  # [B, C], position p <-> id p+1
        tokens = torch.cat(self._cand_tokens, dim=1)
        parent = torch.cat(self._cand_parent, dim=1)
        parent_row = torch.cat(self._cand_parent_row, dim=1)
        # positions are already in (depth, id) order, so a stable descending
        # sort on the score gives (score desc, depth asc, id asc)
        ranked = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :mm]
        valid = torch.arange(mm, device=dev)[None, :] < m[:, None]
        sel = torch.where(valid, ranked, c)  # valid entries form a prefix
        if order == "id":
            sel = torch.sort(sel, dim=1).values
        ok = sel < c
        sel_c = sel.clamp(max=c - 1)

        # candidate id -> output index (root 0 -> 0; unselected -> -1)
        inv = torch.full((b, c + 2), -1, dtype=torch.long, device=dev)
        inv[:, 0] = 0
        out_idx = torch.arange(1, mm + 1, device=dev).expand(b, mm)
        inv.scatter_(1, torch.where(ok, sel + 1, c + 1), out_idx.contiguous())
        par_out = inv.gather(1, parent.gather(1, sel_c))

        neg1 = torch.tensor(-1, dtype=torch.long, device=dev)
        d_tokens = torch.where(ok, tokens.gather(1, sel_c), neg1)
        d_parents = torch.where(ok, par_out, neg1)
        d_scores = torch.where(ok, scores.gather(1, sel_c), torch.tensor(float("-inf"), device=dev))
        d_prow = torch.where(ok, parent_row.gather(1, sel_c), neg1)
        d_depth = torch.where(ok, self._cand_depths(dev).gather(1, sel_c), neg1)

        pad = width - 1 - mm
        root = self.root_tokens[:, None]
        zero = torch.zeros((b, 1), dtype=torch.long, device=dev)

        def cat(first: Tensor, body: Tensor, fill: float | int) -> Tensor:
            parts = [first.to(body.dtype), body]
            if pad > 0:
                parts.append(torch.full((b, pad), fill, dtype=body.dtype, device=dev))
            return torch.cat(parts, dim=1)

        return DraftTree(
            tokens=cat(root, d_tokens, -1),
            parents=cat(zero - 1, d_parents, -1),
            depths=cat(zero, d_depth, -1),
            num_nodes=m + 1,
            scores=cat(torch.zeros((b, 1), device=dev), d_scores, float("-inf")),
            parent_row=cat(zero - 1, d_prow, -1),
        )

    # ------------------------------------------------------------- internals
    def _cand_depths(self, dev: torch.device) -> Tensor:
        parts = [
            torch.full((x.shape[1],), i + 1, dtype=torch.long, device=dev)
            for i, x in enumerate(self._cand_tokens)
        ]
        return torch.cat(parts).expand(self.batch_size, -1)


def _clean_logprobs(vals: Tensor) -> Tensor:
    """float32, NaN -> -inf, and at most 0, so scores never rise along a path."""
    vals = vals.float()
    return torch.where(torch.isnan(vals), float("-inf"), vals).clamp(max=0.0)


def _ranked_children(logprobs: Tensor, k: int, token_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each row's top-``k`` (log-prob, token) in the canonical sibling order: log-prob
    descending, then token id ascending on ties. ``token_ids`` maps columns to tokens
    when drafting over a reduced vocabulary."""
    vals, idx = torch.topk(logprobs, k, dim=-1)
    if token_ids is not None:
        idx = token_ids.to(idx.device)[idx]
    vals = _clean_logprobs(vals)
    idx, perm = torch.sort(idx, dim=-1)
    vals = vals.gather(-1, perm)
    vals, perm = torch.sort(vals, dim=-1, descending=True, stable=True)
    return vals, idx.gather(-1, perm)


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
    here it costs a top-k and two tiny sorts instead of the builder's bookkeeping for
    later levels. ``logprobs``: [B, 1, V] or [B, V], the root's draft log-probs.
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
    vals, idx = _ranked_children(logprobs, topk, token_ids)
    vals, idx = vals[:, :m], idx[:, :m]

    def row(first: Tensor | int | float, body: Tensor, fill: int | float) -> Tensor:
        out = torch.full((b, width), fill, dtype=body.dtype, device=dev)
        out[:, 0] = first
        out[:, 1 : m + 1] = body
        return out

    zeros = torch.zeros((b, m), dtype=torch.long, device=dev)
    return DraftTree(
        tokens=row(root_tokens, idx.long(), -1),
        parents=row(-1, zeros, -1),
        depths=row(0, zeros + 1, -1),
        num_nodes=torch.full((b,), m + 1, dtype=torch.long, device=dev),
        scores=row(0.0, vals, float("-inf")),
        parent_row=row(-1, zeros, -1),
    )
