"""Acceptance of draft heads side by side: EAGLE-1 against EAGLE-3, chains and trees, and
stock vLLM's ``eagle3`` chain with the same EAGLE-3 head.

    .venv/bin/python benchmarks/head_tau.py --eagle3-head heads/smollm2-135m-instruct-eagle3 \\
        --out benchmarks/results/head-tau-cpu

Every system decodes the same prompts one at a time (batch 1), fp32, in its own process
(one engine per system, dataset and temperature). Reported per row: τ = 1 + accepted /
drafting steps (vLLM's counters) and the acceptance rate at each draft position
(depth), i.e. the share of drafting steps whose path reached that depth.

Systems (``--systems``; ``e1`` = ``--eagle1-head``, ``e3`` = ``--eagle3-head``):
``e1-chain3`` / ``e3-chain3`` (the plugin's chain, K=3, greedy drafts),
``vllm-e3-chain3`` (stock vLLM ``method: eagle3``, K=3), ``e1-tree3x8`` / ``e3-tree3x8``
(3 draft passes, top-4, 8 nodes), ``e1-tree4x16`` / ``e3-tree4x16`` (4 passes, top-4, 16
nodes). At T=1 every chain drafts argmax tokens, as vLLM's does, so the heads compare
alike; the plugin's default for chains at T>0 (drafts sampled from q) is bench.py's.

The plugin's systems draft over the head's default vocabulary (``draft_vocab: auto``,
with each request's own tokens beside a reduced one) unless ``--draft-vocab N`` (the
shipped configs' 4096) or ``--no-context-vocab`` (``draft_vocab_context: false``) say
otherwise; rows record the speculative config they ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import load_prompts, spec_counters, tau  # noqa: E402

SHAPES = {  # name -> (method, depth, topk, total_tokens)
    "chain3": ("eagle", 3, 1, 4),
    "tree3x8": ("eagle2", 3, 4, 8),
    "tree4x16": ("eagle2", 4, 4, 16),
}
SYSTEMS = [f"{head}-{shape}" for head in ("e1", "e3") for shape in SHAPES] + ["vllm-e3-chain3"]


def system_spec(name: str, heads: dict[str, str], plugin_keys: dict | None = None
                ) -> tuple[bool, dict]:  # fmt: skip
    """(stock vLLM?, speculative config) of a named system; ``plugin_keys`` are added to
    the plugin's systems' configs."""
    if name == "vllm-e3-chain3":
        return True, {"method": "eagle3", "model": heads["e3"], "num_speculative_tokens": 3}
    head, _, shape = name.partition("-")
    method, depth, topk, total = SHAPES[shape]
    spec = {"method": method, "model": heads[head], "num_speculative_tokens": depth}
    if method == "eagle2":
        spec.update(topk=topk, total_tokens=total)
    else:
        spec.update(draft_sample_method="greedy")
    return False, {**spec, **(plugin_keys or {})}


def run_worker(args) -> None:
    """One system on one dataset at one temperature, in this process; prints one JSON line."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm
    from vllm import SamplingParams

    from eagle_vllm import LLM

    stock, spec = json.loads(args.worker_spec)
    cls = vllm.LLM if stock else LLM
    llm = cls(args.target, speculative_config=spec, dtype="float32", enforce_eager=True,
              max_model_len=2048, seed=0, max_num_seqs=1, disable_log_stats=False)  # fmt: skip
    prompts = load_prompts(args.worker_dataset, args.prompts, llm.get_tokenizer())
    params = SamplingParams(temperature=args.worker_temperature, max_tokens=args.max_tokens,
                            seed=0 if args.worker_temperature else None)  # fmt: skip
    start = time.perf_counter()
    tokens = 0
    for prompt in prompts:
        tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    seconds = time.perf_counter() - start
    counters = spec_counters(llm)
    drafts = counters.get("num_drafts", 0)
    row = {
        "tau": tau(counters) or 1.0,
        "per_depth": [x / drafts for x in counters.get("num_accepted_tokens_per_pos", [])]
        if drafts
        else [],
        "tokens": tokens,
        "tok_s": tokens / seconds,
    }
    print("ROW " + json.dumps(row), flush=True)


def row_order(row: dict) -> tuple:
    """Dataset, temperature, then the systems in SYSTEMS' order."""
    return row["dataset"], row["temperature"], SYSTEMS.index(row["system"])


def write_markdown(path: Path, rows: list[dict], commands: list[str]) -> None:
    lines = [
        "# τ of EAGLE-1 and EAGLE-3 heads (batch 1, fp32)",
        "",
        "Commands (each measures its own rows):",
        "",
        *(f"- `{c}`" for c in commands),
        "",
        "τ does not depend on the machine's speed; tok/s does, so it compares only rows",
        "measured by one command (the machine's load differs between commands).",
        "",
        "| dataset | T | system | τ | acceptance at depth 1, 2, 3, 4 | tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        depths = ", ".join(f"{x:.3f}" for x in r["per_depth"])
        lines.append(
            f"| {r['dataset']} | {r['temperature']:g} | {r['system']} | {r['tau']:.3f} | "
            f"{depths} | {r['tok_s']:.1f} |"
        )
    lines += ["", "tok/s is single-run wall time, for orientation only (bench.py times speed)."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--eagle1-head", default=str(ROOT / "heads/smollm2-135m-instruct-eagle"))
    p.add_argument("--eagle3-head", default=str(ROOT / "heads/smollm2-135m-instruct-eagle3"))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-vocab", default=None,
                   help="the plugin's systems' draft_vocab (auto, full or N; default: auto)")  # fmt: skip
    p.add_argument("--no-context-vocab", action="store_true",
                   help="the plugin's systems with draft_vocab_context: false")  # fmt: skip
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (rows as they finish)")
    p.add_argument(
        "--update",
        action="store_true",
        help="keep OUT.json's rows of other systems, datasets and temperatures (and its "
        "commands), replacing only the rows this command measures (and the commands "
        "none of whose rows remain)",
    )
    p.add_argument("--worker-spec", help=argparse.SUPPRESS)
    p.add_argument("--worker-dataset", help=argparse.SUPPRESS)
    p.add_argument("--worker-temperature", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_spec:
        run_worker(args)
        return 0
    heads = {"e1": args.eagle1_head, "e3": args.eagle3_head}
    plugin_keys = {}
    if args.draft_vocab is not None:
        value = args.draft_vocab
        plugin_keys["draft_vocab"] = int(value) if value.isdigit() else value
    if args.no_context_vocab:
        plugin_keys["draft_vocab_context"] = False
    command = " ".join(["python benchmarks/head_tau.py", *(argv or sys.argv[1:])])
    rows: list[dict] = []
    legacy, legacy_rows = [], False
    if args.update and args.out and Path(args.out).with_suffix(".json").exists():
        earlier = json.loads(Path(args.out).with_suffix(".json").read_text())
        rerun = {(n, d, float(t)) for n in args.systems.split(",")
                 for d in args.datasets.split(",") for t in args.temperatures.split(",")}  # fmt: skip
        rows = [r for r in earlier["rows"]
                if (r["system"], r["dataset"], r["temperature"]) not in rerun]  # fmt: skip
        legacy = [c for c in earlier.get("commands", [earlier.get("command")]) if c]
        # rows name the command that measured them; files from before name none
        legacy_rows = any("command" not in r for r in rows)
    for name in args.systems.split(","):
        if name not in SYSTEMS:
            raise SystemExit(f"error: unknown system '{name}' (use {', '.join(SYSTEMS)})")
        spec = system_spec(name, heads, plugin_keys)
        for dataset in args.datasets.split(","):
            for temperature in (float(t) for t in args.temperatures.split(",")):
                cmd = [sys.executable, __file__, "--target", args.target, "--prompts",
                       str(args.prompts), "--max-tokens", str(args.max_tokens),
                       "--worker-spec", json.dumps(spec), "--worker-dataset", dataset,
                       "--worker-temperature", str(temperature)]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True)
                found = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
                if proc.returncode != 0 or not found:
                    sys.stderr.write(proc.stderr[-3000:])
                    raise SystemExit(f"error: {name} on {dataset} at T={temperature} failed")
                row = {"system": name, "dataset": dataset, "temperature": temperature,
                       "spec": spec[1], "command": command, **json.loads(found[0])}  # fmt: skip
                rows.append(row)
                print(f"{dataset:9s} T={temperature:g} {name:15s} tau {row['tau']:.3f} "
                      f"depths {[round(x, 3) for x in row['per_depth']]}", flush=True)  # fmt: skip
                if args.out:
                    out = Path(args.out)
                    rows.sort(key=row_order)
                    # the commands that measured the rows kept: a rerun drops the ones
                    # whose every row it replaced
                    commands = list(dict.fromkeys(
                        (legacy if legacy_rows else []) + [r["command"] for r in rows if "command" in r]
                    ))  # fmt: skip
                    out.with_suffix(".json").write_text(
                        json.dumps({"commands": commands, "rows": rows}, indent=1)
                    )
                    write_markdown(out.with_suffix(".md"), rows, commands)
    return 0


if __name__ == "__main__":
    sys.exit(main())
