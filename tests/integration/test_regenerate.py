"""``eagle-vllm train --regenerate``: the dataset's answers replaced by the target's own."""

from __future__ import annotations

import json

import pytest
from conftest import ENGINE_KW, shutdown

pytestmark = pytest.mark.vllm

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def test_regenerated_answers_are_the_targets_greedy_answers(tmp_path):
    import vllm
    from tiny_models import build_target
    from vllm import SamplingParams

    from eagle_vllm.train.regenerate import regenerate_answers

    target = build_target(tmp_path / "t", oracle=True, context=0.002)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    conversations = [
        [
            {"role": "user", "content": "w1 w2 w3"},
            {"role": "assistant", "content": "w9 w9"},
            {"role": "user", "content": "w4"},
            {"role": "assistant", "content": "w8"},
        ],
        [{"role": "user", "content": " ".join(f"w{i % 200}" for i in range(600))}],  # too long
        [{"role": "user", "content": "w17 w5"}, {"role": "assistant", "content": "w3"}],
    ]
    progress = tmp_path / "progress.jsonl"
    got = regenerate_answers(
        target,
        conversations,
        max_tokens=8,
        dtype="float32",
        max_model_len=512,
        progress_file=progress,
        chunk=1,
    )

    llm = vllm.LLM(str(target), **ENGINE_KW)
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template(c[:1], tokenize=False) for c in (conversations[0], conversations[2])
    ]
    want = [
        o.outputs[0].text
        for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    ]
    shutdown(llm)
    assert [c[0] for c in got] == [conversations[0][0], conversations[2][0]]  # long one dropped
    assert [c[1] for c in got] == [{"role": "assistant", "content": w} for w in want]
    assert all(len(c) == 2 for c in got) and all(w.strip() for w in want)
    # one line per kept prompt, written as each chunk finished: a rerun resumes from it
    rows = [json.loads(line) for line in progress.read_text().splitlines()]
    assert rows == [{"index": i, "answer": w} for i, w in enumerate(want)]
