"""A draft decoder layer's forward as a flat sequence of calls: what a draft pass runs.

At batch 1 a draft pass multiplies a few rows by a few megabytes of weights, and besides
reading them its cost is the count of calls it makes, each of them with caches the
target's forward emptied (BENCHMARKS.md, "What bounds a draft pass"): every module call
goes through ``nn.Module.__call__``, every vLLM linear through its ``forward`` (TP
split, bias and tuple handling), every custom op through its dispatcher. Here a vLLM
``LlamaDecoderLayer`` runs as the same kernels called directly:

* each linear layer's own ``quant_method.apply`` (so ``draft_dtype``'s bf16 and int8
  GEMMs, and vLLM's CPU GEMM, are the ones used);
* each custom op's platform implementation, as vLLM dispatched it
  (``vllm_surface.custom_op_impl``): RMSNorm, rotary embedding, SiLU-and-mul;
* the attention module the layer holds at call time, so the drafter's stand-ins
  (tree attention, the first pass's in-place attention) are called as before.

The outputs are the layer's own, bit for bit
(``tests/integration/test_first_pass_rows.py::test_direct_layers_match_vllms_modules``).
``out_rows`` runs the layer's output projection and MLP at those rows only, for a pass
that needs every row's K/V but a few rows' outputs (the first pass of a decode step).

Only a plain single-rank layer qualifies (``direct_layer``): under tensor parallelism
the row-parallel linears all-reduce, and with LoRA or a quantization method the modules
are not plain linears; those run through vLLM's modules as before.

Written against vLLM 0.32 (vllm/model_executor/models/llama.py, ``LlamaDecoderLayer``).
"""

from __future__ import annotations

import torch
from torch import nn

from eagle_vllm import vllm_surface


class DirectLlamaLayer:
    """``layer(positions, x, residual)`` of a vLLM ``LlamaDecoderLayer``, without the module
    machinery; see the module docstring. Build with ``direct_layer``."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        norm = layer.input_layernorm
        self.input_norm = (
            None if isinstance(norm, nn.Identity) else vllm_surface.custom_op_impl(norm)
        )
        self.post_norm = vllm_surface.custom_op_impl(layer.post_attention_layernorm)
        self.qkv = vllm_surface.linear_impl(attn.qkv_proj)
        self.o_proj = vllm_surface.linear_impl(attn.o_proj)
        self.gate_up = vllm_surface.linear_impl(mlp.gate_up_proj)
        self.down = vllm_surface.linear_impl(mlp.down_proj)
        self.rotary = vllm_surface.custom_op_impl(attn.rotary_emb)
        self.act = vllm_surface.custom_op_impl(mlp.act_fn)
        self.split = [attn.q_size, attn.kv_size, attn.kv_size]

    def __call__(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        out_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = x if self.input_norm is None else self.input_norm(x)
        else:
            assert self.input_norm is not None, "a layer without input norm comes first"
            h, residual = self.input_norm(x, residual)
        q, k, v = self.qkv(h).split(self.split, dim=-1)
        q, k = self.rotary(positions, q, k)
        out = self.layer.self_attn.attn(q, k, v)  # the drafter's stand-in, when swapped
        if out_rows is not None:
            out, residual = out[out_rows], residual[out_rows]
        h, residual = self.post_norm(self.o_proj(out), residual)
        return self.down(self.act(self.gate_up(h))), residual


def direct_layer(layer: nn.Module) -> DirectLlamaLayer | None:
    """The direct forward of ``layer``, or None where it does not apply: not a plain
    Llama decoder layer on one rank, with plain linears, SiLU and no q/k norm."""
    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return None
    needed = (
        (attn, ("qkv_proj", "o_proj", "rotary_emb", "attn", "q_size", "kv_size")),
        (mlp, ("gate_up_proj", "down_proj", "act_fn")),
        (layer, ("input_layernorm", "post_attention_layernorm")),
    )
    if not all(hasattr(owner, name) for owner, names in needed for name in names):
        return None
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(vllm_surface.is_plain_linear(lin) for lin in linears):
        return None
    ops: list[nn.Module] = [layer.post_attention_layernorm, attn.rotary_emb]
    if not isinstance(layer.input_layernorm, nn.Identity):
        ops.append(layer.input_layernorm)
    if not all(vllm_surface.custom_op_impl(op) is not None for op in ops):
        return None
    if not vllm_surface.is_silu_and_mul(mlp.act_fn):
        return None
    return DirectLlamaLayer(layer)


def direct_layers(layers: list[nn.Module]) -> list[DirectLlamaLayer] | None:
    """Every layer's direct forward, or None if one of them has none."""
    direct = [direct_layer(layer) for layer in layers]
    return None if any(d is None for d in direct) else direct
