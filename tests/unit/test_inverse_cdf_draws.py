"""Random draws through one uniform per row (``verify.sample_from_probs``, two-level
inverse CDF) and the sampler glue that makes them the random draws of vLLM's sampler
in the plugin's runner (``engine/sampler.py``, ``InverseCdfDraws``): each token drawn
with its probability, never a token of probability 0, a seeded row's uniform its
generator's first."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from eagle_vllm.verify.rejection import DRAW_BLOCK, sample_from_probs

P_MIN = 1e-4


def _full_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The one-level inverse CDF over the whole row, in float64."""
    cdf = probs.to(torch.float64).cumsum(-1)
    goal = u.to(torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, goal, right=True).squeeze(1)


@pytest.mark.parametrize("vocab", [7, 2 * DRAW_BLOCK, 3 * DRAW_BLOCK + 5, 49152])
def test_the_two_level_walk_picks_the_full_cdfs_token_up_to_fp32_rounding(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(256, vocab, generator=gen) * 3
    logits[:, ::3] = float("-inf")  # zero-probability tokens, whole blocks of them at V=7
    probs = torch.softmax(logits, dim=-1)
    u = torch.rand(256, dtype=torch.float64, generator=gen)
    drawn = sample_from_probs(probs, u)
    full = _full_cdf_draw(probs, u)
    assert bool((probs.gather(1, drawn[:, None]) > 0).all())
    # A block's mass is summed in fp32, so a boundary may move by its rounding (~1e-7 of
    # the mass before it, as in any fp32 sampler): the tokens may differ only where the
    # full CDF between them is that small.
    cdf = probs.to(torch.float64).cumsum(-1)
    gap = (cdf.gather(1, drawn[:, None]) - cdf.gather(1, full[:, None])).abs()
    assert float(gap.max()) < 1e-6
    assert int((drawn != full).sum()) <= 2


def test_uniforms_at_the_ends_never_pick_a_token_of_probability_zero():
    vocab = 4 * DRAW_BLOCK + 3
    probs = torch.zeros(3, vocab)
    probs[0, 5] = 1.0  # one token
    probs[1, [DRAW_BLOCK - 1, 2 * DRAW_BLOCK]] = 0.5  # the last of one block, the first of the next
    probs[2, -4:] = 0.25  # the padded last block
    for u in (0.0, 0.5, 1.0 - 2**-53):
        drawn = sample_from_probs(probs, torch.full((3,), u, dtype=torch.float64))
        assert bool((probs.gather(1, drawn[:, None]) > 0).all()), (u, drawn)
    assert sample_from_probs(torch.zeros(2, vocab), torch.rand(2)).tolist() == [0, 0]


def test_draws_follow_the_row():
    # many blocks, a padded last block, mass spread so every block is drawn from
    vocab, n = 3 * DRAW_BLOCK + 40, 400_000
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(vocab, generator=gen), dim=0)
    buckets = 60  # tokens grouped so every expected count is large
    drawn = sample_from_probs(p.expand(n, vocab), torch.rand(n, dtype=torch.float64, generator=gen))
    group = torch.arange(vocab) * buckets // vocab
    observed = np.bincount(group[drawn].numpy(), minlength=buckets)
    expected = np.bincount(group.numpy(), weights=p.double().numpy(), minlength=buckets)
    expected *= n / expected.sum()
    assert chisquare(observed, expected).pvalue > P_MIN


pytest.importorskip("vllm")

from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler  # noqa: E402

from eagle_vllm.engine.sampler import InverseCdfDraws, use_inverse_cdf_draws  # noqa: E402


def _law_test(row: torch.Tensor, top_k: int, tokens: torch.Tensor) -> float:
    """p-value of ``tokens`` against softmax over the ``top_k`` largest logits of ``row``."""
    kept = row.topk(top_k).indices
    assert bool(torch.isin(tokens, kept).all())
    p = torch.softmax(row[kept], dim=0).double().numpy()
    index = {int(t): i for i, t in enumerate(kept)}
    observed = np.bincount([index[t] for t in tokens.tolist()], minlength=top_k)
    return chisquare(observed, p * len(tokens) / p.sum()).pvalue


def test_rows_follow_the_processed_row_and_a_seeded_row_its_generators_first_uniform():
    draws = InverseCdfDraws("raw_logprobs")
    vocab, n, top_k = 1000, 100_000, 40
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(vocab, generator=gen) * 2
    k = torch.full((n,), top_k, dtype=torch.int64)
    # every fifth row seeded, each with its own seed: over many seeds they follow the row
    seeded = {r: torch.Generator().manual_seed(10_000 + r) for r in range(0, n, 5)}
    tokens, processed = draws(row.expand(n, vocab).clone(), seeded, k, None)
    assert processed is None  # raw logprobs mode: nothing processed to hand back
    rows = torch.tensor(sorted(seeded))
    unseeded = torch.ones(n, dtype=torch.bool)
    unseeded[rows] = False
    assert _law_test(row, top_k, tokens[unseeded]) > P_MIN
    assert _law_test(row, top_k, tokens[rows]) > P_MIN
    # a seeded row's token: the inverse CDF at its generator's first uniform
    probs = torch.softmax(row.masked_fill(~torch.isin(torch.arange(vocab), row.topk(top_k).indices),
                                          float("-inf")), dim=0)  # fmt: skip
    for r in (0, 5, 995):
        u = torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(10_000 + r))
        assert int(tokens[r]) == int(sample_from_probs(probs[None], u.view(1))[0])


def test_processed_logprobs_are_vllms():
    for mode in ("processed_logits", "processed_logprobs"):
        vllm_draws = TopKTopPSampler(logprobs_mode=mode)
        logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
        k = torch.tensor([5, 7, 300])
        _, ours = InverseCdfDraws(mode)(logits.clone(), {}, k, None)
        _, theirs = vllm_draws(logits.clone(), {}, k, None)
        assert torch.equal(ours, theirs)


def test_installed_once_and_not_over_fp64_gumbel():
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler()
    use_inverse_cdf_draws(sampler)
    use_inverse_cdf_draws(sampler)
    assert isinstance(sampler.topk_topp_sampler, InverseCdfDraws)
    fp64 = Sampler()
    fp64.topk_topp_sampler.use_fp64_gumbel = True  # vLLM asked for fp64 noise: its own
    use_inverse_cdf_draws(fp64)
    assert not isinstance(fp64.topk_topp_sampler, InverseCdfDraws)
