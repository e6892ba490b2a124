"""Greedy verification of a batched draft tree, plus the result type and tree helpers
shared by every verification rule (pure torch, no vLLM imports). Its oracle,
:func:`eagle_vllm.verify.reference.greedy_verify`, walks full ``[B, N, V]`` rows.

Tree convention (shared with the runner):

* ``tokens [B, N] int64``: node 0 is the root (the last accepted token); nodes
  ``1 .. num_nodes[b]-1`` are draft nodes in topological order (``parent < index``).
  Padding is ``-1``.
* ``parents [B, N] int64``: ``parents[:, 0] = -1``; padding ``-1``.
* ``num_nodes [B] int64``: number of nodes including the root (>= 1).
* per-node rows ``[B, N, V]``: row ``i`` is the target's next-token distribution (or
  logits) *after* node ``i``, i.e. the distribution of node ``i``'s children.

Siblings are ordered by node index; when two siblings carry the same token the one
with the smaller index wins (the other can never be reached).  Everything at or
beyond ``num_nodes[b]`` (tokens, parents, rows) is ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["VerifyResult", "child_with_token", "greedy_verify_choices", "greedy_walk_lists"]


@dataclass
class VerifyResult:
    """Outcome of verifying one batch of draft trees.

    Attributes:
        accepted_nodes: ``[B, N-1] int64`` node indices of the accepted path in
            root-to-leaf order, excluding the root; ``-1`` padded.
        num_accepted: ``[B] int64`` number of accepted draft nodes.
        output_tokens: ``[B, N] int64`` the tokens of the accepted nodes followed by
            the bonus/correction token (``num_accepted + 1`` valid entries), ``-1``
            padded.  This is the ``[path..., bonus, -1...]`` row vLLM expects.
    """

    accepted_nodes: Tensor
    num_accepted: Tensor
    output_tokens: Tensor


def _check_tree_inputs(
    tokens: Tensor, parents: Tensor, num_nodes: Tensor, *rows: Tensor
) -> tuple[int, int]:
    """Shape/dtype checks that never synchronise with the device."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, N], got {tuple(tokens.shape)}")
    B, N = tokens.shape
    if N < 1:
        raise ValueError("trees need at least the root node (N >= 1)")
    if parents.shape != tokens.shape:
        raise ValueError(f"parents {tuple(parents.shape)} must match tokens {tuple(tokens.shape)}")
    if num_nodes.shape != (B,):
        raise ValueError(f"num_nodes must be [B]={B}, got {tuple(num_nodes.shape)}")
    for t, name in ((tokens, "tokens"), (parents, "parents"), (num_nodes, "num_nodes")):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    V = None
    for r in rows:
        if r.dim() != 3 or r.shape[:2] != (B, N):
            raise ValueError(f"per-node rows must be [B, N, V]=[{B}, {N}, V], got {tuple(r.shape)}")
        if V is None:
            V = r.shape[2]
        elif r.shape[2] != V:
            raise ValueError("all per-node rows must share the vocabulary size")
    return B, N


def _draft_mask(num_nodes: Tensor, N: int) -> Tensor:
    """``[B, N] bool``: True for real draft nodes (index 1 .. num_nodes-1)."""
    idx = torch.arange(N, device=num_nodes.device)
    return (idx >= 1) & (idx < num_nodes.to(torch.long).unsqueeze(1))


def _masked_parents(parents: Tensor, num_nodes: Tensor) -> Tensor:
    """Parents with padding replaced by ``-2`` (never equal to a node index)."""
    valid = _draft_mask(num_nodes, parents.shape[1])
    return torch.where(
        valid, parents.to(torch.long), torch.full_like(parents, -2, dtype=torch.long)
    )


class _PathRecorder:
    """Accumulates accepted nodes and output tokens without per-row Python loops."""

    def __init__(self, B: int, N: int, device: torch.device) -> None:
        self.N = N
        # one extra (dummy) column receives the writes of rows that do not write
        self._nodes = torch.full((B, N), -1, dtype=torch.long, device=device)
        self._out = torch.full((B, N + 1), -1, dtype=torch.long, device=device)
        self.num_accepted = torch.zeros(B, dtype=torch.long, device=device)

    def accept(self, mask: Tensor, node: Tensor, token: Tensor) -> None:
        col_nodes = torch.where(mask, self.num_accepted, self.N - 1).unsqueeze(1)
        col_out = torch.where(mask, self.num_accepted, self.N).unsqueeze(1)
        self._nodes.scatter_(1, col_nodes, node.unsqueeze(1))
        self._out.scatter_(1, col_out, token.unsqueeze(1))
        self.num_accepted += mask.to(torch.long)

    def finish(self, final_token: Tensor) -> VerifyResult:
        # the dummy columns may hold garbage: reset before slicing
        self._nodes[:, self.N - 1] = -1
        self._out[:, self.N] = -1
        self._out.scatter_(1, self.num_accepted.unsqueeze(1), final_token.unsqueeze(1))
        return VerifyResult(
            accepted_nodes=self._nodes[:, : self.N - 1].clone(),
            num_accepted=self.num_accepted,
            output_tokens=self._out[:, : self.N].clone(),
        )


def _walk_tree(
    tokens: Tensor,
    parents: Tensor,
    num_nodes: Tensor,
    choose: Callable[..., Tensor],
    active_rows_only: bool = False,
) -> VerifyResult:
    """Walk from the root; at node ``u`` the verifier picks ``y = choose(u)``; move to
    the first child of ``u`` whose token is ``y``, otherwise stop and emit ``y``.

    ``choose`` maps the ``[B]`` current nodes to ``[B]`` chosen tokens; it is called
    once per depth for every row (rows that already stopped are ignored) and, for a
    given row, never twice on the same node. With ``active_rows_only`` it is called as
    ``choose(rows, nodes)`` for the rows still walking only, and returns their tokens
    (for choices that cost a draw per row).
    """
    B, N = tokens.shape
    device = tokens.device
    par = _masked_parents(parents, num_nodes)
    toks = tokens.to(torch.long)
    idx = torch.arange(N, device=device)
    rec = _PathRecorder(B, N, device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    active = torch.ones(B, dtype=torch.bool, device=device)
    final = torch.zeros(B, dtype=torch.long, device=device)
    for _ in range(N):  # a path holds at most N-1 drafts, so at most N choices
        if active_rows_only:
            rows = active.nonzero().view(-1)
            y = torch.zeros(B, dtype=torch.long, device=device)
            y[rows] = choose(rows, cur[rows]).to(torch.long)
        else:
            y = choose(cur).to(torch.long)
        match = (par == cur.unsqueeze(1)) & (toks == y.unsqueeze(1))
        first = torch.where(match, idx, N).min(dim=1).values
        found = active & (first < N)
        final = torch.where(active & ~found, y, final)
        node = torch.where(found, first, 0)
        rec.accept(found, node, toks.gather(1, node.unsqueeze(1)).squeeze(1))
        cur = torch.where(found, first, cur)
        active = found
        if not bool(active.any()):
            break
    return rec.finish(final)


def greedy_verify_choices(
    tokens: Tensor, parents: Tensor, num_nodes: Tensor, choice: Tensor
) -> VerifyResult:
    """Greedy (argmax) verification from the target's choice at every node: the longest
    path the target's argmax agrees with.

    ``choice [B, N]`` is the argmax of node ``u``'s target row, so the caller never
    materialises ``[B, N, V]``. At node ``u`` the target's choice is ``y = choice[:, u]``;
    if a child of ``u`` carries ``y`` the walk moves there (the first such child),
    otherwise it stops and ``y`` is the bonus token."""
    if choice.shape != tokens.shape:
        raise ValueError(f"choice must be [B, N] like tokens {tuple(tokens.shape)}, "
                         f"got {tuple(choice.shape)}")  # fmt: skip
    choice = choice.to(torch.long)

    def choose(cur: Tensor) -> Tensor:
        return choice.gather(1, cur.unsqueeze(1)).squeeze(1)

    return _walk_tree(tokens, parents, num_nodes, choose)


def greedy_walk_lists(
    tokens: list[list[int]],
    parents: list[list[int]],
    num_nodes: list[int],
    choice: list[list[int]],
) -> tuple[list[list[int]], list[list[int]]]:
    """:func:`greedy_verify_choices` over Python lists, one tree at a time: per tree, the
    accepted nodes (root excluded) and the output tokens (the accepted nodes' tokens,
    then the target's choice where the walk stopped).

    For the few nodes of a step at small batch sizes: the torch walk runs about forty
    tensor ops however small the trees (0.3-0.5 ms a step on a CPU); this takes a few
    microseconds. Same rule: at node ``u`` the walk moves to the first child of ``u``
    (lowest index) whose token is ``choice[u]``, else stops."""
    paths, outputs = [], []
    for toks, par, n, ch in zip(tokens, parents, num_nodes, choice):
        path, out, cur = [], [], 0
        for _ in range(n):  # a path holds at most n - 1 drafts
            y = ch[cur]
            out.append(y)
            nxt = child_with_token(toks, par, n, cur, y)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        paths.append(path)
        outputs.append(out)
    return paths, outputs


def child_with_token(
    tokens: list[int], parents: list[int], num_nodes: int, node: int, token: int
) -> int | None:
    """The child of ``node`` carrying ``token`` in one tree given as lists (the lowest
    index where two siblings carry it; children come after their parent), or None."""
    return next(
        (j for j in range(node + 1, num_nodes) if parents[j] == node and tokens[j] == token),
        None,
    )
