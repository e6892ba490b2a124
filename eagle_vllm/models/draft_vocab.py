"""A reduced drafting vocabulary over a full-vocabulary LM head (FR-Spec style).

For a head whose LM head covers the whole vocabulary (an EAGLE-1 head, which shares the
target's; an EAGLE-3 head exported with ``--share-lm-head``), ``draft_vocab: N`` drafts
over the N most frequent tokens of the head's ``draft_vocab.json`` only: the rows are
copied once, and a draft pass multiplies by N rows instead of the whole vocabulary's. For
a small target the LM head is most of a draft pass. It stays lossless: verification only
ever sees the draft's true distribution q (zero outside the subset) or its argmax.
"""

from __future__ import annotations

import torch


class DraftVocabMixin:
    """The reduced LM head of a vLLM draft model with ``lm_head`` (over the whole
    vocabulary), ``config.vocab_size`` and ``gemm_dtype`` (the draft's GEMM dtype, None:
    the model's): ``use_draft_vocab`` copies the rows once, ``reduced_draft_logits``
    computes logits over them, ``scatter_draft_logits`` spreads those over the vocabulary.
    The model's own ``draft_logits`` chooses between these and its full head."""

    draft_lm_head: torch.Tensor | None = None
    draft_vocab_ids: torch.Tensor | None = None
    _draft_head_gemm = None

    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """A copy of the LM head's rows of ``token_ids`` ``[n, H]``, whole on every rank:
        under tensor parallelism each rank holds a slice of the vocabulary, so the rows
        are summed over ranks (one all-reduce; every rank must ask for the same ids)."""
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.distributed import tensor_model_parallel_all_reduce as all_reduce

        weight = self.lm_head.weight
        ids = token_ids.to(device=weight.device, dtype=torch.int64)
        shard = self.lm_head.shard_indices  # this rank's slice of the vocabulary
        local = (ids >= shard.org_vocab_start_index) & (ids < shard.org_vocab_end_index)
        rows = torch.zeros(ids.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device)
        rows[local] = weight[ids[local] - shard.org_vocab_start_index].detach()
        if get_tensor_model_parallel_world_size() > 1:
            rows = all_reduce(rows)  # each row is non-zero on exactly one rank
        return rows

    def use_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft over ``token_ids`` only; the LM-head rows are copied (replicated on TP ranks)."""
        ids = token_ids.to(device=self.lm_head.weight.device, dtype=torch.int64)
        rows = self.lm_head_rows(ids)
        # in the draft's GEMM dtype if it is a float one (int8 leaves the LM head alone)
        bf16 = self.gemm_dtype is not None and self.gemm_dtype.is_floating_point
        self.draft_lm_head = rows.to(self.gemm_dtype) if bf16 else rows
        self.draft_vocab_ids = ids
        self._draft_head_gemm = platform_gemm(self.draft_lm_head)

    def reduced_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over ``draft_vocab_ids`` (``use_draft_vocab`` was called)."""
        return self._draft_head_gemm(hidden_states)

    def scatter_draft_logits(self, sub: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from the reduced ones: -inf outside the subset."""
        logits = sub.new_full((sub.shape[0], self.config.vocab_size), float("-inf"))
        logits[:, self.draft_vocab_ids] = sub
        return logits


def platform_gemm(weight: torch.Tensor):
    """x -> x @ weight.T with the GEMM vLLM would pick for a linear layer on this platform
    (on CPU: oneDNN, SGL or torch, by ISA and dtype; 0.32's dispatch_cpu_unquantized_gemm),
    in the weight's dtype; the result comes back in x's."""
    if weight.device.type != "cpu":
        return lambda x: torch.nn.functional.linear(x.to(weight.dtype), weight).to(x.dtype)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    return lambda x: holder.cpu_linear(x.to(weight.dtype), holder.weight, None).to(x.dtype)
