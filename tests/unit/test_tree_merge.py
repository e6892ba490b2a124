"""tree/merge.py: EAGLE nodes and suffix candidates merged into one reranked tree."""

from __future__ import annotations

import math
import random

import pytest
import torch

from eagle_vllm.drafting.suffix import SuffixCandidates
from eagle_vllm.engine.suffix_drafts import _pass_depths
from eagle_vllm.sizing import SourceCalibration
from eagle_vllm.tree.builder import TreeBuilder
from eagle_vllm.tree.merge import BOTH, EAGLE, ROOT, SUFFIX, SuffixGuide, merge_trees
from eagle_vllm.tree.reference import check_tree


def _eagle_tree(root: int, tokens, parents, probs):
    """A one-request DraftTree from lists (node 0 = root)."""
    from eagle_vllm.tree.layout import DraftTree

    n = len(tokens) + 1
    return DraftTree(
        tokens=torch.tensor([[root, *tokens]]),
        parents=torch.tensor([[-1, *parents]]),
        depths=torch.tensor([_depths([-1, *parents])]),
        num_nodes=torch.tensor([n]),
        scores=torch.tensor([[0.0, *[math.log(p) for p in probs]]]),
    )


def _depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def _suffix(root: int, tokens, parents, probs) -> SuffixCandidates:
    parents = [-1, *parents]
    return SuffixCandidates([root, *tokens], parents, [0.0, *[math.log(p) for p in probs]],
                            _depths(parents))  # fmt: skip


def _paths(tree, b=0):
    """Each kept node as its token path from the root."""
    n = int(tree.num_nodes[b])
    toks, pars = tree.tokens[b].tolist(), tree.parents[b].tolist()
    out = []
    for i in range(n):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = pars[j]
        out.append(tuple(reversed(path)))
    return out


def test_a_suffix_branch_repeating_an_eagle_node_is_one_node():
    eagle = _eagle_tree(7, [1, 2, 3], [0, 0, 1], [0.6, 0.3, 0.4])
    # suffix: 1 -> 3 -> 9 (the 1 -> 3 path repeats EAGLE's), and 5
    suffix = _suffix(7, [1, 3, 9, 5], [0, 1, 2, 0], [0.5, 0.5, 0.5, 0.2])
    merged = merge_trees(eagle, [suffix], [10])
    tree = merged.tree
    check_tree(tree)
    paths = _paths(tree)
    assert len(paths) == len(set(paths)) == 6  # root, 1, 2, (1,3), (1,3,9), 5
    source = dict(zip(paths, merged.sources[0].tolist()))
    assert source[()] == ROOT
    assert source[(1,)] == BOTH and source[(1, 3)] == BOTH
    assert source[(2,)] == EAGLE and source[(1, 3, 9)] == SUFFIX and source[(5,)] == SUFFIX
    # a BOTH node's raw value is the larger estimate
    raw = dict(zip(paths, merged.raw_values[0].tolist()))
    assert raw[(1,)] == pytest.approx(0.6) and raw[(1, 3)] == pytest.approx(0.5)


def test_rerank_keeps_the_best_nodes_on_one_scale_and_stays_a_tree():
    eagle = _eagle_tree(7, [1, 2], [0, 0], [0.5, 0.4])
    suffix = _suffix(7, [4, 8], [0, 1], [0.9, 0.9])
    tree = merge_trees(eagle, [suffix], [3]).tree  # root + 2
    assert _paths(tree) == [(), (4,), (4, 8)]
    # calibration: suffix nodes are accepted a tenth as often as they claim
    factors = torch.ones(4, 4)
    factors[SUFFIX] = 0.1
    tree = merge_trees(eagle, [suffix], [3], factors).tree
    assert _paths(tree) == [(), (1,), (2,)]


def test_a_child_never_outranks_its_parent():
    """A suffix child whose own value exceeds its (EAGLE) parent's is capped by it."""
    eagle = _eagle_tree(7, [1], [0], [0.2])
    suffix = _suffix(7, [1, 6], [0, 1], [0.1, 0.1])
    factors = torch.ones(4, 4)
    factors[SUFFIX, 2] = 50.0  # the depth-2 suffix node claims more than its parent
    merged = merge_trees(eagle, [suffix], [2], factors)
    assert _paths(merged.tree) == [(), (1,)]
    scores = merge_trees(eagle, [suffix], [3], factors).tree.scores[0].tolist()
    assert scores[2] <= scores[1]


def test_rows_without_suffix_candidates_keep_the_eagle_tree_as_built():
    torch.manual_seed(0)
    builder = TreeBuilder(torch.tensor([3, 4]), topk=2, nodes=6, passes=3)
    for _ in range(3):
        width = builder.frontier().width
        builder.step(torch.log_softmax(torch.randn(2, width, 11), dim=-1))
    tree = builder.finalize(pad_to=6)
    merged = merge_trees(tree, [None, SuffixCandidates([4], [-1], [0.0], [0])], [6, 6])
    for name in ("tokens", "parents", "depths", "num_nodes"):
        assert torch.equal(getattr(merged.tree, name), getattr(tree, name)), name
    assert merged.sources[:, 1:].eq(EAGLE).all()


def test_suffix_only_trees_and_roots_must_agree():
    tree = merge_trees(None, [_suffix(5, [1, 2], [0, 1], [0.8, 0.5])], [8]).tree
    assert _paths(tree) == [(), (1,), (1, 2)]
    with pytest.raises(ValueError, match="root"):
        merge_trees(_eagle_tree(7, [1], [0], [0.5]), [_suffix(8, [1], [0], [0.5])], [4])


def _reference(eagle_nodes, suffix_nodes, budget, factors):
    """Brute force: union by path, values = calibrated raw capped along the path, then
    the best budget - 1 by (value desc, depth asc)."""
    raw = {}  # path -> {source: value}
    for source, nodes in ((EAGLE, eagle_nodes), (SUFFIX, suffix_nodes)):
        for path, value in nodes.items():
            cur = raw.setdefault(path, {})
            cur[source] = max(cur.get(source, 0.0), value)
    values = {}
    for path in sorted(raw, key=len):
        src = sum(raw[path])  # EAGLE | SUFFIX == BOTH (1 + 2)
        v = max(raw[path].values()) * factors[src][min(len(path), len(factors[src]) - 1)]
        values[path] = min(v, values.get(path[:-1], 1.0))
    ranked = sorted(values, key=lambda p: (-values[p], len(p)))
    return [(), *ranked[: budget - 1]]


@pytest.mark.parametrize("seed", range(40))
def test_merge_matches_a_brute_force_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])

    def random_tree(n, max_depth):
        tokens, parents, probs, paths = [], [], [], {(): 0}
        keys = [()]
        for _ in range(n):
            parent_path = rng.choice(keys)
            if len(parent_path) >= max_depth:
                continue
            t = rng.randrange(vocab)
            path = (*parent_path, t)
            if path in paths:
                continue
            paths[path] = len(keys)
            keys.append(path)
            tokens.append(t)
            parents.append(paths[parent_path])
            parent_p = 1.0 if not parent_path else probs[paths[parent_path] - 1]
            probs.append(parent_p * rng.uniform(0.05, 1.0))
        return tokens, parents, probs, {k: (probs[i - 1] if i else 1.0) for k, i in paths.items()}

    e_tok, e_par, e_p, e_nodes = random_tree(rng.randrange(0, 12), 4)
    s_tok, s_par, s_p, s_nodes = random_tree(rng.randrange(0, 12), 8)
    budget = rng.randrange(1, 20)
    factors = [[rng.uniform(0.2, 2.0) for _ in range(6)] for _ in range(4)]
    eagle = _eagle_tree(99, e_tok, e_par, e_p) if e_tok else _eagle_tree(99, [], [], [])
    merged = merge_trees(eagle, [_suffix(99, s_tok, s_par, s_p)], [budget],
                         torch.tensor(factors))  # fmt: skip
    check_tree(merged.tree)
    e_nodes.pop(())
    s_nodes.pop(())
    if not s_tok:  # nothing to merge: the EAGLE tree as built
        assert _paths(merged.tree) == [(), *list(e_nodes)[: budget - 1]]
        return
    assert _paths(merged.tree) == _reference(e_nodes, s_nodes, budget, factors)


def test_pass_depths_count_only_eagle_only_nodes():
    eagle = _eagle_tree(7, [1, 2, 3], [0, 1, 2], [0.9, 0.8, 0.7])
    suffix = _suffix(7, [1, 4, 5], [0, 1, 2], [0.95, 0.9, 0.85])
    merged = merge_trees(eagle, [suffix], [10])
    paths = _paths(merged.tree)
    depth_of = dict(zip(paths, _pass_depths(merged.tree, merged.sources)[0].tolist()))
    assert depth_of[(1,)] == 0  # both sources: exists without a pass
    assert depth_of[(1, 4)] == 0 and depth_of[(1, 4, 5)] == 0
    assert depth_of[(1, 2)] == 2 and depth_of[(1, 2, 3)] == 3


def test_source_calibration_learns_acceptance_over_prediction():
    cal = SourceCalibration(max_depth=3, decay=1.0, prior=1.0)
    assert torch.allclose(cal.factors(), torch.ones(4, 4, dtype=torch.float64))
    # suffix depth-1 nodes claim 0.5 and are accepted 1 time in 10
    sources = torch.tensor([[ROOT, SUFFIX, EAGLE]] * 10)
    depths = torch.tensor([[0, 1, 1]] * 10)
    raw = torch.tensor([[1.0, 0.5, 0.5]] * 10)
    accepted = torch.zeros(10, 3, dtype=torch.bool)
    accepted[0, 1] = True
    accepted[:, 2] = True  # the EAGLE node: always
    cal.observe(sources, depths, raw, accepted, torch.ones(10, 3, dtype=torch.bool))
    f = cal.factors()
    assert f[SUFFIX, 1] == pytest.approx((1 + 1) / (5 + 1))
    assert f[EAGLE, 1] == pytest.approx((10 + 1) / (5 + 1))
    assert f[BOTH, 1] == 1.0 and f[SUFFIX, 2] == 1.0
    assert cal.accepted_share()[EAGLE] == pytest.approx(10 / 11)


# ------------------------------------------------------------------ SuffixGuide
def _guide_tree():
    # root 7: a=1 (0.9) -> c=3 (0.8) -> d=4 (0.8); b=2 (0.3)
    return _suffix(7, [1, 2, 3, 4], [0, 0, 1, 3], [0.9, 0.3, 0.72, 0.576])


def test_guide_offers_the_children_of_the_nodes_the_frontier_stands_on():
    guide = SuffixGuide([_guide_tree(), None, _suffix(5, [], [], [])])
    offers = guide.offers()
    assert [[(r, t) for r, t, _ in o] for o in offers] == [[(0, 1), (0, 2)], [], []]
    assert offers[0][0][2] == pytest.approx(math.log(0.9))
    # the next frontier: row 1 is the suffix's node 1 (token 1 under the root), row 0 not
    guide.advance([[6, 1], [], []], [[0, 0], [], []])
    offers = guide.offers()
    assert [(r, t) for r, t, _ in offers[0]] == [(1, 3)]
    assert offers[0][0][2] == pytest.approx(math.log(0.72))
    # a frontier that leaves the suffix tree ends the guide's offers
    guide.advance([[6, 8], [], []], [[1, 0], [], []])
    assert guide.offers() is None


def test_guide_values_suffix_nodes_on_the_heads_scale():
    """An offer's log value is the path probability times calibration[SUFFIX, depth] over
    calibration[EAGLE, depth]; depths past the table use its last column."""
    calibration = torch.ones(4, 3)
    calibration[SUFFIX] = torch.tensor([1.0, 0.5, 0.2])
    calibration[EAGLE] = torch.tensor([1.0, 0.25, 0.8])
    guide = SuffixGuide([_guide_tree()], calibration)
    first = guide.offers()[0]
    assert first[0][2] == pytest.approx(math.log(0.9 * 0.5 / 0.25))
    guide.advance([[1]], [[0]])
    guide.advance([[3]], [[0]])
    ((row, token, value),) = guide.offers()[0]
    assert (row, token) == (0, 4) and value == pytest.approx(math.log(0.576 * 0.2 / 0.8))


def test_guided_expansion_drafts_the_heads_children_below_a_suffix_node():
    """The head ranks the suffix's first token outside its beam; offered, it is fed to the
    second pass, and the merged tree holds the head's child below it (source EAGLE) under
    the suffix node (source BOTH), beside the suffix's own branch."""
    vocab, topk = 8, 2
    suffix = [_suffix(7, [5, 6], [0, 1], [0.9, 0.5])]
    guide = SuffixGuide(suffix)
    builder = TreeBuilder(torch.tensor([7]), topk, 8, 2)
    root_logits = torch.tensor([3.0, 2.5, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0])
    frontier = builder.step(torch.log_softmax(root_logits, -1)[None, None], offered=guide.offers())
    guide.advance(*frontier.host_lists())
    assert frontier.host_lists()[0] == [[5, 0]]
    # below token 5 the head is sure of token 2 (not the suffix's 6)
    second = torch.full((1, topk, vocab), -20.0)
    second[0, 0, 2] = 0.0
    second[0, 1, 3] = 0.0
    builder.step(torch.log_softmax(second, -1))
    merged = merge_trees(builder.finalize(), suffix, [8])
    paths = dict(zip(_paths(merged.tree), merged.sources[0].tolist()))
    assert paths[(5,)] == BOTH
    assert paths[(5, 2)] == EAGLE
    assert paths[(5, 6)] == SUFFIX
    check_tree(merged.tree)
