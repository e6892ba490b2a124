"""Side-by-side speed of speculative decoding systems under vLLM, in one command.

    .venv/bin/python benchmarks/bench.py --out benchmarks/results/latest

Systems (each in its own engine process, one after the other, same settings):

* ``vanilla``     vLLM without speculation (the reference every ratio is against)
* ``ngram``       vLLM's built-in n-gram speculation
* ``vllm-eagle``  vLLM's built-in EAGLE chain with the same head
* ``eagle``       eagle-vllm chain   (``--eagle-config``, default configs/eagle.yaml)
* ``eagle2``      eagle-vllm tree    (``--eagle2-config``, default configs/eagle2.yaml)
* ``eagle2-auto`` eagle-vllm tree with load-aware sizing (``--auto-config``,
  default configs/eagle2-auto.yaml)

Conditions: MT-bench first turns (chat template) and HumanEval (raw completion),
batch sizes, temperatures. A batch of size b is b requests submitted together;
prompts run in waves of b. Each condition is repeated ``--reps`` times; every
ratio is computed repetition by repetition against vanilla's same repetition,
and reported as median [min-max].

Metrics: output tokens/s, speedup vs vanilla, mean acceptance length
τ = 1 + accepted/drafts and per-depth acceptance (vLLM's own spec-decode
counters), and for eagle-vllm systems the split of engine-step time between
drafting, the target forward, verification (sampling) and the rest.

On vLLM's CPU build, the stock speculative sampler mis-expands per-request
sampling parameters (see README); ``ngram`` and ``vllm-eagle`` are therefore
only run at temperature 0 there.

Output: ``OUT.json`` (all raw figures), ``OUT.md`` (tables), ``OUT.png`` (plot).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("vanilla", "ngram", "vllm-eagle", "eagle", "eagle2", "eagle2-auto")
OURS = ("eagle", "eagle2", "eagle2-auto")
STOCK_SPEC = ("ngram", "vllm-eagle")


def _prompts(dataset: str, n: int, tokenizer) -> list[str]:
    from eagle_vllm.datasets import humaneval_prompts, mtbench_prompts

    if dataset == "mtbench":
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in mtbench_prompts(0)[:n]
        ]
    if dataset == "humaneval":
        return humaneval_prompts()[:n]
    raise SystemExit(f"error: unknown dataset '{dataset}' (use mtbench, humaneval)")


def _spec_counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.removeprefix("vllm:spec_decode_")] = (
                list(m.values) if hasattr(m, "values") else m.value
            )
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k, 0 if not isinstance(v, list) else [0] * len(v))
        out[k] = [x - y for x, y in zip(v, b)] if isinstance(v, list) else v - b
    return out


def build_engine(system: str, args):
    """The engine of one system; eagle-vllm systems go through eagle_vllm.LLM."""
    common = dict(
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        disable_log_stats=False,
        seed=0,
        max_num_seqs=max(args.batch_sizes),
    )
    if system in OURS:
        from eagle_vllm import LLM

        config = {
            "eagle": args.eagle_config,
            "eagle2": args.eagle2_config,
            "eagle2-auto": args.auto_config,
        }[system]
        return LLM(args.target, speculative_config=config, **common)
    import vllm

    if system == "vanilla":
        return vllm.LLM(args.target, **common)
    if system == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.ngram_k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
        return vllm.LLM(args.target, speculative_config=spec, **common)
    if system == "vllm-eagle":
        spec = {"method": "eagle", "model": args.head, "num_speculative_tokens": args.vllm_eagle_k}
        return vllm.LLM(args.target, speculative_config=spec, **common)
    raise SystemExit(f"error: unknown system '{system}' (use {', '.join(SYSTEMS)})")


def run_worker(system: str, args) -> list[dict]:
    """Run every condition for one system in this process; one row per (condition, rep)."""
    from vllm import SamplingParams

    llm = build_engine(system, args)
    tokenizer = llm.get_tokenizer()
    ours = system in OURS
    rows = []
    # warm-up: first calls allocate and fill caches; one untimed batch per batch size
    # (eagle2-auto measures its arms per batch size; every system gets the same warm-up)
    llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    warm_prompts = _prompts(args.datasets[0], max(args.batch_sizes), tokenizer)
    for batch in args.batch_sizes:
        llm.generate(warm_prompts[:batch], SamplingParams(max_tokens=32), use_tqdm=False)
    for rep in range(args.first_rep, args.first_rep + args.reps):
        for dataset in args.datasets:
            for temperature in args.temperatures:
                if temperature > 0 and system in STOCK_SPEC and args.cpu:
                    continue
                for batch in args.batch_sizes:
                    n = max(batch, args.num_prompts)
                    prompts = _prompts(dataset, n, tokenizer)
                    # Sampled outputs differ between systems (each draws its own sample
                    # of the same distribution), so their lengths do: one early EOS in a
                    # batch halved a row's tok/s (session 9). Sampled requests decode
                    # max_tokens each; greedy ones stop where the target stops, the
                    # same for every system (lossless).
                    params = SamplingParams(
                        temperature=temperature,
                        max_tokens=args.max_tokens,
                        seed=1000 + rep,
                        ignore_eos=temperature > 0,
                    )
                    before = _spec_counters(llm)
                    if ours:
                        llm.collective_rpc("eagle_vllm_timings", kwargs={"reset": True})
                    tokens, start = 0, time.perf_counter()
                    for i in range(0, len(prompts), batch):
                        outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
                        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
                    seconds = time.perf_counter() - start
                    row = dict(
                        system=system,
                        rep=rep,
                        dataset=dataset,
                        temperature=temperature,
                        batch=batch,
                        prompts=len(prompts),
                        tokens=tokens,
                        seconds=seconds,
                        tok_s=tokens / seconds,
                        spec=_delta(_spec_counters(llm), before),
                    )
                    if ours:
                        row["timings"] = llm.collective_rpc("eagle_vllm_timings")[0]
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "timings"}), flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return rows


def _tau(spec: dict) -> float | None:
    drafts = spec.get("num_drafts", 0)
    return 1 + spec.get("num_accepted_tokens", 0) / drafts if drafts else None


def _fmt(values: list[float], digits: int = 2) -> str:
    if not values:
        return "n/a"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def summarise(rows: list[dict], systems: list[str]) -> tuple[str, list[dict]]:
    """Markdown tables: speed and ratios, acceptance, and the time split."""
    key = lambda r: (r["dataset"], r["temperature"], r["batch"])  # noqa: E731
    conditions = sorted({key(r) for r in rows})
    vanilla = {(key(r), r["rep"]): r for r in rows if r["system"] == "vanilla"}
    table = []
    lines = [
        "| dataset | T | batch | system | tok/s | speedup vs vanilla | τ | accepted per depth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cond in conditions:
        for system in systems:
            mine = [r for r in rows if r["system"] == system and key(r) == cond]
            if not mine:
                continue
            ratios = [
                r["tok_s"] / vanilla[(cond, r["rep"])]["tok_s"]
                for r in mine
                if (cond, r["rep"]) in vanilla
            ]
            taus = [t for t in (_tau(r["spec"]) for r in mine) if t is not None]
            per_pos = None
            drafts = sum(r["spec"].get("num_drafts", 0) for r in mine)
            if drafts:
                sums = [
                    sum(x)
                    for x in zip(*(r["spec"].get("num_accepted_tokens_per_pos", []) for r in mine))
                ]
                per_pos = " ".join(f"{s / drafts:.2f}" for s in sums)
            entry = dict(
                dataset=cond[0],
                temperature=cond[1],
                batch=cond[2],
                system=system,
                tok_s=statistics.median(r["tok_s"] for r in mine),
                speedup=statistics.median(ratios) if ratios else None,
                tau=statistics.median(taus) if taus else None,
            )
            table.append(entry)
            lines.append(
                f"| {cond[0]} | {cond[1]:g} | {cond[2]} | {system} | "
                f"{_fmt([r['tok_s'] for r in mine], 1)} | "
                f"{_fmt(ratios) if system != 'vanilla' else '1'} | "
                f"{_fmt(taus) if taus else '-'} | {per_pos or '-'} |"
            )
    split = [
        "",
        "Time split of engine steps (eagle-vllm systems; share of execute_model + sample_tokens):",
        "",
        "| dataset | T | batch | system | draft | target forward | verify | KV compaction | "
        "other (vLLM + plugin) | ms per step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cond in conditions:
        for system in systems:
            mine = [r for r in rows if r["system"] == system and key(r) == cond and "timings" in r]
            if not mine:
                continue
            tot = {}
            for r in mine:
                for name, v in r["timings"].items():
                    tot[name] = tot.get(name, 0.0) + v["seconds"]
            steps = sum(r["timings"].get("execute_model", {}).get("calls", 0) for r in mine)
            total = tot.get("execute_model", 0.0) + tot.get("sample_tokens", 0.0)
            if not total:
                continue
            parts = [
                tot.get(n, 0.0) for n in ("draft", "target_forward", "verify", "kv_compaction")
            ]
            other = total - sum(parts)
            cells = " | ".join(f"{100 * p / total:.0f}%" for p in [*parts, other])
            lines_ms = 1000 * total / max(steps, 1)
            split.append(
                f"| {cond[0]} | {cond[1]:g} | {cond[2]} | {system} | {cells} | {lines_ms:.1f} |"
            )
    return "\n".join(lines + split) + "\n", table


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = sorted({(t["dataset"], t["temperature"], t["batch"]) for t in table})
    systems = [s for s in SYSTEMS if any(t["system"] == s for t in table) and s != "vanilla"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(conds)), 4))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        ys = []
        for c in conds:
            match = [
                t
                for t in table
                if t["system"] == system and (t["dataset"], t["temperature"], t["batch"]) == c
            ]
            ys.append(match[0]["speedup"] if match and match[0]["speedup"] else 0)
        ax.bar([j + i * width for j in range(len(conds))], ys, width, label=system)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(conds))])
    ax.set_xticklabels([f"{d}\nT={t:g} b={b}" for d, t, b in conds], fontsize=8)
    ax.set_ylabel("speedup vs vanilla vLLM (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_systems(systems: list[str], known) -> None:
    """Refuse unknown systems, and runs without vanilla (every ratio is against it)."""
    for system in systems:
        if system not in known:
            raise SystemExit(f"error: --systems: unknown '{system}' (use {', '.join(known)})")
    if "vanilla" not in systems:
        raise SystemExit("error: --systems must include vanilla: every ratio is against it")


def run_as_worker(args, run_worker) -> bool:
    """In a ``--worker SYSTEM`` child: run it and write its rows for ``run_systems``."""
    if not args.worker:
        return False
    rows = run_worker(args.worker, args)
    Path(args.out + f".{args.worker}.json").write_text(json.dumps(rows))
    return True


def run_systems(
    script: str, systems: list[str], argv: list[str] | None, out: str, rounds: int = 0
) -> list[dict]:
    """Run ``script --worker SYSTEM`` for each system, one after the other, each in its own
    process (its own engine, nothing shared); the worker writes its rows to
    ``OUT.SYSTEM.json``. Same environment for all: KV cache size, thread binding, and
    Intel OpenMP preloaded when the venv has it (vLLM's CPU recommendation).

    ``rounds`` > 0: repetitions interleaved, round r runs every system once with
    ``--reps 1 --first-rep r``, in reversed order every other round, so a slow phase of
    this shared machine (vanilla's speed drifted 25% between two repetitions minutes
    apart) lands on every system, not on the one that happened to run then."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and "LD_PRELOAD" not in env:
        # vLLM's CPU install guide preloads Intel OpenMP; its CPU worker warns that
        # speculative decoding loses much without it. Every system gets the same.
        env["LD_PRELOAD"] = str(iomp)
    print(f"LD_PRELOAD={env.get('LD_PRELOAD', '')}", flush=True)
    rows: list[dict] = []
    cmd = [sys.executable, script, *(argv if argv is not None else sys.argv[1:])]
    passes = [([], "")] if rounds <= 0 else [
        (["--reps", "1", "--first-rep", str(r)], f", round {r + 1} of {rounds}")
        for r in range(rounds)
    ]  # fmt: skip
    for r, (extra, label) in enumerate(passes):
        # ABBA: a machine slowing down (or speeding up) steadily favours no system
        for system in systems if r % 2 == 0 else systems[::-1]:
            print(f"== {system}{label}", flush=True)
            subprocess.run([*cmd, *extra, "--worker", system], env=env, check=True)
            part = Path(out + f".{system}.json")
            rows += json.loads(part.read_text())
            part.unlink()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--head", default=str(ROOT / "heads/smollm2-135m-instruct-eagle"))
    p.add_argument("--eagle-config", default=str(ROOT / "configs/eagle.yaml"))
    p.add_argument("--eagle2-config", default=str(ROOT / "configs/eagle2.yaml"))
    p.add_argument("--auto-config", default=str(ROOT / "configs/eagle2-auto.yaml"))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per condition (>= batch)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--first-rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--ngram-k", type=int, default=3)
    p.add_argument("--vllm-eagle-k", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/latest"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    args.datasets = args.datasets.split(",")
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.temperatures = [float(x) for x in args.temperatures.split(",")]
    from vllm.platforms import current_platform

    args.cpu = current_platform.is_cpu()

    if run_as_worker(args, run_worker):
        return 0
    check_systems(args.systems, SYSTEMS)
    for path, what in ((args.target, "--target"), (args.head, "--head")):
        if not Path(path).is_dir():
            raise SystemExit(
                f"error: {what} '{path}' does not exist. Fix: make setup; "
                ".venv/bin/eagle-vllm prepare smollm2 (target) / make reference-head (head)."
            )
    started = time.time()
    rows = run_systems(__file__, args.systems, argv, args.out, rounds=args.reps)
    md, table = summarise(rows, args.systems)
    header = (
        f"# Benchmark: {Path(args.target).name}, head {Path(args.head).name}\n\n"
        f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/bench.py', *(argv or sys.argv[1:])])}`\n\n"
        f"dtype {args.dtype}, enforce_eager, max_tokens {args.max_tokens}, "
        f"{args.num_prompts} prompts per condition (at least the batch size), {args.reps} reps; "
        f"eagle config `{Path(args.eagle_config).name}`, eagle2 config `{Path(args.eagle2_config).name}`; "
        f"wall time {time.time() - started:.0f} s.\n\n"
    )
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(header + md)
    plot(table, Path(args.out + ".png"))
    print(header + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
