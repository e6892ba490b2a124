"""Exactness of the stochastic verification rules (and power of the check itself).

The target model is a function from token prefix to a next-token distribution, stored
as a table ``P[code(prefix)]`` (``Q`` for the draft).  For each trial we draft a tree
(children sampled from q i.i.d. / without replacement, or top-k), give every node the
target row of its own prefix, verify, and read the first two emitted tokens (if only
one was emitted, the second is sampled from the target given the first, as the next
decoding step would).  Their empirical joint law over ``V**2`` cells must match
``P(t1) P(t2 | t1)``:

* no sample in a zero-probability cell;
* TV(empirical, reference) <= 0.5*sqrt(K/n) + sqrt(ln(1/delta)/(2n)), delta = 1e-6
  (K non-zero cells, n samples).  The first term bounds E[TV] (Cauchy-Schwarz), the
  second is McDiarmid's deviation (TV changes by <= 1/n per sample), so a correct rule
  fails it with probability <= 1e-6;
* chi-square goodness of fit (cells with expected count < 5 pooled) p-value > 1e-4.

Deliberately wrong rules must fail the very same check.  Everything is seeded.
Run ``PYTHONPATH=. python tests/statistical/test_rejection_exact.py`` to print the
acceptance-length table quoted in docs/lossless-verification.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from scipy import stats

from eagle_vllm.verify import (
    VerifyResult,
    chain_parents,
    sampled_chain_verify,
    tree_verify_with_draws,
)
from eagle_vllm.verify.reference import deterministic_tree_verify, sampled_tree_verify

torch.set_num_threads(1)

N_SAMPLES = 200_000
P_VALUE_MIN = 1e-4
DELTA = 1e-6
ROOT_TOKEN = 0

# ----------------------------------------------------------------------------- models


@dataclass
class Model:
    """Target P and draft Q as tables indexed by prefix code (root/empty prefix = 0;
    child code = parent_code * (V + 1) + token + 1)."""

    V: int
    P: torch.Tensor  # [C, V] float64
    Q: torch.Tensor  # [C, V] float64

    def child(self, code: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return code * (self.V + 1) + tok + 1


def categorical(probs: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of (unnormalised) probs via the exponential race argmax p/E
    (independent of the production sampler; zero-probability tokens never win)."""
    e = -torch.rand(probs.shape, dtype=torch.float64, generator=gen).log()  # Exp(1)
    return (probs / e).argmax(-1)


def _peaky(shape, gen, power):
    e = torch.empty(shape, dtype=torch.float64).exponential_(generator=gen)
    w = e**power
    return w / w.sum(-1, keepdim=True)


def make_model(V: int, depth: int, kind: str, seed: int, min_q_support: int = 1) -> Model:
    """Tables for prefixes of length < depth+1.

    kind: 'close' (q ~ p), 'far' (independent peaky q), 'zeros' (far, plus q = 0 on
    ~40% of the tokens where p > 0 and p = 0 on ~30% of the tokens where q > 0).
    """
    gen = torch.Generator().manual_seed(seed)
    C = (V + 1) ** depth
    P = _peaky((C, V), gen, 2.0)
    if kind == "close":
        Q = P * torch.empty((C, V), dtype=torch.float64).uniform_(0.7, 1.3, generator=gen)
        Q = Q / Q.sum(-1, keepdim=True)
    else:
        Q = _peaky((C, V), gen, 2.5)
    if kind == "zeros":
        # q = 0 on some tokens (keep at least min_q_support tokens with q > 0)
        r = torch.rand((C, V), generator=gen)
        keep_rank = r.argsort(-1).argsort(-1) < min_q_support
        q_zero = (r < 0.4) & ~keep_rank
        Q = torch.where(q_zero, 0.0, Q)
        Q = Q / Q.sum(-1, keepdim=True)
        # p = 0 on some tokens where q > 0 (keep at least one token with p > 0)
        r2 = torch.rand((C, V), generator=gen)
        p_zero = (r2 < 0.3) & ~q_zero & (r2 > r2.min(-1, keepdim=True).values)
        P = torch.where(p_zero, 0.0, P)
        P = P / P.sum(-1, keepdim=True)
        assert (P.sum(-1) > 0).all() and ((Q > 0).sum(-1) >= min_q_support).all()
        assert ((P > 0) & (Q == 0)).any() and ((Q > 0) & (P == 0)).any()
    return Model(V, P, Q)


# ----------------------------------------------------------------------------- drafting


@dataclass
class Batch:
    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    target: torch.Tensor
    draft: torch.Tensor


def draft_batch(
    model: Model, shape: list[int], mode: str, n: int, gen: torch.Generator, truncate: bool
) -> Batch:
    """Draft n trees of the given shape (parents list, topological).

    mode: 'iid' (children i.i.d. from q of the parent), 'norep' (sequentially without
    replacement from q), 'topk' (j-th child = j-th most likely token under q, stable),
    'uniform_norep' (without replacement from the uniform law: unrelated to q).
    truncate: each trial keeps a random topological prefix of the tree (1..N nodes),
    and the padding is filled with garbage.
    """
    N, V = len(shape), model.V
    ar = torch.arange(n)
    tokens = torch.full((n, N), ROOT_TOKEN, dtype=torch.long)
    codes = torch.zeros((n, N), dtype=torch.long)
    for i in range(1, N):
        u = shape[i]
        sibs = [j for j in range(1, i) if shape[j] == u]
        q = model.Q[codes[:, u]]
        if mode == "iid":
            tok = categorical(q, gen)
        elif mode in ("norep", "uniform_norep"):
            w = q.clone() if mode == "norep" else torch.ones_like(q)
            for j in sibs:
                w[ar, tokens[:, j]] = 0.0
            tok = categorical(w, gen)
        elif mode == "topk":
            order = torch.sort(q, dim=-1, descending=True, stable=True).indices
            tok = order[:, len(sibs)]
        else:
            raise ValueError(mode)
        tokens[:, i] = tok
        codes[:, i] = model.child(codes[:, u], tok)
    parents = torch.tensor(shape, dtype=torch.long).expand(n, N).clone()
    if truncate:
        num_nodes = torch.randint(1, N + 1, (n,), generator=gen)
        pad = torch.arange(N) >= num_nodes.unsqueeze(1)
        tokens = torch.where(pad, torch.randint(0, V, (n, N), generator=gen), tokens)
        parents = torch.where(pad, 0, parents)
        # garbage rows for the padding: the rows of random other prefixes
        junk = torch.randint(0, model.P.shape[0], (n, N), generator=gen)
        target, draft = (
            model.P[torch.where(pad, junk, codes)],
            model.Q[torch.where(pad, junk.flip(1), codes)],
        )
    else:
        num_nodes = torch.full((n,), N, dtype=torch.long)
        target, draft = model.P[codes], model.Q[codes]
    return Batch(tokens, parents, num_nodes, target, draft)


# ----------------------------------------------------------------------------- the check


@dataclass
class Check:
    tv: float
    bound: float
    pvalue: float
    zero_violations: int

    @property
    def ok(self) -> bool:
        return self.zero_violations == 0 and self.tv <= self.bound and self.pvalue > P_VALUE_MIN


def goodness(counts: torch.Tensor, ref: torch.Tensor) -> Check:
    counts, ref = counts.double().flatten(), ref.double().flatten()
    n = counts.sum().item()
    support = ref > 0
    zero_violations = int(counts[~support].sum().item())
    tv = 0.5 * (counts / n - ref).abs().sum().item()
    K = int(support.sum().item())
    bound = 0.5 * math.sqrt(K / n) + math.sqrt(math.log(1 / DELTA) / (2 * n))
    exp, obs = n * ref[support], counts[support]
    small = exp < 5
    if small.any():
        exp = torch.cat([exp[~small], exp[small].sum().view(1)])
        obs = torch.cat([obs[~small], obs[small].sum().view(1)])
    stat = ((obs - exp) ** 2 / exp).sum().item()
    pvalue = float(stats.chi2.sf(stat, max(len(exp) - 1, 1)))
    return Check(tv, bound, pvalue, zero_violations)


def first_two_tokens(model: Model, res: VerifyResult, gen: torch.Generator) -> torch.Tensor:
    out = res.output_tokens
    t1 = out[:, 0]
    nxt = categorical(model.P[model.child(torch.zeros_like(t1), t1)], gen)
    t2 = torch.where(res.num_accepted >= 1, out[:, 1], nxt)
    assert (t1 >= 0).all() and (t2 >= 0).all()
    return torch.stack([t1, t2], 1)


def run_check(model, shape, mode, verify, seed, n=N_SAMPLES, truncate=True):
    """Draft, verify with ``verify(batch) -> VerifyResult`` and check the joint law of
    the first one and two emitted tokens.  Returns (check_1token, check_2tokens)."""
    gen = torch.Generator().manual_seed(seed)
    batch = draft_batch(model, shape, mode, n, gen, truncate)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)  # verifiers below draw from the default generator
        res = verify(batch)
    _check_result_layout(res, batch)
    tt = first_two_tokens(model, res, gen)
    V = model.V
    p1 = model.P[0]
    p2 = model.P[model.child(torch.zeros(V, dtype=torch.long), torch.arange(V))]
    c1 = torch.bincount(tt[:, 0], minlength=V)
    c2 = torch.bincount(tt[:, 0] * V + tt[:, 1], minlength=V * V)
    return goodness(c1, p1), goodness(c2, p1.unsqueeze(1) * p2)


def _check_result_layout(res: VerifyResult, b: Batch):
    n, N = b.tokens.shape
    na = res.num_accepted
    assert res.accepted_nodes.shape == (n, N - 1) and res.output_tokens.shape == (n, N)
    assert (na >= 0).all() and (na <= b.num_nodes - 1).all()
    col = torch.arange(N)
    assert ((res.output_tokens >= 0) == (col <= na.unsqueeze(1))).all()
    assert ((res.accepted_nodes >= 0) == (col[:-1] < na.unsqueeze(1))).all()
    # accepted nodes form a root path of real nodes and their tokens are emitted
    prev = torch.zeros(n, dtype=torch.long)
    for k in range(N - 1):
        m = k < na
        node = res.accepted_nodes[:, k].clamp_min(0)
        assert (b.parents.gather(1, node.unsqueeze(1)).squeeze(1)[m] == prev[m]).all()
        assert (node[m] < b.num_nodes[m]).all()
        assert (
            b.tokens.gather(1, node.unsqueeze(1)).squeeze(1)[m] == res.output_tokens[m, k]
        ).all()
        prev = torch.where(m, node, prev)


def assert_exact(checks):
    for c in checks:
        assert c.ok, c


def assert_detected(checks):
    assert not all(c.ok for c in checks), checks


# ----------------------------------------------------------------------------- verifiers


def v_chain(b: Batch):
    return sampled_chain_verify(b.tokens, b.parents, b.num_nodes, b.target, b.draft)


def v_tree(replacement: bool):
    def f(b: Batch):
        return sampled_tree_verify(b.tokens, b.parents, b.num_nodes, b.target, b.draft, replacement)

    return f


def v_det(b: Batch):
    return deterministic_tree_verify(b.tokens, b.parents, b.num_nodes, b.target)


def v_draws(sample: bool = True):
    """Rule C with the caller's draws (what engine/sampler.py does with vLLM's sampler):
    a categorical draw from the visited node's target row; ``sample=False`` takes the
    row's argmax instead (a wrong "draw" the check must catch)."""

    def f(b: Batch):
        def draw(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            p = b.target[rows, nodes]
            return torch.multinomial(p, 1).view(-1) if sample else p.argmax(dim=-1)

        return tree_verify_with_draws(b.tokens, b.parents, b.num_nodes, draw)

    return f


def reference_rss(accept_with_p: bool = False, forget: bool = False):
    """Independent, test-side recursive rejection sampling with replacement (fixed tree
    shape), with optional deliberate bugs:

    accept_with_p: accept a sampled child with probability p(x) instead of
        min(1, p(x)/q(x)) (residual still norm(max(0, p - q))).
    forget: the residual after each rejection is built from the node's ORIGINAL target
        p instead of the running residual, i.e. it forgets earlier rejected siblings.
    """

    def f(b: Batch) -> VerifyResult:
        n, N = b.tokens.shape
        shape = b.parents[int(b.num_nodes.argmax())].tolist()  # an untruncated row
        children = {u: [i for i in range(1, N) if shape[i] == u] for u in range(N)}
        ar = torch.arange(n)
        out = torch.full((n, N + 1), -1, dtype=torch.long)
        acc_nodes = torch.full((n, N), -1, dtype=torch.long)
        na = torch.zeros(n, dtype=torch.long)
        cur = torch.zeros(n, dtype=torch.long)
        active = torch.ones(n, dtype=torch.bool)
        while active.any():
            moved = torch.zeros(n, dtype=torch.bool)
            new_cur = cur.clone()
            for u in range(N):
                rows = active & (cur == u)
                if not rows.any():
                    continue
                p = b.target[:, u].clone()
                p0, q = p.clone(), b.draft[:, u]
                decided = ~rows
                for c in children[u]:
                    x = b.tokens[:, c]
                    live = ~decided & (c < b.num_nodes)
                    px, qx = p[ar, x], q[ar, x]
                    prob = px if accept_with_p else torch.where(qx > 0, (px / qx).clamp(max=1), 1.0)
                    acc = live & (torch.rand(n, dtype=torch.float64) < prob)
                    rej = live & ~acc
                    new_cur = torch.where(acc, c, new_cur)
                    moved |= acc
                    r = ((p0 if forget else p) - q).clamp_min(0)
                    s = r.sum(-1, keepdim=True)
                    r = torch.where(s > 0, r / s.clamp_min(1e-300), p)
                    p = torch.where(rej.unsqueeze(1), r, p)
                    decided |= acc
                fin = ~decided
                y = categorical(p)
                out[ar, torch.where(fin, na, N)] = torch.where(
                    fin, y, out[ar, torch.where(fin, na, N)]
                )
            out[ar, torch.where(moved, na, N)] = torch.where(
                moved, b.tokens[ar, new_cur], out[ar, torch.where(moved, na, N)]
            )
            acc_nodes[ar, torch.where(moved, na, N - 1)] = torch.where(
                moved, new_cur, acc_nodes[ar, torch.where(moved, na, N - 1)]
            )
            na += moved.long()
            cur, active = new_cur, moved
        acc_nodes[:, N - 1] = -1
        return VerifyResult(acc_nodes[:, : N - 1], na, out[:, :N])

    return f


# ----------------------------------------------------------------------------- shapes

CHAIN4 = [-1, 0, 1, 2]  # 3 drafts, depth 3
WIDE = [-1, 0, 0, 0, 0]  # 4 siblings at the root
# depth 3: root has 3 children; first child 2 children (one with 2 more); second 1
TREE_A = [-1, 0, 0, 0, 1, 1, 2, 4, 4]
# depth 2, bushy: 3 + 3 + 2
TREE_B = [-1, 0, 0, 0, 1, 1, 1, 2, 2]


# ----------------------------------------------------------------------------- exact rules


@pytest.mark.parametrize("kind", ["far", "zeros"])
def test_chain_speculative_sampling_exact(kind):
    model = make_model(6, 3, kind, seed=10)
    assert_exact(run_check(model, CHAIN4, "iid", v_chain, seed=11))


def test_chain_via_tree_rule_exact():
    model = make_model(5, 3, "far", seed=12)
    assert_exact(run_check(model, CHAIN4, "iid", v_tree(True), seed=13))


@pytest.mark.parametrize(
    ("kind", "shape", "V"),
    [("far", TREE_A, 5), ("zeros", TREE_B, 6), ("close", WIDE, 8), ("far", WIDE, 5)],
)
def test_tree_with_replacement_exact(kind, shape, V):
    # small V and peaky q: duplicate siblings are frequent
    model = make_model(V, 3, kind, seed=20 + V)
    assert_exact(run_check(model, shape, "iid", v_tree(True), seed=21 + V))


@pytest.mark.parametrize(
    ("kind", "shape", "V", "mode"),
    [
        ("far", TREE_A, 5, "norep"),
        ("zeros", TREE_B, 7, "norep"),
        ("far", WIDE, 6, "norep"),
        # i.i.d. siblings are fine too: skipping duplicates, each NEW sibling is
        # distributed as q without the tokens already tried
        ("far", WIDE, 5, "iid"),
    ],
)
def test_tree_without_replacement_exact(kind, shape, V, mode):
    model = make_model(V, 3, kind, seed=30 + V, min_q_support=4)
    assert_exact(run_check(model, shape, mode, v_tree(False), seed=31 + V))


@pytest.mark.parametrize(
    ("mode", "kind", "shape"),
    [
        ("topk", "far", TREE_A),
        ("topk", "zeros", WIDE),
        ("topk", "far", CHAIN4),  # argmax draft chain
        ("iid", "far", TREE_B),  # any candidates work, even sampled duplicates
        ("uniform_norep", "zeros", TREE_A),
    ],
)
def test_deterministic_rule_exact(mode, kind, shape):
    model = make_model(6, 3, kind, seed=40, min_q_support=4)
    assert_exact(run_check(model, shape, mode, v_det, seed=41))


@pytest.mark.parametrize(
    ("mode", "kind", "shape"), [("topk", "far", TREE_A), ("iid", "zeros", TREE_B)]
)
def test_rule_with_callers_draws_exact(mode, kind, shape):
    model = make_model(6, 3, kind, seed=42, min_q_support=4)
    assert_exact(run_check(model, shape, mode, v_draws(), seed=43))


def test_reference_implementation_is_exact():
    """Positive control: the test-side implementation used for the mutants passes."""
    model = make_model(5, 3, "far", seed=50)
    assert_exact(run_check(model, WIDE, "iid", reference_rss(), seed=51, n=100_000))


# ----------------------------------------------------------------------------- the check has power


def test_detects_accept_with_p_instead_of_ratio():
    model = make_model(6, 3, "far", seed=60)
    assert_detected(
        run_check(model, CHAIN4, "iid", reference_rss(accept_with_p=True), seed=61, n=100_000)
    )


def test_detects_residual_forgetting_earlier_siblings():
    model = make_model(5, 3, "far", seed=62)
    assert_detected(run_check(model, WIDE, "iid", reference_rss(forget=True), seed=63, n=100_000))


def test_detects_topk_drafts_treated_as_sampled():
    model = make_model(6, 3, "close", seed=64, min_q_support=4)
    for rep in (False, True):
        assert_detected(run_check(model, TREE_A, "topk", v_tree(rep), seed=65, n=100_000))


def test_detects_argmax_in_place_of_the_callers_draw():
    model = make_model(6, 3, "far", seed=68, min_q_support=4)
    assert_detected(run_check(model, TREE_A, "topk", v_draws(sample=False), seed=69, n=100_000))


def test_detects_mismatched_replacement_assumption():
    model = make_model(5, 3, "far", seed=66, min_q_support=4)
    # drafts without replacement verified as if i.i.d.
    assert_detected(run_check(model, WIDE, "norep", v_tree(True), seed=67, n=100_000))


# ----------------------------------------------------------------------------- edge cases


def _one(tokens, parents, target, draft, num_nodes=None):
    tokens = torch.tensor([tokens])
    parents = torch.tensor([parents])
    target = torch.tensor([target], dtype=torch.float64)
    draft = torch.tensor([draft], dtype=torch.float64)
    nn = torch.tensor([tokens.shape[1]]) if num_nodes is None else torch.tensor([num_nodes])
    return tokens, parents, nn, target, draft


def _repeat(args, n):
    return [a.expand(n, *a.shape[1:]).contiguous() for a in args]


def test_p_equals_q_accepts_everything():
    gen = torch.Generator().manual_seed(0)
    B, N, V = 500, 5, 7
    p = _peaky((B, N, V), gen, 2.0)
    tokens = torch.zeros((B, N), dtype=torch.long)
    for i in range(1, N):
        tokens[:, i] = torch.multinomial(p[:, i - 1], 1, generator=gen).squeeze(1)
    nn = torch.full((B,), N)
    for res in (
        sampled_chain_verify(tokens, None, nn, p, p),
        sampled_tree_verify(tokens, chain_parents(nn, N), nn, p, p, True),
        sampled_tree_verify(tokens, chain_parents(nn, N), nn, p, p, False),
    ):
        assert (res.num_accepted == N - 1).all()


def test_q_zero_and_p_zero_conventions():
    n = 2000
    # proposed token 1 has q = 0 (contract violation) and p > 0: always accepted
    t = _one([0, 1], [-1, 0], [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], [[1.0, 0.0, 0.0], [1, 0, 0]])
    for f in (
        lambda *a: sampled_chain_verify(*a),
        lambda *a: sampled_tree_verify(*a, True),
        lambda *a: sampled_tree_verify(*a, False),
    ):
        tok, par, nn, tp, dp = _repeat(t, n)
        res = f(tok, par, nn, tp, dp)
        assert (res.num_accepted == 1).all() and (res.output_tokens[:, 1] == 0).all()
    # proposed token 2 has p = 0: never accepted; correction from norm(max(0, p - q))
    t = _one([0, 2], [-1, 0], [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], [[0.5, 0.0, 0.5], [1, 0, 0]])
    for f in (lambda *a: sampled_chain_verify(*a), lambda *a: sampled_tree_verify(*a, True)):
        res = f(*_repeat(t, n))
        assert (res.num_accepted == 0).all() and (res.output_tokens[:, 0] == 1).all()


def test_zero_residual_falls_back_to_target():
    # p == q, but the draft "proposed" a token with q = p = 0: rejected, residual is 0,
    # the correction is drawn from p itself and never from a zero-probability token
    n = 4000
    p = [[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]]
    t = _one([0, 2], [-1, 0], p, p)
    res = sampled_chain_verify(*_repeat(t, n))
    assert (res.num_accepted == 0).all()
    frac = (res.output_tokens[:, 0] == 1).double().mean().item()
    assert set(res.output_tokens[:, 0].tolist()) == {0, 1} and abs(frac - 0.75) < 0.05
    res = sampled_tree_verify(*_repeat(t, n), True)
    assert set(res.output_tokens[:, 0].tolist()) == {0, 1}


def test_without_replacement_skips_duplicate_siblings():
    gen = torch.Generator().manual_seed(5)
    V = 6
    p = _peaky((1, 3, V), gen, 1.0)
    q = _peaky((1, 3, V), gen, 1.0)
    dup = sampled_tree_verify(
        torch.tensor([[0, 3, 3]]),
        torch.tensor([[-1, 0, 0]]),
        torch.tensor([3]),
        p,
        q,
        False,
        [torch.Generator().manual_seed(s) for s in [7]],
    )
    single = sampled_tree_verify(
        torch.tensor([[0, 3, -1]]),
        torch.tensor([[-1, 0, -1]]),
        torch.tensor([2]),
        p,
        q,
        False,
        [torch.Generator().manual_seed(s) for s in [7]],
    )
    # uniform 0 (final draw) and 1 (coin of node 1) coincide; node 2 is skipped
    assert dup.output_tokens[0, :2].tolist() == single.output_tokens[0, :2].tolist()


# ----------------------------------------------------------------------------- seeds


def _seeded_inputs(seed, B=6, N=9, V=7):
    gen = torch.Generator().manual_seed(seed)
    model = make_model(V, 3, "far", seed=seed)
    return draft_batch(model, TREE_A, "iid", B, gen, truncate=True), model


RULES = {
    "det": lambda b, g: deterministic_tree_verify(b.tokens, b.parents, b.num_nodes, b.target, g),
    "rep": lambda b, g: sampled_tree_verify(
        b.tokens, b.parents, b.num_nodes, b.target, b.draft, True, g
    ),
    "norep": lambda b, g: sampled_tree_verify(
        b.tokens, b.parents, b.num_nodes, b.target, b.draft, False, g
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_same_seed_same_output_and_batch_independence(rule):
    f = RULES[rule]
    b, _ = _seeded_inputs(70, B=40)
    gens = lambda: [torch.Generator().manual_seed(1000 + i) for i in range(40)]  # noqa: E731
    r1, r2 = f(b, gens()), f(b, gens())
    assert torch.equal(r1.output_tokens, r2.output_tokens)
    assert torch.equal(r1.accepted_nodes, r2.accepted_nodes)
    # different seeds do give different outputs somewhere
    r3 = f(b, [torch.Generator().manual_seed(5000 + i) for i in range(40)])
    assert not torch.equal(r1.output_tokens, r3.output_tokens)
    # each request alone (seeded identically) equals its row in the batch, and
    # also when padded to a wider tree with garbage and mixed with unseeded rows
    for i in (0, 13, 39):
        one = Batch(*(t[i : i + 1] for t in (b.tokens, b.parents, b.num_nodes, b.target, b.draft)))
        g = torch.Generator().manual_seed(1000 + i)
        alone = f(one, [g])
        after_alone = torch.rand(1, generator=g)
        assert torch.equal(alone.output_tokens, r1.output_tokens[i : i + 1])
        wide = Batch(
            torch.cat([one.tokens, torch.full((1, 4), 3)], 1).expand(3, -1).contiguous(),
            torch.cat([one.parents, torch.zeros((1, 4), dtype=torch.long)], 1)
            .expand(3, -1)
            .contiguous(),
            one.num_nodes.expand(3).contiguous(),
            torch.cat([one.target, torch.full((1, 4, 7), 1 / 7, dtype=torch.float64)], 1).expand(
                3, -1, -1
            ),
            torch.cat([one.draft, torch.full((1, 4, 7), 1 / 7, dtype=torch.float64)], 1).expand(
                3, -1, -1
            ),
        )
        g = torch.Generator().manual_seed(1000 + i)
        mixed = f(wide, [None, g, torch.Generator().manual_seed(3)])
        assert torch.equal(mixed.output_tokens[1:2, :9], alone.output_tokens)
        assert (mixed.output_tokens[1, 9:] == -1).all()
        # the generator advanced by the same amount (num_nodes uniforms)
        assert torch.equal(torch.rand(1, generator=g), after_alone)


def test_chain_and_tree_versions_agree_given_seeds():
    gen = torch.Generator().manual_seed(80)
    model = make_model(5, 4, "far", seed=80)
    b = draft_batch(model, [-1, 0, 1, 2, 3], "iid", 300, gen, truncate=True)
    parents = chain_parents(b.num_nodes, 5)
    mk = lambda: [torch.Generator().manual_seed(i) for i in range(300)]  # noqa: E731
    rc = sampled_chain_verify(b.tokens, None, b.num_nodes, b.target, b.draft, mk())
    for rep in (True, False):
        rt = sampled_tree_verify(b.tokens, parents, b.num_nodes, b.target, b.draft, rep, mk())
        assert torch.equal(rc.output_tokens, rt.output_tokens)
        assert torch.equal(rc.accepted_nodes, rt.accepted_nodes)
    with pytest.raises(ValueError):
        sampled_chain_verify(
            b.tokens,
            torch.tensor(TREE_A[:5]).expand(300, 5),
            torch.full((300,), 5),
            b.target,
            b.draft,
        )


def test_float32_inputs_and_default_generator():
    b, _ = _seeded_inputs(90, B=64)
    t32, d32 = b.target.float(), b.draft.float()
    for res in (
        deterministic_tree_verify(b.tokens, b.parents, b.num_nodes, t32),
        sampled_tree_verify(b.tokens, b.parents, b.num_nodes, t32, d32, True),
        sampled_tree_verify(b.tokens, b.parents, b.num_nodes, t32, d32, False, [None] * 64),
    ):
        assert (res.output_tokens[:, 0] >= 0).all()


# ----------------------------------------------------------------------------- acceptance


def acceptance_table(n: int = 20_000, V: int = 16, seed: int = 0) -> list[tuple[str, ...]]:
    """Mean emitted tokens per step (num_accepted + 1) at T=1.

    Target logits per prefix z = s * N(0, 1) (s = 2.5 "moderate", s = 5 "peaked");
    draft logits z + sigma * N(0, 1), sigma = 0.5 ("good") or 2.5 ("bad"), independent
    per prefix.  Also reports the target's mean top-1 probability and the mean
    single-draft acceptance 1 - TV(p, q) over the table."""
    rows = []
    depth = 4
    shapes = {
        "chain 4": [-1, 0, 1, 2, 3],
        "binary depth 4 (30)": [-1] + [(i - 1) // 2 for i in range(1, 31)],
    }
    cases = [
        ("A (iid drafts)", "iid", v_tree(True), True),
        ("B (iid drafts)", "iid", v_tree(False), False),
        ("B (w/o-repl. drafts)", "norep", v_tree(False), False),
        ("C (top-k drafts)", "topk", v_det, True),
        ("C (w/o-repl. drafts)", "norep", v_det, False),
    ]
    for target_kind, scale in (("moderate", 2.5), ("peaked", 5.0)):
        for draft_kind, sigma in (("good", 0.5), ("bad", 2.5)):
            gen = torch.Generator().manual_seed(seed)
            C = (V + 1) ** depth
            z = scale * torch.randn((C, V), generator=gen, dtype=torch.float64)
            P = z.softmax(-1)
            Q = (z + sigma * torch.randn((C, V), generator=gen, dtype=torch.float64)).softmax(-1)
            model = Model(V, P, Q)
            top1 = P.max(-1).values.mean().item()
            acc1 = 1 - 0.5 * (P - Q).abs().sum(-1).mean().item()
            for shape_name, shape in shapes.items():
                for name, mode, verify, on_chain in cases:
                    if shape_name.startswith("chain") and not on_chain:
                        continue
                    b = draft_batch(
                        model, shape, mode, n, torch.Generator().manual_seed(seed + 1), False
                    )
                    with torch.random.fork_rng():
                        torch.manual_seed(seed + 2)
                        res = verify(b)
                    mean = res.num_accepted.double().mean().item() + 1
                    rows.append(
                        (
                            f"{target_kind} (top1 {top1:.2f})",
                            f"{draft_kind} (1-TV {acc1:.2f})",
                            shape_name,
                            name,
                            f"{mean:.3f}",
                        )
                    )
    return rows


def test_acceptance_table_smoke(capsys):
    rows = acceptance_table(n=2000)
    with capsys.disabled():
        print()
        for r in rows:
            print("  " + " | ".join(r))
    assert all(1.0 <= float(r[-1]) <= 31 for r in rows)


if __name__ == "__main__":
    import time

    t0 = time.time()
    table = acceptance_table(n=50_000)
    print("| target | draft | tree | rule (drafts) | mean tokens/step |\n|---|---|---|---|---|")
    for r in table:
        print("| " + " | ".join(r) + " |")
    print(f"({time.time() - t0:.1f}s)")
