"""What the load-aware sizer costs per step on the host, outside any engine.

    .venv/bin/python benchmarks/micro/sizer_cost.py
    .venv/bin/python benchmarks/micro/sizer_cost.py --profile benchmarks/results/sizing-profile-cpu.json

A ``TreeSizer`` seeded from a calibration profile decides ``--steps`` steps at batch 1,
4 and 16, fed made-up step costs (verify 34 ms plus 1.2 ms per node and request, 4 ms
per draft pass, +-10%) and acceptance (the first draft accepted 60% of the time), as the
runner feeds it: ``decide``, then ``observe_draft`` / ``observe_verify`` and
``observe_acceptance`` (or ``age_acceptance`` for a step without drafts). Prints the
microseconds per step of ``decide`` and of the observations, and the arms chosen most;
first, the tokens a step the profile alone predicts for the biggest tree.
At batch 1 a step is 40-60 ms on this project's CPUs, so 0.1 ms here is 0.2% of it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagle_vllm.sizing import TreeSizer  # noqa: E402


def run(profile: dict, batch: int, steps: int, seed: int = 0) -> tuple[float, float, Counter]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sizer = TreeSizer(
        profile["depth"], profile["topk"], profile["max_nodes"], root_topk=profile.get("root_topk")
    )
    sizer.load_profile(profile)
    verify = {m: 0.034 + 0.0012 * (m - 1) * batch for m in range(1, sizer.max_nodes + 1)}
    draft = {d: 0.004 * d for d in range(sizer.max_passes + 1)}
    choose_s = observe_s = 0.0
    chosen: Counter = Counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        d, m = sizer.decide(batch)
        t1 = time.perf_counter()
        sizer.observe_draft(batch, d, draft[d] * rng.uniform(0.9, 1.1))
        sizer.observe_verify(batch, m, verify[m] * rng.uniform(0.9, 1.1))
        if d == 0:
            sizer.age_acceptance(0.0)
        else:
            depths = torch.tensor([0] + [min(1 + j // 2, d) for j in range(m - 1)])
            depths = depths[None].repeat(batch, 1)
            accepted = torch.zeros(batch, m, dtype=torch.bool)
            accepted[:, 0] = True
            accepted[:, 1] = torch.rand(batch, generator=gen) < 0.6
            sizer.observe_acceptance(depths, torch.ones(batch, m, dtype=torch.bool), accepted)
        t2 = time.perf_counter()
        choose_s += t1 - t0
        observe_s += t2 - t1
        chosen[(d, m)] += 1
    return 1e6 * choose_s / steps, 1e6 * observe_s / steps, chosen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=str(ROOT / "benchmarks/results/sizing-profile-cpu.json"))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-sizes", default="1,4,16")
    args = p.parse_args()
    profile = json.loads(Path(args.profile).read_text())
    seeded = TreeSizer(
        profile["depth"], profile["topk"], profile["max_nodes"], root_topk=profile.get("root_topk")
    )
    seeded.load_profile(profile)
    biggest = max(seeded.arms)
    print(f"the profile alone: {biggest} expects {seeded.expected_tokens(biggest):.2f} tokens")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        choose_us, observe_us, chosen = run(profile, batch, args.steps)
        top = ", ".join(f"{d},{m}: {n}" for (d, m), n in chosen.most_common(4))
        print(
            f"batch {batch}: choose {choose_us:.0f} us/step, observations {observe_us:.0f}"
            f" us/step; arms {top}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
