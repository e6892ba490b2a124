"""method: eagle2 (dynamic trees) inside real vLLM (CPU, fp32): exactness and acceptance."""

from __future__ import annotations

import pytest
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics
from test_eagle_chain import PROMPTS, greedy, token_ids

pytestmark = pytest.mark.vllm

SETTINGS = [  # (num_speculative_tokens = depth, topk, total_tokens, root_topk)
    (4, 4, 12, None),
    (3, 2, 6, None),
    (5, 3, 16, None),
    (1, 4, 4, None),  # one pass: depth_one_tree, the shape auto sizing picks most at batch 1
    (2, 2, 10, 6),  # a root wider than the beam: 6 + 2 * 2 candidates
]


@pytest.fixture(scope="module")
def vanilla(tiny):
    import vllm

    llm = vllm.LLM(str(tiny["target"]), **ENGINE_KW)
    out = {
        "batch": token_ids(llm.generate(PROMPTS, greedy())),
        "long": token_ids(llm.generate([PROMPTS[-1], PROMPTS[-2]], greedy(48))),
        "cont": token_ids(llm.generate([PROMPTS[6]], greedy(300)))[0],
        "near_max": token_ids(
            llm.generate([" ".join(f"w{(5 * i + 3) % 250}" for i in range(490))], greedy())
        )[0],
    }
    shutdown(llm)
    return out


def _eagle2(target, draft, depth, topk, total, root_topk=None, **kw):
    from eagle_vllm import LLM

    spec = {
        "method": "eagle2",
        "model": str(draft),
        "num_speculative_tokens": depth,
        "topk": topk,
        "total_tokens": total,
    }
    if root_topk is not None:
        spec["root_topk"] = root_topk
    return LLM(str(target), speculative_config=spec, **{**ENGINE_KW, **kw})


@pytest.mark.parametrize("depth,topk,total,root_topk", SETTINGS)
def test_tree_greedy_equals_vanilla(tiny, vanilla, depth, topk, total, root_topk):
    llm = _eagle2(tiny["target"], tiny["draft_noisy"], depth, topk, total, root_topk)
    got = token_ids(llm.generate(PROMPTS, greedy()))
    metrics = spec_metrics(llm)
    shutdown(llm)
    assert got == vanilla["batch"]
    per_depth = metrics["num_accepted_tokens_per_pos"]
    # per-position counters are per-depth acceptance: a path is at most `depth` long
    assert sum(per_depth[depth:]) == 0 and per_depth[min(depth, 2) - 1] > 0, metrics
    assert 1 < mean_acceptance_length(metrics) < depth + 1


def test_topk1_tree_is_the_chain(tiny, vanilla):
    """topk=1 through the tree path drafts and accepts exactly like method eagle."""
    from eagle_vllm import LLM

    results = []
    for spec in (
        {"method": "eagle", "num_speculative_tokens": 4},
        {"method": "eagle2", "num_speculative_tokens": 4, "topk": 1, "total_tokens": 5},
    ):
        llm = LLM(
            str(tiny["target"]),
            speculative_config={**spec, "model": str(tiny["draft_noisy"])},
            **ENGINE_KW,
        )
        results.append((token_ids(llm.generate(PROMPTS, greedy())), spec_metrics(llm)))
        shutdown(llm)
    (chain_out, chain_m), (tree_out, tree_m) = results
    assert chain_out == tree_out == vanilla["batch"]
    assert chain_m == tree_m


def test_tree_beats_chain_at_equal_draft_passes(tiny):
    """Same draft, same number of draft forward passes (4): the tree accepts more."""
    from eagle_vllm import LLM

    taus = {}
    for name, spec in (
        ("chain", {"method": "eagle", "num_speculative_tokens": 4}),
        ("tree", {"method": "eagle2", "num_speculative_tokens": 4, "topk": 4, "total_tokens": 12}),
    ):
        llm = LLM(
            str(tiny["target"]),
            speculative_config={**spec, "model": str(tiny["draft_noisy"])},
            **ENGINE_KW,
        )
        llm.generate(PROMPTS, greedy())
        taus[name] = mean_acceptance_length(spec_metrics(llm))
        shutdown(llm)
    print(f"tau at 4 draft passes: chain {taus['chain']:.3f}, tree {taus['tree']:.3f}")
    assert taus["tree"] > 1.15 * taus["chain"], taus


def test_oracle_tree_accepts_full_depth(tiny):
    """With every candidate kept (1 + topk + (depth-1) * topk^2 = 15 nodes) the
    oracle's argmax path is always in the tree, so every step accepts `depth`.
    (With fewer nodes EAGLE-2 may rightly drop it for likelier shallow siblings.)"""
    depth = 4
    llm = _eagle2(tiny["target_oracle"], tiny["draft_oracle"], depth, 2, 15)
    llm.generate(PROMPTS, greedy())
    metrics = spec_metrics(llm)
    shutdown(llm)
    assert mean_acceptance_length(metrics) == depth + 1, metrics


def test_chunked_prefill_and_prefix_caching_with_trees(tiny, vanilla):
    """Long prompts are chunked (64-token budget) while other requests verify trees.
    Then a prompt that contains 280 generated tokens reuses, through the prefix
    cache, a full KV block written by tree verification and KV compaction: its
    continuation must still be vanilla's."""
    llm = _eagle2(
        tiny["target"],
        tiny["draft_noisy"],
        4,
        4,
        12,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
    )
    first = token_ids(llm.generate([PROMPTS[-1], PROMPTS[-2]], greedy(48)))
    full = token_ids(llm.generate([PROMPTS[6]], greedy(300)))[0]
    # 40 prompt + 280 generated tokens: two full 128-token blocks; with EAGLE, vLLM
    # drops the last matched block (the drafter needs its features), so block 0
    # (prompt + 88 tree-verified tokens) comes from the cache.
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[6]) + vanilla["cont"][:280]
    hits_before = _prefix_cache_hits(llm)
    cont = token_ids(llm.generate([{"prompt_token_ids": prompt_ids}], greedy(20)))[0]
    hits = _prefix_cache_hits(llm) - hits_before
    shutdown(llm)
    assert first == vanilla["long"]
    assert full == vanilla["cont"]
    assert cont == vanilla["cont"][280:300]
    assert hits >= 128  # at least one full block (CPU block size 128) came from the cache


def _prefix_cache_hits(llm) -> float:
    for metric in llm.get_metrics():
        if metric.name == "vllm:prefix_cache_hits":
            return metric.value
    raise AssertionError("vllm:prefix_cache_hits not reported")


def test_tp2_mp_tree_greedy_equals_vanilla(tiny, vanilla, monkeypatch):
    """Tensor parallel 2 with the mp executor: every rank builds the same tree,
    verifies the same path and compacts its own KV shard."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = _eagle2(tiny["target"], tiny["draft_noisy"], 4, 4, 12, tensor_parallel_size=2)
    got = token_ids(llm.generate(PROMPTS, greedy()))
    metrics = spec_metrics(llm)
    shutdown(llm)
    assert got == vanilla["batch"]
    assert mean_acceptance_length(metrics) > 1.2, metrics


@pytest.fixture(scope="module")
def tree_llm(tiny, vanilla):
    llm = _eagle2(tiny["target"], tiny["draft_noisy"], 4, 4, 12)
    yield llm
    shutdown(llm)


def test_tree_mixed_batch_ends_where_vanilla_ends(tree_llm, vanilla):
    """Stop tokens and max_tokens landing inside accepted tree paths."""
    from test_eagle_chain import check_mixed_batch

    check_mixed_batch(tree_llm, vanilla["batch"])


def test_requests_joining_and_leaving(tree_llm, vanilla):
    """Continuous batching: requests arrive while others are mid-generation."""
    from vllm import SamplingParams

    engine = tree_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    pending = list(enumerate(PROMPTS))
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step
            i, prompt = pending.pop(0)
            engine.add_request(f"join-{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    assert [done[f"join-{i}"] for i in range(len(PROMPTS))] == vanilla["batch"]


def test_tree_near_max_model_len(tiny, vanilla, tree_llm):
    """Trees are cut at max_model_len (512) instead of overflowing; output ends exactly there."""
    from vllm import SamplingParams

    prompt = " ".join(f"w{(5 * i + 3) % 250}" for i in range(490))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    got = tree_llm.generate([prompt], params)[0].outputs[0]
    assert len(got.token_ids) == 512 - 490
    assert list(got.token_ids) == vanilla["near_max"]
