"""The drafter's first pass writes the draft KV of every verified or prompt row but reads
its output at one row per request: the last draft layer's output projection and MLP run
on those rows only, and nowhere when the step drafts nothing. In decode steps it runs
with the platform's in-place attention instead of vLLM's input and metadata
preparation. Nothing the drafter reads may change (real vLLM, CPU, fp32)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import ENGINE_KW, shutdown
from test_eagle_chain import PROMPTS, greedy, token_ids

pytestmark = pytest.mark.vllm


def _run(tiny, monkeypatch, trimmed: bool, in_place: bool = True, direct: bool = True,
         draft: str = "draft_noisy") -> dict:  # fmt: skip
    """``in_place=False``: the drafter's attention as on a platform without an in-place
    one (vLLM's first pass, prefixes gathered for the tree passes). ``direct=False``: the
    draft's layers through vLLM's modules (``models/direct_layer.py`` off)."""
    from eagle_vllm import LLM
    from eagle_vllm.engine import proposer
    from eagle_vllm.models import direct_layer, eagle_llama

    roots, trees, row_counts, own_passes, direct_calls = [], [], [], [], []
    tree_positions = []  # (the tree's root positions, a tree pass's positions, its rows)
    in_tree = [None]
    draft_tree = proposer.EagleTreeProposer.draft_tree

    def recording_draft_tree(self, **kw):
        roots.append((kw["root_hidden"].clone(), kw["root_last_hidden"].clone()))
        in_tree[0] = kw["root_positions"].clone()
        try:
            out = draft_tree(self, **kw)
        finally:
            in_tree[0] = None
        trees.append(out[0].tokens.clone())
        return out

    at_rows = proposer._AtRows.forward

    def counting_forward(self, x):
        row_counts.append((x.shape[0], self.rows.numel()))
        return at_rows(self, x)

    own_pass = proposer.EagleTreeProposer._first_pass_own_attention

    def counting_own_pass(self, *args):
        out = own_pass(self, *args)
        own_passes.append(out is not None)
        return out

    direct_call = direct_layer.DirectLlamaLayer.__call__

    def counting_direct_call(self, positions, x, residual, out_rows=None):
        direct_calls.append(x.shape[0] if out_rows is None else len(out_rows))
        if in_tree[0] is not None:
            tree_positions.append((in_tree[0], positions.clone(), x.shape[0]))
        return direct_call(self, positions, x, residual, out_rows)

    monkeypatch.setattr(direct_layer.DirectLlamaLayer, "__call__", counting_direct_call)
    if not direct:
        monkeypatch.setattr(
            eagle_llama.EagleVllmLlamaForCausalLM, "direct_layers", lambda self: None
        )
    monkeypatch.setattr(proposer.EagleTreeProposer, "draft_tree", recording_draft_tree)
    monkeypatch.setattr(proposer._AtRows, "forward", counting_forward)
    monkeypatch.setattr(proposer.EagleTreeProposer, "_first_pass_own_attention", counting_own_pass)
    if not in_place:
        monkeypatch.setattr(
            proposer.EagleTreeProposer, "_in_place_attention", lambda self, layers: None
        )
    if not trimmed:
        monkeypatch.setattr(
            proposer.EagleTreeProposer,
            "_last_layer_outputs_only_at",
            lambda self, rows: contextlib.nullcontext(),
        )
    # the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    spec = {"method": "eagle2", "model": str(tiny[draft]), "num_speculative_tokens": 3,
            "topk": 3, "total_tokens": 8}  # fmt: skip
    llm = LLM(str(tiny["target"]), speculative_config=spec, **ENGINE_KW)
    built_at_load = llm.collective_rpc(_direct_layers_built)[0]
    out = token_ids(llm.generate(PROMPTS, greedy(max_tokens=32)))
    shutdown(llm)
    monkeypatch.undo()
    return {"tokens": out, "roots": roots, "trees": trees, "row_counts": row_counts,
            "own_passes": own_passes, "direct_calls": direct_calls,
            "tree_positions": tree_positions, "built_at_load": built_at_load}  # fmt: skip


def _direct_layers_built(worker) -> bool:
    """Run on the worker: whether the draft's direct layers exist (before any step)."""
    return bool(worker.model_runner.drafter.model._direct)


def test_first_pass_outputs_only_where_read(tiny, monkeypatch):
    """Through vLLM's modules (the direct layers take the rows themselves: compared with
    these in ``test_direct_layers_match_vllms_modules``)."""
    full = _run(tiny, monkeypatch, trimmed=False, direct=False)
    trimmed = _run(tiny, monkeypatch, trimmed=True, direct=False)
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


def test_in_place_attention_matches_vllms_and_gathered(tiny, monkeypatch):
    """The drafter's attention over the paged cache read in place (the first pass of
    decode steps, the tree passes) writes the same draft KV and drafts the same trees
    as vLLM's first pass and gathered prefixes: every later root and tree reads the KV
    earlier passes wrote."""
    theirs = _run(tiny, monkeypatch, trimmed=True, in_place=False)
    ours = _run(tiny, monkeypatch, trimmed=True, in_place=True)
    assert ours["tokens"] == theirs["tokens"]
    # decode steps took the in-place first pass; prompt steps (runs over 64 rows) vLLM's
    assert sum(ours["own_passes"]) > 10 and not all(ours["own_passes"])
    assert not any(theirs["own_passes"])
    assert len(ours["roots"]) == len(theirs["roots"]) > 10
    for (hidden_a, last_a), (hidden_b, last_b) in zip(ours["roots"], theirs["roots"]):
        torch.testing.assert_close(hidden_a, hidden_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last_a, last_b, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(ours["trees"], theirs["trees"]))


def test_direct_layers_match_vllms_modules(tiny, monkeypatch):
    """The draft's layers called directly (``models/direct_layer.py``: the same kernels
    without vLLM's module machinery, the first pass's output projection and MLP at the
    sampled rows only) draft bit for bit what vLLM's modules draft. The random draft: the
    oracle drafts' MLP is zero."""
    modules = _run(tiny, monkeypatch, trimmed=True, direct=False, draft="draft_random")
    direct = _run(tiny, monkeypatch, trimmed=True, direct=True, draft="draft_random")
    assert modules["direct_calls"] == []
    # built when the drafter loaded, not at a first call inside a step (where the first
    # pass has swapped the last layer's projection and MLP for row-trimming stand-ins)
    assert direct["built_at_load"]
    # decode steps' first passes (one output row per request) and tree passes ran direct
    assert sum(n <= len(PROMPTS) for n in direct["direct_calls"]) > 10
    assert direct["tokens"] == modules["tokens"]
    assert len(direct["roots"]) == len(modules["roots"]) > 10
    for (hidden_a, last_a), (hidden_b, last_b) in zip(direct["roots"], modules["roots"]):
        assert torch.equal(hidden_a, hidden_b) and torch.equal(last_a, last_b)
    assert all(torch.equal(a, b) for a, b in zip(direct["trees"], modules["trees"]))


def test_tree_passes_give_every_row_its_position(tiny, monkeypatch):
    """A tree pass feeds ``topk`` frontier nodes per request through the draft's layers:
    each row needs its own position (root + depth) for the rotary embedding, passed as
    a dense array. vLLM's CPU rotary kernel rotates as many rows as it is given
    positions and leaves the rest unrotated; given a broadcast view, it reads past it."""
    run = _run(tiny, monkeypatch, trimmed=True, direct=True)
    passes = run["tree_positions"]
    assert len(passes) > 10
    for root_positions, positions, rows in passes:
        assert positions.is_contiguous() and positions.numel() == rows
        depth = positions.view(len(root_positions), -1) - root_positions[:, None]
        assert rows > len(root_positions) and bool((depth == depth[0, 0]).all())
        assert int(depth[0, 0]) >= 1
