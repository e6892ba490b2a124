"""The plugin's model runner: vLLM's runner with the plugin's drafter and verifier.

Written against vLLM 0.32 (``vllm/v1/worker/gpu_model_runner.py`` and
``cpu_model_runner.py``). It swaps two attributes the stock runner builds in
``__init__`` for ``method="eagle"``:

* ``self.drafter``: ``EagleTreeProposer`` (plugin draft model, chain/tree drafting);
* ``self.rejection_sampler``: ``ExactRejectionSampler`` (exact verification);

and, when trees are drafted (``topk > 1``), wraps five runner methods:

* ``_prepare_inputs``: tree nodes get positions ``root + depth`` (their KV
  slots stay linear, which is what KV compaction needs);
* ``_model_forward``: the target forward runs with tree masks
  (``attention/cpu_backend.py``), capturing the tree rows' K/V;
* ``_sample``: after verification, the accepted path's K/V move to the slots
  of positions ``root+1 .. root+n`` in every target layer (KV compaction), so
  vLLM's scheduler sees an accepted chain;
* ``propose_draft_token_ids``: the drafter's first pass sees the accepted path
  as a chain (rows reordered, positions linear again).

With ``total_tokens: auto`` the runner also feeds a ``TreeSizer`` (``sizing.py``):
the wall time of each step's phases and which tree nodes were accepted; the
drafter asks it for the next step's tree size (``choose_tree_size``). When the
sizer switches drafts off after a plain decode step, the drafter is skipped and
its first pass deferred (``_defer_drafting``; the drafter catches up later).

Scheduling, batching, KV allocation, bookkeeping and metrics stay vLLM's.
"""

from __future__ import annotations

import contextlib
import time

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from eagle_vllm.attention.cpu_backend import verifying_trees
from eagle_vllm.attention.tree_batch import TreeBatch
from eagle_vllm.config import ADDITIONAL_CONFIG_KEY, EagleSpecConfig
from eagle_vllm.engine.proposer import EagleTreeProposer
from eagle_vllm.engine.sampler import ExactRejectionSampler
from eagle_vllm.engine.timing import StepTimings
from eagle_vllm.sizing import TreeSizer
from eagle_vllm.verify import chain_parents


def eagle_config_of(vllm_config) -> EagleSpecConfig | None:
    extra = vllm_config.additional_config or {}
    data = extra.get(ADDITIONAL_CONFIG_KEY)
    return None if data is None else EagleSpecConfig.from_dict(data)


def _needs_chain_verification(params) -> bool:
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


class EagleRunnerMixin:
    """Installs the plugin's drafter and verifier; handles tree-shaped verification."""

    tree_batch: TreeBatch | None = None
    sizer: TreeSizer | None = None

    def _install_eagle(self, device_context) -> None:
        self.eagle_config = eagle_config_of(self.vllm_config)
        self.tree_batch = None
        self.timings = StepTimings()
        self.sizer = None
        self._step_clock: dict[str, float] = {}
        self._planned_size: tuple[int, int] | None = None
        if self.eagle_config is None or self.speculative_config is None:
            return
        cfg = self.eagle_config
        if cfg.auto_size:
            self.sizer = TreeSizer(cfg.num_speculative_tokens, cfg.topk, cfg.total_tokens)
            self.sizer.pinned = _pinned_size(self.sizer)
            if cfg.sizing_profile:  # measured by `eagle-vllm calibrate` (checked at parse)
                self.sizer.load_profile(cfg.sizing_profile)
            # on a GPU a phase's wall time needs a sync, or it only counts kernel launches
            self.timings.synchronize = torch.device(self.device).type == "cuda"
        if self._uses_trees and torch.device(self.device).type == "cpu":
            # build (or load from torch's extension cache) the fused tree-attention op now,
            # not in the first tree step (a first build compiles for ~40 s)
            from eagle_vllm.attention import cpu_tree_op

            cpu_tree_op.load()
        with device_context():
            self.drafter = EagleTreeProposer(self.vllm_config, self.device, self, self.eagle_config)
        self.rejection_sampler = ExactRejectionSampler(
            self.sampler,
            self.speculative_config,
            self.device,
            tree_source=self._tree_parents,
            position_source=lambda: self.positions,
            draft_q_source=self._sampled_draft_q,
        )

    @property
    def _uses_trees(self) -> bool:
        return self.eagle_config is not None and self.eagle_config.topk > 1

    # -- timing (benchmarks read it through the worker's eagle_vllm_timings RPC) --
    def execute_model(self, scheduler_output, *args, **kwargs):
        now = time.perf_counter()
        last = self._step_clock
        if "runner_seconds" in last:
            # the whole step as the engine lives it: runner phases plus the scheduler and
            # output processing between two steps, which the runner does not see
            period = now - last["started"]
            if period < 3 * last["runner_seconds"]:  # not an idle gap between requests
                self._observe_step_costs(last, period)
        self._step_clock = {
            "verified_nodes": 1,
            "decode_only": _decode_only(scheduler_output),
            "started": now,
            "batch": 0,
        }
        if self.sizer is not None and self.drafter.has_deferred:
            self._catch_up_leaving(scheduler_output)
        with self.timings.phase("execute_model") as clock:
            out = super().execute_model(scheduler_output, *args, **kwargs)
        self._step_clock["execute_model"] = clock.seconds
        return out

    def sample_tokens(self, *args, **kwargs):
        with self.timings.phase("sample_tokens") as clock:
            out = super().sample_tokens(*args, **kwargs)
        step = self._step_clock
        if "execute_model" in step:
            step["runner_seconds"] = step["execute_model"] + clock.seconds
            step["batch"] = self.input_batch.num_reqs
            step["passes"] = self.drafter.last_size[0] if self.sizer is not None else 0
            # the batch's sampling mode (vLLM 0.32 InputBatch.random_reqs: temperature > 0):
            # verification costs more when any request samples
            step["sampled"] = bool(self.input_batch.random_reqs)
        return out

    # -- load-aware sizing (total_tokens: auto) --------------------------------
    def choose_tree_size(self, batch_size: int) -> tuple[int, int]:
        """(draft passes, tree nodes) for the next step; the config's maxima unless auto."""
        cfg = self.eagle_config
        if self.sizer is None:
            return cfg.num_speculative_tokens, cfg.total_tokens
        if self._planned_size is not None:  # decided earlier in this step
            choice, self._planned_size = self._planned_size, None
            return choice
        # vLLM 0.32 InputBatch: random_reqs holds the requests with temperature > 0
        batch = self.input_batch
        sampled = batch.random_reqs
        num_sampled = (
            len(sampled)
            if batch_size == batch.num_reqs
            else sum(r in sampled for r in batch.req_ids[:batch_size])
        )
        choice = self.sizer.choose(batch_size, num_sampled=num_sampled)
        if self.sizer.pinned is not None:  # benchmarks: one arm, still measured
            choice = self.sizer.pinned
            self.sizer.history[-1] = (batch_size, *choice)
        if self.parallel_config.tensor_parallel_size > 1:
            # Timings differ between ranks; every rank must draft the same tree.
            from vllm.distributed import get_tp_group

            choice = tuple(get_tp_group().broadcast_object(choice, src=0))
        return choice

    def _observe_step_costs(self, step: dict, period: float) -> None:
        """Charge a finished step's wall time: drafting to its passes, the rest of the
        period (target forward, verification, vLLM's own work) to the nodes verified."""
        sizer = self.sizer
        if sizer is None or "draft" not in step or not step["batch"]:
            return
        if not step["decode_only"]:
            # A prefill chunk would be charged to the arm: to the tree's verify cost, and
            # to its draft cost too (the drafter's first pass over the prompt runs
            # whatever the arm). Charged to no drafts, it made drafts-off look dearer than
            # drafting while requests arrive (eagle-vllm calibrate on SmolLM2, batch 4:
            # 12.3 ms of "drafting" for no drafts, 6.5 ms for one draft pass).
            return
        sampled = step.get("sampled", False)
        sizer.observe_draft(step["batch"], step["passes"], step["draft"], sampled)
        if step["verified_nodes"] == 1 and step["passes"] > 0:
            # Drafting resumes after a drafts-off step: the rest of this step is not what
            # a drafts-off step costs (SmolLM2 on CPU, 4 requests: 50-55 ms against 46-47
            # ms for a drafts-off step after another; vLLM's bookkeeping around the first
            # drafts). Charged to no drafts, a probe of it read 15% dear and kept one
            # draft per request on where it lost to none. Its cost is measured in a
            # drafts-off step that follows another (TreeSizer probes no drafts twice).
            # What it costs beyond one (with the deferred draft KV it writes) prices the
            # sizer's explorations of trees while no drafts wins.
            sizer.observe_resume(step["batch"], period - step["draft"], sampled)
            return
        # deferred draft KV written in this step belongs to earlier steps, not this tree
        rest = period - step["draft"] - step.get("catch_up", 0.0)
        sizer.observe_verify(step["batch"], step["verified_nodes"], rest, sampled)

    def _observe_acceptance(self, metadata) -> None:
        """Which node of each verified tree was accepted, for the sizer's acceptance rates."""
        num_nodes = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64) + 1
        self._step_clock["verified_nodes"] = int(num_nodes.max())
        batch, width = num_nodes.shape[0], int(num_nodes.max())
        node = torch.arange(width)
        valid = node[None, :] < num_nodes[:, None]
        depths = node[None, :].repeat(batch, 1)
        last = self.drafter.last_drafts
        drafted = {} if last is None else {r: i for i, r in enumerate(last.req_ids)}
        rows, src = [], []
        req_ids = self.input_batch.req_ids[:batch]
        random_reqs = self.input_batch.random_reqs  # vLLM 0.32: temperature > 0
        sampled = torch.tensor([r in random_reqs for r in req_ids], dtype=torch.bool)
        for row, req_id in enumerate(req_ids):
            i = drafted.get(req_id)
            if i is None or (
                self._uses_trees
                and _needs_chain_verification(self.requests[req_id].sampling_params)
            ):
                valid[row] = False  # not verified as the tree it was drafted as
                continue
            rows.append(row)
            src.append(i)
        if rows:  # one copy for the batch, not one per request
            n = min(width, last.tree.depths.shape[1])
            depths[rows, :n] = last.tree.depths[src, :n].to("cpu", depths.dtype)
        accepted = torch.zeros(batch, width + 1, dtype=torch.bool)
        path = self.rejection_sampler.last_accepted_nodes
        if path is not None and path.numel():
            rows = torch.arange(batch)[:, None].expand_as(path)
            hit = path >= 0
            accepted[rows[hit], path[hit].clamp(max=width)] = True
        self.sizer.observe_acceptance(depths, valid, accepted[:, :width], sampled)

    # -- step 1: positions ---------------------------------------------------
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self.tree_batch = self._build_tree_batch(scheduler_output) if self._uses_trees else None
        if self.tree_batch is not None:
            tb = self.tree_batch
            valid = tb.valid()
            self.positions[tb.flat_rows()[valid]] = tb.tree_positions()[valid]
        return out

    def _build_tree_batch(self, scheduler_output) -> TreeBatch | None:
        drafted = self.drafter.drafted_trees()
        spec = scheduler_output.scheduled_spec_decode_tokens
        query_start = self.query_start_loc.cpu
        rows, roots, parents, depths = [], [], [], []
        for req_id, draft_ids in spec.items():
            k = len(draft_ids)
            tree = drafted.get(req_id)
            if k == 0 or tree is None:
                continue
            tokens, tree_parents, tree_depths = tree
            if tokens[1 : k + 1].tolist() != list(draft_ids):
                continue  # not this step's drafts (e.g. zero drafts near max_model_len)
            tree_parents = tree_parents[: k + 1]
            if bool((tree_parents[1:] == torch.arange(k)).all()):
                continue  # a chain: causal attention and no compaction needed
            if _needs_chain_verification(self.requests[req_id].sampling_params):
                continue  # its drafts, in tree order, are verified as a chain
            row = self.input_batch.req_id_to_index[req_id]
            rows.append(row)
            roots.append(int(query_start[row + 1]) - k - 1)
            parents.append(tree_parents)
            depths.append(tree_depths[: k + 1])
        if not rows:
            return None
        width = max(p.shape[0] for p in parents)

        def pad(xs, fill):
            return torch.stack(
                [torch.nn.functional.pad(x, (0, width - x.shape[0]), value=fill) for x in xs]
            )

        batch_rows = torch.tensor(rows, dtype=torch.int64)
        root_index = torch.tensor(roots, dtype=torch.int64)
        block_table = self.input_batch.block_table[0].block_table.cpu[batch_rows]
        return TreeBatch(
            batch_rows=batch_rows,
            root_index=root_index,
            root_pos=self.positions[root_index].to("cpu", torch.int64),
            num_nodes=torch.tensor([p.shape[0] for p in parents], dtype=torch.int64),
            parents=pad(parents, -1),
            depths=pad(depths, 0),
            block_table=block_table,
        )

    # -- step 2: target forward with tree masks ----------------------------
    def _model_forward(self, *args, **kwargs):
        with self.timings.phase("target_forward"):
            if self.tree_batch is None:
                return super()._model_forward(*args, **kwargs)
            with verifying_trees(self.tree_batch):
                return super()._model_forward(*args, **kwargs)

    # -- step 3: verification parents, then KV compaction --------------------
    def _tree_parents(self, num_nodes: torch.Tensor, width: int) -> torch.Tensor | None:
        tb = self.tree_batch
        if tb is None:
            return None
        parents = chain_parents(num_nodes, width)
        n = min(width, tb.width)
        tree_parents = tb.parents[:, :n].clone()
        tree_parents[tree_parents >= num_nodes[tb.batch_rows][:, None]] = -1
        parents[tb.batch_rows, :n] = tree_parents
        parents[torch.arange(width)[None, :] >= num_nodes[:, None]] = -1
        return parents

    def _sampled_draft_q(
        self, tokens: torch.Tensor, num_nodes: torch.Tensor, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Draft distributions of requests whose drafts were sampled (draft_sample_method:
        sample): q [B, N, vocab] (node j's row = the law its child was drawn from) and
        the mask of those requests, or None when no request has them. A request whose
        scheduled drafts are not a prefix of what was drafted is left out."""
        last = self.drafter.last_drafts
        if last is None or last.sampled is None or last.draft_q is None:
            return None
        batch, width = tokens.shape
        index = {req_id: i for i, req_id in enumerate(last.req_ids)}
        passes = last.draft_q.shape[1]
        rows, src = [], []
        for b, req_id in enumerate(self.input_batch.req_ids[:batch]):
            i = index.get(req_id)
            n = int(num_nodes[b])
            if i is None or not bool(last.sampled[i]) or n - 1 > passes:
                continue
            if not torch.equal(tokens[b, 1:n], last.tree.tokens[i, 1:n].to(tokens.device)):
                continue
            rows.append(b)
            src.append(i)
        if not rows:
            return None
        q = torch.zeros(batch, width, vocab, dtype=torch.float32)
        n_rows = min(width, passes)
        sub = last.draft_q[src, :n_rows].to("cpu", torch.float32)
        if last.q_token_ids is None:
            q[rows, :n_rows, : sub.shape[-1]] = sub
        else:
            ids = last.q_token_ids.to("cpu", torch.int64)
            q[torch.tensor(rows)[:, None, None], torch.arange(n_rows)[None, :, None], ids] = sub
        mask = torch.zeros(batch, dtype=torch.bool)
        mask[rows] = True
        return q, mask

    def _sample(self, logits, spec_decode_metadata):
        verifying = spec_decode_metadata
        if verifying is not None and verifying.max_spec_len == 0:
            # vLLM 0.32 builds spec-decode metadata whenever requests are scheduled with
            # draft lists, even all empty (a drafts-off step of the sizer). Nothing to
            # verify: vLLM's plain sampler gives the same [B, 1] tokens without the
            # verifier's per-step setup (~18 ms at 64 requests on this CPU).
            verifying = None
            self.rejection_sampler.last_accepted_nodes = torch.full(
                (len(spec_decode_metadata.num_draft_tokens), 0), -1, dtype=torch.int64
            )
        with (
            self.timings.phase("verify"),
            self._position_keyed_plain_sampling(verifying),
        ):
            out = super()._sample(logits, verifying)
        if self.sizer is not None and spec_decode_metadata is not None:
            if verifying is None:  # no drafts: nothing accepted or rejected to count
                self.sizer.age_acceptance()
            else:
                self._observe_acceptance(spec_decode_metadata)
        if self.tree_batch is not None and spec_decode_metadata is not None:
            with self.timings.phase("kv_compaction"):
                self._compact_kv(self.rejection_sampler.last_accepted_nodes)
        return out

    @contextlib.contextmanager
    def _position_keyed_plain_sampling(self, spec_decode_metadata):
        """A step without drafts samples with vLLM's sampler alone; seeded requests
        then draw from a generator keyed by the sampled token's position, like the
        verifier does (see ExactRejectionSampler), so seeds reproduce."""
        metadata = self.input_batch.sampling_metadata
        if spec_decode_metadata is not None or not metadata.generators:
            yield
            return
        from eagle_vllm.engine.sampler import position_keyed_generators

        n = self.input_batch.num_reqs
        last = self.query_start_loc.cpu[1 : n + 1].to(torch.int64) - 1
        positions = self.positions.to("cpu", torch.int64)[last] + 1
        original = metadata.generators
        metadata.generators = position_keyed_generators(original, positions)
        try:
            yield
        finally:
            metadata.generators = original

    def _compact_kv(self, accepted_nodes: torch.Tensor) -> None:
        """Move accepted node i's K/V to the slot of position root+i, in every target layer."""
        tb = self.tree_batch
        r, src_node, dst_row = tb.compaction_moves(accepted_nodes[tb.batch_rows])
        if r.numel() == 0:
            return
        slots = self.input_batch.block_table[0].slot_mapping.cpu[dst_row].to(torch.int64)
        ctx = self.compilation_config.static_forward_context
        for layer_name, (node_k, node_v) in tb.captured_kv.items():
            layer = ctx[layer_name]
            kv_cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
            layer.impl.do_kv_cache_update(
                layer, node_k[r, src_node], node_v[r, src_node], kv_cache, slots
            )

    # -- step 4: drafting from the accepted path -----------------------------
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, *args, **kwargs):  # fmt: skip
        caught_up_before = self._step_clock.get("catch_up", 0.0)
        with self.timings.phase("draft") as clock:
            if self._skips_drafter(scheduler_output):
                out = self._defer_drafting(scheduler_output, sampled_token_ids, hidden_states)
            else:
                tb = self.tree_batch
                if tb is not None:
                    hidden_states = self._accepted_path_as_chain(tb, hidden_states)
                out = super().propose_draft_token_ids(
                    scheduler_output,
                    sampled_token_ids,
                    sampling_metadata,
                    hidden_states,
                    *args,
                    **kwargs,
                )
        # deferred draft KV written in this step is the cost of earlier drafts-off steps,
        # not of this step's tree: keep it out of the sizer's draft cost
        caught_up = self._step_clock.get("catch_up", 0.0) - caught_up_before
        self._step_clock["draft"] = clock.seconds - caught_up
        return out

    def _skips_drafter(self, scheduler_output) -> bool:
        """Auto sizing: decide the next step's tree now. No drafts after a plain decode
        step: the drafter is skipped. Otherwise it runs, after writing any draft KV it
        deferred for these requests (its first pass reads it)."""
        if self.sizer is None:
            return False
        self._planned_size = self.choose_tree_size(self.input_batch.num_reqs)
        if self._planned_size[0] == 0 and _plain_decode(scheduler_output):
            self._planned_size = None
            return True
        if self.drafter.has_deferred:  # its first pass reads the deferred positions
            self._catch_up_draft_kv(first_positions=self._first_scheduled_positions())
        return False

    def _defer_drafting(self, scheduler_output, sampled_token_ids, hidden_states) -> torch.Tensor:
        """A plain decode step before a drafts-off step: skip the drafter and keep what its
        first pass needed (one position per request); the drafter writes that draft KV
        later, many positions per forward. Returns no drafts."""
        drafter = self.drafter
        num_reqs = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        if isinstance(sampled_token_ids, list):
            next_tokens = drafter.prepare_next_token_ids_cpu(
                sampled_token_ids,
                self.requests,
                self.input_batch,
                scheduler_output.num_scheduled_tokens,
            )
        else:  # one sampled token per request: no drafts were verified
            next_tokens = sampled_token_ids[:num_reqs, 0]
        positions = self.positions[:num_reqs].to("cpu", torch.int64)  # one token per request
        full = drafter.defer_first_pass(req_ids, positions, next_tokens, hidden_states[:num_reqs])
        if full:  # bound what waits (memory)
            self._catch_up_draft_kv(first_positions=positions + 1)
        drafter.last_size = (0, 1)
        drafter.last_drafts = None
        return torch.empty(num_reqs, 0, dtype=torch.int64, device=hidden_states.device)

    def _catch_up_draft_kv(self, first_positions: torch.Tensor) -> None:
        """Write the deferred draft KV of this step's requests (``first_positions[b]``: the
        first position of request b not deferred)."""
        num_reqs = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        block_table = self.input_batch.block_table[0].block_table.cpu[:num_reqs]
        with self.timings.phase("draft_catch_up") as clock:
            self.drafter.catch_up(req_ids, first_positions, block_table)
        self._step_clock["catch_up"] = self._step_clock.get("catch_up", 0.0) + clock.seconds

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
        index = self.input_batch.req_id_to_index
        req_ids = [
            r for r in sorted(leaving) if r in index and self.drafter.deferred_end(r) is not None
        ]
        if not req_ids:
            return
        rows = torch.tensor([index[r] for r in req_ids], dtype=torch.int64)
        ends = torch.tensor([self.drafter.deferred_end(r) for r in req_ids], dtype=torch.int64)
        block_size = self.cache_config.block_size  # the prefix cache's unit (hashed blocks)
        full_blocks_end = ends // block_size * block_size
        block_table = self.input_batch.block_table[0].block_table.cpu[rows]
        with self.timings.phase("draft_catch_up") as clock:
            self.drafter.catch_up(req_ids, ends, block_table, limits=full_blocks_end)
        self._step_clock["catch_up"] = self._step_clock.get("catch_up", 0.0) + clock.seconds

    def _first_scheduled_positions(self) -> torch.Tensor:
        num_reqs = self.input_batch.num_reqs
        starts = self.query_start_loc.cpu[:num_reqs].to(torch.int64)
        return self.positions.to("cpu", torch.int64)[starts]

    def _accepted_path_as_chain(self, tb: TreeBatch, hidden_states: torch.Tensor) -> torch.Tensor:
        """Reorder each tree's rows to [root, accepted path..., the rest] and make positions
        linear, so the drafter's first pass sees the accepted tokens as a chain whose
        features are the target's features of exactly those nodes."""
        paths = self.rejection_sampler.last_accepted_nodes[tb.batch_rows].tolist()  # [R, D]
        width = tb.width
        rows = []  # built as lists: one small tensor op per request cost more than all this
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
        hidden_states = hidden_states[perm]
        input_ids = self.input_ids.gpu
        input_ids[dst] = input_ids[src].clone()
        offsets = torch.arange(width)[None, :].expand_as(order)
        self.positions[dst] = (tb.root_pos[:, None] + offsets)[valid]
        return hidden_states


def _pinned_size(sizer: TreeSizer) -> tuple[int, int] | None:
    """``EAGLE_VLLM_SIZER_PIN="passes,nodes"``: every step uses that arm of the auto sizer
    (e.g. ``0,1``: drafts off). For benchmarks that time one arm end to end
    (``benchmarks/step_profile.py``); the sizer keeps measuring."""
    import os

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


class EagleCPUModelRunner(EagleRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self._install_eagle(_torch_cuda_wrapper)


class EagleGPUModelRunner(EagleRunnerMixin, GPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self._install_eagle(contextlib.nullcontext)
