"""Greedy tree verification against a brute-force Python walk."""

from __future__ import annotations

import random

import pytest
import torch

from eagle_vllm.verify import (
    VerifyResult,
    greedy_verify_choices,
    greedy_walk_lists,
    tree_verify_with_draws,
)
from eagle_vllm.verify.reference import greedy_verify

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- helpers


def brute_force(tokens, parents, num_nodes, logits):
    """Plain-Python greedy walk over one tree (lists); returns (path, output tokens)."""
    n = num_nodes
    children = {u: [i for i in range(1, n) if parents[i] == u] for u in range(n)}
    path, out, u = [], [], 0
    while True:
        row = logits[u]
        y = max(range(len(row)), key=lambda v: (row[v], -v))  # first argmax
        nxt = next((c for c in children[u] if tokens[c] == y), None)
        if nxt is None:
            out.append(y)
            return path, out
        path.append(nxt)
        out.append(tokens[nxt])
        u = nxt


def expected_result(trees, N):
    """Stack brute-force results into the VerifyResult layout."""
    B = len(trees)
    acc = torch.full((B, N - 1), -1, dtype=torch.long)
    out = torch.full((B, N), -1, dtype=torch.long)
    num = torch.zeros(B, dtype=torch.long)
    for b, (path, toks) in enumerate(trees):
        acc[b, : len(path)] = torch.tensor(path, dtype=torch.long)
        out[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        num[b] = len(path)
    return acc, num, out


def pad_batch(trees, N, V, gen, garbage=False):
    """trees: list of (tokens list, parents list). Returns padded batch tensors."""
    B = len(trees)
    tokens = torch.full((B, N), -1, dtype=torch.long)
    parents = torch.full((B, N), -1, dtype=torch.long)
    num_nodes = torch.tensor([len(t) for t, _ in trees], dtype=torch.long)
    if garbage:  # padding that would change the answer if it were read
        tokens = torch.randint(0, V, (B, N), generator=gen)
        parents = torch.zeros((B, N), dtype=torch.long)
    for b, (t, p) in enumerate(trees):
        tokens[b, : len(t)] = torch.tensor(t)
        parents[b, : len(p)] = torch.tensor(p)
    logits = torch.randn((B, N, V), generator=gen)
    return tokens, parents, num_nodes, logits


def random_tree(rng: random.Random, n: int, V: int, max_children: int | None = None):
    parents = [-1]
    for i in range(1, n):
        cands = list(range(i))
        if max_children is not None:
            cands = [u for u in cands if parents.count(u) < max_children] or [i - 1]
        parents.append(rng.choice(cands))
    tokens = [rng.randrange(V)] + [rng.randrange(V) for _ in range(1, n)]
    return tokens, parents


def check_against_brute_force(tokens, parents, num_nodes, logits):
    res = greedy_verify(tokens, parents, num_nodes, logits)
    assert isinstance(res, VerifyResult)
    B, N = tokens.shape
    trees = [
        brute_force(tokens[b].tolist(), parents[b].tolist(), int(num_nodes[b]), logits[b].tolist())
        for b in range(B)
    ]
    acc, num, out = expected_result(trees, N)
    assert res.accepted_nodes.shape == (B, N - 1)
    assert res.output_tokens.shape == (B, N)
    assert res.num_accepted.dtype == torch.long
    torch.testing.assert_close(res.accepted_nodes, acc, rtol=0, atol=0)
    torch.testing.assert_close(res.num_accepted, num, rtol=0, atol=0)
    torch.testing.assert_close(res.output_tokens, out, rtol=0, atol=0)
    return res


# ----------------------------------------------------------------------------- tests


def test_hand_built_tree():
    # root(7) -> a:1 (node 1), b:2 (node 2);  a -> c:3 (node 3), d:4 (node 4);  d -> e:0 (5)
    V = 6
    tokens = torch.tensor([[7 % V, 1, 2, 3, 4, 0]])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 4]])
    num_nodes = torch.tensor([6])

    def logits_for(choices):
        lg = torch.zeros(1, 6, V)
        for node, tok in choices.items():
            lg[0, node, tok] = 5.0
        return lg

    # target: root->1, node1->4, node4->0, node5->3  => path 1,4,5 and bonus 3
    res = greedy_verify(tokens, parents, num_nodes, logits_for({0: 1, 1: 4, 4: 0, 5: 3}))
    assert res.accepted_nodes.tolist() == [[1, 4, 5, -1, -1]]
    assert res.num_accepted.tolist() == [3]
    assert res.output_tokens.tolist() == [[1, 4, 0, 3, -1, -1]]
    # target picks sibling 2 at the root, then 5 (no child): path [2], bonus 5
    res = greedy_verify(tokens, parents, num_nodes, logits_for({0: 2, 2: 5}))
    assert res.accepted_nodes.tolist() == [[2, -1, -1, -1, -1]]
    assert res.output_tokens.tolist() == [[2, 5, -1, -1, -1, -1]]
    # target disagrees at the root: nothing accepted, correction = argmax row 0
    res = greedy_verify(tokens, parents, num_nodes, logits_for({0: 5}))
    assert res.num_accepted.tolist() == [0]
    assert res.output_tokens.tolist() == [[5, -1, -1, -1, -1, -1]]


def test_duplicate_siblings_take_first():
    tokens = torch.tensor([[0, 3, 3, 1]])
    parents = torch.tensor([[-1, 0, 0, 2]])  # node 3 hangs under the second "3"
    lg = torch.zeros(1, 4, 5)
    lg[0, 0, 3] = 1.0
    lg[0, 1, 4] = 1.0
    lg[0, 2, 1] = 1.0
    res = greedy_verify(tokens, parents, torch.tensor([4]), lg)
    assert res.accepted_nodes.tolist() == [[1, -1, -1]]
    assert res.output_tokens.tolist() == [[3, 4, -1, -1]]


def test_no_drafts_outputs_argmax_of_row0():
    gen = torch.Generator().manual_seed(0)
    B, N, V = 4, 5, 11
    logits = torch.randn(B, N, V, generator=gen)
    tokens = torch.randint(0, V, (B, N), generator=gen)  # garbage beyond the root
    parents = torch.zeros(B, N, dtype=torch.long)  # garbage: all "children" of root
    num_nodes = torch.ones(B, dtype=torch.long)
    tokens[:, 1] = logits[:, 0].argmax(-1)  # would be accepted if padding were read
    res = greedy_verify(tokens, parents, num_nodes, logits)
    assert res.num_accepted.tolist() == [0] * B
    assert res.output_tokens[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()
    assert (res.output_tokens[:, 1:] == -1).all()
    assert (res.accepted_nodes == -1).all()


def test_single_slot_batch():
    logits = torch.tensor([[[0.0, 2.0, 1.0]]])
    res = greedy_verify(torch.tensor([[1]]), torch.tensor([[-1]]), torch.tensor([1]), logits)
    assert res.accepted_nodes.shape == (1, 0)
    assert res.output_tokens.tolist() == [[1]]


@pytest.mark.parametrize("garbage", [False, True])
def test_chain_matches_brute_force(garbage):
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    V, N = 4, 7
    trees = []
    for _ in range(64):
        n = rng.randint(1, N)
        trees.append(([rng.randrange(V) for _ in range(n)], [-1] + list(range(n - 1))))
    tokens, parents, num_nodes, logits = pad_batch(trees, N, V, gen, garbage)
    # make long acceptances likely: drafts equal the argmax with high probability
    for b, (t, p) in enumerate(trees):
        for i in range(1, len(t)):
            if rng.random() < 0.8:
                tokens[b, i] = logits[b, p[i]].argmax()
    res = check_against_brute_force(tokens, parents, num_nodes, logits)
    assert res.num_accepted.max() >= 4  # the test exercises deep chains


@pytest.mark.parametrize("garbage", [False, True])
def test_random_trees_match_brute_force(garbage):
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(2)
    V, N = 3, 12  # tiny vocab: many matches and duplicate siblings
    trees = [
        random_tree(rng, rng.randint(1, N), V, max_children=rng.choice([1, 2, 3, None]))
        for _ in range(300)
    ]
    tokens, parents, num_nodes, logits = pad_batch(trees, N, V, gen, garbage)
    res = check_against_brute_force(tokens, parents, num_nodes, logits)
    assert res.num_accepted.max() >= 3


def test_padding_ignored_and_batch_independent():
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    V = 5
    trees = [random_tree(rng, rng.randint(1, 6), V) for _ in range(20)]
    a = pad_batch(trees, 6, V, gen, garbage=False)
    res_a = greedy_verify(*a)
    # same trees padded to a wider N with garbage in the padding
    tokens, parents, num_nodes, logits = pad_batch(trees, 10, V, gen, garbage=True)
    logits[:, :6] = a[3]
    res_b = greedy_verify(tokens, parents, num_nodes, logits)
    assert res_b.output_tokens[:, :6].tolist() == res_a.output_tokens.tolist()
    assert (res_b.output_tokens[:, 6:] == -1).all()
    assert res_b.accepted_nodes[:, :5].tolist() == res_a.accepted_nodes.tolist()
    # each row alone gives the same answer as in the batch
    for b in range(0, 20, 7):
        single = greedy_verify(
            tokens[b : b + 1], parents[b : b + 1], num_nodes[b : b + 1], logits[b : b + 1]
        )
        assert single.output_tokens.tolist() == res_b.output_tokens[b : b + 1].tolist()


def test_probs_and_logits_agree_and_int32_inputs():
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    trees = [random_tree(rng, rng.randint(1, 8), 4) for _ in range(50)]
    tokens, parents, num_nodes, logits = pad_batch(trees, 8, 4, gen)
    r1 = greedy_verify(tokens, parents, num_nodes, logits)
    r2 = greedy_verify(tokens.int(), parents.int(), num_nodes.int(), logits.softmax(-1))
    assert r1.output_tokens.tolist() == r2.output_tokens.tolist()
    assert r1.accepted_nodes.tolist() == r2.accepted_nodes.tolist()


def test_choices_alone_give_the_same_walk():
    """The runner's verifier hands over each node's argmax only (no [B, N, V] copy)."""
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    trees = [random_tree(rng, rng.randint(1, 9), 3) for _ in range(200)]
    tokens, parents, num_nodes, logits = pad_batch(trees, 9, 3, gen, garbage=True)
    full = greedy_verify(tokens, parents, num_nodes, logits)
    fast = greedy_verify_choices(tokens, parents, num_nodes, logits.argmax(-1).int())
    assert fast.output_tokens.tolist() == full.output_tokens.tolist()
    assert fast.accepted_nodes.tolist() == full.accepted_nodes.tolist()
    assert full.num_accepted.max() >= 2
    with pytest.raises(ValueError, match="choice must be"):
        greedy_verify_choices(tokens, parents, num_nodes, logits.argmax(-1)[:, :4])


@pytest.mark.parametrize("garbage", [False, True])
def test_the_list_walk_is_the_tensor_walk(garbage):
    """Small batches are walked over Python lists (engine/sampler.py); it must give the
    tensor walk's nodes and tokens on every tree, duplicate siblings and padding included."""
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    N = 10
    trees = [random_tree(rng, rng.randint(1, N), 3, rng.choice([1, 2, None])) for _ in range(300)]
    tokens, parents, num_nodes, logits = pad_batch(trees, N, 3, gen, garbage)
    choice = logits.argmax(-1)
    tensor = greedy_verify_choices(tokens, parents, num_nodes, choice)
    paths, outputs = greedy_walk_lists(
        tokens.tolist(), parents.tolist(), num_nodes.tolist(), choice.tolist()
    )
    assert tensor.num_accepted.max() >= 3
    for b in range(len(trees)):
        n = int(tensor.num_accepted[b])
        assert paths[b] == tensor.accepted_nodes[b, :n].tolist()
        assert outputs[b] == tensor.output_tokens[b, : n + 1].tolist()


def test_callers_draws_walk_the_same_path_visiting_only_walking_rows():
    """tree_verify_with_draws with argmax draws is the greedy walk; it asks for a draw
    of the rows still walking only, never twice for one node of a row."""
    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    trees = [random_tree(rng, rng.randint(1, 9), 3) for _ in range(200)]
    tokens, parents, num_nodes, logits = pad_batch(trees, 9, 3, gen, garbage=True)
    asked: list[tuple[int, int]] = []

    def draw(rows, nodes):
        asked.extend(zip(rows.tolist(), nodes.tolist()))
        return logits[rows, nodes].argmax(-1)

    full = greedy_verify(tokens, parents, num_nodes, logits)
    walked = tree_verify_with_draws(tokens, parents, num_nodes, draw)
    assert walked.output_tokens.tolist() == full.output_tokens.tolist()
    assert walked.accepted_nodes.tolist() == full.accepted_nodes.tolist()
    assert len(asked) == len(set(asked))
    # a row is asked once at the root and once per accepted node
    assert len(asked) == int((full.num_accepted + 1).sum())


def test_bad_shapes_raise():
    t = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError):
        greedy_verify(t, t, torch.ones(2, dtype=torch.long), torch.zeros(2, 4, 5))
    with pytest.raises(ValueError):
        greedy_verify(t, t[:, :2], torch.ones(2, dtype=torch.long), torch.zeros(2, 3, 5))
    with pytest.raises(TypeError):
        greedy_verify(t.float(), t, torch.ones(2, dtype=torch.long), torch.zeros(2, 3, 5))
