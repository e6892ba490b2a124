"""The benchmarks' prompt pools: distinct prompts, every set mixed into any window."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from common import interleaved_prompts, load_prompts, raw_prompts  # noqa: E402


class _ChatTemplate:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "<user>" + messages[0]["content"] + "<assistant>"


def test_curve_pool_interleaves_distinct_prompts():
    pool = interleaved_prompts("mtbench,humaneval", _ChatTemplate())
    mtbench, humaneval = raw_prompts("mtbench"), raw_prompts("humaneval")
    assert (len(mtbench), len(humaneval)) == (80, 164)
    assert len(pool) == len(set(pool)) == 244
    # alternating while both last, then the rest of HumanEval in order
    assert pool[:4] == ["<user>" + mtbench[0] + "<assistant>", humaneval[0],
                        "<user>" + mtbench[1] + "<assistant>", humaneval[1]]  # fmt: skip
    assert pool[160:] == humaneval[80:]
    # the warm-up loads never repeat a timed prompt
    warm = load_prompts("mtbench-turn2", 80, _ChatTemplate())
    assert not set(warm) & set(pool)


def test_unknown_prompt_set_names_the_fix():
    with pytest.raises(SystemExit, match="unknown prompt set 'sharegpt'.*Fix: one of mtbench"):
        raw_prompts("sharegpt")


def test_mtbench_sets_mix_categories_and_name_one():
    from eagle_vllm.datasets import mtbench_prompts

    assert raw_prompts("mtbench")[:2] == [mtbench_prompts(0, "writing")[0],
                                          mtbench_prompts(0, "roleplay")[0]]  # fmt: skip
    assert raw_prompts("mtbench:math") == mtbench_prompts(0, "math")
    assert raw_prompts("mtbench-turn2:coding") == mtbench_prompts(1, "coding")
    with pytest.raises(SystemExit, match="unknown MT-bench category 'poetry'"):
        raw_prompts("mtbench:poetry")
    with pytest.raises(SystemExit, match="unknown prompt set 'humaneval:x'"):
        raw_prompts("humaneval:x")
