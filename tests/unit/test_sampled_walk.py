"""Sampled batches whose rows are processed alike are verified by a walk over Python
lists that processes and draws only the rows of visited nodes (engine/sampler.py,
``_walk_drawing_visited_rows``). Seeded requests must get the tokens the tensor walk
over every processed row gives (both draw with vLLM's sampler, keyed by position);
unseeded ones must follow the target's processed distribution along the tree."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

pytest.importorskip("vllm")

from test_greedy_fast_path import (  # noqa: E402
    _greedy_metadata,
    _random_trees,
    _spec,
    _TreeParents,
)
from test_sampler_draws import _min_p  # noqa: E402
from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from eagle_vllm.engine.sampler import ExactRejectionSampler, use_inverse_cdf_draws  # noqa: E402
from eagle_vllm.engine.step import StepRecord, StepState  # noqa: E402

V = 12
P_MIN = 1e-4


def _metadata(temperature, top_k=None, top_p=None, generators=None, min_p=0.0):
    batch = temperature.shape[0]
    min_p_proc = _min_p(min_p)
    min_p_proc.min_p = torch.full((batch, 1), min_p)
    return _greedy_metadata(
        batch, [min_p_proc], temperature=temperature, all_greedy=False,
        all_random=bool((temperature != GREEDY_TEMPERATURE).all()),
        top_p=top_p, top_k=top_k, generators=generators or {},
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(5))
def test_seeded_requests_get_the_tensor_walks_tokens(monkeypatch, seed):
    gen = torch.Generator().manual_seed(seed)
    batch = 6 + 3 * seed
    counts = [int(torch.randint(1, 7, (1,), generator=gen)) for _ in range(batch)]
    # drafts from a small alphabet over peaked rows, so that walks go deep
    drafts = [torch.randint(0, 2, (n,), generator=gen).tolist() for n in counts]
    logits = torch.randn(sum(counts) + batch, V, generator=gen)
    logits[:, 0] += 6.0
    logits[:, 1] += 3.0
    parents = _random_trees(gen, counts)
    temperature = torch.rand(batch, generator=gen) + 0.3
    temperature[::3] = GREEDY_TEMPERATURE  # a greedy request among sampled ones
    top_k = torch.randint(2, V + 1, (batch,), generator=gen)
    top_p = torch.rand(batch, generator=gen) * 0.5 + 0.5
    positions = torch.randint(10, 500, (logits.shape[0],), generator=gen)

    def run(list_walk: bool):
        generators = {b: torch.Generator().manual_seed(100 + b) for b in range(batch)}
        meta = _metadata(temperature, top_k, top_p, generators, min_p=0.05)
        sampler = Sampler()
        use_inverse_cdf_draws(sampler)
        verifier = ExactRejectionSampler(sampler)
        # the tensor walk serves batches with drafts sampled from q
        monkeypatch.setattr(verifier, "_has_drafts_sampled_from_q", lambda: not list_walk)
        step = StepState(record=StepRecord(started=0.0, decode_only=True), positions=positions)
        step.tree_batch = _TreeParents(parents)
        with verifier.bound_to(step):
            out = verifier(_spec(drafts), None, logits.clone(), meta)
        return out.sampled_token_ids, step.accepted_nodes

    list_tokens, list_nodes = run(True)
    tensor_tokens, tensor_nodes = run(False)
    assert torch.equal(list_tokens, tensor_tokens)
    assert torch.equal(list_nodes, tensor_nodes)
    assert int((list_nodes >= 0).sum()) > batch // 2  # the walks went past the root


def test_unseeded_walks_follow_the_target_along_the_tree():
    # root -> children 1 (token 0) and 2 (token 1); node 1 -> child 3 (token 2)
    parents = torch.tensor([[-1, 0, 0, 1]])
    drafts = [0, 1, 2]
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(4, V, generator=gen)
    rows[:, :3] += 1.5  # the drafted tokens likely, but far from certain
    temperature, top_k = 0.8, 6
    n = 60_000
    meta = _metadata(torch.full((n,), temperature), top_k=torch.full((n,), top_k))
    sampler = Sampler()
    use_inverse_cdf_draws(sampler)
    verifier = ExactRejectionSampler(sampler)
    step = StepState(record=StepRecord(started=0.0, decode_only=True))
    step.tree_batch = _TreeParents(parents.expand(n, 4))
    with verifier.bound_to(step):
        out = verifier(_spec([drafts] * n), None, rows.repeat(n, 1), meta)
    outputs = [tuple(t for t in row if t >= 0) for row in out.sampled_token_ids.tolist()]

    def processed(node: int) -> torch.Tensor:
        scaled = rows[node] / temperature
        kept = scaled.topk(top_k).indices
        p = torch.zeros(V, dtype=torch.float64)
        p[kept] = torch.softmax(scaled[kept].double(), dim=0)
        return p

    # exact law of the output: the root's draw; after token 0 (node 1) node 1's draw,
    # and after token 2 there (node 3) node 3's; after token 1 (node 2) node 2's
    p = {node: processed(node) for node in range(4)}
    law = {}
    for y in range(V):
        if y == 0:
            for z in range(V):
                if z == 2:
                    for w in range(V):
                        law[(0, 2, w)] = p[0][0] * p[1][2] * p[3][w]
                else:
                    law[(0, z)] = p[0][0] * p[1][z]
        elif y == 1:
            for z in range(V):
                law[(1, z)] = p[0][1] * p[2][z]
        else:
            law[(y,)] = p[0][y]
    law = {k: float(v) for k, v in law.items() if v > 0}
    assert set(outputs) <= set(law)
    keys = sorted(law, key=lambda k: -law[k])
    counts = {k: 0 for k in keys}
    for o in outputs:
        counts[o] += 1
    # outcomes with an expected count under 5 pooled into one cell
    big = [k for k in keys if law[k] * n >= 5]
    observed = [counts[k] for k in big] + [n - sum(counts[k] for k in big)]
    expected = [law[k] * n for k in big] + [n * (1 - sum(law[k] for k in big))]
    assert chisquare(observed, expected).pvalue > P_MIN
    accepted = sum(len(o) - 1 for o in outputs) / n
    assert accepted == pytest.approx(float(p[0][0] + p[0][1] + p[0][0] * p[1][2]), abs=0.02)
