"""The EAGLE-1 head in plain torch, for training.

    x      = fc([embed(t_{i+1}) ; f_i])                  (fc: 2H -> H, optional bias)
    h      = x + Attn(x)                                 (no input norm, as SafeAILab)
    f̂_{i+1} = h + MLP(RMSNorm(h))                         (no final norm)
    q      = softmax(lm_head(f̂_{i+1}))                   (the target's lm_head, frozen)

``EagleHead.unroll`` runs the training-time test (as ``train/eagle3.py`` describes it):
step s >= 1 feeds the head's own f̂ back with the true token s further on, attending to
step 0's keys causally and to its own row's earlier steps, as a draft node at depth s+1
does in the plugin's tree drafter.

The same math as vLLM 0.32's ``EagleLlamaForCausalLM`` (one ``LlamaDecoderLayer``
with ``input_layernorm`` removed, neox-style RoPE), and parameter names in
SafeAILab's layout, so ``state_dict()`` is the checkpoint the plugin loads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise NotImplementedError(
            "eagle-vllm train supports targets with plain RoPE (rope_type 'default') only."
        )
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding on ``x [B, heads, L, D]`` at ``positions [B, L]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, L, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: list | None = None
    ) -> torch.Tensor:
        """Causal attention; with ``cache`` (one ``(k, v)`` per unrolled step so far, this
        step's appended), step 0's keys causally and the row's own key at each later step."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, positions, self.theta), apply_rope(k, positions, self.theta)
        gqa = self.heads != self.kv_heads
        if cache is not None:
            cache.append((k, v))
        if cache is None or len(cache) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            keys = torch.cat([kv[0] for kv in cache], dim=2)
            values = torch.cat([kv[1] for kv in cache], dim=2)
            mask = ttt_attention_mask(n, len(cache) - 1, x.device)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


def ttt_attention_mask(n: int, steps: int, device=None) -> torch.Tensor:
    """``[n, n * (steps + 1)]``: row i sees step 0's keys at positions <= i and, in each
    later step's block, only its own key (its ancestors in the draft tree)."""
    eye = torch.eye(n, dtype=torch.bool, device=device)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return torch.cat([causal, *[eye] * steps], dim=1)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict, theta: float):
        super().__init__()
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        self.self_attn = SelfAttention(
            hidden, heads, config.get("num_key_value_heads", heads), head_dim, theta
        )
        self.post_attention_layernorm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
        self.mlp = MLP(hidden, config["intermediate_size"])

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: list | None = None
    ) -> torch.Tensor:
        h = x + self.self_attn(x, positions, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    """Trainable part of an EAGLE-1 head; ``embed``/``lm_head`` are the target's (frozen)."""

    def __init__(self, target_config: dict, *, fc_bias: bool = False):
        super().__init__()
        hidden = target_config["hidden_size"]
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(target_config, rope_theta(target_config))])
        self.reset_parameters(target_config.get("initializer_range", 0.02))

    def reset_parameters(self, std: float) -> None:
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, std)
        # Scale the residual-branch outputs down so the initial head is close to
        # fc(...), as in GPT-2's residual init (depth 1: 1/sqrt(2)).
        for layer in self.layers:
            layer.self_attn.o_proj.weight.data.mul_(1 / math.sqrt(2))
            layer.mlp.down_proj.weight.data.mul_(1 / math.sqrt(2))

    def forward(
        self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``token_embeds``, ``features``: ``[B, L, H]`` (token i+1 with feature i) -> f̂ ``[B, L, H]``."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        for layer in self.layers:
            x = layer(x, positions)
        return x

    def unroll(
        self, embeds_of, tokens: torch.Tensor, features: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """The training-time test over draft positions: ``tokens [B, L]`` (row i holds
        t_{i+1}) and the target's ``features [B, L, H]`` (f_i). Returns each step's f̂
        ``[B, L, H]``: step s at row i takes t_{i+1+s} (``embeds_of`` maps ids to
        embeddings) with step s-1's f̂ at row i, sits at position i+s and predicts
        f_{i+1+s}. Step 0 is :meth:`forward`."""
        b, n = tokens.shape
        base = torch.arange(n, device=tokens.device)[None, :].expand(b, n)
        padded = F.pad(tokens, (0, steps))
        caches: list[list] = [[] for _ in self.layers]
        outputs = []
        for s in range(steps):
            x = self.fc(torch.cat([embeds_of(padded[:, s : s + n]), features], dim=-1))
            for layer, cache in zip(self.layers, caches):
                x = layer(x, base + s, cache)
            outputs.append(x)
            features = x
        return outputs
