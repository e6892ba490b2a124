"""Acceptance length τ of draft sources side by side: EAGLE, suffix, and both merged.

    .venv/bin/python benchmarks/suffix_tau.py --out benchmarks/results/suffix-tau-cpu
    .venv/bin/python benchmarks/suffix_tau.py --systems suffix,eagle2-suffix \\
        --set eagle2-suffix:suffix.max_nodes=12 --prompts 8

Every system decodes the same prompts one at a time (batch 1), greedy, fp32, in its own
engine (a fresh process per system and dataset: the suffix cache starts empty, or from
the seed corpus, each time, and a prompt is never seen twice). A request may draft from
the responses of the requests before it in the same run, as when serving. Reported per
system and dataset: τ = 1 + accepted / drafting steps (vLLM's counters), the share of
accepted drafts from each source (EAGLE, suffix, both), the suffix index's host time per
step, and wall seconds (this is an acceptance benchmark; speed ratios are
``bench.py table``'s).

Systems: ``eagle2`` (configs/eagle2.yaml), ``suffix`` (configs/suffix.yaml),
``eagle2-suffix`` (configs/eagle2-suffix.yaml), ``eagle-suffix`` (configs/eagle.yaml plus
a suffix section), ``eagle2-suffix-seed`` (eagle2-suffix with the seed corpus
``--seed-corpus``), ``suffix-seed`` (suffix with it), ``eagle`` (configs/eagle.yaml).
``--set SYSTEM:KEY=VALUE`` overrides a config key (``suffix.KEY`` inside the section).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import load_prompts  # noqa: E402

SYSTEMS = {
    "eagle": "configs/eagle.yaml",
    "eagle2": "configs/eagle2.yaml",
    "suffix": "configs/suffix.yaml",
    "eagle2-suffix": "configs/eagle2-suffix.yaml",
    "eagle-suffix": "configs/eagle.yaml",
    "eagle2-suffix-seed": "configs/eagle2-suffix.yaml",
    "suffix-seed": "configs/suffix.yaml",
}
DEFAULT_SEED = ROOT / "data/regen-sharegpt-0-6000/conversations.partial.jsonl"


def system_config(name: str, sets: list[str], seed_corpus: str) -> dict:
    path = ROOT / SYSTEMS[name]
    config = yaml.safe_load(path.read_text())
    if config.get("model"):
        config["model"] = str((path.parent / config["model"]).resolve())
    if name == "eagle-suffix":
        config["suffix"] = {}
    if name.endswith("-seed"):
        config.setdefault("suffix", {})["seed_corpus"] = seed_corpus
    for item in sets:
        system, _, kv = item.partition(":")
        if system != name:
            continue
        key, _, value = kv.partition("=")
        value = yaml.safe_load(value)
        if key.startswith("suffix."):
            config.setdefault("suffix", {})[key.removeprefix("suffix.")] = value
        else:
            config[key] = value
    return config


def run_worker(args) -> None:
    """One system on one dataset, in this process; prints one JSON line."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import SamplingParams

    from eagle_vllm import LLM

    config = json.loads(args.worker_config)
    llm = LLM(args.target, speculative_config=config, dtype="float32", enforce_eager=True,
              max_model_len=2048, seed=0, max_num_seqs=1, disable_log_stats=False)  # fmt: skip
    prompts = load_prompts(args.worker_dataset, args.prompts, llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    tokens = 0
    for prompt in prompts:  # batch 1, in order
        out = llm.generate([prompt], params, use_tqdm=False)
        tokens += len(out[0].outputs[0].token_ids)
    seconds = time.perf_counter() - start
    counters = {
        m.name.removeprefix("vllm:spec_decode_"): (m.values if hasattr(m, "values") else m.value)
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }
    suffix = llm.collective_rpc("eagle_vllm_suffix")[0]
    drafts = counters.get("num_drafts", 0)
    row = {
        "tau": 1 + counters.get("num_accepted_tokens", 0) / drafts if drafts else 1.0,
        "per_pos": [x / drafts for x in counters.get("num_accepted_tokens_per_pos", [])]
        if drafts
        else [],
        "tokens": tokens,
        "seconds": seconds,
        "suffix": {k: v for k, v in suffix.items() if k != "drafted"},
    }
    print("ROW " + json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--systems", default="eagle2,suffix,eagle2-suffix")
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--set", action="append", default=[], metavar="SYSTEM:KEY=VALUE")
    p.add_argument("--seed-corpus", default=str(DEFAULT_SEED))
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--worker-dataset", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_config:
        run_worker(args)
        return 0
    results = []
    for name in args.systems.split(","):
        for dataset in args.datasets.split(","):
            if name not in SYSTEMS:
                raise SystemExit(f"error: unknown system '{name}' (use {', '.join(SYSTEMS)})")
            config = system_config(name, args.set, args.seed_corpus)
            cmd = [sys.executable, __file__, "--target", args.target, "--prompts",
                   str(args.prompts), "--max-tokens", str(args.max_tokens),
                   "--worker-config", json.dumps(config), "--worker-dataset", dataset]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            if proc.returncode != 0 or not rows:
                sys.stderr.write(proc.stderr[-3000:])
                raise SystemExit(f"error: {name} on {dataset} failed")
            row = {"system": name, "dataset": dataset, "config": config, **json.loads(rows[0])}
            results.append(row)
            share = row["suffix"].get("accepted_share", {})
            print(f"{dataset:9s} {name:20s} tau {row['tau']:.3f}  "
                  f"eagle/suffix/both {share.get('eagle', 0):.2f}/{share.get('suffix', 0):.2f}/"
                  f"{share.get('both', 0):.2f}  suffix ms/step "
                  f"{row['suffix'].get('host_ms_per_step', 0):.2f}  {row['seconds']:.0f} s",
                  flush=True)  # fmt: skip
            if args.out:  # after every row: a long run's finished rows are kept
                write(args, results, argv)
    return 0


def write(args, results: list[dict], argv: list[str] | None) -> None:
    command = " ".join([".venv/bin/python", "benchmarks/suffix_tau.py", *(argv or sys.argv[1:])])
    lines = [
        "# τ of draft sources: EAGLE, suffix, merged",
        "",
        f"Command: `{command}`",
        "",
        f"SmolLM2-135M-Instruct, fp32, greedy, batch 1, {args.prompts} prompts per dataset "
        f"in order, max_tokens {args.max_tokens}; each system and dataset in a fresh engine.",
        "",
        "| dataset | system | τ | accepted drafts from eagle / suffix / both | "
        "suffix host ms per step | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        share = r["suffix"].get("accepted_share")
        split = (
            "-" if not share else " / ".join(f"{share[k]:.2f}" for k in ("eagle", "suffix", "both"))
        )
        ms = r["suffix"].get("host_ms_per_step")
        lines.append(
            f"| {r['dataset']} | {r['system']} | {r['tau']:.3f} | {split} | "
            f"{'-' if ms is None else f'{ms:.2f}'} | {r['seconds']:.0f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "rows": results}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
