"""Shared fixtures: tiny models built on the spot, and vLLM engines shared per module."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's engine core in the test process: no engine-core process imports vLLM anew for
# each engine (the suite runs in about half the time), and each llm_engine.step() is one step.
# Workers of tensor-parallel engines and servers still run in their own processes. In
# one process, engines must live one after another: shutting one down tears down the
# process's parallel groups, which another live engine still uses.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ENGINE_KW = dict(dtype="float32", enforce_eager=True, max_model_len=512, disable_log_stats=False)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Targets and drafts (see tests/tiny_models.py).

    * ``target_oracle``: next token depends only on the current token.
    * ``target``: the same weights with a little context dependence, so that
      an oracle draft is accepted often but not always and the target's
      attention over the prefix matters.
    """
    from tiny_models import build_draft, build_target

    root = tmp_path_factory.mktemp("tiny")
    t_oracle = build_target(root / "target_oracle", oracle=True)
    t_ctx = build_target(root / "target", oracle=True, context=0.002)
    return {
        "target_oracle": t_oracle,
        "target": t_ctx,
        "draft_oracle": build_draft(root / "draft_oracle", t_oracle, kind="oracle"),
        "draft_noisy": build_draft(
            root / "draft_noisy", t_oracle, kind="oracle", noise=0.002, attn_noise=0.03
        ),
        "draft_random": build_draft(root / "draft_random", t_oracle, kind="random"),
        # SafeAILab variants: fc.bias (large, so it changes the drafts), .bin, embed_tokens
        "draft_oracle_bias": build_draft(
            root / "draft_oracle_bias",
            t_oracle,
            kind="oracle",
            fc_bias=0.5,
            bin_format=True,
            with_embed=True,
        ),
    }


@pytest.fixture(scope="session")
def vanilla_greedy(tiny) -> list[list[int]]:
    """Stock vLLM's greedy output on ``tiny["target"]`` for ``test_eagle_chain.PROMPTS``
    (``greedy()``: 64 tokens, ignore_eos): the reference every exactness test compares with."""
    import vllm
    from test_eagle_chain import PROMPTS, greedy, token_ids

    llm = vllm.LLM(str(tiny["target"]), **ENGINE_KW)
    try:
        return token_ids(llm.generate(PROMPTS, greedy()))
    finally:
        shutdown(llm)


def spec_metrics(llm) -> dict:
    """vLLM's own spec-decode counters of an LLM built with disable_log_stats=False."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.removeprefix("vllm:spec_decode_")] = (
                m.values if hasattr(m, "values") else m.value
            )
    return out


def mean_acceptance_length(metrics: dict) -> float:
    return 1 + metrics["num_accepted_tokens"] / metrics["num_drafts"]


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
