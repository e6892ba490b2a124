"""The verifier's draws are the sampler's own: a seeded request's token at a position is
the one the runner's sampler draws there, whether the verifier's walk, the bonus draw or
a step without drafts decides it (engine/sampler.py; vLLM 0.32's CPU sampler draws a
seed from the generator for a fused Gumbel-max, CUDA's an Exp(1) race, and the plugin's
runner on CPU gives it inverse-CDF draws, so the walk must call the sampler rather than
copy one of them). And the walk draws at visited nodes only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor  # noqa: E402
from vllm.v1.sample.logits_processor.state import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

from eagle_vllm.engine.sampler import ExactRejectionSampler, use_inverse_cdf_draws  # noqa: E402
from eagle_vllm.engine.step import StepRecord, StepState  # noqa: E402


def _step(**fields) -> StepState:
    return StepState(record=StepRecord(started=0.0, decode_only=True), **fields)


from eagle_vllm.verify.position_rng import DOMAIN_SAMPLER, position_generator  # noqa: E402

V = 64
DRAFTS = 3
FIRST_POSITION = 100  # position of the root token (logits row 0)


def _min_p(value: float) -> MinPLogitsProcessor:
    proc = MinPLogitsProcessor.__new__(MinPLogitsProcessor)  # state only: no vllm_config
    proc.min_p_count = 1
    proc.min_p = torch.tensor([[value]])
    return proc


def _metadata(seed: int | None, temperature: float, top_p: float, min_p: float):
    generators = {} if seed is None else {0: torch.Generator().manual_seed(seed)}
    return SamplingMetadata(
        temperature=torch.tensor([temperature]),
        all_greedy=False,
        all_random=True,
        top_p=torch.tensor([top_p]),
        top_k=None,
        generators=generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(1),
        presence_penalties=torch.zeros(1),
        repetition_penalties=torch.ones(1),
        output_token_ids=[[]],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors([_min_p(min_p)]),
    )


def _chain(drafts: list[int]) -> SpecDecodeMetadata:
    n = len(drafts)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(drafts, dtype=torch.int32),
        num_draft_tokens=[n],
        cu_num_draft_tokens=torch.tensor([n], dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor([n + 1], dtype=torch.int32),
        target_logits_indices=torch.arange(n, dtype=torch.int32),
        bonus_logits_indices=torch.tensor([n], dtype=torch.int32),
        logits_indices=torch.arange(n + 1, dtype=torch.int32),
    )


def _sampler(inverse_cdf: bool) -> Sampler:
    sampler = Sampler()
    if inverse_cdf:  # as the plugin's runner gives it on CPU
        use_inverse_cdf_draws(sampler)
    return sampler


def _vllm_draw(
    logits_row: torch.Tensor, seed: int, position: int, inverse_cdf: bool, **params
) -> int:
    """What the sampler draws for this row in a plain step deciding ``position``."""
    meta = _metadata(seed, **params)
    meta.generators[0] = position_generator(seed, position, DOMAIN_SAMPLER)
    out = _sampler(inverse_cdf)(logits_row[None].clone(), meta)
    return int(out.sampled_token_ids.view(-1)[0])


@pytest.mark.parametrize("inverse_cdf", [False, True])
@pytest.mark.parametrize("accepted", [0, 1, DRAFTS])
@pytest.mark.parametrize("seed", [3, 11])
def test_walk_draws_equal_vllms_plain_draws(accepted, seed, inverse_cdf):
    params = dict(temperature=0.8, top_p=0.9, min_p=0.02)
    logits = torch.randn(DRAFTS + 1, V, generator=torch.Generator().manual_seed(seed)) * 2
    # node n's draw decides position FIRST_POSITION + n + 1
    plain = [
        _vllm_draw(logits[n], seed, FIRST_POSITION + n + 1, inverse_cdf, **params) for n in range(4)
    ]
    drafts = plain[:accepted]
    if accepted < DRAFTS:  # then a draft the target's draw does not pick
        drafts += [(plain[accepted] + 1) % V] * (DRAFTS - accepted)
    verifier = ExactRejectionSampler(_sampler(inverse_cdf))
    step = _step(positions=torch.arange(DRAFTS + 1) + FIRST_POSITION)
    with verifier.bound_to(step):
        out = verifier(_chain(drafts), None, logits.clone(), _metadata(seed, **params))
    tokens = out.sampled_token_ids.view(-1).tolist()
    # the accepted drafts, then the token vLLM would have drawn at the next position
    # (the correction after a rejection, or the bonus after all drafts)
    assert tokens[: accepted + 1] == plain[: accepted + 1]
    assert step.accepted_nodes[0, :accepted].tolist() == list(range(1, accepted + 1))


def test_walk_draws_only_at_visited_nodes(monkeypatch):
    sampler = Sampler()
    verifier = ExactRejectionSampler(sampler)
    rows_drawn = []
    original = sampler.topk_topp_sampler.forward

    def counting(logits, generators, k, p):
        rows_drawn.append(logits.shape[0])
        return original(logits, generators, k, p)

    monkeypatch.setattr(sampler.topk_topp_sampler, "forward", counting)
    logits = torch.full((DRAFTS + 1, V), -30.0)
    logits[:, 5] = 30.0  # the target picks token 5 everywhere
    meta = _metadata(None, temperature=1.0, top_p=1.0, min_p=0.0)
    step = _step()
    with verifier.bound_to(step):
        verifier(_chain([7, 5, 5]), None, logits.clone(), meta)  # first draft rejected
    # one row, the walk's root node's: not a row for each of the 4 nodes, and no bonus
    # token, which only a walk reaching the last node needs
    assert rows_drawn == [1]
    assert step.accepted_nodes[0].tolist() == [-1] * DRAFTS

    # a batch that wants logprobs keeps vLLM's own bonus draw (its logprobs come with it)
    rows_drawn.clear()
    with_logprobs = _metadata(None, temperature=1.0, top_p=1.0, min_p=0.0)
    with_logprobs.max_num_logprobs = 2
    with verifier.bound_to(_step()):
        verifier(_chain([7, 5, 5]), None, logits.clone(), with_logprobs)
    assert rows_drawn == [1, 1]
    rows_drawn.clear()
    with verifier.bound_to(_step()):  # every draft accepted: the last node draws the bonus
        out = verifier(_chain([5, 5, 5]), None, logits.clone(), meta)
    assert rows_drawn == [1] * (DRAFTS + 1)
    assert out.sampled_token_ids.view(-1).tolist() == [5] * (DRAFTS + 1)
