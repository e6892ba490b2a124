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
