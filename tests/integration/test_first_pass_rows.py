"""The drafter's first pass writes the draft KV of every verified or prompt row but reads
its output at one row per request: the last draft layer's output projection and MLP run
on those rows only, and nowhere when the step drafts nothing. Nothing the drafter reads
may change (real vLLM, CPU, fp32)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import ENGINE_KW, shutdown
from test_eagle_chain import PROMPTS, greedy, token_ids

pytestmark = pytest.mark.vllm


def _run(tiny, monkeypatch, trimmed: bool) -> dict:
    from eagle_vllm import LLM
    from eagle_vllm.engine import proposer

    roots, row_counts = [], []
    draft_tree = proposer.EagleTreeProposer.draft_tree

    def recording_draft_tree(self, **kw):
        roots.append((kw["root_hidden"].clone(), kw["root_last_hidden"].clone()))
        return draft_tree(self, **kw)

    at_rows = proposer._AtRows.forward

    def counting_forward(self, x):
        row_counts.append((x.shape[0], self.rows.numel()))
        return at_rows(self, x)

    monkeypatch.setattr(proposer.EagleTreeProposer, "draft_tree", recording_draft_tree)
    monkeypatch.setattr(proposer._AtRows, "forward", counting_forward)
    if not trimmed:
        monkeypatch.setattr(
            proposer.EagleTreeProposer,
            "_last_layer_outputs_only_at",
            lambda self, rows: contextlib.nullcontext(),
        )
    # the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    spec = {"method": "eagle2", "model": str(tiny["draft_noisy"]), "num_speculative_tokens": 3,
            "topk": 3, "total_tokens": 8}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, **ENGINE_KW)
    out = token_ids(llm.generate(PROMPTS, greedy(max_tokens=32)))
    shutdown(llm)
    monkeypatch.undo()
    return {"tokens": out, "roots": roots, "row_counts": row_counts}


def test_first_pass_outputs_only_where_read(tiny, monkeypatch):
    full = _run(tiny, monkeypatch, trimmed=False)
    trimmed = _run(tiny, monkeypatch, trimmed=True)
    assert trimmed["tokens"] == full["tokens"]
    # the trimmed passes computed far fewer rows: prompts (up to 131 rows) and trees
    assert full["row_counts"] == []
    assert any(n > 100 and k <= len(PROMPTS) for n, k in trimmed["row_counts"])
    assert all(k < n for n, k in trimmed["row_counts"] if n > len(PROMPTS))
    # every root the drafter expanded from is the same (the same drafts, the same steps)
    assert len(trimmed["roots"]) == len(full["roots"]) > 10
    for (hidden_a, last_a), (hidden_b, last_b) in zip(trimmed["roots"], full["roots"]):
        torch.testing.assert_close(hidden_a, hidden_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last_a, last_b, atol=1e-5, rtol=1e-5)
