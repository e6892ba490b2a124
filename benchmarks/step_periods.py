"""Wall time of every engine step, grouped by what the step did (in-process engine).

    .venv/bin/python benchmarks/step_periods.py --system auto --concurrency 4
    .venv/bin/python benchmarks/step_periods.py --system vanilla-timed --concurrency 4

Systems as in ``cprofile_generate.py``: ``vanilla-timed`` (vanilla vLLM on the plugin's
worker), ``off`` / ``one-draft`` (``configs/eagle2-auto.yaml`` pinned to no drafts / one
draft), ``auto`` (the sizer's own choice). Each repetition serves ``--concurrency``
MT-bench first turns (``--prompts``; after an untimed load of the other set) and prints, per kind
of step (prefill or decode; draft passes run in the step; tree nodes verified in it;
batch size), the number of steps, the median period from one step's start to the next
(what the sizer charges: runner phases plus vLLM's scheduling and output processing),
the median drafting time, the deferred draft KV written, and the runner's own time.
This is how session 7 found that one draft per request and no drafts were within 2%
of each other at 4 and 16 requests (the sizer flipped between them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--system", choices=["vanilla-timed", "off", "one-draft", "auto"],
                   default="auto")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", choices=["mtbench", "humaneval"], default="mtbench",
                   help="timed prompts (the untimed load uses the other set)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--auto-config", default=str(ROOT / "configs/eagle2-auto.yaml"))
    args = p.parse_args(argv)

    from bench import _prompts
    from cprofile_generate import in_process_engine
    from vllm import SamplingParams

    from eagle_vllm.engine import runner as runner_module

    steps: list[tuple] = []
    observe = runner_module.EagleRunnerMixin._observe_step_costs

    previous = {"kind": "prefill"}

    def record(self, step: dict, period: float) -> None:  # every step the sizer would see
        kind = "decode" if step.get("decode_only") else "prefill"
        if kind == "decode" and previous["kind"] == "prefill":
            kind = "decode, first after prefill"  # a suspected outlier, kept apart
        previous["kind"] = "decode" if step.get("decode_only") else "prefill"
        key = (kind, step.get("passes", 0), step.get("verified_nodes", 1), step.get("batch", 0))
        steps.append((key, period, step.get("draft", 0.0), step.get("catch_up", 0.0),
                      step.get("runner_seconds", 0.0)))  # fmt: skip
        observe(self, step, period)

    runner_module.EagleRunnerMixin._observe_step_costs = record

    llm = in_process_engine(args.system, args.target, args.auto_config, args.concurrency)
    other = {"mtbench": "humaneval", "humaneval": "mtbench"}[args.prompts]
    prompts = _prompts(args.prompts, 80, llm.get_tokenizer())
    warm_prompts = _prompts(other, 80, llm.get_tokenizer())
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    c = args.concurrency
    for rep in range(args.reps):
        warm = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens // 2)
        llm.generate(warm_prompts[rep * 7 : rep * 7 + c], warm, use_tqdm=False)
        steps.clear()
        start = time.perf_counter()
        outs = llm.generate([prompts[(rep * 7 + i) % 80] for i in range(c)], params,
                            use_tqdm=False)  # fmt: skip
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{args.system}, rep {rep}: {tokens / seconds:.1f} tok/s ({seconds:.2f} s)")
        print("  kind, draft passes, nodes verified, batch: steps | period ms (median, sum) | "
              "draft ms | catch-up ms (sum) | runner ms")  # fmt: skip
        groups: dict[tuple, list] = {}
        for key, *values in steps:
            groups.setdefault(key, []).append(values)
        for key, rows in sorted(groups.items()):
            period, draft, catch_up, runner = zip(*rows)
            print(f"  {key}: {len(rows)} | {1e3 * statistics.median(period):.1f}, "
                  f"{1e3 * sum(period):.0f} | {1e3 * statistics.median(draft):.1f} | "
                  f"{1e3 * sum(catch_up):.0f} | {1e3 * statistics.median(runner):.1f}")  # fmt: skip
    if args.system != "vanilla-timed":  # what the sizer believed at the end
        table = llm.collective_rpc("eagle_vllm_sizing")[0]
        bucket = table["buckets"].get(1 << max(0, (c - 1).bit_length()), {})
        print(
            "  sizer's arms at this batch: passes,nodes: expected tokens | ms | tok/s per request"
        )
        for arm, row in bucket.items():
            if row["seconds"]:
                print(f"  {arm}: {row['expected_tokens']:.3f} | {1e3 * row['seconds']:.1f} | "
                      f"{row['expected_tokens'] / row['seconds']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
