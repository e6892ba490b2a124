"""Tensor parallel 2 with vLLM's Ray executor on CPU (eagle_vllm.ray_cpu), method eagle2.

vLLM 0.32 alone refuses ``distributed_executor_backend="ray"`` on CPU; an eagle_vllm
config asking for it gets the plugin's CPU Ray executor. A local Ray instance (2 CPUs) is started here; the
engine-core process joins it through RAY_ADDRESS, reserves one {"CPU": 1} bundle
per rank and runs each rank as a Ray actor.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics
from test_eagle_chain import PROMPTS, greedy, token_ids

pytestmark = pytest.mark.vllm

RAY_CPUS = 2


@pytest.fixture(scope="module")
def ray_cluster():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("eagle_vllm.ray_cpu is for vLLM's CPU platform")
    import psutil
    import ray  # in the `test` extra

    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED")}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ctx = ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False)
    os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]  # for the engine core
    try:
        yield ray
    finally:
        ray_procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    # no Ray process of this instance (GCS, raylet, workers) outlives ray.shutdown()
    _, alive = psutil.wait_procs(ray_procs, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive if p.is_running()]


def test_ray_tp2_tree_greedy_equals_vanilla(tiny, vanilla_greedy, ray_cluster, monkeypatch):
    """Every Ray actor builds the same tree, verifies the same path and compacts its KV shard."""
    from eagle_vllm import LLM

    # the engine core in its own process, as served: its placement group is released
    # when that process ends (an engine core in this process would hold it until exit)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    spec = {
        "method": "eagle2",
        "model": str(tiny["draft_noisy"]),
        "num_speculative_tokens": 3,
        "topk": 2,
        "total_tokens": 6,
    }
    llm = LLM(
        str(tiny["target"]),
        speculative_config=spec,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        **ENGINE_KW,
    )
    got = token_ids(llm.generate(PROMPTS, greedy()))
    metrics = spec_metrics(llm)
    ranks = llm.collective_rpc("eagle_vllm_timings")  # the plugin's worker on every rank
    reserved = RAY_CPUS - ray_cluster.available_resources().get("CPU", 0)
    shutdown(llm)
    assert len(ranks) == 2 and all(ranks), ranks
    assert reserved == 2  # one {"CPU": 1} bundle per rank in this Ray instance
    assert got == vanilla_greedy
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] == 5 * metrics["num_drafts"]
    assert sum(metrics["num_accepted_tokens_per_pos"][3:]) == 0, metrics  # depth 3
    assert mean_acceptance_length(metrics) > 1.2, metrics

    # The engine's job is over: its placement group (one CPU per rank) and actors are gone.
    deadline = time.time() + 30
    while ray_cluster.available_resources().get("CPU", 0) < RAY_CPUS and time.time() < deadline:
        time.sleep(0.5)
    assert ray_cluster.available_resources().get("CPU", 0) == RAY_CPUS


def test_ray_tp2_eagle3_tree_greedy_equals_vanilla(
    tiny, vanilla_greedy, ray_cluster, monkeypatch, tmp_path
):
    """An EAGLE-3 head over Ray actors: each rank collects its target's auxiliary layers."""
    from tiny_models import build_eagle3_draft

    from eagle_vllm import LLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    head = build_eagle3_draft(tmp_path / "e3", tiny["target_oracle"], kind="oracle2",
                              draft_vocab=200)  # fmt: skip
    spec = {"method": "eagle2", "model": str(head), "num_speculative_tokens": 3, "topk": 2,
            "total_tokens": 6}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, tensor_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE_KW)  # fmt: skip
    try:
        got = token_ids(llm.generate(PROMPTS, greedy()))
        metrics = spec_metrics(llm)
    finally:
        shutdown(llm)
    assert got == vanilla_greedy
    assert mean_acceptance_length(metrics) > 1.5, metrics


def test_ray_executor_selection_on_cpu(monkeypatch):
    """An eagle_vllm config asking for Ray on CPU gets the CPU Ray executor as the engine's
    executor class; the plugin patches nothing of vLLM's executor selection, and the
    legacy compiled-graph Ray executor is refused with a fix."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("eagle_vllm.ray_cpu is for vLLM's CPU platform")
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    import eagle_vllm.plugin

    eagle_vllm.plugin.register()
    from eagle_vllm import ray_cpu

    def config(backend):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(distributed_executor_backend=backend)
        )

    executor = ray_cpu.executor_class()
    assert executor is ray_cpu.CPURayExecutor and issubclass(executor, RayExecutorV2)
    assert Executor.get_class(config(executor)) is executor  # what the engine args carry
    assert Executor.get_class(config("mp")) is MultiprocExecutor
    assert Executor.get_class(config("ray")) is RayExecutorV2  # vLLM's own, unpatched
    assert ray_cpu.CPURayExecutor._get_actor_resource_kwargs() == {"num_gpus": 0}
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    with pytest.raises(ValueError, match="VLLM_USE_RAY_V2_EXECUTOR_BACKEND"):
        ray_cpu.executor_class()
