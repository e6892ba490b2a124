"""Greedy batches whose sampling cannot move an argmax take one argmax over all logits
rows (engine/sampler.py, ``_argmax_decides``) instead of vLLM's bonus sampler call and
the target rows' copy and processing. The output must be the full path's, token for
token, on chains and trees, and anything that can move an argmax or needs the rows
(logprobs, penalties, bad words, logit bias, min_tokens) must keep the full path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor.builtin import (  # noqa: E402
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.logits_processor.state import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

from eagle_vllm.engine import sampler as sampler_module  # noqa: E402
from eagle_vllm.engine.sampler import ExactRejectionSampler  # noqa: E402
from eagle_vllm.engine.step import StepRecord, StepState  # noqa: E402


class _TreeParents:
    """Every request's parents given outright, as a step's ``TreeBatch`` answers them."""

    def __init__(self, parents: torch.Tensor):
        self.parents = parents

    def verification_parents(self, num_nodes: torch.Tensor, width: int) -> torch.Tensor:
        return self.parents[:, :width]


V = 50


def _greedy_metadata(batch: int, procs=(), **overrides) -> SamplingMetadata:
    fields = dict(
        temperature=None,
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(list(procs)),
    )
    fields.update(overrides)
    return SamplingMetadata(**fields)


def _spec(drafts_per_request: list[list[int]]) -> SpecDecodeMetadata:
    """vLLM 0.32's layout: each request's draft rows, then its bonus row."""
    counts = [len(d) for d in drafts_per_request]
    target, bonus, row = [], [], 0
    for n in counts:
        target += list(range(row, row + n))
        bonus.append(row + n)
        row += n + 1
    flat = [t for d in drafts_per_request for t in d]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(flat, dtype=torch.int32),
        num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32),
        cu_num_sampled_tokens=torch.tensor([n + 1 for n in counts]).cumsum(0).to(torch.int32),
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(row, dtype=torch.int32),
    )


def _random_trees(gen, counts):
    """Parents of random trees (topological: parent < index), padded to the widest."""
    width = max(counts) + 1
    parents = torch.full((len(counts), width), -1, dtype=torch.int64)
    for b, n in enumerate(counts):
        for i in range(1, n + 1):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=gen))
    return parents


@pytest.mark.parametrize("walk", ["lists", "tensors"])
@pytest.mark.parametrize("trees", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_the_fast_path_outputs_what_the_full_path_does(monkeypatch, walk, trees, seed):
    # few nodes are walked over Python lists, more by the tensor walk
    limit = 1_000 if walk == "lists" else 0
    monkeypatch.setattr(sampler_module, "LIST_WALK_MAX_NODES", limit)
    gen = torch.Generator().manual_seed(seed)
    counts = [int(torch.randint(0, 5, (1,), generator=gen)) for _ in range(4 + 4 * seed)]
    counts[0] = max(counts[0], 1)
    # drafts from a small alphabet, so that some match the target's argmax, and logits
    # with ties (integer-valued) so tie-breaking is exercised
    drafts = [torch.randint(0, 4, (n,), generator=gen).tolist() for n in counts]
    logits = torch.randint(0, 3, (sum(counts) + len(counts), V), generator=gen).float()
    logits[:, :4] += 2 * torch.rand(logits.shape[0], 4, generator=gen).round()
    spec = _spec(drafts)
    parents = _random_trees(gen, counts) if trees else None

    def run(fast: bool):
        verifier = ExactRejectionSampler(Sampler())
        step = StepState(record=StepRecord(started=0.0, decode_only=True))
        if trees:
            step.tree_batch = _TreeParents(parents)
        monkeypatch.setattr(sampler_module, "_argmax_decides", lambda m: fast)
        with verifier.bound_to(step):
            out = verifier(spec, None, logits.clone(), _greedy_metadata(len(counts)))
        return out.sampled_token_ids, step.accepted_nodes

    fast_tokens, fast_nodes = run(True)
    full_tokens, full_nodes = run(False)
    assert torch.equal(fast_tokens, full_tokens)
    assert torch.equal(fast_nodes, full_nodes)


def _logit_bias(biases: dict) -> LogitBiasLogitsProcessor:
    proc = LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor)  # state only
    proc.biases = biases
    return proc


def _min_tokens(min_toks: dict) -> MinTokensLogitsProcessor:
    proc = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)  # state only
    proc.min_toks = min_toks
    return proc


def test_only_batches_where_an_argmax_decides_take_it():
    decides = sampler_module._argmax_decides
    assert decides(_greedy_metadata(2))
    # idle built-in processors do not count
    assert decides(_greedy_metadata(2, procs=[_logit_bias({}), _min_tokens({})]))
    for overrides, procs in [
        ({"max_num_logprobs": 0}, ()),
        ({"logprob_token_ids": {0: [1]}}, ()),
        ({"no_penalties": False}, ()),
        ({"allowed_token_ids_mask": torch.zeros(2, V, dtype=torch.bool)}, ()),
        ({"bad_words_token_ids": {0: [[3]]}}, ()),
        ({"all_greedy": False, "temperature": torch.ones(2)}, ()),
        ({}, [_logit_bias({0: {3: 5.0}})]),
        ({}, [_min_tokens({0: (4, [], {2}, False)})]),
    ]:
        assert not decides(_greedy_metadata(2, procs=procs, **overrides)), overrides


def test_a_processor_it_does_not_know_keeps_the_full_path():
    class Custom(LogitBiasLogitsProcessor):  # may apply anything, whatever its state
        def apply(self, logits):
            return -logits

    custom = Custom.__new__(Custom)
    custom.biases = {}

    class Unknown:  # any other non-argmax-invariant processor
        def is_argmax_invariant(self) -> bool:
            return False

    for proc in (custom, Unknown()):
        assert not sampler_module._argmax_decides(_greedy_metadata(1, procs=[proc]))
