"""How much of the target's own output a reduced draft vocabulary can draft at all.

    .venv/bin/python benchmarks/draft_vocab_coverage.py \\
        --head heads/smollm2-135m-instruct-eagle3 --out benchmarks/results/draft-vocab-coverage-cpu

An EAGLE-3 head with a ``d2t`` map drafts only the target ids of its LM-head rows. A token
outside them is never drafted, whatever the head's quality, so the share of the target's
greedy output tokens inside the draft vocabulary bounds the acceptance at every depth. It
is reported per dataset (the prompts and lengths of ``head_tau.py``), with the most frequent
tokens the draft vocabulary misses: mostly names and identifiers copied from the prompt.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import command_line, load_prompts, write_results  # noqa: E402


def draft_token_ids(head: Path) -> set[int] | None:
    """Target ids a head can draft (None: the whole vocabulary, no ``d2t``)."""
    from safetensors import safe_open

    with safe_open(str(head / "model.safetensors"), "pt") as f:
        if "d2t" not in f.keys():
            return None
        d2t = f.get_tensor("d2t")
    return set((d2t + torch.arange(len(d2t))).tolist())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--head", default=str(ROOT / "heads/smollm2-135m-instruct-eagle3"))
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--top-missing", type=int, default=12)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    ids = draft_token_ids(Path(args.head))
    if ids is None:
        raise SystemExit(f"error: '{args.head}' has no d2t map: it drafts the whole vocabulary")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    llm = LLM(args.target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for dataset in args.datasets.split(","):
        prompts = load_prompts(dataset, args.prompts, tokenizer)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [t for out in outputs for t in out.outputs[0].token_ids]
        missing = Counter(t for t in tokens if t not in ids)
        rows.append({
            "dataset": dataset,
            "tokens": len(tokens),
            "coverage": 1 - sum(missing.values()) / len(tokens),
            "distinct_missing": len(missing),
            "top_missing": [[tokenizer.decode([t]), n]
                            for t, n in missing.most_common(args.top_missing)],
        })  # fmt: skip
        print(f"{dataset:9s} {rows[-1]['coverage']:.3f} of {len(tokens)} tokens", flush=True)
    lines = [
        f"# Target output inside the draft vocabulary of {Path(args.head).name} "
        f"({len(ids)} tokens)",
        "",
        f"`{command_line('benchmarks/draft_vocab_coverage.py', argv)}`",
        "",
        f"Greedy, fp32, {args.prompts} prompts x {args.max_tokens} tokens per dataset.",
        "",
        "| dataset | output tokens | inside the draft vocabulary | distinct tokens outside "
        "| most frequent outside (count) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        top = ", ".join(f"`{tok!r}` {n}" for tok, n in r["top_missing"])
        lines.append(
            f"| {r['dataset']} | {r['tokens']} | {r['coverage']:.3f} | "
            f"{r['distinct_missing']} | {top} |"
        )
    if args.out:
        write_results(args.out, args, rows, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
