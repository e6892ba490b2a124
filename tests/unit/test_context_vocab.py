"""Per-request context tokens beside a reduced draft vocabulary (drafting/context_vocab.py)."""

from __future__ import annotations

import torch

from eagle_vllm.drafting.context_vocab import ContextVocabulary


def test_columns_are_the_batch_union_outside_the_base_and_each_requests_own():
    vocab = ContextVocabulary(20, base_ids=torch.tensor([0, 1, 2, 3]))
    vocab.sync("a", [1, 5, 7], [])
    vocab.sync("b", [2, 7, 9], [11])
    extra, allowed = vocab.columns(["a", "b"])
    assert extra.tolist() == [5, 7, 9, 11]  # base tokens 1, 2 are not repeated
    assert allowed.tolist() == [[True, True, False, False], [False, True, True, True]]
    # a request never synced has seen nothing; its row allows no extra column
    extra, allowed = vocab.columns(["new", "a"])
    assert extra.tolist() == [5, 7] and allowed.tolist() == [[False, False], [True, True]]
    extra, allowed = vocab.columns(["new"])
    assert extra.numel() == 0 and allowed.shape == (1, 0)


def test_sync_reads_only_new_output_tokens_and_skips_placeholders():
    vocab = ContextVocabulary(20, base_ids=torch.tensor([0]))
    output = [4]
    vocab.sync("a", [3], output)
    output += [-1, 6]  # vLLM's placeholders for tokens not known yet
    vocab.sync("a", [3], output)
    assert vocab.columns(["a"])[0].tolist() == [3, 4, 6]
    # the prompt is read once: a later call's prompt argument adds nothing
    vocab.sync("a", [3, 8], output)
    assert vocab.columns(["a"])[0].tolist() == [3, 4, 6]
    # an output list that shrank is read on from its new end
    del output[1:]
    output += [12]
    vocab.sync("a", [3], output)
    assert vocab.columns(["a"])[0].tolist() == [3, 4, 6, 12]
    # ids outside the vocabulary are not columns
    vocab.sync("a", [3], output + [25])
    assert vocab.columns(["a"])[0].tolist() == [3, 4, 6, 12]


def test_forget_drops_a_request_whose_id_may_return():
    vocab = ContextVocabulary(10, base_ids=torch.tensor([0]))
    vocab.sync("a", [5], [])
    vocab.forget(["a", "never-seen"])
    assert len(vocab) == 0
    vocab.sync("a", [6], [])  # a new request under the old id: its own prompt only
    assert vocab.columns(["a"])[0].tolist() == [6]


def test_draft_logprobs_add_the_context_columns_each_request_has_seen():
    """The drafter's distribution per row: the reduced vocabulary's columns, then the
    step's context columns, masked to -inf for requests that have not seen the token,
    normalised over both; the token ids follow the columns."""
    from types import SimpleNamespace

    from eagle_vllm.engine.proposer import EagleTreeProposer

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2 * 3, 4, generator=gen)  # 2 requests, 3 rows each
    base_rows, base_ids = torch.randn(5, 4, generator=gen), torch.tensor([0, 1, 2, 3, 4])
    extra_rows, extra_ids = torch.randn(2, 4, generator=gen), torch.tensor([9, 7])
    model = SimpleNamespace(draft_logits=lambda h: (h @ base_rows.T, base_ids))
    allowed = torch.tensor([[True, False], [True, True]])
    drafter = SimpleNamespace(model=model, _context_columns=(extra_ids, extra_rows, allowed))
    logprobs, ids = EagleTreeProposer._draft_logprobs(drafter, hidden, 3)
    assert ids.tolist() == [0, 1, 2, 3, 4, 9, 7] and logprobs.shape == (2, 3, 7)
    full = hidden @ torch.cat([base_rows, extra_rows]).T
    full[:3, 6] = float("-inf")  # request 0 has not seen token 7
    torch.testing.assert_close(logprobs.reshape(6, 7), torch.log_softmax(full, dim=-1))
    drafter._context_columns = None  # none this step: the reduced vocabulary alone
    logprobs, ids = EagleTreeProposer._draft_logprobs(drafter, hidden, 3)
    assert ids.tolist() == base_ids.tolist()
    expected = torch.log_softmax(hidden @ base_rows.T, dim=-1)
    torch.testing.assert_close(logprobs.reshape(6, 5), expected)
