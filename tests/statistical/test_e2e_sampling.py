"""Sampling through real vLLM keeps the target's distribution (chains and trees).

A tiny target with a 10-token vocabulary and spread-out distributions; 20k
samples of the first three generated tokens with speculation and 20k without.
Two-sample chi-square tests on the joint distributions of tokens (1, 2) and
(2, 3) must not reject at 1e-4 (the second and third tokens are the ones the
verifier decides). vLLM's own EAGLE on CPU is the negative control: it is known
not to be lossless there (see README), and the same test must reject it.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ENGINE_KW, mean_acceptance_length, shutdown, spec_metrics

pytestmark = pytest.mark.vllm

N_SAMPLES = 20_000
PROMPT = "w1 w2 w3"
P_MIN = 1e-4


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from tiny_models import build_draft, build_eagle3_draft, build_target

    root = tmp_path_factory.mktemp("small")
    target = build_target(root / "target", oracle=True, context=0.002, words=6, lm_scale=0.3)
    return {
        "target": target,
        "good": build_draft(root / "good", target, kind="oracle"),
        "random": build_draft(root / "random", target, kind="random"),
        # EAGLE-3 heads: q over a 7-of-10-token draft vocabulary (d2t), zero elsewhere
        "e3good": build_eagle3_draft(root / "e3good", target, kind="oracle2", draft_vocab=7),
        "e3random": build_eagle3_draft(root / "e3random", target, draft_vocab=7),
    }


def _samples(llm, temperature: float, top_p: float = 1.0, seeded: bool = False) -> np.ndarray:
    from vllm import SamplingParams

    kw = dict(temperature=temperature, top_p=top_p, max_tokens=3, ignore_eos=True)
    # seeded: request i has seed i, so its draws come from generators keyed by
    # (seed, position) (verify/position_rng.py); over many seeds they must still
    # follow the target's distribution
    params = [SamplingParams(**kw, seed=i) for i in range(N_SAMPLES)] if seeded else None
    outs = llm.generate([PROMPT] * N_SAMPLES, params or SamplingParams(**kw), use_tqdm=False)
    return np.array([list(o.outputs[0].token_ids) for o in outs])


def _two_sample_p(a: np.ndarray, b: np.ndarray, cols: tuple[int, int]) -> float:
    from scipy.stats import chi2_contingency

    vocab = int(max(a.max(), b.max())) + 1

    def counts(x):
        keys = x[:, cols[0]] * vocab + x[:, cols[1]]
        return np.bincount(keys, minlength=vocab * vocab)

    table = np.stack([counts(a), counts(b)])
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table)[1])


@pytest.fixture(scope="module")
def vanilla(small):
    import vllm

    llm = vllm.LLM(str(small["target"]), **ENGINE_KW, seed=1)
    out = {"t1": _samples(llm, 1.0), "t07": _samples(llm, 0.7, 0.9)}
    shutdown(llm)
    return out


def _spec_samples(target, spec, temperature, top_p=1.0, builtin=False, seeded=False, tau=None):
    import vllm

    from eagle_vllm import LLM

    cls = vllm.LLM if builtin else LLM
    llm = cls(str(target), speculative_config=spec, **ENGINE_KW, seed=2)
    samples = _samples(llm, temperature, top_p, seeded)
    if tau is not None:
        tau.append(mean_acceptance_length(spec_metrics(llm)))
    shutdown(llm)
    return samples


# eagle2 drafts top-k trees (verified by the target-only rule); eagle chains default to
# drafts sampled from q (verified with min(1, p/q)); "eagle-greedy" drafts argmax chains.
CASES = [
    pytest.param("eagle2", "good", 1.0, 1.0, id="eagle2-good-T1"),
    pytest.param("eagle", "random", 0.7, 0.9, id="eagle-sampled-random-T0.7-top_p0.9"),
    pytest.param("eagle", "good", 1.0, 1.0, id="eagle-sampled-good-T1"),
    pytest.param("eagle2", "random", 0.7, 0.9, id="eagle2-random-T0.7-top_p0.9"),
    pytest.param(
        "eagle-greedy", "good", 1.0, 1.0, id="eagle-greedy-good-T1", marks=pytest.mark.slow
    ),
    # suffix candidates from the prompt and from the cache of past responses (20k requests
    # of the same prompt: a cache that always predicts the likeliest continuations),
    # merged into the tree, and alone
    pytest.param("eagle2+suffix", "good", 1.0, 1.0, id="eagle2-suffix-good-T1"),
    pytest.param("suffix", None, 0.7, 0.9, id="suffix-T0.7-top_p0.9"),
    # EAGLE-3 heads: a tree, and a chain sampled from q over the head's draft vocabulary
    pytest.param("eagle2", "e3good", 1.0, 1.0, id="eagle2-eagle3-good-T1"),
    pytest.param("eagle", "e3random", 0.7, 0.9, id="eagle-sampled-eagle3-random-T0.7-top_p0.9"),
]


def _spec(small, method: str, draft: str | None) -> dict:
    if method == "suffix":
        return {"method": "suffix", "suffix": {"max_nodes": 6}}
    spec = {"method": method, "model": str(small[draft]), "num_speculative_tokens": 3}
    if method == "eagle2+suffix":
        spec.update(method="eagle2", suffix={"max_nodes": 6})
    if spec["method"] == "eagle2":
        spec.update(topk=3, total_tokens=8)
    if method == "eagle-greedy":
        spec.update(method="eagle", draft_sample_method="greedy")
    if method == "eagle":
        spec.update(draft_sample_method="sample")
    return spec


@pytest.mark.parametrize("method,draft,temperature,top_p", CASES)
def test_sampled_distribution_matches_vanilla(small, vanilla, method, draft, temperature, top_p):
    spec = _spec(small, method, draft)
    tau: list[float] = []
    _check(_spec_samples(small["target"], spec, temperature, top_p, tau=tau), vanilla, temperature)
    if "suffix" in method:  # suffix drafts were accepted: the verifier decided positions
        assert tau[0] > 1.05, tau


def test_sampled_drafts_are_accepted_more_often_at_t1(small):
    """With a draft close to the target, drafts sampled from q are accepted with
    min(1, p/q) ~ 1, argmax drafts only with p(argmax): sampling must raise tau."""
    from vllm import SamplingParams

    from eagle_vllm import LLM

    taus = {}
    for method in ("sample", "greedy"):
        spec = {"method": "eagle", "model": str(small["good"]), "num_speculative_tokens": 3,
                "draft_sample_method": method}  # fmt: skip
        llm = LLM(str(small["target"]), speculative_config=spec, **ENGINE_KW, seed=3)
        params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
        llm.generate([PROMPT] * 300, params, use_tqdm=False)
        taus[method] = mean_acceptance_length(spec_metrics(llm))
        shutdown(llm)
    assert taus["sample"] > taus["greedy"] + 0.5, taus


def test_seeded_requests_with_auto_sizing_match_vanilla(small, vanilla):
    """Per-request seeds (keyed draws) and load-aware sizing together, at T=1 against
    vanilla's unseeded samples (the sizer's warm-up tries every tree size, and steps
    without drafts, at each batch size it meets)."""
    spec = {"method": "eagle2", "model": str(small["good"]), "num_speculative_tokens": 3,
            "topk": 3, "total_tokens": "auto", "max_total_tokens": 8}  # fmt: skip
    _check(_spec_samples(small["target"], spec, 1.0, seeded=True), vanilla, 1.0)


def _check(ours, vanilla, temperature):
    ref = vanilla["t1" if temperature == 1.0 else "t07"]
    for cols in ((0, 1), (1, 2)):
        p = _two_sample_p(ours, ref, cols)
        assert p > P_MIN, f"tokens {cols}: chi-square p={p:.2e}"


def test_the_test_rejects_vllm_builtin_eagle_on_cpu(small, vanilla):
    spec = {"method": "eagle", "model": str(small["good"]), "num_speculative_tokens": 3}
    theirs = _spec_samples(small["target"], spec, 1.0, builtin=True)
    p = min(_two_sample_p(theirs, vanilla["t1"], cols) for cols in ((0, 1), (1, 2)))
    assert p < P_MIN, p


def test_drafts_cannot_change_a_seeded_output(small, monkeypatch):
    """A seeded request's tokens are the same with trees verified as without drafts:
    every seeded draw, the verifier's walk included, is vLLM's sampler's with the
    generator keyed by (seed, position) (engine/sampler.py). A walk with its own
    exponential race would fail: vLLM 0.32's CPU sampler makes a fused Gumbel-max draw
    instead, so the positions such a walk decided would come out different."""
    from vllm import SamplingParams

    from eagle_vllm import LLM

    params = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=10, ignore_eos=True)
        for i in range(48)
    ]
    prompts = [PROMPT] * len(params)
    spec = {"method": "eagle2", "model": str(small["good"]), "num_speculative_tokens": 3,
            "topk": 3, "total_tokens": 8}  # fmt: skip
    llm = LLM(str(small["target"]), speculative_config=spec, **ENGINE_KW, seed=2)
    with_trees = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    metrics = spec_metrics(llm)
    shutdown(llm)
    # the same engine with the load-aware sizer held at no drafts in every step
    monkeypatch.setenv("EAGLE_VLLM_SIZER_PIN", "0,1")
    llm = LLM(str(small["target"]), speculative_config={**spec, "total_tokens": "auto"},
              **ENGINE_KW, seed=5)  # fmt: skip
    without = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    drafted_after = spec_metrics(llm).get("num_drafts", 0)
    shutdown(llm)
    assert metrics["num_accepted_tokens"] > len(params)  # the walk decided many positions
    assert drafted_after == 0
    assert with_trees == without
