"""Requests that must be exact with speculation on (EAGLE-2 trees), or refused clearly.

Each case runs on vanilla vLLM and on eagle-vllm ``eagle2`` (fp32, tiny models)
and compares: max_tokens=1, prompts at max_model_len, n>1, seeds, logprobs and
prompt_logprobs (the target's), penalties, structured output, an empty prompt.
"""

from __future__ import annotations

import pytest
from conftest import ENGINE_KW, shutdown, spec_metrics

pytestmark = pytest.mark.vllm

PROMPTS = [" ".join(f"w{(11 * i + 3 * j) % 250}" for i in range(4 + 5 * j)) for j in range(6)]
LONG = " ".join(f"w{(5 * i + 3) % 250}" for i in range(509))  # + BOS = 510 of 512
RESENT = " ".join(f"w{(7 * i + 1) % 250}" for i in range(300))


def _cases():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    g = dict(temperature=0, ignore_eos=True)
    return {
        "max_tokens_1": (PROMPTS, SamplingParams(max_tokens=1, **g)),
        "at_max_model_len": ([LONG], SamplingParams(max_tokens=16, **g)),
        "logprobs": (PROMPTS, SamplingParams(max_tokens=24, logprobs=3, **g)),
        "prompt_logprobs": (PROMPTS[:3], SamplingParams(max_tokens=4, prompt_logprobs=2, **g)),
        "penalties": (
            PROMPTS,
            SamplingParams(max_tokens=32, repetition_penalty=1.5, presence_penalty=0.5, **g),
        ),  # fmt: skip
        "mixed_penalty_batch": (
            PROMPTS,
            [
                SamplingParams(max_tokens=32, frequency_penalty=0.8 * (i % 2), **g)
                for i in range(len(PROMPTS))
            ],
        ),  # fmt: skip
        # a built-in logits processor acting on the target rows the verifier reads
        "min_tokens": (
            PROMPTS[:3],
            SamplingParams(max_tokens=24, min_tokens=12, temperature=0),
        ),  # fmt: skip
        "structured_regex": (
            PROMPTS[:3],
            SamplingParams(
                max_tokens=12,
                structured_outputs=StructuredOutputsParams(regex=r"(w1|w2|w3)+"),
                temperature=0,
            ),
        ),  # fmt: skip
    }


def _run(llm) -> dict:
    from vllm import SamplingParams

    out = {}
    for name, (prompts, params) in _cases().items():
        res = llm.generate(prompts, params, use_tqdm=False)
        out[name] = [
            {
                "tokens": [list(c.token_ids) for c in r.outputs],
                "logprobs": [c.logprobs for c in r.outputs],
                "prompt_logprobs": r.prompt_logprobs,
                "finish": [c.finish_reason for c in r.outputs],
            }
            for r in res
        ]
    # the same prompt twice: the second one reads the first one's blocks from the
    # prefix cache (block size 128 on CPU)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    out["resent"] = [
        [
            (list(r.outputs[0].token_ids), r.num_cached_tokens)
            for r in llm.generate([RESENT], params, use_tqdm=False)
        ]  # fmt: skip
        for _ in range(2)
    ]
    return out


@pytest.fixture(scope="module")
def vanilla(tiny):
    import vllm

    llm = vllm.LLM(str(tiny["target"]), **ENGINE_KW)
    out = _run(llm)
    shutdown(llm)
    return out


@pytest.fixture(scope="module")
def tree_llm(tiny, vanilla):
    from eagle_vllm import LLM

    spec = {"method": "eagle2", "model": str(tiny["draft_noisy"]), "num_speculative_tokens": 3,
            "topk": 3, "total_tokens": 8}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, **ENGINE_KW)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def tree(tree_llm):
    return _run(tree_llm)


@pytest.mark.parametrize("case", ["max_tokens_1", "at_max_model_len", "penalties",
                                  "mixed_penalty_batch", "structured_regex",
                                  "min_tokens"])  # fmt: skip
def test_tokens_equal_vanilla(vanilla, tree, case):
    assert [r["tokens"] for r in tree[case]] == [r["tokens"] for r in vanilla[case]]
    assert [r["finish"] for r in tree[case]] == [r["finish"] for r in vanilla[case]]


def test_a_resent_prompt_hits_as_many_cached_blocks_as_vanilla(vanilla, tree):
    """vLLM drops the last prefix-cache block an EAGLE request hits (its drafter wants
    those hidden states); this plugin's drafter does not, so a resent prompt reuses
    every full block, like vanilla, and recomputes only its partial last block."""
    (_, first_cached), (tokens, cached) = (run[0] for run in tree["resent"])
    assert first_cached == 0
    assert cached == vanilla["resent"][1][0][1] >= 256  # 2 full blocks of 128 reused
    assert tokens == vanilla["resent"][1][0][0] == vanilla["resent"][0][0][0]


def test_at_max_model_len_stops_by_length(tree):
    (r,) = tree["at_max_model_len"]
    assert r["finish"] == ["length"] and 1 <= len(r["tokens"][0]) < 16  # capped by the model length


def test_penalised_requests_still_speculate(tree_llm):
    """Requests with penalties are verified as chains (vLLM conditions penalties on a
    chain), not refused: drafts are still accepted."""
    from vllm import SamplingParams

    before = spec_metrics(tree_llm)["num_accepted_tokens"]
    tree_llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0,
                                              repetition_penalty=1.2), use_tqdm=False)  # fmt: skip
    assert spec_metrics(tree_llm)["num_accepted_tokens"] > before


def _close_logprobs(a, b):
    """Same token ids with logprobs within fp32 noise, position by position."""
    assert len(a) == len(b)
    for pa, pb in zip(a, b):
        if pa is None or pb is None:
            assert pa is pb
            continue
        assert set(pa) == set(pb)
        for tok in pa:
            assert pa[tok].logprob == pytest.approx(pb[tok].logprob, abs=1e-3)


def test_logprobs_are_the_targets(vanilla, tree):
    for mine, theirs in zip(tree["logprobs"], vanilla["logprobs"]):
        assert mine["tokens"] == theirs["tokens"]
        _close_logprobs(mine["logprobs"][0], theirs["logprobs"][0])


def test_prompt_logprobs_are_the_targets(vanilla, tree):
    for mine, theirs in zip(tree["prompt_logprobs"], vanilla["prompt_logprobs"]):
        _close_logprobs(mine["prompt_logprobs"], theirs["prompt_logprobs"])


def test_seeded_sampling_repeats_exactly(tree_llm):
    """The same seed gives the same output, call after call (prefix cache warm or not,
    batch shared with other requests or not), because every random draw is keyed by
    (seed, sequence position): see eagle_vllm/verify/position_rng.py."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=1.0, n=3, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)

    def run(extra: int):
        prompts = PROMPTS[:2] + PROMPTS[2 : 2 + extra]
        res = tree_llm.generate(prompts, [params] * 2 + [other] * extra, use_tqdm=False)
        return [[tuple(c.token_ids) for c in r.outputs] for r in res[:2]]

    first = run(0)
    assert run(0) == first
    assert run(3) == first  # sharing the batch with unseeded requests changes nothing
    for samples in first:
        assert len(samples) == 3 and all(len(s) == 24 for s in samples)


def test_too_long_and_empty_prompts_are_refused(tree_llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMError

    with pytest.raises(
        (ValueError, VLLMError), match="(?i)max.model.len|maximum model length|too long"
    ):
        tree_llm.generate([LONG + " w1 w2 w3"], SamplingParams(max_tokens=4))
    with pytest.raises((ValueError, VLLMError), match="(?i)empty|prompt"):
        tree_llm.generate([{"prompt_token_ids": []}], SamplingParams(max_tokens=4))


def test_min_p_and_logit_bias_are_refused_clearly(tree_llm):
    """vLLM 0.32 refuses both with any speculative decoding, at request validation, before
    the request reaches the engine; the engine keeps serving."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMError

    for bad in (dict(min_p=0.1), dict(logit_bias={57: 4.0})):
        with pytest.raises((ValueError, VLLMError), match="min_p and logit_bias"):
            tree_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, **bad))
    out = tree_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


JSON_TOKENS = ("{", "}", '"', ":", ",", *"0123456789")
JSON_SCHEMA = {
    "type": "object",
    "properties": {"w1": {"type": "integer"}, "w7": {"type": "integer"}},
    "required": ["w1", "w7"],
    "additionalProperties": False,
}


def test_guided_json_equals_vanilla(tmp_path):
    """Structured output with a JSON schema (xgrammar) through trees: the same tokens as
    vanilla vLLM, and they spell an object of the schema. The tiny vocabulary gets JSON
    punctuation and digits as whole tokens (a word-level tokenizer)."""
    import json

    import vllm
    from tiny_models import build_draft, build_eagle3_draft, build_target
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from eagle_vllm import LLM

    target = build_target(tmp_path / "t", oracle=True, context=0.002, extra_tokens=JSON_TOKENS)
    oracle = build_target(tmp_path / "o", oracle=True, extra_tokens=JSON_TOKENS)
    draft = build_draft(tmp_path / "d", oracle, kind="oracle", noise=0.002, attn_noise=0.03)
    # an EAGLE-3 head too: its drafts are cut by the grammar like any other
    draft3 = build_eagle3_draft(tmp_path / "d3", oracle, kind="oracle2")
    params = SamplingParams(
        max_tokens=40,
        temperature=0,
        structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA),
    )
    results = []
    for build in (
        lambda: vllm.LLM(str(target), **ENGINE_KW),
        lambda: LLM(str(target), speculative_config={"method": "eagle2", "model": str(draft),
                    "num_speculative_tokens": 3, "topk": 3, "total_tokens": 8}, **ENGINE_KW),
        lambda: LLM(str(target), speculative_config={"method": "eagle2", "model": str(draft3),
                    "num_speculative_tokens": 3, "topk": 3, "total_tokens": 8}, **ENGINE_KW),
    ):  # fmt: skip
        llm = build()
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        tok = llm.get_tokenizer()
        results.append([(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs])
        shutdown(llm)
    assert results[0] == results[1] == results[2]
    parsed = 0
    for token_ids, finish in results[1]:
        text = "".join(tok.convert_ids_to_tokens(token_ids)).removesuffix("</s>")
        if finish == "stop":
            assert set(json.loads(text)) == {"w1", "w7"}, text
            parsed += 1
    assert parsed >= 1, results[1]  # at least one object completed within max_tokens
