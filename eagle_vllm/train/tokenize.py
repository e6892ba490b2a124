"""Conversations -> token ids with an assistant-only loss mask, via the chat template;
raw completions (a prompt and the target's completion) -> ids masked to the completion."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenizedConversation:
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool, True on tokens the assistant wrote


def tokenize_conversation(
    tokenizer, messages: list[dict], max_len: int
) -> TokenizedConversation | None:
    """Render ``messages`` with the tokenizer's chat template and mark assistant tokens.

    The assistant span of turn i is the text between the template rendered up to
    turn i with a generation prompt and the template rendered through turn i
    (its end-of-turn token included, so the head learns to draft it). Returns
    None if the template is not prefix-stable or no assistant token survives
    truncation to ``max_len``.

    A raw completion (``datasets.PROMPT_ROLE`` then ``COMPLETION_ROLE``) is the two texts
    joined without a template, as vLLM tokenizes a raw prompt (no special tokens added);
    its mask marks the tokens that start inside the completion.
    """
    from eagle_vllm.datasets import COMPLETION_ROLE, PROMPT_ROLE

    if messages and messages[0]["role"] == PROMPT_ROLE:
        if len(messages) != 2 or messages[1]["role"] != COMPLETION_ROLE:
            return None
        prompt = messages[0]["content"]
        return _masked(tokenizer, prompt + messages[1]["content"], [(len(prompt), None)], max_len)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(
            messages[:i], tokenize=False, add_generation_prompt=True
        )
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(before) and full.startswith(through)):
            return None
        spans.append((len(before), len(through)))
    return _masked(tokenizer, full, spans, max_len)


def _masked(
    tokenizer, text: str, spans: list[tuple[int, int | None]], max_len: int
) -> TokenizedConversation | None:
    """``text``'s first ``max_len`` ids, the loss on tokens starting in a [lo, hi) span
    (hi None: to the end)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    ids = torch.tensor(enc["input_ids"][:max_len], dtype=torch.int64)
    starts = torch.tensor([s for s, _ in enc["offset_mapping"][:max_len]], dtype=torch.int64)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < (len(text) if hi is None else hi))
    if not bool(mask.any()):
        return None
    return TokenizedConversation(ids, mask)
