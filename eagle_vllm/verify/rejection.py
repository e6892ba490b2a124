"""Lossless (distribution-preserving) verification of draft chains and trees.

Pure torch, no vLLM imports.  The tree convention is the one documented in
:mod:`eagle_vllm.verify.greedy`.  The rules and their proofs are written out in
``docs/lossless-verification.md``; the two served here:

* :func:`tree_verify_with_draws` -- rule C: at node ``u`` draw ``y ~ p_u`` with the
  caller's sampler; if a child of ``u`` carries ``y`` move there, otherwise emit ``y``.
  Exact for ANY tree (tokens and shape) that does not depend on the verifier's random
  draws: top-k / argmax drafts, the EAGLE-2 dynamic tree, sampled drafts, anything.
  Needs no draft probabilities, and draws at the visited nodes only.
* :func:`sampled_chain_verify` -- standard speculative sampling of a chain whose drafts
  were SAMPLED from the draft distribution ``q`` of their parent, vectorised over depth.
  Using it on deterministic (argmax) drafts is NOT lossless.

Their oracles live in :mod:`eagle_vllm.verify.reference`:
``deterministic_tree_verify`` (rule C over every node's target probabilities) and
``sampled_tree_verify`` (recursive rejection sampling over sampled trees, SpecInfer /
RSD; on a chain it gives :func:`sampled_chain_verify`'s outputs).

Randomness.  Every draw for request ``b`` comes from ``generators[b]`` (``None``:
torch's default generator for that device).  Request ``b`` draws exactly
``num_nodes[b]`` float64 uniforms per call: uniform ``i >= 1`` is the acceptance coin
(or the categorical draw) at/for node ``i`` and uniform ``0`` is the final
(bonus/correction) draw.  So a seeded request's output, and its generator's state
afterwards, depend only on its own inputs -- not on the batch or its padding -- and
identical generators on every tensor-parallel rank give identical results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from eagle_vllm.verify.greedy import (
    VerifyResult,
    _check_tree_inputs,
    _draft_mask,
    _PathRecorder,
    _walk_tree,
)

__all__ = [
    "chain_parents",
    "draw_uniforms",
    "sample_from_probs",
    "sampled_chain_verify",
    "tree_verify_with_draws",
]

Generators = Sequence[torch.Generator | None] | None


# ----------------------------------------------------------------------------- helpers


def chain_parents(num_nodes: Tensor, N: int) -> Tensor:
    """Parents ``[B, N]`` of chains: ``parents[:, i] = i - 1`` for real nodes, else -1."""
    idx = torch.arange(N, device=num_nodes.device)
    par = (idx - 1).expand(num_nodes.shape[0], N)
    return torch.where(_draft_mask(num_nodes, N), par, torch.full_like(par, -1))


def draw_uniforms(
    generators: Generators, num_nodes: Tensor, N: int, device: torch.device
) -> Tensor:
    """``[B, N] float64`` uniforms in ``[0, 1)``; request ``b`` consumes exactly
    ``num_nodes[b]`` of them from ``generators[b]`` (columns beyond are filler)."""
    B = num_nodes.shape[0]
    if generators is None or all(g is None for g in generators):
        if generators is not None and len(generators) != B:
            raise ValueError(f"need one generator (or None) per request: {len(generators)} != {B}")
        return torch.rand((B, N), dtype=torch.float64, device=device)
    if len(generators) != B:
        raise ValueError(f"need one generator (or None) per request: {len(generators)} != {B}")
    u = torch.full((B, N), 0.5, dtype=torch.float64, device=device)
    unseeded = [b for b, g in enumerate(generators) if g is None]
    if unseeded:
        rows = torch.tensor(unseeded, dtype=torch.long, device=device)
        u[rows] = torch.rand((len(unseeded), N), dtype=torch.float64, device=device)
    counts = num_nodes.tolist()  # one host sync, only when some request is seeded
    for b, g in enumerate(generators):
        if g is None:
            continue
        n = max(1, min(int(counts[b]), N))
        u[b, :n] = torch.rand(n, generator=g, dtype=torch.float64, device=g.device).to(device)
    return u


# Tokens per block of the two-level inverse CDF in :func:`sample_from_probs`.
DRAW_BLOCK = 256


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw: token ``[B]`` from non-negative (unnormalised) rows ``[B, V]``
    with the given ``[B]`` uniforms in ``[0, 1)``.

    The CDF is walked in two levels: the masses of blocks of ``DRAW_BLOCK`` tokens, then
    the tokens of the one block the uniform falls in. So a draw reads each row once (a
    sum per block) instead of building a cumulative sum over the whole vocabulary, and
    costs about a softmax, where vLLM's CPU Gumbel-max hashes and takes a log at every
    token (``engine/sampler.py``, ``InverseCdfDraws``). Cumulative
    sums are float64 (a block's own mass is summed in the input's precision); a token of
    probability 0 is never returned unless the whole row is 0 (then 0: undefined)."""
    B, V = probs.shape
    target = u.to(torch.float64)
    if V <= 2 * DRAW_BLOCK:
        token, _ = _first_above(probs.to(torch.float64).clamp_min(0.0), target, scale=True)
        return token
    p = probs
    if V % DRAW_BLOCK:
        p = torch.nn.functional.pad(p, (0, DRAW_BLOCK - V % DRAW_BLOCK))
    blocks = p.view(B, -1, DRAW_BLOCK)
    block_mass = blocks.sum(dim=-1, dtype=torch.float64 if p.dtype == torch.float64 else None)
    block, rest = _first_above(block_mass.to(torch.float64).clamp_min(0.0), target, scale=True)
    # a (never valid) negative entry only shifts its block's mass; it is never returned
    inside = blocks[torch.arange(B, device=p.device), block].to(torch.float64).clamp_min(0.0)
    offset, _ = _first_above(inside, rest)
    return block * DRAW_BLOCK + offset


def _first_above(mass: Tensor, target: Tensor, scale: bool = False) -> tuple[Tensor, Tensor]:
    """Per row, the first index whose inclusive cumulative ``mass`` exceeds ``target``
    (times the row's total with ``scale``), clamped to the last index of positive mass,
    and what is left of the target past the indices before it."""
    cdf = mass.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    goal = (target.unsqueeze(1) * total) if scale else target.unsqueeze(1)
    index = torch.searchsorted(cdf, goal, right=True)
    # the goal can round up to the total: clamp to the last index of positive mass,
    # which is the first whose cdf reaches the total
    index = torch.minimum(index, torch.searchsorted(cdf, total, right=False))
    below = torch.where(index > 0, cdf.gather(1, (index - 1).clamp_min(0)), 0.0)
    return index.squeeze(1), (goal - below).squeeze(1).clamp_min(0.0)


def _compute_dtype(*ts: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _normalise(rows: Tensor) -> Tensor:
    rows = rows.clamp_min(0.0)
    s = rows.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, rows / s.clamp_min(torch.finfo(rows.dtype).tiny), rows)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """``norm(max(0, p - q))`` for normalised rows; falls back to ``p`` when the residual
    mass is 0.  That only happens when p == q, where a rejection has probability 0 for a
    draft actually drawn from q, so the fallback cannot bias (see the docs)."""
    r = (p - q).clamp_min(0.0)
    s = r.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(torch.finfo(r.dtype).tiny), p)


def _gather_rows(rows: Tensor, node: Tensor) -> Tensor:
    """``rows[b, node[b], :]`` -> ``[B, V]``."""
    B = rows.shape[0]
    return rows[torch.arange(B, device=rows.device), node]


# ----------------------------------------------------------------------------- rules


def tree_verify_with_draws(
    tokens: Tensor,
    parents: Tensor,
    num_nodes: Tensor,
    draw: Callable[[Tensor, Tensor], Tensor],
) -> VerifyResult:
    """Exact verification of candidates that do not depend on the verifier's randomness
    (rule C), with the caller's draws.

    At node ``u`` draw ``y ~ p_u``; if a child of ``u`` carries ``y`` move to the first
    such child, else stop and emit ``y``. ``draw(rows, nodes)`` returns, for each request
    ``rows[i]``, a token drawn from the target's distribution after node ``nodes[i]``,
    independently of every other draw. It is called once per depth, with the requests
    still walking only, and never twice on one node, so a draw is made for the visited
    nodes alone (at most the accepted path plus one per request, instead of a row of
    every node). Exact with any exact sampler: the glue uses vLLM's own, so a draw is the
    one vLLM would make. Oracle: :func:`eagle_vllm.verify.reference.deterministic_tree_verify`.
    """
    B, N = tokens.shape
    if parents.shape != (B, N) or num_nodes.shape != (B,):
        raise ValueError(
            f"tokens [B, N], parents [B, N] and num_nodes [B] must agree: got "
            f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(num_nodes.shape)}"
        )
    return _walk_tree(tokens, parents, num_nodes, draw, active_rows_only=True)


def sampled_chain_verify(
    tokens: Tensor,
    parents: Tensor | None,
    num_nodes: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor,
    generators: Generators = None,
) -> VerifyResult:
    """Standard speculative sampling of a chain (one child per node, each sampled from
    its parent's ``q``): accept node ``i`` with ``min(1, p(x_i)/q(x_i))`` in order,
    stop at the first rejection and draw the correction from ``norm(max(0, p - q))``
    at the rejecting parent, or the bonus from ``p`` after the last node.

    ``tokens``, ``num_nodes`` as for a tree; ``target_probs`` / ``draft_probs``
    ``[B, N, V]``: ``p`` and ``q`` after each node (normalised internally; float64 when
    either is, else float32); ``generators``: see the module docstring. ``parents`` may be
    ``None``; if given it must describe a chain (checked, one host sync).  Uses the same
    uniforms as the oracle :func:`eagle_vllm.verify.reference.sampled_tree_verify`, so
    both give identical outputs for identical generators.
    """
    B, N = tokens.shape
    if parents is None:
        parents = chain_parents(num_nodes, N)
    _check_tree_inputs(tokens, parents, num_nodes, target_probs, draft_probs)
    valid = _draft_mask(num_nodes, N)
    expect = torch.arange(N, device=parents.device) - 1
    if not bool(((parents.to(torch.long) == expect) | ~valid).all()):
        raise ValueError("sampled_chain_verify needs parents[:, i] == i - 1 for every draft node")
    device = target_probs.device
    dt = _compute_dtype(target_probs, draft_probs)
    toks = tokens.to(torch.long)
    u = draw_uniforms(generators, num_nodes, N, device)
    rec = _PathRecorder(B, N, device)

    if N > 1:
        x = toks[:, 1:].clamp(0, target_probs.shape[-1] - 1).unsqueeze(-1)  # [B, N-1, 1]
        p_par = target_probs[:, :-1]
        q_par = draft_probs[:, :-1]
        px = p_par.gather(-1, x).squeeze(-1).to(dt).clamp_min(0)
        qx = q_par.gather(-1, x).squeeze(-1).to(dt).clamp_min(0)
        ps = p_par.sum(dim=-1, dtype=dt)
        qs = q_par.sum(dim=-1, dtype=dt)
        px = torch.where(ps > 0, px / ps.clamp_min(torch.finfo(dt).tiny), 0.0)
        qx = torch.where(qs > 0, qx / qs.clamp_min(torch.finfo(dt).tiny), 0.0)
        ok = (u[:, 1:] * qx.double() < px.double()) & valid[:, 1:]
        num_acc = ok.to(torch.long).cumprod(dim=1).sum(dim=1)
    else:
        num_acc = torch.zeros(B, dtype=torch.long, device=device)
    # accepted path = nodes 1..num_acc
    for k in range(N - 1):  # cheap [B] ops; no host sync
        m = k < num_acc
        rec.accept(m, torch.full_like(num_acc, k + 1), toks[:, k + 1])
    rejected = num_acc < (num_nodes.to(torch.long).to(device) - 1)
    last = num_acc  # the node whose child was rejected, or the leaf
    p_last = _normalise(_gather_rows(target_probs, last).to(dt))
    q_last = _normalise(_gather_rows(draft_probs, last).to(dt))
    dist = torch.where(rejected.unsqueeze(1), _residual(p_last, q_last), p_last)
    final = sample_from_probs(dist, u[:, 0])
    return rec.finish(final)
