"""The int8 draft GEMM (``models/draft_precision.py``): close to the float product, bias
included, any leading shape and float dtype, and the feature fc left in float."""

from __future__ import annotations

import pytest
import torch

from eagle_vllm.config import cpu_has_int8_gemm

pytestmark = pytest.mark.skipif(not cpu_has_int8_gemm(), reason="needs PyTorch's x86 int8 engine")


def test_int8_gemm_is_close_to_the_float_product():
    from eagle_vllm.models.draft_precision import Int8Gemm

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen)
    x = torch.randn(2, 3, 64, generator=gen)
    want = x @ weight.T + bias
    got = Int8Gemm(weight, bias)(x)
    assert got.shape == (2, 3, 96) and got.dtype == torch.float32
    assert (got - want).norm() / want.norm() < 0.02
    # the ranking a draft reads off its logits survives: the same argmax nearly everywhere
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 5 / 6
    half = Int8Gemm(weight)(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    assert (half.float() - x @ weight.T).norm() / (x @ weight.T).norm() < 0.03


def test_int8_gemm_rows_are_scaled_apart():
    """Per-row weight scales: a row a thousand times smaller keeps its precision."""
    from eagle_vllm.models.draft_precision import Int8Gemm

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(2, 64, generator=gen)
    weight[1] *= 1e-3
    x = torch.randn(8, 64, generator=gen)
    got, want = Int8Gemm(weight)(x), x @ weight.T
    small = (got[:, 1] - want[:, 1]).norm() / want[:, 1].norm()
    assert small < 0.02


def test_run_gemms_in_int8_leaves_the_feature_fc_in_float():
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from eagle_vllm.models.draft_precision import _Int8LinearMethod, run_gemms_in

    class Linear(LinearBase):  # a vLLM linear without the parallel state it builds from
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.quant_method = UnquantizedLinearMethod()

    fc, qkv = Linear(), Linear()
    run_gemms_in(torch.qint8, [fc, qkv], feature_fc=fc)
    assert type(fc.quant_method) is UnquantizedLinearMethod
    assert isinstance(qkv.quant_method, _Int8LinearMethod)


def test_int8_linear_adds_the_bias_vllm_passes_and_only_that():
    """A row-parallel layer passes its bias on one rank only: the method must add the
    bias it is given, not the layer's own on every rank."""
    from eagle_vllm.models.draft_precision import _Int8LinearMethod

    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(8, 16, generator=gen), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(8, generator=gen), requires_grad=False)
    bias = layer.bias.data.clone()
    x = torch.randn(3, 16, generator=gen)
    want = x @ layer.weight.data.T
    method = _Int8LinearMethod()
    method.process_weights_after_loading(layer)
    assert layer.weight.numel() == 0  # the float weight is dropped
    without = method.apply(layer, x, None)
    assert (without - want).norm() / want.norm() < 0.02
    assert torch.allclose(method.apply(layer, x, bias), without + bias)
