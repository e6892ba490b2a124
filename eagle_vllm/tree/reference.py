"""Reference implementations (oracles) for tests: plain, slow, obviously correct; never called when serving.

Tree utilities over a :class:`~eagle_vllm.tree.layout.DraftTree` (pure torch, no vLLM)
that the tests use to state and check what the builder returns. What each one checks:

* :func:`check_tree` -- every layout convention of :mod:`eagle_vllm.tree.layout`
  (root, padding, topological parents, depths, monotone scores, ``parent_row``): run on
  every tree :class:`~eagle_vllm.tree.builder.TreeBuilder` and
  :func:`~eagle_vllm.tree.builder.depth_one_tree` build.
* :func:`ancestor_mask`, :func:`children_arrays`, :func:`leaf_mask`,
  :func:`retrieve_indices` -- the shape of a built tree (ancestors, first child / next
  sibling, leaves, root-to-leaf paths), compared with a per-node Python reference.
* :func:`truncate` -- a tree's first ``k`` nodes: a ``"rank"``-ordered tree cut to ``k``
  nodes must equal the tree built with ``nodes = k``, and a padded one its unpadded twin.
* :func:`chain_tree` -- the ``topk = 1`` tree written out directly: the builder's
  ``topk = 1`` output must be the argmax chain.
* :func:`num_candidates`, :func:`num_rows` -- the closed-form sizes of ``passes`` builder
  steps, against the candidates and draft rows the builder actually makes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .layout import DraftTree, ancestor_mask_from_parents

__all__ = [
    "ancestor_mask",
    "chain_tree",
    "check_tree",
    "children_arrays",
    "leaf_mask",
    "num_candidates",
    "num_rows",
    "retrieve_indices",
    "truncate",
]


def num_candidates(topk: int, passes: int, root_topk: int | None = None) -> int:
    """Candidates created by ``passes`` builder steps: root_topk + (passes - 1) * topk**2
    (``root_topk`` defaults to ``topk``)."""
    root = topk if root_topk is None else root_topk
    return 0 if passes <= 0 else root + (passes - 1) * topk * topk


def num_rows(topk: int, passes: int) -> int:
    """Draft rows fed by ``passes`` builder steps: 1 + (passes - 1) * topk."""
    return 0 if passes <= 0 else 1 + (passes - 1) * topk


def ancestor_mask(tree: DraftTree, pad_diag: bool = False) -> Tensor:
    """[B, N, N] bool; row ``i`` is True at ``i`` and at every ancestor of ``i``.

    Padding rows and columns are all False, unless ``pad_diag`` is set, in
    which case padding rows get a True diagonal (handy for attention masks
    that must not have empty rows).
    """
    mask = ancestor_mask_from_parents(tree.parents, tree.num_nodes)
    if pad_diag:
        n = mask.shape[-1]
        eye = torch.eye(n, dtype=torch.bool, device=mask.device)
        mask = mask | (eye[None] & ~tree.valid_mask()[:, :, None])
    return mask


def children_arrays(tree: DraftTree) -> tuple[Tensor, Tensor]:
    """First-child / next-sibling arrays, each [B, N] int64, -1 where none.

    Siblings are ordered by ascending node index (the tree's own order).
    """
    b, n = tree.parents.shape
    dev = tree.device
    ar = torch.arange(n, device=dev).expand(b, n)
    is_child = tree.valid_mask() & (tree.parents >= 0)
    par = torch.where(is_child, tree.parents, n)  # n = dummy bucket
    first = torch.full((b, n + 1), n, dtype=torch.long, device=dev)
    first.scatter_reduce_(1, par, ar.contiguous(), reduce="amin", include_self=True)
    first = first[:, :n]
    first = torch.where(first < n, first, -1)

    key = par * (n + 1) + ar  # children grouped by parent, index ascending
    order = torch.sort(key, dim=1, stable=True).indices
    par_sorted = par.gather(1, order)
    nxt = torch.full((b, n), -1, dtype=torch.long, device=dev)
    if n > 1:
        same = (par_sorted[:, 1:] == par_sorted[:, :-1]) & (par_sorted[:, :-1] < n)
        nxt_vals = torch.where(same, order[:, 1:], -1)
        nxt.scatter_(1, order[:, :-1], nxt_vals)
    return first, nxt


def leaf_mask(tree: DraftTree) -> Tensor:
    """[B, N] bool: valid nodes without children (a root-only tree's root is a leaf)."""
    b, n = tree.parents.shape
    valid = tree.valid_mask()
    has_child = torch.zeros((b, n + 1), dtype=torch.bool, device=tree.device)
    par = torch.where(valid & (tree.parents >= 0), tree.parents, n)
    has_child.scatter_(1, par, True)
    return valid & ~has_child[:, :n]


def retrieve_indices(tree: DraftTree) -> Tensor:
    """Root-to-leaf node-index paths, [B, L, D + 1] int64, padded with -1.

    ``L`` = the largest leaf count in the batch, ``D`` = the largest depth.
    Row ``l`` of request ``b`` is the path to its ``l``-th leaf, leaves taken
    in ascending node index; entry ``d`` is the node at depth ``d`` (entry 0 is
    always the root, 0).  Rows beyond a request's leaf count are all -1.
    (SafeAILab orders rows the same way in greedy mode; in sampling mode it
    additionally sorts rows lexicographically.)
    """
    b, n = tree.parents.shape
    dev = tree.device
    leaf = leaf_mask(tree)
    ar = torch.arange(n, device=dev).expand(b, n)
    n_leaves = int(leaf.sum(1).max().item())
    d1 = tree.max_depth() + 1
    leaf_idx = torch.sort(torch.where(leaf, ar, n), dim=1).values[:, :n_leaves]
    leaf_ok = leaf_idx < n
    anc = ancestor_mask(tree)
    rows = anc.gather(1, leaf_idx.clamp(max=n - 1).unsqueeze(-1).expand(b, n_leaves, n))
    rows = rows & leaf_ok.unsqueeze(-1)
    col = torch.where(rows, tree.depths.clamp(min=0).unsqueeze(1), d1)
    out = torch.full((b, n_leaves, d1 + 1), -1, dtype=torch.long, device=dev)
    out.scatter_(2, col, ar.unsqueeze(1).expand(b, n_leaves, n).contiguous())
    out = out[:, :, :d1]
    return torch.where(leaf_ok.unsqueeze(-1), out, -1)


def truncate(tree: DraftTree, max_nodes: Tensor | int, shrink: bool = True) -> DraftTree:
    """Keep the first ``min(num_nodes, max(max_nodes, 1))`` nodes of each request.

    Valid because the node order is topological (parents first).  With
    ``shrink`` the padded width becomes the largest kept count (host sync);
    otherwise the width is unchanged.
    """
    b, n = tree.parents.shape
    dev = tree.device
    if not isinstance(max_nodes, Tensor):
        max_nodes = torch.full((b,), int(max_nodes), dtype=torch.long, device=dev)
    k = torch.minimum(tree.num_nodes, max_nodes.to(dev).long().reshape(-1).clamp(min=1))
    width = max(int(k.max().item()), 1) if shrink else n
    keep = torch.arange(width, device=dev)[None, :] < k[:, None]

    def cut(x: Tensor, pad: float | int) -> Tensor:
        return torch.where(keep, x[:, :width], torch.as_tensor(pad, dtype=x.dtype, device=dev))

    return DraftTree(
        tokens=cut(tree.tokens, -1),
        parents=cut(tree.parents, -1),
        depths=cut(tree.depths, -1),
        num_nodes=k,
        scores=cut(tree.scores, float("-inf")),
        parent_row=None if tree.parent_row is None else cut(tree.parent_row, -1),
    )


def chain_tree(
    tokens: Tensor,
    root: Tensor,
    lengths: Tensor | None = None,
    logprobs: Tensor | None = None,
) -> DraftTree:
    """A chain (topk = 1) tree: root -> tokens[:, 0] -> tokens[:, 1] -> ...

    ``tokens``: [B, K] draft tokens; ``root``: [B] root tokens; ``lengths``:
    optional [B] number of drafts kept per request (default K); ``logprobs``:
    optional [B, K] per-draft log-probs (scores become their running sums;
    default 0).  ``parent_row[:, i] = i - 1``: node ``i``'s distribution came
    from the draft row of node ``i - 1`` (the builder's numbering for topk=1).
    """
    tokens = tokens.long()
    b, k = tokens.shape
    dev = tokens.device
    n = k + 1
    if lengths is None:
        lengths = torch.full((b,), k, dtype=torch.long, device=dev)
    lengths = lengths.to(dev).long().reshape(-1).clamp(0, k)
    num_nodes = lengths + 1
    ar = torch.arange(n, device=dev)
    valid = ar[None, :] < num_nodes[:, None]
    all_tokens = torch.cat([root.to(dev).long().reshape(b, 1), tokens], dim=1)
    if logprobs is None:
        scores = torch.zeros((b, n), dtype=torch.float32, device=dev)
    else:
        lp = logprobs.to(dev).float()
        scores = torch.cat([torch.zeros((b, 1), device=dev), torch.cumsum(lp, dim=1)], dim=1)
    neg1 = torch.tensor(-1, dtype=torch.long, device=dev)
    return DraftTree(
        tokens=torch.where(valid, all_tokens, neg1),
        parents=torch.where(valid, (ar - 1).expand(b, n), neg1),
        depths=torch.where(valid, ar.expand(b, n), neg1),
        num_nodes=num_nodes,
        scores=torch.where(valid, scores, torch.tensor(float("-inf"), device=dev)),
        parent_row=torch.where(valid, (ar - 1).expand(b, n), neg1),
    )


def check_tree(tree: DraftTree) -> None:
    """Raise ``ValueError`` if ``tree`` breaks the layout conventions (host sync)."""
    b, n = tree.tokens.shape
    for name in ("parents", "depths", "scores"):
        if getattr(tree, name).shape != (b, n):
            raise ValueError(f"{name} has shape {tuple(getattr(tree, name).shape)}")
    if tree.num_nodes.shape != (b,):
        raise ValueError("num_nodes must be [B]")
    if bool((tree.num_nodes < 1).any()) or bool((tree.num_nodes > n).any()):
        raise ValueError("num_nodes out of range")
    valid = tree.valid_mask()
    pad = ~valid
    ar = torch.arange(n, device=tree.device).expand(b, n)
    if bool((tree.parents[:, 0] != -1).any()) or bool((tree.depths[:, 0] != 0).any()):
        raise ValueError("bad root")
    if bool((tree.scores[:, 0] != 0).any()):
        raise ValueError("root score must be 0")
    if bool((tree.tokens[pad] != -1).any()) or bool((tree.parents[pad] != -1).any()):
        raise ValueError("padding tokens/parents must be -1")
    if bool((tree.depths[pad] != -1).any()):
        raise ValueError("padding depths must be -1")
    if bool((tree.scores[pad] != float("-inf")).any()):
        raise ValueError("padding scores must be -inf")
    draft = valid & (ar > 0)
    if bool((tree.tokens[valid] < 0).any()):
        raise ValueError("negative token in a valid node")
    p = tree.parents
    if bool(((p < 0) | (p >= ar))[draft].any()):
        raise ValueError("parent index must satisfy 0 <= parent < own index")
    pd = tree.depths.gather(1, p.clamp(min=0))
    if bool((tree.depths != pd + 1)[draft].any()):
        raise ValueError("depth must be parent depth + 1")
    ps = tree.scores.gather(1, p.clamp(min=0))
    if bool((tree.scores > ps)[draft].any()):
        raise ValueError("a node's score exceeds its parent's")
    if tree.parent_row is not None:
        pr = tree.parent_row
        if bool((pr[:, 0] != -1).any()) or bool((pr[pad] != -1).any()):
            raise ValueError("root/padding parent_row must be -1")
        if bool((pr[draft] < 0).any()):
            raise ValueError("draft node without parent_row")
        # siblings share a row and different parents use different rows
        same_parent = (p[:, :, None] == p[:, None, :]) & draft[:, :, None] & draft[:, None, :]
        same_row = pr[:, :, None] == pr[:, None, :]
        both = draft[:, :, None] & draft[:, None, :]
        if bool((same_parent != (same_row & both)).any()):
            raise ValueError("parent_row must identify the parent")
