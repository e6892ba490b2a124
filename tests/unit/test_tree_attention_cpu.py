"""The CPU tree attention (attention/cpu_backend.py) against the torch reference.

Ragged batches of random trees over prefixes that span several cache blocks, the
K/V written into vLLM's paged CPU cache by vLLM's own writer: every real node's
output must match ``prefix_tree_attention`` on the dense prefix, and the captured
node K/V (used by KV compaction) must be the step's own.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

H_Q, H_KV, D = 9, 3, 64


def _random_parents(n: int, gen: torch.Generator) -> torch.Tensor:
    """A topologically ordered tree of n nodes (node 0 the root)."""
    parents = torch.full((n,), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[i] = int(torch.randint(0, i, (1,), generator=gen))
    return parents


def _depths(parents: torch.Tensor) -> torch.Tensor:
    depths = torch.zeros_like(parents)
    for i in range(1, parents.numel()):
        depths[i] = depths[parents[i]] + 1
    return depths


@pytest.fixture(params=["fused", "torch"])
def tree_attention_path(request, monkeypatch):
    """Both implementations: the fused C++ op (built on first use) and the torch path."""
    from eagle_vllm.attention import cpu_tree_op

    monkeypatch.setenv("EAGLE_VLLM_TREE_ATTENTION", request.param)
    cpu_tree_op.load.cache_clear()
    if request.param == "fused":
        assert cpu_tree_op.load() is not None, "the fused op did not build (see the warning)"
    yield request.param
    cpu_tree_op.load.cache_clear()


@pytest.mark.parametrize(
    "num_nodes, prefixes, block, dtype, head, isa",
    [
        ([5, 5], [40, 17], 16, torch.float32, D, None),
        ([7, 2, 4], [3, 50, 33], 16, torch.float32, D, None),
        ([16, 1], [0, 200], 32, torch.float32, D, None),  # no prefix; a chain of one; "vec"
        ([4, 6], [70, 129], 32, torch.bfloat16, D, None),
        ([9], [150], 32, torch.float32, D, None),  # one tree: its nodes split between threads
        ([11, 3], [77, 20], 16, torch.float32, 80, None),  # a head of 2.5 vectors: tails
        # bf16 on an AMX CPU: the prepacked layout, whatever this machine picks itself
        ([4, 6], [70, 129], 32, torch.bfloat16, D, "amx"),
        ([16, 2], [5, 300], 64, torch.bfloat16, 128, "amx"),
    ],
)
def test_tree_rows_match_the_reference(
    num_nodes: list[int],
    prefixes: list[int],
    block: int,
    dtype,
    head: int,
    isa: str | None,
    tree_attention_path: str,
):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from eagle_vllm.attention.cpu_backend import TreeCPUAttentionImpl
    from eagle_vllm.attention.paged_kv import SUPPORTED_CPU_ISAS, check_cpu_isa, gather_cpu_kv
    from eagle_vllm.attention.reference import prefix_tree_attention
    from eagle_vllm.attention.tree_batch import TreeBatch

    gen = torch.Generator().manual_seed(sum(num_nodes) + sum(prefixes))
    r, width = len(num_nodes), max(num_nodes)
    isa = isa or _get_attn_isa(dtype, block, head)
    if isa not in SUPPORTED_CPU_ISAS:  # e.g. NEON: another layout, not read
        with pytest.raises(NotImplementedError, match="Fix: run with dtype float32"):
            check_cpu_isa(isa)
        return
    max_blocks = -(-(max(prefixes) + width) // block)
    kv_cache = torch.zeros(r * max_blocks + 1, H_KV, block, 2 * head, dtype=dtype)
    block_table = (torch.randperm(r * max_blocks, generator=gen) + 1).view(r, -1).to(torch.int32)
    view = kv_cache.view(kv_cache.shape[0], H_KV, block * 2, head)
    key_cache, value_cache = view.chunk(2, dim=2)

    def write(b: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = block_table[b, positions // block].long() * block + positions % block
        try:
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip
        except RuntimeError as e:  # 'amx' on a CPU without AVX-512 BF16: vLLM has no writer
            if isa != "amx":
                raise
            pytest.skip(f"vLLM's 'amx' KV writer does not run on this CPU: {e}")

    # the step's query rows: request b's nodes at flat rows root_index[b] + j
    root_index = torch.tensor([0, *torch.tensor(num_nodes).cumsum(0)[:-1].tolist()])
    total = sum(num_nodes)
    query = torch.randn(total, H_Q, head, generator=gen).to(dtype)
    key = torch.randn(total, H_KV, head, generator=gen).to(dtype)
    value = torch.randn(total, H_KV, head, generator=gen).to(dtype)
    parents = torch.full((r, width), -1, dtype=torch.int64)
    depths = torch.zeros(r, width, dtype=torch.int64)
    for b, (n, p) in enumerate(zip(num_nodes, prefixes)):
        pos = torch.arange(p)
        prefix_k, prefix_v = (torch.randn(p, H_KV, head, generator=gen).to(dtype) for _ in "kv")
        write(b, pos, prefix_k, prefix_v)
        rows = slice(int(root_index[b]), int(root_index[b]) + n)
        write(b, p + torch.arange(n), key[rows], value[rows])  # tree nodes in slot order
        parents[b, :n] = _random_parents(n, gen)
        depths[b, :n] = _depths(parents[b, :n])
    batch = TreeBatch(
        batch_rows=torch.arange(r),
        root_index=root_index,
        root_pos=torch.tensor(prefixes),
        num_nodes=torch.tensor(num_nodes),
        parents=parents,
        depths=depths,
        block_table=block_table,
    )
    # what the tree path reads of the impl (its __init__ needs a whole VllmConfig; the
    # stock kernel is not called when every row is a tree row)
    impl = TreeCPUAttentionImpl.__new__(TreeCPUAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = H_Q, H_KV, head, head**-0.5
    layer = SimpleNamespace(isa=isa, layer_name="layers.0.attn")
    output = torch.full((total, H_Q * head), float("nan"), dtype=dtype)
    metadata = SimpleNamespace(num_actual_tokens=total, eagle_tree_batch=batch)
    impl.forward(layer, query, key, value, kv_cache, metadata, output)

    mask = batch.ancestor_mask()
    for b, (n, p) in enumerate(zip(num_nodes, prefixes)):
        pk, pv = gather_cpu_kv(kv_cache, block_table[b : b + 1], p, isa)
        rows = slice(int(root_index[b]), int(root_index[b]) + n)
        f32 = (query[None, rows], pk, pv, key[None, rows], value[None, rows])
        q, pk, pv, k, v = (x.float() for x in f32)
        want = prefix_tree_attention(
            q, pk, pv, torch.tensor([p]), k, v, mask[b : b + 1, :n, :n], head**-0.5
        )
        got = output[rows].view(1, n, H_Q, head).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        node_k, node_v = batch.captured_kv["layers.0.attn"]
        assert torch.equal(node_k[b, :n], key[rows]) and torch.equal(node_v[b, :n], value[rows])
    assert not output.isnan().any()  # every row is a tree row, and every one was written
    # the torch path's additive mask (R x N x prefix span) is built only where it is used
    plan = batch.attention_plan(dtype, block)
    assert ("mask" in vars(plan)) == (tree_attention_path == "torch" or isa == "amx")


@pytest.mark.parametrize("query_from", [0, 3])
def test_platform_prefix_attention_reads_the_cache_in_place(query_from: int, monkeypatch):
    """``CPUTreePlatform.prefix_attention`` (the drafter's first pass and tree passes):
    rows from ``query_from`` on attend to their request's cached prefix and the rows
    ``allowed`` admits, earlier rows are keys only, and rows it does not compute are
    zeros."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from eagle_vllm.attention import cpu_tree_op
    from eagle_vllm.attention.paged_kv import SUPPORTED_CPU_ISAS, gather_cpu_kv
    from eagle_vllm.attention.platform import CPUTreePlatform
    from eagle_vllm.attention.reference import prefix_tree_attention

    monkeypatch.setenv("EAGLE_VLLM_TREE_ATTENTION", "fused")
    cpu_tree_op.load.cache_clear()
    block, dtype = 16, torch.float32
    isa = _get_attn_isa(dtype, block, D)
    if isa not in SUPPORTED_CPU_ISAS:
        pytest.skip(f"attention ISA {isa}: not a layout the op reads")
    gen = torch.Generator().manual_seed(7 + query_from)
    prefixes, num_rows, width = [37, 5], [7, 5], 7
    r = len(prefixes)
    kv_cache = torch.zeros(2 * 4 + 1, H_KV, block, 2 * D, dtype=dtype)
    block_table = (torch.randperm(2 * 4, generator=gen) + 1).view(r, -1).to(torch.int64)
    view = kv_cache.view(kv_cache.shape[0], H_KV, block * 2, D)
    key_cache, value_cache = view.chunk(2, dim=2)
    for b, p in enumerate(prefixes):
        pos = torch.arange(p)
        k, v = (torch.randn(p, H_KV, D, generator=gen) for _ in "kv")
        slots = block_table[b, pos // block] * block + pos % block
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip
    layer = SimpleNamespace(isa=isa, kv_cache=[kv_cache])
    attend = CPUTreePlatform().prefix_attention(layer)
    assert attend is not None
    total = r * width
    query = torch.randn(total, H_Q, D, generator=gen)
    key = torch.randn(total, H_KV, D, generator=gen)
    value = torch.randn(total, H_KV, D, generator=gen)
    rows = torch.arange(total).view(r, width)
    allowed = torch.rand(r, width, width, generator=gen) < 0.5
    allowed |= torch.eye(width, dtype=torch.bool)  # every row sees itself
    out = attend(query, key, value, rows, torch.tensor(num_rows), block_table,
                 torch.tensor(prefixes), allowed.contiguous(), D**-0.5, query_from)  # fmt: skip
    out = out.view(r, width, H_Q, D)
    for b, (n, p) in enumerate(zip(num_rows, prefixes)):
        pk, pv = gather_cpu_kv(kv_cache, block_table[b : b + 1].to(torch.int32), p, isa)
        own = slice(b * width, b * width + n)
        want = prefix_tree_attention(
            query[None, own][:, query_from:], pk, pv, torch.tensor([p]), key[None, own],
            value[None, own], allowed[b : b + 1, query_from:n, :n], D**-0.5,
        )  # fmt: skip
        torch.testing.assert_close(out[b : b + 1, query_from:n], want, rtol=1e-5, atol=1e-5)
        assert not out[b, :query_from].any() and not out[b, n:].any()
    cpu_tree_op.load.cache_clear()
