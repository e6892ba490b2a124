"""Optional: replace the dataset's answers by the target's own answers, through vLLM.

A head learns the distribution it is trained on. ShareGPT answers were written
by another model; regenerating them with the target makes the training text the
text the head will have to predict at inference (SafeAILab does the same for
its released heads).

* ``regenerate_answers``: the first user turn of each conversation, answered.
* ``regenerate_conversations``: every user turn in order, each answered with the
  earlier turns (the dataset's user turns and the target's own answers) as context,
  so the head also learns later turns, whose context is a dialogue of the target's.
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


def regenerate_conversations(
    target: str | Path,
    conversations: list[list[dict]],
    *,
    max_tokens: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    dtype: str = "float32",
    max_model_len: int = 2048,
    max_turns: int = 8,
    parts_dir: Path,
    chunk: int = 256,
) -> list[list[dict]]:
    """Each conversation's user turns (up to ``max_turns``) answered one turn at a time by
    the target, the dialogue so far as context; a turn whose context leaves no room for
    ``max_tokens`` within ``max_model_len`` ends its conversation there.

    Resumable and add-only: each finished chunk of ``chunk`` conversations is written to
    ``parts_dir`` as one gzipped JSON-lines file (``part-<first index>.jsonl.gz``, one
    line per conversation: its index and messages; written whole, then renamed), and a
    rerun answers only conversations no part holds. Parts can be committed as they come.
    Greedy answers do not depend on the batch, so a resumed run writes what an
    uninterrupted one would have."""
    from vllm import LLM, SamplingParams

    parts_dir = Path(parts_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    done = read_parts(parts_dir)
    todo = [i for i in range(len(conversations)) if i not in done]
    if todo:
        llm = LLM(model=str(target), dtype=dtype, enforce_eager=True,
                  max_model_len=max_model_len, seed=seed)  # fmt: skip
        try:
            tokenizer = llm.get_tokenizer()
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                    seed=seed if temperature else None)  # fmt: skip
            for start in range(0, len(todo), chunk):
                ids = todo[start : start + chunk]
                dialogues = _answer_turns(
                    llm, tokenizer, params, [conversations[i] for i in ids],
                    max_turns, max_model_len - max_tokens,
                )  # fmt: skip
                _write_part(parts_dir, ids, dialogues)
                done.update(zip(ids, dialogues))
        finally:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
    return [done[i] for i in range(len(conversations)) if done.get(i)]


def _answer_turns(llm, tokenizer, params, conversations, max_turns: int, max_prompt: int):
    users = [[m for m in conv if m["role"] == "user"][:max_turns] for conv in conversations]
    dialogues: list[list[dict]] = [[] for _ in conversations]
    open_rows = set(range(len(conversations)))
    for turn in range(max_turns):
        rows, prompts = [], []
        for r in sorted(open_rows):
            if turn >= len(users[r]):
                open_rows.discard(r)
                continue
            messages = dialogues[r] + [users[r][turn]]
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
            if len(tokenizer(text, add_special_tokens=False).input_ids) > max_prompt:
                open_rows.discard(r)  # the dialogue no longer fits: it ends here
                continue
            rows.append(r)
            prompts.append(messages)
        if not rows:
            break
        outputs = llm.chat(prompts, params, use_tqdm=True)
        for r, messages, out in zip(rows, prompts, outputs):
            answer = out.outputs[0].text
            if not answer.strip():
                open_rows.discard(r)
                continue
            dialogues[r] = messages + [{"role": "assistant", "content": answer}]
    return dialogues


def _write_part(parts_dir: Path, ids: list[int], dialogues: list[list[dict]]) -> None:
    import gzip

    final = parts_dir / f"part-{ids[0]:07d}.jsonl.gz"
    tmp = final.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        f.writelines(json.dumps({"index": i, "messages": d}) + "\n" for i, d in zip(ids, dialogues))
    tmp.rename(final)


def read_parts(parts_dir: Path) -> dict[int, list[dict]]:
    """Conversations the parts in ``parts_dir`` hold, by index (unfinished ``.tmp`` files
    are ignored: their chunk is answered again)."""
    import gzip

    done: dict[int, list[dict]] = {}
    for part in sorted(Path(parts_dir).glob("part-*.jsonl.gz")):
        with gzip.open(part, "rt") as f:
            for line in f:
                row = json.loads(line)
                done[row["index"]] = row["messages"]
    return done
