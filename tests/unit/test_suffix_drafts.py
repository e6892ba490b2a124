"""engine/suffix_drafts.py without an engine: requests kept in step, responses cached
under their key and cut where the user's output ended, the seed corpus."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from eagle_vllm.config import SuffixConfig
from eagle_vllm.engine.step import DraftedTrees
from eagle_vllm.engine.suffix_drafts import SuffixDrafts, read_seed_corpus
from eagle_vllm.tree.merge import BOTH, EAGLE, SUFFIX, merge_trees


def _state(prompt, output, lora=None, stops=(), max_tokens=None, min_tokens=0):
    params = SimpleNamespace(
        all_stop_token_ids=set(stops), max_tokens=max_tokens, min_tokens=min_tokens
    )
    return SimpleNamespace(
        prompt_token_ids=list(prompt), output_token_ids=list(output), sampling_params=params,
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora),
    )  # fmt: skip


def _scheduled(new=(), finished=()):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, cache_salt=s) for r, s in new],
        finished_req_ids=set(finished),
    )


def test_requests_are_indexed_once_then_extended():
    drafts = SuffixDrafts(SuffixConfig(cache_requests=4))
    drafts.note_scheduled(_scheduled(new=[("a", None)]))
    states = {"a": _state([1, 2, 3], [4])}
    # drafting before vLLM's bookkeeping: the output does not hold this step's tokens yet
    drafts.sync(["a"], states, [[5, 6]], output_has_new=False)
    assert drafts.requests.tokens("a") == [1, 2, 3, 4, 5, 6]
    drafts.sync(["a"], states, [[7]], output_has_new=False)
    assert drafts.requests.tokens("a") == [1, 2, 3, 4, 5, 6, 7]
    # after it (method suffix): the output already holds them
    drafts.note_scheduled(_scheduled(new=[("b", None)]))
    drafts.sync(["b"], {"b": _state([9], [8, 7])}, [[7]], output_has_new=True)
    assert drafts.requests.tokens("b") == [9, 8, 7]


def test_finished_responses_are_cached_under_salt_and_adapter_and_cut_at_the_stop():
    drafts = SuffixDrafts(SuffixConfig(cache_requests=4))
    drafts.note_scheduled(_scheduled(new=[("a", "alice"), ("b", None)]))
    states = {
        "a": _state([1], [], lora="ad", stops={2}),  # the step accepted past the stop token
        "b": _state([1], [], max_tokens=3),
    }
    drafts.sync(["a", "b"], states, [[5, 2, 9, 9], [6, 6, 6, 6, 6]], output_has_new=False)
    drafts.note_scheduled(_scheduled(finished=["a", "b"]))
    assert drafts.cache.responses(("alice", "ad")) == [[5, 2]]
    assert drafts.cache.responses((None, None)) == [[6, 6, 6]]
    assert "a" not in drafts.requests and not drafts._salts and not drafts._stops


def test_min_tokens_delays_the_stop():
    drafts = SuffixDrafts(SuffixConfig())
    drafts.note_scheduled(_scheduled(new=[("a", None)]))
    drafts.sync(["a"], {"a": _state([1], [], stops={2}, min_tokens=3)}, [[2, 5, 2, 7]], False)
    drafts.note_scheduled(_scheduled(finished=["a"]))
    assert drafts.cache.responses((None, None)) == [[2, 5, 2]]


def test_propose_skips_and_records():
    drafts = SuffixDrafts(SuffixConfig(max_nodes=4))
    drafts.record = {}
    drafts.note_scheduled(_scheduled(new=[("a", None), ("b", None)]))
    states = {"a": _state([1, 2, 3, 1, 2], []), "b": _state([4], [])}
    drafts.sync(["a", "b"], states, [[], []], output_has_new=False)
    cands = drafts.propose(["a", "b", "unknown"], skip=[False, True, False])
    assert cands[1] is None and cands[2] is None
    assert cands[0].tokens[0] == 2 and cands[0].tokens[1] == 3  # "1 2" was followed by 3
    assert drafts.record == {"a": [cands[0].tokens[1:]]}


@pytest.mark.parametrize("spec_factor,depth", [(1.0, 2), (2.0, 4), (1.5, 3)])
def test_spec_factor_bounds_the_depth_a_match_drafts(spec_factor, depth):
    # "7 8" occurred once before, followed by 1 2 3 4 5: a 2-token match drafts
    # floor(spec_factor * 2) deep along it
    drafts = SuffixDrafts(SuffixConfig(max_nodes=8, spec_factor=spec_factor))
    drafts.note_scheduled(_scheduled(new=[("a", None)]))
    drafts.sync(["a"], {"a": _state([7, 8, 1, 2, 3, 4, 5, 6, 7, 8], [])}, [[]], False)
    (cands,) = drafts.propose(["a"])
    assert cands.tokens[1:] == [1, 2, 3, 4, 5][:depth]


def test_observe_counts_sources_and_calibrates():
    from eagle_vllm.tree.layout import DraftTree

    eagle = DraftTree(
        tokens=torch.tensor([[7, 1, 2]]), parents=torch.tensor([[-1, 0, 0]]),
        depths=torch.tensor([[0, 1, 1]]), num_nodes=torch.tensor([3]),
        scores=torch.log(torch.tensor([[1.0, 0.6, 0.3]])),
    )  # fmt: skip
    from eagle_vllm.drafting.suffix import SuffixCandidates

    suffix = SuffixCandidates([7, 1, 5, 9], [-1, 0, 1, 0], [0.0, -0.5, -0.9, -2.0], [0, 1, 2, 1])
    merged = merge_trees(eagle, [suffix], [5])
    verified = DraftedTrees(
        ["r"], merged.tree, sources=merged.sources, raw_values=merged.raw_values
    )
    tokens = merged.tree.tokens[0].tolist()
    path = [tokens.index(1), tokens.index(5)]  # accepted 1 (both) then 5 (suffix)
    drafts = SuffixDrafts(SuffixConfig())
    drafts.observe(verified, ["r"], torch.tensor([path]), set())
    assert drafts.accepted == {EAGLE: 0, SUFFIX: 1, BOTH: 1}
    assert drafts.drafted[EAGLE] == 1 and drafts.drafted[BOTH] == 1
    factors = drafts.calibration.factors()
    assert factors[BOTH, 1] > 1.0 > factors[EAGLE, 1]
    assert drafts.stats()["accepted_share"] == {"eagle": 0.0, "suffix": 0.5, "both": 0.5}


def test_seed_corpus_of_token_ids(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"token_ids": [1, 2, 3]}) + "\n\n" + json.dumps({"token_ids": [4]}))
    assert read_seed_corpus(str(path), None) == [[1, 2, 3], [4]]
    drafts = SuffixDrafts(SuffixConfig(seed_corpus=str(path), seed_tokens=3))
    assert drafts.seed_tokens == 3  # whole sequences, within the bound
    (seed,) = drafts.cache.indexes_for((None, None))
    assert seed.continuations([1, 2]) == {3: 1}


def test_seed_corpus_errors_name_the_line(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"token_ids": [1]}\n{"other": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_seed_corpus(str(path), None)
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="no tokenizer"):
        read_seed_corpus(str(path), None)
