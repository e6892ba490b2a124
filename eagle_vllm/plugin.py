"""vLLM plugin entry point (``vllm.general_plugins`` -> ``eagle_vllm.plugin:register``).

vLLM calls ``register()`` in every process (front end, engine core, workers),
so it is idempotent and cheap: it registers the draft architectures by name
(lazily imported) and wraps two ``EngineArgs`` methods so that
``--speculative-config`` accepts a YAML/JSON file path. The wrappers are
pass-throughs unless a config is meant for eagle_vllm (a file path, method
``eagle2`` or an eagle_vllm-only key); plain ``{"method": "eagle"}`` stays
vLLM's built-in EAGLE. Worker-side hooks are installed only by the plugin's
``worker_cls``, which only an eagle_vllm config selects.
An eagle_vllm config that asks for ``distributed_executor_backend="ray"`` on CPU gets
the plugin's Ray executor (``eagle_vllm.ray_cpu``; vLLM 0.32 refuses Ray on CPU).

Written against vLLM 0.32 (vllm/engine/arg_utils.py).
"""

from __future__ import annotations

import functools

_REGISTERED = False
# The draft heads, by architecture name (importing them would import vLLM's models).
DRAFT_ARCHITECTURES = {
    "EagleVllmLlamaForCausalLM": "eagle_vllm.models.eagle_llama:EagleVllmLlamaForCausalLM",
    "EagleVllmEagle3LlamaForCausalLM": (
        "eagle_vllm.models.eagle3_llama:EagleVllmEagle3LlamaForCausalLM"
    ),
}


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True

    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for architecture, class_path in DRAFT_ARCHITECTURES.items():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, class_path)
    _patch_engine_args()


def _patch_engine_args() -> None:
    from eagle_vllm.vllm_surface import engine_args_class

    EngineArgs = engine_args_class()

    if getattr(EngineArgs, "_eagle_vllm_patched", False):
        return
    EngineArgs._eagle_vllm_patched = True

    original_add_cli_args = EngineArgs.add_cli_args
    original_create_engine_config = EngineArgs.create_engine_config

    @functools.wraps(original_add_cli_args)
    def add_cli_args(parser, *args, **kwargs):
        parser = original_add_cli_args(parser, *args, **kwargs)
        from eagle_vllm.integration import speculative_config_arg

        for action in parser._actions:
            if "--speculative-config" in action.option_strings:
                action.type = speculative_config_arg
        return parser

    @functools.wraps(original_create_engine_config)
    def create_engine_config(self, *args, **kwargs):
        from eagle_vllm.integration import apply_to_engine_args

        apply_to_engine_args(self)
        return original_create_engine_config(self, *args, **kwargs)

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.create_engine_config = create_engine_config
