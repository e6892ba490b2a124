"""The closed forms of benchmarks/micro/rule_acceptance.py agree with the verifiers they describe."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "micro"))

from rule_acceptance import rule_acceptance  # noqa: E402

from eagle_vllm.verify.reference import deterministic_tree_verify, sampled_tree_verify  # noqa: E402

SAMPLES = 100_000


def _depth1_tree(children: torch.Tensor):
    """[S, k] child tokens -> a depth-1 tree per sample: root + k children."""
    s, k = children.shape
    tokens = torch.cat([torch.zeros(s, 1, dtype=torch.long), children], dim=1)
    parents = torch.cat([torch.full((s, 1), -1), torch.zeros(s, k, dtype=torch.long)], dim=1)
    return tokens, parents, torch.full((s,), k + 1)


def test_closed_forms_match_the_verifiers():
    gen = torch.Generator().manual_seed(0)
    vocab, k = 6, 3
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1).double()
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1).double()
    q[0] = 0  # q = 0 where p > 0
    q = q / q.sum()
    exact = {name: float(v) for name, v in rule_acceptance(p[None], q[None], k).items()}
    torch.manual_seed(1)

    # SpecInfer: k children i.i.d. from q; accepted iff the path is non-empty
    children = torch.multinomial(q.expand(SAMPLES, -1), k, replacement=True, generator=gen)
    tokens, parents, n = _depth1_tree(children)
    rows = torch.zeros(SAMPLES, k + 1, vocab, dtype=torch.float64)
    target, draft = rows.clone(), rows.clone()
    target[:, 0], draft[:, 0] = p, q
    res = sampled_tree_verify(tokens, parents, n, target, draft, replacement=True)
    mc = float((res.accepted_nodes[:, 0] >= 0).double().mean())
    assert abs(mc - exact[f"tree_specinfer{k}"]) < 4 * (0.25 / SAMPLES) ** 0.5, (mc, exact)

    # deterministic rule on the top-k children
    top = q.topk(k).indices.expand(SAMPLES, -1)
    tokens, parents, n = _depth1_tree(top)
    res = deterministic_tree_verify(tokens, parents, n, target)
    mc = float((res.accepted_nodes[:, 0] >= 0).double().mean())
    assert abs(mc - exact[f"tree_top{k}"]) < 4 * (0.25 / SAMPLES) ** 0.5, (mc, exact)

    # chains: speculative sampling accepts sum min(p, q); argmax drafts accept p(argmax q)
    assert abs(exact["chain_sampled"] - float(torch.minimum(p, q).sum())) < 1e-12
    assert abs(exact["chain_argmax"] - float(p[q.argmax()])) < 1e-12
