"""Teacher-forced agreement of EAGLE-3 heads with the target on the evaluation prompts.

    .venv/bin/python benchmarks/head_agreement.py \\
        --heads heads/smollm2-135m-instruct-eagle3 --out benchmarks/results/head-agreement-cpu

The target (vLLM, fp32, greedy) answers the first ``--prompts`` prompts of each dataset
(the prompts and lengths of ``head_tau.py``). Each head then reads the target's features
of those answers, as training does, and is scored per unrolled step exactly like the
training's validation split: the share of answer positions where its argmax is the
target's, among positions whose target token it can draft (``acc``), and how many those
are (``in vocab``; a head with a ``d2t`` map drafts only its rows). ``acc x in vocab`` at
step 1 is what a chain's first draft would accept if drafting reproduced training
exactly, to set beside ``head_tau.py``'s measured depth-1 acceptance: close figures put a
gap between validation and acceptance down to the prompts (the head generalising), far
ones to how the head is run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import command_line, load_prompts, write_results  # noqa: E402


def target_answers(target: str, datasets: list[str], n: int, max_tokens: int) -> dict:
    """dataset -> [(prompt ids, answer ids)]: the target's greedy answers, fp32, one engine."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    llm = LLM(target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    answers = {}
    for dataset in datasets:
        prompts = load_prompts(dataset, n, llm.get_tokenizer())
        outs = llm.generate(prompts, params, use_tqdm=False)
        answers[dataset] = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    return answers


def score_head(target: str, head: Path, examples: list, work: Path) -> dict:
    """Validation metrics of ``head`` over ``examples`` (all of them), with the share of
    answer positions whose target token the head can draft."""
    import torch
    from draft_vocab_coverage import draft_token_ids

    from eagle_vllm.train.eagle3 import Eagle3Trainer
    from eagle_vllm.train.trainer import TrainConfig

    config = json.loads((head / "config.json").read_text())
    layers = tuple(config["eagle_aux_hidden_state_layer_ids"])
    ids = draft_token_ids(head)
    cfg = TrainConfig(
        ce_vocab=0 if ids is None else len(ids), share_lm_head=ids is None, ttt_steps=1,
        eval_ttt_steps=4, noise="none", val_fraction=0.5, init_from=str(head),
    )  # fmt: skip
    trainer = Eagle3Trainer(target, examples, work, cfg, layers)
    trainer.val = examples
    metrics = trainer.evaluate()
    labels = torch.cat([trainer._target_argmax(ex) for ex in examples])
    in_vocab = float((trainer.row_of[labels] >= 0).float().mean())
    return {"in_vocab": in_vocab, **metrics}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--heads", default=str(ROOT / "heads/smollm2-135m-instruct-eagle3"),
                   help="comma-separated EAGLE-3 head folders")  # fmt: skip
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--work", default=str(ROOT / "artifacts/head-agreement"),
                   help="feature caches and scratch (reused when the answers match)")  # fmt: skip
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    from eagle_vllm.train.features import extract_features, load_features
    from eagle_vllm.train.tokenize import TokenizedConversation

    heads = [Path(h) for h in args.heads.split(",") if h]
    layer_sets = {
        tuple(json.loads((h / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"])
        for h in heads
    }
    import torch

    datasets = args.datasets.split(",")
    every_answer = target_answers(args.target, datasets, args.prompts, args.max_tokens)
    rows = []
    for dataset in datasets:
        answers = every_answer[dataset]
        convs = []
        for prompt, answer in answers:
            ids = torch.tensor(prompt + answer, dtype=torch.int64)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(prompt) :] = True
            convs.append(TokenizedConversation(ids, mask))
        for layers in layer_sets:
            cache = extract_features(
                args.target, convs, Path(args.work) / f"{dataset}-{'-'.join(map(str, layers))}",
                dtype="float32", layers=layers, progress=False,
            )  # fmt: skip
            examples = load_features(cache)
            for head in heads:
                config = json.loads((head / "config.json").read_text())
                if tuple(config["eagle_aux_hidden_state_layer_ids"]) != layers:
                    continue
                scores = score_head(args.target, head, examples, Path(args.work) / "scratch")
                row = {"dataset": dataset, "head": str(head),
                       "tokens": sum(len(a) for _, a in answers), **scores}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        lines = [
            "# Teacher-forced agreement of EAGLE-3 heads on the evaluation prompts",
            "",
            f"`{command_line('benchmarks/head_agreement.py', argv)}`",
            "",
            "The target's greedy fp32 answers (first "
            f"{args.prompts} prompts, {args.max_tokens} tokens); acc at unrolled step s over "
            "answer positions whose target token the head can draft; in vocab: their share.",
            "",
            "| dataset | head | tokens | in vocab | acc step 1, 2, 3, 4 | acc x in vocab, step 1 |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            accs = ", ".join(f"{r[f'val_acc_{s}']:.3f}" for s in range(1, 5))
            lines.append(f"| {r['dataset']} | {r['head']} | {r['tokens']} | {r['in_vocab']:.3f} "
                         f"| {accs} | {r['val_acc_1'] * r['in_vocab']:.3f} |")  # fmt: skip
        write_results(args.out, args, rows, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
