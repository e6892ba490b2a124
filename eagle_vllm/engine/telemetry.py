"""What the runner tells the load-aware sizer about each step (``total_tokens: auto``).

Costs: a step's period runs from one ``execute_model`` to the next (the runner's
phases plus vLLM's scheduling and output processing between them). Its drafting is
charged to the draft passes it ran, the rest to the tree nodes it verified
(``charge_step``). Acceptance: which node of each verified tree was accepted
(``observe_acceptance``).
"""

from __future__ import annotations

import torch

from eagle_vllm.engine.step import DraftedTrees, StepRecord
from eagle_vllm.sizing import TreeSizer
from eagle_vllm.sizing.costs import charged_size


def charge_step(sizer: TreeSizer, step: StepRecord, period: float) -> None:
    """Charge a finished step's wall time: drafting to its passes, the rest of the period
    (target forward, verification, vLLM's own work) to the nodes verified."""
    if not step.batch or not step.draft_ran:
        return
    if not step.decode_only:
        # A prefill chunk would be charged to the arm: to the tree's verify cost, and to
        # its draft cost too (the drafter's first pass over the prompt runs whatever the
        # arm). Charged to no drafts, it makes drafts-off look dearer than drafting while
        # requests arrive (SmolLM2 on CPU, batch 4: 12.3 ms of "drafting" for no drafts,
        # 6.5 ms for one draft pass).
        return
    sizer.observe_draft(step.batch, step.passes, step.draft_seconds, step.sampled)
    if step.verified_nodes == 1 and step.passes > 0:
        # Drafting resumes after a drafts-off step: the rest of this step is not what a
        # drafts-off step costs (SmolLM2 on CPU, 4 requests: 50-55 ms against 46-47 ms
        # for a drafts-off step after another; vLLM's bookkeeping around the first
        # drafts). Charged to no drafts, it would keep one draft per request on where it
        # loses to none. No drafts is measured in a drafts-off step that follows another
        # (the sizer probes no drafts twice); what resuming costs beyond one (with the
        # deferred draft KV it writes) prices the sizer's explorations of trees.
        sizer.observe_resume(step.batch, period - step.draft_seconds, step.sampled)
        return
    # deferred draft KV written in this step belongs to earlier steps, not this tree
    rest = period - step.draft_seconds - step.catch_up_seconds
    sizer.observe_verify(step.batch, step.verified_nodes, rest, step.sampled)


def step_period(previous: StepRecord | None, now: float) -> float | None:
    """The previous step's period, if it ran to its end and no idle gap followed it."""
    if previous is None or previous.runner_seconds is None:
        return None
    period = now - previous.started
    if period >= 3 * previous.runner_seconds:  # an idle gap between requests
        return None
    return period


def observe_acceptance(
    sizer: TreeSizer,
    num_draft_tokens: list[int],
    req_ids: list[str],
    sampled: torch.Tensor,
    verified: DraftedTrees | None,
    not_as_drafted: set[str],
    accepted_nodes: torch.Tensor | None,
) -> int:
    """Feed the sizer which node of each verified tree was accepted; returns the nodes the
    step verified per request, root included (the mean, rounded; at least 2 if any
    request had drafts): what the step is charged to. Trees come out at different
    sizes where suffix candidates fill them, and the target forward's cost follows the
    tokens it verifies, not the largest tree.

    ``req_ids``/``sampled``: the batch's requests and which sample; ``verified``: the
    trees drafted for them; ``not_as_drafted``: requests whose drafts were not verified
    as the tree they were drafted as (chains over a flattened tree)."""
    num_nodes = torch.tensor(num_draft_tokens, dtype=torch.int64) + 1
    batch, width = num_nodes.shape[0], int(num_nodes.max())
    node = torch.arange(width)
    valid = node[None, :] < num_nodes[:, None]
    depths = node[None, :].repeat(batch, 1)
    drafted = {} if verified is None else verified.row_of()
    rows, src = [], []
    for row, req_id in enumerate(req_ids[:batch]):
        i = drafted.get(req_id)
        if i is None or req_id in not_as_drafted:
            valid[row] = False
            continue
        rows.append(row)
        src.append(i)
    if rows:  # one copy for the batch, not one per request
        # merged trees: a node's "depth" here is the draft passes its path needs (trees
        # are cut by passes; suffix nodes need none)
        node_depths = verified.tree.depths if verified.pass_depths is None else verified.pass_depths
        n = min(width, node_depths.shape[1])
        depths[rows, :n] = node_depths[src, :n].to("cpu", depths.dtype)
    accepted = torch.zeros(batch, width + 1, dtype=torch.bool)
    if accepted_nodes is not None and accepted_nodes.numel():
        index = torch.arange(batch)[:, None].expand_as(accepted_nodes)
        hit = accepted_nodes >= 0
        accepted[index[hit], accepted_nodes[hit].clamp(max=width)] = True
    passes, nodes = (None, None) if verified is None else (verified.passes, verified.nodes)
    sizer.observe_acceptance(depths, valid, accepted[:, :width], sampled[:batch], passes, nodes)
    if width <= 1:
        return 1
    return charged_size(float(num_nodes.sum()) / batch, width)
