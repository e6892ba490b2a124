"""EAGLE-1 draft model for Llama-family targets, built from vLLM layers.

    f_hat_{j+1} = Decoder( fc( [embed(t_{j+1}) ; f_j] ) )      (SafeAILab cnets1.py)

* ``fc``: Linear(2H -> H), with a bias when the checkpoint carries ``fc.bias``
  (SafeAILab's default; stock vLLM 0.32 builds it without one and cannot load it).
* one or more vLLM ``LlamaDecoderLayer``s (paged KV cache, TP-sharded linears);
  layer 0 has no ``input_layernorm``; there is no final norm.
* ``embed_tokens`` and ``lm_head`` are the target's: vLLM's EAGLE loader
  replaces the draft's modules by the target's (frozen, not duplicated).
* optional reduced draft vocabulary (``draft_vocab.py``): the draft's logits are
  computed for a frequency-ranked subset of the target's LM-head rows only.

Written against vLLM 0.32 (vllm/model_executor/models/llama_eagle.py).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

from eagle_vllm.models.checkpoint import inspect_draft_checkpoint
from eagle_vllm.models.direct_layer import DirectLlamaLayer, direct_layers
from eagle_vllm.models.draft_precision import draft_gemm_dtype, run_gemms_in
from eagle_vllm.models.draft_vocab import DraftVocabMixin

ARCHITECTURE = "EagleVllmLlamaForCausalLM"


class EagleVllmLlamaForCausalLM(DraftVocabMixin, EagleLlamaForCausalLM):
    """vLLM's EAGLE Llama head with SafeAILab's fc bias and no attention-bias confusion."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        hf_config = spec.draft_model_config.hf_config
        info = inspect_draft_checkpoint(str(spec.draft_model_config.model))
        # vLLM's LlamaAttention reads `config.bias` as the q/k/v/o bias, while
        # SafeAILab's config.json uses it for the fc bias. Keep them apart.
        hf_config.bias = bool(getattr(hf_config, "attention_bias", False))
        hf_config.eagle_fc_bias = info.fc_bias
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if info.fc_bias:
            old_fc = self.model.fc
            self.model.fc = ReplicatedLinear(
                input_size=hf_config.hidden_size * 2,
                output_size=hf_config.hidden_size,
                bias=True,
                params_dtype=vllm_config.model_config.dtype,
                quant_config=old_fc.quant_config,
                prefix=maybe_prefix(maybe_prefix(prefix, "model"), "fc"),
                return_bias=False,
            )
        # draft_dtype: the draft's own linear layers (not the shared embedding or LM head)
        self.gemm_dtype = draft_gemm_dtype(vllm_config)
        if self.gemm_dtype is not None:
            run_gemms_in(self.gemm_dtype, self.model.modules(), feature_fc=self.model.fc)
        # the decoder layers called directly, without vLLM's module machinery
        self.use_direct_layers = True
        self._direct: list[DirectLlamaLayer] | None = None

    def draft_logits(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the drafting vocabulary and the token id of each column
        (None: the full vocabulary, column = token id). Drafting only ranks tokens, so
        the reduced vocabulary is never scattered back into a full-size row."""
        if self.draft_lm_head is None:
            return super().compute_logits(hidden_states), None
        return self.reduced_draft_logits(hidden_states), self.draft_vocab_ids

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        sub, ids = self.draft_logits(hidden_states)
        return sub if ids is None else self.scatter_draft_logits(sub)

    def draft_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's feature is the draft's (one layer, the last)."""
        return target_features

    def decode(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder over rows of (token, feature, position), layer by layer (the
        drafter swaps each layer's attention for tree attention). Returns the hidden state
        the LM head reads and the feature of the next draft step (the same), at every
        row or at ``out_rows`` only (the last layer's output projection and MLP then run
        at those rows only, where the layers run directly)."""
        x, residual = self.combine_features(input_ids, features), None
        layers = self.model.layers
        direct = self.direct_layers()
        if direct is None:
            for layer in layers:
                x, residual = layer(positions, x, residual)
            if out_rows is not None:
                x, residual = x[out_rows], residual[out_rows]
        else:
            last = len(direct) - 1
            for i, layer in enumerate(direct):
                x, residual = layer(positions, x, residual, out_rows if i == last else None)
        hidden = x + residual
        return hidden, hidden

    def direct_layers(self) -> list[DirectLlamaLayer] | None:
        """The decoder layers' direct forwards (``direct_layer.py``), built on the first
        call, which the drafter makes once the weights are processed and before any step
        swaps a layer's modules for stand-ins; None where they do not apply or are turned
        off (``use_direct_layers``)."""
        if not self.use_direct_layers:
            return None
        if self._direct is None:
            self._direct = direct_layers(list(self.model.layers)) or []
        return self._direct or None

    def combine_features(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([embed(t); f]): the decoder input for a (token, feature) pair."""
        embed = self.model.embed_tokens  # shared with the target
        # With LoRA on, vLLM 0.32 wraps it in VocabParallelEmbeddingWithLoRA, whose
        # forward indexes the target step's token->adapter map; tree rows do not follow
        # that layout. The head drafts with the base embedding (it was trained on it);
        # drafts only need to be good, verification is with the adapter.
        embeds = getattr(embed, "base_layer", embed)(input_ids)
        return self.model.fc(torch.cat((embeds, features), dim=-1))
