"""Reference implementations (oracles) for tests: plain, slow, obviously correct; never called when serving.

Pure torch, no vLLM imports; the tree convention of :mod:`eagle_vllm.verify.greedy`,
the rules and proofs of ``docs/lossless-verification.md``. What each one checks:

* :func:`greedy_verify` -- the argmax walk over full ``[B, N, V]`` target rows. Checks
  :func:`~eagle_vllm.verify.greedy.greedy_verify_choices` and
  :func:`~eagle_vllm.verify.greedy.greedy_walk_lists` (the serving walks, from the
  target's choice at every node); itself checked against a brute-force path search
  (``tests/unit/test_verify_greedy.py``).
* :func:`deterministic_tree_verify` -- rule C with every node's target probabilities and
  its own uniforms: at node ``u`` draw ``y ~ p_u``, move to the child carrying ``y`` or
  emit it. Checks :func:`~eagle_vllm.verify.rejection.tree_verify_with_draws` (the same
  walk with the caller's sampler, drawing at the visited nodes only), and is the rule the
  exactness and acceptance tests sample (``tests/statistical/``).
* :func:`sampled_tree_verify` -- recursive rejection sampling (SpecInfer / RSD) over a
  tree whose children were sampled from the draft ``q``. Checks
  :func:`~eagle_vllm.verify.rejection.sampled_chain_verify` (identical outputs on
  chains for identical generators) and gives the acceptance rates of rules A and B.
* :func:`position_uniforms` -- the position-keyed hash as ``[0, 1)`` uniforms. Checks
  that keys of :mod:`eagle_vllm.verify.position_rng` are uniform, independent across
  seeds, positions and domains (``tests/unit/test_position_rng.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from eagle_vllm.verify.greedy import (
    VerifyResult,
    _check_tree_inputs,
    _masked_parents,
    _PathRecorder,
    _walk_tree,
    greedy_verify_choices,
)
from eagle_vllm.verify.position_rng import DOMAIN_WALK, _shr, position_keys
from eagle_vllm.verify.rejection import (
    Generators,
    _compute_dtype,
    _gather_rows,
    _normalise,
    _residual,
    draw_uniforms,
    sample_from_probs,
)

__all__ = [
    "deterministic_tree_verify",
    "greedy_verify",
    "position_uniforms",
    "sampled_tree_verify",
]


def greedy_verify(
    tokens: Tensor, parents: Tensor, num_nodes: Tensor, target_logits: Tensor
) -> VerifyResult:
    """Greedy (argmax) verification: the longest path the target's argmax agrees with.

    At node ``u`` the target's choice is ``y = argmax(target_logits[:, u])``; if a child
    of ``u`` carries ``y`` the walk moves there, otherwise it stops and ``y`` is the
    bonus token.  ``target_logits`` may be logits or probabilities (only the argmax is
    used; ties go to the lowest token id, like ``torch.argmax``).

    Args:
        tokens: ``[B, N] int64`` node tokens (root at 0, ``-1`` padding).
        parents: ``[B, N] int64`` parent indices (``-1`` for root and padding).
        num_nodes: ``[B] int64`` nodes per tree including the root.
        target_logits: ``[B, N, V]`` target logits/probs after each node.
    """
    _check_tree_inputs(tokens, parents, num_nodes, target_logits)
    # [B, N]: cheap, so do every node at once
    return greedy_verify_choices(tokens, parents, num_nodes, target_logits.argmax(dim=-1))


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

    The draw at node ``u`` uses uniform ``u`` of the request (see
    :mod:`eagle_vllm.verify.rejection`).
    :func:`tree_verify_with_draws` is the same rule with the draws left to the caller.
    """
    _check_tree_inputs(tokens, parents, num_nodes, target_probs)
    B, N = tokens.shape
    u = draw_uniforms(generators, num_nodes, N, target_probs.device)

    def choose(cur: Tensor) -> Tensor:
        coin = u.gather(1, cur.unsqueeze(1)).squeeze(1)
        return sample_from_probs(_gather_rows(target_probs, cur), coin)

    return _walk_tree(tokens, parents, num_nodes, choose)


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


def position_uniforms(seeds: Tensor, positions: Tensor, domain: int = DOMAIN_WALK) -> Tensor:
    """float64 uniforms in [0, 1), one per (seed, position), 53 random bits each."""
    bits = _shr(position_keys(seeds, positions, domain), 11)
    return bits.to(torch.float64) * (1.0 / (1 << 53))
