"""Property tests for the suffix index and its candidate trees (eagle_vllm.drafting.suffix).

Everything is checked against brute force on random token streams over small alphabets
(many repeats, so the explicit nodes, leaf splits and removals are all exercised), and on
nodes with dozens to hundreds of children (the cached heavy-children lists), with
``SuffixIndex.check_integrity`` after every change:

* counts: ``count(s)`` and ``continuations(s)`` equal counting over the indexed text, for
  every substring of the text (and every one-token extension, present or not), after any
  mix of interleaved extends and removals;
* incremental = from scratch: extending in chunks, or after removals, gives the counts and
  the candidates of an index built in one go from what is left;
* the global cache keeps exactly the last N responses (and the token and per-key
  bounds), and a key's candidates never contain another key's text;
* candidate trees are valid layouts (topological, parents < i, scores non-increasing,
  budget, depth, min_prob) and are exactly the best-first selection of a brute-force
  enumeration of the rule in the module docstring; hand-built cases pin the order.

Hypothesis runs derandomized (the same examples each run); ``SUFFIX_EXAMPLES=500`` runs
more of them.
"""

from __future__ import annotations

import math
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_vllm.drafting import (
    GlobalSuffixCache,
    RequestSuffixes,
    SuffixCandidates,
    SuffixIndex,
    cache_key,
    candidates_to_tree,
    propose,
)

# derandomize: the same examples every run (CI); database=None: no .hypothesis/ folder.
FAST = settings(
    max_examples=int(os.environ.get("SUFFIX_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- brute force
def brute_count(seqs: list[list[int]], pat: list[int], max_len: int) -> int:
    if len(pat) > max_len:
        return 0
    if not pat:
        return sum(len(s) for s in seqs)
    k = len(pat)
    return sum(s[i : i + k] == pat for s in seqs for i in range(len(s) - k + 1))


def brute_continuations(seqs: list[list[int]], pat: list[int], max_len: int) -> dict[int, int]:
    if len(pat) >= max_len:
        return {}
    out: dict[int, int] = {}
    k = len(pat)
    for s in seqs:
        for i in range(len(s) - k):
            if s[i : i + k] == pat:
                out[s[i + k]] = out.get(s[i + k], 0) + 1
    return out


def patterns(seqs: list[list[int]], max_len: int, alphabet: int) -> set[tuple[int, ...]]:
    """Every substring up to max_len, and each extended by every token (mostly absent)."""
    subs = {()}
    for s in seqs:
        for i in range(len(s)):
            for k in range(1, max_len + 1):
                if i + k <= len(s):
                    subs.add(tuple(s[i : i + k]))
    return subs | {p + (t,) for p in subs for t in range(alphabet)}


def assert_counts(ix: SuffixIndex, seqs: list[list[int]], alphabet: int) -> None:
    for p in patterns(seqs, ix.max_len, alphabet):
        pat = list(p)
        assert ix.count(pat) == brute_count(seqs, pat, ix.max_len), pat
        assert ix.continuations(pat) == brute_continuations(seqs, pat, ix.max_len), pat


def brute_propose(
    context: list[int],
    sources: list[tuple[list[list[int]], int]],
    max_nodes: int,
    max_depth: int,
    min_prob: float,
    spec_factor: float | None,
    spec_offset: float = 0.0,
    max_match: int | None = None,
) -> dict[tuple[int, ...], float]:
    """Every path the rule may draft, with its best probability over the match groups.

    ``sources``: (sequences, max_len) per index. Written from the module docstring:
    groups of consecutive match lengths with equal per-source counts, depth bound, summed
    counts, path probability ``p * (count(child) / count(node))``, min_prob cut.
    """
    top_len = max(L for _, L in sources)
    ctx = context[-top_len:]

    def counts(pat: list[int]) -> tuple[int, ...]:
        return tuple(brute_count(seqs, pat, L) for seqs, L in sources)

    top = min(len(ctx), top_len - 1)
    if max_match is not None:
        top = min(top, max_match)
    while top > 0 and not any(counts(ctx[-top:])):
        top -= 1
    groups = []
    m = 1
    while m <= top:
        c = counts(ctx[-m:])
        hi = m
        while hi + 1 <= top and counts(ctx[-(hi + 1) :]) == c:
            hi += 1
        groups.append((m, hi))
        m = hi + 1
    best: dict[tuple[int, ...], float] = {}

    def walk(base: list[int], path: list[int], p: float, limit: int) -> None:
        if len(path) >= limit:
            return
        den = sum(counts(base + path))
        nxt: dict[int, int] = {}
        for seqs, L in sources:
            for t, c in brute_continuations(seqs, base + path, L).items():
                nxt[t] = nxt.get(t, 0) + c
        for t, c in nxt.items():
            q = p * (c / den)
            if q >= min_prob:
                key = tuple(path + [t])
                best[key] = max(best.get(key, 0.0), q)
                walk(base, path + [t], q, limit)

    for lo, hi in groups:
        limit = min(max_depth, top_len - lo)
        if spec_factor is not None:
            limit = min(limit, int(spec_factor * hi + spec_offset + 1e-6))
        walk(ctx[-lo:], [], 1.0, limit)
    return best


def check_candidates(
    cands: SuffixCandidates, root: int, max_nodes: int, max_depth: int, min_prob: float
) -> dict[tuple[int, ...], float]:
    """Layout checks; returns {path: probability} of the drafts."""
    n = cands.num_nodes
    assert len(cands.parents) == len(cands.scores) == len(cands.depths) == n
    assert 1 <= n <= max_nodes
    assert cands.tokens[0] == root and cands.parents[0] == -1
    assert cands.scores[0] == 0.0 and cands.depths[0] == 0
    paths: list[tuple[int, ...]] = [()]
    seen = set()
    for i in range(1, n):
        p = cands.parents[i]
        assert 0 <= p < i
        assert cands.depths[i] == cands.depths[p] + 1 <= max_depth
        assert cands.scores[i] <= cands.scores[p]
        assert math.exp(cands.scores[i]) >= min_prob * (1 - 1e-12)
        assert (p, cands.tokens[i]) not in seen  # siblings differ
        seen.add((p, cands.tokens[i]))
        paths.append(paths[p] + (cands.tokens[i],))
    return {paths[i]: math.exp(cands.scores[i]) for i in range(1, n)}


def assert_best_first(cands: SuffixCandidates, best: dict, root: int, **kw) -> None:
    got = check_candidates(cands, root, kw["max_nodes"], kw["max_depth"], kw["min_prob"])
    for path, p in got.items():  # every draft is a candidate, at its best probability
        assert path in best
        assert math.isclose(p, best[path], rel_tol=1e-9)
    # ... and the drafts are the likeliest candidates (ties at the cut are free).
    want = sorted(best.values(), reverse=True)[: kw["max_nodes"] - 1]
    have = sorted(got.values(), reverse=True)
    assert len(have) == len(want)
    for a, b in zip(have, want):
        assert math.isclose(a, b, rel_tol=1e-9)


# --------------------------------------------------------------------------- the index
ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["extend", "extend", "extend", "remove"]),
        st.integers(0, 3),  # sequence id
        st.lists(st.integers(0, 2), max_size=14),
    ),
    min_size=1,
    max_size=8,
)


@FAST
@given(ops=ops_strategy, max_len=st.integers(1, 6), alphabet=st.integers(1, 3))
def test_counts_match_brute_force(ops, max_len, alphabet):
    """Interleaved extends of several sequences, and removals, against brute counting."""
    ix = SuffixIndex(max_len)
    live: dict[int, list[int]] = {}
    for op, sid, toks in ops:
        toks = [t % alphabet for t in toks]
        if op == "remove":
            if sid in live:
                ix.remove(sid)
                del live[sid]
            continue
        ix.extend(sid, toks)
        live.setdefault(sid, []).extend(toks)
        ix.check_integrity()
        assert_counts(ix, list(live.values()), alphabet)
    assert len(ix) == len(live) and ix.num_tokens == sum(map(len, live.values()))
    # removing everything frees every node but the root
    for sid in list(live):
        ix.remove(sid)
    assert ix.num_nodes == 1 and ix.num_tokens == 0


def test_counts_long_random_streams():
    """Longer seeded streams, every suffix of the growing context checked as it grows."""
    rng = random.Random(1234)
    for _ in range(8):
        alphabet, max_len = rng.randint(2, 4), rng.randint(3, 10)
        text = [rng.randrange(alphabet) for _ in range(rng.randint(50, 120))]
        ix = SuffixIndex(max_len)
        pos = 0
        while pos < len(text):
            step = rng.randint(1, 4)
            ix.extend("r", text[pos : pos + step])
            pos += step
            ctx = text[:pos]
            for m in range(1, min(pos, max_len) + 1):
                suffix = ctx[-m:]
                assert ix.count(suffix) == brute_count([ctx], suffix, max_len)
                assert ix.continuations(suffix) == brute_continuations([ctx], suffix, max_len)
        assert_counts(ix, [text], alphabet)


@FAST
@given(
    seqs=st.lists(st.lists(st.integers(0, 2), max_size=20), min_size=1, max_size=4),
    max_len=st.integers(1, 6),
    data=st.data(),
)
def test_incremental_equals_scratch(seqs, max_len, data):
    """Chunked, interleaved extends and removals equal an index built from what is left."""
    inc = SuffixIndex(max_len)
    cursor = [0] * len(seqs)
    while any(c < len(s) for c, s in zip(cursor, seqs)):
        i = data.draw(st.sampled_from([j for j, s in enumerate(seqs) if cursor[j] < len(s)]))
        k = data.draw(st.integers(1, 5))
        inc.extend(i, seqs[i][cursor[i] : cursor[i] + k])
        cursor[i] += k
    dropped = data.draw(st.sets(st.sampled_from(range(len(seqs)))))
    for i in dropped:
        if seqs[i]:
            inc.remove(i)
    kept = [s for i, s in enumerate(seqs) if i not in dropped and s]
    scratch = SuffixIndex(max_len)
    for i, s in enumerate(kept):
        scratch.extend(i, s)
    assert inc.num_tokens == scratch.num_tokens
    for p in patterns(kept, max_len, 3):
        assert inc.count(list(p)) == scratch.count(list(p))
        assert inc.continuations(list(p)) == scratch.continuations(list(p))
    ctx = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=8))
    kw = dict(max_nodes=8, max_depth=4, min_prob=0.05, spec_factor=None)
    assert propose(ctx, [inc], **kw) == propose(ctx, [scratch], **kw)


# --------------------------------------------------------------------------- global cache
@FAST
@given(
    adds=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), max_size=10)), max_size=25
    ),
    n=st.integers(0, 6),
)
def test_eviction_keeps_exactly_the_last_n(adds, n):
    keys = [cache_key(None, None), cache_key("salt", None), cache_key(None, "lora-a")]
    cache = GlobalSuffixCache(n, max_len=5)
    history: list[tuple[tuple, list[int]]] = []
    for k, toks in adds:
        cache.add(keys[k], toks)
        if n and toks:
            history.append((keys[k], toks))
        last = history[-n:] if n else []
        assert len(cache) == len(last)
        assert cache.num_tokens == sum(len(t) for _, t in last)
        for key in keys:
            mine = [t for kk, t in last if kk == key]
            assert cache.responses(key) == mine
            idx = cache.indexes_for(key)
            assert len(idx) == (1 if mine else 0)  # an emptied key's index is dropped
            if mine:
                for pat in patterns(mine, 5, 4):
                    assert idx[0].count(list(pat)) == brute_count(mine, list(pat), 5)


def test_token_bound_and_per_key_cap():
    cache = GlobalSuffixCache(100, max_len=4, max_tokens=10)
    for i in range(6):
        cache.add((None, None), [i] * 4)
    assert cache.responses((None, None)) == [[4] * 4, [5] * 4]  # 8 tokens <= 10 < 12
    cache = GlobalSuffixCache(100, max_len=4, max_requests_per_key=2)
    for i in range(5):
        cache.add(("a", None), [i])
        cache.add(("b", None), [10 + i])
    assert cache.responses(("a", None)) == [[3], [4]]
    assert cache.responses(("b", None)) == [[13], [14]]
    assert len(cache) == 4
    with pytest.raises(ValueError):
        GlobalSuffixCache(10, max_requests_per_key=0)


def test_seed_is_token_bounded_and_shared():
    cache = GlobalSuffixCache(0, max_len=4)  # no response cache, only the seed
    added = cache.seed([[1, 2, 3], [1, 2, 4], [9] * 10], max_tokens=8)
    assert added == 6
    cache.add(("x", None), [7, 7])  # max_requests=0: nothing is cached
    assert len(cache) == 0
    for key in [("x", None), (None, "lora")]:
        (seed,) = cache.indexes_for(key)
        assert seed.continuations([1, 2]) == {3: 1, 4: 1}


@FAST
@given(
    responses=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        max_size=12,
    ),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    lora=st.booleans(),
)
def test_isolation_by_cache_key(responses, prompt, lora):
    """Key A's candidates come from A's text only: keys have disjoint alphabets."""
    a = cache_key("salt-a", "lora-1" if lora else None)
    b = cache_key("salt-a", None) if lora else cache_key("salt-b", None)
    cache = GlobalSuffixCache(8, max_len=6)
    reqs = RequestSuffixes(cache)
    for i, (is_a, toks) in enumerate(responses):
        key, off = (a, 0) if is_a else (b, 100)
        reqs.add_request(i, [off + t for t in prompt], key)
        reqs.extend(i, [off + t for t in toks])
        reqs.finish(i)
    reqs.add_request("q", prompt, a)
    cands = reqs.propose("q", max_nodes=16, max_depth=4, min_prob=0.0, spec_factor=None)
    assert all(t < 100 for t in cands.tokens)
    assert all(t < 100 for r in cache.responses(a) for t in r)


def test_finish_caches_the_response_only_and_remove_nothing():
    cache = GlobalSuffixCache(4, max_len=4)
    reqs = RequestSuffixes(cache)
    reqs.add_request("a", [1, 2, 3], ("s", None))
    reqs.extend("a", [4])
    reqs.extend("a", [5, 6])
    assert reqs.tokens("a") == [1, 2, 3, 4, 5, 6]
    reqs.finish("a")
    assert cache.responses(("s", None)) == [[4, 5, 6]] and "a" not in reqs
    reqs.add_request("b", [1], ("s", None))
    reqs.extend("b", [9, 9])
    reqs.remove("b")
    assert cache.responses(("s", None)) == [[4, 5, 6]] and len(reqs) == 0
    # the output a user received: cut after a stop token accepted mid-step
    reqs.add_request("c", [1], ("s", None))
    reqs.extend("c", [7, 2, 8])
    assert reqs.response("c") == [7, 2, 8]
    reqs.finish("c", response_len=2)
    assert cache.responses(("s", None)) == [[4, 5, 6], [7, 2]]


def test_clear_drops_responses_and_keeps_the_seed():
    cache = GlobalSuffixCache(4, max_len=4)
    cache.seed([[1, 2, 3]], max_tokens=10)
    cache.add(("s", None), [5, 6, 7])
    cache.clear()
    assert len(cache) == 0 and cache.num_tokens == 0 and cache.keys() == []
    (seed,) = cache.indexes_for(("s", None))
    assert seed.continuations([1]) == {2: 1}
    cache.add(("s", None), [5, 6])
    assert cache.responses(("s", None)) == [[5, 6]]


def test_clear_also_drops_responses_of_requests_running_through_it():
    # vLLM reports a finish one step after the request's last token, so a request that
    # ended before a clear can still be finishing after it: its response must not return
    cache = GlobalSuffixCache(4, max_len=4)
    reqs = RequestSuffixes(cache)
    reqs.add_request("old", [1], ("s", None))
    reqs.extend("old", [7, 8])
    cache.clear()
    reqs.add_request("new", [1], ("s", None))
    reqs.extend("new", [5, 6])
    reqs.finish("old")
    reqs.finish("new")
    assert cache.responses(("s", None)) == [[5, 6]]


# --------------------------------------------------------------------------- candidates
@st.composite
def repetitive(draw, alphabet: int = 3, max_size: int = 40) -> list[int]:
    """A random stream, often followed by a copy of a slice of itself (long matches)."""
    base = draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_size))
    if draw(st.booleans()):
        a = draw(st.integers(0, len(base) - 1))
        b = draw(st.integers(a + 1, len(base)))
        base = base + draw(st.lists(st.integers(0, alphabet - 1), max_size=2)) + base[a:b]
    return base


@FAST
@given(
    own=st.one_of(repetitive(), repetitive(alphabet=5)),
    glob=st.lists(repetitive(max_size=15), max_size=5),
    max_len=st.integers(2, 12),
    max_nodes=st.integers(1, 12),
    max_depth=st.integers(0, 10),
    min_prob=st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.6]),
    spec=st.sampled_from([None, (1.0, 0.0), (0.5, 1.0), (2.0, 0.0)]),
    max_match=st.sampled_from([None, 1, 3]),
)
def test_candidates_against_brute_force(
    own, glob, max_len, max_nodes, max_depth, min_prob, spec, max_match
):
    factor, offset = spec if spec is not None else (None, 0.0)
    cache = GlobalSuffixCache(10, max_len=max_len)
    for g in glob:
        cache.add((None, None), g)
    reqs = RequestSuffixes(cache)
    reqs.add_request("r", own[:3])
    reqs.extend("r", own[3:])
    kw = dict(max_nodes=max_nodes, max_depth=max_depth, min_prob=min_prob)
    kw.update(spec_factor=factor, spec_offset=offset, max_match=max_match)
    fast = reqs.propose("r", **kw)
    own_index = SuffixIndex(max_len)
    own_index.extend(0, own)
    slow = propose(own, [own_index] + cache.indexes_for((None, None)), **kw)
    assert fast == slow  # the request fast path is the generic rule
    if max_depth == 0 or max_nodes == 1 or (max_match is not None and max_match < 1):
        assert fast.num_nodes == 1
        return
    sources = [([own], max_len)] + ([(glob, max_len)] if glob else [])
    best = brute_propose(own, sources, max_nodes, max_depth, min_prob, factor, offset, max_match)
    assert_best_first(fast, best, own[-1], **kw)
    if fast.num_nodes > 1:
        assert 1 <= fast.match_len <= max_len - 1


def test_candidates_against_brute_force_seeded():
    """Many more cases than hypothesis draws, in the regime where depth bounds bind:
    longer texts that end with a copy of an earlier slice of themselves."""
    rng = random.Random(2024)
    for _ in range(300):
        alphabet = rng.choice([3, 5])
        own = [rng.randrange(alphabet) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.7:
            a = rng.randrange(len(own))
            b = rng.randint(a + 1, len(own))
            own = own + [rng.randrange(alphabet) for _ in range(rng.randint(0, 2))] + own[a:b]
        glob = [
            [rng.randrange(3) for _ in range(rng.randint(1, 15))] for _ in range(rng.randint(0, 3))
        ]
        max_len = rng.randint(2, 12)
        factor, offset = rng.choice([(None, 0.0), (1.0, 0.0), (0.5, 1.0), (2.0, 0.0)])
        kw = dict(max_nodes=rng.randint(2, 12), max_depth=rng.randint(1, 10))
        kw.update(
            min_prob=rng.choice([0.0, 0.05, 0.1, 0.3]), spec_factor=factor, spec_offset=offset
        )
        cache = GlobalSuffixCache(10, max_len=max_len)
        for g in glob:
            cache.add((None, None), g)
        reqs = RequestSuffixes(cache)
        reqs.add_request("r", own)
        got = reqs.propose("r", **kw)
        sources = [([own], max_len)] + ([(glob, max_len)] if glob else [])
        best = brute_propose(
            own, sources, kw["max_nodes"], kw["max_depth"], kw["min_prob"], factor, offset
        )
        assert_best_first(got, best, own[-1], **kw)


def test_wide_nodes_stay_exact_under_churn():
    """A token followed by dozens of others (the sorted-children path of wide nodes, and
    its invalidation on every insert and eviction) against brute force."""
    rng = random.Random(99)
    ix = SuffixIndex(4)
    live: dict[int, list[int]] = {}
    for step in range(200):
        if len(live) > 50 or (live and rng.random() < 0.3):  # read after every change
            del live[sid := rng.choice(list(live))]
            ix.remove(sid)
        else:
            resp = [rng.randrange(60) for _ in range(rng.randint(2, 8))]
            resp[0] = 0
            if rng.random() < 0.5:
                resp[1] = rng.randrange(3)  # a few frequent successors among many rare ones
            ix.extend(step, resp)
            live[step] = resp
        history = list(live.values())
        ix.check_integrity()
        assert ix.continuations([0]) == brute_continuations(history, [0], 4)
        if step % 10 == 9:
            assert_counts(ix, history, 2)
        for min_prob in (0.0, 0.02, 0.1):
            kw = dict(max_nodes=8, max_depth=2, min_prob=min_prob, spec_factor=None)
            got = propose([5, 0], [ix], **kw)
            best = brute_propose([5, 0], [(history, 4)], 8, 2, min_prob, None)
            assert_best_first(got, best, 0, **kw)


def test_very_wide_node_thresholds():
    """A node with hundreds of occurrences: queries below, at and above the cut of its
    cached heavy children (1/32 of its count) agree with brute force, across churn."""
    rng = random.Random(5)
    ix = SuffixIndex(3)
    live = {i: [0, min(rng.randrange(30), rng.randrange(30))] for i in range(400)}
    for i, s in live.items():
        ix.extend(i, s)
    for step in range(400):
        # churn: counts cross the heavy cut both ways, heavy children die, ids are reused
        if rng.random() < 0.5:
            del live[i := rng.choice(sorted(live))]
            ix.remove(i)
        else:
            live[i := 1000 + step] = [0, min(rng.randrange(30), rng.randrange(30))]
            ix.extend(i, live[i])
        propose([0], [ix], max_nodes=40, max_depth=1, min_prob=0.03)  # reads the heavy list
        ix.check_integrity()
        if step % 50:
            continue
        history = list(live.values())
        assert ix.continuations([0]) == brute_continuations(history, [0], 3)
        for min_prob in (0.0, 0.004, 0.01, 0.03, 0.1):
            kw = dict(max_nodes=40, max_depth=1, min_prob=min_prob, spec_factor=None)
            got = propose([0], [ix], **kw)
            assert_best_first(
                got, brute_propose([0], [(history, 3)], 40, 1, min_prob, None), 0, **kw
            )


def test_candidates_to_tree_is_a_valid_layout():
    from eagle_vllm.tree.reference import check_tree

    rng = random.Random(7)
    cache = GlobalSuffixCache(20, max_len=8)
    for _ in range(20):
        cache.add((None, None), [rng.randrange(3) for _ in range(30)])
    reqs = RequestSuffixes(cache)
    cands = []
    for r in range(5):
        reqs.add_request(r, [rng.randrange(3) for _ in range(20)])
        cands.append(reqs.propose(r, max_nodes=1 + 3 * r, max_depth=4, min_prob=0.01))
    tree = candidates_to_tree(cands, width=16)
    check_tree(tree)
    assert tree.num_nodes.tolist() == [c.num_nodes for c in cands]
    with pytest.raises(ValueError):
        candidates_to_tree(cands, width=2)


def _global(seqs, max_len=8):
    ix = SuffixIndex(max_len)
    for i, s in enumerate(seqs):
        ix.extend(i, s)
    return ix


def test_hand_longest_match_wins_and_shorter_ones_fill():
    # "1": followed by 2 twice, 3 once, 4 once (count 4); "5 1": by 2 twice, 3 once (count 3)
    ix = _global([[5, 1, 2], [5, 1, 2], [5, 1, 3], [7, 1, 4]])
    c = propose([5, 1], [ix], max_nodes=8, max_depth=3, min_prob=0.1, spec_factor=None)
    assert c.tokens == [1, 2, 3, 4] and c.parents == [-1, 0, 0, 0]
    assert [round(math.exp(s), 6) for s in c.scores[1:]] == [round(2 / 3, 6), 0.333333, 0.25]
    assert c.match_len == 2
    c = propose([5, 1], [ix], max_nodes=3, max_depth=3, min_prob=0.1, spec_factor=None)
    assert c.tokens == [1, 2, 3]
    c = propose([5, 1], [ix], max_nodes=8, max_depth=3, min_prob=0.3, spec_factor=None)
    assert c.tokens == [1, 2, 3]


def test_hand_best_first_depth_ties_and_spec_factor():
    ix = _global([[1, 2, 3, 4]] * 3 + [[1, 5, 6]])
    kw = dict(max_depth=3, min_prob=0.2)
    c = propose([1], [ix], max_nodes=5, spec_factor=None, **kw)
    # 2 (3/4), then its chain 3, 4 (3/4 each: ties go shallower first), then 5 (1/4)
    assert c.tokens == [1, 2, 3, 4, 5] and c.parents == [-1, 0, 1, 2, 0]
    assert c.depths == [0, 1, 2, 3, 1]
    assert c.scores[1] == c.scores[2] == c.scores[3] == math.log(0.75)
    assert propose([1], [ix], max_nodes=4, spec_factor=None, **kw).tokens == [1, 2, 3, 4]
    assert propose([1], [ix], max_nodes=9, spec_factor=None, **kw).tokens == [1, 2, 3, 4, 5, 6]
    # a one-token match drafts one token deep by default (ArcticInference's factor 1)
    assert propose([1], [ix], max_nodes=9, **kw).tokens == [1, 2, 5]
    c = propose([1], [ix], max_nodes=9, spec_factor=1.0, spec_offset=1.0, **kw)
    assert c.tokens == [1, 2, 3, 5, 6] and c.depths == [0, 1, 2, 1, 2]


def test_hand_request_and_global_counts_are_summed():
    cache = GlobalSuffixCache(4, max_len=8)
    cache.add((None, None), [1, 3])
    cache.add((None, None), [1, 3])
    reqs = RequestSuffixes(cache)
    reqs.add_request("r", [8, 1, 2, 9, 8, 1])
    c = reqs.propose("r", max_nodes=8, max_depth=4, min_prob=0.1)
    # "1": own 2 (1 2 earlier, and the context's own), global 2 -> 2: 1/4, 3: 2/4.
    # "8 1": own 2 (8 1 2, and the context's) -> 2: 1/2, then 9: 1/2 (depth 2 = match 2).
    assert c.tokens == [1, 2, 3, 9] and c.parents == [-1, 0, 0, 1]
    assert c.scores[1:] == [math.log(0.5)] * 3
    assert c.match_len == 2
    # without the global cache, the own text alone
    alone = RequestSuffixes()
    alone.add_request("r", [8, 1, 2, 9, 8, 1])
    assert alone.propose("r", max_nodes=8, max_depth=4, min_prob=0.1).tokens == [1, 2, 9]


def test_hand_long_match_drafts_as_deep_as_its_longest_length_allows():
    # The context ends with 11..15, seen once before and followed by 16..20: lengths 1..5
    # have the same two occurrences, one group; its depth is min(max_len - 1, 1.0 * 5).
    reqs = RequestSuffixes(max_len=8)
    reqs.add_request("r", [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 0, 11, 12, 13, 14, 15])
    c = reqs.propose("r", max_nodes=10, max_depth=8, min_prob=0.1)
    assert c.tokens == [15, 16, 17, 18, 19, 20] and c.parents == [-1, 0, 1, 2, 3, 4]
    assert c.scores[1:] == [math.log(0.5)] * 5 and c.match_len == 5
    assert reqs.propose("r", max_nodes=10, max_depth=3, min_prob=0.1).tokens == [15, 16, 17, 18]
    assert reqs.propose("r", max_nodes=10, max_depth=8, min_prob=0.6).tokens == [15]


def test_bad_arguments():
    ix = _global([[1, 2]])
    with pytest.raises(ValueError):
        propose([1], [ix], max_nodes=0)
    with pytest.raises(ValueError):
        propose([1], [ix], min_prob=1.5)
    with pytest.raises(ValueError):
        propose([], [ix])
    with pytest.raises(ValueError):
        SuffixIndex(0)
    reqs = RequestSuffixes()
    reqs.add_request("r", [1])
    with pytest.raises(KeyError):
        reqs.add_request("r", [1])
