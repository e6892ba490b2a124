"""The draft's GEMMs in bfloat16 while the target runs in float32 (``draft_dtype``).

Drafting precision cannot break losslessness: the verifier decides with the target's
own distribution, and sees the draft's only as q, computed in float32 from the draft's
logits, or as its argmax. It can only change which tokens are drafted.

At batch 1 a draft pass mostly reads weights: a one-layer SmolLM2 head holds about
17 MB of float32 linear weights and a 4096-row draft LM head another 9 MB. In bf16 that
is half the bytes, and CPUs with AVX-512 BF16 (or AMX) multiply bf16 on their dot-product
units. Only the linear layers change: their weights are stored in bf16, their inputs are
cast to bf16 and their outputs back. Attention, norms, the residual stream and the
draft's KV cache stay in the target's dtype, so the KV layout is the target's.

``draft_dtype`` values: ``model`` (the target's dtype, the default), ``bfloat16``, and
``auto`` (bfloat16 on a CPU with AVX-512 BF16 or AMX when the target runs in float32;
otherwise the target's dtype).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from eagle_vllm.config import eagle_config_of, resolve_draft_dtype


class _CastingGemm:
    """Stores the layer's weight (and bias) in ``dtype`` before vLLM packs it for the
    platform's GEMM, and casts each input to ``dtype`` and the output back."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight.data = layer.weight.data.to(self.dtype)
        if getattr(layer, "bias", None) is not None:
            layer.bias.data = layer.bias.data.to(self.dtype)
        super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        return super().apply(layer, x.to(self.dtype), bias).to(x.dtype)


class _CastingLinearMethod(_CastingGemm, UnquantizedLinearMethod):
    pass


class _CastingLMHeadMethod(_CastingGemm, UnquantizedEmbeddingMethod):
    pass


def run_gemms_in(dtype: torch.dtype, modules: Iterable[nn.Module], lm_head=None) -> None:
    """Make every unquantized linear layer among ``modules`` (and ``lm_head``, a draft-
    owned LM head) multiply in ``dtype``. Call before the weights are loaded: the
    conversion happens when vLLM processes them."""
    for module in modules:
        if isinstance(module, LinearBase) and type(module.quant_method) is UnquantizedLinearMethod:
            module.quant_method = _CastingLinearMethod(dtype)
    if lm_head is not None and type(lm_head.quant_method) is UnquantizedEmbeddingMethod:
        lm_head.quant_method = _CastingLMHeadMethod(dtype)


def draft_gemm_dtype(vllm_config) -> torch.dtype | None:
    """The dtype of the draft's GEMMs for this engine (None: the model's)."""
    cfg = eagle_config_of(vllm_config)
    if cfg is None:
        return None
    return resolve_draft_dtype(
        cfg.draft_dtype, vllm_config.model_config.dtype, vllm_config.device_config.device_type
    )
