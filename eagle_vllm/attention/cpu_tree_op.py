"""The fused CPU tree-attention op (``csrc/tree_attention_cpu.cpp``), built on first use.

One C++ call per attention layer reads each tree's prefix straight out of vLLM's paged
CPU cache and the nodes' K/V from the step's rows, so no prefix is gathered into a dense
tensor (the torch path in ``cpu_backend.py``). It is compiled with the machine's
compiler through ``torch.utils.cpp_extension`` into torch's extension cache, under a
name that includes this CPU's instruction-set flags (it is built with
``-march=native``, so a cache shared with another CPU model cannot run foreign code).

``EAGLE_VLLM_TREE_ATTENTION`` chooses: ``fused`` (the default; falls back to ``torch``
with a warning when the op cannot be built), ``torch`` (the gather + SDPA path).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "tree_attention_cpu.cpp"
CHOICES = ("fused", "torch")


def requested() -> str:
    value = os.environ.get("EAGLE_VLLM_TREE_ATTENTION", "fused")
    if value not in CHOICES:
        raise ValueError(
            f"EAGLE_VLLM_TREE_ATTENTION={value!r}: expected one of {CHOICES}. "
            "Fix: set it to 'fused' (default) or 'torch', or unset it."
        )
    return value


def _cpu_fingerprint() -> str:
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )  # fmt: skip
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


@functools.lru_cache(maxsize=1)
def load() -> Callable | None:
    """The op (``tree_attention(query, key, value, kv_cache, rows, num_nodes, blocks,
    prefix_len, allowed, scale, out)``), or None when the torch path is requested or
    the op cannot be built here (logged once)."""
    if requested() != "fused":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        source_hash = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:10]
        module = build(
            name=f"eagle_vllm_tree_attention_{source_hash}_{_cpu_fingerprint()}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, an unsupported platform
        logger.warning(
            "eagle_vllm: the fused CPU tree-attention op could not be built (%s); "
            "using the torch path (slower). Fix: install a C++ compiler, or set "
            "EAGLE_VLLM_TREE_ATTENTION=torch to silence this.",
            exc,
        )
        return None
    return module.tree_attention
