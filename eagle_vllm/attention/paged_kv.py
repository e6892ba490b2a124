"""Read K/V out of vLLM's paged KV cache into dense tensors.

vLLM 0.32's CPU backend (``vllm/v1/attention/backends/cpu_attn.py``) stores a
cache tensor of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
but packs each (block, head) as a K region then a V region, laid out by the
attention ISA its metadata builder picks (``_get_attn_isa``):

* ``vec`` / ``vec16`` (fp32 anywhere; bf16 without AMX): K transposed
  (``[head_size][block_size]``), V row-major (``[block_size][head_size]``);
* ``amx`` (bf16 on CPUs with AMX tiles, block size a multiple of 32): K as
  ``[block_size/16][head_size/2][16 tokens][2 dims]``, V as
  ``[head_size/16][block_size/2][16 dims][2 tokens]`` (pairs packed for AMX's bf16
  dot products). vLLM's writer for it runs on any AVX-512 CPU, so the layout is tested
  everywhere (``tests/unit/test_paged_kv.py``).

Other ISAs (NEON, ...) are refused with a clear error rather than read wrongly.
"""

from __future__ import annotations

import torch

SUPPORTED_CPU_ISAS = ("vec", "vec16", "amx")


def check_cpu_isa(isa: str) -> None:
    if isa not in SUPPORTED_CPU_ISAS:
        raise NotImplementedError(
            f"eagle_vllm reads the CPU KV cache in the '{'/'.join(SUPPORTED_CPU_ISAS)}' "
            f"layouts only; this machine's attention ISA is '{isa}'. "
            "Fix: run with dtype float32, or use method 'eagle' through vLLM's "
            "built-in proposer on this machine."
        )


def cpu_kv_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, isa: str = "vec"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V ``[len(block_ids), num_kv_heads, block_size, head_size]`` of these
    blocks of a CPU cache written in ``isa``'s layout."""
    check_cpu_isa(isa)
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    packed = kv_cache.view(nb, h, 2, bs * d)
    k = packed[:, :, 0].index_select(0, block_ids)
    v = packed[:, :, 1].index_select(0, block_ids)
    n = k.shape[0]
    if isa == "amx":
        k = k.view(n, h, bs // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)
        v = v.view(n, h, d // 16, bs // 2, 16, 2).permute(0, 1, 3, 5, 2, 4)
        return k.reshape(n, h, bs, d), v.reshape(n, h, bs, d)
    return k.view(n, h, d, bs).transpose(2, 3), v.view(n, h, bs, d)


def cpu_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``K[blk, head, dim, off]`` and ``V[blk, head, off, dim]`` of a CPU cache in
    the ``vec`` layouts."""
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
    isa: str = "vec",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V ``[B, max_len, num_kv_heads, head_size]`` for each block-table row
    of a cache written in ``isa``'s layout.

    Positions at or past a request's own length hold whatever the cache has
    there; callers mask them.
    """
    bs = kv_cache.shape[2]
    num_blocks = max(1, -(-max_len // bs))
    blocks = block_table[:, :num_blocks].long()
    batch = blocks.shape[0]
    k, v = cpu_kv_blocks(kv_cache, blocks.reshape(-1), isa)  # [B*nblk, H, bs, D]
    h, d = k.shape[1], k.shape[3]
    # [B, nblk, H, bs, D] -> [B, nblk, bs, H, D]
    keys = k.view(batch, num_blocks, h, bs, d).permute(0, 1, 3, 2, 4)
    values = v.view(batch, num_blocks, h, bs, d).permute(0, 1, 3, 2, 4)
    keys = keys.reshape(batch, num_blocks * bs, h, d)
    values = values.reshape(batch, num_blocks * bs, h, d)
    return keys[:, :max_len], values[:, :max_len]
