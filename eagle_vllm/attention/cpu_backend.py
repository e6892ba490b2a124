"""Tree attention inside vLLM's CPU attention backend (vLLM 0.32, ``CPU_ATTN``).

The CPU kernel (``vllm/v1/attention/backends/cpu_attn.py``) supports causal
masks only. This backend subclasses it: every row is computed by the stock
kernel first, then the rows of tree-shaped requests are recomputed in torch
with their tree mask (prefix from the paged cache + the node's ancestors),
and the tree rows' K/V are captured for KV compaction. The rows, the additive
mask and the block ids are built once per step (``TreeBatch.attention_plan``);
``attention/reference.py`` is the same computation in its plainest form. It is installed by the
plugin's worker with ``register_backend(AttentionBackendEnum.CPU_ATTN, ...)``,
so only eagle_vllm engines use it, and it behaves exactly like the stock
backend whenever no tree is being verified.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from eagle_vllm.attention.paged_kv import check_cpu_isa, cpu_kv_views
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
        plan = batch.attention_plan(query.dtype, kv_cache.shape[2])
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        node_k, node_v = k[plan.rows], v[plan.rows]  # [R, N, Hkv, D]
        batch.captured_kv[layer.layer_name] = (node_k, node_v)
        # prefix K/V straight into SDPA's [R, Hkv, P, D] layout (one copy per layer)
        k_t, v_blocks = cpu_kv_views(kv_cache)
        r, p, d = plan.blocks.shape[0], plan.prefix_len, self.head_size
        prefix_k = k_t[plan.blocks].permute(0, 2, 1, 4, 3).reshape(r, self.num_kv_heads, -1, d)
        prefix_v = v_blocks[plan.blocks].permute(0, 2, 1, 3, 4).reshape(r, self.num_kv_heads, -1, d)
        keys = torch.cat([prefix_k[:, :, :p].to(q.dtype), node_k.transpose(1, 2)], dim=2)
        values = torch.cat([prefix_v[:, :, :p].to(q.dtype), node_v.transpose(1, 2)], dim=2)
        tree_out = F.scaled_dot_product_attention(
            q[plan.rows].transpose(1, 2),
            keys,
            values,
            attn_mask=plan.mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2)
        out_view = out.view(num_tokens, self.num_heads, self.head_size)
        out_view[plan.valid_rows] = tree_out[plan.valid].to(out_view.dtype)
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
