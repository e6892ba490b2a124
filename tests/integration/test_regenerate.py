"""``eagle-vllm train --regenerate``: the dataset's answers replaced by the target's own."""

from __future__ import annotations

import json

import pytest
from conftest import ENGINE_KW, shutdown

pytestmark = pytest.mark.vllm

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _chat_target(tmp_path):
    """A tiny oracle target with a plain chat template."""
    from tiny_models import build_target

    target = build_target(tmp_path / "t", oracle=True, context=0.002)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return target


def test_regenerated_answers_are_the_targets_greedy_answers(tmp_path, monkeypatch):
    import vllm
    from vllm import SamplingParams

    from eagle_vllm.train.regenerate import regenerate_answers

    target = _chat_target(tmp_path)
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
    # a rerun with every answer written returns the same without starting an engine
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: pytest.fail("an engine was started"))
    again = regenerate_answers(target, conversations, max_tokens=8, dtype="float32",
                               max_model_len=512, progress_file=progress, chunk=1)  # fmt: skip
    assert again == got


def test_raw_prompts_are_completed_without_the_chat_template(tmp_path):
    """--data code: each stub is completed as vLLM completes a raw prompt, and a completion
    that ended on the end-of-sequence token keeps it."""
    import vllm
    from vllm import SamplingParams

    from eagle_vllm.datasets import COMPLETION_ROLE, PROMPT_ROLE
    from eagle_vllm.train.regenerate import regenerate_answers

    target = _chat_target(tmp_path)
    prompts = ["w1 w2 w3", "w17 w5", "w40 w41 w42 w43"]
    got = regenerate_answers(
        target,
        [[{"role": PROMPT_ROLE, "content": p}] for p in prompts],
        max_tokens=24,
        dtype="float32",
        max_model_len=512,
    )
    llm = vllm.LLM(str(target), **ENGINE_KW)
    eos = llm.get_tokenizer().eos_token
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    shutdown(llm)
    want = [
        o.outputs[0].text
        + (eos if o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason is None else "")
        for o in outputs
    ]
    assert [c[0]["content"] for c in got] == prompts
    assert [c[1] for c in got] == [{"role": COMPLETION_ROLE, "content": w} for w in want]


def test_every_turn_regenerated_with_the_targets_dialogue_as_context(tmp_path):
    """--regenerate-turns all: turn k is answered with the user turns before it and the
    target's own earlier answers as context (the dataset's answers are never seen); a
    rerun resumes from the progress file without recomputing finished conversations."""
    import vllm
    from vllm import SamplingParams

    from eagle_vllm.train.regenerate import regenerate_conversations

    target = _chat_target(tmp_path)
    conversations = [
        [
            {"role": "user", "content": "w1 w2 w3"},
            {"role": "assistant", "content": "w9 w9"},
            {"role": "user", "content": "w4"},
            {"role": "assistant", "content": "w8"},
            {"role": "user", "content": "w40 w41"},
        ],
        [{"role": "user", "content": "w17 w5"}, {"role": "assistant", "content": "w3"}],
    ]
    parts = tmp_path / "dialogues"
    kw = dict(max_tokens=6, dtype="float32", max_model_len=512, parts_dir=parts, chunk=1)
    got = regenerate_conversations(target, conversations, **kw)

    llm = vllm.LLM(str(target), **ENGINE_KW)
    params = SamplingParams(max_tokens=6, temperature=0)
    dialogue: list[dict] = []
    for user in [m for m in conversations[0] if m["role"] == "user"]:
        dialogue.append(user)
        answer = llm.chat([dialogue], params, use_tqdm=False)[0].outputs[0].text
        dialogue.append({"role": "assistant", "content": answer})
    single = llm.chat([conversations[1][:1]], params, use_tqdm=False)[0].outputs[0].text
    shutdown(llm)
    assert got[0] == dialogue and len(got[0]) == 6
    assert got[1] == [conversations[1][0], {"role": "assistant", "content": single}]
    assert "w9 w9" not in json.dumps(got)  # the dataset's own answers are never used
    written = sorted(p.name for p in parts.iterdir())
    assert written == ["part-0000000.jsonl.gz", "part-0000001.jsonl.gz"]
    # resuming: a rerun answers only what no part holds, and rewrites no finished part
    (parts / written[1]).unlink()  # as if stopped before the second chunk
    # parts only: what the finished parts hold, nothing answered
    assert regenerate_conversations(target, conversations, parts_only=True, **kw) == got[:1]
    with pytest.raises(ValueError, match="hold none of the 2 conversations.*Fix"):
        regenerate_conversations(target, conversations, parts_only=True,
                                 **{**kw, "parts_dir": tmp_path / "empty"})  # fmt: skip
    assert sorted(p.name for p in parts.iterdir()) == written[:1]
    again = regenerate_conversations(target, conversations, **kw)
    assert again == got and sorted(p.name for p in parts.iterdir()) == written
