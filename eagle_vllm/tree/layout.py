"""Batched draft-tree layout and the tree utilities served (pure torch, no vLLM).

The tests' tree utilities (``check_tree``, ``truncate``, ``retrieve_indices``, ...) are
oracles: :mod:`eagle_vllm.tree.reference`.

A :class:`DraftTree` holds ``B`` independent trees padded to a common width
``N``.  Conventions (the runner and the verifier rely on them):

* Node ``0`` of every request is the ROOT: the last accepted token, already
  sampled by the target.  Its draft distribution is the first one the draft
  model produces.  The root is always present (``num_nodes >= 1``).
* Nodes ``1 .. num_nodes-1`` are draft nodes in topological order:
  ``0 <= parents[b, i] < i``.  Hence every prefix ``0 .. k-1`` of a valid tree
  is itself a valid tree (see :func:`eagle_vllm.tree.reference.truncate`).
* Valid nodes of request ``b`` are exactly the positions ``i < num_nodes[b]``;
  everything after is padding.
* Padding values: ``tokens = -1``, ``parents = -1``, ``depths = -1``,
  ``scores = -inf``, ``parent_row = -1``.  Root: ``parents = -1``,
  ``depths = 0``, ``scores = 0.0``, ``parent_row = -1``.
* ``depths[b, i]`` is the number of edges from the root, which is also the
  position offset of node ``i`` relative to the root's position.
* ``scores`` are log path values ``sum(log q)`` along the root-to-node path
  (EAGLE-2 "value" in log space).
* ``parent_row[b, i]`` (optional) is the global draft-row index of the draft
  forward row whose output distribution ``q(. | parent(i))`` node ``i`` was
  drawn from.  Rows are numbered in the order the builder's frontiers were fed
  to the draft model (root row = 0, then the depth-1 frontier rows, ...); if
  the caller concatenates the log-probs passed to each
  :meth:`TreeBuilder.step` call along dim 1 it can index them with
  ``parent_row``.  Siblings share a ``parent_row``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["DraftTree", "ancestor_mask_from_parents", "root_only_tree"]


@dataclass
class DraftTree:
    """B padded draft trees; see the module docstring for the conventions."""

    tokens: Tensor  # [B, N] int64; tokens[:, 0] = root token; padding -1
    parents: Tensor  # [B, N] int64; parents[:, 0] = -1; padding -1
    depths: Tensor  # [B, N] int64; depths[:, 0] = 0; padding -1
    num_nodes: Tensor  # [B] int64, including the root (>= 1)
    scores: Tensor  # [B, N] float32 log path value; root 0.0; padding -inf
    parent_row: Tensor | None = None  # [B, N] int64; root/padding -1

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        """Padded width ``N`` (>= 1)."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def valid_mask(self) -> Tensor:
        """[B, N] bool: True for the real nodes (root included)."""
        n = self.max_nodes
        ar = torch.arange(n, device=self.device)
        return ar[None, :] < self.num_nodes[:, None]

    def max_depth(self) -> int:
        """Largest node depth over the batch (host sync)."""
        return int(self.depths.max().item()) if self.depths.numel() else 0

    def to(self, device: torch.device | str) -> DraftTree:
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if isinstance(v, Tensor) else v
        return DraftTree(**kw)


def root_only_tree(root_tokens: Tensor, width: int = 1) -> DraftTree:
    """A batch of trees that contain only their root, padded to ``width``."""
    root_tokens = root_tokens.reshape(-1).long()
    b = root_tokens.shape[0]
    dev = root_tokens.device
    width = max(int(width), 1)
    tokens = torch.full((b, width), -1, dtype=torch.long, device=dev)
    tokens[:, 0] = root_tokens
    parents = torch.full((b, width), -1, dtype=torch.long, device=dev)
    depths = torch.full((b, width), -1, dtype=torch.long, device=dev)
    depths[:, 0] = 0
    scores = torch.full((b, width), float("-inf"), dtype=torch.float32, device=dev)
    scores[:, 0] = 0.0
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        num_nodes=torch.ones(b, dtype=torch.long, device=dev),
        scores=scores,
        parent_row=torch.full((b, width), -1, dtype=torch.long, device=dev),
    )


def ancestor_mask_from_parents(parents: Tensor, num_nodes: Tensor | None = None) -> Tensor:
    """[R, N, N] bool: True where node j is node i or an ancestor of i.

    ``parents``: ``[R, N]``, a node's parent index, -1 for a root and for padding.
    Nodes at or past ``num_nodes[r]`` (when given) are padding: they see, and are seen
    by, nothing. Reachability is squared until it stops growing: ceil(log2(depth)) + 1
    small batched matmuls, where a walk up the tree costs a pass per level (it was
    ~1 ms a step at 16 nodes on a 2-core CPU, more than the whole tree attention).
    """
    r, n = parents.shape
    dev = parents.device
    parents = parents.long()
    has_parent = (parents >= 0).float()
    reach = torch.eye(n, device=dev).repeat(r, 1, 1)  # i reaches itself...
    reach.scatter_add_(2, parents.clamp(min=0)[..., None], has_parent[..., None])  # ...its parent
    while True:  # reach within 2k hops = (reach within k hops)^2; 0/1 floats are exact
        wider = torch.bmm(reach, reach).clamp_(max=1.0)
        if torch.equal(wider, reach):
            break
        reach = wider
    mask = reach > 0
    if num_nodes is not None:
        valid = torch.arange(n, device=dev)[None, :] < num_nodes.to(dev)[:, None]
        mask &= valid[:, :, None] & valid[:, None, :]
    return mask
