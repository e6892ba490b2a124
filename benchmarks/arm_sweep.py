"""What each of the auto sizer's arms costs per step, phase by phase, in one engine.

    .venv/bin/python benchmarks/arm_sweep.py --arms 0,1 1,2 1,3 1,4 2,9 2,16 4,16

One in-process fp32 eager engine serving ``configs/eagle2-auto.yaml`` (or
``--auto-config``); for each arm ``passes,nodes`` in turn the sizer is pinned to it
(``TreeSizer.pinned``, as ``EAGLE_VLLM_SIZER_PIN`` does) and ``--concurrency`` MT-bench
first turns are decoded to ``--max-tokens``. Prints, per arm and repetition, output
tokens/s, engine steps, wall ms per step and the runner's phases in ms per step
(``eagle_vllm_timings``: ``target_forward`` is the target model's forward, ``draft``
the drafter, ``verify`` the rejection sampler, ``kv_compaction`` the accepted path's
K/V moves). Rounds interleave the arms, since this machine drifts. ``--profile
passes,nodes`` also runs that arm once more under ``torch.profiler`` and prints the
ops that took the most time (self CPU), with their calls. This is how
session 9 found what a tree's first extra node costs over a chain at batch 1 (the
CPU tree attention, ``attention/cpu_backend.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _pin(worker, arm: tuple[int, int]) -> bool:
    runner = worker.model_runner
    if arm not in runner.sizer.arms:
        raise ValueError(f"{arm} is not one of the sizer's arms {runner.sizer.arms}")
    runner.sizer.pinned = arm
    runner.timings.snapshot(reset=True)
    return True


def _timings(worker) -> dict:
    return worker.model_runner.timings.snapshot(reset=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arms", nargs="+", default=["0,1", "1,2", "1,3", "1,4", "2,9", "2,16"],
                   help="passes,nodes pairs (the sizer's arms)")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--auto-config", default=str(ROOT / "configs/eagle2-auto.yaml"))
    p.add_argument("--profile", nargs="*", default=[], help="arms to profile (torch.profiler)")
    p.add_argument("--top", type=int, default=25, help="ops per profile")
    args = p.parse_args(argv)
    try:
        arms = [tuple(int(x) for x in a.split(",")) for a in args.arms]
        profiled = [tuple(int(x) for x in a.split(",")) for a in args.profile]
    except ValueError:
        p.error(f"--arms/--profile: expected passes,nodes pairs, got {args.arms} {args.profile}")

    from bench import _prompts
    from cprofile_generate import in_process_engine
    from vllm import SamplingParams

    c = args.concurrency
    llm = in_process_engine("auto", args.target, args.auto_config, c)
    prompts = _prompts("mtbench", 80, llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(_prompts("humaneval", 80, llm.get_tokenizer())[:c], params, use_tqdm=False)
    print("arm (passes, nodes), rep: tok/s | steps | ms/step | runner phases, ms/step")
    for rep in range(args.reps):
        for arm in arms:
            llm.collective_rpc(_pin, args=(arm,))
            batch = [prompts[(10 + 7 * rep + i) % 80] for i in range(c)]
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            phases = llm.collective_rpc(_timings)[0]
            steps = max(phases.get("execute_model", {}).get("calls", 1), 1)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            split = " ".join(
                f"{name}={1e3 * v['seconds'] / steps:.1f}" for name, v in sorted(phases.items())
            )
            print(f"{arm}, {rep}: {tokens / seconds:.1f} | {steps} | "
                  f"{1e3 * seconds / steps:.1f} | {split}", flush=True)  # fmt: skip
    for arm in profiled:
        from torch.profiler import profile

        llm.collective_rpc(_pin, args=(arm,))
        batch = [prompts[(40 + i) % 80] for i in range(c)]
        with profile() as prof:
            llm.generate(batch, params, use_tqdm=False)
        steps = max(llm.collective_rpc(_timings)[0].get("execute_model", {}).get("calls", 1), 1)
        print(f"\nprofile of {arm}: {steps} engine steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
