"""What one engine step knows, in one object handed from hook to hook.

The runner creates a ``StepState`` when vLLM calls ``execute_model`` and passes it, as
an argument or a scoped binding, to the tree attention (``TreeBatch``), the verifier
and the drafter. Drafts are made at the end of step t and verified in step t + 1, so
the new step starts from the previous step's ``drafted`` trees (``verifying``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from eagle_vllm.attention.tree_batch import TreeBatch
from eagle_vllm.tree.layout import DraftTree


@dataclass
class DraftedTrees:
    """The trees one ``propose`` handed to vLLM, for the verifier of the next step."""

    req_ids: list[str]
    tree: DraftTree
    # draft_sample_method: sample. ``sampled[b]``: request b's drafts were sampled
    # from ``draft_q[b, j]`` (node j's child distribution over ``q_token_ids``, or the
    # full vocabulary when None); the verifier then uses q (sampled_chain_verify).
    sampled: torch.Tensor | None = None
    draft_q: torch.Tensor | None = None
    q_token_ids: torch.Tensor | None = None
    # merged trees (a suffix section, tree/merge.py): per node its source (EAGLE, SUFFIX,
    # BOTH; 0 root/padding), raw value (the source's own estimate) and the draft passes
    # its path needs (suffix nodes need none)
    sources: torch.Tensor | None = None
    raw_values: torch.Tensor | None = None
    pass_depths: torch.Tensor | None = None
    # the draft passes the trees were drafted with (None: trees that do not depend on
    # passes, suffix candidates alone); the sizer's acceptance statistics count a tree
    # of d passes for trees of at most d passes
    passes: int | None = None
    # the tree size they were drafted for, root included: a tree may come out smaller
    # (few suffix candidates), and its empty ranks count as drafts not accepted
    nodes: int | None = None

    def row_of(self) -> dict[str, int]:
        return {req_id: i for i, req_id in enumerate(self.req_ids)}


@dataclass
class StepRecord:
    """One step's timings and shape, as the sizer is charged for it (``telemetry.py``)."""

    started: float  # perf_counter at execute_model
    decode_only: bool  # every scheduled token is a request's last token or a draft
    batch: int = 0
    passes: int = 0  # draft passes run for the next step
    verified_nodes: int = 1  # nodes verified per request, the mean (1: no drafts)
    sampled: bool = False  # some request samples (temperature > 0)
    execute_seconds: float = 0.0
    runner_seconds: float | None = None  # execute_model + sample_tokens, once both ran
    draft_ran: bool = False  # the drafting hook ran (drafted, or deferred its first pass)
    draft_seconds: float = 0.0  # the drafter, deferred draft KV excluded
    catch_up_seconds: float = 0.0  # deferred draft KV written in this step


@dataclass
class StepState:
    """One step, from ``execute_model`` to the drafts for the next."""

    record: StepRecord
    # the trees drafted in the previous step, verified in this one (None: no drafts)
    verifying: DraftedTrees | None = None
    # requests whose trees are verified as trees this step (None: chains only)
    tree_batch: TreeBatch | None = None
    # [num_tokens] positions of this step's scheduled tokens (tree rows at root + depth)
    positions: torch.Tensor | None = None
    # [B, max_drafts] node indices of each request's accepted path (-1 padded)
    accepted_nodes: torch.Tensor | None = None
    # (draft passes, tree nodes) the sizer chose for the next step's trees
    planned_size: tuple[int, int] | None = None
    # the requests of this step's batch, in batch order
    req_ids: list[str] = field(default_factory=list)
    # requests with a grammar (their drafts are argmax drafts)
    structured_req_ids: frozenset[str] = frozenset()
    # suffix candidates for the next step's trees, per batch row (None: none), and the
    # calibration the merge ranks them with ([4, D + 1] factors per source and depth)
    suffix_candidates: list | None = None
    source_calibration: torch.Tensor | None = None
    # suffix nodes the head had not proposed that a draft pass expanded (SuffixGuide)
    suffix_nodes_expanded: int = 0
    # the trees drafted in this step, for the next, and their (passes, nodes)
    drafted: DraftedTrees | None = None
    drafted_size: tuple[int, int] = (0, 1)


class StepBound:
    """For objects whose methods vLLM calls (the drafter's ``propose``, the verifier's
    ``forward``): the step those calls work on, bound by the runner around the call."""

    _step: StepState | None = None

    @contextlib.contextmanager
    def bound_to(self, step: StepState):
        self._step = step
        try:
            yield
        finally:
            self._step = None
