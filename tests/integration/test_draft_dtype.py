"""``draft_dtype``: the draft's GEMMs in bf16 or int8 under a float32 target (CPU, real
vLLM). The output stays the target's greedy output token for token, the drafts stay as
good (the oracle heads' acceptance does not fall), and the layers really multiply in the
asked dtype: the draft's linear layers and its own LM head, never the LM head or
embedding it shares with the target; under int8 the decoder layers only, while the fc
that reads the target's features and every LM head stay float32.

On a CPU without AVX-512 BF16 or AMX ``bfloat16`` is refused, and ``int8`` on a worker
without PyTorch's x86 int8 engine (tests/unit/test_config.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics
from test_eagle_chain import PROMPTS, greedy, token_ids

from eagle_vllm.config import cpu_has_bf16_gemm, cpu_has_int8_gemm

pytestmark = [pytest.mark.vllm]

DTYPES = [
    pytest.param(
        "bfloat16",
        marks=pytest.mark.skipif(
            not cpu_has_bf16_gemm(), reason="needs AVX-512 BF16 or AMX (else the key is refused)"
        ),
    ),
    pytest.param(
        "int8",
        marks=pytest.mark.skipif(
            not cpu_has_int8_gemm(), reason="needs PyTorch's x86 int8 engine (fbgemm)"
        ),
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
    """The dtype each of the drafter's GEMMs multiplies in, by module name ("int8": the
    packed int8 GEMM of models/draft_precision.py)."""

    def dtype_of(module) -> str:
        return "int8" if hasattr(module, "int8_gemm") else str(module.weight.dtype)

    model = worker.model_runner.drafter.model
    out = {
        name: dtype_of(module)
        for name, module in model.model.named_modules()
        if hasattr(module, "quant_method") and "embed" not in name
    }
    out["lm_head"] = dtype_of(model.lm_head)
    if getattr(model, "draft_lm_head", None) is not None:
        out["draft_lm_head"] = str(model.draft_lm_head.dtype)
    return out


@pytest.mark.parametrize("draft_dtype", DTYPES)
@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_draft_dtype_keeps_the_output_and_the_acceptance(
    tiny, heads, vanilla_greedy, head, draft_dtype
):
    from eagle_vllm import LLM

    path, spec = heads[head]
    tau, dtypes = {}, {}
    for dtype in ("model", draft_dtype):
        llm = LLM(
            str(tiny["target"]),
            speculative_config={**spec, "model": str(path), "draft_dtype": dtype},
            **ENGINE_KW,
        )
        try:
            out = token_ids(llm.generate(PROMPTS, greedy()))
            tau[dtype] = mean_acceptance_length(spec_metrics(llm))
            dtypes[dtype] = llm.collective_rpc(_gemm_dtypes)[0]
        finally:
            shutdown(llm)
        assert out == vanilla_greedy, dtype
    assert set(dtypes["model"].values()) == {"torch.float32"}, dtypes["model"]
    low = dtypes[draft_dtype]
    want = "torch.bfloat16" if draft_dtype == "bfloat16" else "int8"
    gemms = {k: v for k, v in low.items() if k != "lm_head" or head == "eagle3"}
    if draft_dtype == "int8":  # the fc reading the target's features, and LM heads: float
        kept = {k: gemms.pop(k) for k in ("fc", "lm_head", "draft_lm_head") if k in gemms}
        assert set(kept.values()) == {"torch.float32"} and "fc" in kept, low
    assert set(gemms.values()) == {want}, low
    assert any("qkv_proj" in k for k in gemms) and any("down_proj" in k for k in gemms), low
    if head == "eagle1":  # the LM head is the target's: it stays float32
        assert low["lm_head"] == "torch.float32" and "draft_lm_head" in low, low
    assert tau[draft_dtype] >= tau["model"] - 0.05, tau
    assert tau["model"] > 1.5, tau  # the drafts are good enough to notice a worse one
