"""The worker that builds the plugin's runner (vLLM 0.32, CPU platform).

Selected through ``worker_cls="eagle_vllm.engine.worker.EagleWorker"``, which the
plugin's config sets. ``CPUWorker.init_device`` constructs ``CPUModelRunner`` by its
module-global name (no hook in 0.32), so the name points at the plugin's runner for
the duration of the call (``vllm_surface.cpu_worker_builds``).

RPCs, reachable with ``LLM.collective_rpc(name)``: ``eagle_vllm_timings`` (the runner's
phases), ``eagle_vllm_sizing`` (the load-aware sizer's table, ``total_tokens: auto``),
``eagle_vllm_sizing_profile`` (the same measurements as a calibration profile),
``eagle_vllm_sizing_sweep`` (calibration: run every arm in turn),
``eagle_vllm_suffix`` (the suffix source's counts and recorded candidates) and
``eagle_vllm_rng_digest`` (the random state speculation draws from, per rank).
"""

from __future__ import annotations

import hashlib

import torch

from eagle_vllm import vllm_surface
from eagle_vllm.attention.platform import for_current_platform


class EagleWorker(vllm_surface.cpu_worker_base()):
    def init_device(self):
        from eagle_vllm.engine.runner import EagleCPUModelRunner

        for_current_platform().install_tree_attention()  # the target's tree masks
        with vllm_surface.cpu_worker_builds(EagleCPUModelRunner):
            super().init_device()

    def eagle_vllm_timings(self, reset: bool = False) -> dict:
        """Seconds and calls per runner phase since the last reset (see engine/timing.py)."""
        timings = getattr(self.model_runner, "timings", None)
        return {} if timings is None else timings.snapshot(reset)

    def eagle_vllm_rng_digest(self) -> dict:
        """Digests of the random state this rank draws speculation from: the drafter's
        generator (sampled drafts) and torch's default one (the verifier's coins, vLLM's
        sampler). Tensor-parallel ranks must report identical digests."""

        def digest(state: torch.Tensor) -> str:
            return hashlib.sha256(state.numpy().tobytes()).hexdigest()[:16]

        rng = getattr(getattr(self.model_runner, "drafter", None), "draft_rng", None)
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

    def eagle_vllm_suffix(self, record: bool | None = None, clear_cache: bool = False) -> dict:
        """The suffix source's totals ({} without a suffix section): accepted drafts per
        source, host time per step, cache size. ``record=True`` starts keeping every
        step's suffix candidates per request (returned under ``"drafted"``); ``False``
        stops and clears it. ``clear_cache``: drop the cached past responses (the seed
        corpus stays), e.g. so that a benchmark's next condition starts cold."""
        suffix = getattr(self.model_runner, "suffix", None)
        if suffix is None:
            # vLLM's own suffix decoding on this worker (benchmarks): its cache can be emptied
            cache = getattr(getattr(self.model_runner, "drafter", None), "suffix_cache", None)
            if clear_cache and cache is not None:
                for req_id in list(cache.cached_requests):
                    cache.evict_cached_response(req_id)
            return {}
        if record is not None:
            suffix.record = {} if record else None
        if clear_cache:
            suffix.cache.clear()
        out = suffix.stats()
        if suffix.record is not None:
            out["drafted"] = {k: [list(d) for d in v] for k, v in suffix.record.items()}
        return out

    def eagle_vllm_sizing_sweep(self, visits: int | None = None, steps_per_visit: int = 3) -> int:
        """Start a calibration sweep (``TreeSizer.start_sweep``) if ``visits`` is given;
        returns the sweep's steps left (0 when none runs, or without the auto sizer)."""
        sizer = getattr(self.model_runner, "sizer", None)
        if sizer is None:
            return 0
        if visits is not None:
            sizer.start_sweep(visits, steps_per_visit)
        return sizer.sweep_steps_left

    def eagle_vllm_sizing_profile(self) -> dict:
        """The sizer's measurements as a profile (``eagle-vllm calibrate``; {} unless auto)."""
        sizer = getattr(self.model_runner, "sizer", None)
        return {} if sizer is None else sizer.export_profile()
