"""Drafts-off steps skip the drafter (total_tokens: auto); its draft KV is written later.

A request decoded with drafts off (the sizer pinned to (0, 1)) defers each step's
first pass; the drafter writes those positions when enough are waiting (16 here)
and before drafting resumes. Its draft KV must then equal, position by position, what a
drafter that never skips wrote for the same tokens (method eagle, fixed size).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ENGINE_KW, shutdown

pytestmark = pytest.mark.vllm

PROMPT = " ".join(f"w{(5 * i + 3) % 250}" for i in range(21))
MAX_TOKENS = 90


def _read_draft_kv(worker) -> dict:
    """On the worker: the only running request's draft K/V at its computed positions."""
    from eagle_vllm.attention.paged_kv import gather_cpu_kv

    runner = worker.model_runner
    (state,) = runner.requests.values()
    n = state.num_computed_tokens
    attn = runner.drafter._draft_layers()[0].self_attn.attn
    kv_cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
    k, v = gather_cpu_kv(kv_cache, torch.tensor([state.block_ids[0]]), n)
    return {
        "k": k[0].clone(),
        "v": v[0].clone(),
        "tokens": list(state.output_token_ids),
        "caught_up": getattr(runner.drafter, "caught_up_positions", 0),
    }


def _cap_deferred(worker):
    worker.model_runner.drafter.max_deferred_tokens = 16


def _pin(arm):
    def pin(worker):
        worker.model_runner.sizer.pinned = arm

    return pin


def _step_until(llm, num_tokens: int) -> None:
    engine = llm.llm_engine
    for _ in range(400):
        outs = engine.step()
        if any(len(o.outputs[0].token_ids) >= num_tokens for o in outs):
            return
    raise AssertionError("the request did not reach the length")


def _start(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.llm_engine.add_request("r0", PROMPT, params)


@pytest.fixture
def insecure_rpc(monkeypatch):
    # collective_rpc with a callable (reads the worker's KV cache)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def test_deferred_draft_kv_equals_the_drafters_own(tiny, insecure_rpc, monkeypatch):
    from eagle_vllm import LLM

    draft = str(tiny["draft_noisy"])
    # reference: method eagle, fixed size, so every step runs the drafter's first pass
    ref = LLM(
        str(tiny["target"]),
        speculative_config={"method": "eagle", "model": draft, "num_speculative_tokens": 3},
        **ENGINE_KW,
    )
    _start(ref)
    _step_until(ref, 70)
    want = ref.collective_rpc(_read_draft_kv)[0]
    shutdown(ref)

    monkeypatch.setenv("EAGLE_VLLM_SIZER_PIN", "0,1")  # drafts off from the start
    spec = {"method": "eagle2", "model": draft, "num_speculative_tokens": 3, "topk": 2,
            "total_tokens": "auto"}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, **ENGINE_KW)
    try:
        assert os.environ["EAGLE_VLLM_SIZER_PIN"] == "0,1"
        llm.collective_rpc(_cap_deferred)
        _start(llm)
        _step_until(llm, 45)  # catch-ups at 16 and 32 waiting, then 12 more deferred
        off = llm.collective_rpc(_read_draft_kv)[0]
        llm.collective_rpc(_pin((1, 2)))  # drafting resumes: the rest is written first
        _step_until(llm, 60)
        got = llm.collective_rpc(_read_draft_kv)[0]
    finally:
        shutdown(llm)

    n = min(got["k"].shape[0], want["k"].shape[0])
    assert n >= len(PROMPT.split()) + 55
    assert got["tokens"][:50] == want["tokens"][:50]  # greedy: the same text
    assert off["caught_up"] >= 32, off["caught_up"]  # the cap wrote them while off
    assert got["caught_up"] >= 44, got["caught_up"]
    torch.testing.assert_close(got["k"][:n], want["k"][:n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["v"][:n], want["v"][:n], atol=1e-4, rtol=1e-4)
    # while drafts were off, the last deferred positions were not written yet (they were
    # deferred, not computed): the check above is not vacuous
    n_off = off["k"].shape[0]
    stale = (off["k"][n_off - 8 : n_off] - want["k"][n_off - 8 : n_off]).abs().amax()
    assert stale > 1e-3, "the deferred positions already held the right draft KV"
