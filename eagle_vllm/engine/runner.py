"""The plugin's model runner: vLLM's runner with the plugin's drafter and verifier.

Written against vLLM 0.32 (``vllm/v1/worker/gpu_model_runner.py`` and
``cpu_model_runner.py``). It swaps two attributes the stock runner builds in
``__init__`` for ``method="eagle"``:

* ``self.drafter``: ``EagleTreeProposer`` (plugin draft model, chain/tree drafting);
* ``self.rejection_sampler``: ``ExactRejectionSampler`` (exact verification).

Everything else (scheduling, KV allocation, bookkeeping, metrics) stays vLLM's.
"""

from __future__ import annotations

import contextlib

from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from eagle_vllm.config import ADDITIONAL_CONFIG_KEY, EagleSpecConfig
from eagle_vllm.engine.proposer import EagleTreeProposer
from eagle_vllm.engine.sampler import ExactRejectionSampler


def eagle_config_of(vllm_config) -> EagleSpecConfig | None:
    extra = vllm_config.additional_config or {}
    data = extra.get(ADDITIONAL_CONFIG_KEY)
    return None if data is None else EagleSpecConfig.from_dict(data)


class EagleRunnerMixin:
    """Installs the plugin's drafter and verifier after the stock runner is built."""

    def _install_eagle(self, device_context) -> None:
        self.eagle_config = eagle_config_of(self.vllm_config)
        if self.eagle_config is None or self.speculative_config is None:
            return
        with device_context():
            self.drafter = EagleTreeProposer(self.vllm_config, self.device, self, self.eagle_config)
        self.rejection_sampler = ExactRejectionSampler(
            self.sampler, self.speculative_config, self.device
        )


class EagleCPUModelRunner(EagleRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self._install_eagle(_torch_cuda_wrapper)


class EagleGPUModelRunner(EagleRunnerMixin, GPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self._install_eagle(contextlib.nullcontext)
