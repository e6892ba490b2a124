"""Optional: replace the dataset's answers by the target's own answers, through vLLM.

A head learns the distribution it is trained on. ShareGPT answers were written
by another model; regenerating them with the target makes the training text the
text the head will have to predict at inference (SafeAILab does the same for
its released heads).

* ``regenerate_answers``: the first user turn of each conversation, answered; or each
  raw prompt (``datasets.PROMPT_ROLE``, e.g. a code stub) completed without a chat
  template, as the target completes HumanEval's stubs.
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
    """The kept conversations, each [first user turn, the target's answer], or, for raw
    prompts, [prompt, the target's completion].

    With ``progress_file``, answers are appended there ``chunk`` prompts at a time
    (one JSON line per prompt: its index and answer), and a rerun starts after the
    last chunk written, so a regeneration of hours can be stopped and resumed.
    """
    from transformers import AutoTokenizer

    from eagle_vllm.datasets import COMPLETION_ROLE, PROMPT_ROLE

    raw = [conv[0]["role"] == PROMPT_ROLE for conv in conversations]
    if any(raw) and not all(raw):
        raise ValueError(
            "conversations mix raw prompts and chats. Fix: regenerate each kind in its own run."
        )
    raw_prompts = bool(raw) and all(raw)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    firsts, kept = [], []
    for conv in conversations:
        if raw_prompts:
            text = conv[0]["content"]
        else:
            # text first: transformers 5 returns a BatchEncoding (not ids) when tokenizing
            text = tokenizer.apply_chat_template(
                conv[:1], tokenize=False, add_generation_prompt=True
            )
        prompt_len = len(tokenizer(text, add_special_tokens=False).input_ids)
        if prompt_len + 8 < max_model_len:
            firsts.append(text if raw_prompts else conv[:1])
            kept.append(conv)
    answers = _answers_done(progress_file)
    if len(answers) < len(firsts):  # vLLM only starts when something is left to answer
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(target), dtype=dtype, enforce_eager=True,
                  max_model_len=max_model_len, seed=seed)  # fmt: skip
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed if temperature else None
        )
        try:
            for start in range(len(answers), len(firsts), chunk):
                # greedy answers do not depend on the batch, so chunking changes no answer
                batch = firsts[start : start + chunk]
                if raw_prompts:
                    outputs = llm.generate(batch, params, use_tqdm=True)
                else:
                    outputs = llm.chat(batch, params, use_tqdm=True)
                texts = [_answer_text(out.outputs[0], tokenizer, raw_prompts) for out in outputs]
                answers.extend(texts)
                if progress_file is not None:
                    with open(progress_file, "a") as f:
                        f.writelines(
                            json.dumps({"index": start + i, "answer": t}) + "\n"
                            for i, t in enumerate(texts)
                        )
        finally:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
    role = COMPLETION_ROLE if raw_prompts else "assistant"
    return [
        [conv[0], {"role": role, "content": answer}]
        for conv, answer in zip(kept, answers)
        if answer.strip()
    ]


def _answer_text(completion, tokenizer, raw_prompt: bool) -> str:
    """The answer as trained on. A raw completion that ended on the end-of-sequence token
    keeps it (vLLM's text drops it), so the head learns to draft the end as the chat
    template's end-of-turn token teaches it in chats."""
    ended = completion.finish_reason == "stop" and completion.stop_reason is None
    if raw_prompt and ended and tokenizer.eos_token:
        return completion.text + tokenizer.eos_token
    return completion.text


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
    concurrency: int = 256,
    parts_only: bool = False,
    first_index: int = 0,
) -> list[list[dict]]:
    """Each conversation's user turns (up to ``max_turns``) answered one turn at a time by
    the target, the dialogue so far as context; a turn whose context leaves no room for
    ``max_tokens`` within ``max_model_len`` ends its conversation there.

    Streamed through one engine: ``concurrency`` conversations are in flight, and as soon
    as a turn's answer is done the conversation's next turn is queued (or a new
    conversation starts), so the batch stays full instead of waiting for a whole turn
    of a chunk to end.

    Resumable and add-only: every ``chunk`` finished conversations are written to
    ``parts_dir`` as one gzipped JSON-lines file (``part-<first index>.jsonl.gz``, one
    line per conversation: its index and messages; written whole, then renamed), and a
    rerun answers only conversations no part holds. Parts can be committed as they come.
    Greedy answers do not depend on the batch, so a resumed run writes what an
    uninterrupted one would have. ``parts_only``: answer nothing, return the
    conversations the parts already hold (to train on a run stopped partway).

    ``first_index``: the parts' index of ``conversations[0]``, for a selection that starts
    past the beginning of the data the parts were made from (``--skip-conversations``),
    so that it reads and writes the same parts as a selection from the beginning."""
    from vllm import LLM, SamplingParams

    parts_dir = Path(parts_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    done = read_parts(parts_dir)
    todo = [i for i in range(len(conversations)) if first_index + i not in done]
    if parts_only:
        held = len(conversations) - len(todo)
        if not held:
            raise ValueError(
                f"--regen-parts-only: the parts in '{parts_dir}' hold none of the "
                f"{len(conversations)} conversations selected. Fix: regenerate first, or "
                "select the data (--data, --num-conversations) the parts were made from."
            )
        print(f"{held} of {len(conversations)} conversations from finished parts", flush=True)
    elif todo:
        llm = LLM(model=str(target), dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
                  seed=seed, max_num_seqs=concurrency)  # fmt: skip
        try:
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                    seed=seed if temperature else None)  # fmt: skip
            dialogues = _DialogueStream(
                llm, params, conversations, todo, max_turns, max_model_len - max_tokens
            )
            finished: list[tuple[int, list[dict]]] = []
            for index, dialogue in dialogues.run(concurrency):
                finished.append((first_index + index, dialogue))
                done[first_index + index] = dialogue
                if len(finished) == chunk:
                    _write_part(parts_dir, finished)
                    finished = []
            if finished:
                _write_part(parts_dir, finished)
        finally:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
    indices = range(first_index, first_index + len(conversations))
    return [done[i] for i in indices if done.get(i)]


class _DialogueStream:
    """Conversations answered turn by turn through ``llm.llm_engine``, ``concurrency`` at
    a time; yields (index, dialogue) as each conversation ends."""

    def __init__(self, llm, params, conversations, indices, max_turns: int, max_prompt: int):
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        self.params = params
        self.max_prompt = max_prompt
        self.users = {
            i: [m for m in conversations[i] if m["role"] == "user"][:max_turns] for i in indices
        }
        self.waiting = list(reversed(indices))  # popped from the end: index order
        self.dialogues: dict[int, list[dict]] = {}
        self.pending: dict[str, tuple[int, list[dict]]] = {}  # request id -> (index, prompt)

    def run(self, concurrency: int):
        from tqdm import tqdm

        bar = tqdm(total=len(self.users), unit="conv", desc="dialogues")
        ended: list[int] = []
        while self.waiting or self.pending:
            while self.waiting and len(self.pending) < concurrency:
                index = self.waiting.pop()
                self.dialogues[index] = []
                if not self._next_turn(index):
                    ended.append(index)
            for out in self.engine.step():
                if not out.finished:
                    continue
                index, prompt = self.pending.pop(out.request_id)
                answer = out.outputs[0].text
                if answer.strip():
                    self.dialogues[index] = prompt + [{"role": "assistant", "content": answer}]
                    if self._next_turn(index):
                        continue
                ended.append(index)
            for index in ended:
                bar.update(1)
                yield index, self.dialogues.pop(index)
            ended = []
        bar.close()

    def _next_turn(self, index: int) -> bool:
        """Queue the conversation's next user turn; False when it has none (or it no
        longer fits), i.e. the conversation ended."""
        dialogue = self.dialogues[index]
        turn = len(dialogue) // 2
        if turn >= len(self.users[index]):
            return False
        messages = dialogue + [self.users[index][turn]]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)  # fmt: skip
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) > self.max_prompt:
            return False  # the dialogue no longer fits: it ends here
        request_id = f"{index}-{turn}"
        self.engine.add_request(request_id, {"prompt_token_ids": ids}, self.params)
        self.pending[request_id] = (index, messages)
        return True


def _write_part(parts_dir: Path, rows: list[tuple[int, list[dict]]]) -> None:
    import gzip

    rows = sorted(rows)
    final = parts_dir / f"part-{rows[0][0]:07d}.jsonl.gz"
    tmp = final.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        f.writelines(json.dumps({"index": i, "messages": d}) + "\n" for i, d in rows)
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
