"""Which training-time-test settings pay: k (3, 5, 7 unrolled steps) and the optional
HASS-style top-K and feature terms, each trained the same number of steps on the same
data, then judged by validation top-1 per unrolled step and by τ.

    .venv/bin/python benchmarks/ttt_levers.py --out benchmarks/results/ttt-levers-cpu

The data is the EAGLE-3 reference head's (``make eagle3-head``: SmolLM2's own answers to
ShareGPT first turns), cut to ``--conversations``; one feature cache serves every lever.
Each lever is an ``eagle-vllm train --arch eagle3`` run of ``--steps`` steps with the
reference head's other settings; its head then drafts through ``head_tau.py`` (the
plugin's K=3 chain and 4-pass 16-node tree, batch 1, T=0). Reported per lever: seconds
per training step (its own log), validation top-1 at each unrolled step, τ per dataset.
Compare levers at equal steps here, and weigh τ against the step cost
(``train_cost.py``): k=5 costs about 1.6 steps of k=3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEVERS = {
    "k3": ["--ttt-steps", "3"],
    "k5": ["--ttt-steps", "5"],
    "k7": ["--ttt-steps", "7"],
    "topk": ["--ttt-steps", "3", "--ttt-topk-weight", "0.5"],
    "feature": ["--ttt-steps", "3", "--ttt-feature-weight", "0.1"],
}
REGEN_DATA = ROOT / "data" / "regen-sharegpt-0-6000" / "conversations.partial.jsonl"


def train(args, lever: str, work: Path) -> Path:
    out = work / lever
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "conversations.partial.jsonl").exists():
        shutil.copy(REGEN_DATA, out / "conversations.partial.jsonl")
    cmd = [
        str(ROOT / ".venv" / "bin" / "eagle-vllm"), "train", "--arch", "eagle3",
        "--target", args.target, "--out", str(out), "--features-dir", str(work / "features"),
        "--data", "sharegpt", "--num-conversations", str(args.conversations),
        "--max-len", "1024", "--regenerate", "--regen-max-tokens", "320",
        "--regen-dtype", "bfloat16", "--feature-dtype", "bfloat16", "--ce-vocab", "8192",
        "--max-steps", str(args.steps), "--lr", "6e-4", "--warmup-steps", "30",
        "--tokens-per-batch", "4096", "--noise", "none", "--eval-every", str(args.steps),
        "--save-every", "50", "--seed", "0", *LEVERS[lever],
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return out


def summary(out: Path) -> dict:
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines() if x]
    last = log[-1]
    return {
        "s_per_step": last["elapsed_s"] / max(1, last["step"]),
        "val_acc": [last[k] for k in sorted(k for k in last if k.startswith("val_acc_"))],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--conversations", type=int, default=1000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--work", default=str(ROOT / "artifacts" / "ttt-levers"))
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args()
    work = Path(args.work)
    rows = []
    for lever in args.levers.split(","):
        if lever not in LEVERS:
            raise SystemExit(f"error: unknown lever '{lever}' (use {', '.join(LEVERS)})")
        out = train(args, lever, work)
        tau_out = work / f"tau-{lever}"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "head_tau.py"),
                        "--target", args.target, "--eagle3-head", str(out),
                        "--systems", "e3-chain3,e3-tree4x16", "--temperatures", "0",
                        "--prompts", str(args.prompts), "--out", str(tau_out)],
                       check=True)  # fmt: skip
        taus = json.loads(tau_out.with_suffix(".json").read_text())["rows"]
        rows.append({"lever": lever, **summary(out),
                     "tau": {f"{r['dataset']} {r['system']}": r["tau"] for r in taus}})  # fmt: skip
        Path(args.out + ".json").write_text(
            json.dumps({"args": vars(args), "rows": rows}, indent=1)
        )
        columns = list(rows[0]["tau"])
        lines = [
            "# Training-time-test levers (EAGLE-3, SmolLM2-135M-Instruct)",
            "",
            f"`python benchmarks/ttt_levers.py --conversations {args.conversations} --steps "
            f"{args.steps} --levers {args.levers} --prompts {args.prompts} --out {args.out}`",
            "",
            "| lever | s/step | val top-1 per unrolled step | " + " | ".join(columns) + " |",
            "|---|---|---|" + "---|" * len(columns),
        ]
        for r in rows:
            acc = ", ".join(f"{a:.3f}" for a in r["val_acc"])
            taus_text = " | ".join(f"{r['tau'].get(c, float('nan')):.3f}" for c in columns)
            lines.append(f"| {r['lever']} | {r['s_per_step']:.2f} | {acc} | {taus_text} |")
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")
        print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
