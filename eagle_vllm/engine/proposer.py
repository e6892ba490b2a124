"""The plugin's drafter: EAGLE feature-level drafting of a chain or an EAGLE-2 tree.

One code path serves both methods; a chain is a tree with ``topk = 1``.

1. **First pass** (vLLM attention, paged KV): the draft runs over the tokens
   the target just verified, with features shifted by one, exactly like vLLM's
   own EAGLE proposer. This writes the draft KV of the accepted prefix and
   yields the root's draft feature; the root is the token the target just
   sampled, so the first draft distribution comes from the target's true
   feature of the last accepted token.
2. **Tree expansion** (``tree.builder``): depth by depth, the ``topk`` frontier
   nodes of every request go through the draft's decoder layers in one batched
   forward. Their attention sees the draft KV of the prefix (read from the
   paged cache) plus their own tree ancestors, held in memory, so tree nodes
   never write into the paged cache and cannot overwrite prefix KV.
3. **Rerank** to ``total_tokens`` nodes; the flat node tokens (parents first)
   are handed to vLLM's scheduler as this request's draft tokens.

With ``total_tokens: auto`` the runner's ``TreeSizer`` (``sizing.py``) picks each
step's number of passes and nodes, possibly none. In a plain decode step with none,
the runner skips the drafter altogether and the first pass's inputs (the new
token and the target's feature) are kept per request (``defer_first_pass``); the
draft KV of those positions is written later in one batched forward
(``catch_up``): before any first pass of that request, and when a request has
``MAX_DEFERRED_TOKENS`` waiting. A request that finishes while drafts are off
never pays for them.

Touches vLLM 0.32 internals: ``EagleProposer`` first-pass helpers
(``set_inputs_first_pass``, ``build_per_group_and_layer_attn_metadata``,
``build_model_inputs_first_pass``), ``set_forward_context``, and the draft
layers' ``self_attn.attn`` modules (temporarily swapped during expansion).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.eagle import EagleProposer

from eagle_vllm.attention.paged_kv import check_cpu_isa, gather_cpu_kv
from eagle_vllm.attention.reference import prefix_tree_attention
from eagle_vllm.config import EagleSpecConfig
from eagle_vllm.models.eagle_llama import ARCHITECTURE
from eagle_vllm.tree.builder import TreeBuilder, depth_one_tree
from eagle_vllm.tree.layout import DraftTree

# Deferred positions a request may collect before they are written anyway. Large, so a
# request that finishes while drafts are off (high load) usually never pays for them;
# bounded, for memory (one feature per position) and because KV blocks filled meanwhile
# may be shared by prefix caching, without their draft KV (drafts only: never outputs).
MAX_DEFERRED_TOKENS = 128


@dataclass
class _DeferredFirstPass:
    """First-pass inputs of skipped steps: the draft KV of position ``start + i`` needs
    ``tokens[i]`` (the token at the next position) and ``features[i]`` (the target's
    feature at this one)."""

    start: int
    tokens: list[int]
    features: list[torch.Tensor]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class DraftedTrees:
    """What the last ``propose`` produced, for the verifier of the next step."""

    req_ids: list[str]
    tree: DraftTree
    # draft_sample_method: sample. ``sampled[b]``: request b's drafts were sampled
    # from ``draft_q[b, j]`` (node j's child distribution over ``q_token_ids``, or the
    # full vocabulary when None); the verifier then uses q (sampled_chain_verify).
    sampled: torch.Tensor | None = None
    draft_q: torch.Tensor | None = None
    q_token_ids: torch.Tensor | None = None


class _TreeNodeAttention(nn.Module):
    """Stands in for a draft layer's vLLM ``Attention`` during tree expansion.

    Keeps the K/V of every node expanded so far; each new query attends to
    the request's prefix (from the paged cache) and to the nodes ``mask`` allows.
    """

    def __init__(self, attn: nn.Module, prefix_k, prefix_v, prefix_lens, batch: int):
        super().__init__()
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_size = attn.head_size
        self.scale = attn.impl.scale
        self.prefix_k, self.prefix_v, self.prefix_lens = prefix_k, prefix_v, prefix_lens
        self.node_k = prefix_k.new_zeros(batch, 0, self.num_kv_heads, self.head_size)
        self.node_v = self.node_k
        self.mask: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.mask is not None
        batch, width = self.mask.shape[:2]
        q = q.view(batch, width, self.num_heads, self.head_size)
        k = k.view(batch, width, self.num_kv_heads, self.head_size)
        v = v.view(batch, width, self.num_kv_heads, self.head_size)
        self.node_k = torch.cat([self.node_k, k.to(self.node_k.dtype)], dim=1)
        self.node_v = torch.cat([self.node_v, v.to(self.node_v.dtype)], dim=1)
        out = prefix_tree_attention(
            q,
            self.prefix_k,
            self.prefix_v,
            self.prefix_lens,
            self.node_k,
            self.node_v,
            self.mask,
            self.scale,
        )
        return out.reshape(batch * width, self.num_heads * self.head_size)


class EagleTreeProposer(EagleProposer):
    """vLLM's ``EagleProposer`` with the plugin's draft model and tree drafting."""

    def __init__(self, vllm_config, device, runner, eagle_config: EagleSpecConfig):
        super().__init__(vllm_config, device, runner)
        self.eagle_config = eagle_config
        self.last_drafts: DraftedTrees | None = None
        self._runner = runner
        # (draft passes, tree nodes) of the last propose, for the runner's sizer
        self.last_size: tuple[int, int] = (0, 1)
        self._last_q_rows: list[torch.Tensor] = []
        self._last_q_token_ids: torch.Tensor | None = None
        # Draws for sampled drafts. One generator, seeded alike on every rank and
        # consumed alike, so tensor-parallel ranks draft identical tokens.
        self._draft_rng = torch.Generator(device=device).manual_seed(
            vllm_config.model_config.seed or 0
        )
        self._deferred: dict[str, _DeferredFirstPass] = {}
        self.max_deferred_tokens = MAX_DEFERRED_TOKENS
        self.caught_up_positions = 0  # draft KV positions written by catch_up, in all

    # -- loading -----------------------------------------------------------
    def _get_model(self) -> nn.Module:
        # Route the draft to the plugin's architecture (fc bias, no attention-bias mixup).
        self.speculative_config.draft_model_config.hf_config.architectures = [ARCHITECTURE]
        return super()._get_model()

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        target_hidden = target_model.config.hidden_size
        draft_hidden = self.model.config.hidden_size
        if target_hidden != draft_hidden:
            raise ValueError(
                f"eagle_vllm: draft hidden_size {draft_hidden} does not match the "
                f"target's {target_hidden}. Fix: use a draft trained for this target."
            )
        if self.eagle_config.draft_vocab:
            from eagle_vllm.models.checkpoint import load_draft_vocab

            ids = load_draft_vocab(self.eagle_config.model)[: self.eagle_config.draft_vocab]
            self.model.use_draft_vocab(ids)

    def drafted_trees(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """req_id -> (tokens, parents, depths) of the trees handed out by the last propose."""
        last = self.last_drafts
        if last is None:
            return {}
        tree = last.tree
        return {
            req_id: (tree.tokens[i], tree.parents[i], tree.depths[i])
            for i, req_id in enumerate(last.req_ids)
        }

    def _draft_layers(self) -> list[nn.Module]:
        return list(self.model.model.layers)

    # -- drafting ----------------------------------------------------------
    def propose(
        self,
        num_speculative_tokens,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        num_tokens, token_indices_to_sample, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        _, per_layer_attn_metadata = self.build_per_group_and_layer_attn_metadata(cad)
        mode, num_input_tokens, tokens_across_dp = self._determine_batch_execution_and_padding(
            num_tokens
        )
        model_kwargs, slot_mapping_size = self.build_model_inputs_first_pass(
            num_tokens, num_input_tokens, None
        )
        with set_forward_context(
            per_layer_attn_metadata,
            self.vllm_config,
            num_tokens=num_input_tokens,
            num_tokens_across_dp=tokens_across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=self._get_slot_mapping(slot_mapping_size, cad.slot_mapping),
        ):
            out = self.model(**model_kwargs)
        last_hidden, hidden = out if self.model_returns_tuple() else (out, out)

        depth, total_tokens = self._runner.choose_tree_size(batch_size)
        total_tokens = min(total_tokens, int(num_speculative_tokens) + 1)
        self.last_size = (depth, total_tokens)
        num_drafts = total_tokens - 1
        req_ids = list(self._runner.input_batch.req_ids[:batch_size])
        if num_drafts <= 0 or depth == 0:
            self.last_size = (0, 1)
            self.last_drafts = None
            return torch.empty(batch_size, 0, dtype=torch.int64, device=hidden.device)

        root_hidden = hidden[token_indices_to_sample]
        root_last_hidden = last_hidden[token_indices_to_sample]  # the LM head runs in draft_tree
        root_positions = self.positions[token_indices_to_sample].to(torch.int64)
        temperatures = self._sampling_temperatures(req_ids, sampling_metadata)
        tree = self.draft_tree(
            root_tokens=next_token_ids[:batch_size].to(torch.int64),
            root_hidden=root_hidden,
            root_last_hidden=root_last_hidden,
            root_positions=root_positions,
            block_table=cad.block_table_tensor[:batch_size],
            total_tokens=total_tokens,
            depth=depth,
            temperatures=temperatures,
        )
        self.last_drafts = DraftedTrees(req_ids=req_ids, tree=tree)
        if temperatures is not None:
            self.last_drafts.sampled = temperatures > 0
            self.last_drafts.draft_q = torch.stack(self._last_q_rows, dim=1)  # [B, passes, V]
            self.last_drafts.q_token_ids = self._last_q_token_ids
        drafts = tree.tokens[:, 1 : num_drafts + 1]
        if drafts.shape[1] < num_drafts:  # a smaller tree than the slots (never for full trees)
            drafts = torch.nn.functional.pad(drafts, (0, num_drafts - drafts.shape[1]), value=0)
        return drafts.clamp(min=0)

    def _sampling_temperatures(self, req_ids: list[str], sampling_metadata) -> torch.Tensor | None:
        """[B] temperature at which each request's drafts are sampled (0: argmax drafts),
        or None when nothing is sampled.

        With ``draft_sample_method: sample``, sampled requests draft from q at their own
        temperature. Seeded requests keep argmax drafts: their verifier draws are keyed
        by position, so their output depends on the seed alone, whatever was drafted.
        Requests with a grammar keep argmax drafts too: vLLM truncates drafts the
        grammar rejects, a value-dependent cut under which min(1, p/q) is not exact.
        """
        if self.eagle_config.draft_sample_method != "sample":
            return None
        if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
            return None
        temps = sampling_metadata.temperature[: len(req_ids)].to("cpu", torch.float32).clone()
        for b in sampling_metadata.generators:
            if b < len(req_ids):
                temps[b] = 0.0
        for b, req_id in enumerate(req_ids):
            state = self._runner.requests.get(req_id)
            if state is not None and state.sampling_params is not None:
                if state.sampling_params.structured_outputs is not None:
                    temps[b] = 0.0
        if not bool((temps > 0).any()):
            return None
        return temps

    def _choose_children(
        self, logprobs: torch.Tensor, temperatures: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One child per row: a draw from q = softmax(logprobs / T) where T > 0, the
        argmax where T == 0. Returns children [B, w, 1] and q [B, w, V]."""
        temps = temperatures.to(logprobs.device)[:, None, None]
        q = torch.softmax(logprobs / temps.clamp(min=1e-5), dim=-1)
        race = torch.empty_like(q).exponential_(generator=self._draft_rng)
        sampled = (q / race).argmax(dim=-1, keepdim=True)  # exact draw from q
        greedy = logprobs.argmax(dim=-1, keepdim=True)
        children = torch.where(temps > 0, sampled, greedy)
        return children, q

    @torch.inference_mode()
    def draft_tree(
        self,
        root_tokens: torch.Tensor,
        root_hidden: torch.Tensor,
        root_last_hidden: torch.Tensor,
        root_positions: torch.Tensor,
        block_table: torch.Tensor,
        total_tokens: int,
        depth: int,
        temperatures: torch.Tensor | None = None,
    ) -> DraftTree:
        """Expand (``depth`` draft passes) and rerank a tree per request, from the root's
        draft output. ``temperatures`` [B] (chains only): sample each draft from the
        draft distribution at that temperature (0: argmax); the q rows are kept in
        ``self._last_q_rows`` for the verifier."""
        cfg = self.eagle_config
        batch = root_tokens.shape[0]
        if depth == 1 and temperatures is None:
            # The shape the sizer picks most at batch 1: skip the builder's bookkeeping.
            logprobs, token_ids = self._draft_logprobs(root_last_hidden, 1)
            return depth_one_tree(root_tokens, logprobs, cfg.topk, total_tokens, token_ids)
        builder = TreeBuilder(root_tokens, cfg.topk, total_tokens, depth)
        q_rows: list[torch.Tensor] = []
        self._last_q_rows = q_rows  # node j's child distribution, stacked by propose

        def expand(logprobs: torch.Tensor, token_ids: torch.Tensor | None) -> None:
            if temperatures is None:
                builder.step(logprobs, token_ids)
                return
            children, q = self._choose_children(logprobs, temperatures)
            q_rows.append(q[:, 0])  # chains: one frontier row per pass
            self._last_q_token_ids = token_ids
            builder.step(logprobs, token_ids, children=children)

        expand(*self._draft_logprobs(root_last_hidden, 1))
        if depth == 1:
            return builder.finalize(pad_to=total_tokens)

        layers = self._draft_layers()
        prefix_lens = root_positions + 1  # draft KV at positions <= root's
        shims = _prefix_attention_shims(layers, block_table, prefix_lens)

        max_position = self.max_model_len - 1
        node_hidden = root_hidden[:, None, :]
        node_mask = torch.zeros(batch, 1, 0, dtype=torch.bool, device=root_hidden.device)
        with _swapped_attention(layers, shims):
            for step in range(1, depth):
                frontier = builder.frontier()
                width = frontier.tokens.shape[1]
                parent_rows = frontier.parent_frontier_index.clamp(min=0)
                parent_hidden = torch.gather(
                    node_hidden, 1, parent_rows[:, :, None].expand(-1, -1, node_hidden.shape[-1])
                )
                # Ancestors of a new node = ancestors of its parent (a node of the
                # previous frontier) plus itself.
                inherited = torch.gather(
                    node_mask, 1, parent_rows[:, :, None].expand(-1, -1, node_mask.shape[-1])
                )
                own = torch.eye(width, dtype=torch.bool, device=node_mask.device)
                node_mask = torch.cat([inherited, own[None].expand(batch, -1, -1)], dim=2)
                for shim in shims:
                    shim.mask = node_mask
                positions = (root_positions[:, None] + step).clamp(max=max_position)
                x = self.model.combine_features(
                    frontier.tokens.clamp(min=0).reshape(-1),
                    parent_hidden.reshape(batch * width, -1),
                )
                residual = None
                for layer in layers:
                    x, residual = layer(positions.reshape(-1), x, residual)
                node_hidden = (x + residual).view(batch, width, -1)
                expand(*self._draft_logprobs(node_hidden.reshape(batch * width, -1), width))
        return builder.finalize(pad_to=total_tokens)

    # -- drafts-off steps: deferred first passes ------------------------------
    def defer_first_pass(
        self,
        req_ids: list[str],
        positions: torch.Tensor,
        next_tokens: torch.Tensor,
        features: torch.Tensor,
    ) -> bool:
        """Keep a skipped first pass's inputs: request b's draft KV at ``positions[b]``
        needs ``next_tokens[b]`` and ``features[b]``. True when a request now has
        ``max_deferred_tokens`` waiting (the caller should ``catch_up``)."""
        live = self._runner.requests
        for req_id in [r for r in self._deferred if r not in live]:
            del self._deferred[req_id]  # finished or aborted: its blocks are gone
        features = features.detach().clone()  # the runner reuses its buffers
        full = False
        for b, (req_id, pos, token) in enumerate(
            zip(req_ids, positions.tolist(), next_tokens.tolist())
        ):
            pending = self._deferred.get(req_id)
            if pending is None or pending.end != pos:
                # nothing kept, or positions recomputed since (preemption): the first
                # pass of the recomputation wrote the draft KV before ``pos``
                pending = self._deferred[req_id] = _DeferredFirstPass(pos, [], [])
            pending.tokens.append(int(token))
            pending.features.append(features[b])
            full |= len(pending.tokens) >= self.max_deferred_tokens
        return full

    def deferred_end(self, req_id: str) -> int | None:
        """The first position after request ``req_id``'s deferred run (None: nothing deferred)."""
        pending = self._deferred.get(req_id)
        return None if pending is None else pending.end

    @property
    def has_deferred(self) -> bool:
        """Whether any request has deferred positions (cheap: checked every drafting step)."""
        return bool(self._deferred)

    @torch.inference_mode()
    def catch_up(
        self,
        req_ids: list[str],
        next_positions: torch.Tensor,
        block_table: torch.Tensor,
        limits: torch.Tensor | None = None,
    ) -> int:
        """Write the draft KV of every deferred position of these requests (batch rows),
        in one forward; ``next_positions[b]``: request b's first position not deferred
        (a request whose deferred run does not end there was recomputed and is
        dropped); ``limits[b]``: write only positions below it (the rest is dropped).
        Returns the number of positions written."""
        rows, kept = [], []
        ends = limits.tolist() if limits is not None else [None] * len(req_ids)
        for b, (req_id, nxt, limit) in enumerate(zip(req_ids, next_positions.tolist(), ends)):
            pending = self._deferred.pop(req_id, None)
            if pending is None or pending.end != nxt:
                continue
            if limit is not None:
                keep = max(0, limit - pending.start)
                pending = _DeferredFirstPass(
                    pending.start, pending.tokens[:keep], pending.features[:keep]
                )
            if pending.tokens:
                rows.append(b)
                kept.append(pending)
        if not rows:
            return 0
        device = kept[0].features[0].device
        lengths = torch.tensor([len(p.tokens) for p in kept], dtype=torch.int64)
        starts = torch.tensor([p.start for p in kept], dtype=torch.int64)
        width = int(lengths.max())
        tokens = torch.zeros(len(kept), width, dtype=torch.int64)
        features = torch.zeros(len(kept), width, kept[0].features[0].shape[-1],
                               dtype=kept[0].features[0].dtype, device=device)  # fmt: skip
        for i, pending in enumerate(kept):
            tokens[i, : len(pending.tokens)] = torch.tensor(pending.tokens)
            features[i, : len(pending.tokens)] = torch.stack(pending.features)
        valid = torch.arange(width)[None, :] < lengths[:, None]  # [R, W]
        # each deferred position sees the draft KV before its run (paged cache) and the
        # run's earlier positions (causal)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = (causal[None] & valid[:, None, :]).to(device)
        positions = (starts[:, None] + torch.arange(width)[None, :]).clamp(
            max=self.max_model_len - 1
        )
        table = block_table[torch.tensor(rows)]
        layers = self._draft_layers()
        shims = _prefix_attention_shims(layers, table, starts.to(device))
        for shim in shims:
            shim.mask = mask
        x = self.model.combine_features(
            tokens.to(device).reshape(-1), features.reshape(-1, features.shape[-1])
        )
        residual = None
        with _swapped_attention(layers, shims):
            for layer in layers:
                x, residual = layer(positions.to(device).reshape(-1), x, residual)
        valid_rows = valid.to(device)
        written = positions[valid]
        table_rows = torch.arange(len(rows))[:, None].expand_as(positions)[valid]
        for layer, shim in zip(layers, shims):
            attn = layer.self_attn.attn
            kv_cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
            block_size = kv_cache.shape[2]  # the CPU layout [blocks, heads, block, 2*dim]
            slots = table[table_rows, written // block_size].long() * block_size + (
                written % block_size
            )
            attn.impl.do_kv_cache_update(
                attn, shim.node_k[valid_rows], shim.node_v[valid_rows], kv_cache,
                slots.to(device),
            )  # fmt: skip
        self.caught_up_positions += int(valid.sum())
        return int(valid.sum())

    def _draft_logprobs(self, hidden: torch.Tensor, width: int):
        """[B, width, V'] draft log-probs over the drafting vocabulary, and its token ids."""
        logits, token_ids = self.model.draft_logits(hidden)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logprobs.view(-1, width, logprobs.shape[-1]), token_ids


def _prefix_attention_shims(
    layers: list[nn.Module], block_table: torch.Tensor, prefix_lens: torch.Tensor
) -> list[_TreeNodeAttention]:
    """One ``_TreeNodeAttention`` per draft layer over each request's draft KV of
    positions ``< prefix_lens`` (read from the paged cache)."""
    max_prefix = max(1, int(prefix_lens.max()))
    shims = []
    for layer in layers:
        attn = layer.self_attn.attn
        kv_cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
        check_cpu_isa(getattr(attn, "isa", "unknown"))
        prefix_k, prefix_v = gather_cpu_kv(kv_cache, block_table, max_prefix)
        shims.append(_TreeNodeAttention(attn, prefix_k, prefix_v, prefix_lens, len(block_table)))
    return shims


@contextlib.contextmanager
def _swapped_attention(layers: list[nn.Module], shims: list[nn.Module]):
    originals = [layer.self_attn.attn for layer in layers]
    try:
        for layer, shim in zip(layers, shims):
            layer.self_attn.attn = shim
        yield
    finally:
        for layer, original in zip(layers, originals):
            layer.self_attn.attn = original
