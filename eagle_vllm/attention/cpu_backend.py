"""Tree attention inside vLLM's CPU attention backend (vLLM 0.32, ``CPU_ATTN``).

The CPU kernel (``vllm/v1/attention/backends/cpu_attn.py``) supports causal
masks only. This backend subclasses it: the rows of tree-shaped requests are
computed with their tree mask (prefix from the paged cache + the node's
ancestors) by the fused C++ op (``cpu_tree_op.py``, the prefix read in place) or,
where it cannot be built, in torch (the prefix gathered, then SDPA); the other rows
by the stock kernel (skipped when every row is a tree row), and the tree rows' K/V
are captured for KV compaction. The rows, the additive
mask and the block ids are built once per step (``TreeBatch.attention_plan``);
``attention/reference.py`` is the same computation in its plainest form. It is installed by the
plugin's worker (``platform.CPUTreePlatform``), so only eagle_vllm engines use it. The
step's ``TreeBatch`` arrives with the attention metadata vLLM passes every layer
(``vllm_surface.attach_tree_batch``); without one the backend is the stock backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from eagle_vllm.attention import cpu_tree_op
from eagle_vllm.attention.paged_kv import check_cpu_isa, cpu_kv_blocks
from eagle_vllm.vllm_surface import tree_batch_of


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        batch = None if attn_metadata is None else tree_batch_of(attn_metadata)
        if batch is None or batch.parents.shape[0] == 0:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
            )
        check_cpu_isa(layer.isa)
        num_tokens = query.shape[0]
        plan = batch.attention_plan(query.dtype, kv_cache.shape[2])
        if plan.covers(attn_metadata.num_actual_tokens):
            # Every row is a tree row and is computed below: the stock kernel's causal
            # pass over them would be thrown away.
            out = output
        else:
            out = super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
            )
        r, n = batch.parents.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        node_k = key.view(num_tokens, hkv, d).index_select(0, plan.rows).view(r, n, hkv, d)
        node_v = value.view(num_tokens, hkv, d).index_select(0, plan.rows).view(r, n, hkv, d)
        batch.captured_kv[layer.layer_name] = (node_k, node_v)
        # the fused op reads the prefix in place in the 'vec' layouts; AMX's prepacked
        # bf16 blocks go through the torch path
        fused = cpu_tree_op.load() if layer.isa != "amx" else None
        if fused is not None:  # one C++ call: the prefix is read in place from the cache
            fused(
                query.view(num_tokens, hq, d),
                key.view(num_tokens, hkv, d),
                value.view(num_tokens, hkv, d),
                kv_cache,
                plan.rows.view(r, n),
                batch.num_nodes,
                plan.blocks.view(r, plan.num_blocks),
                batch.root_pos,
                batch.ancestor_mask(),  # [R, N, N] bool, built once per step
                self.scale,
                0,  # every node is a query
                out.view(num_tokens, hq * d),
            )
            return out
        # The torch path. index_select, and one copy into place per tensor (the prefix
        # spans whole blocks): on this CPU its cost was mostly copies and per-op overhead
        # (advanced indexing, permute-reshape, cat), not SDPA's arithmetic
        block_k, block_v = cpu_kv_blocks(kv_cache, plan.blocks, layer.isa)  # [blk, H, off, D]
        nb, bs = plan.num_blocks, kv_cache.shape[2]
        span = nb * bs
        keys = torch.empty(r, hkv, span + n, d, dtype=query.dtype)
        values = torch.empty_like(keys)
        keys[:, :, :span].view(r, hkv, nb, bs, d).copy_(
            block_k.view(r, nb, hkv, bs, d).transpose(1, 2)
        )
        values[:, :, :span].view(r, hkv, nb, bs, d).copy_(
            block_v.view(r, nb, hkv, bs, d).transpose(1, 2)
        )
        keys[:, :, span:].copy_(node_k.transpose(1, 2))
        values[:, :, span:].copy_(node_v.transpose(1, 2))
        q = query.view(num_tokens, hq, d).index_select(0, plan.rows).view(r, n, hq, d)
        tree_out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            values,
            attn_mask=plan.mask,
            scale=self.scale,
            enable_gqa=hq != hkv,
        )
        tree_out = tree_out.transpose(1, 2).reshape(r * n, hq * d).to(out.dtype)
        if plan.valid_nodes is not None:  # padding rows repeat the root: leave them out
            tree_out = tree_out.index_select(0, plan.valid_nodes)
        out.view(num_tokens, hq * d).index_copy_(0, plan.valid_rows, tree_out)
        return out


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return TreeCPUAttentionImpl
