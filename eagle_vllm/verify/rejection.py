"""Lossless (distribution-preserving) verification of draft chains and trees.

Pure torch, no vLLM imports.  The tree convention is the one documented in
:mod:`eagle_vllm.verify.greedy`.  The rules and their proofs are written out in
``docs/lossless-verification.md``; in short:

* :func:`deterministic_tree_verify` -- at node ``u`` draw ``y ~ p_u``; if a child of
  ``u`` carries ``y`` move there, otherwise emit ``y``.  Exact for ANY tree (tokens
  and shape) that does not depend on the verifier's random draws: top-k / argmax
  drafts, the EAGLE-2 dynamic tree, sampled drafts, anything.  Needs no draft
  probabilities.  :func:`tree_verify_with_draws` is the same walk with the caller's
  sampler, drawing at the visited nodes only.
* :func:`sampled_tree_verify` -- recursive rejection sampling (SpecInfer / RSD) for
  children SAMPLED from the draft distribution ``q`` of their parent:
  ``replacement=True``: siblings are i.i.d. draws from ``q``;
  ``replacement=False``: siblings are drawn sequentially without replacement
  (each from ``q`` with the earlier siblings removed and renormalised).
  Using it on deterministic (top-k) children is NOT lossless.
* :func:`sampled_chain_verify` -- the single-child case (standard speculative
  sampling), vectorised over depth.

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
    _masked_parents,
    _PathRecorder,
    _walk_tree,
)

__all__ = [
    "deterministic_tree_verify",
    "tree_verify_with_draws",
    "sampled_chain_verify",
    "sampled_tree_verify",
    "chain_parents",
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


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw: token ``[B]`` from non-negative (unnormalised) rows ``[B, V]``
    with the given ``[B]`` uniforms in ``[0, 1)``.  Computed in float64; a token of
    probability 0 is never returned unless the whole row is 0 (then 0: undefined)."""
    p = probs.to(torch.float64).clamp_min(0.0)
    cdf = p.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    tok = torch.searchsorted(cdf, u.to(torch.float64).unsqueeze(1) * total, right=True)
    # u * total can round up to the total: clamp to the last token of positive mass,
    # which is the first index whose cdf reaches the total
    last_pos = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(tok, last_pos).squeeze(1)


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


def _child_links(parents: Tensor, num_nodes: Tensor) -> tuple[Tensor, Tensor]:
    """``first_child [B, N]`` and ``next_sibling [B, N]`` (``-1`` when none), siblings
    ordered by node index.  One backwards scan over the N slots (no [B, N, N])."""
    B, N = parents.shape
    par = _masked_parents(parents, num_nodes)  # -2 for root/padding
    slot = torch.where(par >= 0, par, N)  # padding writes to a dummy column N
    first = torch.full((B, N + 1), -1, dtype=torch.long, device=parents.device)
    nxt = torch.full((B, N), -1, dtype=torch.long, device=parents.device)
    for i in range(N - 1, 0, -1):
        s = slot[:, i : i + 1]
        # scanning downwards, first[s] holds the smallest j > i under the same parent
        nxt[:, i] = first.gather(1, s).squeeze(1)
        first.scatter_(1, s, i)
    next_sibling = torch.where(par >= 0, nxt, -1)
    return first[:, :N].contiguous(), next_sibling


def _gather_rows(rows: Tensor, node: Tensor) -> Tensor:
    """``rows[b, node[b], :]`` -> ``[B, V]``."""
    B = rows.shape[0]
    return rows[torch.arange(B, device=rows.device), node]


# ----------------------------------------------------------------------------- rules


def deterministic_tree_verify(
    tokens: Tensor,
    parents: Tensor,
    num_nodes: Tensor,
    target_probs: Tensor,
    generators: Generators = None,
) -> VerifyResult:
    """Exact verification of candidates that do not depend on the verifier's randomness
    (top-k / argmax drafts, EAGLE-2 dynamic trees; sampled drafts are fine too).

    At node ``u`` draw ``y ~ p_u`` (``target_probs[:, u]``, normalised internally);
    if a child of ``u`` carries ``y`` move to the first such child, else stop and emit
    ``y``.  The emitted tokens are then distributed exactly as the target samples
    them.  This equals SGLang's / SafeAILab's sequential target-only rule ("accept
    sibling x with p(x), else zero it out and renormalise") at thresholds 1.

    The draw at node ``u`` uses uniform ``u`` of the request (see module docstring).
    :func:`tree_verify_with_draws` is the same rule with the draws left to the caller.
    """
    _check_tree_inputs(tokens, parents, num_nodes, target_probs)
    B, N = tokens.shape
    u = draw_uniforms(generators, num_nodes, N, target_probs.device)

    def choose(cur: Tensor) -> Tensor:
        coin = u.gather(1, cur.unsqueeze(1)).squeeze(1)
        return sample_from_probs(_gather_rows(target_probs, cur), coin)

    return _walk_tree(tokens, parents, num_nodes, choose)


def tree_verify_with_draws(
    tokens: Tensor,
    parents: Tensor,
    num_nodes: Tensor,
    draw: Callable[[Tensor, Tensor], Tensor],
) -> VerifyResult:
    """:func:`deterministic_tree_verify` with the caller's draws: ``draw(rows, nodes)``
    returns, for each request ``rows[i]``, a token drawn from the target's distribution
    after node ``nodes[i]``, independently of every other draw. It is called once per
    depth, with the requests still walking only, and never twice on one node, so
    a draw is made for the visited nodes alone (at most the accepted path plus one per
    request, instead of a row of every node). Exact for the same trees, with any exact
    sampler: the glue uses vLLM's own, so a draw is the one vLLM would make.
    """
    B, N = tokens.shape
    if parents.shape != (B, N) or num_nodes.shape != (B,):
        raise ValueError(
            f"tokens [B, N], parents [B, N] and num_nodes [B] must agree: got "
            f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(num_nodes.shape)}"
        )
    return _walk_tree(tokens, parents, num_nodes, draw, active_rows_only=True)


def sampled_tree_verify(
    tokens: Tensor,
    parents: Tensor,
    num_nodes: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor,
    replacement: bool,
    generators: Generators = None,
) -> VerifyResult:
    """Recursive rejection sampling over a tree whose children were SAMPLED from the
    draft distribution ``q_u = draft_probs[:, u]`` of their parent ``u``.

    At node ``u`` with children ``x_1, x_2, ...`` (index order) and ``p_1 = p_u``:
    accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))`` (then continue at
    that child); on rejection ``p_{i+1} = norm(max(0, p_i - q_i))``.  If every child
    is rejected (or there are none) the final token is drawn from the current
    residual ``p_{k+1}``.

    ``replacement=True`` (SpecInfer, i.i.d. siblings): ``q_i = q_u``; duplicate
    siblings are allowed and handled exactly.  ``replacement=False`` (RSD, siblings
    drawn without replacement): ``q_i`` is ``q_u`` with the earlier siblings zeroed and
    renormalised.

    Outside the sampling contract (documented, not exact): a sibling with
    ``q_i(x) = 0`` is accepted iff ``p_i(x) > 0`` (``min(1, p/0)``); with
    ``replacement=False`` a duplicate sibling, or one met after ``q`` is exhausted, is
    skipped.  Rows are normalised internally; the computation runs in float64 when
    any probability input is float64, else float32.
    """
    _check_tree_inputs(tokens, parents, num_nodes, target_probs, draft_probs)
    B, N = tokens.shape
    V = target_probs.shape[-1]
    device = target_probs.device
    dt = _compute_dtype(target_probs, draft_probs)
    ar = torch.arange(B, device=device)
    toks = tokens.to(torch.long)
    u = draw_uniforms(generators, num_nodes, N, device)
    first_child, next_sibling = _child_links(parents, num_nodes)

    rec = _PathRecorder(B, N, device)
    p_cur = _normalise(target_probs[:, 0].to(dt))  # residual target at the current node
    q_base = _normalise(draft_probs[:, 0].to(dt))  # draft distribution at the current node
    tried = torch.zeros((B, V), dtype=torch.bool, device=device)  # siblings rejected here
    cand = first_child[:, 0].clone()  # candidate child under examination, -1: none left
    active = torch.ones(B, dtype=torch.bool, device=device)
    final = torch.zeros(B, dtype=torch.long, device=device)
    zero = torch.zeros((), dtype=dt, device=device)

    for _ in range(N + 1):  # each row examines each node at most once, then finishes
        has = cand >= 0
        fin = active & ~has
        if bool(fin.any()):
            y = sample_from_probs(p_cur, u[:, 0])
            final = torch.where(fin, y, final)
        active = active & has
        if not bool(active.any()):
            break
        c = cand.clamp_min(0)
        x = toks.gather(1, c.unsqueeze(1)).squeeze(1).clamp(0, V - 1)  # guard padding/root
        if replacement:
            q_i = q_base
            skip = torch.zeros_like(active)
        else:
            q_masked = torch.where(tried, zero, q_base)
            mass = q_masked.sum(dim=-1, keepdim=True)
            q_i = torch.where(mass > 0, q_masked / mass.clamp_min(torch.finfo(dt).tiny), zero)
            skip = tried.gather(1, x.unsqueeze(1)).squeeze(1) | (mass.squeeze(1) <= 0)
        px = p_cur.gather(1, x.unsqueeze(1)).squeeze(1).double()
        qx = q_i.gather(1, x.unsqueeze(1)).squeeze(1).double()
        coin = u.gather(1, c.unsqueeze(1)).squeeze(1)  # float64
        # P(coin * q < p) = min(1, p / q) for q > 0; for q == 0 it is [p > 0]
        ok = coin * qx < px
        acc = active & ~skip & ok
        rej = active & ~skip & ~ok
        mov = active & skip

        rec.accept(acc, c, toks[ar, c])
        p_next = _normalise(_gather_rows(target_probs, c).to(dt))
        q_next = _normalise(_gather_rows(draft_probs, c).to(dt))
        p_cur = torch.where(
            acc.unsqueeze(1), p_next, torch.where(rej.unsqueeze(1), _residual(p_cur, q_i), p_cur)
        )
        q_base = torch.where(acc.unsqueeze(1), q_next, q_base)
        tried = tried & ~acc.unsqueeze(1)
        tried.scatter_(1, x.unsqueeze(1), tried.gather(1, x.unsqueeze(1)) | rej.unsqueeze(1))
        nxt = next_sibling[ar, c]
        cand = torch.where(acc, first_child[ar, c], torch.where(rej | mov, nxt, cand))
    return rec.finish(final)


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

    Same arguments as :func:`sampled_tree_verify` (``replacement`` is meaningless for a
    single child).  ``parents`` may be ``None``; if given it must describe a chain
    (checked, one host sync).  Uses the same uniforms as the tree version, so both
    give identical outputs for identical generators.
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
