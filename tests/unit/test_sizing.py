"""Load-aware sizing (eagle_vllm/sizing/) against simulated hardware and drafts."""

from __future__ import annotations

import pytest
import torch

from eagle_vllm.sizing import (
    GREEDY,
    OFF,
    SAMPLED,
    AcceptanceStats,
    TreeSizer,
    batch_bucket,
    candidate_sizes,
)


def test_candidate_sizes_cover_off_chain_and_full_tree():
    arms = candidate_sizes(max_passes=3, topk=4, max_nodes=8)
    assert arms[0] == OFF
    assert (1, 2) in arms and (3, 8) in arms and (2, 8) in arms
    for d, m in arms[1:]:
        assert m <= 1 + 4 + (d - 1) * 16 and m <= 8 and m >= 2
        assert m >= d + 1 or d == 1
    # a chain: one arm per depth, d passes verify d + 1 nodes
    assert candidate_sizes(max_passes=4, topk=1, max_nodes=5) == [
        OFF,
        (1, 2),
        (2, 3),
        (3, 4),
        (4, 5),
    ]


def test_a_wider_root_widens_the_one_pass_arms_only_by_its_children():
    narrow = candidate_sizes(max_passes=2, topk=4, max_nodes=16)
    wide = candidate_sizes(max_passes=2, topk=4, max_nodes=16, root_topk=8)
    assert max(m for d, m in narrow if d == 1) == 5
    assert max(m for d, m in wide if d == 1) == 9  # the root and its 8 children
    assert max(m for d, m in wide if d == 2) == 16
    sizer = TreeSizer(max_passes=2, topk=4, max_nodes=16, root_topk=8)
    assert sizer.arms == wide and sizer.export_profile()["root_topk"] == 8


def test_batch_bucket():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 17, 64)] == [1, 2, 4, 4, 8, 32, 64]


def test_acceptance_rates_per_depth_limit():
    stats = AcceptanceStats(max_passes=2, max_nodes=4, decay=1.0, prior_rate=0.0)
    # one tree: root, a (depth 1), b (depth 2, child of a), c (depth 1); a and b accepted
    depths = torch.tensor([[0, 1, 2, 1]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    accepted = torch.tensor([[False, True, True, False]])
    for _ in range(3):
        stats.update(depths, valid, accepted)
    # depth <= 2 keeps a, b, c in rank order; depth <= 1 keeps a, c. Each rate has one
    # pseudo-trial of its prior: 0 for the first draft, the better-ranked node's rate for
    # the others (c: (0 + 0.75) / (3 + 1)); b's (3 + 0.75) / 4 is capped at a's.
    assert torch.allclose(
        stats.rates(2)[1:], torch.tensor([0.75, 0.75, 0.1875], dtype=torch.float64)
    )
    assert torch.allclose(stats.rates(1)[1:3], torch.tensor([0.75, 0.1875], dtype=torch.float64))
    assert abs(stats.expected_tokens(2, 3) - 2.5) < 1e-9
    assert stats.expected_tokens(0, 4) == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_acceptance_update_counts_each_node_in_every_cut_tree(seed):
    """Random ragged trees (padding, nodes past max_nodes) against a per-node walk: node
    i at depth k is the j-th draft of the tree cut at every depth d >= k, where j counts
    the verified drafts at depth <= d up to i, clamped to max_nodes - 1."""
    gen = torch.Generator().manual_seed(seed)
    depth, max_nodes, rows, width = 3, 5, 6, 9
    stats = AcceptanceStats(max_passes=depth, max_nodes=max_nodes, decay=0.9)
    hits = torch.zeros(depth + 1, max_nodes, dtype=torch.float64)
    trials = torch.zeros_like(hits)
    for _ in range(3):
        depths = torch.randint(1, depth + 1, (rows, width), generator=gen)
        depths[:, 0] = 0
        valid = torch.arange(width)[None] < torch.randint(1, width + 1, (rows, 1), generator=gen)
        accepted = torch.rand(rows, width, generator=gen) < 0.4
        stats.update(depths, valid, accepted)
        hits *= 0.9
        trials *= 0.9
        for r in range(rows):
            for d in range(1, depth + 1):
                j = 0
                for i in range(1, width):
                    if valid[r, i] and depths[r, i] <= d:
                        j += 1
                        trials[d, min(j, max_nodes - 1)] += 1
                        hits[d, min(j, max_nodes - 1)] += float(accepted[r, i])
    assert torch.allclose(stats.trials, trials) and torch.allclose(stats.hits, hits)


def _root_and_three_children(**drafted):
    """One request's verified tree, ``DraftedTrees`` with ``drafted``'s fields: the root
    and three children, in rank order."""
    from eagle_vllm.engine.step import DraftedTrees
    from eagle_vllm.tree import DraftTree

    tree = DraftTree(
        tokens=torch.tensor([[5, 6, 7, 8]]),
        parents=torch.tensor([[-1, 0, 0, 0]]),
        depths=torch.tensor([[0, 1, 1, 1]]),
        num_nodes=torch.tensor([4]),
        scores=torch.tensor([[0.0, -1.0, -2.0, -3.0]]),
    )
    return DraftedTrees(req_ids=["a"], tree=tree, **drafted)


def test_a_tree_counts_only_for_cuts_its_passes_reach():
    """A tree of one pass is the cut at depth 1 of a two-pass tree, not that tree: there,
    the depth-2 nodes would outrank some of its nodes. Counted as a two-pass tree, a
    one-pass tree in use made every two-pass arm look worth what one pass is."""
    stats = AcceptanceStats(max_passes=3, max_nodes=4, decay=1.0)
    one_pass = torch.tensor([[0, 1, 1, 1]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    rejected = torch.zeros(1, 4, dtype=torch.bool)
    for _ in range(50):
        stats.update(one_pass, valid, rejected, passes=1)
    assert stats.trials[1].sum() == 150 and stats.trials[2:].sum() == 0
    assert stats.expected_tokens(1, 4) < 1.05  # one pass: measured, nothing accepted
    assert stats.expected_tokens(2, 4) == 2.5  # two passes: unmeasured, the prior (0.5)
    # per request: a two-pass tree counts for cuts 1 and 2, a one-pass tree for cut 1
    two_pass = torch.tensor([[0, 1, 2, 1], [0, 1, 1, 1]])
    before = stats.trials.clone()
    stats.update(two_pass, valid.repeat(2, 1), rejected.repeat(2, 1), torch.tensor([2, 1]))
    added = stats.trials - before
    assert added[1].sum() == 2 + 3 and added[2].sum() == 3 and added[3].sum() == 0
    # the telemetry hands the sizer the passes the verified trees were drafted with
    from eagle_vllm.engine.telemetry import observe_acceptance

    sizer = TreeSizer(max_passes=3, topk=3, max_nodes=4)
    drafted = _root_and_three_children(passes=1)
    observe_acceptance(sizer, [3], ["a"], torch.zeros(1, dtype=torch.bool), drafted, set(),
                       torch.tensor([[0, -1, -1, -1]]))  # fmt: skip
    trials = sizer.acceptance.trials
    assert trials[1].sum() > 0 and trials[2:].sum() == 0


def test_a_tree_that_comes_out_smaller_than_its_size_counts_its_empty_ranks_as_misses():
    """A 1-pass, 9-node arm holds the root's 4 children and up to 4 suffix candidates:
    where the suffix source has none, the tree has 5 nodes. Its expected tokens must be
    what such trees give (the empty ranks accept nothing), not what the few full trees
    give: measured on those alone, the arm read 2.44 tokens a step where it gave 2.24."""
    one_pass = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1]])
    full = torch.ones(1, 9, dtype=torch.bool)
    short = full.clone()
    short[0, 5:] = False  # no suffix candidates: the root and its 4 children
    sized, unsized = (
        AcceptanceStats(max_passes=2, max_nodes=9, decay=1.0, extra_depth=8) for _ in range(2)
    )
    given = []
    for step in range(400):
        # one of the root's children is accepted, each a quarter of the time; every
        # eighth tree is full, and its 4 suffix candidates are accepted too
        valid = full if step % 8 == 0 else short
        accepted = torch.zeros(1, 9, dtype=torch.bool)
        accepted[0, 1 + step % 4] = True
        accepted[0, 5:] = valid[0, 5:]
        given.append(1 + int(accepted.sum()))
        sized.update(one_pass, valid, accepted, passes=1, nodes=9)
        unsized.update(one_pass, valid, accepted, passes=1)
    mean_given = sum(given) / len(given)  # 2.5
    assert abs(sized.expected_tokens(1, 9) - mean_given) < 0.02
    assert unsized.expected_tokens(1, 9) > mean_given + 0.4  # the full trees' ranks
    # the 5-node cut is measured by every tree; only the tree's own cut counts its
    # empty ranks (more passes would have filled them)
    assert abs(sized.expected_tokens(1, 5) - 2.0) < 0.02
    assert sized.trials[2].sum() == 0
    # what such trees verify: 5 nodes, 9 one time in eight; a size never drafted is full
    assert abs(sized.expected_nodes(1, 9) - 5.5) < 0.02
    assert sized.expected_nodes(1, 5) == 5 and sized.expected_nodes(2, 9) == 9
    # per request: one tree drafted for 9 nodes, one for 5, both verified with 5
    before = sized.trials.clone()
    sized.update(one_pass.repeat(2, 1), short.repeat(2, 1), torch.zeros(2, 9, dtype=torch.bool),
                 passes=1, nodes=torch.tensor([9, 5]))  # fmt: skip
    added = sized.trials - before
    assert added[1, 1:5].tolist() == [2, 2, 2, 2] and added[1, 5:].tolist() == [1, 1, 1, 1]
    # a request whose drafts were not verified as drafted (no root) counts nothing
    before = sized.trials.clone()
    sized.update(one_pass, torch.zeros(1, 9, dtype=torch.bool), torch.zeros(1, 9, dtype=torch.bool),
                 passes=1, nodes=9)  # fmt: skip
    assert torch.equal(sized.trials, before)
    # the telemetry hands the sizer the size the trees were drafted for
    from eagle_vllm.engine.telemetry import observe_acceptance

    sizer = TreeSizer(max_passes=2, topk=3, max_nodes=6)
    drafted = _root_and_three_children(passes=1, nodes=6)
    observe_acceptance(sizer, [3], ["a"], torch.zeros(1, dtype=torch.bool), drafted, set(),
                       torch.tensor([[0, -1, -1, -1]]))  # fmt: skip
    assert sizer.acceptance.trials[1, 1:6].tolist() == [1, 1, 1, 1, 1]


def test_an_arm_whose_trees_come_out_smaller_costs_what_trees_of_their_size_do():
    """The verify cost of an arm is that of the trees it verifies: a 1-pass 9-node arm
    whose trees hold 7 nodes costs what 7-node trees do, interpolated between the
    sizes measured around 7; an arm never drafted needs its own size measured."""
    from eagle_vllm.sizing.costs import verify_cost_at

    verify = {1: 0.010, 4: 0.016, 6: 0.020, 9: 0.026}
    assert verify_cost_at(verify, 9.0, 9) == 0.026
    assert verify_cost_at(verify, 8.7, 9) == 0.026  # full within rounding
    assert verify_cost_at(verify, 7.0, 9) == pytest.approx(0.022)
    assert verify_cost_at(verify, 6.0, 9) == 0.020
    assert verify_cost_at(verify, 7.0, 13) == pytest.approx(0.022)  # 13 never measured
    assert verify_cost_at(verify, 13.0, 13) is None
    assert verify_cost_at({9: 0.026}, 7.0, 9) == 0.026  # nothing measured below 7

    # In the sizer: steps are charged to the nodes verified per request, and the 9-node
    # arm, whose trees came out at 5 nodes with a full one every eighth step (the
    # telemetry's mean), is priced between the 5- and 6-node costs.
    from eagle_vllm.engine.step import DraftedTrees
    from eagle_vllm.engine.telemetry import observe_acceptance
    from eagle_vllm.tree import DraftTree

    sizer = TreeSizer(max_passes=1, topk=4, max_nodes=9, extra_nodes=4, extra_depth=4)
    assert (1, 9) in sizer.arms
    seconds = {1: 0.040, 5: 0.048, 6: 0.050, 9: 0.056}  # verify cost per node count
    for size, cost in seconds.items():
        for _ in range(3):
            sizer.observe_verify(1, size, cost)
    sizer.observe_draft(1, 1, 0.004)
    for step in range(16):
        full = step % 8 == 0
        n = 9 if full else 5
        tree = DraftTree(
            tokens=torch.arange(n)[None],
            parents=torch.tensor([[-1, 0, 0, 0, 0, 1, 5, 6, 7][:n]]),
            depths=torch.tensor([[0, 1, 1, 1, 1, 2, 3, 4, 5][:n]]),
            num_nodes=torch.tensor([n]),
            scores=-torch.arange(n, dtype=torch.float32)[None],
        )
        drafted = DraftedTrees(req_ids=["a"], tree=tree, passes=1, nodes=9,
                               pass_depths=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1][:n]]))  # fmt: skip
        verified = observe_acceptance(sizer, [n - 1], ["a"], torch.zeros(1, dtype=torch.bool),
                                      drafted, set(), torch.tensor([[0, 1, -1, -1, -1]]))  # fmt: skip
        assert verified == n
    # ranks 5-8 filled 2 times in 16, with one pseudo-trial filled: 3 / 17
    assert abs(sizer.expected_nodes((1, 9)) - (1 + 4 + 4 * 3 / 17)) < 0.02
    assert 0.048 + 0.004 < sizer.cost(1, (1, 9)) < 0.050 + 0.004
    # at 4 requests a step is charged to its mean tree: [9, 5, 5, 5] nodes verify 6 each
    assert observe_acceptance(sizer, [8, 4, 4, 4], list("abcd"), torch.zeros(4, dtype=torch.bool),
                              None, set(), None) == 6  # fmt: skip
    assert observe_acceptance(sizer, [1, 0, 0, 0], list("abcd"), torch.zeros(4, dtype=torch.bool),
                              None, set(), None) == 2  # fmt: skip


def test_an_exploration_renews_only_the_sample_it_takes():
    """An exploration renews the window its step is charged to. Where the step is charged
    to another size than expected (trees that came out smaller), the renewal must not
    stay pending and later reset the window of the size it named."""
    from eagle_vllm.sizing.costs import CostModel

    costs = CostModel(list(range(1, 10)), [1], window=9)
    for step in range(5):
        costs.observe("verify", 4, 9, 0.090, GREEDY, step)
    costs.renew[(GREEDY, "verify", 4)] = (9, 0)  # expected: a 9-node step, fresh window
    costs.observe("verify", 4, 7, 0.080, GREEDY, 5)  # charged to 7 nodes instead
    costs.observe("verify", 4, 9, 0.095, GREEDY, 6)  # a later 9-node step
    assert len(costs.bucket[GREEDY]["verify"][(4, 9)].samples) == 6
    costs.renew[(GREEDY, "verify", 4)] = (9, 2)  # charged as expected: two old ones kept
    costs.observe("verify", 4, 9, 0.100, GREEDY, 7)
    assert list(costs.bucket[GREEDY]["verify"][(4, 9)].samples) == [0.090, 0.095, 0.100]


def test_a_deeper_cut_is_expected_to_give_at_least_what_a_shallower_one_does():
    """A deeper cut ranks a superset of a shallower cut's nodes: a depth measured seldom,
    its rates near the prior, must not read worse than the depth in use."""
    stats = AcceptanceStats(max_passes=2, max_nodes=4, decay=1.0)
    chain = torch.tensor([[0, 1, 1, 1]])
    accepted = torch.tensor([[False, True, False, False]])
    for _ in range(20):
        stats.update(chain, torch.ones(1, 4, dtype=torch.bool), accepted, passes=1)
    assert stats.expected_tokens(1, 2) > 1.9  # the first draft is accepted every time
    for m in range(2, 5):
        assert stats.expected_tokens(2, m) >= stats.expected_tokens(1, m)


def _charge(sizer: TreeSizer, step: dict, period: float) -> None:
    """The runner's accounting of one finished step, with only the sizer it feeds."""
    from eagle_vllm.engine.step import StepRecord
    from eagle_vllm.engine.telemetry import charge_step

    names = {"draft": "draft_seconds", "catch_up": "catch_up_seconds"}
    fields = {names.get(k, k): v for k, v in step.items()}
    charge_step(sizer, StepRecord(started=0.0, draft_ran=True, **fields), period)


def test_a_prefill_step_is_charged_to_no_arm():
    """The drafter's first pass over a prompt runs whatever the arm; charged to the arm of
    a prefill step it made drafts-off look dearer than drafting while requests arrive."""
    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    prefill = {"batch": 4, "passes": 0, "draft": 0.030, "verified_nodes": 1,
               "decode_only": False}  # fmt: skip
    _charge(sizer, prefill, period=0.090)
    assert not sizer.draft_cost and not sizer.verify_cost
    decode = {**prefill, "draft": 0.001, "decode_only": True}
    _charge(sizer, decode, period=0.051)
    assert sizer.draft_cost[(4, 0)].value == pytest.approx(0.001)
    assert sizer.verify_cost[(4, 1)].value == pytest.approx(0.050)


def test_a_step_without_drafts_ages_acceptance_like_an_empty_update():
    """Drafts-off steps skip the per-request update (runner._sample) and only age the
    statistics; that must be what an update with nothing drafted did."""
    aged, updated = (AcceptanceStats(max_passes=2, max_nodes=4, decay=0.9) for _ in range(2))
    depths = torch.tensor([[0, 1, 2, 1]])
    accepted = torch.tensor([[False, True, False, False]])
    for stats in (aged, updated):
        stats.update(depths, torch.ones(1, 4, dtype=torch.bool), accepted)
    for _ in range(5):
        aged.age()
        updated.update(
            torch.zeros(3, 1, dtype=torch.int64),
            torch.ones(3, 1, dtype=torch.bool),
            torch.zeros(3, 1, dtype=torch.bool),
        )
    assert torch.equal(aged.hits, updated.hits) and torch.equal(aged.trials, updated.trials)
    assert aged.trials[2, 1] < 1.0  # it did age


class SimulatedEngine:
    """Costs and acceptance of a made-up machine: verifying extra tokens is cheap at batch 1
    and expensive at large batches; a draft pass costs a fixed share of a step."""

    def __init__(self, rate: float, draft_pass: float, per_token: float, base: float = 1.0):
        self.rate, self.draft_pass, self.per_token, self.base = rate, draft_pass, per_token, base
        self.sampled_per_token = per_token  # a verified token's cost when some request samples
        # acceptance drawn from a low-discrepancy sequence instead of at random: any
        # window of steps accepts ``rate`` of its nodes, for tests of thresholds finer
        # than the sampling noise of a window of trials
        self.stratified = False
        self._draws = 0

    def verify_seconds(self, batch: int, nodes: int, sampled: bool = False) -> float:
        per_token = self.sampled_per_token if sampled else self.per_token
        return self.base + per_token * batch * (nodes - 1)

    def draft_seconds(self, batch: int, passes: int) -> float:
        return 0.05 + self.draft_pass * passes * (1 + 0.02 * batch)

    def accepted(self, batch: int, nodes: int, gen: torch.Generator) -> torch.Tensor:
        """A chain-shaped tree: node i is accepted if all its ancestors are, w.p. rate each."""
        if self.stratified:  # Weyl sequences, one irrational step per node
            index = torch.arange(self._draws, self._draws + batch, dtype=torch.float64)
            self._draws += batch
            steps = torch.tensor([2.0, 3.0, 5.0, 7.0, 11.0, 13.0, 17.0, 19.0][:nodes]).sqrt()
            ok = torch.frac(index[:, None] * steps.to(torch.float64)[None, :]) < self.rate
        else:
            ok = torch.rand(batch, nodes, generator=gen) < self.rate
        ok[:, 0] = True
        return torch.cumprod(ok.to(torch.int64), dim=1).bool()

    def tokens_per_second(self, batch: int, arm) -> float:
        d, m = arm
        expected = 1 + sum(self.rate**i for i in range(1, m)) if d else 1.0
        return expected / (self.verify_seconds(batch, m) + self.draft_seconds(batch, d))


def run(
    sizer: TreeSizer,
    engine: SimulatedEngine,
    batch: int,
    steps: int,
    seed: int = 0,
    sampled: bool = False,
):
    """``steps`` steps of ``batch`` requests, all greedy or all sampling (``sampled``)."""
    gen = torch.Generator().manual_seed(seed)
    last_nodes = 1
    for _ in range(steps):
        cost = engine.verify_seconds(batch, last_nodes, sampled)
        sizer.observe_verify(batch, last_nodes, cost, sampled)
        d, m = sizer.decide(batch, num_sampled=batch if sampled else 0)
        sizer.observe_draft(batch, d, engine.draft_seconds(batch, d), sampled)
        if d:
            # chain-shaped trees, as deep as d passes reach (the nodes past depth d
            # rank as siblings at depth d)
            depths = torch.arange(m).clamp(max=d)[None, :].repeat(batch, 1)
            valid = torch.ones(batch, m, dtype=torch.bool)
            rows = torch.full((batch,), sampled)
            accepted = engine.accepted(batch, m, gen)
            sizer.observe_acceptance(depths, valid, accepted, rows, passes=d)
        last_nodes = m
    return sizer.history[-50:]


def best_arm(engine, batch, arms):
    return max(arms, key=lambda a: engine.tokens_per_second(batch, a))


def test_picks_the_fastest_arm_and_shrinks_with_load():
    engine = SimulatedEngine(rate=0.8, draft_pass=0.05, per_token=0.02)
    chosen = {}
    for batch in (1, 4, 16, 64):
        sizer = TreeSizer(max_passes=4, topk=1, max_nodes=5, explore_every=1000)
        history = run(sizer, engine, batch, steps=400)
        arms = [tuple(h[1:]) for h in history]
        chosen[batch] = max(set(arms), key=arms.count)
        truth = best_arm(engine, batch, sizer.arms)
        # within 3% of the true optimum's throughput
        assert engine.tokens_per_second(batch, chosen[batch]) >= 0.97 * engine.tokens_per_second(
            batch, truth
        ), (batch, chosen[batch], truth)
    sizes = [chosen[b][1] for b in (1, 4, 16, 64)]
    assert sizes == sorted(sizes, reverse=True), chosen  # the tree shrinks as load grows
    assert chosen[1][1] >= 4  # cheap verification, good drafts: a long chain at batch 1
    assert chosen[64] == OFF  # verifying drafts for 64 requests costs more than it gains


def test_switches_off_when_drafts_are_never_accepted_and_back_on_when_they_are():
    engine = SimulatedEngine(rate=0.0, draft_pass=0.05, per_token=0.01)
    sizer = TreeSizer(max_passes=3, topk=1, max_nodes=4, explore_every=16)
    history = run(sizer, engine, batch=1, steps=300)
    arms = [tuple(h[1:]) for h in history]
    assert arms.count(OFF) >= 45  # off except for the periodic re-measurement
    engine.rate = 0.9  # the workload turns predictable (e.g. code)
    # back on within ~30 s of batch-1 decoding on CPU: the stale evidence that drafts
    # fail decays while probes (every 16 steps, backing off to 128) measure the new rate
    history = run(sizer, engine, batch=1, steps=1000, seed=1)
    arms = [tuple(h[1:]) for h in history]
    assert max(set(arms), key=arms.count) == (3, 4)


def test_measurements_follow_the_machine():
    """A slower verify (e.g. another tenant) is picked up by the moving averages."""
    engine = SimulatedEngine(rate=0.6, draft_pass=0.02, per_token=0.001)
    sizer = TreeSizer(max_passes=3, topk=1, max_nodes=4, explore_every=8)
    history = run(sizer, engine, batch=8, steps=200)
    arms = [tuple(h[1:]) for h in history]
    assert max(set(arms), key=arms.count) != OFF
    engine.per_token = 1.0
    history = run(sizer, engine, batch=8, steps=400, seed=2)
    arms = [tuple(h[1:]) for h in history]
    assert max(set(arms), key=arms.count) == OFF


def test_a_stale_expensive_measurement_does_not_lock_an_arm_out():
    """Drafts-off steps first measured in a slow phase (here 3x their cost: a warm-up, a
    prefill burst) must be re-measured and chosen once they are the best arm; a stale
    window must not keep the sizer on a worse arm (seen at 64 requests on CPU)."""

    class SlowStart(SimulatedEngine):
        off_calls = 0

        def verify_seconds(self, batch, nodes, sampled=False):
            if nodes == 1:
                self.off_calls += 1
                if self.off_calls <= 12:
                    return 3 * super().verify_seconds(batch, nodes)
            return super().verify_seconds(batch, nodes)

    engine = SlowStart(rate=0.3, draft_pass=0.05, per_token=0.02)
    truth = SimulatedEngine(rate=0.3, draft_pass=0.05, per_token=0.02)
    assert best_arm(truth, 64, candidate_sizes(3, 1, 4)) == OFF
    sizer = TreeSizer(max_passes=3, topk=1, max_nodes=4, explore_every=16)
    history = run(sizer, engine, batch=64, steps=400)
    arms = [tuple(h[1:]) for h in history]
    assert arms.count(OFF) >= 45, arms


def test_benchmark_pin_must_name_an_arm(monkeypatch):
    import pytest

    from eagle_vllm.engine.runner import _pinned_size

    sizer = TreeSizer(max_passes=3, topk=1, max_nodes=4)
    monkeypatch.delenv("EAGLE_VLLM_SIZER_PIN", raising=False)
    assert _pinned_size(sizer) is None
    monkeypatch.setenv("EAGLE_VLLM_SIZER_PIN", "0,1")
    assert _pinned_size(sizer) == OFF
    for bad in ("5,9", "x"):
        monkeypatch.setenv("EAGLE_VLLM_SIZER_PIN", bad)
        with pytest.raises(ValueError, match="EAGLE_VLLM_SIZER_PIN.*Fix"):
            _pinned_size(sizer)


def test_deferred_draft_kv_is_not_charged_to_the_step_that_writes_it():
    """A step that writes draft KV deferred by earlier drafts-off steps (catch_up) must
    not make its own tree look dearer: neither its drafting nor the rest of its step."""
    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    step = {"batch": 4, "passes": 1, "draft": 0.002, "catch_up": 0.050, "verified_nodes": 2,
            "decode_only": True}  # fmt: skip
    _charge(sizer, step, period=0.062)
    assert sizer.draft_cost[(4, 1)].value == pytest.approx(0.002)
    assert sizer.verify_cost[(4, 2)].value == pytest.approx(0.010)


def _calibrated_sizer() -> TreeSizer:
    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    # no drafts clearly best at 16 requests (by 30%: beyond the hysteresis), a tree at 1
    engine = SimulatedEngine(rate=0.8, draft_pass=0.1, per_token=0.1)
    run(sizer, engine, batch=1, steps=120)
    run(sizer, engine, batch=16, steps=120)
    return sizer


def test_a_profile_lets_a_new_engine_start_without_exploring():
    """eagle-vllm calibrate writes export_profile(); an engine seeded with it picks the
    best arm at once in every calibrated bucket instead of trying each arm."""
    import json

    from eagle_vllm.sizing import OFF

    calibrated = _calibrated_sizer()
    profile = json.loads(json.dumps(calibrated.export_profile()))  # through JSON, as on disk
    fresh = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    fresh.load_profile(profile)
    for batch in (1, 16):
        best = calibrated.choose(batch).arm
        first = [fresh.decide(batch) for _ in range(6)]
        # no exploration; where a tree wins, no drafts is probed first (twice), its cost
        # known only from the profile
        probe = [OFF, OFF] if best != OFF else [best, best]
        assert first == probe + [best] * 4, first
    assert fresh.decide(1) != OFF and fresh.decide(16) == OFF  # the simulated machine's best
    _assert_same_rates(fresh.acceptance, calibrated.acceptance)
    # an uncalibrated bucket still explores, starting with no drafts
    assert fresh.decide(64) == OFF


def test_a_profile_for_another_tree_bound_or_malformed_is_refused():
    from eagle_vllm.sizing import check_profile

    profile = _calibrated_sizer().export_profile()
    check_profile(profile, 2, 2, 4)
    with pytest.raises(ValueError, match="made for num_speculative_tokens/topk/root_topk"):
        check_profile(profile, 3, 2, 4)
    # a wider root changes the arms: the profile of a narrower one is refused
    with pytest.raises(ValueError, match=r"\(2, 2, 2, 4\), the config has \(2, 2, 3, 4\)"):
        check_profile(profile, 2, 2, 4, root_topk=3)
    # profiles written before root_topk was a key were made with the root topk wide
    older = {k: v for k, v in profile.items() if k != "root_topk"}
    check_profile(older, 2, 2, 4)
    with pytest.raises(ValueError, match="root_topk"):
        check_profile(older, 2, 2, 4, root_topk=4)
    with pytest.raises(ValueError, match="not an eagle-vllm sizing profile"):
        check_profile({"verify_seconds": {}}, 2, 2, 4)
    broken = {**profile, "verify_seconds": {"1,x": 0.1}}
    with pytest.raises(ValueError, match="malformed"):
        check_profile(broken, 2, 2, 4)
    negative = {**profile, "draft_seconds": {"1,1": -0.1}}
    with pytest.raises(ValueError, match="malformed"):
        check_profile(negative, 2, 2, 4)
    with pytest.raises(ValueError, match="Fix: make it with `eagle-vllm calibrate`"):
        check_profile({**profile, "eagle_vllm_sizing_profile": 99}, 2, 2, 4)


def test_seldom_verified_nodes_promise_no_more_than_better_ranked_ones():
    """Node 1 verified often and accepted a quarter of the time; nodes 2.. never verified.
    Their prior (0.5) must not make a big tree look better than the measured node: a
    tree of depth 2 yields at most 3 tokens, and a node ranks below node 1's rate."""
    stats = AcceptanceStats(max_passes=2, max_nodes=16, decay=1.0)
    depths = torch.tensor([[0, 1]]).repeat(40, 1)
    accepted = torch.zeros(40, 2, dtype=torch.bool)
    accepted[:10, 1] = True
    stats.update(depths, torch.ones(40, 2, dtype=torch.bool), accepted)
    rates = stats.rates(2)[1:]
    assert rates[0] == pytest.approx(10.5 / 41)
    assert bool((rates[1:] <= rates[:-1]).all())  # never rising with rank
    assert stats.expected_tokens(2, 16) <= 3.0
    assert stats.expected_tokens(1, 2) == pytest.approx(1 + 10.5 / 41)


def test_nodes_with_few_trials_lean_on_the_better_ranked_node_not_a_flat_prior():
    """A calibration profile's counts, scaled to 64 trials of the first draft, leave the
    low ranks with a few trials each (SmolLM2 on CPU: ranks 3-15 under 4). Under a flat
    prior of 0.5 they read 0.17 each and a 16-node tree of 3 passes promised 3.8 tokens
    a step, where the measured rates give under 1.8. A rank never verified still starts
    at its better-ranked neighbour's rate: worth trying when that one is good."""
    measured = [0.0, 0.45, 0.15, 0.08, 0.04, 0.08] + [0.0] * 10  # rates by rank
    trials = torch.tensor([0.0, 252, 76, 14, 10, 10] + [1.9] * 3 + [1.15] * 4 + [0.78] * 3)
    hits = trials * torch.tensor(measured, dtype=torch.float64)
    stats = AcceptanceStats(max_passes=3, max_nodes=16)
    stats.set_rates_from(hits.repeat(4, 1), trials.repeat(4, 1), weight=64.0)
    assert stats.trials[3, 3] < 4
    assert stats.expected_tokens(3, 16) < 1.0 + sum(measured) + 0.2  # 1.8 measured
    assert stats.rates(3)[1] == pytest.approx((0.45 * 64 + 0.5) / 65)

    fresh = AcceptanceStats(max_passes=1, max_nodes=4, decay=1.0)
    depths = torch.tensor([[0, 1]]).repeat(100, 1)
    accepted = torch.ones(100, 2, dtype=torch.bool)
    fresh.update(depths, torch.ones(100, 2, dtype=torch.bool), accepted)
    # ranks 2-3 never verified: at rank 1's rate (100.5 / 101), not at 0.5
    assert torch.allclose(fresh.rates(1)[1:], torch.full((3,), 100.5 / 101, dtype=torch.float64))


def test_drafting_needs_a_margin_to_start_and_half_of_it_to_go_on():
    """A tree must predict 5% more throughput than no drafts to start drafting and 2.5%
    more to keep drafting: a 2% edge does not start it, a 15% edge does, a 4% edge keeps
    it going (no flipping inside the band), and drafts never accepted stop it.

    Acceptance is stratified: at random, the rate a window of ~200 decayed trials
    measures has a 2-3% spread, wider than the band's edges are from 4%, so whether a
    4% edge kept drafting depended on the seed's path."""

    def gain(engine):  # one draft's predicted throughput over no drafts'
        return engine.tokens_per_second(1, (1, 2)) / engine.tokens_per_second(1, OFF)

    def arms_after(sizer, engine, steps, seed):
        return [tuple(h[1:]) for h in run(sizer, engine, batch=1, steps=steps, seed=seed)]

    engine = SimulatedEngine(rate=0.0, draft_pass=0.05, per_token=0.1)
    engine.stratified = True
    sizer = TreeSizer(max_passes=2, topk=1, max_nodes=3, explore_every=1000)
    # (of the last 50 steps; an exploration every 1000 steps may fall among them)
    assert arms_after(sizer, engine, 400, seed=0).count(OFF) >= 49
    engine.rate = 0.166
    assert 1.0 < gain(engine) < 1.03
    assert arms_after(sizer, engine, 600, seed=1).count(OFF) >= 49  # does not start

    engine = SimulatedEngine(rate=0.40, draft_pass=0.05, per_token=0.1)
    engine.stratified = True
    assert gain(engine) > 1.15
    sizer = TreeSizer(max_passes=2, topk=1, max_nodes=3, explore_every=1000)
    assert arms_after(sizer, engine, 400, seed=2).count(OFF) <= 1  # starts
    engine.rate = 0.19
    assert 1.03 < gain(engine) < 1.05
    assert arms_after(sizer, engine, 600, seed=3).count(OFF) <= 1  # goes on
    engine.rate = 0.0
    assert arms_after(sizer, engine, 600, seed=4).count(OFF) >= 49  # stops


@pytest.mark.parametrize(
    "gain, drafting_before, drafts",
    [(1.06, False, True), (1.04, False, False), (1.04, True, True), (1.015, True, False)],
)
def test_the_band_in_which_the_sizer_keeps_its_side(gain, drafting_before, drafts):
    """The band's edges exactly, with costs and acceptance fixed: one draft must predict
    5% over no drafts to start, 2.5% to go on."""
    sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2, explore_every=10**6)
    for _ in range(3):
        sizer.observe_verify(1, 1, 1.0)
        sizer.observe_draft(1, 0, 0.05)
        sizer.observe_verify(1, 2, 1.0)
        sizer.observe_draft(1, 1, 0.05)
    rate = gain - 1.0  # same costs: throughput ratio = expected tokens = 1 + node 1's rate
    sizer.acceptance.set_counts(
        torch.tensor([[0.0, 0.0], [0.0, rate * 1e6 - 0.5]]),
        torch.tensor([[0.0, 0.0], [0.0, 1e6 - 1]]),
    )
    assert sizer.throughput(1, (1, 2)) / sizer.throughput(1, OFF) == pytest.approx(gain)
    sizer._last_best = (1, 2) if drafting_before else OFF
    assert (sizer.choose(1).arm != OFF) == drafts


def test_explorations_back_off_while_no_drafts_keeps_winning():
    """At a load where no tree wins, each exploration costs a drafting step: they come
    ever less often (every 32 steps at first, at most every 256), and every 32 steps
    again once a tree wins."""
    engine = SimulatedEngine(rate=0.3, draft_pass=0.05, per_token=0.02)
    assert best_arm(engine, 64, candidate_sizes(3, 1, 4)) == OFF
    sizer = TreeSizer(max_passes=3, topk=1, max_nodes=4, explore_every=32)
    run(sizer, engine, batch=64, steps=3000)
    late = [tuple(h[1:]) for h in sizer.history[-2000:]]
    assert 2000 // 256 <= sum(a != OFF for a in late) <= 2000 // 256 + 2, late
    engine.rate, engine.per_token = 0.9, 0.0005  # cheap verification, good drafts
    history = run(sizer, engine, batch=64, steps=800, seed=3)
    arms = [tuple(h[1:]) for h in history]
    assert max(set(arms), key=arms.count) != OFF
    assert sizer._explore_interval == 32


def test_while_a_tree_wins_no_drafts_is_probed_and_its_window_kept():
    """The hysteresis holds on to the side it is on, so the other side's cost must stay
    current: while a tree wins, half the explorations probe no drafts, and a probe adds
    a sample (a median of several) instead of replacing the window with one."""
    engine = SimulatedEngine(rate=0.8, draft_pass=0.02, per_token=0.001)
    assert best_arm(engine, 4, candidate_sizes(3, 1, 4)) != OFF
    sizer = TreeSizer(max_passes=3, topk=1, max_nodes=4, explore_every=16)
    run(sizer, engine, batch=4, steps=200)
    late = [tuple(h[1:]) for h in sizer.history[-160:]]
    assert late.count(OFF) >= 2 * (160 // 32), late  # one probe in every two explorations
    assert len(sizer.verify_cost[(4, 1)].samples) >= 3
    # two drafts-off steps per probe: the runner measures no drafts only in the second
    runs = "".join("o" if a == OFF else "t" for a in late).strip("o").split("t")
    assert {len(r) for r in runs if r} == {2}, late


def test_the_step_where_drafting_resumes_is_not_charged_to_no_drafts():
    """It verifies no drafts but costs more than a drafts-off step that follows another
    (vLLM's bookkeeping around the first drafts): its drafting is charged to the passes,
    the rest to nothing."""
    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    resume = {"batch": 4, "passes": 1, "draft": 0.006, "catch_up": 0.010, "verified_nodes": 1,
              "decode_only": True}  # fmt: skip
    _charge(sizer, resume, period=0.070)
    assert sizer.draft_cost[(4, 1)].value == pytest.approx(0.006)
    assert (4, 1) not in sizer.verify_cost
    steady_off = {**resume, "passes": 0, "draft": 0.0003, "catch_up": 0.0}
    _charge(sizer, steady_off, period=0.0473)
    assert sizer.verify_cost[(4, 1)].value == pytest.approx(0.047)
    # what resuming cost beyond a drafts-off step (its catch-up included) prices the
    # explorations of trees while no drafts wins
    off = sizer.costs.kind_cost(4, "verify", 1, GREEDY)
    assert sizer.costs.resume_cost(4, GREEDY, off) == pytest.approx(0.070 - 0.006 - 0.047)


def test_a_loads_tail_at_a_smaller_batch_does_not_decide_for_the_full_batch():
    """Requests finishing leave a few steps at a smaller batch in the same bucket. Costs
    are kept per exact batch size too, so one draft being cheap at 3 requests (where it
    wins) does not make it look cheap at 4 (where it loses by 19%)."""

    class Tails(SimulatedEngine):
        def verify_seconds(self, batch, nodes, sampled=False):
            return 1.8 if (batch, nodes) == (4, 2) else 1.0

        def draft_seconds(self, batch, passes):
            return 0.05 + 0.02 * passes

    engine = Tails(rate=0.5, draft_pass=0.0, per_token=0.0)
    assert engine.tokens_per_second(4, (1, 2)) < 0.85 * engine.tokens_per_second(4, OFF)
    assert engine.tokens_per_second(3, (1, 2)) > 1.4 * engine.tokens_per_second(3, OFF)
    sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2, explore_every=1000)
    for cycle in range(6):
        run(sizer, engine, batch=4, steps=40, seed=cycle)
        for _ in range(8):  # the tail drafted (say, the tree it was on before): cheap there
            sizer.observe_draft(3, 1, engine.draft_seconds(3, 1))
            sizer.observe_verify(3, 2, engine.verify_seconds(3, 2))
    full_batch = [tuple(h[1:]) for h in sizer.history if h[0] == 4][40:]  # after the first cycle
    assert full_batch.count(OFF) == 5 * 40, full_batch


def test_acceptance_is_kept_per_temperature_class():
    """Sampled requests accept fewer drafts than greedy ones. With one table, a sampled
    load taught the sizer that drafts fail, and the greedy load after it ran without
    drafts until explorations relearned it; per class, greedy drafts again at once."""
    greedy = SimulatedEngine(rate=0.8, draft_pass=0.05, per_token=0.02)
    sampled = SimulatedEngine(rate=0.02, draft_pass=0.05, per_token=0.02)
    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    run(sizer, greedy, batch=1, steps=150)
    assert sizer.history[-1][1] > 0  # greedy drafts
    # (the sampled class starts from the greedy rates and unlearns them over ~150 steps)
    tail = run(sizer, sampled, batch=1, steps=200, sampled=True)
    assert sum(d == 0 for _, d, _ in tail) >= 45, tail  # sampled: no drafts but probes
    back = run(sizer, greedy, batch=1, steps=5)[-5:]
    assert back[0][1] > 0, back  # at once
    # (the only drafts-off steps: one probe of no drafts, if an exploration falls due)
    assert sum(d == 0 for _, d, _ in back) <= 2, back


def test_a_mixed_batch_expects_the_classes_weighted_by_their_share():
    sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2)
    hits = torch.zeros(2, 2, dtype=torch.float64)
    trials = torch.zeros(2, 2, dtype=torch.float64)
    trials[1, 1] = 1000.0
    for cls, rate in (("greedy", 0.8), ("sampled", 0.2)):
        hits[1, 1] = rate * 1000.0
        sizer.acceptance_of[cls].set_counts(hits.clone(), trials.clone())
    e_greedy = sizer.acceptance_of["greedy"].expected_tokens(1, 2)
    e_sampled = sizer.acceptance_of["sampled"].expected_tokens(1, 2)
    assert e_greedy == pytest.approx(1.8, abs=1e-3) and e_sampled == pytest.approx(1.2, abs=1e-3)
    for num_sampled, want in (
        (0, e_greedy),
        (4, e_sampled),
        (1, 0.75 * e_greedy + 0.25 * e_sampled),
    ):
        assert sizer.expected_tokens((1, 2), num_sampled / 4) == pytest.approx(want)


def test_a_new_class_starts_from_the_others_rates_and_learns_its_own_fast():
    """A sampled load after a greedy profile starts from the greedy rates, not from the
    optimistic prior (0.5 a node), and a few steps of its own outvote them."""
    sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2)
    hits = torch.zeros(2, 2, dtype=torch.float64)
    trials = torch.zeros(2, 2, dtype=torch.float64)
    hits[1, 1], trials[1, 1] = 350.0, 1000.0  # greedy: E(1, 2) = 1.35
    sizer.acceptance.set_counts(hits, trials)
    assert sizer.expected_tokens((1, 2), 1.0) == pytest.approx(1.35, abs=0.02)  # prior: 1.5
    depths = torch.tensor([[0, 1]]).repeat(4, 1)
    valid = torch.ones(4, 2, dtype=torch.bool)
    accepted = torch.tensor([[True, True], [True, False], [True, False], [True, False]])
    for _ in range(6):  # a quarter of the drafts accepted
        sizer.observe_acceptance(depths, valid, accepted, torch.ones(4, dtype=torch.bool))
    assert sizer.expected_tokens((1, 2), 1.0) < 1.29
    assert sizer.acceptance.expected_tokens(1, 2) == pytest.approx(1.35, abs=1e-3)  # untouched


def test_a_profile_carries_both_classes():
    import json

    sizer = _calibrated_sizer()
    assert "acceptance_sampled" not in sizer.export_profile()  # calibration runs at T=0
    run(sizer, SimulatedEngine(rate=0.1, draft_pass=0.05, per_token=0.02), 1, 50, sampled=True)
    profile = json.loads(json.dumps(sizer.export_profile()))
    assert "acceptance_sampled" in profile
    fresh = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    fresh.load_profile(profile)
    for cls in ("greedy", "sampled"):
        _assert_same_rates(fresh.acceptance_of[cls], sizer.acceptance_of[cls])


def _assert_same_rates(loaded, source) -> None:
    """A loaded profile keeps every acceptance rate, at the weight of at most
    PROFILE_TRIALS verified drafts of any node."""
    from eagle_vllm.sizing import PROFILE_TRIALS

    for d in range(source.max_passes + 1):
        assert torch.allclose(loaded.rates(d), source.rates(d), atol=0.02)
    raw = source.hits / source.trials.clamp(min=1e-9)
    seen = source.trials > 0
    assert torch.allclose((loaded.hits / loaded.trials.clamp(min=1e-9))[seen], raw[seen])
    assert float(loaded.trials.max()) == pytest.approx(
        min(PROFILE_TRIALS, float(source.trials.max()))
    )


def _one_draft_profile(verify: dict, draft: dict, hits: float, trials: float) -> dict:
    """A profile for a one-draft sizer (off or one draft) at 4 requests: seconds per step
    by tree nodes and by draft passes, and node 1's acceptance counts."""
    return {
        "eagle_vllm_sizing_profile": 1,
        "depth": 1,
        "topk": 1,
        "max_nodes": 2,
        "verify_seconds": {f"4,{n}": s for n, s in verify.items()},
        "draft_seconds": {f"4,{d}": s for d, s in draft.items()},
        "acceptance": {"hits": [[0.0, 0.0], [0.0, hits]], "trials": [[0.0, 0.0], [0.0, trials]]},
    }


def _serve_at_four(sizer, verify: dict, draft: dict, accept: float, steps: int) -> list:
    """``steps`` steps of 4 requests at these live costs (by nodes, by passes), each draft
    accepted with probability ``accept``; the arms chosen."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        d, m = sizer.decide(4)
        sizer.observe_draft(4, d, draft[d])
        if d:
            accepted = torch.rand(4, 2, generator=gen) < accept
            accepted[:, 0] = True
            depths = torch.tensor([[0, 1]]).repeat(4, 1)
            sizer.observe_acceptance(depths, torch.ones(4, 2, dtype=torch.bool), accepted)
        sizer.observe_verify(4, m, verify[m])
    return [tuple(h[1:]) for h in sizer.history]


def _serve_one_draft_at_four(
    hits: float, trials: float, profile_speed: float, steps: int
) -> list[tuple[int, int]]:
    """A one-draft sizer (off or one draft) loaded with a profile of these acceptance
    counts, with costs ``profile_speed`` times the live ones, serving 4 requests that
    accept 10% of drafts; the arms it chose."""
    verify = {1: 0.041, 2: 0.052}  # live seconds per step at 4 requests, by tree nodes
    draft = {0: 0.001, 1: 0.006}  # by draft passes
    sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2)
    sizer.load_profile(
        _one_draft_profile(
            {n: profile_speed * s for n, s in verify.items()},
            {d: profile_speed * s for d, s in draft.items()},
            hits,
            trials,
        )
    )
    return _serve_at_four(sizer, verify, draft, 0.1, steps)


@pytest.mark.parametrize("profile_trials", [None, 1e9])
def test_live_acceptance_outvotes_a_profile_made_on_other_prompts(profile_trials, monkeypatch):
    """A profile calibrated on chat (561 drafts accepted half the time) served to code
    that accepts 10%: the sizer turns drafts off within a few steps at 4 requests. The
    profile at full weight (1e9: every count of the profile) keeps drafting for over 30
    steps; served that way, HumanEval at batch 4 ran at 0.88x vanilla."""
    import eagle_vllm.sizing.policy as sizing

    if profile_trials is not None:
        monkeypatch.setattr(sizing, "PROFILE_TRIALS", profile_trials)
    choices = _serve_one_draft_at_four(hits=280.0, trials=561.0, profile_speed=1.0, steps=50)
    assert choices[:2] == [OFF, OFF]  # no drafts probed first: its cost is the profile's
    assert choices[2] == (1, 2)  # the profile's acceptance: drafting wins at first
    drafted = sum(c != OFF for c in choices[2:26])
    if profile_trials is None:
        assert drafted <= 8, choices  # off after a few steps, bar the odd exploration
    else:
        assert drafted >= 20, choices  # the old weighting: still drafting


def test_profile_costs_follow_the_machine_s_drift_since_calibrating():
    """A profile made when the machine was 30% slower: the arm in use is measured live
    at once, its competitors only by the profile. Unscaled, no drafts looked 30% dear
    next to the live tree; costs only the profile has measured are scaled by the
    live/profile ratio of the bucket's measured ones."""
    verify = {1: 0.041, 2: 0.052}  # live seconds per step at 4 requests, by tree nodes
    draft = {0: 0.001, 1: 0.006}  # by draft passes
    slower = {n: 1.3 * s for n, s in verify.items()}, {d: 1.3 * s for d, s in draft.items()}
    sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2)
    sizer.load_profile(_one_draft_profile(*slower, hits=18.0, trials=40.0))
    for _ in range(3):  # the tree in use, measured live
        sizer.observe_verify(4, 2, verify[2])
        sizer.observe_draft(4, 1, draft[1])
    assert sizer.costs.kind_cost(4, "verify", 1, GREEDY) == pytest.approx(verify[1])
    assert sizer.cost(4, OFF) == pytest.approx(verify[1] + draft[0])


def test_costs_are_kept_per_sampling_mode():
    """Verification costs more when a request samples (the rejection sampler's
    probabilities over the vocabulary). Here one draft wins on greedy batches and loses
    on sampled ones, at the same acceptance. Kept apart, each load's costs are its own
    from its first step when loads alternate; with one table (mode ignored), each
    switch ran several steps on the other load's costs."""
    engine = SimulatedEngine(rate=0.3, draft_pass=0.02, per_token=0.05)
    engine.sampled_per_token = 0.5
    greedy_gain = engine.tokens_per_second(1, (1, 2)) / engine.tokens_per_second(1, OFF)
    assert greedy_gain > 1.15
    assert engine.verify_seconds(1, 2, True) + engine.draft_seconds(1, 1) > 1.3 * (
        engine.verify_seconds(1, 1, True) + engine.draft_seconds(1, 0)
    )  # 1.3 tokens per step cannot pay for it
    sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2, explore_every=1000)
    run(sizer, engine, batch=1, steps=100)
    run(sizer, engine, batch=1, steps=100, seed=1, sampled=True)
    for cycle in range(4):
        greedy = [tuple(h[1:]) for h in run(sizer, engine, 1, 12, seed=2 + cycle)[-12:]]
        assert greedy.count(OFF) == 0, (cycle, greedy)
        sampled = [tuple(h[1:]) for h in run(sizer, engine, 1, 12, 9 + cycle, sampled=True)[-12:]]
        assert sampled.count(OFF) == 12, (cycle, sampled)


def test_a_profile_carries_the_sampled_mode_s_costs():
    import json

    sizer = _calibrated_sizer()
    assert "verify_seconds_sampled" not in sizer.export_profile()  # calibrated at T=0 only
    engine = SimulatedEngine(rate=0.8, draft_pass=0.1, per_token=0.1)
    engine.sampled_per_token = 0.3
    run(sizer, engine, batch=1, steps=60, sampled=True)
    profile = json.loads(json.dumps(sizer.export_profile()))
    fresh = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    fresh.load_profile(profile)
    for kind in ("verify", "draft"):
        measured = sizer.costs.bucket[SAMPLED][kind]
        assert any(size > (1 if kind == "verify" else 0) for _, size in measured)  # a tree's
        for (_, size), samples in measured.items():  # the sampled tables, as measured
            carried = fresh.costs.kind_cost(1, kind, size, SAMPLED)
            assert carried == pytest.approx(samples.value)
    # a greedy batch: the greedy costs
    for a in fresh.arms:
        if a != OFF:
            assert fresh.cost(1, a) < fresh.cost(1, a, sampled_share=1.0)


def test_explorations_spend_at_most_their_budget(monkeypatch):
    """An arm that the optimistic bound keeps calling a possible winner but that costs
    five steps (a memory cliff at a large tree): re-measuring it at every other
    exploration cost 15% of the time. Explorations may spend 5% beyond the best arm.

    The bound's per-node slope (``_verify_slope``) now sees this cliff once it is
    measured; held at zero here, the budget alone must hold the line (a cliff it cannot
    see: a tree past what was ever measured, a cost that jumps later)."""
    import eagle_vllm.sizing.policy as policy

    monkeypatch.setattr(policy, "verify_slope", lambda verify: 0.0)

    class Cliff(SimulatedEngine):
        def verify_seconds(self, batch, nodes, sampled=False):
            return {1: 1.0, 2: 1.02, 3: 1.04, 4: 5.0}[nodes]

        def draft_seconds(self, batch, passes):
            return 0.01 * passes

    engine = Cliff(rate=0.3, draft_pass=0.0, per_token=0.0)
    best = best_arm(engine, 1, candidate_sizes(3, 1, 4))

    def overhead(budget: float) -> float:
        sizer = TreeSizer(
            max_passes=3, topk=1, max_nodes=4, explore_every=16, explore_budget=budget
        )
        run(sizer, engine, batch=1, steps=400)
        late = [tuple(h[1:]) for h in run(sizer, engine, batch=1, steps=2000, seed=1)]
        late = [tuple(h[1:]) for h in sizer.history[-2000:]]
        seconds = sum(engine.verify_seconds(1, m) + engine.draft_seconds(1, d) for d, m in late)
        ideal = len(late) * (engine.verify_seconds(1, best[1]) + engine.draft_seconds(1, best[0]))
        return seconds / ideal - 1.0

    assert overhead(float("inf")) > 0.09  # without a budget (what the bound alone allows)
    assert overhead(0.05) < 0.06


def test_big_trees_are_not_explored_where_every_node_costs_a_batch_of_tokens():
    """At 64 requests each tree node adds 64 tokens to the target's forward (compute-bound
    on CPU). The optimistic bound caps a tree's gain at ``1 + d`` tokens; its cost must be
    bounded by more than a small tree's, or a 16-node tree (1024 tokens a step) "could
    still win" and is explored at several plain steps' cost."""
    engine = SimulatedEngine(rate=0.45, draft_pass=0.05, per_token=0.01)
    sizer = TreeSizer(max_passes=2, topk=4, max_nodes=16, explore_every=32)
    assert best_arm(engine, 64, sizer.arms) == OFF
    run(sizer, engine, batch=64, steps=1500)
    arms = [tuple(h[1:]) for h in sizer.history]
    assert max(m for _, m in arms) <= 4, sorted(set(arms))
    seconds = sum(engine.verify_seconds(64, m) + engine.draft_seconds(64, d) for d, m in arms)
    ideal = len(arms) * (engine.verify_seconds(64, 1) + engine.draft_seconds(64, 0))
    assert seconds / ideal - 1.0 < 0.03


def test_exploring_a_tree_while_no_drafts_wins_is_priced_with_what_resuming_costs():
    """The step where drafting resumes writes the draft KV deferred while drafts were off
    (tens of ms at 16 requests): an exploration from no drafts pays it, so its price
    includes it, and the budget allows fewer of them."""
    engine = SimulatedEngine(rate=0.4, draft_pass=0.02, per_token=0.03)
    assert best_arm(engine, 16, candidate_sizes(2, 1, 3)) == OFF

    def explorations(resume_seconds: float) -> int:
        sizer = TreeSizer(max_passes=2, topk=1, max_nodes=3, explore_every=4)
        run(sizer, engine, batch=16, steps=50)
        sizer.observe_resume(16, engine.verify_seconds(16, 1) + resume_seconds)
        run(sizer, engine, batch=16, steps=2000, seed=1)
        late = [tuple(h[1:]) for h in sizer.history[-2000:]]
        return sum(a != OFF for a in late)

    free, dear = explorations(0.0), explorations(6.0)
    # at most the budget: 5% of a step's time each step, about 6.5 steps per exploration
    assert dear <= 2000 * 0.05 * 1.05 / 6.5 + 2 and dear < free / 2, (free, dear)
    # a probe dearer than the budget can ever save up for still runs, at the budget's rate
    assert 0 < explorations(1000.0) <= 2, explorations(1000.0)


def test_a_bigger_tree_measured_cheaper_than_a_smaller_one_is_pooled_with_it():
    """Each tree size is measured alone, at its own times, on a noisy machine. A 6-node
    verify read cheaper than a 4-node one (SmolLM2 on CPU, batch 1) and the sizer picked
    two passes of 6 nodes for a cost no 6-node tree has. Verify costs are the
    least-squares non-decreasing fit of the sizes' samples: the dip is pooled with the
    sizes it undercuts, into their mean, not raised to the dearest of them (which keeps
    every stray slow sample and drops every lucky fast one)."""
    sizer = TreeSizer(max_passes=2, topk=4, max_nodes=6, explore_every=10**6)
    assert {(1, 2), (1, 4), (2, 6)} <= set(sizer.arms)
    verify = {1: 0.030, 2: 0.034, 3: 0.037, 4: 0.040, 5: 0.041, 6: 0.033}  # 6: a dip
    draft = {0: 0.0, 1: 0.004, 2: 0.008}
    for m, seconds in verify.items():
        sizer.observe_verify(1, m, seconds)
    for d, seconds in draft.items():
        sizer.observe_draft(1, d, seconds)
    rates = torch.zeros(3, 6, dtype=torch.float64)
    rates[:, 0] = 1.0
    rates[1, 1:] = torch.tensor([0.45, 0.10, 0.05, 0.01, 0.0])  # E(1, 4) = 1.60
    rates[2, 1:] = torch.tensor([0.45, 0.10, 0.05, 0.04, 0.02])  # E(2, 6) = 1.66
    sizer.acceptance.set_counts(rates * 1e6, torch.full_like(rates, 1e6))
    # as measured, the dip made (2, 6) the fastest arm: 1.66 / 0.041 s
    raw = {(d, m): sizer.expected_tokens((d, m)) / (verify[m] + draft[d]) for d, m in sizer.arms}
    assert max(raw, key=raw.get) == (2, 6)
    pooled = (verify[4] + verify[5] + verify[6]) / 3  # 4, 5 and 6 nodes: one mean
    assert sizer.cost(1, (2, 6)) == pytest.approx(pooled + draft[2])
    assert sizer.cost(1, (1, 4)) == pytest.approx(pooled + draft[1])
    assert sizer.cost(1, (1, 3)) == pytest.approx(verify[3] + draft[1])  # in order: kept
    # one pass (about 38 tokens/s at 2, 4 or 5 nodes); the dip no longer buys a second
    # pass, which 0.06 more tokens cannot pay at 4 ms
    assert sizer.choose(1).arm[0] == 1


@pytest.mark.parametrize("seed", range(3))
def test_the_verify_fit_is_the_nearest_non_decreasing_costs(seed):
    """Pool-adjacent-violators against brute force: the fit is non-decreasing and no
    non-decreasing sequence on a grid comes nearer the medians (weighted squares)."""
    import itertools

    from eagle_vllm.sizing.costs import Samples, monotone_verify_costs

    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 6]
    medians = (torch.rand(len(sizes), generator=gen) * 4).round().tolist()
    counts = torch.randint(1, 5, (len(sizes),), generator=gen).tolist()
    windows = {}
    for m, c, n in zip(sizes, medians, counts):
        windows[m] = (1.0, Samples(9))
        for _ in range(n):
            windows[m][1].add(c, step=0)
    fit, _ = monotone_verify_costs(windows)
    values = [fit[m] for m in sizes]
    assert values == sorted(values)

    def loss(seq):
        return sum(n * (a - b) ** 2 for a, b, n in zip(seq, medians, counts))

    grid = [x / 4 for x in range(17)]
    best = min(loss(seq) for seq in itertools.combinations_with_replacement(grid, len(sizes)))
    assert loss(values) <= best + 1e-9


def test_noisy_costs_widen_the_margin_to_start_drafting():
    """One draft predicts 8% over no drafts. Measured on a quiet machine (samples within
    1%), that starts drafting; with the same medians but samples spread +-15% (another
    tenant), the gain is within the noise of the two windows and drafting does not
    start. The margin to keep drafting is half of it."""

    def sizer_with(spread: float) -> TreeSizer:
        sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2, explore_every=10**6)
        for k in range(9):
            jitter = 1.0 + spread * (k - 4) / 4  # median 1.0, +-spread
            sizer.observe_verify(4, 1, 1.0 * jitter)
            sizer.observe_draft(4, 0, 0.0)
            sizer.observe_verify(4, 2, 1.0 * jitter)
            sizer.observe_draft(4, 1, 0.0)
        rate = 0.08
        sizer.acceptance.set_counts(
            torch.tensor([[0.0, 0.0], [0.0, rate * 1e6]]), torch.tensor([[0.0, 0.0], [0.0, 1e6]])
        )
        return sizer

    quiet, busy = sizer_with(0.01), sizer_with(0.15)
    for sizer in (quiet, busy):
        assert sizer.throughput(4, (1, 2)) / sizer.throughput(4, OFF) == pytest.approx(1.08)
    assert quiet.choose(4).arm == (1, 2)
    assert busy.choose(4).arm == OFF
    busy._last_best = (1, 2)  # already drafting: half the margin keeps it
    margin = busy.start_margin(busy._predicted_rates(4, 0.0)[3])
    assert margin > 0.08 > margin / 2
    assert busy.choose(4).arm == (1, 2)


def test_choose_is_a_question_and_commit_its_answer():
    """``choose`` depends only on its arguments and the measured state: asking twice gives
    the same decision and changes nothing; ``commit`` applies the decision's bookkeeping."""
    engine = SimulatedEngine(rate=0.6, draft_pass=0.02, per_token=0.004)
    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=4, explore_every=8)
    run(sizer, engine, batch=4, steps=40)

    def state():
        return (sizer.steps, sizer._explore_credit, sizer._explore_interval,
                sizer._last_best, sizer._repeat, len(sizer.history), dict(sizer.costs.renew))  # fmt: skip

    before = state()
    first, again = sizer.choose(4), sizer.choose(4)
    assert first == again and state() == before
    assert sizer.choose(4, num_sampled=4).sampled_share == 1.0 and state() == before
    sizer.commit(first)
    assert sizer.steps == before[0] + 1 and sizer.history[-1] == (4, *first.arm)


def test_a_calibration_sweep_runs_every_arm_then_the_contenders_in_rounds():
    """``start_sweep``: every arm for ``steps_per_visit`` steps, then the arms still in
    contention (within ``SWEEP_CLEAR_LOSS`` of the best) again in each later round;
    then the sizer chooses again."""
    from eagle_vllm.sizing.policy import SWEEP_CLEAR_LOSS

    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    engine = SimulatedEngine(rate=0.8, draft_pass=0.05, per_token=0.02)
    rates = {a: engine.tokens_per_second(1, a) for a in sizer.arms}
    best = max(rates, key=rates.get)
    assert rates[best] > (1 + SWEEP_CLEAR_LOSS) * rates[OFF]  # no drafts clearly loses
    sizer.start_sweep(visits=3, steps_per_visit=2)
    assert sizer.sweep_steps_left == 3 * 2 * len(sizer.arms)  # at most
    run(sizer, engine, batch=1, steps=60)
    swept = [tuple(h[1:]) for h in sizer.history[: 2 * len(sizer.arms)]]
    assert swept == [arm for arm in sizer.arms for _ in range(2)]  # the first round: all
    later = [tuple(h[1:]) for h in sizer.history[2 * len(sizer.arms) :]]
    assert sizer.sweep_steps_left == 0
    assert OFF not in later[:8]  # clearly losing: not visited again
    assert later[:2].count(later[0]) == 2 and best in later[:8]
    # the best arm's windows hold samples from every round
    assert len(sizer.draft_cost[(1, best[0])].samples) >= 6
    assert len(sizer.verify_cost[(1, best[1])].samples) >= 6
    assert sizer.acceptance.trials[2, 2] > 0  # two-pass trees were verified at depth 2
    assert sizer.choose(1).arm == best  # the sizer's own choice again


def test_a_sweep_outvotes_one_slow_sample_per_arm():
    """One measurement per arm is one noisy sample: a stray slow step on an arm's first
    visit (a garbage collection, another tenant) costs it the choice. A sweep's visits
    of three steps hold three samples, whose median is the arm's real cost."""
    engine = SimulatedEngine(rate=0.8, draft_pass=0.05, per_token=0.02)
    best = best_arm(engine, 1, TreeSizer(max_passes=2, topk=2, max_nodes=4).arms)
    assert best != OFF
    slow_once = set()

    class Stray(SimulatedEngine):
        def verify_seconds(self, batch, nodes, sampled=False):
            seconds = super().verify_seconds(batch, nodes, sampled)
            if nodes == best[1] and nodes not in slow_once:  # its first measurement
                slow_once.add(nodes)
                return 3 * seconds
            return seconds

    stray = Stray(rate=0.8, draft_pass=0.05, per_token=0.02)
    once = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    once.start_sweep(visits=1, steps_per_visit=1)
    # one step more: a step's tree is verified, and its cost measured, in the next step
    run(once, stray, batch=1, steps=once.sweep_steps_left + 1)
    assert once.choose(1).arm != best  # misled by the stray sample
    slow_once.clear()
    swept = TreeSizer(max_passes=2, topk=2, max_nodes=4)
    swept.start_sweep(visits=3, steps_per_visit=3)
    run(swept, stray, batch=1, steps=swept.sweep_steps_left + 1)
    assert swept.choose(1).arm == best


class NoisyStarEngine:
    """A made-up machine whose every draft is a child of the root (depth 1), the j-th
    accepted with probability ``accept[j - 1]`` (at most one), and whose every measured
    cost is off by lognormal noise of ``sigma`` (a shared machine)."""

    def __init__(self, accept: list[float], sigma: float, seed: int):
        self.accept = torch.tensor(accept, dtype=torch.float64)
        self.sigma = sigma
        self.gen = torch.Generator().manual_seed(seed)

    def verify(self, batch: int, nodes: int) -> float:
        return 0.040 + 0.0012 * batch * (nodes - 1)

    def draft(self, batch: int, passes: int) -> float:
        return 0.003 * passes

    def expected(self, arm) -> float:
        return 1.0 if arm[0] == 0 else 1.0 + float(self.accept[: arm[1] - 1].sum())

    def rate(self, batch: int, arm) -> float:
        return self.expected(arm) / (self.verify(batch, arm[1]) + self.draft(batch, arm[0]))

    def noisy(self, seconds: float) -> float:
        return seconds * float(torch.randn((), generator=self.gen, dtype=torch.float64).mul(
            self.sigma).exp())  # fmt: skip

    def accepted(self, batch: int, nodes: int) -> torch.Tensor:
        u = torch.rand(batch, generator=self.gen, dtype=torch.float64)
        bounds = torch.cumsum(self.accept[: nodes - 1], 0)
        child = (u[:, None] < bounds[None, :]).int().argmax(1) + 1
        hit = u < bounds[-1]
        out = torch.zeros(batch, nodes, dtype=torch.bool)
        out[:, 0] = True
        out[torch.arange(batch)[hit], child[hit]] = True
        return out


def test_a_near_tie_on_a_noisy_machine_costs_at_most_its_noise():
    """No drafts beats the best tree by 4% at 4 requests, on a machine whose every step
    time is off by 15% (lognormal): with a dozen trees compared against no drafts, the
    one whose samples came out lowest looks best. Over 1000 steps the sizer's choices
    must run within 0.5% of no drafts' throughput (costs fitted together, a margin as
    wide as the noise); taking each tree size's own samples at face value with a fixed
    5% margin lost up to 1.4%."""
    accept = [0.15, 0.04, 0.02, 0.015, 0.01, 0.0075, 0.005, 0.005, 0.005, 0.005]
    accept += [0.0025] * 5
    batch = 4
    for seed in range(4):
        engine = NoisyStarEngine(accept, sigma=0.15, seed=seed)
        sizer = TreeSizer(max_passes=2, topk=4, max_nodes=16)
        if seed == 0:
            best_tree = max(
                (a for a in sizer.arms if a != OFF), key=lambda a: engine.rate(batch, a)
            )
            assert engine.rate(batch, best_tree) / engine.rate(batch, OFF) == pytest.approx(
                0.962, abs=0.005)  # fmt: skip
            assert len(sizer.arms) >= 10
        nodes = 1
        for _ in range(1500):
            sizer.observe_verify(batch, nodes, engine.noisy(engine.verify(batch, nodes)))
            d, m = sizer.decide(batch)
            sizer.observe_draft(batch, d, engine.noisy(engine.draft(batch, d)))
            if d:
                depths = torch.ones(batch, m, dtype=torch.int64)
                depths[:, 0] = 0
                valid = torch.ones(batch, m, dtype=torch.bool)
                sizer.observe_acceptance(depths, valid, engine.accepted(batch, m))
            nodes = m
        late = [tuple(h[1:]) for h in sizer.history[-1000:]]
        tokens = sum(engine.expected(a) for a in late)
        seconds = sum(engine.verify(batch, a[1]) + engine.draft(batch, a[0]) for a in late)
        assert tokens / seconds >= 0.995 * engine.rate(batch, OFF), (seed, sorted(set(late)))


def test_no_drafts_known_only_from_a_profile_is_measured_before_a_tree_is_trusted():
    """A profile measured a drafts-off step at 4 requests at 49 ms (a noisy calibration;
    SmolLM2 on CPU, sampled: 51.5 ms profiled, 41-46 ms live). Live, it costs 44 ms and
    one draft (1.12 tokens for 54 ms) loses to it by 9%, but against the profile's
    figures one draft predicts 6% more and starts. The sizer probes no drafts at once,
    the first time a tree wins against a cost it has only from the profile, and then
    keeps drafts off; before, the stale figure decided every step until the periodic
    probe (32 steps)."""
    live_verify = {1: 0.044, 2: 0.050}
    live_draft = {0: 0.0003, 1: 0.004}
    sizer = TreeSizer(max_passes=1, topk=1, max_nodes=2)
    profiled_verify = {1: 0.049, 2: 0.050}
    sizer.load_profile(_one_draft_profile(profiled_verify, live_draft, hits=160.0, trials=1000.0))
    assert sizer.throughput(4, (1, 2)) > 1.05 * sizer.throughput(4, OFF)  # the profile's view
    choices = _serve_at_four(sizer, live_verify, live_draft, 0.12, steps=24)
    assert choices[:2] == [OFF, OFF], choices  # the probe, twice
    assert sizer.costs.kind_cost(4, "verify", 1, GREEDY) == pytest.approx(0.044)
    # then no drafts, bar one step that measures the tree live (the machine looked 10%
    # faster than profiled, so the tree's profiled cost was scaled down with it)
    assert sum(c != OFF for c in choices) <= 1, choices


def test_an_arm_whose_trees_come_out_smaller_is_not_explored_every_step():
    """A step is charged to the nodes it verified. One pass and 13 nodes counts on 8 suffix
    candidates; where the suffix source finds few, its trees come out smaller and the arm
    stays unmeasured. Explored again whenever it was unmeasured, such arms took 7 of 38
    steps at 4 requests (SmolLM2, HumanEval, CPU); now each is tried once per
    ``max_explore_every`` steps in a bucket."""
    engine = SimulatedEngine(rate=0.6, draft_pass=0.075, per_token=0.02)
    engine.stratified = True
    sizer = TreeSizer(max_passes=2, topk=2, max_nodes=8, extra_nodes=4, extra_depth=4)
    largest_one_pass = 1 + 2  # what one pass drafts without the suffix candidates
    assert any(d == 1 and m > largest_one_pass for d, m in sizer.arms)
    gen = torch.Generator().manual_seed(0)
    verified, batch, steps = 1, 4, 600
    unmeasured = []
    for _ in range(steps):
        sizer.observe_verify(batch, verified, engine.verify_seconds(batch, verified))
        d, m = sizer.decide(batch)
        if sizer.last_decision.kind == "unmeasured":
            unmeasured.append((d, m))
        sizer.observe_draft(batch, d, engine.draft_seconds(batch, d))
        verified = min(m, largest_one_pass) if d == 1 else m  # no suffix candidates
        if d:
            depths = torch.arange(verified).clamp(max=d)[None, :].repeat(batch, 1)
            valid = torch.ones(batch, verified, dtype=torch.bool)
            accepted = engine.accepted(batch, verified, gen)
            sizer.observe_acceptance(depths, valid, accepted, passes=d)
    unreachable = [a for a in sizer.arms if a[0] == 1 and a[1] > largest_one_pass]
    tries = sum(arm in unreachable for arm in unmeasured)
    assert 0 < tries <= len(unreachable) * (1 + steps // sizer.max_explore_every), tries
