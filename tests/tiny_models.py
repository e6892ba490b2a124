"""Tiny Llama targets and EAGLE drafts built on the spot (no hub), for tests.

* ``build_tokenizer``: a word-level tokenizer (``w0 .. wN`` plus specials).
* ``build_target``: a random tiny Llama in float32; ``oracle=True`` zeroes every
  ``o_proj``/``down_proj`` so the next token depends only on the current one.
* ``build_draft``: a SafeAILab-layout EAGLE-1 head (``config.json`` +
  ``model.safetensors``): ``random``, ``oracle`` (``fc = [I | 0]``, zero
  ``o_proj``/``down_proj``: reproduces an oracle target exactly), optionally
  with noise and/or an ``fc.bias``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_WORDS = 250
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 256


def build_tokenizer(path: Path, words: int = VOCAB_WORDS, extra: tuple[str, ...] = ()) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(words):
        vocab[f"w{i}"] = len(vocab)
    for token in extra:  # e.g. JSON punctuation, for structured-output tests
        vocab[token] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(path))
    return len(vocab)


def _llama_config(vocab_size: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def build_target(
    path: Path,
    *,
    oracle: bool = False,
    context: float = 0.0,
    layers: int = 2,
    seed: int = 0,
    words: int = VOCAB_WORDS,
    lm_scale: float | None = None,
    extra_tokens: tuple[str, ...] = (),
) -> Path:
    """``oracle``: o_proj/down_proj scaled by ``context`` (0 = next token depends
    only on the current token; small values add a little context dependence)."""
    from transformers import LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(path, words, extra_tokens)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(vocab_size, layers)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            if oracle:
                layer.self_attn.o_proj.weight.mul_(context)
                layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        if lm_scale is not None:  # small values give spread-out distributions
            model.lm_head.weight.mul_(lm_scale)
        elif oracle:
            model.lm_head.weight.mul_(20.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def build_draft(
    path: Path,
    target: Path,
    *,
    kind: str = "random",
    noise: float = 0.0,
    attn_noise: float = 0.0,
    fc_bias: float | None = None,
    with_embed: bool = False,
    bin_format: bool = False,
    seed: int = 1,
) -> Path:
    """Write a SafeAILab-layout EAGLE-1 head for ``target``."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    target_cfg = json.loads((target / "config.json").read_text())
    h, kv = HIDDEN, KV_HEADS * (HIDDEN // HEADS)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    weights = {
        "fc.weight": rnd(h, 2 * h, std=0.1),
        "layers.0.self_attn.q_proj.weight": rnd(h, h),
        "layers.0.self_attn.k_proj.weight": rnd(kv, h),
        "layers.0.self_attn.v_proj.weight": rnd(kv, h),
        "layers.0.self_attn.o_proj.weight": rnd(h, h),
        "layers.0.mlp.gate_proj.weight": rnd(INTERMEDIATE, h),
        "layers.0.mlp.up_proj.weight": rnd(INTERMEDIATE, h),
        "layers.0.mlp.down_proj.weight": rnd(h, INTERMEDIATE),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    if kind == "oracle":
        weights["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        weights["layers.0.self_attn.o_proj.weight"].zero_()
        weights["layers.0.mlp.down_proj.weight"].zero_()
        if noise:
            weights["fc.weight"] += rnd(h, 2 * h, std=noise)
        if attn_noise:  # makes the draft's attention (prefix + ancestors) matter
            weights["layers.0.self_attn.o_proj.weight"] += rnd(h, h, std=attn_noise)
    elif kind != "random":
        raise ValueError(kind)
    if fc_bias is not None:
        weights["fc.bias"] = rnd(h, std=fc_bias)
    if with_embed:
        target_weights = load_file(str(target / "model.safetensors"))
        weights["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"].clone()
    cfg = {**_draft_layer_config(target_cfg), "bias": fc_bias is not None}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = {k: v.contiguous().float() for k, v in weights.items()}
    if bin_format:
        torch.save(weights, path / "pytorch_model.bin")
    else:
        save_file(weights, str(path / "model.safetensors"))
    return path


def _draft_layer_config(target_cfg: dict) -> dict:
    """The Llama config of a one-layer draft for a tiny target."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "vocab_size": target_cfg["vocab_size"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def build_lora(path: Path, target: Path, rank: int = 8, scale: float = 0.3, seed: int = 0) -> Path:
    """A PEFT-layout LoRA adapter for a tiny target (q/v/o/down projections), random and
    large enough to change the target's greedy outputs."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(target) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (d_in, d_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": [m.split(".")[-1] for m in shapes],
                "base_model_name_or_path": str(target),
                "fan_in_fan_out": False,
                "modules_to_save": None,
            }
        )
    )
    return path


def oracle_next_tokens(target: Path) -> torch.Tensor:
    """[V] the greedy next token of an oracle target (``build_target(oracle=True)``) after
    each token: its residual stream stays the token's embedding, so the next token is
    argmax(lm_head . rmsnorm(embed(t)))."""
    from safetensors.torch import load_file

    w = load_file(str(target / "model.safetensors"))
    embed = w["model.embed_tokens.weight"].double()
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed @ w["lm_head.weight"].double().T).argmax(-1)


def build_eagle3_draft(
    path: Path,
    target: Path,
    *,
    kind: str = "random",
    layout: str = "speculators",
    draft_vocab: int | None = None,
    aux_layers: tuple[int, ...] = (0, 1, 2),
    seed: int = 2,
    shared_lm_head: bool = False,
) -> Path:
    """Write an EAGLE-3 head for ``target``: ``layout`` ``speculators`` (what
    ``eagle-vllm train --arch eagle3`` writes) or ``safeailab`` (``midlayer.*``, a Llama
    config.json). ``draft_vocab``: an LM head over that many target ids (a seeded random
    subset, mapped by ``d2t``; None: the full vocabulary, no ``d2t``).

    ``kind="oracle2"`` (for an oracle target, whose features are all the token's
    embedding): fc keeps the first layer's feature, the decoder passes it through, and the
    LM head maps rmsnorm(embed(t)) to the token two steps after t (least squares over the
    whole vocabulary), so depth-1 drafts are right and deeper ones mostly wrong.

    ``shared_lm_head``: no ``lm_head`` (nor ``d2t``): the head drafts the whole vocabulary
    through the target's LM head. With ``oracle2``, fc then maps each token's embedding to
    the next token's (least squares), so the target's head reads the token two ahead."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    target_cfg = json.loads((target / "config.json").read_text())
    vocab = target_cfg["vocab_size"]
    h, kv, n = HIDDEN, KV_HEADS * (HIDDEN // HEADS), len(aux_layers)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    if draft_vocab is None:
        used = torch.arange(vocab)
    else:
        used = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    rows = used.numel()
    weights = {
        "fc.weight": rnd(h, n * h, std=0.1),
        "layers.0.self_attn.q_proj.weight": rnd(h, 2 * h, std=0.1),
        "layers.0.self_attn.k_proj.weight": rnd(kv, 2 * h, std=0.1),
        "layers.0.self_attn.v_proj.weight": rnd(kv, 2 * h, std=0.1),
        "layers.0.self_attn.o_proj.weight": rnd(h, h),
        "layers.0.mlp.gate_proj.weight": rnd(INTERMEDIATE, h),
        "layers.0.mlp.up_proj.weight": rnd(INTERMEDIATE, h),
        "layers.0.mlp.down_proj.weight": rnd(h, INTERMEDIATE),
        "layers.0.input_layernorm.weight": torch.ones(h),
        "layers.0.hidden_norm.weight": torch.ones(h),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": rnd(rows, h),
    }
    if kind == "oracle2":
        weights["layers.0.self_attn.o_proj.weight"].zero_()
        weights["layers.0.mlp.down_proj.weight"].zero_()
        nxt = oracle_next_tokens(target)
        embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"].double()
        if shared_lm_head:  # fc: embed(t) -> embed(next(t)); the target's head does the rest
            first = torch.linalg.lstsq(embed, embed[nxt]).solution.T.float()
        else:  # fc keeps embed(t); the head's own LM head maps it two tokens ahead
            first = torch.eye(h)
            normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6)  # [V, h]
            column_of = {int(t): i for i, t in enumerate(used)}
            wanted = torch.zeros(vocab, rows, dtype=torch.float64)
            for t, u in enumerate(nxt[nxt].tolist()):
                if u in column_of:
                    wanted[t, column_of[u]] = 20.0
            weights["lm_head.weight"] = torch.linalg.lstsq(normed, wanted).solution.T.float()
        weights["fc.weight"] = torch.cat([first, torch.zeros(h, (n - 1) * h)], dim=1)
    elif kind != "random":
        raise ValueError(kind)
    if shared_lm_head:
        if draft_vocab is not None:
            raise ValueError("a shared LM head drafts the whole vocabulary")
        del weights["lm_head.weight"]
    if draft_vocab is not None:
        weights["d2t"] = used - torch.arange(rows)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
        weights["t2d"] = t2d
    layer_cfg = {
        **_draft_layer_config(target_cfg),
        "tie_word_embeddings": False,
        "num_aux_hidden_states": n,
        "hidden_act": "silu",
        "rope_theta": target_cfg.get("rope_theta", 10000.0),
        "attention_bias": False,
    }
    if layout == "speculators":
        cfg = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "draft_vocab_size": rows,
            "norm_before_residual": True,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "transformer_layer_config": layer_cfg,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": 3,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }  # fmt: skip
                ],
                "verifier": {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]},
            },
        }
    elif layout == "safeailab":
        cfg = {**layer_cfg, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": rows,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}}  # fmt: skip
        weights = {
            ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
            for k, v in weights.items()
        }
    else:
        raise ValueError(layout)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() if v.dtype == torch.bool else v.contiguous().float()
               if v.is_floating_point() else v.contiguous()
               for k, v in weights.items()}, str(path / "model.safetensors"))  # fmt: skip
    return path
