"""Acceptance statistics of rank-ordered draft trees, per class of request (pure torch).

Trees come in rank order (every prefix is the best smaller tree, ``tree/builder.py``)
and a node's acceptance depends only on its own path, so how often the j-th node of
a tree cut at depth d is accepted is measured from every verified tree, for every
depth limit at once. Acceptance does not depend on load, so it is shared by all
batch sizes; it does depend on sampling, so greedy and sampled requests keep their
own statistics and a batch's expected tokens weigh the two by their share of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Acceptance is kept per class of request: sampled requests accept fewer drafts than
# greedy ones (SmolLM2 on HumanEval, one draft: about 1.26 tokens per step at T=1, 1.35
# at T=0), and a batch may hold both.
GREEDY, SAMPLED = "greedy", "sampled"
CLASSES = (GREEDY, SAMPLED)
# A class seen for the first time starts from the other class's rates, weighted as this
# many verified drafts of its best node: its own first few steps outvote them.
SEED_TRIALS = 8.0


def other_class(cls: str) -> str:
    return SAMPLED if cls == GREEDY else GREEDY


@dataclass
class AcceptanceStats:
    """How often the j-th node of a rank-ordered tree, cut at depth d (drafted with d
    passes), is accepted."""

    max_passes: int
    max_nodes: int
    decay: float = 0.995
    # deepest node another source (suffix candidates, no draft pass) adds to a tree: a
    # tree of d passes then accepts up to max(d, extra_depth) drafts
    extra_depth: int = 0
    # prior: one pseudo-observation, never decayed, so a node unseen (or not seen for
    # long) drifts back to worth trying: at this rate for the first draft, at the
    # better-ranked node's rate for the others (rates())
    prior_rate: float = 0.5
    hits: torch.Tensor = field(init=False)
    trials: torch.Tensor = field(init=False)
    # E(d, m) for every d and m, rebuilt once after the counts change (the sizer reads it
    # for every arm, several times per step)
    _expected: list[list[float]] | None = field(init=False, default=None, repr=False)
    # whether any node was ever tried: asked for every arm of every step, so kept with
    # the counts instead of a tensor reduction per question
    _observed: bool | None = field(init=False, default=None, repr=False)
    # At each tree's own cut (its passes), how often the j-th rank of the size it was
    # drafted for was tried and how often a node filled it: the trees' expected sizes
    # (``expected_nodes``), which are what a step verifies. Not part of a profile.
    own_trials: torch.Tensor = field(init=False, repr=False)
    own_filled: torch.Tensor = field(init=False, repr=False)
    _nodes: list[list[float]] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        shape = (self.max_passes + 1, self.max_nodes)
        self.set_counts(torch.zeros(shape, dtype=torch.float64), torch.zeros(shape))
        self.own_trials = torch.zeros(shape, dtype=torch.float64)
        self.own_filled = torch.zeros(shape, dtype=torch.float64)

    @property
    def observed(self) -> bool:
        if self._observed is None:
            self._observed = bool(self.trials.any())
        return self._observed

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
        self._expected = self._observed = None

    def update(
        self,
        depths: torch.Tensor,
        valid: torch.Tensor,
        accepted: torch.Tensor,
        passes: torch.Tensor | int | None = None,
        nodes: torch.Tensor | int | None = None,
    ) -> None:
        """One verified step. ``[R, W]`` per request and node (node 0 = root):
        node depths, which nodes were verified, which were accepted. ``passes``: the
        draft passes each tree was drafted with (``[R]`` or one for all; None: every
        tree was drafted to ``max_passes``); ``nodes``: the size each tree was drafted
        for, root included (``[R]`` or one for all; None: as verified)."""
        if depths.numel() == 0:
            return
        depths, valid, accepted = depths.cpu(), valid.cpu(), accepted.cpu()
        self.age()
        drafted = valid.clone()
        drafted[:, 0] = False  # the root is not a draft
        # Trees cut at every depth d at once: keep[d - 1] holds the nodes at depth <= d,
        # and a kept node counts as the j-th node of its cut tree (1-based: the root is
        # node 0). One vectorised pass: this runs every step, on the critical path.
        cuts = torch.arange(1, self.max_passes + 1)[:, None, None]
        keep = drafted[None] & (depths[None] <= cuts)  # [depth, R, W]
        if passes is not None:
            # A tree of d passes is the cut at depth d of a deeper tree, not a deeper
            # cut: there, nodes at depth d + 1 would outrank some of its nodes. Counted
            # as deeper cuts, one-pass trees in use made two passes look worth what one
            # is, and no acceptance could then pay for a second pass.
            passes = torch.as_tensor(passes, dtype=depths.dtype).reshape(-1, 1)
            keep &= cuts <= passes[None]
        j = torch.cumsum(keep.to(torch.int64), dim=2).clamp(max=self.max_nodes - 1)
        index = (cuts * self.max_nodes + j)[keep]
        self.trials.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
        hits = accepted[None].expand_as(keep)[keep].to(torch.float64)
        self.hits.view(-1).index_add_(0, index, hits)
        if nodes is not None:
            self._count_empty_ranks(keep, valid[:, 0], passes, nodes)
        self._expected = self._observed = self._nodes = None

    def _count_empty_ranks(self, keep: torch.Tensor, present: torch.Tensor, passes, nodes) -> None:
        """A tree that came out smaller than the size it was drafted for (a suffix source
        with few candidates fills the ranks beyond the draft passes' nodes) left its
        last ranks empty: at its own cut they count as drafts not accepted. Measured on
        the trees that filled them only, a 1-pass 9-node arm read as 2.44 tokens a step
        where it gave 2.24 (SmolLM2, HumanEval, 4 requests), and the sizer chose it over
        smaller trees that gave as much for fewer verified tokens. Deeper cuts are not
        counted: there, more passes would have filled those ranks."""
        rows = keep.shape[1]
        own = torch.full((rows,), self.max_passes, dtype=torch.int64)
        if passes is not None:
            own = torch.as_tensor(passes, dtype=torch.int64).reshape(-1).expand(rows)
        own = own.clamp(1, self.max_passes)
        filled = keep.sum(dim=2)[own - 1, torch.arange(rows)]  # drafts in each own cut
        size = torch.as_tensor(nodes, dtype=torch.int64).reshape(-1).expand(rows)
        ranks = torch.arange(self.max_nodes)
        tried = (ranks > 0) & (ranks < size[:, None]) & present[:, None]  # [R, max_nodes]
        empty = tried & (ranks > filled[:, None])
        cells = own[:, None] * self.max_nodes + ranks
        for counts, mask in ((self.own_trials, tried), (self.own_filled, tried & ~empty)):
            index = cells[mask]
            counts.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
        if bool(empty.any()):
            index = cells[empty]
            self.trials.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.float64))

    def age(self) -> None:
        """One step passes: older observations weigh less (a step without drafts
        observes nothing else)."""
        self.hits *= self.decay
        self.trials *= self.decay
        self.own_trials *= self.decay
        self.own_filled *= self.decay
        self._expected = self._nodes = None

    def rates(self, d: int) -> torch.Tensor:
        """Acceptance rate of the j-th node (index 0: the root) of trees cut at depth d."""
        return torch.tensor(self._all_rates()[d], dtype=torch.float64)

    def _all_rates(self) -> list[list[float]]:
        """Per cut depth, each node's hits and trials plus one pseudo-trial of the prior:
        ``prior_rate`` for the first draft, the better-ranked node's rate for the others;
        and never above that rate.

        Never rising with rank: trees are ranked by draft score, so a node is accepted
        at most as often as a better-ranked one. Without the cap, nodes seldom verified
        sit near the prior and promise more than any tree can give, so big trees are
        tried at loads where one costs five plain steps. The prior follows rank for the
        same reason: a calibration profile's counts, scaled to 64 trials, leave the
        late ranks with a few trials each, and a flat prior there made a 16-node tree
        look worth 3.8 tokens a step where its nodes measured almost nothing."""
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
            # E(d, m) = 1 + sum of the first m - 1 drafts' rates, capped at 1 + d, and at
            # least E(d - 1, m): a deeper cut ranks a superset of the shallower cut's
            # nodes, so its best m nodes are worth at least as much (without the floor, a
            # cut measured seldom, near the prior, reads worse than the shallower one
            # measured every step, and is never tried)
            self._expected = []
            for cut, rates in enumerate(self._all_rates()):
                row, total = [1.0, 1.0], 1.0
                for rate in rates[1:]:
                    total += rate
                    row.append(min(total, 1.0 + max(cut, self.extra_depth)))
                if cut >= 2:
                    row = [max(e, shallower) for e, shallower in zip(row, self._expected[-1])]
                self._expected.append(row)
        return self._expected[d][min(m, self.max_nodes)]

    def expected_nodes(self, d: int, m: int) -> float:
        """Nodes a tree drafted with ``d`` passes for ``m`` nodes holds, root included: ``m``
        unless its trees came out smaller (few suffix candidates). Each rank's filled
        share at the trees' own cut, with one pseudo-trial filled (a size never drafted
        reads as full), never rising with rank (a rank is filled only after the ones
        before it)."""
        if d == 0 or m <= 1:
            return 1.0
        if self._nodes is None:
            self._nodes = []
            filled, tried = self.own_filled.tolist(), self.own_trials.tolist()
            for filled_row, tried_row in zip(filled, tried):
                row, total, share = [1.0, 1.0], 1.0, 1.0
                for f, t in zip(filled_row[1:], tried_row[1:]):
                    share = min(share, (f + 1.0) / (t + 1.0))
                    total += share
                    row.append(total)
                self._nodes.append(row)
        return self._nodes[d][min(m, self.max_nodes)]


class AcceptanceByClass:
    """Greedy and sampled requests' ``AcceptanceStats``; a batch's expected tokens weigh
    the two classes by their share of it."""

    def __init__(self, max_passes: int, max_nodes: int, extra_depth: int = 0):
        self.of = {
            cls: AcceptanceStats(max_passes, max_nodes, extra_depth=extra_depth) for cls in CLASSES
        }

    def _stats(self, cls: str) -> AcceptanceStats:
        """A class never observed reads as the other's rates, weakly (``SEED_TRIALS``),
        once the other is observed; it is seeded so when first observed."""
        stats, other = self.of[cls], self.of[other_class(cls)]
        if stats.observed or not other.observed:
            return stats
        seeded = AcceptanceStats(stats.max_passes, stats.max_nodes, stats.decay,
                                 stats.extra_depth, stats.prior_rate)  # fmt: skip
        seeded.seed_from(other)
        return seeded

    def expected_tokens(self, arm: tuple[int, int], sampled_share: float = 0.0) -> float:
        """Tokens per request per step of a batch of which ``sampled_share`` samples: each
        class's E(d, m), weighted by its share of the batch."""
        greedy = self._stats(GREEDY).expected_tokens(*arm) if sampled_share < 1 else 0.0
        if sampled_share <= 0:
            return greedy
        sampled = self._stats(SAMPLED).expected_tokens(*arm)
        return (1.0 - sampled_share) * greedy + sampled_share * sampled

    def expected_nodes(self, arm: tuple[int, int], sampled_share: float = 0.0) -> float:
        """Nodes per request a step of ``arm`` verifies (``AcceptanceStats.
        expected_nodes``), each class weighted by its share of the batch."""
        greedy = self._stats(GREEDY).expected_nodes(*arm) if sampled_share < 1 else 0.0
        if sampled_share <= 0:
            return greedy
        sampled = self._stats(SAMPLED).expected_nodes(*arm)
        return (1.0 - sampled_share) * greedy + sampled_share * sampled

    def observe(self, depths, valid, accepted, sampled=None, passes=None, nodes=None) -> None:
        """One verified step (``AcceptanceStats.update``); ``sampled``: ``[R]`` bool, which
        requests sample (temperature > 0), None if none do; ``passes``: the trees' draft
        passes (``[R]``, one int, or None: ``max_passes``); ``nodes``: the sizes they
        were drafted for (``[R]``, one int, or None: as verified)."""
        if sampled is None or not bool(torch.as_tensor(sampled).any()):
            self._seed(GREEDY)
            self.of[GREEDY].update(depths, valid, accepted, passes, nodes)
            return
        sampled = torch.as_tensor(sampled, dtype=torch.bool).cpu()
        parts = [
            (cls, rows) for cls, rows in ((GREEDY, ~sampled), (SAMPLED, sampled)) if rows.any()
        ]
        for cls, _ in parts:  # both from the counts as they were before this step
            self._seed(cls)
        for cls, rows in parts:
            per_class = [
                x[rows] if isinstance(x, torch.Tensor) and x.dim() else x for x in (passes, nodes)
            ]
            self.of[cls].update(depths[rows], valid[rows], accepted[rows], *per_class)

    def age(self, sampled_share: float) -> None:
        """A step without drafts: the classes in the batch age (nothing is observed)."""
        for cls, share in ((GREEDY, 1.0 - sampled_share), (SAMPLED, sampled_share)):
            if share > 0:
                self.of[cls].age()

    def _seed(self, cls: str) -> None:
        """A class never observed starts from the other's rates (weakly), not the prior."""
        stats, other = self.of[cls], self.of[other_class(cls)]
        if not stats.observed and other.observed:
            stats.seed_from(other)


class SourceCalibration:
    """Acceptance per draft source and depth, against what the source predicted.

    Every verified node of a merged tree (``tree/merge.py``) has a source class (EAGLE,
    suffix, or both), a depth and a raw value: its source's own estimate of the chance it
    is accepted (EAGLE: product of draft confidences; suffix: path probability; both: the
    larger). ``factors()[source, depth]`` is accepted nodes over summed raw values, with
    decay, so ``factor * raw`` estimates the acceptance of a node like it: the merge
    ranks both sources on that one scale. One pseudo-observation predicting and
    accepting ``prior`` keeps classes never seen at factor 1 (their raw values rank them)
    and pulls thinly measured ones toward it.
    """

    def __init__(self, max_depth: int, decay: float = 0.995, prior: float = 1.0) -> None:
        self.max_depth = int(max_depth)
        self.decay = decay
        self.prior = prior
        self.predicted = torch.zeros(4, self.max_depth + 1, dtype=torch.float64)
        self.accepted = torch.zeros(4, self.max_depth + 1, dtype=torch.float64)
        self._factors: torch.Tensor | None = None

    def observe(
        self, sources: torch.Tensor, depths: torch.Tensor, raw: torch.Tensor,
        accepted: torch.Tensor, valid: torch.Tensor,
    ) -> None:  # fmt: skip
        """One verified step: ``[R, W]`` per node (root and padding are skipped by
        source ``0``/``valid``)."""
        drafted = valid & (sources > 0)
        if not bool(drafted.any()):
            return
        self.predicted *= self.decay
        self.accepted *= self.decay
        index = sources[drafted] * (self.max_depth + 1) + depths[drafted].clamp(max=self.max_depth)
        self.predicted.view(-1).index_add_(0, index, raw[drafted].to(torch.float64))
        self.accepted.view(-1).index_add_(0, index, accepted[drafted].to(torch.float64))
        self._factors = None

    def factors(self) -> torch.Tensor:
        """``[4, max_depth + 1]`` acceptance over prediction per source and depth."""
        if self._factors is None:
            self._factors = (self.accepted + self.prior) / (self.predicted + self.prior)
        return self._factors

    def accepted_share(self) -> dict[int, float]:
        """Each source class's share of the accepted drafts (decayed counts)."""
        per = self.accepted.sum(dim=1)
        total = float(per[1:].sum())
        return {s: (float(per[s]) / total if total else 0.0) for s in (1, 2, 3)}
