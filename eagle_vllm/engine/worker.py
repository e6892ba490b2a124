"""Workers that build the plugin's runner (vLLM 0.32).

Selected through ``worker_cls="eagle_vllm.engine.worker.EagleWorker"``, which
the plugin's config sets; vLLM keeps an explicit ``worker_cls`` on CPU and CUDA.

* CPU: ``CPUWorker.init_device`` constructs ``CPUModelRunner`` by its
  module-global name (no hook in 0.32), so the name is swapped for the
  duration of the call.
* CUDA: ``Worker._make_model_runner`` is the official hook.

Both add ``eagle_vllm_timings``, reachable with
``LLM.collective_rpc("eagle_vllm_timings", kwargs={"reset": True})``, and
``eagle_vllm_sizing`` (the load-aware sizer's table, ``total_tokens: auto``),
``eagle_vllm_sizing_profile`` (the same measurements as a calibration profile) and
``eagle_vllm_rng_digest`` (the random state speculation draws from, per rank).
"""

from __future__ import annotations

from vllm.platforms import current_platform


class _TimingsRPC:
    def eagle_vllm_timings(self, reset: bool = False) -> dict:
        """Seconds and calls per runner phase since the last reset (see engine/timing.py)."""
        timings = getattr(self.model_runner, "timings", None)
        return {} if timings is None else timings.snapshot(reset)

    def eagle_vllm_rng_digest(self) -> dict:
        """Digests of the random state this rank draws speculation from: the drafter's
        generator (sampled drafts) and torch's default one (the verifier's coins, vLLM's
        sampler). Tensor-parallel ranks must report identical digests."""
        import hashlib

        import torch

        def digest(state: torch.Tensor) -> str:
            return hashlib.sha256(state.numpy().tobytes()).hexdigest()[:16]

        drafter = getattr(self.model_runner, "drafter", None)
        rng = getattr(drafter, "_draft_rng", None)
        return {
            "drafter": None if rng is None else digest(rng.get_state()),
            "default": digest(torch.get_rng_state()),
        }

    def eagle_vllm_sizing(self) -> dict:
        """The load-aware sizer's measurements and recent choices ({} unless total_tokens: auto)."""
        sizer = getattr(self.model_runner, "sizer", None)
        if sizer is None:
            return {}
        return {**sizer.table(), "history": [list(h) for h in sizer.history]}

    def eagle_vllm_sizing_profile(self) -> dict:
        """The sizer's measurements as a profile (``eagle-vllm calibrate``; {} unless auto)."""
        sizer = getattr(self.model_runner, "sizer", None)
        return {} if sizer is None else sizer.export_profile()


def _cpu_worker_cls():
    import vllm.v1.worker.cpu_worker as cpu_worker

    from eagle_vllm.engine.runner import EagleCPUModelRunner

    class EagleCPUWorker(_TimingsRPC, cpu_worker.CPUWorker):
        def init_device(self):
            from eagle_vllm.attention import cpu_backend

            cpu_backend.install()  # tree masks for the target's verification forward
            original = cpu_worker.CPUModelRunner
            cpu_worker.CPUModelRunner = EagleCPUModelRunner
            try:
                super().init_device()
            finally:
                cpu_worker.CPUModelRunner = original

    return EagleCPUWorker


def _gpu_worker_cls():
    from vllm.v1.worker.gpu_worker import Worker

    from eagle_vllm.engine.runner import EagleGPUModelRunner

    class EagleGPUWorker(_TimingsRPC, Worker):
        def _make_model_runner(self):
            if self.use_v2_model_runner:
                raise RuntimeError(
                    "eagle_vllm needs vLLM's V1 model runner. Fix: set VLLM_USE_V2_MODEL_RUNNER=0."
                )
            return EagleGPUModelRunner(self.vllm_config, self.device)

    return EagleGPUWorker


EagleWorker = _cpu_worker_cls() if current_platform.is_cpu() else _gpu_worker_cls()
