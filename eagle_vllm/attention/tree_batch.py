"""Per-step description of the draft trees being verified (pure torch).

Built by the runner for each step; read by the tree attention (masks), the
verifier (parents) and the KV compaction (which rows moved where).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from eagle_vllm.tree.layout import ancestor_mask_from_parents
from eagle_vllm.verify import chain_parents


@dataclass
class AttentionPlan:
    """Per-step inputs of the tree attention, shared by all layers (``attention_plan``)."""

    rows: torch.Tensor  # [R * N] flat query rows of the nodes, request by request
    valid_rows: torch.Tensor  # flat query rows of the real nodes (not padding)
    valid_nodes: torch.Tensor | None  # their indices in ``rows`` (None: every node is real)
    blocks: torch.Tensor  # [R * B] int64 block ids of each request's first B blocks
    num_blocks: int  # B: the blocks holding the longest prefix (positions before a root)
    block_size: int
    dtype: torch.dtype
    root_pos: torch.Tensor  # [R] int64: a request's prefix is the positions before it
    ancestor_mask: torch.Tensor  # [R, N, N] bool (``TreeBatch.ancestor_mask``)

    @cached_property
    def mask(self) -> torch.Tensor:
        """[R, 1, N, B * block + N] additive mask (0 visible, -inf hidden) of the torch
        path. Built on first use only: the fused op reads ``ancestor_mask`` directly."""
        span = self.num_blocks * self.block_size
        prefix_ok = torch.arange(span)[None, :] < self.root_pos[:, None]
        r, n, _ = self.ancestor_mask.shape
        allowed = torch.cat([prefix_ok[:, None, :].expand(r, n, span), self.ancestor_mask], 2)
        additive = torch.zeros(allowed.shape, dtype=self.dtype)
        return additive.masked_fill(~allowed, float("-inf"))[:, None]

    def covers(self, num_tokens: int) -> bool:
        """Whether the tree rows are all of the step's ``num_tokens`` query rows (then no
        row needs the stock causal kernel)."""
        return self.valid_rows.numel() == num_tokens


@dataclass
class TreeBatch:
    """The tree-shaped requests of one verification step.

    Each tree request r occupies flat query rows ``root_index[r] + j`` for its
    nodes ``j < num_nodes[r]`` (node 0 = root = the last accepted token, nodes
    in topological order), sits in batch row ``batch_rows[r]``, and its root
    is at sequence position ``root_pos[r]`` (so its prefix is positions
    ``< root_pos[r]``).
    """

    batch_rows: torch.Tensor  # [R] int64
    root_index: torch.Tensor  # [R] int64 flat token index of the root
    root_pos: torch.Tensor  # [R] int64
    num_nodes: torch.Tensor  # [R] int64, root included
    parents: torch.Tensor  # [R, N] int64, -1 for root/padding
    depths: torch.Tensor  # [R, N] int64, 0 for root/padding
    block_table: torch.Tensor  # [R, max_blocks] int32, this step's block-table rows
    # filled during the target forward: layer name -> (K, V) of the tree rows [R, N, Hkv, D]
    captured_kv: dict = field(default_factory=dict)
    _ancestor_mask: torch.Tensor | None = field(default=None, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def width(self) -> int:
        return self.parents.shape[1]

    def valid(self) -> torch.Tensor:
        return torch.arange(self.width)[None, :] < self.num_nodes[:, None]

    def flat_rows(self) -> torch.Tensor:
        """[R, N] flat query rows of the nodes (padding rows clamp to the root)."""
        offsets = torch.arange(self.width)[None, :]
        return self.root_index[:, None] + torch.where(self.valid(), offsets, 0)

    def tree_positions(self) -> torch.Tensor:
        return self.root_pos[:, None] + self.depths

    def compaction_moves(
        self, accepted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which K/V must move after verification.

        ``accepted``: ``[R, D]`` node indices of each tree's accepted path (-1 padded).
        Path node ``i`` (0-based) belongs at position ``root + i + 1``, i.e. flat row
        ``root_index + i + 1``. Returns ``(tree, src_node, dst_row)`` for every node
        not already there; the caller copies K/V of ``(tree, src_node)`` (captured
        during the forward, so overlapping sources are safe) to ``dst_row``'s slot.
        """
        depth_index = torch.arange(1, accepted.shape[1] + 1)[None, :].expand_as(accepted)
        moved = (accepted >= 0) & (accepted != depth_index)
        tree, i = moved.nonzero(as_tuple=True)
        return tree, accepted[tree, i], self.root_index[tree] + i + 1

    def verification_parents(self, num_nodes: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width] parents of every request of the batch for the verifier: this
        batch's trees in their rows (nodes beyond a request's ``num_nodes`` cut), chains
        in the others, -1 past each request's nodes."""
        parents = chain_parents(num_nodes, width)
        n = min(width, self.width)
        tree_parents = self.parents[:, :n].clone()
        tree_parents[tree_parents >= num_nodes[self.batch_rows][:, None]] = -1
        parents[self.batch_rows, :n] = tree_parents
        parents[torch.arange(width)[None, :] >= num_nodes[:, None]] = -1
        return parents

    def ancestor_mask(self) -> torch.Tensor:
        """[R, N, N] True where node i may attend to node j (j is i or an ancestor).

        Computed once per step and reused by every attention layer."""
        if self._ancestor_mask is None:
            self._ancestor_mask = ancestor_mask_from_parents(self.parents, self.num_nodes)
        return self._ancestor_mask

    def attention_plan(self, dtype: torch.dtype, block_size: int) -> AttentionPlan:
        """What every attention layer of this step shares, built once per step. The
        prefix spans whole blocks (the cache's own layout, so gathering it is one copy);
        positions past a request's root are masked."""
        key = (dtype, block_size)
        if key not in self._plans:
            rows, valid = self.flat_rows(), self.valid()
            num_blocks = -(-max(int(self.root_pos.max()), 1) // block_size)
            flat_valid = valid.reshape(-1)
            self._plans[key] = AttentionPlan(
                rows=rows.reshape(-1),
                valid_rows=rows[valid],
                valid_nodes=None if bool(flat_valid.all()) else flat_valid.nonzero()[:, 0],
                blocks=self.block_table[:, :num_blocks].reshape(-1).long(),
                num_blocks=num_blocks,
                block_size=block_size,
                dtype=dtype,
                root_pos=self.root_pos,
                ancestor_mask=self.ancestor_mask(),
            )
        return self._plans[key]
