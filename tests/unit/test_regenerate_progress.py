"""Resuming a regeneration: which answers a progress file already holds."""

from __future__ import annotations

import json

import pytest

from eagle_vllm.train.regenerate import _answers_done


def _line(index: int, answer: str) -> str:
    return json.dumps({"index": index, "answer": answer}) + "\n"


def test_no_file_means_nothing_done(tmp_path):
    assert _answers_done(None) == []
    assert _answers_done(tmp_path / "missing.jsonl") == []


def test_a_torn_last_line_is_cut_so_appending_continues_cleanly(tmp_path):
    progress = tmp_path / "p.jsonl"
    progress.write_text(_line(0, "a") + _line(1, "b\nc") + '{"index": 2, "ans')
    assert _answers_done(progress) == ["a", "b\nc"]
    with open(progress, "a") as f:
        f.write(_line(2, "d"))
    assert _answers_done(progress) == ["a", "b\nc", "d"]


def test_a_gap_in_the_indices_is_refused_with_the_fix(tmp_path):
    progress = tmp_path / "p.jsonl"
    progress.write_text(_line(0, "a") + _line(2, "c"))
    with pytest.raises(ValueError, match="delete the file"):
        _answers_done(progress)


@pytest.mark.parametrize("data, skip", [("sharegpt", 60), ("file", 30)])
def test_a_selection_that_skips_reads_the_parts_where_a_selection_from_the_start_wrote(
    tmp_path, data, skip
):
    """Parts are indexed from the beginning of the data. A selection made with
    --skip-conversations (ShareGPT records, or rows of a file) reads the dialogues a
    selection from the start wrote for the same conversations, not the first ones again,
    also where unusable records and eval prompts were dropped before it."""
    from argparse import Namespace

    from eagle_vllm.datasets import mtbench_prompts
    from eagle_vllm.train.main import _conversations, _skipped_count
    from eagle_vllm.train.regenerate import _write_part, regenerate_conversations

    if data == "file":
        rows = [[{"role": "user", "content": f"question {i}"}] for i in range(60)]
        for i in (3, 11, 40):  # eval prompts, dropped from training data
            rows[i] = [{"role": "user", "content": mtbench_prompts()[i]}]
        data = tmp_path / "prompts.jsonl"
        data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    parts = tmp_path / "parts"
    parts.mkdir()
    whole = _conversations(Namespace(data=str(data), skip_conversations=0,
                                     num_conversations=skip + 20))  # fmt: skip
    later_args = Namespace(data=str(data), skip_conversations=skip, num_conversations=20)
    later, first = _conversations(later_args), _skipped_count(later_args)
    assert 0 < first < skip and later
    assert whole[first : first + len(later)] == later
    answered = [
        c[:1] + [{"role": "assistant", "content": f"answer {i}"}] for i, c in enumerate(whole)
    ]
    _write_part(parts, list(enumerate(answered)))
    got = regenerate_conversations(
        "no-target", later, parts_dir=parts, parts_only=True, first_index=first
    )
    assert got == answered[first : first + len(later)]
