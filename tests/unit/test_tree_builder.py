"""Property tests for the EAGLE-2 tree builder and the tree layout helpers.

The builder is checked against a brute-force pure-Python reference of the
expand + rerank procedure, against a port of SafeAILab's ``topK_genrate``
selection logic, and against hand-worked tie cases; its trees' shape through the
oracles of ``eagle_vllm.tree.reference``, themselves checked per node here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from eagle_vllm.tree.builder import TreeBuilder, depth_one_tree
from eagle_vllm.tree.layout import DraftTree, ancestor_mask_from_parents
from eagle_vllm.tree.reference import (
    ancestor_mask,
    chain_tree,
    check_tree,
    children_arrays,
    leaf_mask,
    num_candidates,
    num_rows,
    retrieve_indices,
    truncate,
)

torch.set_num_threads(1)

NEG_INF = float("-inf")


# --------------------------------------------------------------------------
# fake draft model: a fixed random distribution per (request, path)
# --------------------------------------------------------------------------
class FakeDraft:
    """Deterministic random log-probs per (request, token path).

    mode "cont": continuous log-softmax values (no ties);
    mode "quant": few distinct values, many exact ties (including log 1 = 0,
        so child score == parent score), but the k-th and (k+1)-th values of
        each row always differ so the proposed token SET is well defined;
    mode "inf": one token at 0.0 and -inf elsewhere (requires V == topk).
    """

    def __init__(self, rng: np.random.RandomState, vocab: int, topk: int, mode: str):
        self.rng, self.vocab, self.topk, self.mode = rng, vocab, topk, mode
        self.cache: dict[tuple, np.ndarray] = {}

    def _make(self) -> np.ndarray:
        v, k, rng = self.vocab, self.topk, self.rng
        if self.mode == "cont":
            x = rng.randn(v) * 2.0
            x = x - x.max()
            x = x - math.log(np.exp(x).sum())
            return x.astype(np.float32)
        if self.mode == "inf":
            x = np.full(v, NEG_INF, dtype=np.float32)
            x[rng.randint(v)] = 0.0
            return x
        top = -rng.randint(0, 3, size=k).astype(np.float32)  # {0, -1, -2}
        rest_hi = top.min() - 1.0
        rest = rest_hi - rng.randint(0, 3, size=v - k).astype(np.float32)
        if v > k and rng.rand() < 0.3:
            rest[rng.rand(v - k) < 0.5] = NEG_INF
        x = np.concatenate([top, rest]).astype(np.float32)
        return x[rng.permutation(v)]

    def __call__(self, b: int, path: tuple) -> np.ndarray:
        key = (b, path)
        if key not in self.cache:
            self.cache[key] = self._make()
        return self.cache[key]


def run_builder(roots, topk, nodes, passes, draft, pad_to=None, order="rank", root_topk=None,
                offers=None):  # fmt: skip
    """Drive TreeBuilder like the runner would; returns (tree, all_logprobs). ``offers``:
    ``(b, path) -> [(token, log value)]``, children offered below each frontier node."""
    bsz = len(roots)
    tb = TreeBuilder(torch.tensor(roots, dtype=torch.long), topk, nodes, passes, root_topk)
    fr = tb.frontier()
    assert fr.width == 1 and fr.depth == 0
    assert fr.tokens[:, 0].tolist() == list(roots)
    paths = [[(r,)] for r in roots]
    all_lp = []
    prev_rows = fr.rows
    prev_anc = fr.ancestor_rows
    for d in range(passes):
        lp = torch.stack(
            [torch.stack([torch.from_numpy(draft(b, p)) for p in paths[b]]) for b in range(bsz)]
        )
        all_lp.append(lp)
        offered = None
        if offers is not None:
            offered = [
                [(j, t, v) for j, path in enumerate(paths[b]) for t, v in offers(b, path)]
                for b in range(bsz)
            ]
        fr = tb.step(lp, offered=offered)
        assert fr.depth == d + 1
        assert fr.width == topk
        pfi = fr.parent_frontier_index.tolist()
        toks = fr.tokens.tolist()
        paths = [[paths[b][pfi[b][j]] + (toks[b][j],) for j in range(fr.width)] for b in range(bsz)]
        # ancestor rows extend the parent's ancestor rows with the new row
        exp_anc = torch.cat(
            [
                prev_anc.gather(1, fr.parent_frontier_index[:, :, None].expand(-1, -1, d + 1)),
                fr.rows.expand(bsz, -1)[:, :, None],
            ],
            dim=2,
        )
        assert torch.equal(fr.ancestor_rows, exp_anc)
        # the tree passes' mask: row r (index r - 1) is the node or an ancestor below the root
        seen = int(fr.rows[-1])
        exp_mask = torch.zeros(bsz, fr.width, seen + 1, dtype=torch.bool)
        exp_mask.scatter_(2, exp_anc, True)
        assert torch.equal(fr.ancestor_mask, exp_mask[:, :, 1:])
        assert int(fr.rows[0]) == int(prev_rows[-1]) + 1
        prev_rows, prev_anc = fr.rows, fr.ancestor_rows
    assert tb.passes_done == passes
    tree = tb.finalize(pad_to=pad_to, order=order)
    lp_all = torch.cat(all_lp, dim=1) if all_lp else None
    if lp_all is not None:
        assert lp_all.shape[1] == num_rows(topk, passes)  # a wider root feeds no more rows
    return tree, lp_all


# --------------------------------------------------------------------------
# brute-force reference
# --------------------------------------------------------------------------
def f32(x) -> np.float32:
    return np.float32(x)


def reference(root, draft_b, topk, passes, nodes, order="rank", root_topk=None, offers_b=None):
    """Pure-Python EAGLE-2 expand + rerank for one request; the root proposes
    ``root_topk`` children (default ``topk``), every later node ``topk``. ``offers_b``:
    ``path -> [(token, log value)]`` offered below a frontier node: a top-k child's score
    rises to the offer (capped by the parent's), another token becomes a candidate
    numbered after the level's top-k children.

    Returns (selected nodes in output order, all candidates); each node is a
    dict with id, token, score, depth, parent (candidate id), prow, path.
    """
    cands = []
    frontier = [dict(id=0, path=(root,), score=f32(0.0), row=0)]
    next_row, nid = 1, 1
    for d in range(1, passes + 1):
        children = []
        for fn in frontier:
            lp = draft_b(fn["path"])
            width = topk if d > 1 or root_topk is None else root_topk
            kids = sorted(range(len(lp)), key=lambda t: (-lp[t], t))[:width]
            for t in kids:
                val = min(f32(lp[t]), f32(0.0))
                children.append(
                    dict(
                        id=nid,
                        token=t,
                        score=f32(fn["score"] + val),
                        depth=d,
                        parent=fn["id"],
                        prow=fn["row"],
                        path=fn["path"] + (t,),
                    )
                )
                nid += 1
        for fn in frontier if offers_b is not None else ():
            for t, v in offers_b(fn["path"]):
                value = min(f32(v), fn["score"])
                mine = [c for c in children if c["parent"] == fn["id"] and c["token"] == t]
                if mine:
                    mine[0]["score"] = max(mine[0]["score"], value)
                    continue
                children.append(
                    dict(id=nid, token=t, score=value, depth=d, parent=fn["id"],
                         prow=fn["row"], path=fn["path"] + (t,))
                )  # fmt: skip
                nid += 1
        cands += children
        best = sorted(children, key=lambda c: (-c["score"], c["id"]))[:topk]
        frontier = [
            dict(id=c["id"], path=c["path"], score=c["score"], row=next_row + j)
            for j, c in enumerate(best)
        ]
        next_row += len(best)
    m = max(0, min(nodes - 1, len(cands)))
    sel = sorted(cands, key=lambda c: (-c["score"], c["depth"], c["id"]))[:m]
    if order == "id":
        sel.sort(key=lambda c: c["id"])
    return sel, cands


def brute_ancestor_mask(parents, n_nodes, width):
    mask = [[False] * width for _ in range(width)]
    for i in range(n_nodes):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = parents[j]
    return mask


def check_against_reference(
    tree: DraftTree, lp_all, roots, topk, passes, budgets, draft, order="rank", root_topk=None
):
    check_tree(tree)
    bsz = len(roots)
    width = tree.max_nodes
    anc = ancestor_mask(tree).tolist()
    first, nxt = children_arrays(tree)
    first, nxt = first.tolist(), nxt.tolist()
    leaves = leaf_mask(tree).tolist()
    ri = retrieve_indices(tree).tolist()
    for b in range(bsz):
        sel, cands = reference(
            roots[b], lambda p, b=b: draft(b, p), topk, passes, budgets[b], order, root_topk
        )
        n = len(sel) + 1
        assert int(tree.num_nodes[b]) == n
        pos = {0: 0}
        for i, c in enumerate(sel):
            pos[c["id"]] = i + 1
        exp_tokens = [roots[b]] + [c["token"] for c in sel]
        exp_parents = [-1] + [pos[c["parent"]] for c in sel]  # KeyError = disconnected
        exp_depths = [0] + [c["depth"] for c in sel]
        exp_scores = [0.0] + [float(c["score"]) for c in sel]
        exp_prow = [-1] + [c["prow"] for c in sel]
        pad = width - n
        assert tree.tokens[b].tolist() == exp_tokens + [-1] * pad
        assert tree.parents[b].tolist() == exp_parents + [-1] * pad
        assert tree.depths[b].tolist() == exp_depths + [-1] * pad
        assert tree.scores[b].tolist() == exp_scores + [NEG_INF] * pad
        assert tree.parent_row[b].tolist() == exp_prow + [-1] * pad

        # selected set == top-m of ALL candidates by value (multiset of scores)
        all_scores = sorted((float(c["score"]) for c in cands), reverse=True)
        assert sorted(exp_scores[1:], reverse=True) == all_scores[: n - 1]
        # and every unselected candidate is not better than the worst selected
        if 1 < n <= len(cands):
            worst = min(exp_scores[1:])
            chosen = {c["id"] for c in sel}
            for c in cands:
                if c["id"] not in chosen:
                    assert float(c["score"]) <= worst
                    if float(c["score"]) == worst:  # tie: never shallower than a chosen one
                        assert c["depth"] >= max(
                            s["depth"] for s in sel if float(s["score"]) == worst
                        )

        # parent_row indexes the distribution each node was drawn from
        for i in range(1, n):
            p = exp_parents[i]
            lp = float(lp_all[b, exp_prow[i], exp_tokens[i]].clamp(max=0.0))
            assert float(f32(f32(exp_scores[p]) + f32(lp))) == exp_scores[i]

        # ancestor mask
        bm = brute_ancestor_mask(exp_parents, n, width)
        assert anc[b] == bm
        # children arrays
        kids = {i: [j for j in range(1, n) if exp_parents[j] == i] for i in range(n)}
        for i in range(width):
            ch = kids.get(i, [])
            assert first[b][i] == (ch[0] if ch else -1)
            for j, a in enumerate(ch):
                assert nxt[b][a] == (ch[j + 1] if j + 1 < len(ch) else -1)
            assert leaves[b][i] == (i < n and not ch)
        # retrieve indices
        leaf_ids = [i for i in range(n) if not kids[i]]
        for row_i, leaf in enumerate(leaf_ids):
            path = []
            j = leaf
            while j >= 0:
                path.append(j)
                j = exp_parents[j]
            path = path[::-1]
            row = ri[b][row_i]
            assert row[: len(path)] == path and all(x == -1 for x in row[len(path) :])
        for row in ri[b][len(leaf_ids) :]:
            assert all(x == -1 for x in row)


def random_case(seed: int, mode: str):
    rng = np.random.RandomState(seed)
    topk = int(rng.randint(1, 6))
    vocab = topk if mode == "inf" else int(rng.randint(max(5, topk + 1), 51))
    passes = int(rng.randint(1, 7))
    bsz = int(rng.randint(1, 5))
    budgets = [int(x) for x in rng.randint(1, 41, size=bsz)]
    roots = [int(x) for x in rng.randint(0, vocab, size=bsz)]
    return rng, topk, vocab, passes, roots, budgets


@pytest.mark.parametrize("mode", ["cont", "quant", "inf"])
def test_builder_matches_reference(mode):
    n_cases = {"cont": 120, "quant": 160, "inf": 60}[mode]
    for seed in range(n_cases):
        rng, topk, vocab, passes, roots, budgets = random_case(1000 * len(mode) + seed, mode)
        draft = FakeDraft(rng, vocab, topk, mode)
        nodes = torch.tensor(budgets) if seed % 2 == 0 else budgets[0]
        if not isinstance(nodes, torch.Tensor):
            budgets = [budgets[0]] * len(roots)
        order = "rank" if seed % 3 else "id"
        tree, lp_all = run_builder(roots, topk, nodes, passes, draft, order=order)
        check_against_reference(tree, lp_all, roots, topk, passes, budgets, draft, order)


def test_wider_root_matches_reference():
    """``root_topk > topk``: the root proposes ``root_topk`` candidates, the beam below
    it stays ``topk`` wide (the best ``topk`` of the root's children), and the rerank
    chooses over all of them."""
    for seed in range(120):
        rng, topk, vocab, passes, roots, budgets = random_case(90_000 + seed, "cont")
        root_topk = topk + int(rng.randint(1, 6))
        vocab = max(vocab, root_topk + 1)
        draft = FakeDraft(rng, vocab, topk, "cont")
        order = "rank" if seed % 3 else "id"
        tree, lp_all = run_builder(
            roots, topk, torch.tensor(budgets), passes, draft, order=order, root_topk=root_topk
        )
        check_against_reference(tree, lp_all, roots, topk, passes, budgets, draft, order, root_topk)
        assert int(tree.num_nodes.max()) <= 1 + num_candidates(topk, passes, root_topk)


def test_wider_root_one_pass_keeps_root_topk_children():
    draft = _const_draft([-0.1 * t for t in range(10)])
    tree, _ = run_builder([7], 2, 16, 1, draft, root_topk=6)
    assert tree.tokens[0].tolist() == [7, 0, 1, 2, 3, 4, 5]
    assert tree.depths[0].tolist() == [0] + [1] * 6
    with pytest.raises(ValueError, match="root_topk"):
        TreeBuilder(torch.tensor([7]), 3, 8, 2, root_topk=2)


# --------------------------------------------------------------------------
# hand-worked ties
# --------------------------------------------------------------------------
def _const_draft(values):
    vals = np.asarray(values, dtype=np.float32)
    return lambda b, path: vals


@pytest.mark.parametrize(
    "order, total, exp_tokens, exp_parents, exp_depths",
    [
        ("id", 1, [9], [-1], [0]),
        ("id", 4, [9, 0, 0, 0], [-1, 0, 1, 2], [0, 1, 2, 3]),
        ("id", 5, [9, 0, 1, 0, 0], [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3]),
        ("id", 7, [9, 0, 1, 0, 1, 0, 0], [-1, 0, 0, 1, 1, 2, 3], [0, 1, 1, 2, 2, 2, 3]),
        ("rank", 1, [9], [-1], [0]),
        ("rank", 4, [9, 0, 0, 0], [-1, 0, 1, 2], [0, 1, 2, 3]),
        ("rank", 5, [9, 0, 0, 0, 1], [-1, 0, 1, 2, 0], [0, 1, 2, 3, 1]),
        ("rank", 7, [9, 0, 0, 0, 1, 1, 0], [-1, 0, 1, 2, 0, 1, 4], [0, 1, 2, 3, 1, 2, 2]),
    ],
)
def test_ties_shallow_first(order, total, exp_tokens, exp_parents, exp_depths):
    # every distribution: token0 -> log 1 = 0, token1 -> -1, rest lower.
    # candidates (id: score, depth): 1:0 d1, 2:-1 d1, 3:0 d2, 4:-1 d2, 5:-1 d2,
    # 6:-2 d2, 7:0 d3, 8:-1 d3, 9:-1 d3, 10:-2 d3.
    draft = _const_draft([0.0, -1.0, -5.0, -6.0, -7.0])
    tree, _ = run_builder([9], 2, total, 3, draft, order=order)
    check_tree(tree)
    assert tree.tokens[0].tolist() == exp_tokens
    assert tree.parents[0].tolist() == exp_parents
    assert tree.depths[0].tolist() == exp_depths


def test_all_equal_scores_stay_connected():
    # all children have log-prob 0 -> every candidate ties with the root's children
    for topk in (1, 2, 3):
        draft = _const_draft([0.0] * topk + [-3.0] * 4)
        for total in range(1, 30):
            tree, _ = run_builder([1, 2], topk, total, 4, draft)
            check_tree(tree)
            n = int(tree.num_nodes[0])
            d = tree.depths[0, :n].tolist()
            assert d == sorted(d)  # shallow-first fill: a BFS prefix
            # with all ties, the kept set is the first n-1 candidates by id
            cnt = [topk] + [topk * topk] * 3
            exp_depths, lvl = [0], 1
            for c in cnt:
                exp_depths += [lvl] * c
                lvl += 1
            assert d == exp_depths[:n]


# --------------------------------------------------------------------------
# SafeAILab port (selection logic of cnets.py topK_genrate, B = 1)
# --------------------------------------------------------------------------
def safeailab_select(root, draft, top_k, passes, total_token):
    sd = passes - 1  # their `depth`: loop iterations after the root forward
    scores_list, parents_list, ss_token = [], [], []
    last_p = torch.from_numpy(draft(0, (root,)))
    top = torch.topk(last_p, top_k, dim=-1)
    topk_index, topk_p = top.indices, top.values
    scores = topk_p
    scores_list.append(scores[None])
    parents_list.append(torch.zeros(1, dtype=torch.long))
    ss_token.append(topk_index[None])
    paths = [(root, int(t)) for t in topk_index]
    topk_cs_index = torch.arange(top_k)
    for i in range(sd):
        bias1 = top_k if i > 0 else 0
        bias2 = max(0, i - 1)
        bias = 1 + top_k**2 * bias2 + bias1
        parents_list.append(topk_cs_index + bias)
        last_p = torch.stack([torch.from_numpy(draft(0, p)) for p in paths])
        top = torch.topk(last_p, top_k, dim=-1)
        topk_index, topk_p = top.indices, top.values
        cu_scores = topk_p + scores[:, None]
        topk_cs = torch.topk(cu_scores.view(-1), top_k, dim=-1)
        topk_cs_index, scores = topk_cs.indices, topk_cs.values
        out_ids = topk_cs_index // top_k
        new_tok = topk_index.view(-1)[topk_cs_index]
        paths = [paths[int(o)] + (int(t),) for o, t in zip(out_ids, new_tok, strict=True)]
        ss_token.append(topk_index)
        scores_list.append(cu_scores)
    scores_list = torch.cat(scores_list, dim=0).view(-1)
    ss_token_list = torch.cat(ss_token, dim=0).view(-1)
    top_scores_index = torch.topk(scores_list, total_token - 1, dim=-1).indices
    top_scores_index = torch.sort(top_scores_index).values
    draft_tokens = torch.cat((torch.tensor([root]), ss_token_list[top_scores_index]))
    draft_parents = torch.cat(parents_list, dim=0)[top_scores_index // top_k].long()
    mask_index = torch.searchsorted(top_scores_index, draft_parents - 1, right=False)
    mask_index[draft_parents == 0] = -1
    mask_index = mask_index + 1
    return draft_tokens.tolist(), [-1] + mask_index.tolist()


def test_matches_safeailab_port():
    for seed in range(60):
        rng = np.random.RandomState(50_000 + seed)
        topk = int(rng.randint(1, 6))
        vocab = int(rng.randint(max(5, topk + 1), 51))
        passes = int(rng.randint(1, 7))
        n_cand = num_candidates(topk, passes)
        total = int(rng.randint(2, n_cand + 2))
        draft = FakeDraft(rng, vocab, topk, "cont")
        root = int(rng.randint(vocab))
        tree, _ = run_builder([root], topk, total, passes, draft, order="id")
        toks, pars = safeailab_select(root, draft, topk, passes, total)
        assert tree.tokens[0].tolist() == toks
        assert tree.parents[0].tolist() == pars
        # their position ids = depths
        assert tree.depths[0].tolist() == [len(_path(pars, i)) - 1 for i in range(len(pars))]


def _path(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


# --------------------------------------------------------------------------
# chains, truncation, padding, budgets
# --------------------------------------------------------------------------
def test_topk1_is_argmax_chain():
    for seed in range(40):
        rng = np.random.RandomState(7_000 + seed)
        vocab = int(rng.randint(5, 51))
        passes = int(rng.randint(1, 7))
        bsz = int(rng.randint(1, 5))
        roots = [int(x) for x in rng.randint(0, vocab, size=bsz)]
        budgets = [int(x) for x in rng.randint(1, 10, size=bsz)]
        draft = FakeDraft(rng, vocab, 1, "cont")
        tree, _ = run_builder(roots, 1, torch.tensor(budgets), passes, draft)
        check_tree(tree)
        k = max(min(budgets) - 1, 0)
        chains, lps, lens = [], [], []
        for b in range(bsz):
            path, toks, lp = (roots[b],), [], []
            for _ in range(passes):
                x = draft(b, path)
                t = int(np.argmax(x))
                toks.append(t)
                lp.append(float(x[t]))
                path = path + (t,)
            chains.append(toks)
            lps.append(lp)
            lens.append(min(passes, budgets[b] - 1))
        ct = chain_tree(
            torch.tensor(chains),
            torch.tensor(roots),
            lengths=torch.tensor(lens),
            logprobs=torch.tensor(lps).clamp(max=0.0),
        )
        ct = truncate(ct, ct.num_nodes)  # shrink to the same width
        assert torch.equal(tree.tokens, ct.tokens)
        assert torch.equal(tree.parents, ct.parents)
        assert torch.equal(tree.depths, ct.depths)
        assert torch.equal(tree.num_nodes, ct.num_nodes)
        assert torch.equal(tree.parent_row, ct.parent_row)
        assert torch.allclose(tree.scores, ct.scores)
        assert k >= 0


def test_chain_tree_layout():
    toks = torch.tensor([[5, 6, 7], [1, 2, 3]])
    ct = chain_tree(toks, torch.tensor([4, 0]), lengths=torch.tensor([3, 1]))
    check_tree(ct)
    assert ct.tokens.tolist() == [[4, 5, 6, 7], [0, 1, -1, -1]]
    assert ct.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, -1, -1]]
    assert ct.depths.tolist() == [[0, 1, 2, 3], [0, 1, -1, -1]]
    assert ct.num_nodes.tolist() == [4, 2]
    assert retrieve_indices(ct).tolist() == [[[0, 1, 2, 3]], [[0, 1, -1, -1]]]
    m = ancestor_mask(ct)
    assert m[0].tolist() == torch.tril(torch.ones(4, 4, dtype=torch.bool)).tolist()
    assert m[1].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    md = ancestor_mask(ct, pad_diag=True)
    assert md[1].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


def test_truncate_keeps_valid_prefix():
    for seed in range(40):
        rng, topk, vocab, passes, roots, budgets = random_case(90_000 + seed, "quant")
        draft = FakeDraft(rng, vocab, topk, "quant")
        tree, _ = run_builder(roots, topk, torch.tensor(budgets), passes, draft)
        bsz = len(roots)
        mx = torch.tensor(rng.randint(0, 42, size=bsz))
        for shrink in (True, False):
            t2 = truncate(tree, mx, shrink=shrink)
            check_tree(t2)
            k = torch.minimum(tree.num_nodes, mx.clamp(min=1))
            assert torch.equal(t2.num_nodes, k)
            w = t2.max_nodes
            assert w == (int(k.max()) if shrink else tree.max_nodes)
            for b in range(bsz):
                kb = int(k[b])
                assert t2.tokens[b, :kb].tolist() == tree.tokens[b, :kb].tolist()
                assert t2.parents[b, :kb].tolist() == tree.parents[b, :kb].tolist()
                assert t2.scores[b, :kb].tolist() == tree.scores[b, :kb].tolist()
                assert t2.parent_row[b, :kb].tolist() == tree.parent_row[b, :kb].tolist()
            a1 = ancestor_mask(tree)[:, :w, :w]
            a2 = ancestor_mask(t2)
            keep = t2.valid_mask()
            assert torch.equal(a2, a1 & keep[:, :, None] & keep[:, None, :])
        t3 = truncate(tree, 1)
        assert t3.num_nodes.tolist() == [1] * bsz and t3.max_nodes == 1


def test_per_request_budgets_and_pad_to():
    rng = np.random.RandomState(3)
    draft = FakeDraft(rng, 20, 3, "cont")
    roots = [1, 2, 3, 4]
    budgets = torch.tensor([1, 2, 9, 100])  # root only, one draft, 8 drafts, clamped
    tree, lp = run_builder(roots, 3, budgets, 4, draft)
    n_cand = num_candidates(3, 4)
    assert tree.num_nodes.tolist() == [1, 2, 9, n_cand + 1]
    assert tree.max_nodes == n_cand + 1
    check_against_reference(tree, lp, roots, 3, 4, budgets.tolist(), draft)
    padded, _ = run_builder(roots, 3, budgets, 4, draft, pad_to=64)
    assert padded.max_nodes == 64
    assert trees_equal(truncate(padded, padded.num_nodes), tree)
    # pad_to below the budget clamps it; in rank order a prefix is the
    # optimal smaller tree, so truncation == building with a smaller budget
    small, _ = run_builder(roots, 3, budgets, 4, draft, pad_to=5)
    assert small.num_nodes.tolist() == [1, 2, 5, 5]
    assert trees_equal(small, truncate(tree, 5))
    small_id, lp = run_builder(roots, 3, budgets.clamp(max=5), 4, draft, order="id")
    check_against_reference(small_id, lp, roots, 3, 4, [1, 2, 5, 5], draft, "id")


def trees_equal(a: DraftTree, b: DraftTree) -> bool:
    return all(
        torch.equal(getattr(a, f), getattr(b, f))
        for f in ("tokens", "parents", "depths", "num_nodes", "scores", "parent_row")
    )


def test_no_drafts():
    tb = TreeBuilder(torch.tensor([3, 4]), topk=4, nodes=1, passes=3)
    tree = tb.finalize()  # without any step
    check_tree(tree)
    assert tree.tokens.tolist() == [[3], [4]] and tree.num_nodes.tolist() == [1, 1]
    tb = TreeBuilder(torch.tensor([3]), topk=2, nodes=5, passes=0)
    assert tb.finalize().num_nodes.tolist() == [1]
    with pytest.raises(RuntimeError):
        tb.step(torch.zeros(1, 1, 5))


def test_partial_steps_and_errors():
    tb = TreeBuilder(torch.tensor([0]), topk=2, nodes=10, passes=3)
    with pytest.raises(ValueError):
        tb.step(torch.zeros(1, 2, 5))  # wrong width
    with pytest.raises(ValueError):
        tb.step(torch.zeros(1, 1, 1))  # vocab < topk
    fr = tb.step(torch.log_softmax(torch.randn(1, 1, 6), -1))
    tree = tb.finalize()  # finalize after fewer than `passes` steps
    check_tree(tree)
    assert tree.num_nodes.tolist() == [3]
    assert fr.rows.tolist() == [1, 2]


def test_nan_and_positive_logprobs_are_sanitised():
    lp = torch.tensor([[[float("nan"), 1e-6, -1.0, -2.0, -3.0]]])
    tb = TreeBuilder(torch.tensor([0]), topk=3, nodes=4, passes=1)
    tb.step(lp)
    tree = tb.finalize()
    check_tree(tree)
    assert tree.scores[0].tolist() == [0.0, 0.0, -1.0, NEG_INF]
    assert tree.tokens[0].tolist() == [0, 1, 2, 0]


def test_reduced_vocabulary_columns_map_to_token_ids():
    """Drafting over a token subset (draft_vocab) gives the tree that the full vocabulary
    with -inf outside the subset gives."""
    gen = torch.Generator().manual_seed(3)
    batch, vocab, sub, topk, passes = 3, 50, 12, 3, 3
    token_ids = torch.randperm(vocab, generator=gen)[:sub]
    roots = torch.randint(0, vocab, (batch,), generator=gen)
    full_b = TreeBuilder(roots, topk, 8, passes)
    sub_b = TreeBuilder(roots, topk, 8, passes)
    for _ in range(passes):
        width = full_b.frontier().width
        logits = torch.randn(batch, width, sub, generator=gen)
        full = torch.full((batch, width, vocab), float("-inf"))
        full[:, :, token_ids] = logits
        full_b.step(torch.log_softmax(full, -1))
        sub_b.step(torch.log_softmax(logits, -1), token_ids=token_ids)
    a, b = full_b.finalize(), sub_b.finalize()
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.isin(b.tokens[:, 1:], token_ids).all()


def test_caller_chosen_children_keep_their_order_and_scores():
    """Sampled drafting passes the children itself: they are used as given (draw order
    kept, no top-k), mapped through the reduced vocabulary, scored by their log-probs."""
    gen = torch.Generator().manual_seed(4)
    batch, sub, passes = 2, 9, 3
    token_ids = torch.arange(100, 100 + sub)
    builder = TreeBuilder(torch.tensor([5, 6]), 1, passes + 1, passes)
    chosen, expected_score = [], torch.zeros(batch)
    for _ in range(passes):
        logprobs = torch.log_softmax(torch.randn(batch, 1, sub, generator=gen), -1)
        # the least likely column: top-k would never pick it
        pick = logprobs.argmin(dim=-1, keepdim=True)
        builder.step(logprobs, token_ids, children=pick)
        chosen.append(token_ids[pick[:, 0, 0]])
        expected_score += logprobs.gather(-1, pick)[:, 0, 0]
    tree = builder.finalize()
    assert torch.equal(tree.tokens[:, 1:], torch.stack(chosen, dim=1))
    assert torch.equal(tree.parents[0], torch.tensor([-1, 0, 1, 2]))
    assert torch.allclose(tree.scores[:, -1], expected_score)
    with pytest.raises(ValueError, match="children"):
        TreeBuilder(torch.tensor([5, 6]), 1, 2, 1).step(logprobs, children=pick[:1])


@pytest.mark.parametrize("seed", range(4))
def test_ancestor_mask_matches_a_walk_up_the_tree(seed):
    """Reachability squaring against walking each node's parent pointers, on ragged
    random trees (chains included: the deepest case for the squaring's stop test)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 5, 16, 33]
    width = max(sizes)
    parents = torch.full((len(sizes), width), -1, dtype=torch.long)
    for r, n in enumerate(sizes):
        for i in range(1, n):
            chain = seed % 2 == 1 and r == len(sizes) - 1
            parents[r, i] = i - 1 if chain else int(torch.randint(0, i, (1,), generator=g))
    mask = ancestor_mask_from_parents(parents, torch.tensor(sizes))
    want = torch.zeros(len(sizes), width, width, dtype=torch.bool)
    for r, n in enumerate(sizes):
        for i in range(n):
            j = i
            while j >= 0:
                want[r, i, j] = True
                j = int(parents[r, j])
    assert torch.equal(mask, want)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("topk,total", [(1, 2), (3, 4), (4, 4), (4, 9), (8, 3), (2, 1)])
def test_depth_one_tree_equals_the_builder(seed, topk, total):
    """The one-pass shortcut builds exactly the builder's tree: ties (coarsely
    quantised log-probs), NaN, positive rounding and a non-monotonic reduced vocabulary
    included."""
    g = torch.Generator().manual_seed(seed)
    b, v = 5, 12
    logprobs = torch.log_softmax(torch.randn(b, 1, v, generator=g), dim=-1)
    logprobs = (logprobs * 2).round() / 2  # many exact ties
    logprobs[0, 0, 3] = float("nan")
    logprobs[1, 0, 5] = 1e-7
    token_ids = torch.randperm(1000, generator=g)[:v] if seed % 2 else None
    roots = torch.randint(0, 1000, (b,), generator=g)

    got = depth_one_tree(roots, logprobs, topk, total, token_ids)
    # the shortcut's width is the root's: topk, or a narrower beam under a wider root
    for beam in {topk, 1}:
        builder = TreeBuilder(roots, beam, total, passes=1, root_topk=topk)
        builder.step(logprobs, token_ids)
        expected = builder.finalize(pad_to=total)
        for name in ("tokens", "parents", "depths", "num_nodes", "scores", "parent_row"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name
    check_tree(got)


def _suffix_offers(rng: np.random.RandomState, vocab: int, bsz: int):
    """Random offers per (request, path): none for most paths, else one to three tokens
    with log values from certain to unlikely (ties with the head's scores included)."""
    table: dict[tuple, list[tuple[int, float]]] = {}

    def offers(b: int, path: tuple) -> list[tuple[int, float]]:
        key = (b, path)
        if key not in table:
            count = int(rng.choice([0, 0, 1, 2, 3]))
            tokens = rng.choice(vocab, size=min(count, vocab), replace=False)
            table[key] = [(int(t), float(rng.choice([0.0, -0.5, -1.0, -3.0, -9.0])))
                          for t in tokens]  # fmt: skip
        return table[key]

    return offers


@pytest.mark.parametrize("mode", ["cont", "quant"])
def test_offered_children_match_reference(mode):
    """Children offered by another source (suffix candidates): the frontier and the
    rerank take them on their capped values, a top-k child offered again keeps one node
    with the larger score, and their parent rows are their parents' frontier rows. Batches
    with different numbers of offers per request pad the level, and padding is never
    kept, even when the budget exceeds every real candidate."""
    for seed in range(80):
        rng, topk, vocab, passes, roots, budgets = random_case(7000 + seed, mode)
        draft = FakeDraft(rng, vocab, topk, mode)
        offers = _suffix_offers(rng, vocab, len(roots))
        tree, _ = run_builder(roots, topk, torch.tensor(budgets), passes, draft, offers=offers)
        check_tree(tree)
        for b, root in enumerate(roots):
            sel, _ = reference(root, lambda p, b=b, d=draft: d(b, p), topk, passes, budgets[b],
                               offers_b=lambda p, b=b, o=offers: o(b, p))  # fmt: skip
            n = len(sel) + 1
            assert int(tree.num_nodes[b]) == n, seed
            pos = {0: 0}
            for i, c in enumerate(sel):
                pos[c["id"]] = i + 1
            pad = tree.max_nodes - n
            assert tree.tokens[b].tolist() == [root] + [c["token"] for c in sel] + [-1] * pad
            assert tree.parents[b].tolist() == [-1] + [pos[c["parent"]] for c in sel] + [-1] * pad
            assert tree.depths[b].tolist() == [0] + [c["depth"] for c in sel] + [-1] * pad
            assert tree.scores[b].tolist() == (
                [0.0] + [float(c["score"]) for c in sel] + [NEG_INF] * pad
            )
            assert tree.parent_row[b].tolist() == [-1] + [c["prow"] for c in sel] + [-1] * pad


def test_an_offered_node_is_expanded_by_the_next_pass():
    """A token the head ranks last, offered as certain below the root, takes a frontier
    row: the next pass feeds it (its ancestors the root and its own row) and its children
    join the tree beneath it."""
    topk = 2
    root_lp = torch.log_softmax(torch.tensor([[[4.0, 3.0, 0.0, 0.0, 0.0, -5.0]]]), -1)
    builder = TreeBuilder(torch.tensor([9]), topk, 6, 2)
    frontier = builder.step(root_lp, offered=[[(0, 5, 0.0)]])
    assert frontier.tokens.tolist() == [[5, 0]]  # the offer (value 1) before token 0
    assert frontier.host_lists() == ([[5, 0]], [[0, 0]])
    assert frontier.ancestor_rows.tolist() == [[[0, 1], [0, 2]]]
    child_lp = torch.log_softmax(torch.tensor([[[0.0, 0.0, 0.0, 5.0, 0.0, 0.0]] * 2]), -1)
    builder.step(child_lp)
    tree = builder.finalize()
    check_tree(tree)
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    assert tokens[:3] == [9, 5, 3] and parents[:3] == [-1, 0, 1]
    assert tree.parent_row[0].tolist()[:3] == [-1, 0, 1]


def test_offers_need_top_k_children_and_one_list_per_request():
    lp = torch.log_softmax(torch.randn(2, 1, 8), -1)
    with pytest.raises(ValueError, match="one list per request"):
        TreeBuilder(torch.tensor([1, 2]), 2, 4, 2).step(lp, offered=[[]])
    with pytest.raises(ValueError, match="offered children need the top-k"):
        TreeBuilder(torch.tensor([1, 2]), 1, 4, 2).step(
            lp, children=torch.zeros(2, 1, 1, dtype=torch.long), offered=[[], []]
        )
