"""The CPU paged-KV reader and the torch tree attention.

K/V are written with vLLM's own CPU cache writer, called exactly as
``CPUAttentionBackendImpl.do_kv_cache_update`` (vllm/v1/attention/backends/
cpu_attn.py) does, with the ISA its metadata builder computes
(``_get_attn_isa``); ``gather_cpu_kv`` must read back exactly what was written.
No engine is started.
"""

from __future__ import annotations

import math

import pytest
import torch

from eagle_vllm.attention.paged_kv import (
    SUPPORTED_CPU_ISAS,
    check_cpu_isa,
    cpu_kv_views,
    gather_cpu_kv,
)
from eagle_vllm.attention.reference import prefix_tree_attention

torch.set_num_threads(1)

NUM_KV_HEADS = 2
HEAD_SIZE = 64


@pytest.fixture(scope="module")
def vllm_cpu():
    ops = pytest.importorskip("vllm._custom_ops")
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip("not the CPU build of vLLM")
    return ops, cpu_attn._get_attn_isa


def write_kv(ops, isa, kv_cache, key, value, slot_mapping):
    """``do_kv_cache_update`` of vLLM 0.32's CPU backend (kv_cache_dtype auto, scales 1)."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
    kv = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
    key_cache, value_cache = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_isa_is_supported_for_float32(vllm_cpu, block_size):
    _, get_isa = vllm_cpu
    isa = get_isa(torch.float32, block_size, HEAD_SIZE, "auto")
    if isa not in SUPPORTED_CPU_ISAS:
        with pytest.raises(NotImplementedError, match="Fix:"):
            check_cpu_isa(isa)
        pytest.skip(f"this machine's fp32 attention ISA is {isa}")
    check_cpu_isa(isa)
    assert isa == ("vec16" if block_size % 32 else "vec")


@pytest.mark.parametrize("isa", ["neon", "vsx", "unknown"])
def test_other_isas_refused(isa):
    with pytest.raises(NotImplementedError) as exc:
        check_cpu_isa(isa)
    assert isa in str(exc.value) and "Fix:" in str(exc.value)


@pytest.mark.parametrize(
    "block_size,head_size", [(16, HEAD_SIZE), (128, HEAD_SIZE), (32, HEAD_SIZE), (16, 48)]
)
@pytest.mark.parametrize("chunked", [False, True], ids=["one_write", "prefill_then_decode"])
def test_gather_reads_what_vllm_wrote(vllm_cpu, block_size, head_size, chunked):
    ops, get_isa = vllm_cpu
    isa = get_isa(torch.float32, block_size, head_size, "auto")
    if isa not in SUPPORTED_CPU_ISAS:
        pytest.skip(f"fp32 attention ISA here is {isa}")
    g = torch.Generator().manual_seed(block_size * 1000 + head_size + chunked)
    lens = [1, block_size, 2 * block_size + 5, 3 * block_size - 1]
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # a spare column, as in vLLM
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    kv_cache = torch.full(
        (num_blocks, NUM_KV_HEADS, block_size, 2 * head_size), float("nan"), dtype=torch.float32
    )
    # each request gets random, disjoint blocks in a random order
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_table = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    keys, values, slots = [], [], []
    for r, n in enumerate(lens):
        nb = -(-n // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        block_table[r, :nb] = torch.tensor(blocks, dtype=torch.int32)
        keys.append(torch.randn(n, NUM_KV_HEADS, head_size, generator=g))
        values.append(torch.randn(n, NUM_KV_HEADS, head_size, generator=g))
        pos = torch.arange(n)
        slots.append(block_table[r, pos // block_size].long() * block_size + pos % block_size)

    if chunked:
        # a prefill of all but the last token of each request, then one decode step
        pre = [slice(0, n - 1) for n in lens]
        dec = [slice(n - 1, n) for n in lens]
        for part in (pre, dec):
            write_kv(
                ops,
                isa,
                kv_cache,
                torch.cat([k[s] for k, s in zip(keys, part)]),
                torch.cat([v[s] for v, s in zip(values, part)]),
                torch.cat([m[s] for m, s in zip(slots, part)]),
            )
    else:
        # all tokens of all requests in one batch, shuffled
        order = torch.randperm(sum(lens), generator=g)
        write_kv(
            ops,
            isa,
            kv_cache,
            torch.cat(keys)[order].contiguous(),
            torch.cat(values)[order].contiguous(),
            torch.cat(slots)[order].contiguous(),
        )

    max_len = max(lens)
    k_out, v_out = gather_cpu_kv(kv_cache, block_table, max_len)
    assert k_out.shape == v_out.shape == (len(lens), max_len, NUM_KV_HEADS, head_size)
    for r, n in enumerate(lens):
        assert torch.equal(k_out[r, :n], keys[r]), f"request {r}: K differs"
        assert torch.equal(v_out[r, :n], values[r]), f"request {r}: V differs"
        # a shorter max_len reads a prefix of the same
        k_short, v_short = gather_cpu_kv(kv_cache, block_table[r : r + 1], n)
        assert torch.equal(k_short[0], keys[r]) and torch.equal(v_short[0], values[r])

    # the views agree with the gather, slot by slot
    k_t, v_view = cpu_kv_views(kv_cache)
    r, n = len(lens) - 1, lens[-1]
    for t in range(n):
        blk, off = int(block_table[r, t // block_size]), t % block_size
        assert torch.equal(k_t[blk, :, :, off], keys[r][t])
        assert torch.equal(v_view[blk, :, off, :], values[r][t])


@pytest.mark.parametrize("block_size,head_size", [(32, 64), (64, 128), (128, 96), (32, 32)])
def test_gather_reads_what_vllm_wrote_in_the_amx_layout(vllm_cpu, block_size, head_size):
    """bf16 on CPUs with AMX tiles: vLLM picks the 'amx' ISA, whose writer prepacks K and V
    in pairs. The writer itself runs on any AVX-512 CPU, so the layout is checked here
    whatever this machine's own ISA is."""
    ops, _ = vllm_cpu
    g = torch.Generator().manual_seed(block_size + head_size)
    lens = [1, block_size, 2 * block_size + 5, 3 * block_size - 1]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    kv_cache = torch.full((num_blocks, NUM_KV_HEADS, block_size, 2 * head_size), float("nan"),
                          dtype=torch.bfloat16)  # fmt: skip
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_table = torch.zeros(len(lens), max(-(-n // block_size) for n in lens) + 1,
                              dtype=torch.int32)  # fmt: skip
    keys, values, slots = [], [], []
    for r, n in enumerate(lens):
        nb = -(-n // block_size)
        block_table[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        keys.append(torch.randn(n, NUM_KV_HEADS, head_size, generator=g).bfloat16())
        values.append(torch.randn(n, NUM_KV_HEADS, head_size, generator=g).bfloat16())
        pos = torch.arange(n)
        slots.append(block_table[r, pos // block_size].long() * block_size + pos % block_size)
    order = torch.randperm(sum(lens), generator=g)
    try:
        write_kv(ops, "amx", kv_cache, torch.cat(keys)[order].contiguous(),
                 torch.cat(values)[order].contiguous(), torch.cat(slots)[order].contiguous())  # fmt: skip
    except RuntimeError as e:  # a CPU without AVX-512 BF16: vLLM has no AMX writer for it
        pytest.skip(f"vLLM's 'amx' KV writer does not run on this CPU: {e}")
    k_out, v_out = gather_cpu_kv(kv_cache, block_table, max(lens), "amx")
    for r, n in enumerate(lens):
        assert torch.equal(k_out[r, :n], keys[r]), f"request {r}: K differs"
        assert torch.equal(v_out[r, :n], values[r]), f"request {r}: V differs"
    # the 'vec' reading of the same bytes is wrong: the layouts do differ
    k_vec, _ = gather_cpu_kv(kv_cache, block_table, max(lens), "vec")
    assert not torch.equal(k_vec[2, : lens[2]], keys[2])


def test_gather_hand_written_layout():
    """The documented layout, written by hand: K transposed, V row-major, per (block, head)."""
    nb, h, bs, d = 3, 2, 4, 8
    cache = torch.zeros(nb, h, bs, 2 * d)
    flat = cache.view(nb, h, 2, bs * d)
    k = torch.randn(nb, h, bs, d)
    v = torch.randn(nb, h, bs, d)
    flat[:, :, 0] = k.transpose(2, 3).reshape(nb, h, bs * d)
    flat[:, :, 1] = v.reshape(nb, h, bs * d)
    table = torch.tensor([[2, 0], [1, 2]])
    k_out, v_out = gather_cpu_kv(cache, table, 6)
    expect_k = torch.cat([k[2], k[0]], dim=1).transpose(0, 1)[:6]
    expect_v = torch.cat([v[2], v[0]], dim=1).transpose(0, 1)[:6]
    assert torch.equal(k_out[0], expect_k) and torch.equal(v_out[0], expect_v)
    assert k_out.shape == (2, 6, h, d)
    # max_len 0 still works (no prefix)
    k0, v0 = gather_cpu_kv(cache, table, 0)
    assert k0.shape == (2, 0, h, d) and v0.shape == (2, 0, h, d)


# --------------------------------------------------------------------------
# prefix + tree attention
# --------------------------------------------------------------------------
def naive_attention(query, prefix_k, prefix_v, prefix_lens, node_k, node_v, node_mask, scale):
    """Per request, query and head: softmax over the visible keys, in float64."""
    batch, num_q, hq, d = query.shape
    hkv = prefix_k.shape[2]
    group = hq // hkv
    out = torch.zeros(batch, num_q, hq, d, dtype=torch.float64)
    for b in range(batch):
        n = int(prefix_lens[b])
        for q in range(num_q):
            visible = node_mask[b, q].nonzero().flatten()
            for h in range(hq):
                kv_h = h // group
                ks = torch.cat([prefix_k[b, :n, kv_h], node_k[b, visible, kv_h]]).double()
                vs = torch.cat([prefix_v[b, :n, kv_h], node_v[b, visible, kv_h]]).double()
                scores = (ks @ query[b, q, h].double()) * scale
                out[b, q, h] = torch.softmax(scores, dim=0) @ vs
    return out


def random_tree_mask(g, batch, num_nodes):
    """Ancestor-or-self masks ``[B, M, M]`` of random trees (parent index < child index)."""
    mask = torch.zeros(batch, num_nodes, num_nodes, dtype=torch.bool)
    for b in range(batch):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, num_nodes)]
        for i in range(num_nodes):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parents[j]
    return mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_nodes", [1, 5, 16])
def test_prefix_tree_attention_matches_naive(seed, num_nodes):
    g = torch.Generator().manual_seed(seed * 100 + num_nodes)
    batch, hq, hkv, d, p = 3, 4, 2, 64, 37
    query = torch.randn(batch, num_nodes, hq, d, generator=g)
    prefix_k = torch.randn(batch, p, hkv, d, generator=g)
    prefix_v = torch.randn(batch, p, hkv, d, generator=g)
    node_k = torch.randn(batch, num_nodes, hkv, d, generator=g)
    node_v = torch.randn(batch, num_nodes, hkv, d, generator=g)
    prefix_lens = torch.tensor([p, 1, int(torch.randint(2, p, (1,), generator=g))])
    # positions past each request's length hold large junk, which must be ignored
    for b in range(batch):
        prefix_k[b, prefix_lens[b] :] = 1e3
        prefix_v[b, prefix_lens[b] :] = -1e3
    node_mask = random_tree_mask(g, batch, num_nodes)
    scale = 1 / math.sqrt(d)
    args = (query, prefix_k, prefix_v, prefix_lens, node_k, node_v, node_mask, scale)
    out = prefix_tree_attention(*args)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), naive_attention(*args), atol=1e-5, rtol=1e-5)


def test_prefix_tree_attention_general_masks():
    """Arbitrary (non-tree) masks, more queries than nodes, an empty prefix, another scale."""
    g = torch.Generator().manual_seed(7)
    batch, num_q, m, hq, hkv, d, p = 2, 6, 4, 4, 2, 64, 9
    query = torch.randn(batch, num_q, hq, d, generator=g)
    prefix_k = torch.randn(batch, p, hkv, d, generator=g)
    prefix_v = torch.randn(batch, p, hkv, d, generator=g)
    node_k = torch.randn(batch, m, hkv, d, generator=g)
    node_v = torch.randn(batch, m, hkv, d, generator=g)
    node_mask = torch.rand(batch, num_q, m, generator=g) < 0.5
    node_mask[0, :, 0] = True  # request 0 has no prefix: every query sees some node
    prefix_lens = torch.tensor([0, p])
    args = (query, prefix_k, prefix_v, prefix_lens, node_k, node_v, node_mask, 0.3)
    torch.testing.assert_close(
        prefix_tree_attention(*args).double(), naive_attention(*args), atol=1e-5, rtol=1e-5
    )


def test_prefix_tree_attention_no_nodes():
    """``M = 0``: plain attention over each request's prefix."""
    g = torch.Generator().manual_seed(3)
    batch, num_q, hq, hkv, d, p = 2, 3, 4, 2, 64, 11
    query = torch.randn(batch, num_q, hq, d, generator=g)
    prefix_k = torch.randn(batch, p, hkv, d, generator=g)
    prefix_v = torch.randn(batch, p, hkv, d, generator=g)
    empty = torch.zeros(batch, 0, hkv, d)
    args = (
        query,
        prefix_k,
        prefix_v,
        torch.tensor([4, 11]),
        empty,
        empty,
        torch.zeros(batch, num_q, 0, dtype=torch.bool),
        0.125,
    )
    torch.testing.assert_close(
        prefix_tree_attention(*args).double(), naive_attention(*args), atol=1e-5, rtol=1e-5
    )


def test_prefix_tree_attention_on_gathered_cache(vllm_cpu):
    """End to end on CPU: the prefix comes out of vLLM's paged cache."""
    ops, get_isa = vllm_cpu
    bs = 16
    isa = get_isa(torch.float32, bs, HEAD_SIZE, "auto")
    if isa not in SUPPORTED_CPU_ISAS:
        pytest.skip(f"fp32 attention ISA here is {isa}")
    g = torch.Generator().manual_seed(11)
    lens = [20, 7]
    kv_cache = torch.zeros(8, NUM_KV_HEADS, bs, 2 * HEAD_SIZE)
    block_table = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=g) for n in lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=g) for n in lens]
    slots = [
        block_table[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
        for r, n in enumerate(lens)
    ]
    write_kv(ops, isa, kv_cache, torch.cat(keys), torch.cat(values), torch.cat(slots))
    prefix_k, prefix_v = gather_cpu_kv(kv_cache, block_table, max(lens))
    m = 5
    query = torch.randn(2, m, 4, HEAD_SIZE, generator=g)
    node_k = torch.randn(2, m, NUM_KV_HEADS, HEAD_SIZE, generator=g)
    node_v = torch.randn(2, m, NUM_KV_HEADS, HEAD_SIZE, generator=g)
    mask = random_tree_mask(g, 2, m)
    scale = HEAD_SIZE**-0.5
    out = prefix_tree_attention(
        query, prefix_k, prefix_v, torch.tensor(lens), node_k, node_v, mask, scale
    )
    dense_k = torch.zeros(2, max(lens), NUM_KV_HEADS, HEAD_SIZE)
    dense_v = torch.zeros_like(dense_k)
    for r, n in enumerate(lens):
        dense_k[r, :n], dense_v[r, :n] = keys[r], values[r]
    expected = naive_attention(
        query, dense_k, dense_v, torch.tensor(lens), node_k, node_v, mask, scale
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
