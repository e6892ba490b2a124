"""The target's features for training: its last hidden state (after the final norm),
and for EAGLE-3 heads the inputs of chosen decoder layers.

The last hidden state is exactly what vLLM hands an EAGLE-1 draft at inference: the
target model's forward output ``hidden_states`` (``LlamaModel.forward`` returns the
normed states), which the proposer pairs with the next token. Here the same
states come from transformers' ``model.model(...).last_hidden_state``;
``tests/integration/test_train.py`` checks the two agree for the same tokens.
An EAGLE-3 head also trains on it: the target's distribution is lm_head(last hidden).

EAGLE-3 features (``layers``) are the residual stream entering decoder layer j, which is
vLLM's auxiliary hidden state j (``SupportsEagle3``: ``hidden_states + residual`` before
layer j) and transformers' ``hidden_states[j]``; they are stored concatenated, [L, n*H].

Features are computed in length-sorted batches and cached on disk in shards
(``shard-NNNNN.pt``), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_vllm.train.tokenize import TokenizedConversation

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class Example:
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool
    hidden: torch.Tensor  # [L, H] target features
    aux: torch.Tensor | None = None  # [L, n*H] inputs of the EAGLE-3 layers (None: EAGLE-1)
    # [L] the target's full-vocabulary argmax after each position, where the loss reads it
    # (filled on first use by the EAGLE-3 trainer; -1 where not computed)
    target_argmax: torch.Tensor | None = None


def load_target(target: str | Path, dtype: str = "bfloat16"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=DTYPES[dtype])
    return model.eval()


def _fingerprint(
    target: Path,
    examples: list[TokenizedConversation],
    dtype: str,
    layers=None,
    compute_dtype: str = "float32",
) -> str:
    key = f"{Path(target).resolve()}|{dtype}" + ("" if layers is None else f"|{list(layers)}")
    if compute_dtype != "float32":  # (float32 caches keep the fingerprints they were made with)
        key += f"|computed in {compute_dtype}"
    h = hashlib.sha256(key.encode())
    for ex in examples:
        h.update(ex.input_ids.numpy().tobytes())
        h.update(ex.loss_mask.numpy().tobytes())
    return h.hexdigest()[:16]


@torch.inference_mode()
def target_features(model, batch: list[torch.Tensor], layers=None):
    """Last hidden states for a list of token-id tensors (right-padded in one forward);
    with ``layers``, pairs (last hidden, concatenated inputs of those decoder layers)."""
    lengths = [len(ids) for ids in batch]
    width = max(lengths)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    attn = torch.zeros(len(batch), width, dtype=torch.int64)
    for i, seq in enumerate(batch):
        ids[i, : len(seq)] = seq
        attn[i, : len(seq)] = 1
    out = model.model(input_ids=ids, attention_mask=attn, output_hidden_states=layers is not None)
    hidden = out.last_hidden_state
    if layers is None:
        return [hidden[i, :n] for i, n in enumerate(lengths)]
    aux = torch.cat([out.hidden_states[j] for j in layers], dim=-1)
    return [(hidden[i, :n], aux[i, :n]) for i, n in enumerate(lengths)]


def extract_features(
    target: str | Path,
    examples: list[TokenizedConversation],
    cache_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    compute_dtype: str = "float32",
    tokens_per_batch: int = 8192,
    shard_size: int = 256,
    progress: bool = True,
    layers: tuple[int, ...] | None = None,
) -> Path:
    """Compute and cache features for ``examples``; returns the cache folder. ``layers``:
    also the inputs of these decoder layers (EAGLE-3), stored concatenated.

    ``dtype`` is the storage dtype; the target runs in ``compute_dtype``: fp32 by
    default, the features a served fp32 target gives (transformers' bf16 forward
    measured 3.5x slower than fp32 on a CPU without AVX-512 BF16, and 1.8x faster on
    one with it: benchmarks/micro/feature_forward.py). A cache made for other data, another target or another storage or
    compute dtype is refused rather than mixed in."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    meta_path = cache / "meta.json"
    fingerprint = _fingerprint(Path(target), examples, dtype, layers, compute_dtype)
    num_shards = -(-len(examples) // shard_size)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if layers is None and meta.get("layers") is not None:
            # An EAGLE-3 cache of the same data also holds the last hidden state, all an
            # EAGLE-1 head trains on: use (and finish) it as it is.
            layers = tuple(meta["layers"])
            fingerprint = _fingerprint(Path(target), examples, dtype, layers, compute_dtype)
        if meta["fingerprint"] != fingerprint:
            raise ValueError(
                f"feature cache '{cache}' was built for other data/target/dtype/compute dtype "
                f"(fingerprint {meta['fingerprint']} != {fingerprint}). Fix: pass another "
                "--features-dir or delete that folder."
            )
    model = None
    todo = [s for s in range(num_shards) if not (cache / f"shard-{s:05d}.pt").exists()]
    bar = None
    if progress and todo:
        from tqdm import tqdm

        total = sum(len(ex.input_ids) for ex in examples)
        bar = tqdm(total=total, unit="tok", desc="target features")
        for s in range(num_shards):
            if s not in todo:
                bar.update(sum(len(ex.input_ids) for ex in examples[s * shard_size :][:shard_size]))
    for s in todo:
        if model is None:
            model = load_target(target, compute_dtype)
        shard = examples[s * shard_size : (s + 1) * shard_size]
        order = sorted(range(len(shard)), key=lambda i: len(shard[i].input_ids))
        hidden: list[torch.Tensor | None] = [None] * len(shard)
        aux: list[torch.Tensor | None] = [None] * len(shard)
        start = 0
        while start < len(order):
            width = len(shard[order[start]].input_ids)
            end = start + 1
            while end < len(order):
                width = len(shard[order[end]].input_ids)
                if width * (end - start + 1) > tokens_per_batch:
                    break
                end += 1
            feats = target_features(model, [shard[i].input_ids for i in order[start:end]], layers)
            for i, f in zip(order[start:end], feats):
                if layers is not None:
                    f, a = f
                    aux[i] = a.to(DTYPES[dtype]).clone()
                hidden[i] = f.to(DTYPES[dtype]).clone()
            if bar is not None:
                bar.update(sum(len(shard[i].input_ids) for i in order[start:end]))
            start = end
        payload = {
            "input_ids": [ex.input_ids.to(torch.int32) for ex in shard],
            "loss_mask": [ex.loss_mask for ex in shard],
            "hidden": hidden,
        }
        if layers is not None:
            payload["aux"] = aux
        tmp = cache / f"shard-{s:05d}.pt.tmp"
        torch.save(payload, tmp)
        tmp.rename(cache / f"shard-{s:05d}.pt")
    if bar is not None:
        bar.close()
    hidden_size = None
    if model is not None:
        hidden_size = model.config.hidden_size
    meta = {
        "fingerprint": fingerprint,
        "target": str(Path(target).resolve()),
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "num_examples": len(examples),
        "num_tokens": sum(len(ex.input_ids) for ex in examples),
        "num_shards": num_shards,
        "hidden_size": hidden_size,
        "layers": None if layers is None else list(layers),
    }
    if meta_path.exists() and hidden_size is None:
        meta["hidden_size"] = json.loads(meta_path.read_text())["hidden_size"]
    meta_path.write_text(json.dumps(meta, indent=2))
    return cache


def load_features(cache_dir: str | Path, *, mmap: bool = True) -> list[Example]:
    """The examples of a feature cache. With ``mmap`` the shards are mapped, not read:
    features are paged in as batches touch them and the page cache keeps what fits, so
    a cache larger than memory still trains (a 1.7M-token EAGLE-3 cache is 7 GB)."""
    cache = Path(cache_dir)
    meta = json.loads((cache / "meta.json").read_text())
    out: list[Example] = []
    for s in range(meta["num_shards"]):
        payload = torch.load(cache / f"shard-{s:05d}.pt", weights_only=True, mmap=mmap)
        aux = payload.get("aux") or [None] * len(payload["hidden"])
        for ids, mask, hidden, a in zip(
            payload["input_ids"], payload["loss_mask"], payload["hidden"], aux
        ):
            out.append(Example(ids.long(), mask, hidden, a))
    return out


def check_extra_cache(
    cache_dir: str | Path, target: str | Path, layers: tuple[int, ...] | None
) -> Path:
    """Refuse a finished feature cache from another run that cannot be trained on beside
    this run's: unfinished, made for another target (by folder name), or, for an EAGLE-3
    run, of other layers (an EAGLE-1 run reads the last hidden state every cache holds)."""
    cache = Path(cache_dir)
    meta_path = cache / "meta.json"
    if not meta_path.is_file():
        raise ValueError(
            f"--extra-features '{cache}': no meta.json, so not a finished feature cache. "
            "Fix: point it at the --features-dir of a run that got past feature extraction."
        )
    meta = json.loads(meta_path.read_text())
    missing = [s for s in range(meta["num_shards"]) if not (cache / f"shard-{s:05d}.pt").is_file()]
    if missing:
        raise ValueError(
            f"--extra-features '{cache}': shards {missing[:4]} are missing. Fix: finish that "
            "run's feature extraction (rerun it) first."
        )
    if Path(meta["target"]).name != Path(target).resolve().name:
        raise ValueError(
            f"--extra-features '{cache}' holds features of target '{meta['target']}', not "
            f"'{target}'. Fix: extract them with this --target."
        )
    theirs = None if meta.get("layers") is None else tuple(meta["layers"])
    # every cache holds the last hidden state, so an EAGLE-1 run (layers None) reads any
    if layers is not None and theirs != tuple(layers):
        raise ValueError(
            f"--extra-features '{cache}' holds layers {theirs}, this run trains on {layers} "
            "(None: the last layer only, EAGLE-1). Fix: use a cache of the same --arch and "
            "--aux-layers."
        )
    return cache
