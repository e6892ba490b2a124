"""Reduced draft vocabulary (FR-Spec style): drafting over a ranked subset of the LM head.

The oracle draft reproduces the oracle target exactly, so with a subset that
covers every token it still gets everything accepted, and with half the
vocabulary it loses exactly the drafts outside the subset, while the output
stays the target's greedy output token for token (chain and tree).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics

pytestmark = pytest.mark.vllm

K = 3
PROMPTS = [" ".join(f"w{(7 * i + j) % 250}" for i in range(5 + 3 * j)) for j in range(8)]


def greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def ids_of(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def ranked_draft(tiny, tmp_path_factory):
    """The oracle draft plus a draft_vocab.json ranking every token (shuffled)."""
    import json

    path = tmp_path_factory.mktemp("dv") / "draft"
    shutil.copytree(tiny["draft_oracle"], path)
    vocab = 254
    ranked = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    (path / "draft_vocab.json").write_text(json.dumps({"token_ids": ranked.tolist()}))
    return path, ranked


@pytest.fixture(scope="module")
def vanilla(tiny):
    import vllm

    llm = vllm.LLM(str(tiny["target_oracle"]), **ENGINE_KW)
    out = ids_of(llm.generate(PROMPTS, greedy()))
    shutdown(llm)
    return out


def _run(tiny, draft, **spec):
    from eagle_vllm import LLM

    llm = LLM(
        str(tiny["target_oracle"]), speculative_config={"model": str(draft), **spec}, **ENGINE_KW
    )
    try:
        return ids_of(llm.generate(PROMPTS, greedy())), spec_metrics(llm)
    finally:
        shutdown(llm)


def test_full_coverage_subset_keeps_the_oracle_exact(tiny, ranked_draft, vanilla):
    draft, _ = ranked_draft
    got, metrics = _run(tiny, draft, method="eagle", num_speculative_tokens=K)  # auto: 254
    assert got == vanilla
    assert mean_acceptance_length(metrics) == K + 1, metrics


def test_half_vocabulary_drafts_only_inside_it_and_stays_exact(tiny, ranked_draft, vanilla):
    draft, ranked = ranked_draft
    half = 127
    got, metrics = _run(tiny, draft, method="eagle", num_speculative_tokens=K, draft_vocab=half,
                        draft_vocab_context=False)  # fmt: skip
    assert got == vanilla
    # Position 1's draft comes from the target's own feature, so it is accepted
    # exactly when the target's next token lies in the subset.
    inside = set(ranked[:half].tolist())
    tau = mean_acceptance_length(metrics)
    assert 1.0 < tau < K + 1, metrics
    per_pos = metrics["num_accepted_tokens_per_pos"]
    assert per_pos[0] < metrics["num_drafts"]
    covered = sum(t in inside for seq in vanilla for t in seq) / sum(map(len, vanilla))
    assert 0.2 < covered < 0.8  # the subset really cuts through the outputs

    # Each request's own tokens beside the half (the default): a token outside it is
    # drafted once the request has seen it, so more is accepted, and the output is the
    # same.
    got, with_context = _run(tiny, draft, method="eagle", num_speculative_tokens=K,
                             draft_vocab=half)  # fmt: skip
    assert got == vanilla
    assert mean_acceptance_length(with_context) > tau + 0.1, (with_context, metrics)


def test_tree_with_small_draft_vocab_stays_exact(tiny, ranked_draft, vanilla):
    draft, _ = ranked_draft
    got, _ = _run(
        tiny,
        draft,
        method="eagle2",
        num_speculative_tokens=3,
        topk=2,
        total_tokens=6,
        draft_vocab=60,
    )
    assert got == vanilla
