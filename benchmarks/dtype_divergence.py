"""Greedy outputs of speculative systems against vanilla vLLM's, per dtype.

    .venv/bin/python benchmarks/dtype_divergence.py --out benchmarks/results/dtype-divergence-cpu

In float32 every lossless system must reproduce vanilla's greedy tokens exactly (the test
suite asserts it on tiny models; this checks the real target). In bfloat16 a verify
forward scores several tokens at once, and a multi-token matrix product rounds
differently from one token's, so a near-tie between the top two tokens can flip: stock
vLLM's own speculation diverges too. Per system and dtype this counts the outputs
identical to vanilla's (same dtype, same batch), and where the others first differ.

Each system runs in its own process (one engine per dtype); the prompts (MT-bench first
turns and HumanEval) run as one batch of ``--batch`` requests at a time.

``--margins`` (after a run, reading OUT.json): at each first difference, vanilla's own
log-probabilities (one prefill of the prompt and vanilla's tokens so far, in that dtype)
of vanilla's token and of the system's. A gap of a bf16 step or two is a near-tie that
rounding flips; a large one would be a bug.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DEFAULT_AUTO_CONFIG,
    DEFAULT_EAGLE_CONFIG,
    DEFAULT_HEAD,
    DEFAULT_TARGET,
    ROOT,
    build_engine,
    check_systems,
    command_line,
    engine_kwargs,
    load_prompts,
    run_as_worker,
    run_systems,
    shutdown,
    write_results,
)

SCRIPT = "benchmarks/dtype_divergence.py"
SYSTEMS = ("vanilla", "ngram", "vllm-eagle", "eagle", "eagle2-auto")


def run_worker(system: str, args) -> list[dict]:
    """Greedy outputs of one system at every dtype: one row per (dtype, dataset, prompt)."""
    from vllm import SamplingParams

    rows = []
    for dtype in args.dtypes:
        llm = build_engine(system, args, **engine_kwargs(dtype, args.batch, log_stats=False))
        tokenizer = llm.get_tokenizer()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        for dataset in args.datasets:
            prompts = load_prompts(dataset, args.prompts, tokenizer)
            for start in range(0, len(prompts), args.batch):
                outs = llm.generate(prompts[start : start + args.batch], params, use_tqdm=False)
                for i, out in enumerate(outs):
                    rows.append({"system": system, "dtype": dtype, "dataset": dataset,
                                 "prompt": start + i,
                                 "tokens": list(out.outputs[0].token_ids)})  # fmt: skip
        shutdown(llm)
        del llm
    return rows


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarise(rows: list[dict], args, command: str) -> str:
    reference = {
        (r["dtype"], r["dataset"], r["prompt"]): r["tokens"]
        for r in rows
        if r["system"] == "vanilla"
    }
    lines = [
        "# Greedy outputs against vanilla vLLM's, per dtype",
        "",
        f"Command: `{command}`",
        "",
        f"{args.prompts} prompts per dataset ({', '.join(args.datasets)}), {args.max_tokens} "
        f"tokens, batches of {args.batch}, T=0. Identical: outputs equal to vanilla's of the "
        "same dtype, token for token; first difference: the token index where the others "
        "first differ (median [min-max]).",
        "",
        "| dtype | system | identical | first difference |",
        "|---|---|---|---|",
    ]
    for dtype in args.dtypes:
        for system in args.systems:
            if system == "vanilla":
                continue
            mine = [r for r in rows if r["system"] == system and r["dtype"] == dtype]
            diffs = [
                first_difference(r["tokens"], reference[(dtype, r["dataset"], r["prompt"])])
                for r in mine
            ]
            split = [d for d in diffs if d is not None]
            where = f"{statistics.median(split):g} [{min(split)}-{max(split)}]" if split else "-"
            lines.append(
                f"| {dtype} | {system} | {len(mine) - len(split)} / {len(mine)} | {where} |"
            )
    return "\n".join(lines) + "\n"


def _logprob(logprobs: dict, token: int) -> str:
    return f"{logprobs[token].logprob:.3f}" if token in logprobs else "< top 20"


def margins(args) -> str:
    """Vanilla's log-probabilities of both tokens at every first difference (``--margins``)."""
    import json

    import vllm
    from vllm import SamplingParams

    rows = json.loads(Path(args.out + ".json").read_text())["rows"]
    reference = {(r["dtype"], r["dataset"], r["prompt"]): r["tokens"]
                 for r in rows if r["system"] == "vanilla"}  # fmt: skip
    lines = ["| dtype | system | dataset, prompt | token | logprob of vanilla's | of the system's |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for dtype in args.dtypes:
        llm = vllm.LLM(args.target, **engine_kwargs(dtype, 1, log_stats=False))
        tokenizer = llm.get_tokenizer()
        prompts = {d: load_prompts(d, args.prompts, tokenizer) for d in args.datasets}
        for r in rows:
            if r["dtype"] != dtype or r["system"] == "vanilla":
                continue
            theirs = reference[(dtype, r["dataset"], r["prompt"])]
            at = first_difference(r["tokens"], theirs)
            if at is None or at >= min(len(r["tokens"]), len(theirs)):
                continue
            prompt = prompts[r["dataset"]][r["prompt"]]
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] + theirs[:at]
            params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            logprobs = out.outputs[0].logprobs[0]
            lines.append(f"| {dtype} | {r['system']} | {r['dataset']}, {r['prompt']} | {at} | "
                         f"{_logprob(logprobs, theirs[at])} | "
                         f"{_logprob(logprobs, r['tokens'][at])} |")  # fmt: skip
        shutdown(llm)
        del llm
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--head", default=DEFAULT_HEAD)
    p.add_argument("--eagle-config", default=DEFAULT_EAGLE_CONFIG)
    p.add_argument("--auto-config", default=DEFAULT_AUTO_CONFIG)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=16, help="prompts per dataset")
    p.add_argument("--batch", type=int, default=4, help="requests per generate() call")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ngram-k", type=int, default=3)
    p.add_argument("--vllm-eagle-k", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/dtype-divergence"))
    p.add_argument("--margins", action="store_true", help="after a run: see the docstring")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    args.dtypes = args.dtypes.split(",")
    args.datasets = args.datasets.split(",")
    if run_as_worker(args, run_worker):
        return 0
    if args.margins:
        table = margins(args)
        Path(args.out + "-margins.md").write_text(
            f"# Vanilla's log-probabilities at each first difference\n\nCommand: "
            f"`{command_line(SCRIPT, argv)}`\n\n{table}"
        )
        print(table)
        return 0
    check_systems(args.systems, SYSTEMS)
    rows = run_systems(__file__, args.systems, argv, args.out)
    md = summarise(rows, args, command_line(SCRIPT, argv))
    write_results(args.out, args, rows, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
