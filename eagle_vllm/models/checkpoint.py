"""Read an EAGLE draft checkpoint folder without building a model.

Supports SafeAILab's layout (``config.json`` + ``pytorch_model.bin`` or
``model.safetensors``; weights ``fc.weight``, optional ``fc.bias``,
``layers.N.*`` without ``input_layernorm`` on layer 0, optional
``embed_tokens.weight``) and the project's own output, which is the same layout.

In SafeAILab's ``config.json`` the key ``bias`` means the **fc** bias. vLLM's
Llama layers read ``config.bias`` as the attention bias, so the two meanings
are separated here: the fc bias is decided by the weights themselves.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from eagle_vllm.config import EagleConfigError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# A frequency-ranked subset of the target's vocabulary to draft over (FR-Spec style),
# written by ``eagle-vllm train --ce-vocab N``: {"token_ids": [...]}, most frequent first.
# JSON, not safetensors: vLLM's loader reads every *.safetensors file of the folder, and
# stock vLLM EAGLE must still load the head.
DRAFT_VOCAB_FILE = "draft_vocab.json"


class DraftCheckpointError(EagleConfigError):
    """A draft folder whose files cannot be an EAGLE-1 head (raised before any worker starts)."""


@dataclass(frozen=True)
class DraftInfo:
    path: str
    weights_file: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    fc_bias: bool
    has_embed_tokens: bool
    has_draft_vocab_map: bool
    draft_vocab_size: int = 0  # length of draft_vocab.json' token_ids (0: none)


def _weight_keys_and_shapes(path: Path) -> tuple[str, dict[str, tuple[int, ...]]]:
    st_files = sorted(path.glob("*.safetensors"))
    if st_files:
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        for f in st_files:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    shapes[k] = tuple(fh.get_slice(k).get_shape())
        return str(st_files[0]), shapes
    bin_file = path / "pytorch_model.bin"
    if bin_file.is_file():
        import torch

        state = torch.load(bin_file, map_location="cpu", mmap=True, weights_only=True)
        return str(bin_file), {k: tuple(v.shape) for k, v in state.items()}
    raise DraftCheckpointError(
        f"draft folder '{path}' has no weights. Fix: add model.safetensors or "
        "pytorch_model.bin (SafeAILab layout)."
    )


def _strip(key: str) -> str:
    return key[len("model.") :] if key.startswith("model.") else key


@functools.lru_cache(maxsize=16)
def inspect_draft_checkpoint(path: str) -> DraftInfo:
    """Read config.json and the weight names/shapes; raise a clear error if inconsistent."""
    folder = Path(path)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftCheckpointError(
            f"draft folder '{folder}': cannot read config.json ({exc}). "
            "Fix: use an EAGLE checkpoint folder with a valid config.json."
        ) from None
    weights_file, shapes = _weight_keys_and_shapes(folder)
    shapes = {_strip(k): v for k, v in shapes.items()}
    hidden = cfg.get("hidden_size")
    vocab = cfg.get("vocab_size")
    if not isinstance(hidden, int) or not isinstance(vocab, int):
        raise DraftCheckpointError(
            f"draft config '{folder / 'config.json'}' lacks hidden_size/vocab_size. "
            "Fix: copy them from the target model's config.json."
        )
    fc = shapes.get("fc.weight")
    if fc is None:
        raise DraftCheckpointError(
            f"draft weights '{weights_file}' have no fc.weight, so this is not an "
            "EAGLE-1 head. Fix: use a SafeAILab-layout EAGLE checkpoint."
        )
    if fc != (hidden, 2 * hidden):
        raise DraftCheckpointError(
            f"draft fc.weight has shape {list(fc)}, expected [{hidden}, {2 * hidden}] "
            f"for hidden_size {hidden}. Fix: use an EAGLE-1 head whose config matches "
            "its weights."
        )
    fc_bias = "fc.bias" in shapes
    declared = cfg.get("bias")
    if declared is True and not fc_bias:
        raise DraftCheckpointError(
            f"draft config '{folder / 'config.json'}' says \"bias\": true but the "
            'weights have no fc.bias. Fix: set "bias": false or restore fc.bias.'
        )
    embed = shapes.get("embed_tokens.weight")
    if embed is not None and embed != (vocab, hidden):
        raise DraftCheckpointError(
            f"draft embed_tokens.weight has shape {list(embed)}, expected "
            f"[{vocab}, {hidden}]. Fix: drop embed_tokens (the target's is shared)."
        )
    layers = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.")}
    num_layers = cfg.get("num_hidden_layers", len(layers))
    if layers and sorted(layers) != list(range(num_layers)):
        raise DraftCheckpointError(
            f"draft weights hold layers {sorted(layers)} but config.json says "
            f"num_hidden_layers={num_layers}. Fix: make them agree."
        )
    return DraftInfo(
        draft_vocab_size=_draft_vocab_size(folder, vocab),
        path=str(folder),
        weights_file=weights_file,
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=num_layers,
        fc_bias=fc_bias,
        has_embed_tokens=embed is not None,
        has_draft_vocab_map="d2t" in shapes,
    )


def _draft_vocab_size(folder: Path, vocab: int) -> int:
    path = folder / DRAFT_VOCAB_FILE
    if not path.is_file():
        return 0
    ids = load_draft_vocab(str(folder))
    if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise DraftCheckpointError(
            f"'{path}' must hold token_ids: a 1-D list of distinct target token ids "
            f"in [0, {vocab}). Fix: rewrite it with eagle-vllm train, or delete it."
        )
    if ids.unique().numel() != ids.numel():
        raise DraftCheckpointError(f"'{path}' repeats token ids. Fix: keep each id once.")
    return int(ids.numel())


def load_draft_vocab(path: str):
    """The frequency-ranked token ids of a head's reduced draft vocabulary."""
    import torch

    path = Path(path) / DRAFT_VOCAB_FILE
    try:
        ids = json.loads(path.read_text())["token_ids"]
        return torch.tensor(ids, dtype=torch.int64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DraftCheckpointError(
            f"'{path}' is not a JSON object with a token_ids list ({exc}). "
            "Fix: rewrite it with eagle-vllm train, or delete it."
        ) from None
