"""Tree attention over vLLM's paged KV cache on GPU, as a Triton kernel.

Written against **vLLM 0.32** (``vllm/v1/attention/backends/triton_attn.py`` and
``flash_attn.py``). This is the GPU counterpart of the CPU path
(``cpu_backend.py``); its oracle is ``reference.prefix_tree_attention``.

KV cache layout
    vLLM 0.32 hands every attention backend (TRITON_ATTN and FLASH_ATTN alike) one
    tensor per layer of *logical* shape ``[num_blocks, num_kv_heads, block_size,
    2 * head_size]``: the last axis holds K (``[:head_size]``) then V
    (``[head_size:]``). Its physical stride order is a ``KVCacheLayout``
    (``vllm/v1/kv_cache_layout.py``; default ``LBNHC``, i.e. NHD, others
    ``LBHNC``/HND and the layer-interleaved ``BL..`` orders). Both backends read it
    as ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``, i.e. K and V views of
    shape ``[num_blocks, block_size, num_kv_heads, head_size]``; this kernel does the
    same and reads them through their strides, so every stride order works as long
    as the head axis of the content is contiguous (stride 1).
    Also accepted: an explicit ``(key_cache, value_cache)`` pair of such 4D views
    (e.g. ``(kv[0], kv[1])`` of a legacy ``[2, num_blocks, block_size, H, D]``
    cache). Refused with ``NotImplementedError``: 5D tensors (split them into that
    pair), quantized caches (fp8 and the ``*_per_token_head`` modes, whose content
    axis is not ``2 * head_size``), and a K/V dtype other than the query's.

Mask semantics
    Tree ``r`` has ``num_nodes[r]`` nodes (node 0 = root, the last accepted token).
    Node ``j`` sits in the cache at sequence position ``root_pos[r] + j`` (the nodes
    are laid out linearly after the prefix; their *rotary* positions are
    ``root_pos + depth``, which only matters to whoever computed Q/K). Query node
    ``i`` of tree ``r`` sees every cache position ``< root_pos[r]`` (the prefix;
    ``root_pos`` may be 0) and the positions ``root_pos[r] + j`` whose bit ``j`` is
    set in ``ancestor_bits[r, i]`` (its ancestors and itself). Bit ``j`` is bit
    ``j % 32`` of the int32 word ``ancestor_bits[r, i, j // 32]``; build the words
    with :func:`ancestor_bits_from_parents` or :func:`pack_ancestor_mask`. Trees have
    at most ``MAX_TREE_NODES`` (256) nodes, root included (vLLM 0.32 verifies at most
    128 drafts per step).

Kernel
    One program per (tile of nodes, tree, kv head); its rows are (node, query head of
    that kv head's GQA group) pairs, so a K/V tile is loaded once per group. It runs a
    flash-attention online softmax (fp32 accumulators, ``exp2``) over the prefix, read
    block by block through the block table, then over the tree nodes with the bit mask.
    dtypes fp32 / fp16 / bf16 (fp32 dots in IEEE precision, not TF32), any head size up
    to 256 (padded to a power of two, at least 16), power-of-two block sizes. There is
    no split over the prefix yet: with few trees and kv heads, long prefixes run on few
    programs (see ``benchmarks/micro/tree_attention_gpu.py``).

Everything but :func:`tree_paged_attention` is pure torch; triton is imported only
when the kernel is first called, so this module imports on machines without it.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from eagle_vllm.tree.layout import ancestor_mask_from_parents

BITS_PER_WORD = 32
MAX_TREE_NODES = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_SIZE = 256


# --------------------------------------------------------------------------- masks
def num_mask_words(num_nodes: int) -> int:
    """int32 words per node row for a tree of ``num_nodes`` nodes (root included)."""
    if num_nodes > MAX_TREE_NODES:
        raise ValueError(
            f"tree attention supports trees of at most {MAX_TREE_NODES} nodes (root "
            f"included), got {num_nodes}. Fix: lower total_tokens in the speculative config."
        )
    return max(1, -(-num_nodes // BITS_PER_WORD))


def pack_ancestor_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bit-pack a bool mask ``[R, N, M]`` into int32 words ``[R, N, ceil(M / 32)]``.

    Bit ``j % 32`` of word ``j // 32`` of row ``(r, i)`` is ``mask[r, i, j]``.
    """
    if mask.dim() != 3 or mask.dtype != torch.bool:
        raise ValueError(f"expected a bool mask [R, N, M], got {mask.dtype} {tuple(mask.shape)}")
    r, n, m = mask.shape
    words = num_mask_words(m)
    padded = F.pad(mask, (0, words * BITS_PER_WORD - m)).view(r, n, words, BITS_PER_WORD)
    weights = torch.ones(BITS_PER_WORD, dtype=torch.int64, device=mask.device)
    weights <<= torch.arange(BITS_PER_WORD, dtype=torch.int64, device=mask.device)
    packed = (padded.to(torch.int64) * weights).sum(-1)  # in [0, 2**32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's complement
    return packed.to(torch.int32)


def unpack_ancestor_bits(bits: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Inverse of :func:`pack_ancestor_mask`: int32 ``[R, N, W]`` -> bool ``[R, N, num_keys]``."""
    r, n, w = bits.shape
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int64, device=bits.device)
    flat = (bits.to(torch.int64)[..., None] >> shifts) & 1
    return flat.view(r, n, w * BITS_PER_WORD)[..., :num_keys].bool()


def ancestor_bits_from_parents(
    parents: torch.Tensor, num_nodes: torch.Tensor | None = None
) -> torch.Tensor:
    """Bit-packed ancestor-or-self mask ``[R, N, ceil(N / 32)]`` int32 from ``parents [R, N]``."""
    num_mask_words(parents.shape[1])  # size check first
    return pack_ancestor_mask(ancestor_mask_from_parents(parents, num_nodes))


# --------------------------------------------------------------------------- kernel
def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


@functools.cache
def _kernel():
    """Import triton and define the kernel, once, on first use.

    The kernel and its helper become module globals (triton resolves the names a
    kernel uses through its module's globals; its interpreter ignores closures), so
    this module stays importable, and its mask helpers usable, without triton.
    """
    global triton, tl, _attend, _tree_attention_kernel
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "eagle_vllm.attention.triton_tree.tree_paged_attention needs triton "
            "(it comes with CUDA builds of torch / vLLM). On CPU use "
            "eagle_vllm.attention.cpu_backend; to test the kernel on CPU install triton "
            "into a side folder (`make setup` does: .triton-pkgs) and run with "
            "PYTHONPATH=.triton-pkgs TRITON_INTERPRET=1."
        ) from exc

    @triton.jit
    def _attend(
        acc,
        m_i,
        l_i,
        q,
        K,
        V,
        bt_row,
        kv_head,
        pos,
        pos_ok,
        visible,
        offs_d,
        d_ok,
        scale_log2,
        stride_kb,
        stride_kn,
        stride_kh,
        stride_vb,
        stride_vn,
        stride_vh,
        BLOCK_SIZE: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """One online-softmax step over the keys at cache positions ``pos``."""
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        k_ptrs = (
            K
            + block[None, :] * stride_kb
            + slot[None, :] * stride_kn
            + kv_head * stride_kh
            + offs_d[:, None]
        )
        k_t = tl.load(k_ptrs, mask=d_ok[:, None] & pos_ok[None, :], other=0.0)  # [D, BK]
        if UPCAST:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision="ieee") * scale_log2  # [BM, BK], log2 units
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = (
            V
            + block[:, None] * stride_vb
            + slot[:, None] * stride_vn
            + kv_head * stride_vh
            + offs_d[None, :]
        )
        v = tl.load(v_ptrs, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)  # [BK, D]
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        return acc, m_new, l_i

    @triton.jit
    def _tree_attention_kernel(
        Q,
        K,
        V,
        Out,
        BlockTable,
        RootIndex,
        RootPos,
        NumNodes,
        Bits,
        scale_log2,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_kn,
        stride_kh,
        stride_vb,
        stride_vn,
        stride_vh,
        stride_bt,
        stride_bits_r,
        stride_bits_n,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_NODES: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # one program: a tile of BLOCK_NODES nodes of tree `tree`, the GROUP query heads
        # that share kv head `kv_head`; rows are (node, head-in-group) pairs.
        tile = tl.program_id(0)
        tree = tl.program_id(1)
        kv_head = tl.program_id(2)
        n_nodes = tl.load(NumNodes + tree).to(tl.int32)
        if tile * BLOCK_NODES >= n_nodes:
            return
        root_pos = tl.load(RootPos + tree).to(tl.int32)
        root_row = tl.load(RootIndex + tree).to(tl.int64)
        BLOCK_M: tl.constexpr = BLOCK_NODES * GROUP_PAD

        offs_m = tl.arange(0, BLOCK_M)
        node = tile * BLOCK_NODES + offs_m // GROUP_PAD
        head = kv_head * GROUP + offs_m % GROUP_PAD
        row_ok = (node < n_nodes) & (offs_m % GROUP_PAD < GROUP)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        offs_k = tl.arange(0, BLOCK_K)

        token = root_row + node.to(tl.int64)
        q_ptrs = Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        # finite start: a tile a row cannot see leaves it unchanged (no inf - inf)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        bt_row = BlockTable + tree.to(tl.int64) * stride_bt

        # 1) the prefix: positions [0, root_pos), visible to every node
        for start in range(0, root_pos, BLOCK_K):
            pos = start + offs_k
            pos_ok = pos < root_pos
            visible = row_ok[:, None] & pos_ok[None, :]
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, K, V, bt_row, kv_head, pos, pos_ok, visible, offs_d, d_ok,
                scale_log2, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                BLOCK_SIZE, UPCAST,
            )  # fmt: skip

        # 2) the tree: node j at position root_pos + j, visible where bit j of the row is set
        bits_row = Bits + tree.to(tl.int64) * stride_bits_r + node[:, None] * stride_bits_n
        for start in range(0, n_nodes, BLOCK_K):
            j = start + offs_k
            j_ok = j < n_nodes
            words = tl.load(
                bits_row + (j // 32)[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0
            )
            visible = ((words >> (j % 32)[None, :]) & 1) != 0
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, K, V, bt_row, kv_head, root_pos + j, j_ok, visible, offs_d,
                d_ok, scale_log2, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
                stride_vh, BLOCK_SIZE, UPCAST,
            )  # fmt: skip

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = Out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return _tree_attention_kernel


def _split_kv_cache(kv_cache, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)`` views ``[num_blocks, block_size, num_kv_heads, head_size]``."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError("kv_cache as a sequence must be (key_cache, value_cache)")
        key_cache, value_cache = kv_cache
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.dim() != 4 or t.shape[-1] != head_size:
                raise ValueError(
                    f"{name} must be [num_blocks, block_size, num_kv_heads, {head_size}], "
                    f"got {tuple(t.shape)}"
                )
        if key_cache.shape != value_cache.shape:
            raise ValueError(
                f"key_cache {tuple(key_cache.shape)} and value_cache "
                f"{tuple(value_cache.shape)} differ"
            )
        return key_cache, value_cache
    if kv_cache.dim() == 5:
        raise NotImplementedError(
            f"a 5D KV cache {tuple(kv_cache.shape)} is not vLLM 0.32's layout (one "
            "[num_blocks, num_kv_heads, block_size, 2 * head_size] tensor per layer). "
            "Fix: pass (key_cache, value_cache) views [num_blocks, block_size, num_kv_heads, "
            "head_size], e.g. (kv[0], kv[1]) for [2, num_blocks, ...] or (kv[:, 0], kv[:, 1]) "
            "for [num_blocks, 2, ...]."
        )
    if kv_cache.dim() != 4:
        raise ValueError(
            "kv_cache must be vLLM 0.32's [num_blocks, num_kv_heads, block_size, "
            f"2 * head_size] tensor or a (key_cache, value_cache) pair, got {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[-1] != 2 * head_size:
        raise NotImplementedError(
            f"KV cache content axis is {kv_cache.shape[-1]}, not 2 * head_size = "
            f"{2 * head_size}: a per-token-head quantized cache (inline scales) or a V head "
            "size different from K's. Fix: kv_cache_dtype='auto' and equal K/V head sizes."
        )
    # exactly what TRITON_ATTN / FLASH_ATTN do: (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D))
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def tree_paged_attention(
    query: torch.Tensor,
    kv_cache,
    block_table: torch.Tensor,
    root_pos: torch.Tensor,
    num_nodes: torch.Tensor,
    ancestor_bits: torch.Tensor,
    scale: float,
    root_index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_k: int = 64,
    block_m: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of the tree query rows over the paged cache (see the module docstring).

    Args:
        query: either flat ``[T, Hq, D]`` (vLLM's query rows; tree ``r``'s node ``j`` is
            row ``root_index[r] + j``) or dense ``[R, N, Hq, D]`` with ``root_index=None``.
        kv_cache: vLLM 0.32's per-layer cache ``[num_blocks, Hkv, block_size, 2 * D]``
            (any ``KVCacheLayout`` stride order), or ``(key_cache, value_cache)``, each
            ``[num_blocks, block_size, Hkv, D]``. It must already hold the tree nodes'
            K/V at positions ``root_pos + j``.
        block_table: ``[R, max_blocks]`` int32/int64 rows of the tree requests; must cover
            positions ``< root_pos[r] + num_nodes[r]``.
        root_pos: ``[R]`` int, prefix length = cache position of the root.
        num_nodes: ``[R]`` int, nodes per tree including the root (``<= N``).
        ancestor_bits: ``[R, N, ceil(N / 32)]`` int32 from :func:`ancestor_bits_from_parents`.
        scale: softmax scale.
        root_index: ``[R]`` flat row of each root, for a flat ``query``.
        out: optional output like ``query``. Only tree rows are written; other rows keep
            their values (zeros when ``out`` is None).
        block_k, block_m, num_warps, num_stages: tuning knobs (keys per step, rows per
            program = nodes x padded GQA group).

    Returns:
        ``out``, shaped like ``query``, in ``query``'s dtype.
    """
    if query.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"query dtype {query.dtype}; supported: {SUPPORTED_DTYPES}")
    dense = query.dim() == 4
    if dense:
        if root_index is not None:
            raise ValueError("root_index is only for a flat [T, Hq, D] query")
        r_dense, n_dense = query.shape[:2]
        flat_query = query.reshape(r_dense * n_dense, *query.shape[2:])
        root_index = torch.arange(r_dense, device=query.device) * n_dense
    elif query.dim() == 3:
        if root_index is None:
            raise ValueError("a flat [T, Hq, D] query needs root_index")
        flat_query = query
    else:
        raise ValueError(f"query must be [T, Hq, D] or [R, N, Hq, D], got {tuple(query.shape)}")
    num_q_heads, head_size = flat_query.shape[1:]
    if head_size > MAX_HEAD_SIZE:
        raise NotImplementedError(f"head size {head_size} > {MAX_HEAD_SIZE}")

    key_cache, value_cache = _split_kv_cache(kv_cache, head_size)
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise NotImplementedError(
            f"KV cache dtype {key_cache.dtype} differs from the query's {query.dtype} "
            "(fp8 / quantized KV caches are not supported). Fix: kv_cache_dtype='auto'."
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise NotImplementedError("the head_size axis of the KV cache must be contiguous")
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if block_size & (block_size - 1):
        raise NotImplementedError(f"block size {block_size} is not a power of two")

    num_trees = block_table.shape[0]
    tensors = dict(key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                   root_pos=root_pos, num_nodes=num_nodes, ancestor_bits=ancestor_bits,
                   root_index=root_index)  # fmt: skip
    for name, t in tensors.items():
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, the query on {query.device}")
    if ancestor_bits.dim() != 3 or ancestor_bits.dtype != torch.int32:
        raise ValueError(
            f"ancestor_bits must be int32 [R, N, W], got {ancestor_bits.dtype} "
            f"{tuple(ancestor_bits.shape)}; build it with ancestor_bits_from_parents"
        )
    width = ancestor_bits.shape[1]
    if ancestor_bits.shape[2] != num_mask_words(width):
        raise ValueError(
            f"ancestor_bits has {ancestor_bits.shape[2]} words per row, a tree of width "
            f"{width} needs {num_mask_words(width)}"
        )
    for name, t in (("root_pos", root_pos), ("num_nodes", num_nodes), ("root_index", root_index)):
        if t.shape != (num_trees,):
            raise ValueError(f"{name} must be [{num_trees}], got {tuple(t.shape)}")
    if ancestor_bits.shape[0] != num_trees:
        raise ValueError(f"ancestor_bits has {ancestor_bits.shape[0]} trees, expected {num_trees}")
    if dense and width != query.shape[1]:
        raise ValueError(f"dense query has {query.shape[1]} nodes per tree, ancestor_bits {width}")
    if flat_query.stride(-1) != 1:
        flat_query = flat_query.contiguous()

    if out is None:
        flat_out = torch.zeros_like(flat_query)
    else:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}")
        flat_out = out.view(flat_query.shape) if dense else out
        if flat_out.stride(-1) != 1:
            raise ValueError("out's last axis must be contiguous")

    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    head_pad = max(16, _next_pow2(head_size))
    block_nodes = max(1, min(block_m // group_pad, _next_pow2(width)))
    block_nodes = max(block_nodes, -(-16 // group_pad))  # tl.dot needs >= 16 rows
    block_k = max(16, _next_pow2(block_k))

    # triton 3.7's interpreter multiplies bf16 dot operands as raw uint16 bits: there,
    # (and only there) bf16 tiles are upcast to fp32 before each tl.dot
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    upcast = query.dtype == torch.bfloat16 and interpreted
    kernel = _kernel()
    ancestor_bits = ancestor_bits.contiguous()
    block_table = block_table.contiguous()
    grid = (-(-width // block_nodes), num_trees, num_kv_heads)
    if num_trees and width:
        kernel[grid](
            flat_query, key_cache, value_cache, flat_out, block_table,
            root_index, root_pos, num_nodes, ancestor_bits,
            float(scale) * math.log2(math.e),
            flat_query.stride(0), flat_query.stride(1), flat_out.stride(0), flat_out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_table.stride(0), ancestor_bits.stride(0), ancestor_bits.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, GROUP=group, GROUP_PAD=group_pad,
            BLOCK_NODES=block_nodes, BLOCK_K=block_k, BLOCK_SIZE=block_size, UPCAST=upcast,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    if out is not None:
        return out
    return flat_out.view(query.shape)
