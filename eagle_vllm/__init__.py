"""eagle-vllm: EAGLE-1 chains and EAGLE-2 dynamic trees for stock vLLM, verified exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from eagle_vllm.llm import LLM


def load_speculative_config(config: Any, target: str | None = None) -> dict[str, Any]:
    """Engine kwargs (``speculative_config``, ``additional_config``, ``worker_cls``)
    for ``vllm.LLM(model, **load_speculative_config("eagle.yaml", model))``."""
    from eagle_vllm.config import parse_speculative_config, validate_against_target

    cfg = parse_speculative_config(config, target=target)
    if target is not None:
        validate_against_target(cfg, target)
    return cfg.engine_kwargs()


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing vllm takes seconds
        from eagle_vllm.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "load_speculative_config", "__version__"]
