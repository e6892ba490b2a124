"""Position-keyed randomness: uniform, independent, and trees that cannot change a seed's output."""

from __future__ import annotations

import torch
from scipy import stats

from eagle_vllm.verify import tree_verify_with_draws
from eagle_vllm.verify.position_rng import (
    DOMAIN_SAMPLER,
    position_generator,
    position_generators,
    position_keys,
)
from eagle_vllm.verify.reference import position_uniforms

V = 6


def test_uniforms_are_uniform_and_independent():
    seeds = torch.arange(400)
    pos = torch.arange(500)[None, :].repeat(400, 1)
    u = position_uniforms(seeds, pos)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-4
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):  # neighbours in position / seed
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(r)) < 0.01
    other = position_uniforms(seeds, pos, DOMAIN_SAMPLER)
    assert abs(float(torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1])) < 0.01
    assert torch.equal(u, position_uniforms(seeds, pos))  # deterministic
    g1, g2 = position_generator(7, 11), position_generator(7, 11)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_generators_made_together_are_the_ones_made_alone():
    seeds, positions = [7, 7, 12345, 2**40 + 3], [11, 12, 0, 99]
    together = position_generators(seeds, torch.tensor(positions))
    for generator, seed, position in zip(together, seeds, positions):
        key = position_keys(torch.tensor([seed]), torch.tensor([[position]]), DOMAIN_SAMPLER)
        assert generator.initial_seed() == int(key) & ((1 << 63) - 1)
    assert len({g.initial_seed() for g in together}) == len(seeds)
    assert position_generators([], []) == []


def _lm(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy target: the next-token distribution is a fixed function of the prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0)


def _random_tree(g: torch.Generator, n: int) -> tuple[list[int], list[int]]:
    parents, tokens = [-1], [0]
    for i in range(1, n):
        parents.append(int(torch.randint(0, i, (1,), generator=g)))
        tokens.append(int(torch.randint(0, V, (1,), generator=g)))
    return tokens, parents


def _generate(seed: int, tree_seed: int, length: int = 12) -> list[int]:
    """Speculative generation with random trees, each draw keyed by (seed, position)."""
    g = torch.Generator().manual_seed(tree_seed)
    out: list[int] = []
    while len(out) < length:
        n = int(torch.randint(1, 7, (1,), generator=g))
        tokens, parents = _random_tree(g, n)
        depth = [0] * n
        prefix_of = [tuple(out)]
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            prefix_of.append(prefix_of[parents[i]] + (tokens[i],))
        probs = torch.stack([_lm(p) for p in prefix_of])
        pos = [len(out) + d for d in depth]  # position each node's draw decides

        def draw(rows, nodes, probs=probs, pos=pos):
            # an exponential race keyed by (seed, position), as vLLM's native sampler
            # draws with a position-keyed generator (engine/sampler.py calls vLLM's own:
            # tests/unit/test_sampler_draws.py)
            tokens = []
            for node in nodes.tolist():
                e = torch.empty(V).exponential_(
                    generator=position_generator(seed, pos[node], DOMAIN_SAMPLER)
                )
                tokens.append(int((probs[node] / e).argmax()))
            return torch.tensor(tokens)

        res = tree_verify_with_draws(
            torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([n]), draw
        )
        out += [t for t in res.output_tokens[0].tolist() if t >= 0]
    return out[:length]


def test_the_tree_cannot_change_a_seeded_output():
    for seed in range(20):
        runs = {tuple(_generate(seed, tree_seed)) for tree_seed in range(4)}
        assert len(runs) == 1, (seed, runs)


def test_seeded_outputs_follow_the_target_distribution():
    """First two tokens over many seeds vs the exact joint p(a) p(b | a)."""
    n = 6000
    counts = torch.zeros(V, V)
    for seed in range(n):
        a, b = _generate(seed, tree_seed=seed % 7, length=2)
        counts[a, b] += 1
    first = _lm(())
    expected = torch.stack([first[a] * _lm((a,)) for a in range(V)]) * n
    chi = stats.chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert chi.pvalue > 1e-4, chi
