"""The sizer's policy: each step's (draft passes, tree nodes) from measured costs and acceptance.

A step with ``d`` passes and an ``m``-node tree yields ``E(d, m)`` tokens per request
(``acceptance.py``) and costs ``verify(B, n) + draft(B, d)`` seconds at batch size ``B``
(``costs.py``), where ``n`` is ``m`` or, for trees that come out smaller (a suffix
source with few candidates filling the ranks beyond what the passes draft), the nodes
they hold; their empty ranks count as drafts not accepted in ``E``. The sizer picks
the arm with the most tokens per second, ``E / cost``.

The terms of the policy, a bandit over tree sizes:

* an **arm** is one ``(passes, nodes)`` choice; ``(0, 1)`` (``OFF``) is no drafts;
* an **exploration** runs an arm that is not the predicted best, to measure it: an arm
  never measured in this batch bucket (tried again only after ``max_explore_every``
  steps: a step is charged to the nodes it verified, so an arm whose trees come out
  smaller than its size, such as one pass and 13 nodes where the suffix source finds
  few candidates, stays unmeasured; SmolLM2 at 4 requests on a CPU explored one 7
  times in 38 steps), tried only if it could still win (its expected tokens over a
  lower bound of its cost must beat the best measured arm: costs grow with nodes and
  passes, so at high load, where one small tree already loses to no drafts, the big
  trees are never tried), or, every ``explore_every`` steps, the stalest arm that
  could still win, its old samples replaced by the fresh one;
* a **probe** is the exploration of the other side, alternating with the stalest arm:
  the smallest tree while no drafts wins (keeps acceptance measured), no drafts while a
  tree wins (keeps its cost current), the fresh sample joining the probe's two latest.
  No drafts is also probed at once, the first time a tree wins in a batch bucket and
  mode where its cost is known only from a calibration profile or from the other mode:
  every tree is judged against it, and a stale or noisy profile figure (SmolLM2 on CPU:
  a drafts-off step at 4 sampled requests profiled at 51 ms, measured at 41-46) would
  otherwise decide every step until the periodic probe.

Explorations have a budget: each step earns ``explore_budget`` (5%) of the best arm's
cost, and an arm is explored only if its extra cost over the best arm (measured, or
its lower bound; for a tree while no drafts wins, plus what resuming drafting costs)
is covered. While no drafts keeps winning the interval doubles, up to 8x.

A tree must predict ``speculation_margin`` (5%) more throughput than no drafts to start
drafting and half that to keep drafting: a band, so a near tie does not flip the
sizer every few steps. Predictions for trees come out optimistic (prefill steps, the
steps around a switch and a new load's acceptance are not in them; SmolLM2 on CPU: a
predicted tie at 4 requests runs at 0.88-0.93x vanilla end to end) and a near tie is
the machine's noise. Where the measured costs are noisier than the margin covers, it
widens to ``SPREAD_Z`` standard errors of the predicted cost difference
(``costs.monotone_verify_costs``): on a busy machine a gain the samples cannot tell
from noise does not start drafting.

``choose`` is a pure function of its arguments and the measured state: it returns a
``Decision``, and ``commit`` applies the decision's bookkeeping (exploration credit and
schedule, history). ``decide`` does both, as the runner does once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle_vllm.sizing.acceptance import GREEDY, SAMPLED, AcceptanceByClass, AcceptanceStats
from eagle_vllm.sizing.costs import CostModel, batch_bucket, charged_size, verify_slope

OFF = (0, 1)  # (draft passes, tree nodes): no speculation this step
# A profile's acceptance describes its calibration prompts, not this engine's traffic
# (costs describe the machine and stay): it starts as this many verified drafts of the
# best node, so a workload that accepts less, such as code against a profile made on
# chat, outvotes it within a few dozen drafts (at full weight, HumanEval at 4 requests
# keeps drafting at τ 1.23 for a whole 64-token run, at 0.88x vanilla).
PROFILE_TRIALS = 64.0
PROFILE_VERSION = 1  # eagle-vllm calibrate's output (TreeSizer.export_profile)
# its cost tables: greedy batches' (required) and sampled batches' (optional)
PROFILE_COST_KEYS = ("verify_seconds", "draft_seconds", "verify_seconds_sampled",
                     "draft_seconds_sampled")  # fmt: skip

Arm = tuple[int, int]
# The margin to start drafting is at least this many standard errors of the predicted
# cost difference between a tree and no drafts (half of it to keep drafting): one-sided,
# a tree that does not pay starts drafting on noise about 2% of the time.
SPREAD_Z = 2.0
# A calibration sweep visits an arm again only while it is within this much of the best
# arm's predicted throughput (``TreeSizer._next_swept``).
SWEEP_CLEAR_LOSS = 0.25


def candidate_sizes(
    max_passes: int, topk: int, max_nodes: int, extra_nodes: int = 0, root_topk: int | None = None
) -> list[Arm]:
    """The (draft passes, tree nodes) arms: off, then every number of passes with a few
    tree sizes. ``extra_nodes``: candidates another source adds to every tree (suffix);
    ``root_topk``: the root's children (default ``topk``)."""
    root = topk if root_topk is None else root_topk
    arms = [OFF]
    for d in range(1, max_passes + 1):
        reachable = 1 + root + (d - 1) * topk * topk + extra_nodes  # nodes d passes can draft
        top = min(max_nodes, reachable)
        low = 2 if d == 1 else min(top, d + 1)  # a tree of d passes needs d + 1 nodes
        sizes = {top, low}
        m = low
        while m < top:  # geometric steps between the chain and the full tree
            sizes.add(m)
            m = max(m + 1, int(m * 1.5))
        arms += [(d, m) for m in sorted(sizes)]
    return arms


@dataclass(frozen=True)
class Decision:
    """One step's choice and the policy bookkeeping ``TreeSizer.commit`` applies.

    ``kind``: ``best`` (the predicted best arm), ``repeat`` (a probe of no drafts, run
    twice), ``unmeasured`` (an arm's first sample in this bucket), ``explore`` (the
    stalest arm) or ``probe`` (the other side)."""

    arm: Arm
    kind: str
    batch_size: int
    sampled_share: float
    credit: float  # exploration credit after this step's earnings, before ``price``
    credit_cap: float
    price: float = 0.0  # credit an exploration spends
    keep: int = 0  # ``explore``/``probe``: old samples kept in the arm's renewed windows
    repeat: Arm | None = None  # the arm of the next step (no drafts is probed twice)

    @property
    def mode(self) -> str:
        return SAMPLED if self.sampled_share > 0 else GREEDY


@dataclass(frozen=True)
class _Context:
    """What the bounds of one ``choose`` call share (all derived from measured state)."""

    costs: dict[Arm, float]
    nodes: dict[Arm, float]  # the nodes each arm's trees hold (``expected_nodes``)
    sampled_share: float
    node_slope: float  # ``verify_slope`` at this batch size
    resume_extra: float  # ``CostModel.resume_cost`` at this batch size
    base: float | None  # what a step of the arm in use costs now
    best: float  # the best measured arm's tokens per second


class TreeSizer:
    """Chooses each step's (draft passes, tree nodes) from measured costs and acceptance."""

    def __init__(
        self,
        max_passes: int,
        topk: int,
        max_nodes: int,
        explore_every: int = 32,
        window: int = 9,
        speculation_margin: float = 0.05,
        explore_budget: float = 0.05,
        extra_nodes: int = 0,
        extra_depth: int = 0,
        root_topk: int | None = None,
    ):
        # extra_nodes / extra_depth: a suffix source's candidates per tree and their depth
        # bound; they cost no draft pass, so a tree of d passes may hold more nodes and
        # accept more than d drafts
        self.max_passes, self.topk, self.max_nodes = max_passes, topk, max_nodes
        self.root_topk = topk if root_topk is None else root_topk
        self.arms = candidate_sizes(max_passes, topk, max_nodes, extra_nodes, self.root_topk)
        self.speculation_margin = speculation_margin
        self.explore_every = explore_every
        self.max_explore_every = 8 * explore_every
        self.explore_budget = explore_budget
        self.window = window
        # every tree size has its verify cost: a step is charged to the nodes it
        # verified, which for trees that come out smaller than their arm is no arm's size
        self.costs = CostModel(
            list(range(1, max_nodes + 1)), sorted({d for d, _ in self.arms}), window
        )
        self._acceptance = AcceptanceByClass(max_passes, max_nodes, extra_depth)
        # the policy's own state, changed by ``commit`` only
        self.steps = 0
        self._explore_interval = explore_every
        self._last_explore = 0
        self._last_best: Arm | None = None
        self._explorations = 0
        self._repeat: Arm | None = None
        self._explore_credit = 0.0
        self._credit_cap = math.inf  # the most credit that can build up
        # (mode, bucket) where no drafts has been probed (``choose``'s first probe)
        self._off_probed: set[tuple[str, int]] = set()
        # (mode, bucket, arm) -> the step an unmeasured arm was last explored at
        self._unmeasured_tried: dict[tuple[str, int, Arm], int] = {}
        self.last_decision: Decision | None = None
        self.history: list[tuple[int, int, int]] = []  # (batch, d, m), last 4096 choices
        self.pinned: Arm | None = None  # benchmarks: every step runs this arm
        # calibration (``start_sweep``): the visits still to make, the last first
        self._sweep: list[Arm] = []
        self._sweep_steps_per_visit, self._sweep_visit_left = 1, 0
        self._sweep_arm, self._sweep_visited = OFF, set()

    # -- measurements ------------------------------------------------------
    @property
    def acceptance_of(self) -> dict[str, AcceptanceStats]:
        return self._acceptance.of

    @property
    def acceptance(self) -> AcceptanceStats:
        """The greedy requests' acceptance (calibration profiles measure it at T=0)."""
        return self._acceptance.of[GREEDY]

    @property
    def verify_cost(self):
        """Greedy batches' verify costs per (bucket, nodes)."""
        return self.costs.bucket[GREEDY]["verify"]

    @property
    def draft_cost(self):
        """Greedy batches' draft costs per (bucket, passes)."""
        return self.costs.bucket[GREEDY]["draft"]

    def observe_verify(self, batch_size: int, nodes: int, seconds: float, sampled=False):
        """A step's cost beyond drafting; ``sampled``: some request in it sampled."""
        mode = SAMPLED if sampled else GREEDY
        self.costs.observe("verify", batch_size, nodes, seconds, mode, self.steps)

    def observe_draft(self, batch_size: int, passes: int, seconds: float, sampled=False):
        """A step's drafting; ``sampled``: some request in it sampled."""
        mode = SAMPLED if sampled else GREEDY
        self.costs.observe("draft", batch_size, passes, seconds, mode, self.steps)

    def observe_resume(self, batch_size: int, seconds: float, sampled: bool = False) -> None:
        """A step that verified no drafts but drafted for the next (drafting resumes):
        its period less its drafting. Charged to no arm, it prices explorations."""
        mode = SAMPLED if sampled else GREEDY
        self.costs.observe_resume(batch_size, seconds, mode, self.steps)

    def observe_acceptance(
        self, depths, valid, accepted, sampled=None, passes=None, nodes=None
    ) -> None:
        """One verified step: ``[R, W]`` node depths, which nodes were verified, which
        accepted; ``sampled``: ``[R]`` bool, which requests sample, None if none do;
        ``passes``: the draft passes the trees were drafted with (``[R]`` or one int;
        None: ``max_passes``); ``nodes``: the tree size they were drafted for, root
        included (``[R]`` or one int; None: as verified)."""
        self._acceptance.observe(depths, valid, accepted, sampled, passes, nodes)

    def age_acceptance(self, sampled_share: float) -> None:
        """A step without drafts: the classes in the batch age (nothing is observed)."""
        self._acceptance.age(sampled_share)

    # -- predictions -----------------------------------------------------------
    def expected_tokens(self, arm: Arm, sampled_share: float = 0.0) -> float:
        """Tokens per request per step, for a batch of which ``sampled_share`` samples."""
        return self._acceptance.expected_tokens(arm, sampled_share)

    def expected_nodes(self, arm: Arm, sampled_share: float = 0.0) -> float:
        """Nodes per request a step of ``arm`` verifies, root included (fewer than its size
        where its trees come out smaller)."""
        return self._acceptance.expected_nodes(arm, sampled_share)

    def _arm_nodes(self, sampled_share: float) -> dict[Arm, float]:
        return {arm: self.expected_nodes(arm, sampled_share) for arm in self.arms}

    def cost(self, batch_size: int, arm: Arm, sampled_share: float = 0.0) -> float | None:
        """Seconds per step (verify plus draft; None if either is unmeasured)."""
        mode = SAMPLED if sampled_share > 0 else GREEDY
        nodes = self._arm_nodes(sampled_share)
        return self.costs.arm_costs(batch_size, mode, self.arms, nodes)[0].get(arm)

    def throughput(self, batch_size: int, arm: Arm, sampled_share: float = 0.0) -> float | None:
        """Predicted tokens per second of one request at this batch size (None: unmeasured)."""
        cost = self.cost(batch_size, arm, sampled_share)
        if cost is None:
            return None
        return self.expected_tokens(arm, sampled_share) / max(cost, 1e-9)

    # -- the decision --------------------------------------------------------
    def decide(self, batch_size: int, num_sampled: int = 0) -> Arm:
        """``choose`` and ``commit``: the arm of the next step (``pinned`` if set, else the
        sweep's next arm while one runs)."""
        decision = self.choose(batch_size, num_sampled)
        self.commit(decision)
        forced = self.pinned
        if forced is None and self.sweep_steps_left:
            forced = self._next_swept(batch_size, num_sampled)
        if forced is not None:  # benchmarks and calibration: the arm is set, still measured
            self.history[-1] = (batch_size, *forced)
            return forced
        return decision.arm

    def start_sweep(self, visits: int = 3, steps_per_visit: int = 3) -> None:
        """Calibration (``eagle-vllm calibrate``): the next steps run every arm in turn,
        ``steps_per_visit`` steps at a time, and all arms ``visits`` times over.

        Measured as usual, every arm's cost window then holds samples from each round
        (one measurement per arm is one noisy sample, and the machine drifts between
        arms measured at different times: interleaved rounds spread the drift over all
        of them), and acceptance is measured at every depth the config allows, also
        for trees the free sizer would not try at this load. After its first visit an
        arm that clearly loses is not visited again (``_next_swept``). Then the sizer
        chooses again."""
        if visits < 0 or steps_per_visit < 1:
            raise ValueError(
                f"visits must be >= 0 and steps_per_visit >= 1, got {visits}, {steps_per_visit}"
            )
        self._sweep = [arm for _ in range(visits) for arm in self.arms][::-1]  # popped
        self._sweep_steps_per_visit = steps_per_visit
        self._sweep_arm, self._sweep_visit_left = OFF, 0
        self._sweep_visited = set()

    @property
    def sweep_steps_left(self) -> int:
        """Steps of the current sweep still to run, at most (0: none running)."""
        return self._sweep_visit_left + len(self._sweep) * self._sweep_steps_per_visit

    def _next_swept(self, batch_size: int, num_sampled: int) -> Arm | None:
        """The sweep's arm for this step. After an arm's first visit, a visit is skipped
        while the arm, as measured, loses to the best arm by more than
        ``SWEEP_CLEAR_LOSS``: beyond the machine's noise, so its rank cannot change (at
        64 requests a 16-node tree verifies 1024 tokens a step)."""
        while self._sweep_visit_left == 0:
            if not self._sweep:
                return None  # the last visits were skipped: the sizer's own choice
            arm = self._sweep.pop()
            if arm in self._sweep_visited and self._clearly_loses(batch_size, num_sampled, arm):
                continue
            self._sweep_visited.add(arm)
            self._sweep_arm, self._sweep_visit_left = arm, self._sweep_steps_per_visit
        self._sweep_visit_left -= 1
        return self._sweep_arm

    def _clearly_loses(self, batch_size: int, num_sampled: int, arm: Arm) -> bool:
        share = min(max(num_sampled / max(batch_size, 1), 0.0), 1.0)
        rates = self._predicted_rates(batch_size, share)[2]
        return arm in rates and rates[arm] * (1.0 + SWEEP_CLEAR_LOSS) < max(rates.values())

    def _predicted_rates(self, batch_size: int, share: float):
        """Every measured arm's cost, the verify costs they were built from, its
        predicted tokens per second, for a batch of which ``share`` samples, the
        relative standard error of a tree's cost against no drafts', and every arm's
        expected nodes per tree."""
        mode = SAMPLED if share > 0 else GREEDY
        nodes = self._arm_nodes(share)
        costs, verify, spread = self.costs.arm_costs_and_spread(batch_size, mode, self.arms, nodes)
        rates = {a: self.expected_tokens(a, share) / max(c, 1e-9) for a, c in costs.items()}
        return costs, verify, rates, spread, nodes

    def start_margin(self, spread: float) -> float:
        """The predicted gain over no drafts that starts drafting (half of it keeps it):
        ``speculation_margin``, or ``SPREAD_Z`` standard errors of the cost difference
        where the measurements are noisier."""
        return max(self.speculation_margin, SPREAD_Z * spread)

    def choose(self, batch_size: int, num_sampled: int = 0) -> Decision:
        """The next step's arm for ``batch_size`` requests, of which ``num_sampled`` sample
        (temperature > 0) and the rest are greedy. Changes nothing."""
        step = self.steps + 1
        share = min(max(num_sampled / max(batch_size, 1), 0.0), 1.0)
        mode = SAMPLED if share > 0 else GREEDY
        bucket = batch_bucket(batch_size)
        costs, verify, rates, spread, nodes = self._predicted_rates(batch_size, share)
        base = costs.get(self._last_best) or costs.get(OFF)
        ctx = _Context(
            costs=costs,
            nodes=nodes,
            sampled_share=share,
            node_slope=verify_slope(verify),
            resume_extra=self.costs.resume_cost(batch_size, mode, verify.get(1)),
            base=base,
            best=max(rates.values(), default=0.0),
        )
        credit, cap = self._explore_credit, self._credit_cap
        if base is not None:  # every step earns a share of its time for explorations
            cap = self.explore_budget * self.max_explore_every * base
            credit = min(credit + self.explore_budget * base, cap)
        made = dict(batch_size=batch_size, sampled_share=share, credit=credit, credit_cap=cap)
        if self._repeat is not None:
            return Decision(self._repeat, "repeat", **made)
        if len(costs) < len(self.arms):
            for arm in self.arms:  # smallest first: off, then growing trees
                if arm in costs or not self._could_win(ctx, arm):
                    continue
                tried = self._unmeasured_tried.get((mode, bucket, arm))
                if tried is not None and step - tried < self.max_explore_every:
                    continue
                if (price := self._price(ctx, arm)) <= credit:
                    return Decision(arm, "unmeasured", price=price, **made)
        if step - self._last_explore >= self._explore_interval:
            explored = self._explore(ctx, bucket, mode, credit, cap, made)
            if explored is not None:
                return explored
        drafting_now = self._last_best not in (None, OFF)
        margin = self.start_margin(spread) / (2 if drafting_now else 1)

        def score(a):
            rate = rates[a]
            if a != OFF:  # to start drafting: +margin; to keep drafting: +margin/2
                rate /= 1.0 + margin
            return (rate, -a[1], -a[0])

        best = max(costs, key=score)
        if (
            best != OFF
            and (mode, bucket) not in self._off_probed
            and self.costs.last_measured(mode, bucket, OFF) < 0
        ):
            # no drafts known only from a profile or the other mode: measure it before
            # trusting a tree's lead over it (twice: the runner measures no drafts in a
            # drafts-off step that follows another); the fresh sample replaces the old
            return Decision(OFF, "probe", price=self._price(ctx, OFF), repeat=OFF, **made)
        return Decision(best, "best", **made)

    def commit(self, decision: Decision) -> None:
        """Apply a decision's bookkeeping: the step count, the exploration credit and
        schedule, the arm in use, the history."""
        self.steps += 1
        self._explore_credit = decision.credit - decision.price
        self._credit_cap = decision.credit_cap
        self._repeat = decision.repeat
        if decision.kind == "best":
            self._last_best = decision.arm
        elif decision.kind == "unmeasured":
            key = (decision.mode, batch_bucket(decision.batch_size), decision.arm)
            self._unmeasured_tried[key] = self.steps
        elif decision.kind in ("explore", "probe"):
            if decision.arm == OFF:
                self._off_probed.add((decision.mode, batch_bucket(decision.batch_size)))
            if self._last_best == OFF:  # no drafts kept winning since the last one
                self._explore_interval = min(2 * self._explore_interval, self.max_explore_every)
            else:
                self._explore_interval = self.explore_every
            self._last_explore = self.steps
            self._explorations += 1
            bucket = batch_bucket(decision.batch_size)
            size = self._charged_size(decision.arm, decision.sampled_share)
            self.costs.renew[(decision.mode, "verify", bucket)] = (size, decision.keep)
            self.costs.renew[(decision.mode, "draft", bucket)] = (decision.arm[0], decision.keep)
        self.last_decision = decision
        self.history.append((decision.batch_size, *decision.arm))
        del self.history[:-4096]

    def _explore(self, ctx: _Context, bucket: int, mode: str, credit: float, cap: float,
                 made: dict) -> Decision | None:  # fmt: skip
        """An exploration, or None (none affordable yet)."""
        # Alternate: the stalest arm that could still win, and a probe of the other
        # side (no drafts while a tree wins, the smallest tree while no drafts wins).
        probe = (self._explorations + 1) % 2 == 0
        drafting_now = self._last_best not in (None, OFF)
        probe_arm = OFF if drafting_now else self.arms[min(1, len(self.arms) - 1)]
        if not probe:
            # the arm in use is measured every step, the probe's at every other
            # exploration: the stalest of the others, if any could still win
            exclude = (probe_arm, self._last_best)
            candidates = [
                a
                for a in ctx.costs
                if a not in exclude
                and self._could_win(ctx, a, own=False)
                and self._price(ctx, a) <= credit
            ]
            if candidates:
                arm = min(candidates, key=lambda a: self._last_measured(ctx, mode, bucket, a))
                # the stalest arm's window may describe another phase of the workload
                # (a warm-up, a burst of prefills): the fresh sample replaces it
                return Decision(arm, "explore", price=self._price(ctx, arm), keep=0, **made)
        price = self._price(ctx, probe_arm)
        # a probe dearer than the cap runs when the credit is full (the credit goes
        # negative), so acceptance is never left stale forever
        if price <= credit or credit >= cap:
            # a probe's fresh sample joins its two latest (a median of three: one sample
            # is noise, nine follow a change too slowly); no drafts twice, since the
            # runner measures no drafts only in a drafts-off step that follows another
            repeat = OFF if probe_arm == OFF else None
            return Decision(probe_arm, "probe", price=price, keep=2, repeat=repeat, **made)
        return None  # the credit is short: try again next step

    def _floor(self, ctx: _Context, arm: Arm, own: bool = True) -> float:
        """A lower bound of an arm's cost: for every measured arm with at most as many
        nodes (as its trees come out) and passes, its cost plus the extra nodes at the
        node slope each (costs grow with nodes and passes); the largest of these."""
        size = ctx.nodes.get(arm, arm[1])
        return max(
            (
                c + ctx.node_slope * (size - other_size)
                for other, c in ctx.costs.items()
                if other[0] <= arm[0]
                and (other_size := ctx.nodes.get(other, other[1])) <= size
                and (own or other != arm)
            ),
            default=0.0,
        )

    def _last_measured(self, ctx: _Context, mode: str, bucket: int, arm: Arm) -> int:
        """The step an arm was last measured at (its trees' own size, if smaller)."""
        size = charged_size(ctx.nodes.get(arm, arm[1]), arm[1])
        return self.costs.last_measured(mode, bucket, arm, size)

    def _charged_size(self, arm: Arm, sampled_share: float) -> int:
        """The tree size a step of ``arm`` is expected to be charged to."""
        return charged_size(self.expected_nodes(arm, sampled_share), arm[1])

    def _could_win(self, ctx: _Context, arm: Arm, own: bool = True) -> bool:
        """Optimistic bound: expected tokens over ``_floor``. ``own=False`` leaves the
        arm's own measurement out, for re-measuring it: a stale sample must not be what
        keeps an arm from being measured again."""
        floor = self._floor(ctx, arm, own)
        return floor <= 0 or self.expected_tokens(arm, ctx.sampled_share) / floor > ctx.best

    def _price(self, ctx: _Context, arm: Arm) -> float:
        """Seconds an exploration of ``arm`` costs over the arm in use: its floor (its cost
        if measured) less ``base``, plus, for a tree while no drafts is in use, what
        resuming drafting costs beyond that. Nothing before anything is measured: every
        arm's first sample is exploration."""
        if ctx.base is None:
            return 0.0
        price = max(self._floor(ctx, arm) - ctx.base, 0.0)
        if arm[0] > 0 and self._last_best in (None, OFF):
            price += ctx.resume_extra
        return price

    # -- calibration profiles (eagle-vllm calibrate, config key sizing_profile) ----
    def export_profile(self) -> dict:
        """The measured costs (per batch bucket and mode) and acceptance, JSON-ready, to
        seed another engine of the same config on the same hardware."""
        profile = {
            "eagle_vllm_sizing_profile": PROFILE_VERSION,
            "depth": self.max_passes,  # the profile format's name
            "topk": self.topk,
            "root_topk": self.root_topk,
            "max_nodes": self.max_nodes,
            **self.costs.export(),
        }
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
        than any the engine takes, and the acceptance rates, worth ``PROFILE_TRIALS``
        drafts. New batch buckets then start from measured costs instead of trying every
        arm. A cost only the profile has measured is scaled by how this engine's samples
        of the bucket's other costs compare with the profile's (the machine's drift)."""
        check_profile(profile, self.max_passes, self.topk, self.max_nodes, self.root_topk)
        self.costs.load({k: profile[k] for k in PROFILE_COST_KEYS if k in profile})
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
        at the batch size that fills it, in the mode of the last committed decision)."""
        last = self.last_decision
        share = 0.0 if last is None else last.sampled_share
        mode = SAMPLED if share > 0 else GREEDY
        out = {"arms": [list(a) for a in self.arms], "mode": mode, "buckets": {}}
        nodes = self._arm_nodes(share)
        for b in self.costs.buckets():
            costs, _ = self.costs.arm_costs(b, mode, self.arms, nodes)
            out["buckets"][b] = {
                f"{d},{m}": {
                    "expected_tokens": round(self.expected_tokens((d, m), share), 3),
                    "expected_nodes": round(nodes[(d, m)], 2),
                    "seconds": None if (c := costs.get((d, m))) is None else round(c, 5),
                }
                for d, m in self.arms
            }
        return out


def check_profile(
    profile: object, max_passes: int, topk: int, max_nodes: int, root_topk: int | None = None
) -> None:
    """Raise ValueError (what is wrong, and the fix) unless ``profile`` is a sizing
    profile made for this tree bound (passes, topk, the root's children and largest
    tree). A profile without ``root_topk`` was made with the root as wide as ``topk``."""
    fix = "make it with `eagle-vllm calibrate` for this config"
    if not isinstance(profile, dict) or "eagle_vllm_sizing_profile" not in profile:
        raise ValueError(f"not an eagle-vllm sizing profile. Fix: {fix}")
    if profile["eagle_vllm_sizing_profile"] != PROFILE_VERSION:
        raise ValueError(
            f"profile version {profile['eagle_vllm_sizing_profile']!r}, expected "
            f"{PROFILE_VERSION}. Fix: {fix}"
        )
    made = (
        profile.get("depth"),
        profile.get("topk"),
        profile.get("root_topk", profile.get("topk")),
        profile.get("max_nodes"),
    )
    wanted = (max_passes, topk, topk if root_topk is None else root_topk, max_nodes)
    if made != wanted:
        raise ValueError(
            f"made for num_speculative_tokens/topk/root_topk/max_total_tokens {made}, the "
            f"config has {wanted}. Fix: {fix}"
        )
    shape = [max_passes + 1, max_nodes]
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
