"""Optional: replace the dataset's answers by the target's own answers, through vLLM.

A head learns the distribution it is trained on. ShareGPT answers were written
by another model; regenerating them with the target makes the training text the
text the head will have to predict at inference (SafeAILab does the same for
its released heads). Only the first user turn is kept and answered.
"""

from __future__ import annotations

import json
from pathlib import Path


def regenerate_answers(
    target: str | Path,
    conversations: list[list[dict]],
    *,
    max_tokens: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    progress_file: Path | None = None,
    chunk: int = 128,
) -> list[list[dict]]:
    """The kept conversations, each [first user turn, the target's answer].

    With ``progress_file``, answers are appended there ``chunk`` prompts at a time
    (one JSON line per prompt: its index and answer), and a rerun starts after the
    last chunk written, so a regeneration of hours can be stopped and resumed.
    """
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target), dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=seed
    )
    try:
        tokenizer = llm.get_tokenizer()
        firsts, kept = [], []
        for conv in conversations:
            # text first: transformers 5 returns a BatchEncoding (not ids) when tokenizing
            text = tokenizer.apply_chat_template(
                conv[:1], tokenize=False, add_generation_prompt=True
            )
            prompt_len = len(tokenizer(text, add_special_tokens=False).input_ids)
            if prompt_len + 8 < max_model_len:
                firsts.append(conv[:1])
                kept.append(conv)
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed if temperature else None
        )
        answers = _answers_done(progress_file)
        for start in range(len(answers), len(firsts), chunk):
            # greedy answers do not depend on the batch, so chunking changes no answer
            outputs = llm.chat(firsts[start : start + chunk], params, use_tqdm=True)
            texts = [out.outputs[0].text for out in outputs]
            answers.extend(texts)
            if progress_file is not None:
                with open(progress_file, "a") as f:
                    f.writelines(
                        json.dumps({"index": start + i, "answer": t}) + "\n"
                        for i, t in enumerate(texts)
                    )
        return [
            [conv[0], {"role": "assistant", "content": answer}]
            for conv, answer in zip(kept, answers)
            if answer.strip()
        ]
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass


def _answers_done(progress_file: Path | None) -> list[str]:
    """Answers already written, in prompt order; a torn last line is dropped."""
    if progress_file is None or not progress_file.exists():
        return []
    answers, good_bytes = [], 0
    for line in progress_file.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # stopped mid-write: cut the torn line, so that appending continues cleanly
            with open(progress_file, "r+") as f:
                f.truncate(good_bytes)
            break
        if row["index"] != len(answers):
            raise ValueError(
                f"{progress_file}: line for prompt {row['index']} where {len(answers)} was "
                "expected. Fix: delete the file to regenerate from the start."
            )
        answers.append(row["answer"])
        good_bytes += len(line.encode())
    return answers
