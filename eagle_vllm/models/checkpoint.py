"""Read an EAGLE draft checkpoint folder without building a model.

Two head types, told apart by their weights (``DraftInfo.head_type``):

* **EAGLE-1** (SafeAILab ``cnets1.py`` layout, and the project's ``--arch eagle1``
  output): ``fc.weight`` [H, 2H] (optional ``fc.bias``), ``layers.N.*`` without
  ``input_layernorm`` on layer 0, optional ``embed_tokens.weight``; the LM head is the
  target's. In SafeAILab's ``config.json`` the key ``bias`` means the **fc** bias;
  vLLM's Llama layers read ``config.bias`` as the attention bias, so the two meanings
  are separated here: the fc bias is decided by the weights themselves.
* **EAGLE-3**: ``fc.weight`` [H, n*H_target] fusing n target layers, one decoder layer
  whose q/k/v take ``[embed ‖ feature]`` (2H) and that has a ``hidden_norm``, a final
  ``norm``, its own ``lm_head`` over a draft vocabulary and ``d2t`` (draft id -> target
  id offsets). Two layouts: the ``speculators`` format (``config.json`` with
  ``speculators_model_type: eagle3``, ``transformer_layer_config``, ``draft_vocab_size``,
  ``eagle_aux_hidden_state_layer_ids``; weights ``layers.0.*``), which
  ``eagle-vllm train --arch eagle3`` writes, and SafeAILab's (a Llama ``config.json``
  with ``draft_vocab_size``; weights ``midlayer.*``).

A folder that mixes them (an EAGLE-3 config over EAGLE-1 weights, or the reverse) is
refused here, before any worker starts.
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
HEAD_TYPES = ("eagle1", "eagle3")


class DraftCheckpointError(EagleConfigError):
    """A draft folder whose files cannot be an EAGLE head (raised before any worker starts)."""


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
    head_type: str = "eagle1"  # "eagle1" or "eagle3"
    # EAGLE-3: the target layers whose features are fused (vLLM's numbering: id j is the
    # input of decoder layer j); None: the target's default (2, L/2, L-3)
    aux_layer_ids: tuple[int, ...] | None = None
    num_aux_layers: int = 0  # EAGLE-3: features fused by fc (fc input = n * H)
    head_vocab_size: int = 0  # EAGLE-3: rows of its own LM head (its draft vocabulary)
    speculators_format: bool = False


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
    key = key[len("model.") :] if key.startswith("model.") else key
    return "layers.0." + key[len("midlayer.") :] if key.startswith("midlayer.") else key


def _looks_eagle3(shapes: dict[str, tuple[int, ...]]) -> bool:
    """EAGLE-3's decoder layer normalises the fed feature apart from the token embedding
    (``hidden_norm``, in every EAGLE-3 layout); EAGLE-1's has no such norm."""
    return "layers.0.hidden_norm.weight" in shapes


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
    speculators = "speculators_model_type" in cfg
    if speculators:
        kind = cfg["speculators_model_type"]
        if kind != "eagle3":
            raise DraftCheckpointError(
                f"draft config '{folder / 'config.json'}' is a speculators '{kind}' "
                "checkpoint; eagle_vllm runs EAGLE-1 and EAGLE-3 heads. Fix: use an "
                "eagle3 speculator, or pass this one to vLLM directly."
            )
        layer_cfg = cfg.get("transformer_layer_config")
        if not isinstance(layer_cfg, dict):
            raise DraftCheckpointError(
                f"speculators config '{folder / 'config.json'}' lacks the "
                "transformer_layer_config object. Fix: add it (the draft layer's Llama config)."
            )
    else:
        layer_cfg = cfg
    hidden = layer_cfg.get("hidden_size")
    vocab = layer_cfg.get("vocab_size")
    if not isinstance(hidden, int) or not isinstance(vocab, int):
        where = "transformer_layer_config" if speculators else "config.json"
        raise DraftCheckpointError(
            f"draft config '{folder / 'config.json'}' lacks hidden_size/vocab_size in "
            f"{where}. Fix: copy them from the target model's config.json."
        )
    fc = shapes.get("fc.weight")
    if fc is None:
        raise DraftCheckpointError(
            f"draft weights '{weights_file}' have no fc.weight, so this is not an "
            "EAGLE head. Fix: use a SafeAILab-layout EAGLE-1/EAGLE-3 or a speculators "
            "eagle3 checkpoint."
        )
    eagle3 = _looks_eagle3(shapes)
    if speculators and not eagle3:
        raise DraftCheckpointError(
            f"draft '{folder}' has a speculators eagle3 config but EAGLE-1 weights (no "
            "hidden_norm). Fix: use the config.json that came "
            "with these weights (SafeAILab EAGLE-1 layout), or the EAGLE-3 weights."
        )
    layers = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.")}
    num_layers = layer_cfg.get("num_hidden_layers", len(layers))
    if layers and sorted(layers) != list(range(num_layers)):
        raise DraftCheckpointError(
            f"draft weights hold layers {sorted(layers)} but config.json says "
            f"num_hidden_layers={num_layers}. Fix: make them agree."
        )
    embed = shapes.get("embed_tokens.weight")
    if embed is not None and embed != (vocab, hidden):
        raise DraftCheckpointError(
            f"draft embed_tokens.weight has shape {list(embed)}, expected "
            f"[{vocab}, {hidden}]. Fix: drop embed_tokens (the target's is shared)."
        )
    common = dict(
        path=str(folder),
        weights_file=weights_file,
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=num_layers,
        has_embed_tokens=embed is not None,
        has_draft_vocab_map="d2t" in shapes,
        draft_vocab_size=_draft_vocab_size(folder, vocab),
    )
    if eagle3:
        return _inspect_eagle3(folder, cfg, layer_cfg, shapes, fc, speculators, common)
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
    return DraftInfo(fc_bias=fc_bias, **common)


def _inspect_eagle3(folder, cfg, layer_cfg, shapes, fc, speculators, common) -> DraftInfo:
    hidden, vocab = common["hidden_size"], common["vocab_size"]
    config_path = folder / "config.json"
    if common["num_layers"] != 1:
        raise DraftCheckpointError(
            f"EAGLE-3 draft '{folder}' has {common['num_layers']} decoder layers; "
            "eagle_vllm runs EAGLE-3 heads with one (as SafeAILab, SpecForge and "
            "speculators train them). Fix: use a one-layer EAGLE-3 head."
        )
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(cfg.get("eagle_config"), dict):
        ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list) and not ids:
        ids = None  # as vLLM: an empty list means the target's default layers
    if ids is not None and (
        not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids)
    ):
        raise DraftCheckpointError(
            f"'{config_path}': eagle_aux_hidden_state_layer_ids must be a non-empty list "
            f"of target layer indices, got {ids!r}. Fix: e.g. [2, 15, 27] for a 30-layer "
            "target, or drop the key for the target's default layers."
        )
    target_hidden = cfg.get("target_hidden_size") or hidden
    num_aux = len(ids) if ids else 3
    if fc != (hidden, num_aux * target_hidden):
        raise DraftCheckpointError(
            f"EAGLE-3 draft fc.weight has shape {list(fc)}, expected "
            f"[{hidden}, {num_aux * target_hidden}] ({num_aux} target layers of "
            f"{target_hidden}). Fix: make eagle_aux_hidden_state_layer_ids list the "
            "layers the head was trained on."
        )
    q = shapes.get("layers.0.self_attn.q_proj.weight")
    if q is not None and (len(q) != 2 or q[1] != 2 * hidden):
        raise DraftCheckpointError(
            f"EAGLE-3 draft q_proj.weight has shape {list(q)}; an EAGLE-3 layer reads "
            f"[embed ; feature], {2 * hidden} wide. Fix: use the head's original weights "
            "(hidden_size in the config must be the target's)."
        )
    if "fc.bias" in shapes:
        raise DraftCheckpointError(
            f"EAGLE-3 draft '{folder}' has an fc.bias, which EAGLE-3 heads do not have "
            "(vLLM would not load it). Fix: use the head's original weights."
        )
    lm_head = shapes.get("lm_head.weight")
    draft_vocab = cfg.get("draft_vocab_size", layer_cfg.get("draft_vocab_size"))
    rows = lm_head[0] if lm_head is not None else vocab
    if lm_head is not None and lm_head[1] != hidden:
        raise DraftCheckpointError(
            f"EAGLE-3 draft lm_head.weight has shape {list(lm_head)}, expected "
            f"[draft_vocab_size, {hidden}]. Fix: use the head's original weights."
        )
    if draft_vocab is not None and draft_vocab != rows:
        raise DraftCheckpointError(
            f"'{config_path}' says draft_vocab_size {draft_vocab} but the LM head has "
            f"{rows} rows. Fix: set draft_vocab_size to {rows}."
        )
    d2t = shapes.get("d2t")
    if rows < vocab and d2t != (rows,):
        raise DraftCheckpointError(
            f"EAGLE-3 draft '{folder}' drafts over {rows} of {vocab} tokens but its d2t "
            f"map has shape {None if d2t is None else list(d2t)}, expected [{rows}]. "
            "Fix: add the d2t tensor (draft id -> target id offset) it was trained with."
        )
    if rows > vocab:
        raise DraftCheckpointError(
            f"EAGLE-3 draft LM head has {rows} rows, more than the vocabulary ({vocab}). "
            "Fix: use a head trained for this target."
        )
    if common["draft_vocab_size"] and rows < vocab:
        raise DraftCheckpointError(
            f"EAGLE-3 draft '{folder}' also has {DRAFT_VOCAB_FILE}; this head already "
            f"drafts over its own {rows}-token vocabulary (lm_head + d2t). Fix: delete "
            f"{DRAFT_VOCAB_FILE} (only a head over the whole vocabulary, such as one that "
            "shares the target's LM head, takes one)."
        )
    return DraftInfo(
        fc_bias=False,
        head_type="eagle3",
        aux_layer_ids=tuple(ids) if ids else None,
        num_aux_layers=num_aux,
        head_vocab_size=rows,
        speculators_format=speculators,
        **{**common, "has_draft_vocab_map": d2t is not None},
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
