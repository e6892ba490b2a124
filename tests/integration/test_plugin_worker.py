"""The plugin's worker without an eagle_vllm config (the benchmarks' ``vanilla-timed`` and
``ngram-timed``): vLLM's own decoding, untouched, with the runner's phases timed."""

from __future__ import annotations

import pytest
from conftest import ENGINE_KW, shutdown
from test_eagle_chain import PROMPTS, greedy, token_ids

pytestmark = pytest.mark.vllm

WORKER = "eagle_vllm.engine.worker.EagleWorker"


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram",
                         "num_speculative_tokens": 3, "prompt_lookup_min": 2}])  # fmt: skip
def test_plugin_worker_runs_vllms_own_decoding(
    tiny, vanilla_greedy, speculative_config, monkeypatch
):
    import sys

    import vllm

    if speculative_config is not None:
        # vLLM's ngram proposer imports numba, and with llvmlite loaded every later engine
        # built in this process fails in vLLM 0.32's CPU kernel-override scan
        # (triton_utils/dispatcher.py reads vars() of llvmlite's ffi.lib, whose __getattr__
        # answers any name): the engine core runs in its own process, as served.
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    llm = vllm.LLM(str(tiny["target"]), worker_cls=WORKER,
                   speculative_config=speculative_config, **ENGINE_KW)  # fmt: skip
    try:
        got = token_ids(llm.generate(PROMPTS, greedy()))
        (timings,) = llm.collective_rpc("eagle_vllm_timings")
    finally:
        shutdown(llm)
    assert got == vanilla_greedy
    assert "llvmlite.binding.ffi" not in sys.modules  # later engines in this process start
    # the phases benchmarks split a step into (bench.py's time split)
    for phase in ("execute_model", "target_forward", "verify", "sample_tokens"):
        assert timings[phase]["calls"] > 0, (phase, timings)
