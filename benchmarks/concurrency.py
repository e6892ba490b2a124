"""Throughput against concurrency (1 -> 64 requests in flight), side by side, one command.

    .venv/bin/python benchmarks/concurrency.py --out benchmarks/results/concurrency-cpu

For each system (its own engine process, same settings) and each concurrency c,
c MT-bench first turns are submitted together and decoded to ``--max-tokens``;
output tokens / wall seconds is the throughput. Every ratio is against vanilla's
figure for the same c and repetition, reported as median [min-max].

For ``eagle2-auto`` (``configs/eagle2-auto.yaml``, load-aware sizing) the table
also shows which tree sizes the sizer chose at each concurrency. Every system runs
each load once untimed (half the tokens, HumanEval prompts, so the timed MT-bench
prompts meet a cold prefix cache) before timing it: steady state, which for
eagle2-auto includes measuring its arms at that batch size.

Output: ``OUT.json`` (raw), ``OUT.md`` (table), ``OUT.png`` (curve).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import _fmt, _prompts, _spec_counters, check_systems, run_as_worker, run_systems  # noqa: E402

SYSTEMS = ("vanilla", "eagle", "eagle2", "eagle2-auto")


def build_engine(system: str, args):
    common = dict(
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        disable_log_stats=False,
        seed=0,
        max_num_seqs=max(args.concurrency),
    )
    if system == "vanilla":
        import vllm

        return vllm.LLM(args.target, **common)
    from eagle_vllm import LLM

    config = {
        "eagle": args.eagle_config,
        "eagle2": args.eagle2_config,
        "eagle2-auto": args.auto_config,
    }[system]
    return LLM(args.target, speculative_config=config, **common)


def run_worker(system: str, args) -> list[dict]:
    from vllm import SamplingParams

    llm = build_engine(system, args)
    prompts = _prompts("mtbench", 80, llm.get_tokenizer())
    # warm-up loads use other prompts: the timed prompts' prefill is measured cold
    # (a warm prefix cache would hand vanilla and eagle-vllm every full block, and
    # vLLM's own EAGLE all but the last: it recomputes that one for its drafter)
    warm_prompts = _prompts("humaneval", 80, llm.get_tokenizer())
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    rows = []
    for rep in range(args.first_rep, args.first_rep + args.reps):
        for c in args.concurrency:
            batch = [prompts[(rep * 7 + i) % len(prompts)] for i in range(c)]
            # steady state: the same load once untimed (eagle2-auto measures its arms)
            warm = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens // 2)
            warm_batch = [warm_prompts[(rep * 7 + i) % len(warm_prompts)] for i in range(c)]
            llm.generate(warm_batch, warm, use_tqdm=False)
            before = _spec_counters(llm)
            history_len = 0
            if system == "eagle2-auto":
                history_len = len(llm.collective_rpc("eagle_vllm_sizing")[0]["history"])
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            after = _spec_counters(llm)
            drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
            accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
            row = dict(
                system=system,
                rep=rep,
                concurrency=c,
                tokens=tokens,
                seconds=seconds,
                tok_s=tokens / seconds,
                tau=1 + accepted / drafts if drafts else None,
            )
            if system == "eagle2-auto":
                sizing = llm.collective_rpc("eagle_vllm_sizing")[0]
                history = sizing["history"]
                new = history[history_len:] if len(history) < 4096 else history[-200:]
                row["arms"] = Counter(f"{d},{m}" for _, d, m in new).most_common(3)
                # what the sizer believed after the run at this load (its batch bucket):
                # expected tokens per request-step and seconds per step, per measured arm
                bucket = sizing["buckets"].get(1 << max(0, (c - 1).bit_length()), {})
                row["sizer"] = {
                    arm: [v["expected_tokens"], v["seconds"]]
                    for arm, v in bucket.items()
                    if v["seconds"]
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return rows


def summarise(rows: list[dict], systems: list[str], levels: list[int]) -> tuple[str, dict]:
    vanilla = {(r["concurrency"], r["rep"]): r for r in rows if r["system"] == "vanilla"}
    curve: dict[str, dict[int, float]] = {}
    lines = [
        "| concurrency | " + " | ".join(systems) + " | eagle2-auto's trees (passes,nodes: steps) |",
        "|---|" + "---|" * len(systems) + "---|",
    ]
    for c in levels:
        cells = []
        for system in systems:
            mine = [r for r in rows if r["system"] == system and r["concurrency"] == c]
            speeds = [r["tok_s"] for r in mine]
            ratios = [
                r["tok_s"] / vanilla[(c, r["rep"])]["tok_s"]
                for r in mine
                if (c, r["rep"]) in vanilla
            ]
            if system == "vanilla":
                cells.append(f"{_fmt(speeds, 1)} tok/s")
            else:
                cells.append(f"{_fmt(ratios)}x")
            if ratios:
                curve.setdefault(system, {})[c] = statistics.median(ratios)
        arms = Counter()
        for r in rows:
            if r["system"] == "eagle2-auto" and r["concurrency"] == c:
                arms.update({a: n for a, n in r.get("arms", [])})
        arm_text = ", ".join(f"{a}: {n}" for a, n in arms.most_common(3)) or "-"
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {arm_text} |")
    return "\n".join(lines) + "\n", curve


def plot(curve: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system, points in curve.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=system)
    ax.axhline(1.0, color="black", lw=0.8, label="vanilla")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("throughput / vanilla vLLM (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--eagle-config", default=str(ROOT / "configs/eagle.yaml"))
    p.add_argument("--eagle2-config", default=str(ROOT / "configs/eagle2.yaml"))
    p.add_argument("--auto-config", default=str(ROOT / "configs/eagle2-auto.yaml"))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--first-rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/concurrency-latest"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    check_systems(args.systems, SYSTEMS)
    if run_as_worker(args, run_worker):
        return 0

    started = time.time()
    rows = run_systems(__file__, args.systems, argv, args.out, rounds=args.reps)
    md, curve = summarise(rows, args.systems, args.concurrency)
    command = " ".join([".venv/bin/python", "benchmarks/concurrency.py", *(argv or sys.argv[1:])])
    header = (
        f"# Throughput vs concurrency: {Path(args.target).name}\n\n"
        f"Command: `{command}`\n\n"
        f"dtype {args.dtype}, enforce_eager, T={args.temperature:g}, {args.max_tokens} tokens "
        f"per request, MT-bench first turns, {args.reps} reps; speculative systems as "
        f"ratios to vanilla at the same concurrency; wall time {time.time() - started:.0f} s.\n\n"
    )
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(header + md)
    plot(curve, Path(args.out + ".png"))
    print(header + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
