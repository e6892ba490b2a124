"""The plugin's drafter: EAGLE feature-level drafting of a chain or an EAGLE-2 tree.

One code path serves both methods; a chain is a tree with ``topk = 1``. ``propose``
(called by vLLM's runner inside ``propose_draft_token_ids``, with the step bound by
``bound_to(step)``) reads top to bottom:

1. **First pass** (``first_pass``): the draft runs over the tokens the target just
   verified, with features shifted by one, as vLLM's own EAGLE proposer does. This
   writes the draft KV of the accepted prefix and yields the root's draft feature; the
   root is the token the target just sampled, so the first draft distribution comes
   from the target's true feature of the last accepted token. Decode steps run it with
   the platform's attention over the paged cache read in place
   (``TreePlatform.prefix_attention``); prompt steps with vLLM's attention and input
   preparation (``vllm_surface.first_pass_forward``).
2. **Tree expansion** (``tree.builder``, ``draft_tree``): depth by depth, the ``topk``
   frontier nodes of every request go through the draft's decoder layers in one
   batched forward. Their attention sees the draft KV of the prefix (read in place
   from the paged cache, or gathered where the platform cannot) plus their own tree
   ancestors, held in memory, so tree nodes never write into the paged cache and
   cannot overwrite prefix KV.
   Each pass's draft distribution covers the head's drafting vocabulary: with
   ``draft_vocab: N``, the N most frequent tokens plus, per request, the tokens of its
   own context (``draft_vocab_context``, ``drafting/context_vocab.py``).
3. **Rerank** to the step's planned number of nodes; the flat node tokens (parents
   first) go to vLLM's scheduler as the request's draft tokens, and the trees to the
   ``StepState`` (``drafted``), which the next step verifies. With a ``suffix:``
   section the rerank runs over the EAGLE nodes and the step's suffix candidates
   together (``tree/merge.py``, ``engine/suffix_drafts.py``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from vllm.v1.spec_decode.eagle import EagleProposer

from eagle_vllm import vllm_surface
from eagle_vllm.attention.platform import TreePlatform
from eagle_vllm.attention.reference import prefix_tree_attention
from eagle_vllm.config import EagleSpecConfig
from eagle_vllm.drafting.context_vocab import ContextVocabulary
from eagle_vllm.engine.step import DraftedTrees, StepBound, StepState
from eagle_vllm.engine.suffix_drafts import merge_drafts
from eagle_vllm.models.eagle3_llama import ARCHITECTURE3
from eagle_vllm.models.eagle_llama import ARCHITECTURE
from eagle_vllm.tree.builder import TreeBuilder, depth_one_tree
from eagle_vllm.tree.layout import DraftTree
from eagle_vllm.tree.merge import SuffixGuide


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


# The longest run of rows per request the first pass takes through the platform's
# in-place attention (a decode step verifies at most a tree's nodes per request); longer
# runs are prompt chunks, for vLLM's causal kernel.
OWN_FIRST_PASS_MAX_ROWS = 64


@dataclass(frozen=True)
class _RunPlan:
    """The first pass's rows, one run per request (``_first_pass_own_attention``):
    ``rows [R, N]`` (row i of run r; padding repeats the last), ``num_rows [R]``,
    ``blocks [R, B]`` int64, ``prefix_len [R]`` (the run's first position: the draft KV
    before it is in the cache), ``allowed [R, N, N]`` (causal), ``slots [T]``."""

    rows: torch.Tensor
    num_rows: torch.Tensor
    blocks: torch.Tensor
    prefix_len: torch.Tensor
    allowed: torch.Tensor
    slots: torch.Tensor


class _RunAttention(nn.Module):
    """Stands in for a draft layer's ``Attention`` in the first pass of a decode step:
    writes the rows' K/V to their slots, and each row attends to its request's draft KV
    before the run (read in place) and to the run's rows up to itself."""

    def __init__(self, attn: nn.Module, attend, plan: _RunPlan, platform: TreePlatform):
        super().__init__()
        self.attn, self.attend, self.plan, self.platform = attn, attend, plan, platform
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_size, self.scale = attn.head_size, attn.impl.scale
        self.kv_only = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows = q.shape[0]
        k = k.view(rows, self.num_kv_heads, self.head_size)
        v = v.view(rows, self.num_kv_heads, self.head_size)
        self.platform.write_kv(self.attn, k, v, self.plan.slots)
        if self.kv_only:
            raise _KVCaptured
        p = self.plan
        return self.attend(
            q.view(rows, self.num_heads, self.head_size), k, v, p.rows, p.num_rows, p.blocks,
            p.prefix_len, p.allowed, self.scale,
        )  # fmt: skip


class _NodeBuffers:
    """One draft layer's tree-pass buffers, kept across steps: each a flat tensor grown to
    the largest shape asked for, handed out as a contiguous view of its first elements."""

    def __init__(self, dtype: torch.dtype, device) -> None:
        self.dtype, self.device = dtype, device
        self._flat: dict[str, torch.Tensor] = {}
        self._rows = torch.arange(0, device=device)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel:
            dtype = torch.bool if name == "allowed" else self.dtype
            flat = self._flat[name] = torch.zeros(numel, dtype=dtype, device=self.device)
        return flat[:numel].view(shape)

    def rows(self, n: int) -> torch.Tensor:
        """``arange(n)``."""
        if self._rows.numel() < n:
            self._rows = torch.arange(n, device=self.device)
        return self._rows[:n]


class _InPlaceTreeNodeAttention(nn.Module):
    """``_TreeNodeAttention`` over the prefix read in place from the paged cache
    (``TreePlatform.prefix_attention``): nothing is gathered. The nodes' queries, K/V
    and ancestor masks accumulate in per-request buffers; each forward's new nodes are
    the queries, the earlier ones keys only."""

    def __init__(self, attn: nn.Module, attend, blocks, prefix_lens, batch: int, capacity: int,
                 buffers: _NodeBuffers):  # fmt: skip
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_size, self.scale = attn.head_size, attn.impl.scale
        self.attend, self.blocks, self.prefix_lens = attend, blocks, prefix_lens
        self.count, self.capacity = 0, max(capacity, 1)
        self.mask: torch.Tensor | None = None
        n, d = self.capacity, self.head_size
        # the platform reads rows < the nodes fed so far only (``prefix_attention``), so
        # the buffers are reused from step to step without clearing
        self.query = buffers.take("query", (batch, n, self.num_heads, d))
        self.key = buffers.take("key", (batch, n, self.num_kv_heads, d))
        self.value = buffers.take("value", (batch, n, self.num_kv_heads, d))
        self.allowed = buffers.take("allowed", (batch, n, n))
        self.rows = buffers.rows(batch * n).view(batch, n)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.mask is not None
        batch, width = self.mask.shape[:2]
        start, end = self.count, self.count + width
        assert end <= self.capacity, "more nodes than the drafter planned for"
        self.query[:, start:end] = q.view(batch, width, self.num_heads, self.head_size)
        self.key[:, start:end] = k.view(batch, width, self.num_kv_heads, self.head_size)
        self.value[:, start:end] = v.view(batch, width, self.num_kv_heads, self.head_size)
        self.allowed[:, start:end, :end] = self.mask
        self.count = end
        out = self.attend(
            self.query.view(-1, self.num_heads, self.head_size),
            self.key.view(-1, self.num_kv_heads, self.head_size),
            self.value.view(-1, self.num_kv_heads, self.head_size),
            self.rows,
            torch.full((batch,), end, dtype=torch.int64, device=q.device),
            self.blocks,
            self.prefix_lens,
            self.allowed,
            self.scale,
            start,
        )
        out = out.view(batch, self.capacity, -1)[:, start:end]
        return out.reshape(batch * width, self.num_heads * self.head_size)

    @property
    def node_k(self) -> torch.Tensor:
        return self.key[:, : self.count]

    @property
    def node_v(self) -> torch.Tensor:
        return self.value[:, : self.count]


class _KVCaptured(Exception):
    """Raised by ``_KVOnlyAttention`` once it holds the K/V: nothing after is needed."""


class _KVOnlyAttention(nn.Module):
    """Stands in for the last draft layer's ``Attention`` when only its K/V are wanted
    (``forward_runs``): keeps them, then stops the forward (``_KVCaptured``)."""

    def __init__(self, attn: nn.Module, batch: int):
        super().__init__()
        self.num_kv_heads = attn.num_kv_heads
        self.head_size = attn.head_size
        self.batch = batch
        self.mask: torch.Tensor | None = None
        self.node_k = self.node_v = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = (self.batch, -1, self.num_kv_heads, self.head_size)
        self.node_k, self.node_v = k.reshape(shape), v.reshape(shape)
        raise _KVCaptured


class _AtRows(nn.Module):
    """``module`` applied to ``rows`` of its input only; the other rows' outputs are zeros.
    Handles vLLM linears that return ``(output, bias)``."""

    def __init__(self, module: nn.Module, rows: torch.Tensor, out_features: int):
        super().__init__()
        self.module, self.rows, self.out_features = module, rows.long(), out_features

    def forward(self, x: torch.Tensor):
        if self.rows.numel() == 0:  # no outputs wanted (a first pass that only writes KV)
            full = x.new_zeros(x.shape[0], self.out_features)
            return (full, None) if getattr(self.module, "return_bias", False) else full
        out = self.module(x[self.rows])
        rest = ()
        if isinstance(out, tuple):
            out, *rest = out
        full = out.new_zeros(x.shape[0], out.shape[-1])
        full[self.rows] = out
        return (full, *rest) if rest else full


class EagleTreeProposer(StepBound, EagleProposer):
    """vLLM's ``EagleProposer`` with the plugin's draft model and tree drafting; ``propose``
    drafts for the step it is ``bound_to``."""

    def __init__(self, vllm_config, device, runner, eagle_config: EagleSpecConfig,
                 platform: TreePlatform):  # fmt: skip
        super().__init__(vllm_config, device, runner)
        self.eagle_config = eagle_config
        self.platform = platform
        # Draws for sampled drafts. One generator, seeded alike on every rank and
        # consumed alike, so tensor-parallel ranks draft identical tokens.
        self.draft_rng = torch.Generator(device=device).manual_seed(
            vllm_config.model_config.seed or 0
        )
        # the platform's in-place attention per draft layer (None: not resolved yet)
        self._in_place_attends: list | None = None
        # each draft layer's tree-pass buffers (_InPlaceTreeNodeAttention), kept across steps
        self._node_buffers: list[_NodeBuffers] = []
        self._causal_masks: dict[int, torch.Tensor] = {}
        # each request's own tokens beside the reduced draft vocabulary (None: not used),
        # and this step's extra LM-head columns (token ids, rows, [B, E] allowed)
        self.context_vocab: ContextVocabulary | None = None
        self._context_columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # the LM-head rows of the context columns so far (a buffer with room to append)
        self._context_rows: torch.Tensor | None = None

    # -- loading -----------------------------------------------------------
    def _get_model(self) -> nn.Module:
        # Route the draft to the plugin's architecture (fc bias, no attention-bias mixup).
        architecture = ARCHITECTURE3 if self.eagle_config.head_type == "eagle3" else ARCHITECTURE
        self.speculative_config.draft_model_config.hf_config.architectures = [architecture]
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
        # the layers' direct forward, built from the layers as loaded (before any step
        # swaps their modules for stand-ins)
        self.model.direct_layers()
        if self.eagle_config.draft_vocab:
            from eagle_vllm.models.checkpoint import load_draft_vocab

            ids = load_draft_vocab(self.eagle_config.model)[: self.eagle_config.draft_vocab]
            self.model.use_draft_vocab(ids)
            if self.eagle_config.draft_vocab_context:
                self.context_vocab = ContextVocabulary(self.model.config.vocab_size, ids)

    def draft_layers(self) -> list[nn.Module]:
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
        step = self._step
        assert step is not None, "propose runs inside bound_to(step)"
        batch_size = common_attn_metadata.batch_size()
        cfg = self.eagle_config
        passes, nodes = step.planned_size or (cfg.num_speculative_tokens, cfg.total_tokens)
        nodes = min(nodes, int(num_speculative_tokens) + 1)
        drafting = nodes > 1 and passes > 0  # else the first pass only writes draft KV

        def outputs_only_at(rows: torch.Tensor):
            return self._last_layer_outputs_only_at(rows if drafting else rows[:0])

        # EAGLE-3: the target's layers, concatenated by vLLM's runner, fused by fc
        target_hidden_states = self.model.draft_features(target_hidden_states)
        root_hidden, root_last_hidden, root_positions = self.first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states,
            token_indices_to_sample, common_attn_metadata, num_rejected_tokens_gpu,
            outputs_only_at, drafting,
        )  # fmt: skip
        if not drafting:
            step.drafted, step.drafted_size = None, (0, 1)
            return torch.empty(batch_size, 0, dtype=torch.int64, device=target_hidden_states.device)

        req_ids = step.req_ids[:batch_size]
        temperatures = self._sampling_temperatures(req_ids, sampling_metadata, step)
        suffix = step.suffix_candidates
        if suffix is not None and temperatures is not None:  # sampled chains stay draws from q
            suffix = [None if t > 0 else c for t, c in zip(temperatures.tolist(), suffix)]
        if suffix is not None and not any(c is not None and c.num_nodes > 1 for c in suffix):
            suffix = None
        self._context_columns = self._step_context_columns(req_ids)
        try:
            tree, draft_q, q_token_ids = self.draft_tree(
                root_tokens=next_token_ids[:batch_size].to(torch.int64),
                root_hidden=root_hidden,
                root_last_hidden=root_last_hidden,  # the LM head runs here
                root_positions=root_positions,
                block_table=common_attn_metadata.block_table_tensor[:batch_size],
                nodes=nodes,
                passes=passes,
                temperatures=temperatures,
                suffix=suffix if cfg.suffix is not None and cfg.suffix.expand else None,
                calibration=step.source_calibration,
            )
        finally:
            self._context_columns = None
        step.drafted_size = (passes, nodes)
        if suffix is not None:
            drafts = merge_drafts(step, tree, suffix, nodes, step.source_calibration)
        else:
            step.drafted = DraftedTrees(req_ids=req_ids, tree=tree)
            drafts = None
        step.drafted.passes, step.drafted.nodes = passes, nodes
        if temperatures is not None:
            step.drafted.sampled = temperatures > 0
            step.drafted.draft_q = draft_q
            step.drafted.q_token_ids = q_token_ids
        if drafts is not None:
            return drafts  # one list per request: merged trees differ in size
        num_drafts = nodes - 1
        drafts = tree.tokens[:, 1 : num_drafts + 1]
        if drafts.shape[1] < num_drafts:  # a smaller tree than the slots (never for full trees)
            drafts = torch.nn.functional.pad(drafts, (0, num_drafts - drafts.shape[1]), value=0)
        return drafts.clamp(min=0)

    def first_pass(self, target_token_ids, next_token_ids, target_positions,
                   target_hidden_states, token_indices_to_sample, cad,
                   num_rejected_tokens_gpu, outputs_only_at, drafting: bool):  # fmt: skip
        """The draft over the tokens the target just verified: writes their draft KV and
        returns each request's root (draft feature ``[B, H]``, the LM head's input
        ``[B, H]``, position ``[B]``).

        Decode steps run it with the platform's in-place attention
        (``_first_pass_own_attention``); prefills, and platforms without one, run it as
        vLLM's own EAGLE proposer does (``vllm_surface.first_pass_forward``)."""
        own = self._first_pass_own_attention(
            target_token_ids, next_token_ids, target_positions, target_hidden_states,
            token_indices_to_sample, cad, drafting,
        )  # fmt: skip
        if own is not None:
            return own
        last_hidden, hidden, rows, _ = vllm_surface.first_pass_forward(
            self, outputs_only_at=outputs_only_at,
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample, cad=cad,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )  # fmt: skip
        return hidden[rows], last_hidden[rows], self.positions[rows].to(torch.int64)

    @torch.inference_mode()
    def _first_pass_own_attention(self, target_token_ids, next_token_ids, target_positions,
                                  target_hidden_states, token_indices_to_sample, cad,
                                  drafting: bool):  # fmt: skip
        """The first pass of a decode step without vLLM's input and attention-metadata
        preparation (about 1 ms a step on a 2-core CPU, as much as the pass's own ops):
        each request's rows up to the one sampled from (the accepted path and the bonus
        token; vLLM's pass also runs the rejected rows, whose KV the next step
        overwrites) go through the draft's layers, their attention reading the prefix in
        place from the paged cache (``TreePlatform.prefix_attention``), their K/V written
        to their slots. None where it does not apply: a prompt chunk in the batch (long
        runs: vLLM's causal kernel), a compiled draft, a platform without the attention."""
        batch = cad.batch_size()
        if cad.max_query_len > OWN_FIRST_PASS_MAX_ROWS or vllm_surface.draft_is_compiled(
            self.vllm_config
        ):
            return None
        layers = self.draft_layers()
        attends = self._in_place_attention(layers)
        if attends is None:
            return None
        device = target_hidden_states.device
        # The plan on the host: a decode step has a few rows per request, and in an engine
        # step every op runs with caches the target's forward emptied.
        starts = cad.query_start_loc_cpu[: batch + 1].tolist()
        if token_indices_to_sample is None:
            sampled = [start - 1 for start in starts[1:]]
        else:
            sampled = token_indices_to_sample[:batch].tolist()
        lengths = [last - first + 1 for first, last in zip(starts, sampled)]  # rows kept (>= 1)
        width = max(lengths)
        kept: list[int] = []  # flat rows kept: each request's rows up to its sampled one
        rows: list[int] = []  # [batch, width]: row i of run r (padding repeats the last)
        for first, n in zip(starts, lengths):
            offset = len(kept)
            kept += range(first, first + n)
            rows += [offset + min(i, n - 1) for i in range(width)]
        total = len(kept)
        offsets = [rows[r * width] for r in range(batch)]  # first kept row of each request
        last_rows = [o + n - 1 for o, n in zip(offsets, lengths)]  # the sampled rows
        # input ids shifted by one within each request; the sampled row reads the token
        # the target just sampled (set_inputs_first_pass)
        next_rows = [row + 1 for row in kept]
        for r in last_rows:
            next_rows[r] = kept[r]  # overwritten below
        host = torch.tensor(kept + next_rows + rows + lengths + offsets + last_rows)
        host = host.to(device)
        kept_t, next_t = host[:total], host[total : 2 * total]
        rows_t = host[2 * total : 2 * total + batch * width].view(batch, width)
        lengths_t, offsets_t, sample_rows = host[2 * total + batch * width :].view(3, batch)
        tokens = target_token_ids[next_t]
        tokens[sample_rows] = next_token_ids[:batch].to(tokens.dtype)
        positions = target_positions[kept_t].to(torch.int64)
        features = target_hidden_states[kept_t]
        plan = _RunPlan(
            rows=rows_t,
            num_rows=lengths_t,
            blocks=cad.block_table_tensor[:batch].to(torch.int64),
            prefix_len=positions[offsets_t],
            allowed=self._causal(batch, width, device),
            slots=cad.slot_mapping[kept_t].to(torch.int64),
        )
        shims = [
            _RunAttention(layer.self_attn.attn, attend, plan, self.platform)
            for layer, attend in zip(layers, attends)
        ]
        if not drafting:  # only the KV is wanted: the last layer stops once it is written
            shims[-1].kv_only = True
        # layers run directly take the rows themselves (decode's out_rows)
        trim = contextlib.nullcontext()
        if self.model.direct_layers() is None:
            trim = self._last_layer_outputs_only_at(sample_rows)
        with _swapped_attention(layers, shims), trim, contextlib.suppress(_KVCaptured):
            logit_hidden, hidden = self.model.decode(tokens, features, positions, sample_rows)
            return hidden, logit_hidden, positions[sample_rows]
        empty = target_hidden_states[:0]  # only the KV was written
        return empty, empty, positions[:0]

    def _causal(self, batch: int, width: int, device) -> torch.Tensor:
        """``[batch, width, width]`` bool lower triangles (read only): the first ``batch`` of
        one tensor per width, grown to the largest batch asked for."""
        mask = self._causal_masks.get(width)
        if mask is None or mask.shape[0] < batch:
            mask = torch.ones(batch, width, width, dtype=torch.bool, device=device).tril_()
            self._causal_masks[width] = mask
        return mask[:batch]

    def _sampling_temperatures(
        self, req_ids: list[str], sampling_metadata, step: StepState
    ) -> torch.Tensor | None:
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
            if req_id in step.structured_req_ids:
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
        race = torch.empty_like(q).exponential_(generator=self.draft_rng)
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
        nodes: int,
        passes: int,
        temperatures: torch.Tensor | None = None,
        suffix: list | None = None,
        calibration: torch.Tensor | None = None,
    ) -> tuple[DraftTree, torch.Tensor | None, torch.Tensor | None]:
        """Expand (``passes`` draft passes) and rerank a tree of ``nodes`` nodes per
        request, from the root's draft output. ``temperatures`` [B] (chains only): sample
        each draft from the draft distribution at that temperature (0: argmax).
        ``suffix``: each request's suffix candidates (or None), whose nodes compete with
        the head's for each pass's frontier (``tree.merge.SuffixGuide``; ``calibration``
        the sources' factors, as the merge takes them). Returns
        the trees and, when sampling, q ``[B, passes, V']`` (node j's child distribution)
        over the token ids returned last (None: the full vocabulary)."""
        cfg = self.eagle_config
        batch = root_tokens.shape[0]
        if passes == 1 and temperatures is None:
            # The shape the sizer picks most at batch 1: skip the builder's bookkeeping.
            logprobs, token_ids = self._draft_logprobs(root_last_hidden, 1)
            tree = depth_one_tree(root_tokens, logprobs, cfg.root_topk, nodes, token_ids)
            return tree, None, None
        builder = TreeBuilder(root_tokens, cfg.topk, nodes, passes, root_topk=cfg.root_topk)
        q_rows: list[torch.Tensor] = []
        q_token_ids = None
        guide = None
        if suffix is not None and temperatures is None and passes > 1:
            guide = SuffixGuide(suffix, calibration)

        def expand(logprobs: torch.Tensor, token_ids: torch.Tensor | None) -> None:
            nonlocal q_token_ids, guide
            if temperatures is None:
                offered = None
                if guide is not None and builder.passes_done < passes - 1:
                    offered = guide.offers()  # None: no frontier row on a suffix node
                frontier = builder.step(logprobs, token_ids, offered=offered)
                if offered is None:
                    guide = None
                else:
                    guide.advance(*frontier.host_lists())
                return
            children, q = self._choose_children(logprobs, temperatures)
            q_rows.append(q[:, 0])  # chains: one frontier row per pass
            q_token_ids = token_ids
            builder.step(logprobs, token_ids, children=children)

        def finish() -> tuple[DraftTree, torch.Tensor | None, torch.Tensor | None]:
            if self._step is not None:
                self._step.suffix_nodes_expanded = builder.offered_in_frontier
            draft_q = torch.stack(q_rows, dim=1) if q_rows else None
            return builder.finalize(pad_to=nodes), draft_q, q_token_ids

        expand(*self._draft_logprobs(root_last_hidden, 1))
        if passes == 1:
            return finish()

        layers = self.draft_layers()
        prefix_lens = root_positions + 1  # draft KV at positions <= root's
        shims = self._prefix_attention_shims(
            layers, block_table, prefix_lens, capacity=(passes - 1) * cfg.topk
        )

        max_position = self.max_model_len - 1
        node_hidden = root_hidden[:, None, :]
        with _swapped_attention(layers, shims):
            for depth in range(1, passes):
                frontier = builder.frontier()
                width = frontier.width
                if depth == 1:  # every node's parent is the root
                    parent_hidden = node_hidden.expand(-1, width, -1)
                else:
                    parent_rows = frontier.parent_frontier_index[:, :, None]
                    parent_hidden = torch.gather(
                        node_hidden, 1, parent_rows.expand(-1, -1, node_hidden.shape[-1])
                    )
                # each node attends to its ancestors among the nodes fed so far, and itself
                node_mask = frontier.ancestor_mask
                for shim in shims:
                    shim.mask = node_mask
                # one position per row, contiguous: vLLM's CPU rotary kernel rotates as
                # many rows as it is given positions, leaves the others as they are, and
                # reads the positions as a dense array
                positions = (root_positions[:, None] + depth).clamp(max=max_position)
                logit_hidden, features = self.model.decode(
                    frontier.tokens.reshape(-1),
                    parent_hidden.reshape(batch * width, -1),
                    positions.repeat(1, width).view(-1),
                )
                node_hidden = features.view(batch, width, -1)
                expand(*self._draft_logprobs(logit_hidden, width))
        return finish()

    @torch.inference_mode()
    def forward_runs(self, tokens, features, positions, block_table, starts, mask):
        """The draft layers' K/V over runs of positions (``deferred.py``): run r's
        positions see the draft KV before ``starts[r]`` (paged cache) and the run's
        positions ``mask`` allows. Returns each layer's attention module and the runs' K/V.

        Only K/V are wanted, so the last layer stops once its K/V are known: its
        attention, output projection and MLP, and its prefix read, are skipped (for a
        one-layer head, all but fc and the K/V projection)."""
        device = features.device
        layers = self.draft_layers()
        shims = self._prefix_attention_shims(
            layers[:-1], block_table, starts.to(device), capacity=mask.shape[-1]
        )
        shims.append(_KVOnlyAttention(layers[-1].self_attn.attn, len(block_table)))
        for shim in shims:
            shim.mask = mask
        with _swapped_attention(layers, shims), contextlib.suppress(_KVCaptured):
            self.model.decode(
                tokens.to(device).reshape(-1),
                features.reshape(-1, features.shape[-1]),
                positions.to(device).reshape(-1),
            )
        return [(layer.self_attn.attn, (s.node_k, s.node_v)) for layer, s in zip(layers, shims)]

    @contextlib.contextmanager
    def _last_layer_outputs_only_at(self, rows: torch.Tensor):
        """The first pass reads the draft's output at one row per request (``rows``) but
        writes the KV of every row (a prompt's, or all verified nodes'): the last layer's
        output projection and MLP run on ``rows`` only (other rows' outputs are zeros)."""
        layer = self.draft_layers()[-1]
        attention = layer.self_attn
        o_proj, mlp = attention.o_proj, layer.mlp
        hidden_size = self.model.config.hidden_size
        attention.o_proj = _AtRows(o_proj, rows, hidden_size)
        layer.mlp = _AtRows(mlp, rows, hidden_size)
        try:
            yield
        finally:
            attention.o_proj, layer.mlp = o_proj, mlp

    def _step_context_columns(self, req_ids: list[str]):
        """This step's extra draft columns for the requests' own tokens: (token ids [E],
        LM-head rows [E, H], allowed [B, E]), or None (none used, or none to add). Only
        the rows of columns new since the last step are gathered (the table of columns
        appends between rebuilds); every pass reads them."""
        if self.context_vocab is None:
            return None
        extra, allowed, first_new = self.context_vocab.columns(req_ids)
        if extra.numel() == 0:
            return None
        buffer = self._context_rows
        if buffer is None:
            first_new = 0
        if first_new < len(extra):
            new_rows = self.model.lm_head_rows(extra[first_new:])
            if first_new == 0 or len(buffer) < len(extra):
                grown = new_rows.new_empty(max(256, 2 * len(extra)), new_rows.shape[1])
                if first_new > 0:
                    grown[:first_new] = buffer[:first_new]
                buffer = self._context_rows = grown
            buffer[first_new : len(extra)] = new_rows
        rows = buffer[: len(extra)]
        device = rows.device
        return extra.to(device), rows, allowed.to(device)

    def _draft_logprobs(self, hidden: torch.Tensor, width: int):
        """[B, width, V'] draft log-probs over the drafting vocabulary, and its token ids:
        the head's (reduced) vocabulary, then this step's context columns, each masked
        out of the rows of requests that have not seen that token."""
        logits, token_ids = self.model.draft_logits(hidden)
        logits = logits.float()
        if self._context_columns is not None and token_ids is not None:
            extra, rows, allowed = self._context_columns
            context = torch.nn.functional.linear(hidden.to(rows.dtype), rows).float()
            own = allowed.repeat_interleave(width, dim=0)  # [B * width, E]
            logits = torch.cat([logits, context.masked_fill(~own, float("-inf"))], dim=-1)
            token_ids = torch.cat([token_ids, extra])
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.view(-1, width, logprobs.shape[-1]), token_ids

    def _prefix_attention_shims(
        self,
        layers: list[nn.Module],
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        capacity: int,
    ) -> list[nn.Module]:
        """One attention stand-in per draft layer over each request's draft KV of
        positions ``< prefix_lens`` (the paged cache) and at most ``capacity`` nodes: read
        in place where the platform can
        (``_InPlaceTreeNodeAttention``), else gathered (``_TreeNodeAttention``)."""
        attends = self._in_place_attention(layers)
        batch = len(block_table)
        if attends is not None:
            blocks = block_table.to(torch.int64)
            prefix_lens = prefix_lens.to(torch.int64)
            while len(self._node_buffers) < len(layers):
                self._node_buffers.append(_NodeBuffers(self.dtype, blocks.device))
            return [
                _InPlaceTreeNodeAttention(
                    layer.self_attn.attn, attend, blocks, prefix_lens, batch, capacity, buffers
                )
                for layer, attend, buffers in zip(layers, attends, self._node_buffers)
            ]
        max_prefix = max(1, int(prefix_lens.max()))
        shims = []
        for layer in layers:
            attn = layer.self_attn.attn
            prefix_k, prefix_v = self.platform.gather_prefix_kv(attn, block_table, max_prefix)
            shims.append(_TreeNodeAttention(attn, prefix_k, prefix_v, prefix_lens, batch))
        return shims

    def _in_place_attention(self, layers: list[nn.Module]) -> list | None:
        """The platform's in-place attention of each of ``layers`` (None: not for all)."""
        if self._in_place_attends is None:
            everyone = self.draft_layers()
            self._in_place_attends = [
                self.platform.prefix_attention(layer.self_attn.attn) for layer in everyone
            ]
        attends = self._in_place_attends[: len(layers)]
        return None if any(a is None for a in attends) else attends


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
