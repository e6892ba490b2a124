"""What one step costs: vanilla vs eagle2-auto pinned to drafts-off and to one draft.

    .venv/bin/python benchmarks/step_profile.py --out benchmarks/results/step-profile-cpu

Systems (each its own engine process, same settings, ``bench.run_systems``):

* ``vanilla``: vLLM without speculation;
* ``off``: ``configs/eagle2-auto.yaml`` with every step pinned to no drafts
  (``EAGLE_VLLM_SIZER_PIN=0,1``): the plugin's overhead when speculation is off;
* ``one-draft``: pinned to one draft pass and a 2-node tree (``1,2``);
* ``auto``: the sizer's own choice;
* ``vanilla-timed`` / ``ngram-timed``: vanilla vLLM / vLLM's ngram set never to match, on
  the plugin's worker, so their runner times the same phases (diagnostics for ``off``).

For each concurrency c, c MT-bench first turns are decoded to ``--max-tokens`` after an
untimed warm-up on HumanEval prompts (cold prefix cache for the timed prompts). Reports
output tokens/s, the ratio to vanilla, and the plugin's wall time per runner phase
(``eagle_vllm_timings``) in ms per step. Output: ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import _fmt, _prompts, check_systems, run_as_worker, run_systems  # noqa: E402

# vanilla-timed: vanilla vLLM (no speculation) on the plugin's worker, whose runner times
# the same phases: a vanilla step's target forward beside the plugin's drafts-off step
# ngram-timed: the same, with vLLM's ngram speculation set so it never finds a match (a
# 40-token n-gram): vLLM's spec-decode path without a draft model, beside ``off``
PINS = {
    "vanilla": None,
    "vanilla-timed": None,
    "ngram-timed": None,
    "off": "0,1",
    "one-draft": "1,2",
    "auto": None,
}
PHASES = ("target_forward", "verify", "draft", "draft_catch_up", "execute_model", "sample_tokens")


def run_worker(system: str, args) -> list[dict]:
    from vllm import SamplingParams

    if PINS[system]:
        os.environ["EAGLE_VLLM_SIZER_PIN"] = PINS[system]  # inherited by the engine
    common = dict(dtype=args.dtype, enforce_eager=True, max_model_len=2048, seed=0,
                  disable_log_stats=False, max_num_seqs=max(args.concurrency))  # fmt: skip
    if system == "vanilla":
        import vllm

        llm = vllm.LLM(args.target, **common)
    elif system == "vanilla-timed":
        import vllm

        from eagle_vllm.config import WORKER_CLS

        llm = vllm.LLM(args.target, worker_cls=WORKER_CLS, **common)
    elif system == "ngram-timed":
        import vllm

        from eagle_vllm.config import WORKER_CLS

        never = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 40,
                 "prompt_lookup_max": 40}  # fmt: skip
        llm = vllm.LLM(args.target, worker_cls=WORKER_CLS, speculative_config=never, **common)
    else:
        from eagle_vllm import LLM

        llm = LLM(args.target, speculative_config=args.auto_config, **common)
    tokenizer = llm.get_tokenizer()
    prompts = _prompts("mtbench", 80, tokenizer)
    warm_prompts = _prompts("humaneval", 80, tokenizer)
    rows = []
    for rep in range(args.reps):
        for c in args.concurrency:
            warm = SamplingParams(temperature=0, max_tokens=args.max_tokens // 2, ignore_eos=True)
            llm.generate(warm_prompts[(rep * 7) % 16 :][:c], warm, use_tqdm=False)
            if system != "vanilla":
                llm.collective_rpc("eagle_vllm_timings", kwargs={"reset": True})
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            batch = [prompts[(rep * 7 + i) % len(prompts)] for i in range(c)]
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            row = dict(system=system, rep=rep, concurrency=c, tok_s=tokens / seconds)
            if system != "vanilla":
                timings = llm.collective_rpc("eagle_vllm_timings")[0]
                row["ms_per_step"] = {
                    k: 1000 * v["seconds"] / max(v["calls"], 1) for k, v in timings.items()
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return rows


def summarise(rows: list[dict], systems: list[str], levels: list[int]) -> str:
    vanilla = {(r["concurrency"], r["rep"]): r["tok_s"] for r in rows if r["system"] == "vanilla"}
    lines = [
        "| concurrency | system | tok/s | vs vanilla | "
        + " | ".join(f"{p} ms/step" for p in PHASES)
        + " |",
        "|---|---|---|---|" + "---|" * len(PHASES),
    ]
    for c in levels:
        for system in systems:
            mine = [r for r in rows if r["system"] == system and r["concurrency"] == c]
            speeds = [r["tok_s"] for r in mine]
            ratios = [r["tok_s"] / vanilla[(c, r["rep"])] for r in mine if (c, r["rep"]) in vanilla]
            phases = [
                statistics.median(r["ms_per_step"].get(p, 0.0) for r in mine)
                if mine and "ms_per_step" in mine[0] else None
                for p in PHASES
            ]  # fmt: skip
            cells = ["-" if x is None else f"{x:.1f}" for x in phases]
            ratio = "1" if system == "vanilla" else f"{_fmt(ratios)}x"
            lines.append(
                f"| {c} | {system} | {_fmt(speeds, 1)} | {ratio} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--auto-config", default=str(ROOT / "configs/eagle2-auto.yaml"))
    p.add_argument("--systems", default=",".join(PINS))
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/step-profile-latest"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    check_systems(args.systems, PINS)
    if run_as_worker(args, run_worker):
        return 0

    started = time.time()
    rows = run_systems(__file__, args.systems, argv, args.out)
    command = " ".join([".venv/bin/python", "benchmarks/step_profile.py", *(argv or sys.argv[1:])])
    md = (
        f"# Step profile: {Path(args.target).name}\n\nCommand: `{command}`\n\n"
        f"dtype {args.dtype}, enforce_eager, T=0, {args.max_tokens} tokens per request, "
        f"MT-bench first turns (warm-up on HumanEval), {args.reps} reps, median [min-max]; "
        f"phases from the plugin's runner timers; wall time {time.time() - started:.0f} s.\n\n"
        + summarise(rows, args.systems, args.concurrency)
    )
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
