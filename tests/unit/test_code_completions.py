"""Raw code-completion training data: stubs from Python modules, their loss mask, and the
errors that keep them out of the chat paths."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest

from eagle_vllm import datasets
from eagle_vllm.datasets import COMPLETION_ROLE, PROMPT_ROLE, code_completion_prompts
from eagle_vllm.train.tokenize import tokenize_conversation

MODULE_A = '''import os
from typing import List


def documented(xs: List[int]) -> int:
    """Return the sum of the even numbers in xs, or zero when there are none."""
    return sum(x for x in xs if x % 2 == 0)


def undocumented(x):
    return x


def short_doc(x):
    """Too short."""
    return x


def only_a_docstring():
    """A docstring and nothing after it leaves nothing to complete."""


class Box:
    def method(self, n):
        """Return n copies of the box, each one a fresh instance of the class."""
        return [Box() for _ in range(n)]
'''

MODULE_B = '''def second(path):
    """Open path and return its first line, stripped of surrounding whitespace."""
    with open(path) as fh:
        return fh.readline().strip()
'''


def _stdlib_like(root):
    (root / "pkg").mkdir(parents=True)
    (root / "a.py").write_text(MODULE_A)
    (root / "pkg" / "b.py").write_text(MODULE_B)
    (root / "test").mkdir()
    (root / "test" / "t.py").write_text(MODULE_B.replace("second", "in_a_test_suite"))
    (root / "site-packages").mkdir()
    (root / "site-packages" / "s.py").write_text(MODULE_B.replace("second", "installed"))
    (root / "broken.py").write_text("def broken(:\n")
    return root


def test_stubs_are_signature_and_docstring_with_the_modules_imports(tmp_path):
    prompts = code_completion_prompts(root=_stdlib_like(tmp_path))
    texts = [p[0]["content"] for p in prompts]
    assert all(len(p) == 1 and p[0]["role"] == PROMPT_ROLE for p in prompts)
    # round-robin over modules in path order: each module's first stub, then the seconds
    assert [t.split("def ")[1].split("(")[0] for t in texts] == ["documented", "second", "method"]
    assert texts[0] == (
        "import os\nfrom typing import List\n\n\n"
        "def documented(xs: List[int]) -> int:\n"
        '    """Return the sum of the even numbers in xs, or zero when there are none."""\n'
    )
    assert texts[2].startswith("import os\nfrom typing import List\n\n\ndef method(self, n):\n")
    assert texts[1] == (
        "def second(path):\n"
        '    """Open path and return its first line, stripped of surrounding whitespace."""\n'
    )


def test_skip_limit_and_per_file_cut_the_order(tmp_path):
    root = _stdlib_like(tmp_path)
    every = code_completion_prompts(root=root)
    assert code_completion_prompts(1, skip=1, root=root) == every[1:2]
    assert len(code_completion_prompts(root=root, per_file=1)) == 2
    assert code_completion_prompts(root=root, max_chars=80) == []


def test_humaneval_prompts_are_dropped(tmp_path, monkeypatch):
    root = _stdlib_like(tmp_path)
    leaked = code_completion_prompts(root=root)[1][0]["content"]
    monkeypatch.setattr(datasets, "eval_prompt_keys", lambda: {datasets._normalise(leaked)})
    assert leaked not in [p[0]["content"] for p in code_completion_prompts(root=root)]


def test_the_interpreters_standard_library_gives_thousands_of_stubs():
    prompts = code_completion_prompts(2000)
    assert len(prompts) == 2000
    assert len({p[0]["content"] for p in prompts}) == 2000
    for prompt in prompts[::40]:  # each a parseable stub that ends on its docstring
        function = ast.parse(prompt[0]["content"]).body[-1]
        assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        assert len(function.body) == 1 and ast.get_docstring(function)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    from tiny_models import build_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def test_a_raw_completion_is_masked_to_the_completion(word_tokenizer):
    msgs = [{"role": PROMPT_ROLE, "content": "w5 w6 "}, {"role": COMPLETION_ROLE,
            "content": "w7 w8 </s>"}]  # fmt: skip
    ex = tokenize_conversation(word_tokenizer, msgs, max_len=100)
    words = word_tokenizer.convert_ids_to_tokens(ex.input_ids.tolist())
    assert words == ["w5", "w6", "w7", "w8", "</s>"]  # no chat template, no BOS
    assert ex.loss_mask.tolist() == [False, False, True, True, True]
    assert tokenize_conversation(word_tokenizer, msgs, max_len=3).loss_mask.tolist() == [
        False,
        False,
        True,
    ]
    assert tokenize_conversation(word_tokenizer, msgs, max_len=2) is None
    assert tokenize_conversation(word_tokenizer, msgs[:1], max_len=100) is None  # unanswered


def test_regeneration_refuses_a_mix_of_raw_prompts_and_chats():
    from eagle_vllm.train.regenerate import regenerate_answers

    mixed = [[{"role": PROMPT_ROLE, "content": "def f():\n"}], [{"role": "user", "content": "hi"}]]
    with pytest.raises(ValueError, match="mix raw prompts and chats"):
        regenerate_answers("no-such-model", mixed)


@pytest.mark.parametrize(
    "finish, stop_reason, raw, expected",
    [
        ("stop", None, True, "x = 1\n</s>"),  # ended on EOS: kept, to be drafted
        ("stop", "\n\n", True, "x = 1\n"),  # a stop string is not the end of sequence
        ("length", None, True, "x = 1\n"),
        ("stop", None, False, "x = 1\n"),  # chats: the template adds the end-of-turn
    ],
)
def test_a_raw_completion_keeps_its_end_of_sequence(
    word_tokenizer, finish, stop_reason, raw, expected
):
    from eagle_vllm.train.regenerate import _answer_text

    completion = SimpleNamespace(text="x = 1\n", finish_reason=finish, stop_reason=stop_reason)
    assert _answer_text(completion, word_tokenizer, raw) == expected


@pytest.mark.parametrize("flags", [[], ["--regenerate", "--regenerate-turns", "all"]])
def test_code_data_needs_first_turn_regeneration(tmp_path, flags, capsys):
    from eagle_vllm.train.main import main

    with pytest.raises(SystemExit, match="--data code holds prompts only"):
        main(["--target", str(tmp_path), "--out", str(tmp_path / "o"), "--data", "code", *flags])
