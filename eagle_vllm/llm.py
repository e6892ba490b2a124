"""``eagle_vllm.LLM``: ``vllm.LLM`` that also takes ``speculative_model=`` and a config file."""

from __future__ import annotations

import os
from typing import Any

import vllm

from eagle_vllm.config import (
    METHOD_ALIASES_EAGLE3,
    METHODS,
    EagleConfigError,
    parse_speculative_config,
    validate_against_target,
)
from eagle_vllm.integration import resolve


class LLM(vllm.LLM):
    """Drop-in ``vllm.LLM``.

    Extra arguments:
        speculative_model: an EAGLE draft folder; alone it means ``method: eagle``.
        speculative_config: a dict or the path of a YAML/JSON file with the
            keys documented in the README (``method``, ``model``, ...). Method
            ``eagle``/``eagle3``/``eagle2``/``suffix`` is the plugin's (the head type comes
            from the checkpoint); other vLLM methods (e.g.
            ``{"method": "ngram", ...}``) pass through to vLLM unchanged.
    Everything else goes to ``vllm.LLM`` unchanged.
    """

    def __init__(
        self,
        model: str,
        *args: Any,
        speculative_model: str | os.PathLike | None = None,
        speculative_config: dict[str, Any] | str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        if speculative_model is not None:
            cfg = parse_speculative_config(
                speculative_config if speculative_config is not None else {"method": "eagle"},
                target=model,
                speculative_model=os.fspath(speculative_model),
            )
            validate_against_target(cfg, model, kwargs.get("max_model_len"))
            resolved = cfg.engine_kwargs()
        elif isinstance(speculative_config, dict) and speculative_config.get("method") in (
            *METHODS,
            METHOD_ALIASES_EAGLE3,
        ):
            # Through eagle_vllm.LLM, method eagle (eagle3) means the plugin's chain;
            # vLLM's built-in EAGLE (EAGLE-3) stays reachable through vllm.LLM.
            cfg = parse_speculative_config(speculative_config, target=model)
            validate_against_target(cfg, model, kwargs.get("max_model_len"))
            resolved = cfg.engine_kwargs()
        else:
            resolved = resolve(
                speculative_config, target=model, max_model_len=kwargs.get("max_model_len")
            )
        if resolved is not None:
            extra = kwargs.pop("additional_config", None) or {}
            kwargs["additional_config"] = {**extra, **resolved["additional_config"]}
            kwargs["speculative_config"] = resolved["speculative_config"]
            kwargs["worker_cls"] = resolved["worker_cls"]
            if "scheduler_cls" in resolved:
                if kwargs.get("scheduler_cls") not in (None, resolved["scheduler_cls"]):
                    raise EagleConfigError(
                        f"scheduler_cls '{kwargs['scheduler_cls']}' conflicts with the suffix "
                        f"source's past-response cache, which needs "
                        f"'{resolved['scheduler_cls']}'. Fix: leave scheduler_cls unset, or "
                        "set suffix.cache_requests: 0."
                    )
                kwargs["scheduler_cls"] = resolved["scheduler_cls"]
        elif speculative_config is not None:
            kwargs["speculative_config"] = speculative_config
        super().__init__(model, *args, **kwargs)
