"""``draft_dtype: bfloat16``: the draft's GEMMs in bf16 under a float32 target (CPU, real
vLLM). The output stays the target's greedy output token for token, the drafts stay as
good (the oracle heads' acceptance does not fall), and the layers really multiply in
bf16: the draft's linear layers and its own LM head, never the LM head or embedding
it shares with the target.

On a CPU without AVX-512 BF16 or AMX the key is refused (tests/unit/test_config.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics
from test_eagle_chain import PROMPTS, greedy, token_ids

from eagle_vllm.config import cpu_has_bf16_gemm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not cpu_has_bf16_gemm(), reason="needs AVX-512 BF16 or AMX (else the key is refused)"
    ),
]


@pytest.fixture(scope="module")
def heads(tiny, tmp_path_factory):
    """An EAGLE-1 head drafting over a reduced vocabulary (its own copy of the LM-head
    rows), and an EAGLE-3 head with its own 200-token LM head."""
    from tiny_models import build_eagle3_draft

    root = tmp_path_factory.mktemp("draft_dtype")
    eagle1 = root / "eagle1"
    shutil.copytree(tiny["draft_noisy"], eagle1)
    ranked = torch.randperm(254, generator=torch.Generator().manual_seed(0))
    (eagle1 / "draft_vocab.json").write_text(json.dumps({"token_ids": ranked.tolist()}))
    eagle3 = build_eagle3_draft(
        root / "eagle3", tiny["target_oracle"], kind="oracle2", draft_vocab=200
    )
    return {
        "eagle1": (eagle1, {"method": "eagle2", "num_speculative_tokens": 3, "topk": 2,
                            "total_tokens": 6, "draft_vocab": 254}),
        "eagle3": (eagle3, {"method": "eagle3", "num_speculative_tokens": 3,
                            "draft_sample_method": "greedy"}),
    }  # fmt: skip


def _gemm_dtypes(worker) -> dict[str, str]:
    """The dtype each of the drafter's GEMMs multiplies in, by module name."""
    model = worker.model_runner.drafter.model
    out = {
        name: str(module.weight.dtype)
        for name, module in model.model.named_modules()
        if hasattr(module, "quant_method") and "embed" not in name
    }
    out["lm_head"] = str(model.lm_head.weight.dtype)
    if getattr(model, "draft_lm_head", None) is not None:
        out["draft_lm_head"] = str(model.draft_lm_head.dtype)
    return out


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_bf16_draft_keeps_the_output_and_the_acceptance(tiny, heads, vanilla_greedy, head):
    from eagle_vllm import LLM

    path, spec = heads[head]
    tau, dtypes = {}, {}
    for draft_dtype in ("model", "bfloat16"):
        llm = LLM(
            str(tiny["target"]),
            speculative_config={**spec, "model": str(path), "draft_dtype": draft_dtype},
            **ENGINE_KW,
        )
        try:
            out = token_ids(llm.generate(PROMPTS, greedy()))
            tau[draft_dtype] = mean_acceptance_length(spec_metrics(llm))
            dtypes[draft_dtype] = llm.collective_rpc(_gemm_dtypes)[0]
        finally:
            shutdown(llm)
        assert out == vanilla_greedy, draft_dtype
    assert set(dtypes["model"].values()) == {"torch.float32"}, dtypes["model"]
    bf16 = dtypes["bfloat16"]
    gemms = {k: v for k, v in bf16.items() if k != "lm_head" or head == "eagle3"}
    assert set(gemms.values()) == {"torch.bfloat16"}, bf16
    assert any("qkv_proj" in k for k in gemms) and any("down_proj" in k for k in gemms), bf16
    if head == "eagle1":  # the LM head is the target's: it stays float32
        assert bf16["lm_head"] == "torch.float32" and "draft_lm_head" in bf16, bf16
    assert tau["bfloat16"] >= tau["model"] - 0.05, tau
    assert tau["model"] > 1.5, tau  # the drafts are good enough to notice a worse one
