"""Load-aware tree sizing (``total_tokens: auto``): pick each step's tree from measurements.

Pure Python/torch, no vLLM imports; the runner feeds it and asks it once per step.

A step that drafts ``d`` passes and verifies a tree of ``m`` nodes (the root plus
``m - 1`` drafts) yields, per request, ``E(d, m)`` tokens and costs
``verify(B, m) + draft(B, d)`` seconds at batch size ``B``. The sizer picks the
``(d, m)`` that maximises tokens per second, ``E / cost``:

* ``E(d, m) = 1 + sum_j rate_d[j]`` over the first ``m - 1`` nodes of the tree
  restricted to depth <= ``d``. Trees come in rank order (every prefix is the best
  smaller tree, ``tree/builder.py``), and a node's acceptance depends only on its
  own path, so ``rate_d[j]`` (how often the j-th node is accepted) is measured
  from every verified tree, for every depth limit at once. Acceptance does not
  depend on load, so it is shared by all batch sizes; it does depend on sampling,
  so greedy and sampled requests keep their own rates and a batch's ``E`` weighs
  the two by their share of it. A node's rate never exceeds
  a better-ranked node's, and ``E(d, m) <= 1 + d``, so nodes seldom verified (near
  their prior) cannot make a big tree look better than it can be.
* ``verify(B, m)`` (the whole step except drafting: target forward, verification,
  KV compaction, vLLM's bookkeeping) and ``draft(B, d)`` (the drafter's passes)
  are wall-clock measurements on the running hardware, kept per exact batch size
  and per power-of-two batch-size bucket (for batch sizes not seen yet, and for
  calibration profiles) as the median of the last few samples (robust to a stray
  slow step: a garbage collection, another tenant). An arm not yet measured in a
  bucket is tried only if it could still win: its expected tokens over a lower bound
  of its cost (a smaller arm's measured cost, plus each extra node at half the
  per-node slope measured at this batch size: costs grow with nodes and passes) must
  beat the best measured arm. So at high load, where one small tree already loses to no
  drafts, the big trees are never tried. Every ``explore_every`` steps (doubling, up
  to 8x, while no drafts keeps winning: each exploration costs a drafting step) either the
  stalest arm that could still win (judged without its own, possibly stale, cost)
  is re-measured, its old samples replaced by the fresh one, or the other side is
  probed: the smallest tree while speculation is off (keeps acceptance measured), no
  drafts while a tree wins (keeps its cost current), the sample joining the probe's
  two latest; so the table follows the machine and the workload. Explorations have a
  budget: each step earns 5% of the best arm's cost, and an arm is explored only if
  its extra cost over the best arm (measured, or its lower bound; for a tree while no
  drafts wins, plus what resuming drafting costs: the deferred draft KV it writes) is
  covered.
* Costs are kept per mode of the batch: no request samples, or some do (verification
  at T > 0 computes probabilities for every node). A cost not yet measured in a mode
  is the other mode's, scaled by how the two compare on the costs measured in both.

``(0, 1)`` is always a candidate: no drafts this step. A tree must predict
``speculation_margin`` (5%) more throughput than no drafts to start drafting, and
half that to keep drafting (a band, so a near tie does not flip the sizer every few
steps): predictions for trees came out optimistic on this CPU (a predicted tie at 4
requests ran at 0.90x vanilla end to end), switching has costs its measurement
leaves out, and a near tie is this machine's noise. After a plain decode step
the runner then skips the drafter and defers its first pass (the draft KV is
written later, many positions per forward), so a drafts-off step costs about
what a step of vanilla vLLM costs. As the batch grows, the verify cost of extra
tokens rises and the chosen tree shrinks, down to none.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

OFF = (0, 1)  # (draft passes, tree nodes): no speculation this step
# Acceptance is kept per class of request: sampled requests accept fewer drafts than
# greedy ones (SmolLM2 on HumanEval, one draft: about 1.26 tokens per step at T=1, 1.35
# at T=0), and a batch may hold both.
GREEDY, SAMPLED = "greedy", "sampled"
# A class seen for the first time starts from the other class's rates, weighted as this
# many verified drafts of its best node: its own first few steps outvote them.
SEED_TRIALS = 8.0
# A profile's acceptance describes its calibration prompts, not this engine's traffic
# (costs describe the machine and stay): it starts as this many verified drafts of the
# best node, so a workload that accepts less, such as code against a profile made on
# chat, outvotes it within a few dozen drafts. At full weight (561 drafts in
# benchmarks/results/sizing-profile-cpu.json) HumanEval at 4 requests kept drafting at
# τ 1.23 for a whole 64-token run, at 0.88x vanilla.
PROFILE_TRIALS = 64.0
# Costs are kept per mode of the batch: GREEDY when no request samples, SAMPLED when any
# does. Verification at T > 0 computes probabilities over the vocabulary for every
# node (SmolLM2 on CPU: the rejection sampler was 12-40% of a drafting step at T=1
# against 2-5% at T=0), so a tree's cost measured on greedy batches undersells it on
# sampled ones, and the reverse.
MODES = (GREEDY, SAMPLED)
PROFILE_VERSION = 1  # eagle-vllm calibrate's output (TreeSizer.export_profile)
# its cost tables: greedy batches' (required) and sampled batches' (optional)
PROFILE_COST_KEYS = ("verify_seconds", "draft_seconds", "verify_seconds_sampled",
                     "draft_seconds_sampled")  # fmt: skip


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, 8, ...)."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))


def candidate_sizes(depth: int, topk: int, max_nodes: int) -> list[tuple[int, int]]:
    """The (draft passes, tree nodes) arms: off, then every depth with a few tree sizes."""
    arms = [OFF]
    for d in range(1, depth + 1):
        reachable = 1 + topk + (d - 1) * topk * topk  # nodes depth d can draft
        top = min(max_nodes, reachable)
        low = 2 if d == 1 else min(top, d + 1)  # a tree of depth d needs d + 1 nodes
        sizes = {top, low}
        m = low
        while m < top:  # geometric steps between the chain and the full tree
            sizes.add(m)
            m = max(m + 1, int(m * 1.5))
        arms += [(d, m) for m in sorted(sizes)]
    return arms


class _Samples:
    """The last few wall-clock samples of one cost; its value is their median."""

    def __init__(self, window: int):
        self.samples: deque[float] = deque(maxlen=window)
        self.last_step = -1
        self._median: float | None = None  # read every step, changed once per step at most

    def add(self, seconds: float, step: int) -> None:
        self.samples.append(seconds)
        self.last_step = step
        self._median = None

    def keep_last(self, n: int) -> None:
        while len(self.samples) > n:
            self.samples.popleft()
        self._median = None

    @property
    def value(self) -> float:
        if self._median is None:
            self._median = statistics.median(self.samples)
        return self._median


@dataclass
class AcceptanceStats:
    """How often the j-th node of a rank-ordered tree, cut at depth d, is accepted."""

    depth: int
    max_nodes: int
    decay: float = 0.995
    # prior: one pseudo-observation, never decayed, so a node unseen (or not seen for
    # long) drifts back to worth trying: at this rate for the first draft, at the
    # better-ranked node's rate for the others (rates())
    prior_rate: float = 0.5
    hits: torch.Tensor = field(init=False)
    trials: torch.Tensor = field(init=False)
    # E(d, m) for every d and m, rebuilt once after the counts change (the sizer reads it
    # for every arm, several times per step)
    _expected: list[list[float]] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        shape = (self.depth + 1, self.max_nodes)
        self.set_counts(torch.zeros(shape, dtype=torch.float64), torch.zeros(shape))

    @property
    def observed(self) -> bool:
        return bool(self.trials.any())

    def seed_from(self, other: AcceptanceStats, weight: float = SEED_TRIALS) -> None:
        """Start from ``other``'s rates, worth at most ``weight`` trials of any node."""
        self.set_rates_from(other.hits, other.trials, weight)

    def set_rates_from(self, hits: torch.Tensor, trials: torch.Tensor, weight: float) -> None:
        """Start from the rates of these counts, worth at most ``weight`` trials of any
        node (the counts are scaled down together, so every rate is kept)."""
        trials = trials.to(torch.float64)
        scale = min(1.0, weight / max(float(trials.max()), 1e-9))
        self.set_counts(hits.to(torch.float64) * scale, trials * scale)

    def set_counts(self, hits: torch.Tensor, trials: torch.Tensor) -> None:
        self.hits = hits.to(torch.float64)
        self.trials = trials.to(torch.float64)
        self._expected = None

    def update(self, depths: torch.Tensor, valid: torch.Tensor, accepted: torch.Tensor) -> None:
        """One verified step. ``[R, W]`` per request and node (node 0 = root):
        node depths, which nodes were verified, which were accepted."""
        if depths.numel() == 0:
            return
        depths, valid, accepted = depths.cpu(), valid.cpu(), accepted.cpu()
        self.age()
        drafted = valid.clone()
        drafted[:, 0] = False  # the root is not a draft
        # Trees cut at every depth d at once: keep[d - 1] holds the nodes at depth <= d,
        # and a kept node counts as the j-th node of its cut tree (1-based: the root is
        # node 0). One vectorised pass: this runs every step, on the critical path.
        cuts = torch.arange(1, self.depth + 1)[:, None, None]
        keep = drafted[None] & (depths[None] <= cuts)  # [depth, R, W]
        j = torch.cumsum(keep.to(torch.int64), dim=2).clamp(max=self.max_nodes - 1)
        index = (cuts * self.max_nodes + j)[keep]
        self.trials.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
        hits = accepted[None].expand_as(keep)[keep].to(torch.float64)
        self.hits.view(-1).index_add_(0, index, hits)
        self._expected = None

    def age(self) -> None:
        """One step passes: older observations weigh less (a step without drafts
        observes nothing else)."""
        self.hits *= self.decay
        self.trials *= self.decay
        self._expected = None

    def rates(self, d: int) -> torch.Tensor:
        """Acceptance rate of the j-th node (index 0: the root) of trees cut at depth d."""
        return torch.tensor(self._all_rates()[d], dtype=torch.float64)

    def _all_rates(self) -> list[list[float]]:
        """Per cut depth, each node's hits and trials plus one pseudo-trial of the prior:
        ``prior_rate`` for the first draft, the better-ranked node's rate for the others;
        and never above that rate.

        Never rising with rank: trees are ranked by draft score, so a node is accepted
        at most as often as a better-ranked one. Without the cap, nodes seldom verified
        sat near the prior (0.5 each) and promised more than any tree can give (SmolLM2
        on CPU: 3.7 tokens per step for 2 passes), so big trees kept being tried at loads
        where one costs five plain steps. With a flat prior under the cap, they still
        sat at the cap: a calibration profile, its counts scaled to 64 trials, left ranks
        3-15 with under 4 trials each, and their rate at 0.17 where ranks 3-5 measured
        0.03-0.08 and ranks 6-15 zero; a 16-node tree looked worth 3.8 tokens a step."""
        out = []
        for hits, trials in zip(self.hits.tolist(), self.trials.tolist()):
            row = [(hits[0] + self.prior_rate) / (trials[0] + 1.0)]
            prior = self.prior_rate
            for j in range(1, len(hits)):
                rate = (hits[j] + prior) / (trials[j] + 1.0)
                prior = rate if j == 1 else min(rate, prior)
                row.append(prior)
            out.append(row)
        return out

    def expected_tokens(self, d: int, m: int) -> float:
        """Tokens a request gains per step with ``d`` passes and an ``m``-node tree: at most
        ``1 + d`` (one accepted draft per pass, plus the target's own token)."""
        if d == 0 or m <= 1:
            return 1.0
        if self._expected is None:
            # E(d, m) = 1 + sum of the first m - 1 drafts' rates, capped at 1 + d
            self._expected = []
            for cut, rates in enumerate(self._all_rates()):
                row, total = [1.0, 1.0], 1.0
                for rate in rates[1:]:
                    total += rate
                    row.append(min(total, 1.0 + cut))
                self._expected.append(row)
        return self._expected[d][min(m, self.max_nodes)]


class TreeSizer:
    """Chooses each step's (draft passes, tree nodes) from measured costs and acceptance."""

    def __init__(
        self,
        depth: int,
        topk: int,
        max_nodes: int,
        explore_every: int = 32,
        window: int = 9,
        speculation_margin: float = 0.05,
        explore_budget: float = 0.05,
    ):
        self.depth, self.topk, self.max_nodes = depth, topk, max_nodes
        # A tree must predict this much more throughput than no drafts to start
        # drafting, half of it to keep drafting. A bias: SmolLM2 on CPU at 4 requests,
        # one draft per request predicted within 1% of no drafts ran at 0.88-0.93x
        # vanilla end to end (prefill steps, the steps around a switch and the
        # acceptance of a new load are not in the prediction). A band: with one
        # threshold, near ties at 4 and 16 requests flipped between the two every few
        # steps and lost 6-14% (session 7). At 1 request a draft predicts +20%.
        self.speculation_margin = speculation_margin
        # Steps between explorations: explore_every while a tree wins, doubling (up to
        # max_explore_every) while no drafts keeps winning. Each exploration costs a
        # drafting step and the deferred draft KV written for it: every 32 steps that
        # was a few percent of all time at high load, where drafts never win.
        self.max_explore_every = 8 * explore_every
        self._explore_interval = explore_every
        self._last_explore = 0
        self._last_best: tuple[int, int] | None = None
        self._explorations = 0
        self._repeat: tuple[int, int] | None = None  # an arm to run once more (a probe)
        # What explorations may cost beyond the best arm, as a share of the time: each
        # step earns this share of the best arm's cost, an exploration spends its arm's
        # extra cost. Without it an arm whose bound said "could still win" was
        # re-measured at every other exploration whatever it cost (SmolLM2 on CPU, 16
        # requests at T=1: a 15-node tree at 896 ms a step against 65 ms for no drafts).
        self.explore_budget = explore_budget
        self._explore_credit = 0.0
        self._credit_cap = math.inf  # the most credit that can build up (set per step)
        self.arms = candidate_sizes(depth, topk, max_nodes)
        self._tree_sizes = sorted({m for _, m in self.arms})
        self._pass_counts = sorted({d for d, _ in self.arms})
        self.acceptance_of = {c: AcceptanceStats(depth, max_nodes) for c in (GREEDY, SAMPLED)}
        self._sampled_share = 0.0  # of the batch chose() was last asked about
        self._mode = GREEDY  # of the batch chose() was last asked about
        self.explore_every = explore_every
        self.window = window
        # Per mode (GREEDY: no request samples; SAMPLED: some do) and kind ("verify":
        # (bucket, nodes) -> seconds; "draft": (bucket, passes) -> seconds).
        self._bucket_costs: dict[str, dict[str, dict[tuple[int, int], _Samples]]] = {
            mode: {"verify": {}, "draft": {}} for mode in MODES
        }
        # The same samples per exact batch size, preferred where measured: within a
        # bucket a step's cost still varies with the batch (SmolLM2 on CPU, one draft
        # per request: 59 ms at 3 requests, 75 ms at 4), and the steps of a load's tail
        # (requests finishing) left the bucket's window describing a smaller batch.
        self._exact: dict[str, dict[str, dict[tuple[int, int], _Samples]]] = {
            mode: {"verify": {}, "draft": {}} for mode in MODES
        }
        # A cost not yet measured in the batch's mode is the other mode's, scaled by how
        # the two modes' costs of this (kind, bucket) compare where both are measured.
        self._mode_ratio: dict[tuple[str, str, int], _Samples] = {}
        # A calibration profile's costs, and how this engine's live samples compare with
        # them per (kind, bucket): the machine drifts as a whole (SmolLM2 on CPU, a day
        # after calibrating: 42 ms for a drafts-off step at 4 requests against the
        # profile's 55, and 58 against 74 for one draft). Costs only the profile has
        # measured are scaled by that ratio; unscaled, the arm in use was compared with
        # a stale competitor until an exploration re-measured it (50 steps drafting at
        # 0.82x vanilla).
        self._profile_cost: dict[tuple[str, str, int, int], float] = {}  # (mode, kind, ...)
        self._drift: dict[tuple[str, int], _Samples] = {}
        self.steps = 0
        self.history: list[tuple[int, int, int]] = []  # (batch, d, m), last 4096 choices
        # cost windows an exploration renews: (mode, kind, bucket, size) -> old samples kept
        self._renew: dict[tuple[str, str, int, int], int] = {}
        self.pinned: tuple[int, int] | None = None  # set by the runner for benchmarks
        # Steps where drafting resumed after no drafts, per (mode, bucket): the period less
        # its drafting. Beyond a drafts-off step, such a step writes the draft KV deferred
        # while drafts were off and pays vLLM's bookkeeping around the first drafts
        # (SmolLM2 on CPU, 16 requests: 119 ms against 64 for a drafts-off step, 44 of it
        # catch-up); an exploration of a tree while no drafts wins pays that too.
        self._resume: dict[tuple[str, int], _Samples] = {}
        self._node_slope = 0.0  # _verify_slope at the batch size chose() was last asked about
        self._resume_extra = 0.0  # _resume_cost at that batch size

    @property
    def verify_cost(self) -> dict[tuple[int, int], _Samples]:
        """Greedy batches' verify costs per (bucket, nodes)."""
        return self._bucket_costs[GREEDY]["verify"]

    @property
    def draft_cost(self) -> dict[tuple[int, int], _Samples]:
        """Greedy batches' draft costs per (bucket, passes)."""
        return self._bucket_costs[GREEDY]["draft"]

    # -- measurements ------------------------------------------------------
    def observe_verify(
        self, batch_size: int, nodes: int, seconds: float, sampled: bool = False
    ) -> None:
        """A step's cost beyond drafting; ``sampled``: some request in it sampled."""
        self._observe("verify", batch_size, nodes, seconds, SAMPLED if sampled else GREEDY)

    def observe_draft(
        self, batch_size: int, passes: int, seconds: float, sampled: bool = False
    ) -> None:
        """A step's drafting; ``sampled``: some request in it sampled."""
        self._observe("draft", batch_size, passes, seconds, SAMPLED if sampled else GREEDY)

    def observe_resume(self, batch_size: int, seconds: float, sampled: bool = False) -> None:
        """A step that verified no drafts but drafted for the next (drafting resumes):
        its period less its drafting. Charged to no arm, it prices explorations."""
        key = (SAMPLED if sampled else GREEDY, batch_bucket(batch_size))
        self._resume.setdefault(key, _Samples(self.window)).add(seconds, self.steps)

    def _resume_cost(self, batch_size: int, off: float | None = None) -> float:
        """What resuming drafting costs beyond a drafts-off step at this batch size (0
        until measured); ``off``: that step's cost, if known."""
        bucket = batch_bucket(batch_size)
        samples = self._resume.get((self._mode, bucket)) or self._resume.get(
            (_other(self._mode), bucket)
        )
        if off is None:
            off = self._kind_cost(batch_size, "verify", 1)
        if samples is None or off is None:
            return 0.0
        return max(samples.value - off, 0.0)

    def _observe(self, kind: str, batch_size: int, size: int, seconds: float, mode: str):
        bucket = batch_bucket(batch_size)
        keep = self._renew.pop((mode, kind, bucket, size), None)
        profiled = self._profile_cost.get((mode, kind, bucket, size))
        if profiled is not None:
            drift = self._drift.setdefault((kind, bucket), _Samples(self.window))
            drift.add(seconds / profiled, self.steps)
        other = self._bucket_costs[_other(mode)][kind].get((bucket, size))
        if other is not None:
            ratio = self._mode_ratio.setdefault((mode, kind, bucket), _Samples(self.window))
            ratio.add(seconds / max(self._scaled(other, kind, bucket), 1e-12), self.steps)
        for windows, key in (
            (self._bucket_costs[mode][kind], (bucket, size)),
            (self._exact[mode][kind], (batch_size, size)),
        ):
            samples = windows.setdefault(key, _Samples(self.window))
            if keep is not None:
                samples.keep_last(keep)
            samples.add(seconds, self.steps)

    @property
    def acceptance(self) -> AcceptanceStats:
        """The greedy requests' acceptance (calibration profiles measure it at T=0)."""
        return self.acceptance_of[GREEDY]

    def observe_acceptance(self, depths, valid, accepted, sampled=None) -> None:
        """One verified step (``AcceptanceStats.update``); ``sampled``: ``[R]`` bool, which
        requests sample (temperature > 0), None if none do."""
        if sampled is None or not bool(torch.as_tensor(sampled).any()):
            self.acceptance_of[GREEDY].update(depths, valid, accepted)
            return
        sampled = torch.as_tensor(sampled, dtype=torch.bool).cpu()
        for cls, rows in ((GREEDY, ~sampled), (SAMPLED, sampled)):
            if rows.any():
                self._seed(cls)
                self.acceptance_of[cls].update(depths[rows], valid[rows], accepted[rows])

    def age_acceptance(self) -> None:
        """A step without drafts: the classes in the batch age (nothing is observed)."""
        for cls, share in ((GREEDY, 1.0 - self._sampled_share), (SAMPLED, self._sampled_share)):
            if share > 0:
                self.acceptance_of[cls].age()

    def _seed(self, cls: str) -> None:
        """A class never observed starts from the other's rates (weakly), not the prior."""
        stats = self.acceptance_of[cls]
        other = self.acceptance_of[SAMPLED if cls == GREEDY else GREEDY]
        if not stats.observed and other.observed:
            stats.seed_from(other)

    def expected_tokens(self, arm: tuple[int, int]) -> float:
        """Tokens per request per step for the batch chose() was last asked about: each
        class's E(d, m), weighted by its share of the batch."""
        share = self._sampled_share
        greedy = self.acceptance_of[GREEDY].expected_tokens(*arm) if share < 1 else 0.0
        if share <= 0:
            return greedy
        sampled = self.acceptance_of[SAMPLED].expected_tokens(*arm)
        return (1.0 - share) * greedy + share * sampled

    # -- the decision --------------------------------------------------------
    def _scaled(self, samples: _Samples, kind: str, bucket: int) -> float:
        """A window's value; one holding only the profile's seed is scaled as the machine
        drifted since calibrating."""
        value = samples.value
        if samples.last_step < 0 and (drift := self._drift.get((kind, bucket))):
            value *= drift.value
        return value

    def _cost(self, batch_size: int, arm: tuple[int, int]) -> float | None:
        """Seconds per step in the current batch's mode (verify plus draft; None if either
        is unmeasured)."""
        return self._arm_costs(batch_size)[0].get(arm)

    def _arm_costs(self, batch_size: int) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
        """Seconds per step of every arm measured at this batch size, in arm order, and
        the verify cost per tree size they were built from.

        Each distinct size's cost is looked up once (this runs every step, on the
        critical path of batch 1), and verify and draft costs are made non-decreasing in
        the size: a bigger tree, or more passes, never costs less. Each size is measured
        alone, at its own times, on a noisy machine; taken as measured, a 6-node verify
        once read cheaper than a 4-node one (SmolLM2 on CPU, batch 1), and the sizer
        picked two passes of 6 nodes over one pass of 4 for a cost the 6-node tree could
        not have."""
        verify = _non_decreasing(
            {m: self._kind_cost(batch_size, "verify", m) for m in self._tree_sizes}
        )
        draft = _non_decreasing(
            {d: self._kind_cost(batch_size, "draft", d) for d in self._pass_counts}
        )
        costs = {(d, m): verify[m] + draft[d] for d, m in self.arms if m in verify and d in draft}
        return costs, verify

    def _kind_cost(self, batch_size: int, kind: str, size: int) -> float | None:
        """One kind of cost in the current batch's mode: the exact batch size's samples
        where measured, else its bucket's (batch sizes not seen yet, and a calibration
        profile's buckets); else the other mode's, scaled by the modes' measured ratio."""
        bucket = batch_bucket(batch_size)
        for mode in (self._mode, _other(self._mode)):
            samples = self._exact[mode][kind].get((batch_size, size))
            samples = samples or self._bucket_costs[mode][kind].get((bucket, size))
            if samples is not None:
                break
        else:
            return None
        value = self._scaled(samples, kind, bucket)
        if mode != self._mode and (ratio := self._mode_ratio.get((self._mode, kind, bucket))):
            value *= ratio.value
        return value

    def throughput(self, batch_size: int, arm: tuple[int, int]) -> float | None:
        """Predicted tokens per second of one request at this batch size (None: unmeasured)."""
        cost = self._cost(batch_size, arm)
        if cost is None:
            return None
        return self.expected_tokens(arm) / max(cost, 1e-9)

    def choose(self, batch_size: int, num_sampled: int = 0) -> tuple[int, int]:
        """(draft passes, tree nodes) for the next step of ``batch_size`` requests, of which
        ``num_sampled`` sample (temperature > 0) and the rest are greedy."""
        self.steps += 1
        self._sampled_share = min(max(num_sampled / max(batch_size, 1), 0.0), 1.0)
        self._mode = SAMPLED if self._sampled_share > 0 else GREEDY
        if self._sampled_share > 0:
            self._seed(SAMPLED)
        if self._sampled_share < 1:
            self._seed(GREEDY)
        bucket = batch_bucket(batch_size)
        costs = self._costs(batch_size)  # once per step: this runs every step
        rates = {a: self.expected_tokens(a) / max(c, 1e-9) for a, c in costs.items()}
        best = max(rates.values(), default=0.0)
        drafting_now = self._last_best not in (None, OFF)
        base = costs.get(self._last_best) or costs.get(OFF)  # what a step costs now
        if base is not None:  # every step earns a share of its time for explorations
            self._credit_cap = self.explore_budget * self.max_explore_every * base
            self._explore_credit = min(
                self._explore_credit + self.explore_budget * base, self._credit_cap
            )
        arm, self._repeat = self._repeat, None
        if arm is None and len(costs) < len(self.arms):
            arm = self._unmeasured(costs, base, best)
        if arm is None and self.steps - self._last_explore >= self._explore_interval:
            arm = self._explore(bucket, costs, base, best, drafting_now)
        if arm is None:

            def score(a):
                rate = rates[a]
                if a != OFF:  # to start drafting: +margin; to keep drafting: +margin/2
                    rate /= 1.0 + self.speculation_margin / (2 if drafting_now else 1)
                return (rate, -a[1], -a[0])

            arm = self._last_best = max(costs, key=score)
        self.history.append((batch_size, *arm))
        del self.history[:-4096]
        return arm

    def _explore(
        self, bucket: int, costs: dict, base: float | None, best: float, drafting_now: bool
    ):
        """The arm of an exploration, or None (none due, or none affordable yet)."""
        # Alternate: the stalest arm that could still win, and a probe of the other
        # side: while no drafts wins, the smallest tree (keeps acceptance measured);
        # while a tree wins, no drafts (keeps its cost current: a stale figure for it
        # is what the band would otherwise hold on to).
        probe = (self._explorations + 1) % 2 == 0
        probe_arm = OFF if drafting_now else self.arms[min(1, len(self.arms) - 1)]
        arm = None
        if not probe:
            # the arm in use is measured every step, the probe's at every other
            # exploration: the stalest of the others, if any could still win
            arm = self._stalest(bucket, costs, base, best, (probe_arm, self._last_best))
        if arm is not None:
            # the stalest arm's window may describe another phase of the workload (a
            # warm-up, a burst of prefills): the fresh sample replaces it
            keep, price = 0, self._price(costs, arm, base)
        elif (price := self._price(costs, probe_arm, base)) <= self._explore_credit or (
            self._explore_credit >= self._credit_cap  # a probe dearer than the cap: its rate
        ):  # is the budget's (the credit goes negative), so acceptance is never left stale
            # a probe's fresh sample joins its two latest (a median of three: one
            # sample is noise on this machine, nine follow a change too slowly)
            arm, keep = probe_arm, 2
            if arm == OFF:
                # twice: the runner measures no drafts only in a drafts-off step that
                # follows another (the step where drafting resumes costs more)
                self._repeat = OFF
        else:
            return None  # the credit is short: try again next step
        if self._last_best == OFF:  # no drafts kept winning since the last one
            self._explore_interval = min(2 * self._explore_interval, self.max_explore_every)
        else:
            self._explore_interval = self.explore_every
        self._last_explore = self.steps
        self._explorations += 1
        self._explore_credit -= price
        self._renew[(self._mode, "verify", bucket, arm[1])] = keep
        self._renew[(self._mode, "draft", bucket, arm[0])] = keep
        return arm

    def _costs(self, batch_size: int) -> dict[tuple[int, int], float]:
        """``_arm_costs``; also sets the per-node slope ``_floor`` extrapolates with, and
        what resuming drafting costs, at this batch size."""
        costs, verify = self._arm_costs(batch_size)
        self._node_slope = self._verify_slope(verify)
        self._resume_extra = self._resume_cost(batch_size, verify.get(1))
        return costs

    def _verify_slope(self, verify: dict[int, float]) -> float:
        """A lower bound of what one more tree node adds to a step at one batch size, from
        its verify costs per tree size (``_arm_costs``): half the chord slope of those
        costs (between the smallest and
        largest tree measured; from no drafts if only one tree is). Verifying is
        memory-bound for few tokens and compute-bound beyond, so the marginal cost of a
        node only grows with the tree, and the chord under-estimates what lies beyond the
        largest measured tree; the half absorbs noise and the fixed cost drafting adds at
        two nodes. ``E(d, m) <= 1 + d`` caps what a bigger tree can give, but without this
        its cost was bounded by a much smaller tree's (SmolLM2 on CPU, 64 requests: a
        16-node tree, 1024 tokens a step, "could still win" next to a 4-node one and was
        explored at 3x a plain step's cost)."""
        measured = sorted(verify.items())
        trees = [(m, c) for m, c in measured if m >= 2]
        span = trees if len(trees) >= 2 else measured
        if len(span) < 2:
            return 0.0
        (m_lo, c_lo), (m_hi, c_hi) = span[0], span[-1]
        return 0.5 * max(c_hi - c_lo, 0.0) / (m_hi - m_lo)

    def _floor(self, costs: dict, arm: tuple[int, int], own: bool = True) -> float:
        """A lower bound of an arm's cost: for every measured arm with at most as many
        nodes and passes, its cost plus the extra nodes at ``_node_slope`` each (costs
        grow with nodes and passes); the largest of these."""
        return max(
            (
                c + self._node_slope * (arm[1] - other[1])
                for other, c in costs.items()
                if other[0] <= arm[0] and other[1] <= arm[1] and (own or other != arm)
            ),
            default=0.0,
        )

    def _could_win(self, costs: dict, arm: tuple[int, int], best: float, own: bool = True) -> bool:
        """Optimistic bound: expected tokens over ``_floor``. ``own=False`` leaves the
        arm's own measurement out, for re-measuring it: a stale sample must not be what
        keeps an arm from being measured again."""
        floor = self._floor(costs, arm, own)
        return floor <= 0 or self.expected_tokens(arm) / floor > best

    def _price(self, costs: dict, arm: tuple[int, int], base: float | None) -> float:
        """Seconds an exploration of ``arm`` costs over the best arm: its floor (its cost
        if measured) less ``base``, plus, for a tree while no drafts is in use, what
        resuming drafting costs beyond that (``observe_resume``). Nothing before anything
        is measured: every arm's first sample is exploration."""
        if base is None:
            return 0.0
        price = max(self._floor(costs, arm) - base, 0.0)
        if arm[0] > 0 and self._last_best in (None, OFF):
            price += self._resume_extra
        return price

    def _unmeasured(self, costs: dict, base: float | None, best: float) -> tuple[int, int] | None:
        for arm in self.arms:  # smallest first: off, then growing trees
            if arm in costs or not self._could_win(costs, arm, best):
                continue
            if (price := self._price(costs, arm, base)) <= self._explore_credit:
                self._explore_credit -= price
                return arm
        return None

    def _stalest(
        self, bucket: int, costs: dict, base: float | None, best: float, exclude=()
    ) -> tuple[int, int] | None:
        candidates = [
            a
            for a in costs
            if a not in exclude
            and self._could_win(costs, a, best, own=False)
            and self._price(costs, a, base) <= self._explore_credit
        ]
        if not candidates:
            return None
        tables = self._bucket_costs[self._mode]

        def age(arm):  # never measured in this mode: stalest of all
            v = tables["verify"].get((bucket, arm[1]))
            d = tables["draft"].get((bucket, arm[0]))
            return min(v.last_step if v else -2, d.last_step if d else -2)

        return min(candidates, key=age)

    # -- calibration profiles (eagle-vllm calibrate, config key sizing_profile) ----
    def export_profile(self) -> dict:
        """The measured costs (per batch bucket and mode) and acceptance, JSON-ready, to
        seed another engine of the same config on the same hardware."""

        def costs(table: dict) -> dict[str, float]:
            return {f"{b},{n}": s.value for (b, n), s in sorted(table.items()) if s.samples}

        profile = {
            "eagle_vllm_sizing_profile": PROFILE_VERSION,
            "depth": self.depth,
            "topk": self.topk,
            "max_nodes": self.max_nodes,
        }
        for mode, suffix in ((GREEDY, ""), (SAMPLED, "_sampled")):
            for kind in ("verify", "draft"):
                table = costs(self._bucket_costs[mode][kind])
                if table or mode == GREEDY:
                    profile[f"{kind}_seconds{suffix}"] = table
        # greedy requests' acceptance; sampled requests' if observed
        for key, stats in (
            ("acceptance", self.acceptance_of[GREEDY]),
            ("acceptance_sampled", self.acceptance_of[SAMPLED]),
        ):
            if key == "acceptance" or stats.observed:
                profile[key] = {"hits": stats.hits.tolist(), "trials": stats.trials.tolist()}
        return profile

    def load_profile(self, profile: dict) -> None:
        """Seed the tables from ``export_profile``'s output: one sample per cost, older
        than any the engine takes (so it is re-measured first, and outvoted by the
        engine's own samples), and the acceptance rates, worth ``PROFILE_TRIALS``
        drafts. New batch buckets then start
        from measured costs instead of trying every arm. A cost only the profile has
        measured is scaled by how this engine's samples of the bucket's other costs
        compare with the profile's (the machine's drift since calibrating)."""
        check_profile(profile, self.depth, self.topk, self.max_nodes)
        for name in PROFILE_COST_KEYS:
            kind = name.split("_")[0]
            mode = SAMPLED if name.endswith("_sampled") else GREEDY
            table = self._bucket_costs[mode][kind]
            for key, seconds in profile.get(name, {}).items():
                bucket, size = (int(x) for x in key.split(","))
                table.setdefault((bucket, size), _Samples(self.window)).add(float(seconds), -1)
                self._profile_cost[(mode, kind, bucket, size)] = float(seconds)
        for mode in MODES:  # how the profile's two modes compare, per (kind, bucket)
            other = _other(mode)
            for kind in ("verify", "draft"):
                for (bucket, size), samples in self._bucket_costs[mode][kind].items():
                    theirs = self._bucket_costs[other][kind].get((bucket, size))
                    if theirs is not None:
                        ratio = self._mode_ratio.setdefault(
                            (mode, kind, bucket), _Samples(self.window)
                        )
                        ratio.add(samples.value / theirs.value, -1)
        for key, cls in (("acceptance", GREEDY), ("acceptance_sampled", SAMPLED)):
            acceptance = profile.get(key)
            if acceptance:
                self.acceptance_of[cls].set_rates_from(
                    torch.tensor(acceptance["hits"], dtype=torch.float64),
                    torch.tensor(acceptance["trials"], dtype=torch.float64),
                    PROFILE_TRIALS,
                )

    def table(self) -> dict:
        """The current measurements and predictions, for logs and benchmarks (per bucket,
        at the batch size that fills it, in the mode of the batch last chosen for)."""
        buckets = sorted(
            {b for tables in self._bucket_costs.values() for t in tables.values() for b, _ in t}
        )
        out = {"arms": [list(a) for a in self.arms], "mode": self._mode, "buckets": {}}
        for b in buckets:
            costs, _ = self._arm_costs(b)
            out["buckets"][b] = {
                f"{d},{m}": {
                    "expected_tokens": round(self.expected_tokens((d, m)), 3),
                    "seconds": None if (c := costs.get((d, m))) is None else round(c, 5),
                }
                for d, m in self.arms
            }
        return out


def _non_decreasing(costs: dict[int, float | None]) -> dict[int, float]:
    """The measured costs (None: unmeasured, left out), each raised to the largest cost
    of a smaller size."""
    out: dict[int, float] = {}
    floor = 0.0
    for size in sorted(costs):
        if (cost := costs[size]) is not None:
            floor = out[size] = max(floor, cost)
    return out


def _other(mode: str) -> str:
    return SAMPLED if mode == GREEDY else GREEDY


def check_profile(profile: object, depth: int, topk: int, max_nodes: int) -> None:
    """Raise ValueError (what is wrong, and the fix) unless ``profile`` is a sizing
    profile made for this tree bound (depth, topk and largest tree)."""
    fix = "make it with `eagle-vllm calibrate` for this config"
    if not isinstance(profile, dict) or "eagle_vllm_sizing_profile" not in profile:
        raise ValueError(f"not an eagle-vllm sizing profile. Fix: {fix}")
    if profile["eagle_vllm_sizing_profile"] != PROFILE_VERSION:
        raise ValueError(
            f"profile version {profile['eagle_vllm_sizing_profile']!r}, expected "
            f"{PROFILE_VERSION}. Fix: {fix}"
        )
    made = tuple(profile.get(k) for k in ("depth", "topk", "max_nodes"))
    if made != (depth, topk, max_nodes):
        raise ValueError(
            f"made for num_speculative_tokens/topk/max_total_tokens {made}, the config has "
            f"{(depth, topk, max_nodes)}. Fix: {fix}"
        )
    shape = [depth + 1, max_nodes]
    try:
        for name in ("verify_seconds", "draft_seconds"):
            profile[name]  # required; the sampled mode's tables are optional
        for name in PROFILE_COST_KEYS:
            for key, seconds in profile.get(name, {}).items():
                bucket, size = (int(x) for x in key.split(","))
                if bucket < 1 or size < 0 or not float(seconds) > 0:
                    raise ValueError(f"{name}[{key!r}] = {seconds!r}")
        for key in ("acceptance", "acceptance_sampled"):
            acceptance = profile.get(key)
            if acceptance:
                for name in ("hits", "trials"):
                    if list(torch.tensor(acceptance[name]).shape) != shape:
                        raise ValueError(f"{key} {name} is not {shape}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed ({exc}). Fix: {fix}") from None
