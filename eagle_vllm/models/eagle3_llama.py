"""EAGLE-3 draft model for Llama-family targets: vLLM's own, with the drafter's interface.

    g_j       = fc( [a_j ; b_j ; c_j] )                     (features of 3 target layers)
    h_{j+1}   = Decoder( [norm(embed(t_{j+1})) ; hidden_norm(g_j)] )   (q/k/v take 2H)
    logits    = lm_head( norm(h_{j+1}) )  over the draft vocabulary, mapped by d2t

Deeper draft steps feed back the decoder's pre-norm output as the next feature (as
vLLM's ``eagle3`` chain and SafeAILab's EAGLE-3 do). The layers, weights, ``d2t`` and
both checkpoint layouts (``speculators``, SafeAILab ``midlayer.*``) are vLLM 0.32's
``Eagle3LlamaForCausalLM`` (vllm/model_executor/models/llama_eagle3.py); this class
adds what the plugin's drafter calls on any head:

* ``draft_features``: the target's auxiliary features -> the draft's feature (``fc``);
* ``decode``: the decoder layers over (token, feature) rows, called layer by layer
  (the drafter swaps each layer's attention for tree attention);
* ``draft_logits``: logits over the draft vocabulary and the target id of each column.
  Drafting only ranks tokens, so the reduced vocabulary is never scattered back into a
  full row; the verifier sees the draft's true distribution q (zero outside the draft
  vocabulary) or its argmax, so it stays lossless. A head without a ``d2t`` map (one
  that shares the target's LM head) can draft over a frequency-ranked subset of it
  instead (``draft_vocab``, ``draft_vocab.py``).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

from eagle_vllm.models.draft_precision import draft_gemm_dtype, run_gemms_in
from eagle_vllm.models.draft_vocab import DraftVocabMixin

ARCHITECTURE3 = "EagleVllmEagle3LlamaForCausalLM"


class EagleVllmEagle3LlamaForCausalLM(DraftVocabMixin, Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 Llama head with the interface of the plugin's drafter."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._column_ids: torch.Tensor | None = None
        # draft_dtype: the head's linear layers and its own LM head (vLLM swaps in the
        # target's when the checkpoint has none, and that one stays in the target's dtype)
        self.gemm_dtype = draft_gemm_dtype(vllm_config)
        if self.gemm_dtype is not None:
            run_gemms_in(
                self.gemm_dtype, self.model.modules(), lm_head=self.lm_head,
                feature_fc=getattr(self.model, "fc", None),
            )  # fmt: skip

    def draft_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """[N, n*H] concatenated target layers -> [N, H] draft feature."""
        return self.combine_hidden_states(target_features)

    def decode(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder over rows of (token, feature, position). Returns the hidden state
        the LM head reads and the feature of the next draft step, at every row or at
        ``out_rows`` only."""
        embed = self.model.embed_tokens  # may be the target's (shared when not in the head)
        # With LoRA on, vLLM 0.32 wraps the shared embedding in VocabParallelEmbeddingWithLoRA,
        # whose forward indexes the target step's token->adapter map; tree rows do not follow
        # that layout. The head drafts with the base embedding (it was trained on it).
        embeds = getattr(embed, "base_layer", embed)(input_ids)
        x, residual = features, None
        for layer in self.model.layers:
            x, residual = layer(positions=positions, embeds=embeds, hidden_states=x,
                                residual=residual)  # fmt: skip
        if out_rows is not None:
            x, residual = x[out_rows], residual[out_rows]
        normed, prenorm = self.model.norm(x, residual)
        return normed, (normed if self.model.norm_output else prenorm)

    def direct_layers(self) -> None:
        """EAGLE-3 layers (2H attention input) run through vLLM's modules only."""
        return None

    def draft_logits(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the draft vocabulary and the target token id of each column
        (None: the full vocabulary, column = token id)."""
        if self.draft_lm_head is not None:  # draft_vocab over a shared (full) LM head
            return self.reduced_draft_logits(hidden_states), self.draft_vocab_ids
        logits = self.logits_processor(self.lm_head, hidden_states)
        if self.draft_id_to_target_id is None:
            return logits, None
        if self._column_ids is None or self._column_ids.device != logits.device:
            base = torch.arange(self.config.draft_vocab_size, device=logits.device)
            self._column_ids = base + self.draft_id_to_target_id.to(logits.device)
        return logits, self._column_ids

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.draft_lm_head is None:
            return super().compute_logits(hidden_states)
        return self.scatter_draft_logits(self.reduced_draft_logits(hidden_states))
