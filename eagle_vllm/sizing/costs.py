"""Measured step costs per batch size, tree size and draft passes (pure Python).

A step that drafts ``d`` passes and verifies ``m`` tree nodes costs
``verify(B, m) + draft(B, d)`` seconds at batch size ``B``:

* ``verify(B, m)``: the whole step except drafting (target forward, verification, KV
  compaction, vLLM's bookkeeping);
* ``draft(B, d)``: the drafter's passes.

Both are wall-clock measurements on the running hardware, kept per exact batch size and
per power-of-two batch-size bucket (for batch sizes not seen yet, and for calibration
profiles), as the median of the last few samples (robust to a stray slow step: a
garbage collection, another tenant). They are kept per mode of the batch: ``greedy``
when no request samples, ``sampled`` when any does (verification at T > 0 computes
probabilities for every node). A cost not yet measured in a mode is the other mode's,
scaled by how the two compare where both are measured.

The verify costs of one batch size are fitted together (``monotone_verify_costs``): a
bigger tree never costs less, and the windows' spread measures the machine's noise,
which sets how much gain the sizer needs before it starts drafting (``policy.py``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from eagle_vllm.sizing.acceptance import GREEDY, SAMPLED

# Costs are kept per mode of the batch: GREEDY when no request samples, SAMPLED when any
# does. Verification at T > 0 computes probabilities over the vocabulary for every
# node (SmolLM2 on CPU: the rejection sampler is 12-40% of a drafting step at T=1
# against 2-5% at T=0), so a tree's cost measured on greedy batches undersells it on
# sampled ones, and the reverse.
MODES = (GREEDY, SAMPLED)
KINDS = ("verify", "draft")


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, 8, ...)."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))


def other_mode(mode: str) -> str:
    return SAMPLED if mode == GREEDY else GREEDY


class Samples:
    """The last few wall-clock samples of one cost; its value is their median."""

    def __init__(self, window: int):
        self.samples: deque[float] = deque(maxlen=window)
        self.last_step = -1
        # read every step, changed once per step at most
        self._median: float | None = None
        self._deviation: float | None = None

    def add(self, seconds: float, step: int) -> None:
        self.samples.append(seconds)
        self.last_step = step
        self._median = self._deviation = None

    def keep_last(self, n: int) -> None:
        while len(self.samples) > n:
            self.samples.popleft()
        self._median = self._deviation = None

    @property
    def value(self) -> float:
        if self._median is None:
            self._median = statistics.median(self.samples)
        return self._median

    @property
    def relative_deviation(self) -> float:
        """The samples' median absolute deviation from their median, relative to it."""
        if self._deviation is None:
            median = self.value
            self._deviation = statistics.median(
                abs(x / median - 1.0) if median > 0 else 0.0 for x in self.samples
            )
        return self._deviation


class CostModel:
    """Step costs as measured: per mode, kind, batch bucket (and exact batch size) and size
    (tree nodes for ``verify``, draft passes for ``draft``)."""

    def __init__(self, tree_sizes: list[int], pass_counts: list[int], window: int = 9):
        self.tree_sizes, self.pass_counts, self.window = tree_sizes, pass_counts, window
        # (mode, kind) -> (bucket, size) -> samples
        self.bucket: dict[str, dict[str, dict[tuple[int, int], Samples]]] = {
            mode: {kind: {} for kind in KINDS} for mode in MODES
        }
        # The same samples per exact batch size, preferred where measured: within a
        # bucket a step's cost still varies with the batch (SmolLM2 on CPU, one draft
        # per request: 59 ms at 3 requests, 75 ms at 4), and the steps of a load's tail
        # (requests finishing) leave the bucket's window describing a smaller batch.
        self.exact: dict[str, dict[str, dict[tuple[int, int], Samples]]] = {
            mode: {kind: {} for kind in KINDS} for mode in MODES
        }
        # A cost not yet measured in the batch's mode is the other mode's, scaled by how
        # the two modes' costs of this (kind, bucket) compare where both are measured.
        self.mode_ratio: dict[tuple[str, str, int], Samples] = {}
        # A calibration profile's costs, and how this engine's live samples compare with
        # them per (kind, bucket): the machine drifts as a whole (SmolLM2 on CPU, a day
        # after calibrating: 42 ms for a drafts-off step at 4 requests against the
        # profile's 55). Costs only the profile has measured are scaled by that ratio, so
        # the arm in use is not compared with a stale competitor.
        self.profile_cost: dict[tuple[str, str, int, int], float] = {}
        self.drift: dict[tuple[str, int], Samples] = {}
        # Steps where drafting resumed after no drafts, per (mode, bucket): the period less
        # its drafting. Beyond a drafts-off step, such a step writes the draft KV deferred
        # while drafts were off and pays vLLM's bookkeeping around the first drafts
        # (SmolLM2 on CPU, 16 requests: 119 ms against 64 for a drafts-off step, 44 of it
        # catch-up); an exploration of a tree while no drafts wins pays that too.
        self.resume: dict[tuple[str, int], Samples] = {}
        # the window an exploration renews, (mode, kind, bucket) -> (size, old samples
        # kept): the next sample of that kind in the bucket is the exploration's, so it
        # applies to that sample only (a step charged to another size than expected
        # must not leave a renewal pending for a later step of that size)
        self.renew: dict[tuple[str, str, int], tuple[int, int]] = {}

    def observe(self, kind: str, batch_size: int, size: int, seconds: float, mode: str,
                step: int) -> None:  # fmt: skip
        bucket = batch_bucket(batch_size)
        renewed = self.renew.pop((mode, kind, bucket), None)
        keep = renewed[1] if renewed is not None and renewed[0] == size else None
        profiled = self.profile_cost.get((mode, kind, bucket, size))
        if profiled is not None:
            drift = self.drift.setdefault((kind, bucket), Samples(self.window))
            drift.add(seconds / profiled, step)
        other = self.bucket[other_mode(mode)][kind].get((bucket, size))
        if other is not None:
            ratio = self.mode_ratio.setdefault((mode, kind, bucket), Samples(self.window))
            ratio.add(seconds / max(self.scaled(other, kind, bucket), 1e-12), step)
        for windows, key in (
            (self.bucket[mode][kind], (bucket, size)),
            (self.exact[mode][kind], (batch_size, size)),
        ):
            samples = windows.setdefault(key, Samples(self.window))
            if keep is not None:
                samples.keep_last(keep)
            samples.add(seconds, step)

    def observe_resume(self, batch_size: int, seconds: float, mode: str, step: int) -> None:
        key = (mode, batch_bucket(batch_size))
        self.resume.setdefault(key, Samples(self.window)).add(seconds, step)

    def scaled(self, samples: Samples, kind: str, bucket: int) -> float:
        """A window's value; one holding only the profile's seed is scaled as the machine
        drifted since calibrating."""
        return samples.value * self._drift_factor(samples, kind, bucket)

    def _drift_factor(self, samples: Samples, kind: str, bucket: int) -> float:
        """How the machine drifted since calibrating, for a window holding only the
        profile's seed (1 for any other)."""
        if samples.last_step < 0 and (drift := self.drift.get((kind, bucket))):
            return drift.value
        return 1.0

    def kind_cost(self, batch_size: int, kind: str, size: int, mode: str) -> float | None:
        """One kind of cost in ``mode``: the exact batch size's samples where measured,
        else its bucket's (batch sizes not seen yet, and a calibration profile's
        buckets); else the other mode's, scaled by the modes' measured ratio."""
        found = self._window(batch_size, kind, size, mode)
        return None if found is None else found[0] * found[1].value

    def _window(
        self, batch_size: int, kind: str, size: int, mode: str
    ) -> tuple[float, Samples] | None:
        """``kind_cost``'s window: (scale, samples); the cost is ``scale`` times their
        median (the scale: the machine's drift since a profile, the modes' ratio)."""
        bucket = batch_bucket(batch_size)
        for found_in in (mode, other_mode(mode)):
            samples = self.exact[found_in][kind].get((batch_size, size))
            samples = samples or self.bucket[found_in][kind].get((bucket, size))
            if samples is not None:
                break
        else:
            return None
        scale = self._drift_factor(samples, kind, bucket)
        if found_in != mode and (ratio := self.mode_ratio.get((mode, kind, bucket))):
            scale *= ratio.value
        return scale, samples

    def arm_costs(
        self,
        batch_size: int,
        mode: str,
        arms: list[tuple[int, int]],
        nodes: dict[tuple[int, int], float] | None = None,
    ) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
        """Seconds per step of every arm measured at this batch size, in arm order, and
        the verify cost per tree size they were built from.

        Each distinct size's cost is looked up once (this runs every step, on the
        critical path of batch 1). A bigger tree, or more passes, never costs less: verify
        costs are the non-decreasing fit of every size's samples
        (``monotone_verify_costs``), draft costs made non-decreasing in passes. Each size
        is measured alone, at its own times, on a noisy machine; taken as measured, a
        6-node verify can read cheaper than a 4-node one, and the sizer would pick two
        passes of 6 nodes over one pass of 4 for a cost the 6-node tree cannot have.

        ``nodes``: per arm, the nodes its trees hold on average, where they come out
        smaller than its size (``AcceptanceStats.expected_nodes``): its verify cost is
        that of trees that size (``verify_cost_at``)."""
        return self.arm_costs_and_spread(batch_size, mode, arms, nodes)[:2]

    def arm_costs_and_spread(
        self,
        batch_size: int,
        mode: str,
        arms: list[tuple[int, int]],
        nodes: dict[tuple[int, int], float] | None = None,
    ) -> tuple[dict[tuple[int, int], float], dict[int, float], float]:
        """``arm_costs``, and the relative standard error of a tree's predicted cost
        against no drafts' (``monotone_verify_costs``; 0 until both have a few samples)."""
        windows = {m: self._window(batch_size, "verify", m, mode) for m in self.tree_sizes}
        verify, spread = monotone_verify_costs(windows)
        draft = _non_decreasing(
            {d: self.kind_cost(batch_size, "draft", d, mode) for d in self.pass_counts}
        )
        nodes = nodes or {}
        costs = {}
        for d, m in arms:
            v = verify_cost_at(verify, nodes.get((d, m), m), m)
            if v is not None and d in draft:
                costs[(d, m)] = v + draft[d]
        return costs, verify, spread

    def resume_cost(self, batch_size: int, mode: str, off: float | None) -> float:
        """What resuming drafting costs beyond a drafts-off step at this batch size (0
        until measured); ``off``: that step's cost, if known."""
        bucket = batch_bucket(batch_size)
        samples = self.resume.get((mode, bucket)) or self.resume.get((other_mode(mode), bucket))
        if samples is None or off is None:
            return 0.0
        return max(samples.value - off, 0.0)

    def last_measured(
        self, mode: str, bucket: int, arm: tuple[int, int], nodes: int | None = None
    ) -> int:
        """The step an arm was last measured at in this mode and bucket (-2: never);
        ``nodes``: the size its trees come out at, if smaller than its own."""
        tables = self.bucket[mode]
        v = tables["verify"].get((bucket, arm[1] if nodes is None else nodes))
        d = tables["draft"].get((bucket, arm[0]))
        return min(v.last_step if v else -2, d.last_step if d else -2)

    def buckets(self) -> list[int]:
        return sorted({b for t in self.bucket.values() for w in t.values() for b, _ in w})

    # -- calibration profiles ------------------------------------------------
    def export(self) -> dict[str, dict[str, float]]:
        """``{kind}_seconds[_sampled]`` tables (the sampled mode's only where measured)."""

        def table(windows: dict) -> dict[str, float]:
            return {f"{b},{n}": s.value for (b, n), s in sorted(windows.items()) if s.samples}

        out = {}
        for mode, suffix in ((GREEDY, ""), (SAMPLED, "_sampled")):
            for kind in KINDS:
                costs = table(self.bucket[mode][kind])
                if costs or mode == GREEDY:
                    out[f"{kind}_seconds{suffix}"] = costs
        return out

    def load(self, tables: dict[str, dict[str, float]]) -> None:
        """Seed from ``export``'s tables: one sample per cost, older than any the engine
        takes (so it is re-measured first, and outvoted by the engine's own samples)."""
        for name, costs in tables.items():
            kind = name.split("_")[0]
            mode = SAMPLED if name.endswith("_sampled") else GREEDY
            windows = self.bucket[mode][kind]
            for key, seconds in costs.items():
                bucket, size = (int(x) for x in key.split(","))
                windows.setdefault((bucket, size), Samples(self.window)).add(float(seconds), -1)
                self.profile_cost[(mode, kind, bucket, size)] = float(seconds)
        for mode in MODES:  # how the profile's two modes compare, per (kind, bucket)
            for kind in KINDS:
                for (bucket, size), samples in self.bucket[mode][kind].items():
                    theirs = self.bucket[other_mode(mode)][kind].get((bucket, size))
                    if theirs is not None:
                        ratio = self.mode_ratio.setdefault(
                            (mode, kind, bucket), Samples(self.window)
                        )
                        ratio.add(samples.value / theirs.value, -1)


def comes_out_full(nodes: float, size: int) -> bool:
    """Whether trees drafted for ``size`` nodes that hold ``nodes`` on average are full,
    within rounding."""
    return nodes >= size - 0.5


def charged_size(nodes: float, size: int) -> int:
    """The tree size a step is charged to whose trees, drafted for at most ``size``
    nodes, hold ``nodes`` per request on average: ``size`` while they are full, else the
    mean rounded, at least 2 (a step with drafts is not a drafts-off step)."""
    return size if comes_out_full(nodes, size) else max(2, round(nodes))


def verify_cost_at(verify: dict[int, float], nodes: float, size: int) -> float | None:
    """The verify cost of an arm of ``size`` nodes whose trees hold ``nodes`` on average
    (from ``verify``, the costs per tree size): its size's cost while its trees are
    full, else the cost interpolated at their size between the measured sizes around
    it (a 1-pass 9-node arm whose suffix candidates fill 7 nodes verifies what a 7-node
    tree does). None: unmeasured (an arm never drafted reads as full, so it needs its
    own size measured)."""
    if comes_out_full(nodes, size):
        return verify.get(size)
    below = max((s for s in verify if s <= nodes), default=None)
    above = min((s for s in verify if s >= nodes), default=None)
    if below is None or above is None:
        return verify.get(size)
    if above == below:
        cost = verify[below]
    else:
        share = (nodes - below) / (above - below)
        cost = verify[below] + share * (verify[above] - verify[below])
    return min(cost, verify[size]) if size in verify else cost


def verify_slope(verify: dict[int, float]) -> float:
    """A lower bound of what one more tree node adds to a step at one batch size, from
    its verify costs per tree size (``CostModel.arm_costs``): half the chord slope of
    those costs (between the smallest and largest tree measured; from no drafts if only
    one tree is). Verifying is memory-bound for few tokens and compute-bound beyond, so
    the marginal cost of a node only grows with the tree, and the chord under-estimates
    what lies beyond the largest measured tree; the half absorbs noise and the fixed
    cost drafting adds at two nodes. ``E(d, m) <= 1 + d`` caps what a bigger tree can
    give, but without a slope its cost is bounded by a much smaller tree's, and at 64
    requests a 16-node tree (1024 tokens a step) would look able to win next to a 4-node
    one and be explored at 3x a plain step's cost."""
    measured = sorted(verify.items())
    trees = [(m, c) for m, c in measured if m >= 2]
    span = trees if len(trees) >= 2 else measured
    if len(span) < 2:
        return 0.0
    (m_lo, c_lo), (m_hi, c_hi) = span[0], span[-1]
    return 0.5 * max(c_hi - c_lo, 0.0) / (m_hi - m_lo)


# Samples a window needs before its spread counts (``monotone_verify_costs``): a
# profile's seed is one sample, and the spread of two says little.
MIN_SPREAD_SAMPLES = 3


def monotone_verify_costs(
    windows: dict[int, tuple[float, Samples] | None],
) -> tuple[dict[int, float], float]:
    """Verify costs per tree size (1: no drafts) from every size's window (``(scale,
    samples)``: the cost is ``scale`` times the samples' median; None: unmeasured, left
    out), and the relative standard error of a tree's cost against no drafts'.

    The costs are the least-squares non-decreasing fit of the windows' medians, weighted
    by their sample counts (pool-adjacent-violators): a bigger tree never costs less,
    and where a size reads cheaper than a smaller one, the two are pooled into their
    weighted mean. Raising the dip to the smaller size's cost instead keeps every
    stray slow sample and drops every lucky fast one, and a shape assumed for the
    costs (a line) misprices the sizes off it: verifying is memory-bound for few
    tokens and compute-bound beyond.

    The standard error: the machine's noise, as the median over the windows of
    ``MIN_SPREAD_SAMPLES`` or more of their samples' relative deviation from their
    own median (robust to a stray slow step; 1.4826 times it is a normal sigma), taken
    as 1.25 sigma / sqrt(n) for a median, for no drafts' window and the fullest tree
    window (the arm in use) together; 0 until both are measured."""
    sizes, medians, counts, deviations = [], [], [], []
    for size, window in sorted(windows.items()):
        if window is None:
            continue
        scale, samples = window
        sizes.append(size)
        medians.append(scale * samples.value)
        counts.append(len(samples.samples))
        if counts[-1] >= MIN_SPREAD_SAMPLES:
            deviations.append(samples.relative_deviation)
    costs = dict(zip(sizes, _pool_adjacent_violators(medians, counts)))
    n_off = counts[0] if sizes and sizes[0] <= 1 else 0
    n_tree = max((n for size, n in zip(sizes, counts) if size > 1), default=0)
    if min(n_off, n_tree) < MIN_SPREAD_SAMPLES:
        return costs, 0.0
    sigma = 1.4826 * statistics.median(deviations)
    return costs, 1.25 * sigma * math.sqrt(1.0 / n_off + 1.0 / n_tree)


def _pool_adjacent_violators(values: list[float], weights: list[int]) -> list[float]:
    """The weighted least-squares non-decreasing sequence nearest ``values``."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for value, weight in zip(values, weights):
        blocks.append([value, float(max(weight, 1)), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight, length = blocks.pop()
            last = blocks[-1]
            total = last[1] + weight
            last[0] = (last[0] * last[1] + mean * weight) / total
            last[1], last[2] = total, last[2] + length
    return [mean for mean, _, length in blocks for _ in range(length)]


def _non_decreasing(costs: dict[int, float | None]) -> dict[int, float]:
    """The measured costs (None: unmeasured, left out), each raised to the largest cost
    of a smaller size."""
    out: dict[int, float] = {}
    floor = 0.0
    for size in sorted(costs):
        if (cost := costs[size]) is not None:
            floor = out[size] = max(floor, cost)
    return out
