"""Tree attention in torch: each query sees its request's prefix plus its tree ancestors.

Served, not only a test oracle: the draft model's attention while the tree is expanded
(``engine/proposer.py``, ``_TreeNodeAttention``), on every platform. It is also the
plainest form of the target's tree attention, and the tests' oracle for the CPU
backend's fused op and torch path (``cpu_backend.py``) and the GPU kernel
(``triton_tree.py``). Inputs are dense: the prefix K/V already gathered from the paged
cache (``TreePlatform.gather_prefix_kv``; ``paged_kv.py`` on CPU) and the tree nodes' K/V
held in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefix_tree_attention(
    query: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_lens: torch.Tensor,
    node_k: torch.Tensor,
    node_v: torch.Tensor,
    node_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Masked attention for a batch of trees.

    Args:
        query: ``[B, Q, Hq, D]``.
        prefix_k, prefix_v: ``[B, P, Hkv, D]``; row b is valid below ``prefix_lens[b]``.
        node_k, node_v: ``[B, M, Hkv, D]`` K/V of tree nodes (may be ``M = 0``).
        node_mask: ``[B, Q, M]`` bool, True where query q may see node m
            (its ancestors and itself).
        scale: softmax scale.

    Returns:
        ``[B, Q, Hq, D]``.
    """
    batch, num_q = query.shape[:2]
    p = prefix_k.shape[1]
    prefix_ok = torch.arange(p, device=query.device)[None, :] < prefix_lens[:, None]
    mask = torch.cat([prefix_ok[:, None, :].expand(batch, num_q, p), node_mask], dim=2)
    keys = torch.cat([prefix_k, node_k], dim=1).transpose(1, 2)
    values = torch.cat([prefix_v, node_v], dim=1).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys.to(query.dtype),
        values.to(query.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=query.shape[2] != keys.shape[1],
    )
    return out.transpose(1, 2)
