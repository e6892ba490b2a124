"""Train an EAGLE-1 head on cached target features; export a SafeAILab-layout checkpoint.

Loss (SafeAILab ``eagle/train/main.py``)::

    L = SmoothL1(f̂_{i+1}, f_{i+1}) + w · CE(target, q)

* SmoothL1 is averaged over the hidden size, then over the loss positions.
* CE ``soft``: against the target's distribution ``softmax(lm_head(f_{i+1}))``
  (SafeAILab's default, w = 0.1); ``hard``: against the next token in the data.
  ``ce_vocab`` > 0 restricts both sides of the CE to the most frequent training
  tokens (FR-Spec style), which cuts the LM-head cost of a step several times;
  the SmoothL1 term still trains the whole feature.
* Loss positions: draft position i (token t_{i+1}, feature f_i) counts when
  t_{i+1} is an assistant token.

Noise on the input features (the draft sees its own, imperfect features at
depth > 1; noise makes it robust to that):

* ``uniform`` (default): U(-a, a) with a = ``noise`` (the paper's U(-0.1, 0.1)).
* ``safeailab``: SafeAILab's code, ``(rand - 0.5) · 0.2 · 512 / L``: the same
  amplitude only at L = 512, larger for short sequences and smaller for long ones.
* ``none``.

Resumable: ``state.pt`` in the output folder holds model, optimiser, schedule,
step and RNG; rerunning the same command continues from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle_vllm.train.features import Example
from eagle_vllm.train.head import EagleHead


@dataclass
class TrainConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    max_steps: int = 1000
    tokens_per_batch: int = 4096
    grad_clip: float = 0.5
    ce_weight: float = 0.1
    ce_labels: str = "soft"  # soft | hard
    ce_vocab: int = 0  # 0 = full vocabulary
    noise: str = "uniform"  # uniform | safeailab | none
    noise_scale: float = 0.1
    fc_bias: bool = False
    # bfloat16 autocast: on CPU (torch 2.13) its backward ran ~50x slower than fp32; use fp32 there
    dtype: str = "float32"  # float32 | bfloat16 (autocast)
    val_fraction: float = 0.02
    # how validation conversations are chosen: random (a seeded shuffle) | prompt (by a hash
    # of the first prompt, so a conversation that two data sources share, or that a larger
    # dataset adds, lands on the same side) | auto (prompt when training on several
    # feature caches, else random)
    val_split: str = "auto"
    eval_every: int = 100
    save_every: int = 100
    log_every: int = 10
    max_minutes: float = 0.0  # 0 = no time limit; otherwise stop (and save) after this
    seed: int = 0
    # unrolled steps of the training-time test (0: the head's default, 5 for EAGLE-3 and 1,
    # plain EAGLE-1 training, for EAGLE-1) and their loss decay; EAGLE-3 (--arch eagle3,
    # train/eagle3.py): target layers ("" = 2, L/2, L-3), optional HASS-style top-K and
    # feature terms, a frozen LM head
    ttt_steps: int = 0
    ttt_decay: float = 0.8
    aux_layers: str = ""
    ttt_topk: int = 10
    ttt_topk_weight: float = 0.0
    ttt_feature_weight: float = 0.0
    ttt_freeze_lm_head: bool = False
    # draft the whole vocabulary through the target's own LM head (frozen, exported without
    # lm_head/d2t, so the head is about half the size and loaders share the target's):
    # no token the target writes is out of the draft's reach; needs ce_vocab 0
    share_lm_head: bool = False
    # with share_lm_head: each training batch's softmaxes run over this many of the most
    # frequent assistant tokens plus every token of the batch's conversations and the
    # target's argmaxes there (a sampled softmax: the copied names and identifiers stay in,
    # at a sixth of the columns); 0 = the whole vocabulary. Validation scores all of it.
    lm_head_sample: int = 0
    # validation unrolls at least this many steps: accuracy per step beyond the trained
    # ones (the validation loss stays over ttt_steps, comparable with the training loss)
    eval_ttt_steps: int = 4
    # a warm start: the weights of an exported head of the same kind (a new optimiser and
    # schedule); "" = the usual initialisation
    init_from: str = ""
    # EAGLE-1, with init_from: keep that head's draft vocabulary (its draft_vocab.json
    # ranking, which a config's draft_vocab: N serves the first N of) instead of ranking
    # this run's data, so that training on over other data (e.g. task answers only) does
    # not move the served tokens away from what the earlier data taught. EAGLE-3 warm
    # starts always keep theirs (their d2t).
    keep_init_vocab: bool = False


def load_target_embeddings(target: str | Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The target's config, input embeddings and LM head (tied heads share one tensor)."""
    from safetensors import safe_open

    target = Path(target)
    config = json.loads((target / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in fh.keys():
                    tensors[key] = fh.get_tensor(key).float()
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"target '{target}' has no model.embed_tokens.weight in safetensors")
    embed = tensors["model.embed_tokens.weight"]
    lm_head = tensors.get("lm_head.weight", embed)
    return config, embed, lm_head


def feature_noise(features: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    if mode == "none":
        return features
    if mode == "uniform":
        return features + (torch.rand_like(features) * 2 - 1) * scale
    if mode == "safeailab":
        length = features.shape[1]
        return features + (torch.rand_like(features) - 0.5) * 0.2 * 512 / length
    raise ValueError(f"noise: unknown mode '{mode}'. Fix: use uniform, safeailab or none.")


def eagle_loss(
    f_hat: torch.Tensor,
    f_next: torch.Tensor,
    next_tokens: torch.Tensor,
    lm_head: torch.Tensor,
    *,
    ce_weight: float,
    ce_labels: str,
) -> dict[str, torch.Tensor]:
    """Loss over loss positions only: ``f_hat``/``f_next`` ``[N, H]``, ``next_tokens [N]``
    (index into ``lm_head``'s rows, -1 if outside it). Returns loss, parts and top-1 agreement."""
    regression = F.smooth_l1_loss(f_hat.float(), f_next.float(), reduction="none").mean(-1)
    draft_logits = f_hat @ lm_head.T.to(f_hat.dtype)
    draft_logp = torch.log_softmax(draft_logits.float(), dim=-1)
    with torch.no_grad():
        target_logits = (f_next @ lm_head.T.to(f_next.dtype)).float()
        agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    if ce_labels == "soft":
        ce = -(torch.softmax(target_logits, dim=-1) * draft_logp).sum(-1)
    elif ce_labels == "hard":
        ok = next_tokens >= 0
        ce = torch.where(ok, -draft_logp.gather(1, next_tokens.clamp(min=0)[:, None])[:, 0], 0.0)
    else:
        raise ValueError(f"ce_labels: unknown '{ce_labels}'. Fix: use soft or hard.")
    loss = regression.mean() + ce_weight * ce.mean()
    return {
        "loss": loss,
        "smooth_l1": regression.mean().detach(),
        "ce": ce.mean().detach(),
        "acc": agree.mean(),
    }


VAL_SPLITS = ("auto", "random", "prompt")


def prompt_key(example: Example) -> int:
    """A stable 64-bit hash of the tokens before the first assistant token."""
    first = int(example.loss_mask.nonzero()[0, 0]) if bool(example.loss_mask.any()) else 0
    ids = example.input_ids[:first].to(torch.int64).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(ids, digest_size=8).digest(), "little")


def validation_split(
    examples: list[Example], fraction: float, seed: int, mode: str
) -> tuple[list[int], list[int]]:
    """Indices of the validation and the training examples, each in one seeded shuffled
    order (at least one validates, given two or more). ``random``: the shuffle's first
    ``fraction``. ``prompt``: the examples whose prompt hash falls in the lowest
    ``fraction`` of the hash range, whatever else is in the data (``auto`` is ``random``
    here; the CLI resolves it)."""
    if mode not in VAL_SPLITS:
        raise ValueError(f"val_split '{mode}' is unknown. Fix: one of {', '.join(VAL_SPLITS)}.")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    if len(examples) < 2:
        return [], order
    if mode != "prompt":
        n_val = max(1, int(len(examples) * fraction))
        return order[:n_val], order[n_val:]
    keys = [prompt_key(ex) for ex in examples]
    chosen = {i for i in order if keys[i] < fraction * 2**64} or {min(order, key=keys.__getitem__)}
    return [i for i in order if i in chosen], [i for i in order if i not in chosen]


def frequent_tokens(examples: list[Example], vocab_size: int, keep: int) -> torch.Tensor:
    """Ids of the ``keep`` most frequent assistant tokens (ties by id), sorted by frequency."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ex in examples:
        counts += torch.bincount(ex.input_ids[ex.loss_mask], minlength=vocab_size)
    return torch.sort(-counts, stable=True).indices[:keep]


def make_batches(
    examples: list[Example], tokens_per_batch: int, rng: random.Random
) -> list[list[int]]:
    """Length-bucketed batches of example indices, shuffled."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].input_ids), rng.random()))
    batches, current, width = [], [], 0
    for i in order:
        n = len(examples[i].input_ids)
        if current and max(width, n) * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, n)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(examples: list[Example], indices: list[int]):
    width = max(len(examples[i].input_ids) for i in indices)
    b = len(indices)
    hidden_size = examples[indices[0]].hidden.shape[-1]
    ids = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.bool)
    feats = torch.zeros(b, width, hidden_size)
    for row, i in enumerate(indices):
        ex = examples[i]
        n = len(ex.input_ids)
        ids[row, :n], mask[row, :n], feats[row, :n] = ex.input_ids, ex.loss_mask, ex.hidden.float()
    return ids, mask, feats


class Trainer:
    # unrolled training-time-test steps when the config leaves them to the head (ttt_steps 0)
    default_ttt_steps = 1

    def __init__(
        self, target: str | Path, examples: list[Example], out_dir: str | Path, config: TrainConfig
    ):
        if config.ttt_steps < 0:
            raise ValueError(
                f"--ttt-steps {config.ttt_steps}: need 1 or more unrolled steps, or 0 for "
                f"the head's default. Fix: e.g. --ttt-steps 3."
            )
        if config.ttt_steps == 0:
            config = replace(config, ttt_steps=self.default_ttt_steps)
        self.cfg = config
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.seed)
        self.target_config, self.embed, lm_head = load_target_embeddings(target)
        if examples and examples[0].hidden.shape[-1] != self.target_config["hidden_size"]:
            raise ValueError("feature cache hidden size does not match the target's")
        val, train = validation_split(examples, config.val_fraction, config.seed, config.val_split)
        self.val = [examples[i] for i in val]
        self.train = [examples[i] for i in train]
        vocab = lm_head.shape[0]
        self.vocab_ids = self.draft_vocabulary(vocab)
        self.target_lm_head = lm_head
        self.lm_head = lm_head[self.vocab_ids].contiguous()
        # full-vocab id -> row of self.lm_head (-1 if not drafted)
        self.row_of = torch.full((vocab,), -1, dtype=torch.int64)
        self.row_of[self.vocab_ids] = torch.arange(len(self.vocab_ids))
        self.model = self.build_model()
        self.warm_start(self.model)
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.step = 0
        self.log_path = self.out / "train_log.jsonl"
        self._resume()

    def draft_vocabulary(self, vocab_size: int) -> torch.Tensor:
        """Target ids the draft's loss covers: the ``ce_vocab`` most frequent assistant
        tokens of the training split (with ``keep_init_vocab``, the warm start's ranking),
        or the whole vocabulary."""
        if self.cfg.keep_init_vocab:
            return self.init_vocabulary(vocab_size)
        if self.cfg.ce_vocab and self.cfg.ce_vocab < vocab_size:
            return frequent_tokens(self.train, vocab_size, self.cfg.ce_vocab)
        return torch.arange(vocab_size)

    def init_vocabulary(self, vocab_size: int) -> torch.Tensor:
        """The ``--init-from`` head's ranked draft vocabulary (its draft_vocab.json; none:
        the whole vocabulary), which must be as long as this run's ``ce_vocab``."""
        from eagle_vllm.models.checkpoint import DRAFT_VOCAB_FILE

        if not self.cfg.init_from:
            raise ValueError(
                "--keep-init-vocab keeps the --init-from head's draft vocabulary. "
                "Fix: add --init-from HEAD, or drop --keep-init-vocab."
            )
        path = Path(self.cfg.init_from) / DRAFT_VOCAB_FILE
        if path.is_file():
            ids = torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.int64)
        else:
            ids = torch.arange(vocab_size)
        check_init_vocab_size(ids, self.cfg, vocab_size, "--keep-init-vocab: ", "ranks")
        if int(ids.max()) >= vocab_size:
            raise ValueError(
                f"--keep-init-vocab: '{path}' holds token ids beyond the target's "
                f"vocabulary of {vocab_size}. Fix: warm-start from a head of this target."
            )
        return ids

    def build_model(self) -> torch.nn.Module:
        return EagleHead(self.target_config, fc_bias=self.cfg.fc_bias)

    def warm_start(self, model: torch.nn.Module) -> None:
        """Load the weights of the exported head ``init_from`` into ``model`` (no-op without).
        Only the weights: the optimiser, schedule and log start anew, so training can go on
        from a shipped or downloaded head with other data or another schedule."""
        if not self.cfg.init_from:
            return
        from safetensors.torch import load_file

        path = Path(self.cfg.init_from) / "model.safetensors"
        if not path.is_file():
            raise ValueError(
                f"--init-from: no '{path}'. Fix: point it at a head folder this trainer "
                "exported (config.json + model.safetensors)."
            )
        weights = self.adapt_warm_start(load_file(str(path)))
        own = model.state_dict()
        wrong = sorted(
            k for k in own.keys() | weights.keys()
            if k not in own or k not in weights or own[k].shape != weights[k].shape
        )  # fmt: skip
        if wrong:
            raise ValueError(
                f"--init-from '{self.cfg.init_from}' does not fit this head: tensors "
                f"{wrong[:6]} are missing, extra or of another shape. Fix: warm-start from a "
                "head of the same --arch and target (and, for eagle3, the same --aux-layers)."
            )
        model.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()})

    def adapt_warm_start(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The exported tensors, named and ordered as ``build_model``'s module holds them."""
        return weights

    def _lr_factor(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        progress = min(1.0, (step - c.warmup_steps) / max(1, c.max_steps - c.warmup_steps))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def _resume(self) -> None:
        state_path = self.out / "state.pt"
        if not state_path.exists():
            return
        state = torch.load(state_path, weights_only=False)
        if state["config"] != asdict(self.cfg):
            changed = {k for k in state["config"] if state["config"][k] != asdict(self.cfg).get(k)}
            harmless = {"max_steps", "max_minutes", "eval_every", "save_every", "log_every",
                        "eval_ttt_steps"}  # fmt: skip
            if changed - harmless:
                raise ValueError(
                    f"'{state_path}' was written with other settings ({sorted(changed)}). "
                    "Fix: rerun with the same settings, or use a new --out folder."
                )
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"])

    def save_state(self) -> None:
        state = {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "step": self.step,
            "rng": torch.get_rng_state(),
            "config": asdict(self.cfg),
        }
        torch.save(state, self.out / "state.pt.tmp")
        (self.out / "state.pt.tmp").rename(self.out / "state.pt")

    def _losses(self, indices: list[int], examples: list[Example], train: bool):
        ids, mask, feats = collate(examples, indices)
        # draft position i: token t_{i+1}, feature f_i -> f̂_{i+1}, whose token is t_{i+2}
        tokens_in, feats_in, f_next = ids[:, 1:], feats[:, :-1], feats[:, 1:]
        if train:
            feats_in = feature_noise(feats_in, self.cfg.noise, self.cfg.noise_scale)
        next_tok = F.pad(ids[:, 2:], (0, 1))
        next_rows = self.row_of[next_tok]
        next_rows[:, -1] = -1  # the last position's next token lies beyond the sequence
        # loss rows j: the input token t_{j+1} is an assistant token
        batch, j = mask[:, 1:].nonzero(as_tuple=True)
        steps = self.cfg.ttt_steps if train else max(self.cfg.ttt_steps, self.cfg.eval_ttt_steps)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16")
        with autocast:
            outputs = self.model.unroll(lambda t: self.embed[t], tokens_in, feats_in, steps)
        # step s scores row j from its output at row j - s (that row's depth-(s+1) draft)
        total, weight_sum, parts = None, 0.0, {}
        for s, f_hat in enumerate(outputs):
            keep = j >= s
            if not bool(keep.any()):
                continue
            rows = (batch[keep], j[keep])
            with autocast:
                step = eagle_loss(
                    f_hat[batch[keep], j[keep] - s],
                    f_next[rows],
                    next_rows[rows],
                    self.lm_head,
                    ce_weight=self.cfg.ce_weight,
                    ce_labels=self.cfg.ce_labels,
                )
            if s == 0:
                parts = {k: v for k, v in step.items() if k != "loss"}
            if s < self.cfg.ttt_steps:
                weighted = self.cfg.ttt_decay**s * step["loss"]
                total = weighted if total is None else total + weighted
                weight_sum += self.cfg.ttt_decay**s
            if steps > 1:
                parts[f"acc_{s + 1}"] = step["acc"].detach()
                parts[f"smooth_l1_{s + 1}"] = step["smooth_l1"]
        if total is None:  # no assistant token to learn from in this batch
            total, weight_sum = feats.new_zeros((), requires_grad=True), 1.0
        parts["loss"] = total / weight_sum
        return parts

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        rng = random.Random(1234)
        totals: dict[str, float] = {}
        count = 0
        for batch in make_batches(self.val, self.cfg.tokens_per_batch, rng):
            parts = self._losses(batch, self.val, train=False)
            for k, v in parts.items():
                totals[k] = totals.get(k, 0.0) + float(v) * len(batch)
            count += len(batch)
        self.model.train()
        return {f"val_{k}": v / max(count, 1) for k, v in totals.items()}

    def fit(self, progress: bool = True) -> dict:
        c = self.cfg
        start = time.time()
        epoch_batches: list[list[int]] = []
        epoch = -1
        self.model.train()
        log = self.log_path.open("a")
        last: dict = {}
        while self.step < c.max_steps:
            # the batch order is a function of (seed, epoch), so a resumed run sees the same data
            batches_per_epoch = len(make_batches(self.train, c.tokens_per_batch, random.Random(0)))
            want_epoch = self.step // max(1, batches_per_epoch)
            if want_epoch != epoch:
                epoch = want_epoch
                epoch_batches = make_batches(
                    self.train, c.tokens_per_batch, random.Random(c.seed * 1000 + epoch)
                )
            batch = epoch_batches[self.step % len(epoch_batches)]
            parts = self._losses(batch, self.train, train=True)
            self.opt.zero_grad(set_to_none=True)
            parts["loss"].backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
            self.opt.step()
            self.sched.step()
            self.step += 1
            row = {
                "step": self.step,
                "epoch": epoch,
                "lr": self.sched.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "elapsed_s": round(time.time() - start, 1),
                **{k: float(v.detach()) for k, v in parts.items()},
            }
            if self.step % c.eval_every == 0 or self.step == c.max_steps:
                row.update(self.evaluate())
            if self.step % c.log_every == 0 or "val_loss" in row or self.step == 1:
                log.write(json.dumps(row) + "\n")
                log.flush()
                if progress:
                    print(
                        " ".join(
                            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items()
                        ),
                        flush=True,
                    )
            last = row
            if self.step % c.save_every == 0:
                self.save_state()
            if c.max_minutes and time.time() - start > c.max_minutes * 60:
                break
        log.close()
        self.save_state()
        return last

    def export(self, dtype: str = "bfloat16") -> Path:
        """Write ``config.json`` + ``model.safetensors`` (SafeAILab layout) into the output folder."""
        from safetensors.torch import save_file

        cfg = dict(self.target_config)
        for key in ("quantization_config", "auto_map", "_name_or_path"):
            cfg.pop(key, None)
        cfg.update(
            architectures=["LlamaForCausalLM"],
            num_hidden_layers=1,
            bias=self.cfg.fc_bias,
            torch_dtype=dtype,
            dtype=dtype,
            tie_word_embeddings=False,
            eagle_vllm={"trained_steps": self.step, "train_config": asdict(self.cfg)},
        )
        (self.out / "config.json").write_text(json.dumps(cfg, indent=2))
        target_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        weights = {
            k: v.detach().to(target_dtype).contiguous() for k, v in self.model.state_dict().items()
        }
        save_file(weights, str(self.out / "model.safetensors"))
        if len(self.vocab_ids) < self.row_of.shape[0]:
            # the CE's token subset, ranked by frequency: the head's reduced draft vocabulary
            write_draft_vocab(self.out, self.vocab_ids)
        return self.out


def check_init_vocab_size(
    ids: torch.Tensor, cfg: TrainConfig, vocab_size: int, prefix: str, verb: str
) -> None:
    """A warm start's draft vocabulary ``ids`` must be as long as this run's ``ce_vocab``
    (0 or at least the vocabulary: all of it)."""
    wanted = cfg.ce_vocab if 0 < cfg.ce_vocab < vocab_size else vocab_size
    if len(ids) != wanted:
        raise ValueError(
            f"{prefix}'{cfg.init_from}' {verb} {len(ids)} tokens, this run "
            f"--ce-vocab {cfg.ce_vocab} (0: the whole vocabulary). Fix: pass "
            f"--ce-vocab {len(ids) if len(ids) < vocab_size else 0}."
        )


def write_draft_vocab(out: Path, token_ids: torch.Tensor) -> None:
    """The frequency-ranked token ids a config's ``draft_vocab: N`` drafts the first N of."""
    from eagle_vllm.models.checkpoint import DRAFT_VOCAB_FILE

    (out / DRAFT_VOCAB_FILE).write_text(
        json.dumps(
            {
                "token_ids": token_ids.tolist(),
                "ranked_by": "assistant-token frequency in the training data",
            }
        )
    )


def plot_curves(log_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key in zip(axes, ("loss", "smooth_l1", "acc")):
        ax.plot(steps, [r[key] for r in rows], label=f"train {key}", alpha=0.6)
        val = [(r["step"], r[f"val_{key}"]) for r in rows if f"val_{key}" in r]
        if val:
            ax.plot(*zip(*val), "o-", label=f"val {key}" + (", step 1" if key == "acc" else ""))
        for s in range(2, 9) if key == "acc" else ():  # the unrolled steps' agreement
            deeper = [(r["step"], r[f"val_acc_{s}"]) for r in rows if f"val_acc_{s}" in r]
            if deeper:
                ax.plot(*zip(*deeper), "o-", label=f"val acc, step {s}")
        ax.set_xlabel("step")
        ax.set_title(key if key != "acc" else "top-1 agreement with the target")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
