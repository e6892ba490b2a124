"""Read K/V out of vLLM's paged KV cache into dense tensors.

vLLM 0.32's CPU backend (``vllm/v1/attention/backends/cpu_attn.py``) stores a
cache tensor of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
but packs each (block, head) as a K region then a V region. With the ``vec``
ISA, K is stored transposed (``[head_size][block_size]``) and V row-major
(``[block_size][head_size]``). Other ISAs (AMX, NEON) prepack differently and
are refused with a clear error rather than read wrongly.
"""

from __future__ import annotations

import torch

SUPPORTED_CPU_ISAS = ("vec", "vec16")


def check_cpu_isa(isa: str) -> None:
    if isa not in SUPPORTED_CPU_ISAS:
        raise NotImplementedError(
            f"eagle_vllm reads the CPU KV cache in the '{'/'.join(SUPPORTED_CPU_ISAS)}' "
            f"layouts only; this machine's attention ISA is '{isa}'. "
            "Fix: run with dtype float32, or use method 'eagle' through vLLM's "
            "built-in proposer on this machine."
        )


def cpu_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``K[blk, head, dim, off]`` and ``V[blk, head, off, dim]`` of a CPU cache."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    packed = kv_cache.view(nb, h, 2, bs * d)
    k_t = packed[:, :, 0].view(nb, h, d, bs)
    v = packed[:, :, 1].view(nb, h, bs, d)
    return k_t, v


def gather_cpu_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V ``[B, max_len, num_kv_heads, head_size]`` for each block-table row.

    Positions at or past a request's own length hold whatever the cache has
    there; callers mask them.
    """
    k_t, v = cpu_kv_views(kv_cache)
    bs = kv_cache.shape[2]
    num_blocks = max(1, -(-max_len // bs))
    blocks = block_table[:, :num_blocks].long()
    batch = blocks.shape[0]
    # [B, nblk, H, D, bs] -> [B, nblk, bs, H, D]
    keys = k_t[blocks].permute(0, 1, 4, 2, 3).reshape(batch, num_blocks * bs, *k_t.shape[1:3])
    values = (
        v[blocks].permute(0, 1, 3, 2, 4).reshape(batch, num_blocks * bs, v.shape[1], v.shape[3])
    )
    return keys[:, :max_len], values[:, :max_len]
