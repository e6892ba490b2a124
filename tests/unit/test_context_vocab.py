"""Per-request context tokens beside a reduced draft vocabulary (drafting/context_vocab.py)."""

from __future__ import annotations

import torch

from eagle_vllm.drafting.context_vocab import ContextVocabulary


def test_columns_are_every_tracked_requests_tokens_and_allowed_is_each_requests_own():
    vocab = ContextVocabulary(20, base_ids=torch.tensor([0, 1, 2, 3]))
    vocab.sync("a", [1, 7, 5], [])
    vocab.sync("b", [2, 7, 9], [11])
    extra, allowed, first_new = vocab.columns(["a", "b"])
    # base tokens 1, 2 are not columns; a column per token, in the order first seen
    assert extra.tolist() == [5, 7, 9, 11] and first_new == 0
    assert allowed.tolist() == [[True, True, False, False], [False, True, True, True]]
    # a request never synced has seen nothing; the columns stay every tracked request's
    extra, allowed, first_new = vocab.columns(["new", "a"])
    assert extra.tolist() == [5, 7, 9, 11] and first_new == 4
    assert allowed.tolist() == [[False] * 4, [True, True, False, False]]
    # a token already a column (b's 9) joins a's row without a new column
    vocab.sync("a", [], [9, 13])
    extra, allowed, first_new = vocab.columns(["a"])
    assert extra.tolist() == [5, 7, 9, 11, 13] and first_new == 4
    assert allowed.tolist() == [[True, True, True, False, True]]
    # the same batch asked again after a sync sees the sync
    vocab.columns(["a", "b"])
    vocab.sync("b", [], [11, 5])
    assert vocab.columns(["a", "b"])[1][1].tolist() == [True, True, True, True, False]
    empty = ContextVocabulary(20, base_ids=torch.tensor([0]))
    extra, allowed, _ = empty.columns(["new"])
    assert extra.numel() == 0 and allowed.shape == (1, 0)


def test_sync_reads_only_new_output_tokens_and_skips_placeholders():
    vocab = ContextVocabulary(20, base_ids=torch.tensor([0]))
    output = [4]
    vocab.sync("a", [3], output)
    output += [-1, 6]  # vLLM's placeholders for tokens not known yet
    vocab.sync("a", [3], output)
    assert vocab.columns(["a"])[0].tolist() == [3, 4]
    # vLLM deletes the placeholders and appends the real tokens: read from there
    del output[1:]
    output += [12, 6]
    vocab.sync("a", [3], output)
    assert vocab.columns(["a"])[0].tolist() == [3, 4, 12, 6]
    # the prompt is read once: a later call's prompt argument adds nothing
    vocab.sync("a", [3, 8], output)
    assert vocab.columns(["a"])[0].tolist() == [3, 4, 12, 6]
    # ids outside the vocabulary are not columns
    vocab.sync("a", [3], output + [25])
    assert vocab.columns(["a"])[0].tolist() == [3, 4, 12, 6]


def test_forget_drops_a_request_whose_id_may_return():
    vocab = ContextVocabulary(10, base_ids=torch.tensor([0]))
    vocab.sync("a", [5], [])
    vocab.forget(["a", "never-seen"])
    assert len(vocab) == 0 and vocab.num_dead_columns == 1
    vocab.sync("a", [6], [])  # a new request under the old id: its own prompt only
    extra, allowed, _ = vocab.columns(["a"])
    assert extra.tolist() == [5, 6] and allowed.tolist() == [[False, True]]
    vocab.sync("b", [5], [])  # the dead column comes back to life
    assert vocab.num_dead_columns == 0


def test_the_table_is_rebuilt_once_dead_columns_outnumber_live_ones(monkeypatch):
    import eagle_vllm.drafting.context_vocab as module

    monkeypatch.setattr(module, "MIN_DEAD_COLUMNS", 2)
    vocab = ContextVocabulary(50, base_ids=torch.tensor([0]))
    vocab.sync("a", [10, 11, 12], [])
    vocab.sync("b", [20, 21], [])
    vocab.columns(["a", "b"])
    vocab.forget(["a"])  # 3 dead against 2 live
    extra, allowed, first_new = vocab.columns(["b"])
    assert extra.tolist() == [20, 21] and first_new == 0 and vocab.num_dead_columns == 0
    assert allowed.tolist() == [[True, True]]


def test_columns_stay_each_requests_tokens_over_random_traffic(monkeypatch):
    """Against a plain model of the sets over random syncs, forgets and batches: each
    request's allowed columns are exactly its tokens outside the base, every tracked
    request's token is a column once, columns before ``first_new`` never change, and
    dead columns stay bounded."""
    import random

    import eagle_vllm.drafting.context_vocab as module

    monkeypatch.setattr(module, "MIN_DEAD_COLUMNS", 8)
    rng = random.Random(0)
    vocab_size, base = 60, set(range(0, 60, 3))
    vocab = ContextVocabulary(vocab_size, base_ids=torch.tensor(sorted(base)))
    prompts, outputs, model = {}, {}, {}
    previous: list[int] = []
    rebuilds = 0
    for step in range(400):
        live = list(prompts)
        if live and rng.random() < 0.08:
            gone = rng.sample(live, rng.randint(1, len(live)))
            vocab.forget(gone)
            for r in gone:
                del prompts[r], outputs[r]
                model.pop(r, None)
        if rng.random() < 0.3 or not prompts:
            r = f"r{step}"
            prompts[r] = [rng.randrange(-1, vocab_size + 3) for _ in range(rng.randint(0, 6))]
            outputs[r] = []
        batch = rng.sample(list(prompts), rng.randint(1, len(prompts)))
        for r in batch:
            outputs[r] += [rng.randrange(vocab_size + 2) for _ in range(rng.randint(0, 2))]
            vocab.sync(r, prompts[r], outputs[r])
            model[r] = {t for t in prompts[r] + outputs[r] if 0 <= t < vocab_size} - base
        asked = batch + ["never-synced"]
        extra, allowed, first_new = vocab.columns(asked)
        ids = extra.tolist()
        assert len(set(ids)) == len(ids) and not set(ids) & base
        assert set().union(*model.values()) <= set(ids)
        for row, r in enumerate(asked):
            assert {t for t, a in zip(ids, allowed[row].tolist()) if a} == model.get(r, set())
        if first_new == 0:
            rebuilds += 1
        else:
            assert ids[:first_new] == previous
        assert first_new == 0 or first_new == len(previous)
        assert vocab.num_dead_columns <= max(8, len(ids) - vocab.num_dead_columns)
        previous = ids
    assert rebuilds > 1  # the traffic did rebuild the table


def test_the_drafters_rows_follow_the_columns_gathering_only_new_ones():
    """``_step_context_columns`` keeps the LM-head rows of the table's columns, gathering
    the new columns' rows only, and all of them again after a rebuild."""
    from types import SimpleNamespace

    from eagle_vllm.engine.proposer import EagleTreeProposer

    weight = torch.randn(40, 3)
    asked: list[list[int]] = []

    def lm_head_rows(ids):
        asked.append(ids.tolist())
        return weight[ids]

    vocab = ContextVocabulary(40, base_ids=torch.tensor([0]))
    drafter = SimpleNamespace(
        context_vocab=vocab, _context_rows=None, model=SimpleNamespace(lm_head_rows=lm_head_rows)
    )
    step = EagleTreeProposer._step_context_columns
    vocab.sync("a", [5, 6], [])
    extra, rows, allowed = step(drafter, ["a"])
    assert asked == [[5, 6]] and torch.equal(rows, weight[extra])
    assert step(drafter, ["a"]) is not None and asked == [[5, 6]]  # nothing new: no gather
    vocab.sync("b", list(range(7, 300 % 40 + 7)), [])
    vocab.sync("a", [], [9, 39])
    extra, rows, allowed = step(drafter, ["a", "b"])
    assert asked[-1] == extra.tolist()[2:] and torch.equal(rows, weight[extra])
    assert allowed.tolist()[0] == [t in (5, 6, 9, 39) for t in extra.tolist()]
    vocab._rebuild_columns()
    extra, rows, _ = step(drafter, ["a"])
    assert asked[-1] == extra.tolist() and torch.equal(rows, weight[extra])


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
