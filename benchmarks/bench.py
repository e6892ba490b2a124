"""Side-by-side speed of speculative decoding systems under vLLM: ``make bench``'s figures.

    .venv/bin/python benchmarks/bench.py table --out benchmarks/results/latest
    .venv/bin/python benchmarks/bench.py curve --out benchmarks/results/concurrency-latest

``table``: every system on MT-bench and HumanEval at a few batch sizes and temperatures,
side by side (tables and a bar plot). ``curve``: throughput against concurrency (1 -> 64
requests in flight). Each system runs in its own engine process with the same settings;
every ratio is against vanilla vLLM's same repetition. ``bench.py table --help`` and
``bench.py curve --help`` describe each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DEFAULT_AUTO_CONFIG,
    DEFAULT_EAGLE2_CONFIG,
    DEFAULT_EAGLE2_SUFFIX_CONFIG,
    DEFAULT_EAGLE3_HEAD,
    DEFAULT_EAGLE_CONFIG,
    DEFAULT_HEAD,
    DEFAULT_SUFFIX_CONFIG,
    DEFAULT_TARGET,
    PLUGIN_SYSTEMS,
    ROOT,
    STOCK_SPEC_SYSTEMS,
    build_engine,
    check_systems,
    command_line,
    counters_delta,
    engine_kwargs,
    fmt_median,
    generate_in_flight,
    interleaved_prompts,
    load_prompts,
    raw_prompts,
    read_timings,
    reset_timings,
    run_as_worker,
    run_subcommands,
    run_systems,
    shutdown,
    sizer_bucket,
    sizing_table,
    spec_counters,
    suffix_delta,
    suffix_stats,
    tau,
    write_results,
)

TABLE_SYSTEMS = (
    "vanilla", "ngram", "vllm-eagle", "eagle", "eagle2", "eagle2-auto", "suffix", "eagle2-suffix",
)  # fmt: skip
# also accepted: vLLM's suffix decoding, where arctic-inference is installed
TABLE_OPTIONAL = ("vllm-suffix", "vllm-eagle3", "eagle2-auto-nosuffix", "eagle2-auto-nocontext")
CURVE_SYSTEMS = ("vanilla", "eagle", "eagle2", "eagle2-auto")
CURVE_OPTIONAL = ("suffix", "eagle2-suffix")

TABLE_HELP = "every system side by side: tok/s, speedup, tau, time split (table, plot)"
TABLE_DOC = """Side-by-side speed of speculative decoding systems under vLLM, in one command.

    .venv/bin/python benchmarks/bench.py table --out benchmarks/results/latest

Systems (each in its own engine process, one after the other, same settings):

* ``vanilla``     vLLM without speculation (the reference every ratio is against)
* ``ngram``       vLLM's built-in n-gram speculation
* ``vllm-eagle``  vLLM's built-in EAGLE chain with the same head
* ``eagle``       eagle-vllm chain   (``--eagle-config``, default configs/eagle.yaml)
* ``eagle2``      eagle-vllm tree    (``--eagle2-config``, default configs/eagle2.yaml)
* ``eagle2-auto`` eagle-vllm tree with load-aware sizing (``--auto-config``,
  default configs/eagle2-auto.yaml)
* ``suffix``      eagle-vllm model-free suffix trees (``--suffix-config``, default
  configs/suffix.yaml)
* ``eagle2-suffix`` eagle-vllm tree merged with suffix candidates
  (``--eagle2-suffix-config``, default configs/eagle2-suffix.yaml)
* ``vllm-suffix`` vLLM's built-in suffix decoding (needs arctic-inference: ``make
  vllm-suffix``; not in the default list)
* ``vllm-eagle3`` vLLM's built-in EAGLE-3 chain (``method: eagle3``) with ``--eagle3-head``
  (not in the default list)
* ``eagle2-auto-nosuffix`` ``--auto-config`` without its suffix section (not in the
  default list)
* ``eagle2-auto-nocontext`` ``--auto-config`` with ``draft_vocab_context: false``: the
  head drafts its frequent tokens only (not in the default list)

Systems that learn from past requests (a suffix source's cache of responses) start
every condition with that cache emptied, so no prompt is ever seen twice; a request
may draft from the responses of earlier requests of the same condition, as when
serving. A seed corpus, if the config has one, stays.

Conditions: MT-bench first turns (chat template; the first ``--num-prompts`` taken
round-robin over its eight categories, ``mtbench:CATEGORY`` for one) and HumanEval (raw
completion), batch sizes, temperatures. A batch of size b is b requests submitted
together; prompts run in waves of b. Each condition is repeated ``--reps`` times (the
same prompts; prefix caching off, and the untimed warm-up on MT-bench second turns); every
ratio is computed repetition by repetition against vanilla's same repetition,
and reported as median [min-max].

Metrics: output tokens/s, speedup vs vanilla, mean acceptance length
τ = 1 + accepted/drafts and per-depth acceptance (vLLM's own spec-decode
counters), and for eagle-vllm systems the split of engine-step time between
drafting, the target forward, verification (sampling) and the rest.

On vLLM's CPU build, the stock speculative sampler mis-expands per-request
sampling parameters (see README); ``ngram``, ``vllm-eagle`` and ``vllm-eagle3`` are
therefore only run at temperature 0 there.

Output: ``OUT.json`` (all raw figures), ``OUT.md`` (tables), ``OUT.png`` (plot).
"""

CURVE_HELP = "throughput against concurrency 1 -> 64, as ratios to vanilla (table, curve)"
CURVE_DOC = """Throughput against concurrency (1 -> 64 requests in flight), side by side, one command.

    .venv/bin/python benchmarks/bench.py curve --out benchmarks/results/concurrency-latest

For each system (its own engine process, same settings) and each concurrency c, c
requests are kept in flight: c prompts start together and each finished request's slot
goes to the next prompt (``common.generate_in_flight``), until ``--requests-per-client``
x c requests have been decoded to ``--max-tokens``. That is the load a server with c
clients sees. The prompts (``--prompts``) are the 80 MT-bench first turns and the 164
HumanEval stubs, interleaved: 244 distinct prompts, so no prompt runs twice in one
measurement and 64 clients keep 64 requests in flight for nearly four waves.
``--requests-per-client 1`` is one batch that drains: its last steps run the slowest
requests alone, which costs speculation (its requests finish at different steps) and not
vanilla (all finish together).
Output tokens / wall seconds is the throughput. Every ratio is against vanilla's
figure for the same c and repetition, reported as median [min-max].

For ``eagle2-auto`` (``configs/eagle2-auto.yaml``, load-aware sizing) the table
also shows which tree sizes the sizer chose at each concurrency. Every system runs
each load once untimed (c requests, half the tokens, MT-bench second turns) before
timing it: steady state, which for eagle2-auto includes measuring its arms at that batch size.
Prefix caching is off for every system: the repetitions reuse prompts.

Output: ``OUT.json`` (raw), ``OUT.md`` (table), ``OUT.png`` (curve).
"""


# -- table -----------------------------------------------------------------------------


def run_table_worker(system: str, args) -> list[dict]:
    """Run every condition for one system in this process; one row per (condition, rep)."""
    from vllm import SamplingParams

    # no prefix cache: the repetitions reuse prompts, and a warm cache would shorten
    # every prefill after the first
    llm = build_engine(
        system,
        args,
        **engine_kwargs(args.dtype, max(args.batch_sizes), args.max_model_len),
        enable_prefix_caching=False,
    )
    tokenizer = llm.get_tokenizer()
    ours = system in PLUGIN_SYSTEMS
    rows = []
    # warm-up: first calls allocate and fill caches; one untimed batch per batch size
    # (eagle2-auto measures its arms per batch size; every system gets the same warm-up)
    llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    # MT-bench second turns: never a timed prompt
    warm_prompts = load_prompts("mtbench-turn2", max(args.batch_sizes), tokenizer)
    for batch in args.batch_sizes:
        llm.generate(warm_prompts[:batch], SamplingParams(max_tokens=32), use_tqdm=False)
    for rep in range(args.first_rep, args.first_rep + args.reps):
        for dataset in args.datasets:
            for temperature in args.temperatures:
                if temperature > 0 and system in STOCK_SPEC_SYSTEMS and args.cpu:
                    continue
                for batch in args.batch_sizes:
                    n = max(batch, args.num_prompts)
                    prompts = load_prompts(dataset, n, tokenizer)
                    # Sampled outputs differ between systems (each draws its own sample
                    # of the same distribution), so their lengths do: one early EOS in a
                    # batch can halve a row's tok/s. Sampled requests decode max_tokens
                    # each; greedy ones stop where the target stops, the same for every
                    # system (lossless).
                    params = SamplingParams(
                        temperature=temperature,
                        max_tokens=args.max_tokens,
                        seed=1000 + rep,
                        ignore_eos=temperature > 0,
                    )
                    before = spec_counters(llm)
                    if ours:
                        reset_timings(llm)
                        suffix_before = suffix_stats(llm, clear_cache=True)
                    if system == "vllm-suffix":  # its cache of responses starts cold too
                        suffix_stats(llm, clear_cache=True)
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
                        spec=counters_delta(spec_counters(llm), before),
                    )
                    if ours:
                        row["timings"] = read_timings(llm)
                        row["suffix"] = suffix_delta(suffix_stats(llm), suffix_before)
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "timings"}), flush=True)
    shutdown(llm)
    return rows


def summarise_table(rows: list[dict], systems: list[str]) -> tuple[str, list[dict]]:
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
            taus = [t for t in (tau(r["spec"]) for r in mine) if t is not None]
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
                f"{fmt_median([r['tok_s'] for r in mine], 1)} | "
                f"{fmt_median(ratios) if system != 'vanilla' else '1'} | "
                f"{fmt_median(taus) if taus else '-'} | {per_pos or '-'} |"
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
    sources = [
        "",
        "Suffix source (systems with one): share of accepted drafts by source, and the "
        "suffix index's host time per drafting step:",
        "",
        "| dataset | T | batch | system | eagle | suffix | both | suffix ms per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cond in conditions:
        for system in systems:
            mine = [r for r in rows if r["system"] == system and key(r) == cond and r.get("suffix")]
            if not mine:
                continue
            acc = Counter()
            for r in mine:
                acc.update(r["suffix"]["accepted"])
            total = sum(acc.values()) or 1
            steps = sum(r["suffix"]["host_steps"] for r in mine)
            ms = 1000 * sum(r["suffix"]["host_seconds"] for r in mine) / max(steps, 1)
            shares = " | ".join(f"{acc[k] / total:.2f}" for k in ("eagle", "suffix", "both"))
            sources.append(
                f"| {cond[0]} | {cond[1]:g} | {cond[2]} | {system} | {shares} | {ms:.2f} |"
            )
    if len(sources) == 6:
        sources = []
    return "\n".join(lines + split + sources) + "\n", table


def plot_table(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = sorted({(t["dataset"], t["temperature"], t["batch"]) for t in table})
    systems = [s for s in TABLE_SYSTEMS if any(t["system"] == s for t in table) and s != "vanilla"]
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


def add_table_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--head", default=DEFAULT_HEAD)
    p.add_argument("--eagle3-head", default=DEFAULT_EAGLE3_HEAD, help="vllm-eagle3's head")
    p.add_argument("--eagle-config", default=DEFAULT_EAGLE_CONFIG)
    p.add_argument("--eagle2-config", default=DEFAULT_EAGLE2_CONFIG)
    p.add_argument("--auto-config", default=DEFAULT_AUTO_CONFIG)
    p.add_argument("--suffix-config", default=DEFAULT_SUFFIX_CONFIG)
    p.add_argument("--eagle2-suffix-config", default=DEFAULT_EAGLE2_SUFFIX_CONFIG)
    p.add_argument("--systems", default=",".join(TABLE_SYSTEMS))
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
    p.add_argument("--vllm-suffix-k", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/latest"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def table(args, argv: list[str] | None) -> int:
    args.systems = args.systems.split(",")
    args.datasets = args.datasets.split(",")
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.temperatures = [float(x) for x in args.temperatures.split(",")]
    from vllm.platforms import current_platform

    args.cpu = current_platform.is_cpu()

    if run_as_worker(args, run_table_worker):
        return 0
    check_systems(args.systems, TABLE_SYSTEMS + TABLE_OPTIONAL)
    for path, what in ((args.target, "--target"), (args.head, "--head")):
        if not Path(path).is_dir():
            raise SystemExit(
                f"error: {what} '{path}' does not exist. Fix: make setup; "
                ".venv/bin/eagle-vllm prepare smollm2 (target) / make reference-head (head)."
            )
    started = time.time()
    rows = run_systems(__file__, args.systems, argv, args.out, rounds=args.reps)
    md, entries = summarise_table(rows, args.systems)
    header = (
        f"# Benchmark: {Path(args.target).name}, head {Path(args.head).name}\n\n"
        f"Command: `{command_line('benchmarks/bench.py', argv)}`\n\n"
        f"dtype {args.dtype}, enforce_eager, max_tokens {args.max_tokens}, "
        f"{args.num_prompts} prompts per condition (at least the batch size), {args.reps} reps; "
        f"eagle config `{Path(args.eagle_config).name}`, eagle2 config `{Path(args.eagle2_config).name}`; "
        f"wall time {time.time() - started:.0f} s.\n\n"
    )
    write_results(args.out, args, rows, header + md)
    plot_table(entries, Path(args.out + ".png"))
    print(header + md)
    return 0


# -- curve -----------------------------------------------------------------------------


def run_curve_worker(system: str, args) -> list[dict]:
    from vllm import SamplingParams

    # no prefix cache: the repetitions reuse prompts, and a warm cache would hand vanilla
    # and eagle-vllm every full block, vLLM's own EAGLE all but the last (it recomputes
    # that one for its drafter)
    kwargs = engine_kwargs(args.dtype, max(args.concurrency), args.max_model_len)
    llm = build_engine(system, args, **kwargs, enable_prefix_caching=False)
    prompts = interleaved_prompts(args.prompts, llm.get_tokenizer())
    # untimed warm-up loads: prompts the timed ones never are
    warm_prompts = load_prompts("mtbench-turn2", 80, llm.get_tokenizer())
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    rows = []
    for rep in range(args.first_rep, args.first_rep + args.reps):
        for c in args.concurrency:
            n = min(args.requests_per_client * c, len(prompts))  # no prompt twice in a run
            batch = [prompts[(rep * 7 + i) % len(prompts)] for i in range(n)]
            # steady state: the same load once untimed (eagle2-auto measures its arms)
            warm = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens // 2)
            warm_batch = [warm_prompts[(rep * 7 + i) % len(warm_prompts)] for i in range(c)]
            llm.generate(warm_batch, warm, use_tqdm=False)
            if system in PLUGIN_SYSTEMS:  # a suffix cache starts cold: no prompt seen twice
                suffix_stats(llm, clear_cache=True)
            before = spec_counters(llm)
            history_len = 0
            if system == "eagle2-auto":
                history_len = len(sizing_table(llm)["history"])
            start = time.perf_counter()
            outs = generate_in_flight(llm, batch, params, c)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            after = spec_counters(llm)
            drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
            accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
            row = dict(
                system=system,
                rep=rep,
                concurrency=c,
                requests=n,
                tokens=tokens,
                seconds=seconds,
                tok_s=tokens / seconds,
                tau=1 + accepted / drafts if drafts else None,
            )
            if system == "eagle2-auto":
                sizing = sizing_table(llm)
                history = sizing["history"]
                new = history[history_len:] if len(history) < 4096 else history[-200:]
                row["arms"] = Counter(f"{d},{m}" for _, d, m in new).most_common(3)
                # what the sizer believed after the run at this load (its batch bucket):
                # expected tokens per request-step and seconds per step, per measured arm
                bucket = sizer_bucket(sizing, c)
                row["sizer"] = {
                    arm: [v["expected_tokens"], v["seconds"]]
                    for arm, v in bucket.items()
                    if v["seconds"]
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    shutdown(llm)
    return rows


def summarise_curve(rows: list[dict], systems: list[str], levels: list[int]) -> tuple[str, dict]:
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
                cells.append(f"{fmt_median(speeds, 1)} tok/s")
            else:
                cells.append(f"{fmt_median(ratios)}x")
            if ratios:
                curve.setdefault(system, {})[c] = statistics.median(ratios)
        arms = Counter()
        for r in rows:
            if r["system"] == "eagle2-auto" and r["concurrency"] == c:
                arms.update({a: n for a, n in r.get("arms", [])})
        arm_text = ", ".join(f"{a}: {n}" for a, n in arms.most_common(3)) or "-"
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {arm_text} |")
    return "\n".join(lines) + "\n", curve


def plot_curve(curve: dict[str, dict[int, float]], path: Path) -> None:
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


def add_curve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--eagle-config", default=DEFAULT_EAGLE_CONFIG)
    p.add_argument("--eagle2-config", default=DEFAULT_EAGLE2_CONFIG)
    p.add_argument("--auto-config", default=DEFAULT_AUTO_CONFIG)
    p.add_argument("--suffix-config", default=DEFAULT_SUFFIX_CONFIG)
    p.add_argument("--eagle2-suffix-config", default=DEFAULT_EAGLE2_SUFFIX_CONFIG)
    p.add_argument("--systems", default=",".join(CURVE_SYSTEMS))
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=4,
                   help="requests per level: this many times the concurrency, at most the "
                        "distinct prompts (1: one batch that drains)")  # fmt: skip
    p.add_argument("--prompts", default="mtbench,humaneval",
                   help="prompt sets, interleaved into one pool of distinct prompts "
                        "(mtbench: 80, humaneval: 164)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--first-rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/concurrency-latest"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def curve(args, argv: list[str] | None) -> int:
    args.systems = args.systems.split(",")
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    check_systems(args.systems, CURVE_SYSTEMS + CURVE_OPTIONAL)
    if args.requests_per_client < 1:
        raise SystemExit("error: --requests-per-client must be at least 1 (1: one batch)")
    names = args.prompts.split(",")
    pool = sum(len(raw_prompts(name)) for name in names)
    if "mtbench-turn2" in names:
        raise SystemExit(
            "error: --prompts may not hold mtbench-turn2: the untimed warm-up loads use it. "
            "Fix: mtbench, humaneval or both."
        )
    if run_as_worker(args, run_curve_worker):
        return 0

    started = time.time()
    rows = run_systems(__file__, args.systems, argv, args.out, rounds=args.reps)
    md, points = summarise_curve(rows, args.systems, args.concurrency)
    header = (
        f"# Throughput vs concurrency: {Path(args.target).name}\n\n"
        f"Command: `{command_line('benchmarks/bench.py', argv)}`\n\n"
        f"dtype {args.dtype}, enforce_eager, no prefix cache, T={args.temperature:g}, "
        f"{args.max_tokens} tokens per request, c requests in flight until "
        f"{args.requests_per_client}c (at most the {pool} distinct prompts of "
        f"{args.prompts}, interleaved) are done, {args.reps} reps; "
        f"speculative systems as "
        f"ratios to vanilla at the same concurrency; wall time {time.time() - started:.0f} s.\n\n"
    )
    write_results(args.out, args, rows, header + md)
    plot_curve(points, Path(args.out + ".png"))
    print(header + md)
    return 0


def main(argv: list[str] | None = None) -> int:
    modes = {
        "table": (TABLE_HELP, TABLE_DOC, add_table_args, table),
        "curve": (CURVE_HELP, CURVE_DOC, add_curve_args, curve),
    }
    return run_subcommands(__doc__, modes, argv)


if __name__ == "__main__":
    sys.exit(main())
