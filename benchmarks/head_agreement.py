"""Teacher-forced agreement of EAGLE heads with the target on the evaluation prompts.

    .venv/bin/python benchmarks/head_agreement.py \\
        --heads heads/smollm2-135m-instruct-eagle3 --out benchmarks/results/head-agreement-cpu
    .venv/bin/python benchmarks/head_agreement.py --prompts 80 --datasets mtbench \\
        --heads heads/smollm2-135m-instruct-eagle,artifacts/eagle1-stage3

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

An EAGLE-1 head (no ``eagle_aux_hidden_state_layer_ids`` in its config) is scored at
unrolled steps 1-4 (the depth-1 draft from the target's feature, then each deeper node
from the head's own, as it drafts a tree), drafting over the ``--draft-vocab`` most
frequent tokens of its ``draft_vocab.json`` as the shipped configs serve it
(``draft_vocab: 4096``). Its depth-1 agreement over 80 MT-bench answers (about 10K positions, paired across heads) is
a minute's comparison of two heads where an engine A/B takes a quarter of an hour.

``--context-vocab`` also scores each EAGLE-1 head drafting as the shipped configs do by
default (``draft_vocab_context``; rows marked ``+context``): over the ``--draft-vocab``
frequent tokens plus every token of the conversation before the drafted one (prompt and
answer so far).

``--int8 engine,engine+fc,engine+head,engine-7bit`` also scores each EAGLE-1 head with
GEMMs in int8 (``draft_dtype: int8``, ``models/draft_precision.py``): ``engine`` as the
plugin runs it (the decoder layer in int8, the feature fc and the LM head in float),
``engine+fc`` / ``engine+head`` with the fc / the draft LM head in int8 too,
``engine-7bit`` with 7-bit inputs (what x86 CPUs without VNNI use).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import command_line, load_prompts, write_results  # noqa: E402


def head_layers(head: Path) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head reads (None: an EAGLE-1 head)."""
    config = json.loads((head / "config.json").read_text())
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    return None if layers is None else tuple(layers)


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


# Drafts a one-pass tree takes from the root at batch 1 (the sizer's usual 1,4 arm).
RECALL_TOPK = 3
# Unrolled steps an EAGLE-1 head is scored at (the training-time test's, each step a
# draft node one deeper, fed the head's own features and the true tokens)
UNROLLED_STEPS = 4


INT8_VARIANTS = {  # name -> (fc in int8, LM head in int8, 7-bit inputs)
    "engine": (False, False, False),
    "engine+fc": (True, False, False),
    "engine+head": (False, True, False),
    "engine-7bit": (False, False, True),
}


def _int8_head(model, variant: str) -> None:
    """Swap ``model``'s linear layers for int8 ones as ``variant`` says (in place)."""
    import torch

    from eagle_vllm.models.draft_precision import Int8Gemm

    with_fc, _, reduce_range = INT8_VARIANTS[variant]
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and (with_fc or name != "fc"):
                child.forward = Int8Gemm(child.weight, child.bias, reduce_range=reduce_range)


def score_eagle1_head(
    target: str,
    head: Path,
    examples: list,
    work: Path,
    draft_vocab: int,
    int8: str = "",
    context: bool = False,
) -> dict:
    """Agreement of EAGLE-1 ``head`` over the answer positions of ``examples``: its argmax
    over its first ``draft_vocab`` tokens (0: all) against the target's token at each
    unrolled step (``val_acc_1`` .. ``val_acc_4``: the node at that depth, its ancestors
    the true tokens), and how often the depth-1 token is among its ``RECALL_TOPK`` best
    (``recall_top3``: what a one-pass tree of 3 drafts can accept). Each step's share is
    over every answer position (a position less than s tokens into the sequence has no
    depth-s draft and counts as missed; answers are long enough for this to be rare). ``int8``: one of
    ``INT8_VARIANTS`` (the head's GEMMs in int8), or empty. ``context``: each position
    also drafts the tokens of the conversation before the drafted one."""
    import torch

    from eagle_vllm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(target, [], work, TrainConfig(ce_vocab=0, noise="none",
                                                    init_from=str(head)))  # fmt: skip
    vocab = torch.arange(trainer.target_lm_head.shape[0])
    if draft_vocab:
        ranked = json.loads((head / "draft_vocab.json").read_text())["token_ids"]
        vocab = torch.tensor(ranked[:draft_vocab], dtype=torch.int64)
    lm_head = trainer.target_lm_head[vocab]
    logits_of = lambda f: f @ lm_head.T  # noqa: E731
    if int8:
        from eagle_vllm.models.draft_precision import Int8Gemm

        _int8_head(trainer.model, int8)
        _, int8_lm_head, reduce_range = INT8_VARIANTS[int8]
        if int8_lm_head:
            logits_of = Int8Gemm(lm_head, reduce_range=reduce_range)
    agree = [0] * UNROLLED_STEPS
    recalled = in_vocab = positions = 0
    trainer.model.eval()
    with torch.no_grad():
        for ex in examples:
            ids, hidden = ex.input_ids, ex.hidden.float()
            # draft position j reads token j+1 and feature j, and predicts token j+2; the
            # unrolled step s drafts it from row j - s (the depth-(s+1) node under it)
            tokens_in, feats_in = ids[None, 1:-1], hidden[None, :-2]
            outputs = trainer.model.unroll(
                lambda t: trainer.embed[t], tokens_in, feats_in, UNROLLED_STEPS
            )
            scored = ex.loss_mask[1:-1]
            rows_at = torch.nonzero(scored).flatten()
            wanted = ids[2:][scored]
            allowed = None
            if context:  # row j drafts token j+2 over the vocabulary and tokens 0..j+1
                allowed = torch.zeros(len(rows_at), len(trainer.target_lm_head),
                                      dtype=torch.bool)  # fmt: skip
                allowed[:, vocab] = True
                earlier = torch.arange(len(ids))[None, :] < rows_at[:, None] + 2
                row, col = torch.nonzero(earlier, as_tuple=True)
                allowed[row, ids[col]] = True
                in_vocab += int(allowed.gather(1, wanted[:, None]).sum())
            else:
                in_vocab += int(torch.isin(wanted, vocab).sum())
            for step, f_hat in enumerate(outputs):
                keep = rows_at >= step
                f_rows = f_hat[0, rows_at[keep] - step]
                if allowed is not None:
                    logits = f_rows @ trainer.target_lm_head.T
                    masked = logits.masked_fill(~allowed[keep], float("-inf"))
                    drafted = masked.topk(RECALL_TOPK, dim=-1).indices
                else:
                    drafted = vocab[logits_of(f_rows).topk(RECALL_TOPK, dim=-1).indices]
                agree[step] += int((drafted[:, 0] == wanted[keep]).sum())
                if step == 0:
                    recalled += int((drafted == wanted[:, None]).any(-1).sum())
            positions += int(scored.sum())
    return {
        "in_vocab": in_vocab / positions,
        **{f"val_acc_{s + 1}": a / positions for s, a in enumerate(agree)},
        "recall_top3": recalled / positions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--heads", default=str(ROOT / "heads/smollm2-135m-instruct-eagle3"),
                   help="comma-separated EAGLE-1 or EAGLE-3 head folders")  # fmt: skip
    p.add_argument("--draft-vocab", type=int, default=4096,
                   help="EAGLE-1 heads draft over this many tokens (0: all)")  # fmt: skip
    p.add_argument("--context-vocab", action="store_true",
                   help="EAGLE-1 heads also draft every earlier token of the conversation")  # fmt: skip
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--work", default=str(ROOT / "artifacts/head-agreement"),
                   help="feature caches and scratch (reused when the answers match)")  # fmt: skip
    p.add_argument("--int8", default="",
                   help="also score EAGLE-1 heads with int8 GEMMs: comma-separated "
                        f"variants among {', '.join(INT8_VARIANTS)}")  # fmt: skip
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    from eagle_vllm.train.features import extract_features, load_features
    from eagle_vllm.train.tokenize import TokenizedConversation

    heads = [Path(h) for h in args.heads.split(",") if h]
    int8 = [v for v in args.int8.split(",") if v]
    if unknown := [v for v in int8 if v not in INT8_VARIANTS]:
        raise SystemExit(f"error: --int8: unknown {unknown}; use {', '.join(INT8_VARIANTS)}")
    if args.context_vocab and any(INT8_VARIANTS[v][1] for v in int8):
        raise SystemExit("error: --context-vocab scores the LM head in float; drop engine+head")
    layers_of = {h: head_layers(h) for h in heads}
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
        # one cache per set of answers: another prompt count or order is another cache
        digest = hashlib.sha1(json.dumps(answers).encode()).hexdigest()[:10]
        for layers in dict.fromkeys(layers_of.values()):
            name = "last" if layers is None else "-".join(map(str, layers))
            cache = extract_features(
                args.target, convs, Path(args.work) / f"{dataset}-{name}-{digest}",
                dtype="float32", layers=layers, progress=False,
            )  # fmt: skip
            examples = load_features(cache)
            for head in (h for h in heads if layers_of[h] == layers):
                scratch = Path(args.work) / ("scratch" if layers else "scratch-eagle1")
                variants = [("", False)]
                if layers is None:
                    variants += [(v, False) for v in int8]
                    variants += [("", True)] if args.context_vocab else []
                for variant, context in variants:
                    if layers is None:
                        scores = score_eagle1_head(args.target, head, examples, scratch,
                                                   args.draft_vocab, variant, context)  # fmt: skip
                    else:
                        scores = score_head(args.target, head, examples, scratch)
                    name = f"{head} (int8 {variant})" if variant else str(head)
                    name += " (+context)" if context else ""
                    row = {"dataset": dataset, "head": name,
                           "tokens": sum(len(a) for _, a in answers), **scores}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        lines = [
            "# Teacher-forced agreement of EAGLE heads on the evaluation prompts",
            "",
            f"`{command_line('benchmarks/head_agreement.py', argv)}`",
            "",
            "The target's greedy fp32 answers (first "
            f"{args.prompts} prompts, {args.max_tokens} tokens); acc at unrolled step s over "
            "answer positions whose target token the head can draft; in vocab: their share. "
            f"EAGLE-1 heads: over all answer positions, drafting over "
            f"{args.draft_vocab or 'all'} tokens (+context: and every earlier token of the "
            "conversation), with how often the target's token at step 1 is among "
            "the head's 3 best (what a one-pass tree of 3 drafts can accept).",
            "",
            "| dataset | head | tokens | in vocab | acc step 1, 2, 3, 4 | acc x in vocab, step 1 |",
            "|---|---|---|---|---|---|",
        ]
        lines += [table_row(r) for r in rows]
        write_results(args.out, args, rows, "\n".join(lines) + "\n")
    return 0


def table_row(r: dict) -> str:
    """One head's markdown row: agreement per unrolled step, and step 1's over every
    answer position (an EAGLE-1 head's agreement already counts the positions it cannot
    draft, and comes with its top-3 recall)."""
    accs = ", ".join(f"{r[f'val_acc_{s}']:.3f}" for s in range(1, 5))
    if "recall_top3" in r:  # EAGLE-1
        accs += f" (top-3 {r['recall_top3']:.3f})"
        first = r["val_acc_1"]
    else:
        first = r["val_acc_1"] * r["in_vocab"]
    return (f"| {r['dataset']} | {r['head']} | {r['tokens']} | {r['in_vocab']:.3f} "
            f"| {accs} | {first:.3f} |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
