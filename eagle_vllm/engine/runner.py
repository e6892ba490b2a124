"""The plugin's model runner: vLLM's CPU runner with the plugin's drafter and verifier.

One decode step, in the order vLLM 0.32's runner calls its hooks
(``vllm/v1/worker/gpu_model_runner.py``, which ``cpu_model_runner.py`` extends), and
what each adds to the step's ``StepState`` (``engine/step.py``):

1. ``execute_model``: a new ``StepState``; it will verify the trees the previous step
   drafted (``verifying``). The previous step's period is charged to the sizer
   (``telemetry.py``), and requests leaving with deferred draft KV write it
   (``deferred.py``).
2. ``_prepare_inputs``: the batch's requests (``req_ids``) and, for requests whose drafts
   are a tree, the ``TreeBatch``; tree nodes get positions ``root + depth`` (their KV
   slots stay linear, which KV compaction needs) (``tree_batch``, ``positions``).
3. ``_model_forward``: the target forward; the ``TreeBatch`` travels with the attention
   metadata vLLM hands every layer, which verifies tree rows with tree masks
   (``attention/cpu_backend.py``) and captures their K/V.
4. ``sample_tokens`` -> ``_sample``: the verifier (``engine/sampler.py``) walks each
   tree with exact rules (``accepted_nodes``); the sizer learns which nodes were
   accepted; the accepted path's K/V move to the slots of positions ``root+1 ..
   root+n`` in every target layer (KV compaction), so vLLM's scheduler sees a chain.
5. ``propose_draft_token_ids``: the sizer plans the next step's tree
   (``planned_size``); then either the drafter (``engine/proposer.py``) drafts from the
   accepted path, seen as a chain (``drafted``), or, for no drafts after a plain decode
   step, its first pass is deferred.

Scheduling, batching, KV allocation, bookkeeping and metrics stay vLLM's. Every access
to vLLM's private state goes through ``vllm_surface.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from eagle_vllm import vllm_surface as vs
from eagle_vllm.attention.platform import for_current_platform
from eagle_vllm.attention.tree_batch import TreeBatch
from eagle_vllm.config import eagle_config_of, slow_target_dtype_warning
from eagle_vllm.engine import telemetry
from eagle_vllm.engine.deferred import DeferredDrafts
from eagle_vllm.engine.proposer import EagleTreeProposer
from eagle_vllm.engine.sampler import (
    ExactRejectionSampler,
    position_keyed_generators,
    use_inverse_cdf_draws,
)
from eagle_vllm.engine.step import DraftedTrees, StepRecord, StepState
from eagle_vllm.engine.suffix_drafts import SuffixDrafts
from eagle_vllm.engine.timing import StepTimings
from eagle_vllm.sizing import TreeSizer

CPUModelRunner, _cpu_device_context = vs.cpu_runner_base()
logger = logging.getLogger(__name__)


def needs_chain_verification(params) -> bool:
    """vLLM conditions penalties, bad words and grammars on the drafts read as a chain
    (each draft position sees the drafts before it). A tree request with any of them
    is therefore verified as a chain over its flattened tree: still exact (any draft
    sequence can be verified), and its first drafts are the tree's best nodes."""
    if params is None:
        return False
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.bad_words_token_ids
        or params.structured_outputs is not None
    )


class EagleCPUModelRunner(CPUModelRunner):
    """Installs the plugin's drafter and verifier; runs each step through a ``StepState``."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.eagle_config = eagle_config_of(self.vllm_config)
        self.timings = StepTimings()
        self.sizer: TreeSizer | None = None
        self.deferred = DeferredDrafts()
        self.step: StepState | None = None  # the step in flight (or the last one)
        self._drafted: DraftedTrees | None = None  # the last drafts, verified next step
        self.suffix: SuffixDrafts | None = None  # the suffix source (a suffix section)
        if self.eagle_config is None or self.speculative_config is None:
            return
        cfg = self.eagle_config
        self.platform = for_current_platform()
        warning = slow_target_dtype_warning(
            vllm_config.model_config.dtype, vllm_config.device_config.device_type
        )
        if warning:
            logger.warning(warning)
        if cfg.auto_size:
            extra_nodes, extra_depth = (
                (0, 0) if cfg.suffix is None else (cfg.suffix.max_nodes, cfg.suffix.max_depth)
            )
            self.sizer = TreeSizer(cfg.num_speculative_tokens, cfg.topk, cfg.total_tokens,
                                   extra_nodes=extra_nodes, extra_depth=extra_depth,
                                   root_topk=cfg.root_topk)  # fmt: skip
            self.sizer.pinned = _pinned_size(self.sizer)
            if cfg.sizing_profile:  # measured by `eagle-vllm calibrate` (checked at parse)
                self.sizer.load_profile(cfg.sizing_profile)
        if self._uses_trees:
            self.platform.prepare()
        if cfg.uses_head:
            with _cpu_device_context():
                self.drafter = EagleTreeProposer(
                    self.vllm_config, self.device, self, cfg, self.platform
                )
            if cfg.suffix is not None:
                self.suffix = SuffixDrafts(cfg.suffix, self.model_config.tokenizer)
        else:  # method suffix: vLLM built the model-free drafter (method custom_class)
            self.suffix = self.drafter.suffix
        # every random draw, in steps with drafts and without, through one uniform per row
        use_inverse_cdf_draws(self.sampler)
        self.rejection_sampler = ExactRejectionSampler(
            self.sampler, self.speculative_config, self.device
        )

    @property
    def _uses_trees(self) -> bool:
        return self.eagle_config is not None and self.eagle_config.uses_trees

    # -- 1. a new step -------------------------------------------------------
    def execute_model(self, scheduler_output, *args, **kwargs):
        now = time.perf_counter()
        previous = self.step
        period = telemetry.step_period(None if previous is None else previous.record, now)
        if self.sizer is not None and period is not None:
            telemetry.charge_step(self.sizer, previous.record, period)
        self.step = StepState(
            record=StepRecord(started=now, decode_only=_decode_only(scheduler_output)),
            verifying=self._drafted,
        )
        if self.deferred:
            self._catch_up_leaving(scheduler_output)
        context = getattr(self.drafter, "context_vocab", None) if self.eagle_config else None
        if context is not None and scheduler_output.finished_req_ids:
            context.forget(scheduler_output.finished_req_ids)
        if self.suffix is not None:
            self.suffix.note_scheduled(scheduler_output)
        with self.timings.phase("execute_model") as clock:
            out = super().execute_model(scheduler_output, *args, **kwargs)
        self.step.record.execute_seconds = clock.seconds
        return out

    # -- 2. positions ----------------------------------------------------------
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        step = self.step
        step.req_ids = vs.batch_req_ids(self.input_batch)
        step.positions = self.positions
        if self._uses_trees:
            step.tree_batch = self._build_tree_batch(scheduler_output, step.verifying)
        if step.tree_batch is not None:
            tb = step.tree_batch
            valid = tb.valid()
            self.positions[tb.flat_rows()[valid]] = tb.tree_positions()[valid]
        return out

    def _build_tree_batch(self, scheduler_output, drafted: DraftedTrees | None):
        if drafted is None:
            return None
        index = drafted.row_of()
        spec = scheduler_output.scheduled_spec_decode_tokens
        query_start = vs.query_starts(self)
        rows, roots, parents, depths = [], [], [], []
        for req_id, draft_ids in spec.items():
            k = len(draft_ids)
            i = index.get(req_id)
            if k == 0 or i is None:
                continue
            tree = drafted.tree
            if tree.tokens[i, 1 : k + 1].tolist() != list(draft_ids):
                continue  # not this step's drafts (e.g. zero drafts near max_model_len)
            tree_parents = tree.parents[i, : k + 1]
            if bool((tree_parents[1:] == torch.arange(k)).all()):
                continue  # a chain: causal attention and no compaction needed
            if needs_chain_verification(self.requests[req_id].sampling_params):
                continue  # its drafts, in tree order, are verified as a chain
            row = self.input_batch.req_id_to_index[req_id]
            rows.append(row)
            roots.append(int(query_start[row + 1]) - k - 1)
            parents.append(tree_parents)
            depths.append(tree.depths[i, : k + 1])
        if not rows:
            return None
        width = max(p.shape[0] for p in parents)

        def pad(xs, fill):
            return torch.stack(
                [torch.nn.functional.pad(x, (0, width - x.shape[0]), value=fill) for x in xs]
            )

        batch_rows = torch.tensor(rows, dtype=torch.int64)
        root_index = torch.tensor(roots, dtype=torch.int64)
        return TreeBatch(
            batch_rows=batch_rows,
            root_index=root_index,
            root_pos=self.positions[root_index].to("cpu", torch.int64),
            num_nodes=torch.tensor([p.shape[0] for p in parents], dtype=torch.int64),
            parents=pad(parents, -1),
            depths=pad(depths, 0),
            block_table=vs.block_table_rows(self.input_batch, batch_rows),
        )

    # -- 3. the target forward, with tree masks ----------------------------------
    def _model_forward(self, *args, **kwargs):
        with self.timings.phase("target_forward"):
            if self.step is not None and self.step.tree_batch is not None:
                vs.attach_tree_batch(self.step.tree_batch)
            return super()._model_forward(*args, **kwargs)

    # -- 4. verification, acceptance statistics, KV compaction -------------------
    def sample_tokens(self, *args, **kwargs):
        with self.timings.phase("sample_tokens") as clock:
            out = super().sample_tokens(*args, **kwargs)
        record = self.step.record if self.step is not None else None
        if record is not None and record.execute_seconds:
            record.runner_seconds = record.execute_seconds + clock.seconds
            record.batch = self.input_batch.num_reqs
            record.passes = self.step.drafted_size[0] if self.sizer is not None else 0
            # verification costs more when any request samples
            record.sampled = bool(vs.sampled_req_ids(self.input_batch))
        return out

    def _sample(self, logits, spec_decode_metadata):
        step = self.step
        verifying = spec_decode_metadata
        if verifying is not None and verifying.max_spec_len == 0:
            # vLLM 0.32 builds spec-decode metadata whenever requests are scheduled with
            # draft lists, even all empty (a drafts-off step of the sizer). Nothing to
            # verify: vLLM's plain sampler gives the same [B, 1] tokens without the
            # verifier's per-step setup (~18 ms at 64 requests on a CPU).
            verifying = None
            step.accepted_nodes = torch.full(
                (len(spec_decode_metadata.num_draft_tokens), 0), -1, dtype=torch.int64
            )
        verifier = getattr(self, "rejection_sampler", None)  # None: no speculation
        binding = (
            verifier.bound_to(step)
            if isinstance(verifier, ExactRejectionSampler)
            else contextlib.nullcontext()  # vLLM's own (speculation not from this plugin)
        )
        with self.timings.phase("verify"), binding, self._position_keyed_plain_sampling(verifying):
            out = super()._sample(logits, verifying)
        as_chains = None  # requests verified as chains, found once for both readers
        if verifying is not None and (self.sizer is not None or self.suffix is not None):
            as_chains = self._verified_as_chains(step.req_ids)
        if self.sizer is not None and spec_decode_metadata is not None:
            if verifying is None:  # no drafts: nothing accepted or rejected to count
                self.sizer.age_acceptance(self._sampled_share())
            else:
                self._observe_acceptance(spec_decode_metadata, as_chains)
        if self.suffix is not None and verifying is not None and step.verifying is not None:
            self.suffix.observe(step.verifying, step.req_ids, step.accepted_nodes, as_chains)
        if step.tree_batch is not None and spec_decode_metadata is not None:
            with self.timings.phase("kv_compaction"):
                self._compact_kv(step.tree_batch, step.accepted_nodes)
        return out

    def _sampled_share(self) -> float:
        n = self.input_batch.num_reqs
        return len(vs.sampled_req_ids(self.input_batch)) / n if n else 0.0

    def _observe_acceptance(self, metadata, as_chains: set[str]) -> None:
        step = self.step
        sampled_ids = vs.sampled_req_ids(self.input_batch)
        sampled = torch.tensor([r in sampled_ids for r in step.req_ids], dtype=torch.bool)
        step.record.verified_nodes = telemetry.observe_acceptance(
            self.sizer, metadata.num_draft_tokens, step.req_ids, sampled, step.verifying,
            as_chains, step.accepted_nodes,
        )  # fmt: skip

    def _verified_as_chains(self, req_ids: list[str]) -> set[str]:
        """Requests whose tree drafts were verified as a chain (needs_chain_verification)."""
        if not self._uses_trees:
            return set()
        return {r for r in req_ids if needs_chain_verification(self.requests[r].sampling_params)}

    @contextlib.contextmanager
    def _position_keyed_plain_sampling(self, spec_decode_metadata):
        """A step without drafts samples with vLLM's sampler alone; seeded requests
        then draw from a generator keyed by the sampled token's position, like the
        verifier does (see ExactRejectionSampler), so seeds reproduce."""
        metadata = self.input_batch.sampling_metadata
        if spec_decode_metadata is not None or not metadata.generators:
            yield
            return
        n = self.input_batch.num_reqs
        last = vs.query_starts(self)[1 : n + 1].to(torch.int64) - 1
        positions = self.positions.to("cpu", torch.int64)[last] + 1
        original = metadata.generators
        metadata.generators = position_keyed_generators(original, positions)
        try:
            yield
        finally:
            metadata.generators = original

    def _compact_kv(self, tb: TreeBatch, accepted_nodes: torch.Tensor) -> None:
        """Move accepted node i's K/V to the slot of position root+i, in every target layer."""
        r, src_node, dst_row = tb.compaction_moves(accepted_nodes[tb.batch_rows])
        if r.numel() == 0:
            return
        slots = vs.step_slot_mapping(self.input_batch)[dst_row].to(torch.int64)
        layers = vs.target_attention_layers(self)
        for layer_name, (node_k, node_v) in tb.captured_kv.items():
            self.platform.write_kv(layers[layer_name], node_k[r, src_node], node_v[r, src_node],
                                   slots)  # fmt: skip

    # -- 5. drafting for the next step --------------------------------------------
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args, **kwargs):  # fmt: skip
        if self.eagle_config is None:  # vLLM's own speculation on this worker (benchmarks)
            return super().propose_draft_token_ids(
                scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                sample_hidden_states, aux_hidden_states, *args, **kwargs,
            )  # fmt: skip
        step = self.step
        caught_up_before = step.record.catch_up_seconds
        if self.suffix is not None:  # every step's tokens, drafting or not
            with self.timings.phase("suffix_index"):
                self._sync_suffix(sampled_token_ids)
        with self.timings.phase("draft") as clock:
            step.planned_size = self._plan_size()
            if (
                step.planned_size[0] == 0
                and self.sizer is not None
                and _plain_decode(scheduler_output)
            ):
                out = self._defer_drafting(
                    scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states
                )
            else:
                if self.deferred:  # the first pass reads the deferred positions
                    self._catch_up(self._first_scheduled_positions())
                if step.tree_batch is not None and self.eagle_config.uses_head:
                    hidden_states, aux_hidden_states = self._accepted_path_as_chain(
                        step, hidden_states, aux_hidden_states
                    )
                if self.eagle_config.draft_sample_method == "sample":  # only they read it
                    step.structured_req_ids = frozenset(
                        r for r in step.req_ids
                        if (p := self.requests[r].sampling_params) is not None
                        and p.structured_outputs is not None
                    )  # fmt: skip
                if step.planned_size[0] > 0:
                    self._sync_context_vocab(step.req_ids)
                if self.suffix is not None and step.planned_size[0] > 0:
                    step.suffix_candidates = self.suffix.propose(step.req_ids)
                    step.source_calibration = self.suffix.calibration.factors()
                with self.drafter.bound_to(step):
                    out = super().propose_draft_token_ids(
                        scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                        sample_hidden_states, aux_hidden_states, *args, **kwargs,
                    )  # fmt: skip
        self._drafted = step.drafted
        if self.suffix is not None:
            self.suffix.expanded += step.suffix_nodes_expanded
        step.record.draft_ran = True
        # deferred draft KV written in this step is the cost of earlier drafts-off steps,
        # not of this step's tree: keep it out of the sizer's draft cost
        caught_up = step.record.catch_up_seconds - caught_up_before
        step.record.draft_seconds = clock.seconds - caught_up
        return out

    def _sync_suffix(self, sampled_token_ids) -> None:
        """Append this step's tokens to the requests' suffix indexes. A list holds each
        request's valid tokens after vLLM's bookkeeping (``method: suffix``, drafted like
        n-grams); a tensor, the sampled rows before it (EAGLE drafters run first)."""
        req_ids = vs.batch_req_ids(self.input_batch)
        if isinstance(sampled_token_ids, list):
            self.suffix.sync(req_ids, self.requests, sampled_token_ids, output_has_new=True)
        else:
            new = vs.step_new_tokens(self, sampled_token_ids)
            self.suffix.sync(req_ids, self.requests, new, output_has_new=False)

    def _sync_context_vocab(self, req_ids: list[str]) -> None:
        """Add the batch's new prompt and output tokens to the drafter's per-request token
        sets (``draft_vocab_context``). Read from vLLM's request state, so a request's
        tokens of this very step join at its next drafting step."""
        context = getattr(self.drafter, "context_vocab", None)
        if context is None:
            return
        for req_id in req_ids:
            prompt_ids, output_ids, _ = vs.request_text(self.requests[req_id])
            context.sync(req_id, prompt_ids, output_ids)

    def _plan_size(self) -> tuple[int, int]:
        """(draft passes, tree nodes) for the next step: the sizer's choice (rank 0's,
        under tensor parallelism: timings differ between ranks, trees must not), or the
        config's maxima without auto sizing."""
        cfg = self.eagle_config
        if self.sizer is None:
            return cfg.num_speculative_tokens, cfg.total_tokens
        batch = self.input_batch
        choice = self.sizer.decide(batch.num_reqs, len(vs.sampled_req_ids(batch)))
        return tuple(vs.tp_broadcast(choice, self.parallel_config.tensor_parallel_size))

    def _defer_drafting(
        self, scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states
    ) -> torch.Tensor:
        """A plain decode step before a drafts-off step: skip the drafter and keep what its
        first pass needs (one position per request: the token and the draft's feature,
        fused from the target's layers for EAGLE-3); the draft KV is written later,
        many positions per forward. Returns no drafts."""
        num_reqs = self.input_batch.num_reqs
        if isinstance(sampled_token_ids, list):
            next_tokens = self.drafter.prepare_next_token_ids_cpu(
                sampled_token_ids,
                self.requests,
                self.input_batch,
                scheduler_output.num_scheduled_tokens,
            )
        else:  # one sampled token per request: no drafts were verified
            next_tokens = sampled_token_ids[:num_reqs, 0]
        positions = self.positions[:num_reqs].to("cpu", torch.int64)  # one token per request
        if aux_hidden_states is not None:  # EAGLE-3: keep the fused feature (H, not n*H)
            target_features = torch.cat([h[:num_reqs] for h in aux_hidden_states], dim=-1)
            features = self.drafter.model.draft_features(target_features)
        else:
            features = hidden_states[:num_reqs]
        full = self.deferred.defer(
            self.step.req_ids[:num_reqs], positions, next_tokens, features, self.requests
        )
        if full:  # bound what waits (memory)
            self._catch_up(positions + 1)
        self.step.drafted, self.step.drafted_size = None, (0, 1)
        return torch.empty(num_reqs, 0, dtype=torch.int64, device=hidden_states.device)

    def _catch_up(self, first_positions: torch.Tensor) -> None:
        """Write the deferred draft KV of this step's requests (``first_positions[b]``: the
        first position of request b not deferred)."""
        num_reqs = self.input_batch.num_reqs
        with self.timings.phase("draft_catch_up") as clock:
            self.deferred.catch_up(
                self.drafter,
                vs.batch_req_ids(self.input_batch),
                first_positions,
                vs.block_table_rows(self.input_batch, slice(0, num_reqs)),
                vs.block_size(self.input_batch),
            )
        self.step.record.catch_up_seconds += clock.seconds

    def _catch_up_leaving(self, scheduler_output) -> None:
        """Write the deferred draft KV of requests that finished or were preempted, in
        their full blocks.

        With prefix caching their full blocks stay cached, draft KV included, and a
        later request with the same prefix (the next turn of a chat, a recomputed
        preempted request) drafts from it. A partial last block is never cached, so
        its deferred positions are dropped unwritten. vLLM frees the blocks when the
        request leaves, so this step's forward is the first that can overwrite them;
        this runs before it, while the request still has its batch row (vLLM 0.32:
        ``_update_states`` removes it inside ``execute_model``)."""
        if not self.cache_config.enable_prefix_caching:
            return  # freed blocks are never read again
        leaving = set(scheduler_output.finished_req_ids)
        leaving |= set(scheduler_output.preempted_req_ids or ())
        req_ids, rows = self.deferred.leaving(leaving, self.input_batch.req_id_to_index)
        if not req_ids:
            return
        ends = torch.tensor([self.deferred.end(r) for r in req_ids], dtype=torch.int64)
        size = vs.block_size(self.input_batch)  # the prefix cache's unit (hashed blocks)
        full_blocks_end = ends // size * size
        with self.timings.phase("draft_catch_up") as clock:
            self.deferred.catch_up(
                self.drafter, req_ids, ends,
                vs.block_table_rows(self.input_batch, torch.tensor(rows, dtype=torch.int64)),
                size, limits=full_blocks_end,
            )  # fmt: skip
        self.step.record.catch_up_seconds += clock.seconds

    def _first_scheduled_positions(self) -> torch.Tensor:
        num_reqs = self.input_batch.num_reqs
        starts = vs.query_starts(self)[:num_reqs].to(torch.int64)
        return self.positions.to("cpu", torch.int64)[starts]

    def _accepted_path_as_chain(self, step: StepState, hidden_states: torch.Tensor,
                                aux_hidden_states: list[torch.Tensor] | None):  # fmt: skip
        """Reorder each tree's rows to [root, accepted path..., the rest] and make positions
        linear, so the drafter's first pass sees the accepted tokens as a chain whose
        features (the last layer's, or EAGLE-3's auxiliary layers') are the target's
        features of exactly those nodes."""
        tb = step.tree_batch
        paths = step.accepted_nodes[tb.batch_rows].tolist()  # [R, D]
        width = tb.width
        rows = []  # built as lists: one small tensor op per request costs more
        for path, num_nodes in zip(paths, tb.num_nodes.tolist()):
            accepted = [j for j in path if j >= 0]
            taken = set(accepted)
            new = [0, *accepted, *(j for j in range(1, num_nodes) if j not in taken)]
            rows.append(new + list(range(len(new), width)))
        order = torch.tensor(rows, dtype=torch.int64).view(len(rows), width)
        valid = tb.valid()
        src = (tb.root_index[:, None] + order)[valid]
        dst = tb.flat_rows()[valid]
        perm = torch.arange(hidden_states.shape[0])
        perm[dst] = src
        if aux_hidden_states is None:
            hidden_states = hidden_states[perm]
        else:  # EAGLE-3: the drafter reads the auxiliary layers only
            aux_hidden_states = [h[perm] for h in aux_hidden_states]
        input_ids = vs.step_input_ids(self)
        input_ids[dst] = input_ids[src].clone()
        offsets = torch.arange(width)[None, :].expand_as(order)
        self.positions[dst] = (tb.root_pos[:, None] + offsets)[valid]
        return hidden_states, aux_hidden_states


def _pinned_size(sizer: TreeSizer) -> tuple[int, int] | None:
    """``EAGLE_VLLM_SIZER_PIN="passes,nodes"``: every step uses that arm of the auto sizer
    (e.g. ``0,1``: drafts off). For benchmarks that time one arm end to end
    (``benchmarks/step_profile.py phases``); the sizer keeps measuring."""
    value = os.environ.get("EAGLE_VLLM_SIZER_PIN")
    if not value:
        return None
    try:
        arm = tuple(int(x) for x in value.split(","))
    except ValueError:
        arm = ()
    if arm not in sizer.arms:
        raise ValueError(
            f"EAGLE_VLLM_SIZER_PIN={value!r} is not one of the sizer's arms "
            f"{[f'{d},{m}' for d, m in sizer.arms]}. Fix: pick one, or unset it."
        )
    return arm


def _plain_decode(scheduler_output) -> bool:
    """Whether every request was scheduled exactly one token and no drafts."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    return not any(spec.values()) and all(
        n == 1 for n in scheduler_output.num_scheduled_tokens.values()
    )


def _decode_only(scheduler_output) -> bool:
    """Whether every scheduled token is a request's last token or one of its drafts."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    return all(
        n == 1 + len(spec.get(req_id, ()))
        for req_id, n in scheduler_output.num_scheduled_tokens.items()
    )
