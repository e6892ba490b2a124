"""What an EAGLE-3 training step costs, lever by lever (``eagle-vllm train --arch eagle3``).

    .venv/bin/python benchmarks/train_cost.py --target models/SmolLM2-135M-Instruct \\
        --out benchmarks/results/train-cost-cpu

One optimizer step of ``Eagle3Trainer`` (training-time test forward, backward, AdamW) on
synthetic batches shaped like the training data: ``--seq-len`` tokens per conversation of
which ``--assistant-fraction`` are assistant tokens (the loss rows), ``--tokens-per-batch``
per step, with the target's real embedding and LM head. Each configuration changes one
lever from the base (draft vocabulary 8192, k=3 unrolled steps, trainable LM head, no
extra terms): the draft vocabulary, k, a frozen LM head, the target's own LM head over
the whole vocabulary (``--share-lm-head``), that with a sampled softmax
(``--lm-head-sample``), the HASS-style top-K term, the feature term.
``dense`` is the same base step with every position scored (both LM heads and the
softmaxes over all rows, prompt and padding included), the form the loss rows replace. Reported: median seconds per step over ``--reps`` timed steps after one warm-up,
and thousands of tokens per second. Timings need an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle_vllm.train.eagle3 import (  # noqa: E402
    Eagle3Trainer,
    collate_eagle3,
    default_aux_layers,
    target_distributions,
    ttt_losses,
)
from eagle_vllm.train.features import Example  # noqa: E402
from eagle_vllm.train.trainer import TrainConfig  # noqa: E402

LEVERS = {  # name -> TrainConfig changes from the base
    "base": {},  # draft vocabulary 8192, k=3, trainable LM head, no extra terms
    "dense": {},  # the base with every row scored
    "vocab-4096": {"ce_vocab": 4096},
    "vocab-16384": {"ce_vocab": 16384},
    "k5": {"ttt_steps": 5},
    "k7": {"ttt_steps": 7},
    "frozen-lm-head": {"ttt_freeze_lm_head": True},
    # the whole vocabulary through the target's frozen LM head (--share-lm-head)
    "shared-lm-head": {"ce_vocab": 0, "share_lm_head": True},
    # the same, its softmaxes over the 8192 most frequent tokens plus the batch's own
    # tokens and the target's argmaxes (--lm-head-sample 8192)
    "shared-lm-head-sampled": {"ce_vocab": 0, "share_lm_head": True, "lm_head_sample": 8192},
    "topk-term": {"ttt_topk_weight": 0.5},  # HASS-style, K=10
    "feature-term": {"ttt_feature_weight": 0.1},
}


def synthetic_examples(hidden: int, vocab: int, num: int, seq_len: int, assistant: float,
                       num_aux: int) -> list[Example]:  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompt = int(round(seq_len * (1 - assistant)))
    # token ids Zipf-distributed over a shuffled vocabulary, as text is: how many distinct
    # tokens a batch holds sets the sampled softmax's width
    ranked = torch.randperm(vocab, generator=gen)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    examples = []
    for _ in range(num):
        mask = torch.zeros(seq_len, dtype=torch.bool)
        mask[prompt:] = True
        examples.append(
            Example(
                input_ids=ranked[torch.multinomial(zipf, seq_len, True, generator=gen)],
                loss_mask=mask,
                hidden=torch.randn(seq_len, hidden, generator=gen).to(torch.bfloat16),
                aux=torch.randn(seq_len, num_aux * hidden, generator=gen).to(torch.bfloat16),
            )
        )
    return examples


def dense_losses(trainer: Eagle3Trainer, indices: list[int], examples: list[Example]):
    """The step with every position scored, masks applied afterwards."""
    ids, mask, aux, last = collate_eagle3(examples, indices)
    b, n = ids.shape
    logp, _, column = target_distributions(
        last[:, 1:].reshape(-1, last.shape[-1]), trainer.target_lm_head, trainer.vocab_ids
    )
    logits = trainer.model.unroll(lambda t: trainer.embed[t], ids, aux, trainer.cfg.ttt_steps)
    return ttt_losses(
        [x[:, : n - 1] for x in logits], logp.view(b, n - 1, -1), column.view(b, n - 1),
        mask[:, 1:], decay=trainer.cfg.ttt_decay,
    )  # fmt: skip


def time_steps(trainer: Eagle3Trainer, examples: list[Example], batch: list[int], reps: int,
               dense: bool) -> list[float]:  # fmt: skip
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        parts = (dense_losses(trainer, batch, examples) if dense
                 else trainer._losses(batch, examples, train=True))  # fmt: skip
        trainer.opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        trainer.opt.step()
        if rep:  # the first step warms up allocators and AdamW state
            times.append(time.perf_counter() - start)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--assistant-fraction", type=float, default=0.6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--levers", default="", help="comma-separated names (default: all)")
    p.add_argument("--out", default="", help="write <out>.json and <out>.md")
    args = p.parse_args()

    config = json.loads((Path(args.target) / "config.json").read_text())
    aux_layers = default_aux_layers(config["num_hidden_layers"])
    per_batch = max(1, args.tokens_per_batch // args.seq_len)
    examples = synthetic_examples(config["hidden_size"], config["vocab_size"], per_batch + 2,
                                  args.seq_len, args.assistant_fraction, len(aux_layers))  # fmt: skip
    base = TrainConfig(ce_vocab=8192, ttt_steps=3, noise="none", val_fraction=0.01,
                       tokens_per_batch=args.tokens_per_batch)  # fmt: skip
    chosen = [x.strip() for x in args.levers.split(",") if x.strip()] or list(LEVERS)
    rows = []
    import tempfile

    for name in chosen:
        cfg = replace(base, **LEVERS[name])
        with tempfile.TemporaryDirectory() as out:
            trainer = Eagle3Trainer(args.target, examples, out, cfg, aux_layers)
            batch = list(range(len(trainer.train)))[:per_batch]
            times = time_steps(trainer, trainer.train, batch, args.reps, name == "dense")
        tokens = sum(len(trainer.train[i].input_ids) for i in batch)
        median = statistics.median(times)
        rows.append({"lever": name, "s_per_step": median, "tokens": tokens,
                     "ktok_per_s": tokens / median / 1000, "times": times})  # fmt: skip
        print(f"{name:16s} {median:7.2f} s/step  {tokens / median / 1000:6.2f} ktok/s", flush=True)
    if args.out:
        meta = {"target": args.target, "tokens_per_batch": args.tokens_per_batch,
                "seq_len": args.seq_len, "assistant_fraction": args.assistant_fraction,
                "reps": args.reps, "threads": torch.get_num_threads()}  # fmt: skip
        Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        base_s = rows[0]["s_per_step"]
        lines = [
            "# EAGLE-3 training step cost per lever",
            "",
            f"`python benchmarks/train_cost.py --out {args.out}`: {meta}",
            "",
            "| lever | s/step | ktok/s | vs first row |",
            "|---|---|---|---|",
        ]
        for r in rows:
            lines.append(f"| {r['lever']} | {r['s_per_step']:.2f} | {r['ktok_per_s']:.2f} | "
                         f"{r['s_per_step'] / base_s:.2f}x |")  # fmt: skip
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
