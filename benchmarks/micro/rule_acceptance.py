"""Which verification rule accepts more at T=1? First-draft acceptance on real (p, q) pairs.

    .venv/bin/python benchmarks/micro/rule_acceptance.py heads/smollm2-135m-instruct-eagle \
        [--features heads/smollm2-135m-instruct-eagle/features] [--topk 4]

For every assistant token of the validation conversations held out in training
(the trainer's own split), q is the head's distribution for the next token from
the target's true feature (what the first draft step sees at inference, over the
head's drafting vocabulary) and p the target's, at temperature 1. Exact
acceptance probabilities of the first draft position, averaged over positions:

* chain, argmax draft, deterministic rule (the plugin's ``eagle``):  p(argmax q)
* chain, draft sampled from q, speculative sampling:                 sum_x min(p, q)
* tree, top-k children, deterministic rule (the plugin's ``eagle2``): sum_{x in topk q} p(x)
* tree, k children sampled i.i.d. from q, SpecInfer (recursive rejection with
  residual updates): 1 - prod_i (1 - sum_x min(r_i, q)), r_0 = p,
  r_{i+1} = norm(max(r_i - q, 0)); the residual does not depend on the rejected
  draw, so this is exact.

Depth 1 dominates tau for heads whose deeper acceptance is small (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def rule_acceptance(p: torch.Tensor, q: torch.Tensor, topk: int) -> dict[str, torch.Tensor]:
    """Per-position acceptance of the first draft; ``p`` and ``q`` ``[N, V]`` over one vocabulary."""
    top = q.topk(topk, dim=-1).indices
    out = {
        "chain_argmax": p.gather(1, q.argmax(-1, keepdim=True))[:, 0],
        "chain_sampled": torch.minimum(p, q).sum(-1),
        f"tree_top{topk}": p.gather(1, top).sum(-1),
    }
    residual, rejected = p.clone(), torch.ones(p.shape[0], dtype=p.dtype)
    for _ in range(topk):
        accept = torch.minimum(residual, q).sum(-1)
        rejected = rejected * (1 - accept)
        residual = (residual - q).clamp(min=0)
        residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
    out[f"tree_specinfer{topk}"] = 1 - rejected
    return out


@torch.no_grad()
def measure(head_dir: Path, features_dir: Path, target: Path, topk: int, max_positions: int):
    from safetensors.torch import load_file

    from eagle_vllm.train.features import load_features
    from eagle_vllm.train.trainer import TrainConfig, Trainer, collate

    args = json.loads((head_dir / "train_args.json").read_text())
    config = TrainConfig(seed=args["seed"], val_fraction=args["val_fraction"], ce_vocab=0)
    trainer = Trainer(target, load_features(features_dir), Path("/tmp/rule_acceptance"), config)
    state = {k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    trainer.model.load_state_dict(state)
    trainer.model.eval()
    full_head = trainer.lm_head  # ce_vocab=0: every row
    ids_file = head_dir / "draft_vocab.json"
    draft_ids = (
        torch.tensor(json.loads(ids_file.read_text())["token_ids"])
        if ids_file.exists()
        else torch.arange(full_head.shape[0])
    )
    sums: dict[str, float] = {}
    count = 0
    for i in range(len(trainer.val)):
        ids, mask, feats = collate(trainer.val, [i])
        tokens_in, feats_in, f_next = ids[:, 1:], feats[:, :-1], feats[:, 1:]
        positions = torch.arange(tokens_in.shape[1])[None, :]
        f_hat = trainer.model(trainer.embed[tokens_in], feats_in, positions)
        sel = mask[:, 1:].nonzero(as_tuple=True)
        p = torch.softmax(f_next[sel] @ full_head.T, dim=-1)[:, draft_ids]  # q is 0 elsewhere
        q = torch.softmax(f_hat[sel] @ full_head[draft_ids].T, dim=-1)
        for name, values in rule_acceptance(p.double(), q.double(), topk).items():
            sums[name] = sums.get(name, 0.0) + float(values.sum())
        count += p.shape[0]
        if count >= max_positions:
            break
    return {name: total / count for name, total in sums.items()}, count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("heads", nargs="+", help="head folders (eagle-vllm train outputs)")
    ap.add_argument("--features", default=str(ROOT / "heads/smollm2-135m-instruct-eagle/features"))
    ap.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--max-positions", type=int, default=20000)
    args = ap.parse_args(argv)
    for head in args.heads:
        result, n = measure(
            Path(head), Path(args.features), Path(args.target), args.topk, args.max_positions
        )
        cells = ", ".join(f"{k} {v:.3f}" for k, v in result.items())
        print(f"{Path(head).name} ({n} positions, T=1): {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
