"""EAGLE-3 heads inside real vLLM (CPU, fp32): the plugin's chain against stock vLLM's
``eagle3`` chain with the same checkpoint, trees, the suffix hybrid, deferred drafting,
and SafeAILab's ``midlayer`` layout.

The head (``tiny_models.build_eagle3_draft(kind="oracle2")``) reads the target's
auxiliary layers (0, 1, 2) and drafts over a 200-token vocabulary mapped by ``d2t``;
its depth-1 drafts are right, so acceptance proves features, fusion and ``d2t`` reach
the drafter as vLLM's own EAGLE-3 path computes them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics
from test_eagle_chain import PROMPTS, greedy, token_ids

pytestmark = pytest.mark.vllm

K = 3


@pytest.fixture(scope="module")
def heads(tiny, tmp_path_factory):
    from tiny_models import build_eagle3_draft

    root = tmp_path_factory.mktemp("eagle3")
    return {
        "oracle2": build_eagle3_draft(
            root / "oracle2", tiny["target_oracle"], kind="oracle2", draft_vocab=200
        ),
        "random_safeailab": build_eagle3_draft(
            root / "random_safeailab", tiny["target_oracle"], layout="safeailab"
        ),
        "shared_oracle2": build_eagle3_draft(
            root / "shared_oracle2", tiny["target_oracle"], kind="oracle2", shared_lm_head=True
        ),
    }


def _accepted_per_position(llm) -> list[int]:
    return list(spec_metrics(llm)["num_accepted_tokens_per_pos"])


def _stock_and_plugin_chains(tiny, head) -> dict[str, tuple[list, list[int], float]]:
    """The same EAGLE-3 checkpoint in stock vLLM's eagle3 chain and in the plugin's chain
    (method eagle3, the alias; "greedy": argmax chain drafts, as vLLM's, since the
    plugin's chain default samples at T>0): per engine, the greedy outputs, the accepted
    drafts per position and tau."""
    import vllm

    from eagle_vllm import LLM

    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    runs = {}
    for name, make, extra in (("stock", vllm.LLM, {}),
                              ("ours", LLM, {"draft_sample_method": "greedy"})):  # fmt: skip
        llm = make(str(tiny["target"]), speculative_config={**spec, **extra}, **ENGINE_KW)
        try:
            out = token_ids(llm.generate(PROMPTS, greedy()))
            runs[name] = (out, _accepted_per_position(llm),
                          mean_acceptance_length(spec_metrics(llm)))  # fmt: skip
        finally:
            shutdown(llm)
    return runs


def test_plugin_chain_matches_stock_vllm_eagle3(tiny, heads, vanilla_greedy):
    """Stock vLLM's eagle3 chain and the plugin's with the same checkpoint: the same greedy
    outputs (the target's) and the same acceptance at every draft position, so the same
    tau."""
    runs = _stock_and_plugin_chains(tiny, heads["oracle2"])
    (stock_out, stock_pos, stock_tau), (ours_out, ours_pos, ours_tau) = runs["stock"], runs["ours"]
    assert stock_out == vanilla_greedy
    assert ours_out == vanilla_greedy
    assert ours_pos == stock_pos, (ours_pos, stock_pos)
    assert ours_tau == pytest.approx(stock_tau)
    assert ours_tau > 1.5, ours_tau  # the head's depth-1 drafts are right


def _eagle2(tiny, head, **spec):
    from eagle_vllm import LLM

    config = {"method": "eagle2", "model": str(head), "num_speculative_tokens": 3, "topk": 3,
              "total_tokens": 10, **spec}  # fmt: skip
    return LLM(str(tiny["target"]), speculative_config=config, **ENGINE_KW)


@pytest.mark.parametrize(
    "name,spec",
    [
        ("tree", {}),
        ("tree+suffix", {"suffix": {"max_nodes": 6}}),
        ("one-pass", {"num_speculative_tokens": 1, "topk": 4, "total_tokens": 5}),
    ],
)
def test_eagle3_trees_greedy_equal_vanilla(tiny, heads, vanilla_greedy, name, spec):
    llm = _eagle2(tiny, heads["oracle2"], **spec)
    try:
        got = token_ids(llm.generate(PROMPTS, greedy()))
        tau = mean_acceptance_length(spec_metrics(llm))
    finally:
        shutdown(llm)
    assert got == vanilla_greedy
    assert tau > (1.3 if name == "one-pass" else 1.5), tau  # one pass: tau <= 2


def test_eagle3_deferred_draft_kv_equals_the_drafters_own(tiny, heads, monkeypatch):
    """Drafts off (total_tokens: auto pinned to (0, 1)): each skipped first pass keeps the
    fused EAGLE-3 feature and writes its draft KV later; after drafting resumes, the draft
    KV equals, position by position, what the eagle3 chain (never skipping) wrote."""
    from test_deferred_draft_kv import (
        PROMPT,
        _cap_deferred,
        _lockstep_env,
        _pin,
        _read_draft_kv,
        _start,
        _step_until,
    )

    from eagle_vllm import LLM

    _lockstep_env(monkeypatch)
    head = str(heads["oracle2"])
    ref = LLM(str(tiny["target"]), speculative_config={"method": "eagle3", "model": head,
              "num_speculative_tokens": 3}, **ENGINE_KW)  # fmt: skip
    try:
        _start(ref, max_tokens=150)
        _step_until(ref, 130)
        want = ref.collective_rpc(_read_draft_kv)[0]
    finally:
        shutdown(ref)
    monkeypatch.setenv("EAGLE_VLLM_SIZER_PIN", "0,1")  # drafts off from the start
    spec = {"method": "eagle2", "model": head, "num_speculative_tokens": 3, "topk": 2,
            "total_tokens": "auto"}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, **ENGINE_KW)
    try:
        llm.collective_rpc(_cap_deferred)
        _start(llm)
        _step_until(llm, 45)  # catch-ups at 16 and 32 waiting, then 12 more deferred
        llm.collective_rpc(_pin((1, 2)))  # drafting resumes: the rest is written first
        _step_until(llm, 60)
        got = llm.collective_rpc(_read_draft_kv)[0]
    finally:
        shutdown(llm)
    n = min(got["k"].shape[0], want["k"].shape[0])
    assert n >= len(PROMPT.split()) + 55
    assert got["tokens"][:50] == want["tokens"][:50]
    assert got["caught_up"] >= 44, got["caught_up"]
    torch.testing.assert_close(got["k"][:n], want["k"][:n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["v"][:n], want["v"][:n], atol=1e-4, rtol=1e-4)


def test_shared_lm_head_eagle3_drafts_through_the_targets_head(tiny, heads, vanilla_greedy):
    """A head without lm_head or d2t (``eagle-vllm train --share-lm-head``) drafts the whole
    vocabulary through the target's LM head, in stock vLLM's eagle3 chain as in the plugin's
    chain and tree: the target's outputs, the same acceptance per position in both chains,
    and a tau only the target's head gives (this head's fc alone steers it to the token two
    ahead)."""
    runs = _stock_and_plugin_chains(tiny, heads["shared_oracle2"])
    (stock_out, stock_pos, _), (ours_out, ours_pos, ours_tau) = runs["stock"], runs["ours"]
    tree = _eagle2(tiny, heads["shared_oracle2"])
    try:
        tree_out = token_ids(tree.generate(PROMPTS, greedy()))
        tree_tau = mean_acceptance_length(spec_metrics(tree))
    finally:
        shutdown(tree)
    assert stock_out == ours_out == tree_out == vanilla_greedy
    assert ours_pos == stock_pos, (ours_pos, stock_pos)
    assert ours_tau > 1.5 and tree_tau > 1.5, (ours_tau, tree_tau)


def test_shared_lm_head_eagle3_drafts_over_its_ranked_draft_vocab(
    tiny, heads, vanilla_greedy, tmp_path
):
    """``draft_vocab: N`` on a head that shares the target's LM head drafts over the first
    N tokens of its draft_vocab.json only: ranked with every token the target writes first,
    it keeps the full head's acceptance; ranked with those last (N = the rest), no draft
    can be accepted, until each request's own tokens join the drafting vocabulary
    (``draft_vocab_context``): then the tokens it wrote before are drafted again. All
    stay exact."""
    import json
    import shutil

    vocab = json.loads((tiny["target"] / "config.json").read_text())["vocab_size"]
    written = sorted({t for out in vanilla_greedy for t in out})
    others = sorted(set(range(vocab)) - set(written))
    taus = {}
    for name, ranked, n, context in (("written", written + others, len(written), False),
                                     ("others", others + written, len(others), False),
                                     ("others+context", others + written, len(others), True)):  # fmt: skip
        head = tmp_path / name
        shutil.copytree(heads["shared_oracle2"], head)
        (head / "draft_vocab.json").write_text(json.dumps({"token_ids": ranked}))
        llm = _eagle2(tiny, head, draft_vocab=n, draft_vocab_context=context)
        try:
            assert token_ids(llm.generate(PROMPTS, greedy())) == vanilla_greedy, name
            taus[name] = mean_acceptance_length(spec_metrics(llm))
        finally:
            shutdown(llm)
    assert taus["written"] > 1.5 and taus["others"] == 1.0, taus
    assert taus["others+context"] > 1.2, taus


def test_safeailab_eagle3_layout_loads_and_is_exact(tiny, heads, vanilla_greedy):
    """SafeAILab's EAGLE-3 layout (midlayer.*, a Llama config.json with draft_vocab_size,
    layer ids under eagle_config): loaded as EAGLE-3, greedy output is the target's."""
    llm = _eagle2(tiny, heads["random_safeailab"])
    try:
        got = token_ids(llm.generate(PROMPTS, greedy()))
    finally:
        shutdown(llm)
    assert got == vanilla_greedy


def test_eagle3_tree_tp2_mp_greedy_equals_vanilla(tiny, heads, vanilla_greedy, monkeypatch):
    """Tensor parallel 2 (mp executor): each rank collects its target's auxiliary layers,
    fuses them with the replicated fc and drafts the same tree over the draft vocabulary."""
    from eagle_vllm import LLM

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    spec = {"method": "eagle2", "model": str(heads["oracle2"]), "num_speculative_tokens": 3,
            "topk": 3, "total_tokens": 10}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, tensor_parallel_size=2, **ENGINE_KW)
    try:
        got = token_ids(llm.generate(PROMPTS, greedy()))
        tau = mean_acceptance_length(spec_metrics(llm))
    finally:
        shutdown(llm)
    assert got == vanilla_greedy
    assert tau > 1.5, tau
