"""KV compaction after tree verification, checked slot by slot in a real CPU KV cache."""

from __future__ import annotations

import torch
from test_paged_kv import HEAD_SIZE, NUM_KV_HEADS, vllm_cpu, write_kv  # noqa: F401

from eagle_vllm.attention.paged_kv import gather_cpu_kv
from eagle_vllm.attention.tree_batch import TreeBatch

torch.set_num_threads(1)


def _tree_batch(root_index, root_pos, parents, depths, block_table):
    num_nodes = torch.tensor([int((p >= 0).sum()) + 1 for p in parents])
    return TreeBatch(
        batch_rows=torch.arange(len(parents)),
        root_index=torch.tensor(root_index),
        root_pos=torch.tensor(root_pos),
        num_nodes=num_nodes,
        parents=torch.stack(parents),
        depths=torch.stack(depths),
        block_table=block_table,
    )


def test_compaction_moves_accepted_path_to_linear_slots(vllm_cpu):  # noqa: F811
    ops, get_isa = vllm_cpu
    block_size = 16
    isa = get_isa(torch.float32, block_size, HEAD_SIZE)
    num_blocks = 8
    kv_cache = torch.full((num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE), float("nan"))
    g = torch.Generator().manual_seed(0)

    # two requests; request 0's root at position 13 (crosses a block boundary), blocks [2, 5];
    # request 1's root at position 3, block [6, 1]
    block_table = torch.tensor([[2, 5], [6, 1]], dtype=torch.int32)
    root_pos = [13, 3]
    #   tree 0: 0 -> 1, 0 -> 2, 2 -> 3, 2 -> 4, 4 -> 5      tree 1: 0 -> 1, 1 -> 2, 0 -> 3
    parents = [torch.tensor([-1, 0, 0, 2, 2, 4]), torch.tensor([-1, 0, 1, 0, -1, -1])]
    depths = [torch.tensor([0, 1, 1, 2, 2, 3]), torch.tensor([0, 1, 2, 1, 0, 0])]
    num_nodes = [6, 4]
    root_index = [0, 6]
    tb = _tree_batch(root_index, root_pos, parents, depths, block_table)

    def slot(r, pos):
        return int(block_table[r, pos // block_size]) * block_size + pos % block_size

    # prefix KV (positions < root) and this step's tree rows at linear slots, as vLLM writes them
    rows_slots, keys, values = [], [], []
    for r in range(2):
        for pos in range(root_pos[r] + num_nodes[r]):
            rows_slots.append(slot(r, pos))
    keys = torch.randn(len(rows_slots), NUM_KV_HEADS, HEAD_SIZE, generator=g)
    values = torch.randn(len(rows_slots), NUM_KV_HEADS, HEAD_SIZE, generator=g)
    write_kv(ops, isa, kv_cache, keys, values, torch.tensor(rows_slots))
    before_k, before_v = gather_cpu_kv(kv_cache, block_table, 32)

    # captured tree K/V [R, N, H, D] (what the attention backend keeps)
    node_k = torch.stack([before_k[r, root_pos[r] : root_pos[r] + 6] for r in range(2)])
    node_v = torch.stack([before_v[r, root_pos[r] : root_pos[r] + 6] for r in range(2)])

    accepted = torch.tensor([[2, 4, 5], [1, 2, -1]])  # request 1's path is already in place
    tree, src, dst_row = tb.compaction_moves(accepted)
    assert tree.tolist() == [0, 0, 0]
    assert src.tolist() == [2, 4, 5]
    assert dst_row.tolist() == [1, 2, 3]
    dst_slots = torch.tensor([slot(0, root_pos[0] + int(row)) for row in dst_row])
    write_kv(ops, isa, kv_cache, node_k[tree, src], node_v[tree, src], dst_slots)

    after_k, after_v = gather_cpu_kv(kv_cache, block_table, 32)
    for r, path in ((0, [2, 4, 5]), (1, [1, 2])):
        root = root_pos[r]
        # prefix and root untouched
        assert torch.equal(after_k[r, : root + 1], before_k[r, : root + 1])
        assert torch.equal(after_v[r, : root + 1], before_v[r, : root + 1])
        # position root+i holds accepted node i's K/V, slot by slot
        for i, node in enumerate(path, start=1):
            assert torch.equal(after_k[r, root + i], node_k[r, node])
            assert torch.equal(after_v[r, root + i], node_v[r, node])
    # request 0's slot root+4 (a rejected node beyond the path) keeps its old value
    assert torch.equal(after_k[0, root_pos[0] + 4], before_k[0, root_pos[0] + 4])


def test_ancestor_mask_of_tree_batch():
    tb = _tree_batch(
        [0],
        [5],
        [torch.tensor([-1, 0, 0, 2, 2, 4])],
        [torch.tensor([0, 1, 1, 2, 2, 3])],
        torch.zeros(1, 1, dtype=torch.int32),
    )
    mask = tb.ancestor_mask()[0]
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 2, 3}, 4: {0, 2, 4}, 5: {0, 2, 4, 5}}
    for i, anc in expected.items():
        assert set(mask[i].nonzero().view(-1).tolist()) == anc
    assert tb.tree_positions()[0].tolist() == [5, 6, 6, 7, 7, 8]
