"""Suffix candidates inside real vLLM (CPU, fp32): model-free (method suffix) and merged
into EAGLE chains and EAGLE-2 trees; exactness, sources, and cache_salt isolation."""

from __future__ import annotations

import pytest
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics
from test_eagle_chain import PROMPTS, greedy, token_ids

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vanilla(tiny):
    import vllm

    llm = vllm.LLM(str(tiny["target"]), **ENGINE_KW)
    out = {
        "batch": token_ids(llm.generate(PROMPTS, greedy())),
        "long": token_ids(llm.generate([PROMPTS[-1], PROMPTS[-2]], greedy(48))),
    }
    shutdown(llm)
    return out


def _spec(tiny, name: str) -> dict:
    draft = str(tiny["draft_noisy"])
    return {
        "suffix": {"method": "suffix", "suffix": {"max_nodes": 6}},
        "eagle2+suffix": {"method": "eagle2", "model": draft, "num_speculative_tokens": 3,
                          "topk": 2, "total_tokens": 10, "suffix": {"max_nodes": 6}},
        "eagle2+suffix, expanded": {"method": "eagle2", "model": draft,
                                    "num_speculative_tokens": 3, "topk": 2, "total_tokens": 10,
                                    "suffix": {"max_nodes": 6, "expand": True}},
        "eagle+suffix": {"method": "eagle", "model": draft, "num_speculative_tokens": 3,
                         "suffix": {"max_nodes": 4, "max_depth": 6}},
        "eagle2-auto+suffix": {"method": "eagle2", "model": draft, "num_speculative_tokens": 3,
                               "topk": 2, "total_tokens": "auto", "max_total_tokens": 12,
                               "suffix": {"max_nodes": 6}},
    }[name]  # fmt: skip


def _llm(tiny, spec: dict, **kw):
    from eagle_vllm import LLM

    return LLM(str(tiny["target"]), speculative_config=spec, **{**ENGINE_KW, **kw})


def _suffix_stats(llm) -> dict:
    return llm.collective_rpc("eagle_vllm_suffix")[0]


@pytest.mark.parametrize(
    "name",
    ["suffix", "eagle2+suffix", "eagle2+suffix, expanded", "eagle+suffix", "eagle2-auto+suffix"],
)
def test_greedy_equals_vanilla(tiny, vanilla, name, monkeypatch):
    """Continuous batching (nine prompts at once), every source configuration. The auto
    sizer is held at one draft pass and 9 nodes (on this tiny target it would turn drafts
    off): a tree of one pass that accepts deeper paths has suffix nodes in it, priced
    through the sizer's statistics by passes."""
    if name == "eagle2-auto+suffix":
        monkeypatch.setenv("EAGLE_VLLM_SIZER_PIN", "1,9")
    llm = _llm(tiny, _spec(tiny, name))
    got = token_ids(llm.generate(PROMPTS, greedy()))
    metrics, stats = spec_metrics(llm), _suffix_stats(llm)
    shutdown(llm)
    assert got == vanilla["batch"]
    assert mean_acceptance_length(metrics) > 1.2, metrics
    # suffix nodes were verified and accepted (the tiny target's text repeats)
    from_suffix = stats["accepted"]["suffix"] + stats["accepted"]["both"]
    assert from_suffix > 0, stats
    if name != "suffix":
        assert stats["accepted"]["eagle"] + stats["accepted"]["both"] > 0, stats
        # deeper than the head's passes: suffix branches cost no pass
        passes = 1 if name == "eagle2-auto+suffix" else 3
        assert sum(metrics["num_accepted_tokens_per_pos"][passes:]) > 0, metrics
    # with suffix.expand, suffix nodes outside the head's beam are fed to its later passes
    assert (stats["expanded"] > 0) == (name == "eagle2+suffix, expanded"), stats
    assert stats["host_steps"] > 0


def test_hybrid_tree_with_chunked_prefill_and_prefix_caching(tiny, vanilla):
    """Long prompts chunked (64-token budget) while other requests verify merged trees;
    then the same prompts again, their blocks from the prefix cache, and past responses in
    the suffix cache: still vanilla's tokens."""
    llm = _llm(tiny, _spec(tiny, "eagle2+suffix"), enable_prefix_caching=True,
               enable_chunked_prefill=True, max_num_batched_tokens=64)  # fmt: skip
    first = token_ids(llm.generate([PROMPTS[-1], PROMPTS[-2]], greedy(48)))
    before = _suffix_stats(llm)["accepted"]
    again = token_ids(llm.generate([PROMPTS[-1], PROMPTS[-2]], greedy(48)))
    after = _suffix_stats(llm)
    shutdown(llm)
    assert first == again == vanilla["long"]
    assert after["cached_responses"] >= 1
    # the repeated requests drafted from the cached responses: more suffix acceptances
    gained = after["accepted"]["suffix"] + after["accepted"]["both"]
    gained -= before["suffix"] + before["both"]
    assert gained > 0, (before, after)


def _first_drafts(tiny, salts: tuple[str | None, str | None]) -> tuple[list[int], list[int]]:
    """Request A (salt ``salts[0]``) writes a response R; then request B (salt
    ``salts[1]``) whose one-token prompt is R[10]: B's own text holds nothing to draft
    from, so its first suffix candidates can only come from A's cached response.
    Returns (R, B's first candidates, drafted after its first token R[11])."""
    llm = _llm(tiny, {"method": "suffix", "suffix": {"max_nodes": 8, "cache_requests": 16}})
    llm.collective_rpc("eagle_vllm_suffix", kwargs={"record": True})

    def prompt(ids, salt):
        return {"prompt_token_ids": ids, **({} if salt is None else {"cache_salt": salt})}

    a_ids = llm.get_tokenizer().encode(PROMPTS[3])
    response = token_ids(llm.generate([prompt(a_ids, salts[0])], greedy(32)))[0]
    b = token_ids(llm.generate([prompt([response[10]], salts[1])], greedy(8)))[0]
    drafted = _suffix_stats(llm)["drafted"]
    shutdown(llm)
    assert b[:4] == response[11:15]  # the target repeats itself: A's text would match
    a_drafts, b_drafts = drafted.values()  # A's request, then B's
    assert a_drafts
    return response, b_drafts[0]


def test_cache_salt_groups_never_draft_from_each_others_responses(tiny):
    response, same = _first_drafts(tiny, ("alice", "alice"))
    # same salt: the cached response is drafted from (B's first root is R[11], its own
    # first token; a 2-token match drafts 2 deep, spec_factor 1)
    assert len(same) >= 2 and same == response[12 : 12 + len(same)]
    _, other = _first_drafts(tiny, ("alice", "bob"))
    assert other == []  # another salt: nothing of alice's
    _, unsalted = _first_drafts(tiny, ("alice", None))
    assert unsalted == []  # requests without a salt share only among themselves


def test_bad_suffix_sections_fail_before_workers_start(tiny):
    from eagle_vllm.config import EagleConfigError

    with pytest.raises(EagleConfigError, match="suffix.max_nodes"):
        _llm(tiny, {"method": "suffix", "suffix": {"max_nodes": 0}})
    with pytest.raises(EagleConfigError, match="suffix.depth"):
        _llm(tiny, {"method": "suffix", "suffix": {"depth": 4}})
    with pytest.raises(EagleConfigError, match="'model': does not apply"):
        _llm(tiny, {"method": "suffix", "model": str(tiny["draft_noisy"])})
