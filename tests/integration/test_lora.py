"""LoRA adapters with speculation on: the target runs with the request's adapter in the
verification forward (trees included), the draft stays the base model's head, and greedy
output equals vanilla vLLM's with the same adapter."""

from __future__ import annotations

import pytest
from conftest import ENGINE_KW, shutdown, spec_metrics
from test_eagle_chain import PROMPTS, greedy, token_ids

pytestmark = pytest.mark.vllm

LORA_KW = dict(enable_lora=True, max_lora_rank=8, max_loras=2)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    from tiny_models import build_lora

    root = tmp_path_factory.mktemp("lora")
    return [build_lora(root / f"lora{i}", tiny["target"], seed=i) for i in range(2)]


def _generate(llm, adapters):
    """One batch alternating the two adapters, then the base model alone.

    Not one batch mixing adapter and no-adapter requests: on vLLM 0.32's CPU build the
    no-adapter requests of such a batch decode wrongly (and differently from run to
    run) without any speculation; see docs/lossless-verification.md."""
    from vllm.lora.request import LoRARequest

    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    prompts = PROMPTS[:6]
    lora = [requests[i % 2] for i in range(len(prompts))]
    return (
        token_ids(llm.generate(prompts, greedy(), lora_request=lora)),
        token_ids(llm.generate(prompts[:2], greedy())),
    )


@pytest.fixture(scope="module")
def lora_vanilla(tiny, adapters):
    import vllm

    llm = vllm.LLM(str(tiny["target"]), **ENGINE_KW, **LORA_KW)
    want = _generate(llm, adapters)
    shutdown(llm)
    with_lora, base = want
    # the adapters change the outputs (else this test would prove nothing)
    assert with_lora[0] != base[0] and with_lora[1] != base[1]
    return want


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_lora_greedy_equals_vanilla(tiny, adapters, lora_vanilla, head, tmp_path):
    """EAGLE-3: the auxiliary features come from the adapted target forward, the draft
    embeds with the base embedding (vLLM wraps the shared one for LoRA)."""
    from tiny_models import build_eagle3_draft

    from eagle_vllm import LLM

    draft = (
        tiny["draft_noisy"]
        if head == "eagle1"
        else build_eagle3_draft(tmp_path / "e3", tiny["target_oracle"], kind="oracle2")
    )
    spec = {"method": "eagle2", "model": str(draft), "num_speculative_tokens": 3,
            "topk": 3, "total_tokens": 8}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, **ENGINE_KW, **LORA_KW)
    got = _generate(llm, adapters)
    metrics = spec_metrics(llm)
    shutdown(llm)
    assert got == lora_vanilla
    assert metrics["num_drafts"] > 0 and metrics["num_accepted_tokens"] > 0
