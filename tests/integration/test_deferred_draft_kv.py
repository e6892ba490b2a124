"""Drafts-off steps skip the drafter (total_tokens: auto); its draft KV is written later.

A request decoded with drafts off (the sizer pinned to (0, 1)) defers each step's
first pass; the drafter writes those positions when enough are waiting (16 here),
before drafting resumes, and when the request leaves (its cached blocks may serve a
later request with the same prefix). Its draft KV must then equal, position by
position, what a drafter that never skips wrote for the same tokens (method eagle,
fixed size).
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
    attn = runner.drafter.draft_layers()[0].self_attn.attn
    kv_cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
    k, v = gather_cpu_kv(kv_cache, torch.tensor([state.block_ids[0]]), n)
    return {
        "k": k[0].clone(),
        "v": v[0].clone(),
        "tokens": list(state.output_token_ids),
        "caught_up": runner.deferred.written_positions,
    }


def _request_blocks(worker) -> dict:
    runner = worker.model_runner
    (state,) = runner.requests.values()
    return {
        "blocks": list(state.block_ids[0]),
        "computed": state.num_computed_tokens,
        "prompt": len(state.prompt_token_ids),
        "block_size": runner.cache_config.block_size,
    }


def _read_blocks(blocks: list[int], n: int):
    """On the worker: the draft K/V of positions < n in these blocks, whoever owns them."""

    def read(worker) -> dict:
        from eagle_vllm.attention.paged_kv import gather_cpu_kv

        runner = worker.model_runner
        attn = runner.drafter.draft_layers()[0].self_attn.attn
        kv_cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
        k, v = gather_cpu_kv(kv_cache, torch.tensor([blocks]), n)
        return {
            "k": k[0].clone(),
            "v": v[0].clone(),
            "caught_up": runner.deferred.written_positions,
        }

    return read


def _cap_deferred(worker):
    worker.model_runner.deferred.max_tokens = 16


def _cap_deferred_at(cap: int):
    def set_cap(worker):
        worker.model_runner.deferred.max_tokens = cap

    return set_cap


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


def _start(llm, max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.llm_engine.add_request("r0", PROMPT, params)


def _lockstep_env(mp: pytest.MonkeyPatch) -> None:
    # collective_rpc with a callable (reads the worker's KV cache)
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # The engine core in this process: each llm_engine.step() runs exactly one step, so
    # a read sees the request where the test stopped it. In its own process (the
    # default) the core runs ahead of the client and may finish the request first.
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(autouse=True)
def lockstep_engine(monkeypatch):
    _lockstep_env(monkeypatch)


@pytest.fixture(scope="module")
def reference_kv(tiny) -> dict:
    """Method eagle, fixed size (every step runs the drafter's first pass): the request's
    draft KV after 130 tokens (past the first 128-position block)."""
    from eagle_vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        _lockstep_env(mp)
        spec = {"method": "eagle", "model": str(tiny["draft_noisy"]), "num_speculative_tokens": 3}
        ref = LLM(str(tiny["target"]), speculative_config=spec, **ENGINE_KW)
        try:
            _start(ref, max_tokens=150)
            _step_until(ref, 130)
            return ref.collective_rpc(_read_draft_kv)[0]
        finally:
            shutdown(ref)


def test_deferred_draft_kv_equals_the_drafters_own(tiny, reference_kv, monkeypatch):
    from eagle_vllm import LLM

    draft = str(tiny["draft_noisy"])
    want = reference_kv
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


def test_a_request_leaving_with_drafts_off_writes_its_deferred_draft_kv(
    tiny, reference_kv, monkeypatch
):
    """With prefix caching, a finished request's full blocks (draft KV included) serve
    the next request with the same prefix, so what it deferred there is written when it
    leaves; its partial last block is never cached, so that part is not."""
    from vllm import SamplingParams

    from eagle_vllm import LLM

    monkeypatch.setenv("EAGLE_VLLM_SIZER_PIN", "0,1")
    spec = {"method": "eagle2", "model": str(tiny["draft_noisy"]), "num_speculative_tokens": 3,
            "topk": 2, "total_tokens": "auto"}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, **ENGINE_KW)
    try:
        llm.collective_rpc(_cap_deferred_at(1000))  # only the request's end writes it
        params = SamplingParams(temperature=0, max_tokens=140, ignore_eos=True)
        llm.llm_engine.add_request("r0", PROMPT, params)
        _step_until(llm, 20)
        running = llm.collective_rpc(_request_blocks)[0]
        block = running["block_size"]
        read_running = _read_blocks(running["blocks"], running["computed"])
        before = llm.collective_rpc(read_running)[0]
        for _ in range(400):  # r0 finishes while drafts are off
            if any(o.finished for o in llm.llm_engine.step()):
                break
        else:
            raise AssertionError("r0 did not finish")
        # the engine core tells the worker that r0 left in its next step
        llm.llm_engine.step()
        after = llm.collective_rpc(_read_blocks(running["blocks"][:1], block))[0]
    finally:
        shutdown(llm)

    want, n = reference_kv, running["computed"]
    prompt = running["prompt"]
    assert prompt + 16 <= n < block < prompt + 140  # r0 fills its first block, then ends
    assert want["k"].shape[0] >= block
    assert before["caught_up"] == 0  # nothing was written while r0 ran
    # the deferred positions were not written before r0 left: the check is not vacuous
    assert (before["k"][n - 8 : n] - want["k"][n - 8 : n]).abs().amax() > 1e-3
    # its full block, written when it left; not its partial last block
    assert after["caught_up"] == block - prompt, (after["caught_up"], block, prompt)
    torch.testing.assert_close(after["k"], want["k"][:block], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after["v"], want["v"][:block], atol=1e-4, rtol=1e-4)
