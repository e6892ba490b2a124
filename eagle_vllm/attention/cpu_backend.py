"""Tree attention inside vLLM's CPU attention backend (vLLM 0.32, ``CPU_ATTN``).

The CPU kernel (``vllm/v1/attention/backends/cpu_attn.py``) supports causal
masks only. This backend subclasses it: every row is computed by the stock
kernel first, then the rows of tree-shaped requests are recomputed in torch
with their tree mask (prefix from the paged cache + the node's ancestors),
and the tree rows' K/V are captured for KV compaction. It is installed by the
plugin's worker with ``register_backend(AttentionBackendEnum.CPU_ATTN, ...)``,
so only eagle_vllm engines use it, and it behaves exactly like the stock
backend whenever no tree is being verified.
"""

from __future__ import annotations

import contextlib
import threading

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from eagle_vllm.attention.paged_kv import check_cpu_isa, gather_cpu_kv
from eagle_vllm.attention.reference import prefix_tree_attention
from eagle_vllm.attention.tree_batch import TreeBatch

_STATE = threading.local()


@contextlib.contextmanager
def verifying_trees(batch: TreeBatch | None):
    """Tree masks apply to attention calls made inside this context (the target forward)."""
    _STATE.batch = batch
    try:
        yield
    finally:
        _STATE.batch = None


def current_tree_batch() -> TreeBatch | None:
    return getattr(_STATE, "batch", None)


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
        )
        batch = current_tree_batch()
        if batch is None or attn_metadata is None or batch.parents.shape[0] == 0:
            return out
        check_cpu_isa(layer.isa)
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        rows = batch.flat_rows()
        node_k, node_v = k[rows], v[rows]
        batch.captured_kv[layer.layer_name] = (node_k, node_v)
        max_prefix = max(int(batch.root_pos.max()), 1)
        prefix_k, prefix_v = gather_cpu_kv(kv_cache, batch.block_table, max_prefix)
        tree_out = prefix_tree_attention(
            q[rows],
            prefix_k,
            prefix_v,
            batch.root_pos,
            node_k,
            node_v,
            batch.ancestor_mask(),
            self.scale,
        )
        valid = batch.valid()
        out_view = out.view(num_tokens, self.num_heads, self.head_size)
        out_view[rows[valid]] = tree_out[valid].to(out_view.dtype)
        return out


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return TreeCPUAttentionImpl


def install() -> None:
    """Route vLLM's CPU_ATTN backend to the tree-capable subclass (this process only)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(
        AttentionBackendEnum.CPU_ATTN,
        "eagle_vllm.attention.cpu_backend.TreeCPUAttentionBackend",
    )
