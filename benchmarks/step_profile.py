"""What an engine step costs, five ways: one mode per question.

    .venv/bin/python benchmarks/step_profile.py phases --out benchmarks/results/step-profile-cpu
    .venv/bin/python benchmarks/step_profile.py periods --system auto --concurrency 4
    .venv/bin/python benchmarks/step_profile.py cprofile --system off --concurrency 1
    .venv/bin/python benchmarks/step_profile.py arms --arms 0,1 1,3 1,4 2,6 --reps 3
    .venv/bin/python benchmarks/step_profile.py patterns --pattern auto on alt alt5 batchoff

* ``phases``: vanilla against ``configs/eagle2-auto.yaml`` pinned to drafts-off, to one
  draft, and free, each in its own engine process; the runner's phases in ms per step.
* ``periods``: every engine step's wall time, grouped by what the step did.
* ``cprofile``: cProfile of one timed ``generate()``.
* ``arms``: each of the sizer's arms pinned in turn in one engine, phase by phase.
* ``patterns``: acceptance around drafts-off steps, on the tests' tiny models.

The systems (``common.SYSTEMS``): ``vanilla``; ``vanilla-timed`` / ``ngram-timed``
(vanilla vLLM / vLLM's ngram set never to match, on the plugin's worker, whose runner
times the same phases); ``off``, ``one-draft``, ``tree-1-4``, ``tree-2-6`` (the auto
config with the sizer pinned through ``EAGLE_VLLM_SIZER_PIN``) and ``auto`` (free).
``periods``, ``cprofile`` and ``arms`` run the engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the profiler and their patches see the
runner. ``step_profile.py MODE --help`` describes each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DEFAULT_AUTO_CONFIG,
    DEFAULT_TARGET,
    PINS,
    ROOT,
    build_engine,
    check_systems,
    command_line,
    engine_kwargs,
    fmt_median,
    load_prompts,
    read_timings,
    reset_timings,
    run_as_worker,
    run_subcommands,
    run_systems,
    shutdown,
    sizer_bucket,
    sizing_table,
    suffix_stats,
    write_results,
)

from eagle_vllm.config import DRAFT_DTYPES  # noqa: E402

SCRIPT = "benchmarks/step_profile.py"
PHASES_SYSTEMS = ("vanilla", "vanilla-timed", "ngram-timed", "off", "one-draft", "auto")
PERIODS_SYSTEMS = ("vanilla-timed", "off", "one-draft", "auto")
CPROFILE_SYSTEMS = ("vanilla-timed", *PINS)  # off, one-draft, tree-1-4, tree-2-6, auto


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--auto-config", default=DEFAULT_AUTO_CONFIG)
    p.add_argument("--draft-dtype", default=None, choices=DRAFT_DTYPES,
                   help="override the config's draft_dtype (the draft's GEMMs)")  # fmt: skip


def in_process_engine(system: str, args, concurrency: int):
    """An fp32 eager engine in this process (the profiler and patches see its runner):
    ``vanilla-timed`` or ``args.auto_config`` pinned per ``PINS``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    kwargs = engine_kwargs("float32", max(concurrency, 1), log_stats=False)
    return build_engine(system, args, **kwargs)


# -- phases ----------------------------------------------------------------------------

PHASES_DOC = """What one step costs: vanilla vs eagle2-auto pinned to drafts-off and to one draft.

    .venv/bin/python benchmarks/step_profile.py phases --out benchmarks/results/step-profile-cpu

Systems (each its own engine process, same settings, ``common.run_systems``):

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
PHASES = ("target_forward", "verify", "draft", "draft_catch_up", "execute_model", "sample_tokens")


def _engine_steps(timings: dict) -> int:
    """Engine steps in runner timings (``execute_model`` runs once a step), at least 1."""
    return max(timings.get("execute_model", {}).get("calls", 1), 1)


def run_phases_worker(system: str, args) -> list[dict]:
    from vllm import SamplingParams

    # vanilla-timed: vanilla vLLM (no speculation) on the plugin's worker, whose runner times
    # the same phases: a vanilla step's target forward beside the plugin's drafts-off step
    # ngram-timed: the same, with vLLM's ngram speculation set so it never finds a match (a
    # 40-token n-gram): vLLM's spec-decode path without a draft model, beside ``off``
    llm = build_engine(system, args, **engine_kwargs(args.dtype, max(args.concurrency)))
    tokenizer = llm.get_tokenizer()
    prompts = load_prompts("mtbench", 80, tokenizer)
    warm_prompts = load_prompts("humaneval", 80, tokenizer)
    rows = []
    for rep in range(args.first_rep, args.first_rep + args.reps):
        for c in args.concurrency:
            warm = SamplingParams(temperature=0, max_tokens=args.max_tokens // 2, ignore_eos=True)
            llm.generate(warm_prompts[(rep * 7) % 16 :][:c], warm, use_tqdm=False)
            if system != "vanilla":
                reset_timings(llm)
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            batch = [prompts[(rep * 7 + i) % len(prompts)] for i in range(c)]
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            row = dict(system=system, rep=rep, concurrency=c, tok_s=tokens / seconds)
            if system != "vanilla":
                timings = read_timings(llm)
                # per engine step, not per call of the phase: draft_catch_up runs only
                # in the steps where requests catch up
                steps = _engine_steps(timings)
                row["ms_per_step"] = {k: 1000 * v["seconds"] / steps for k, v in timings.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    shutdown(llm)
    return rows


def summarise_phases(rows: list[dict], systems: list[str], levels: list[int]) -> str:
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
            ratio = "1" if system == "vanilla" else f"{fmt_median(ratios)}x"
            lines.append(
                f"| {c} | {system} | {fmt_median(speeds, 1)} | {ratio} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines) + "\n"


def add_phases_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--systems", default=",".join(PHASES_SYSTEMS))
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/step-profile-latest"))
    p.add_argument(
        "--interleave",
        action="store_true",
        help="each repetition in fresh processes, the systems taking turns (ABBA), so that "
        "what one engine process differs from another lands on every system alike",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--first-rep", type=int, default=0, help=argparse.SUPPRESS)


def phases(args, argv: list[str] | None) -> int:
    args.systems = args.systems.split(",")
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    check_systems(args.systems, PHASES_SYSTEMS)
    if run_as_worker(args, run_phases_worker):
        return 0

    started = time.time()
    rounds = args.reps if args.interleave else 0
    rows = run_systems(__file__, args.systems, argv, args.out, rounds=rounds)
    processes = "a fresh engine process per system and repetition, the systems taking turns"
    md = (
        f"# Step profile: {Path(args.target).name}\n\n"
        f"Command: `{command_line(SCRIPT, argv)}`\n\n"
        f"dtype {args.dtype}, enforce_eager, T=0, {args.max_tokens} tokens per request, "
        f"MT-bench first turns (warm-up on HumanEval), {args.reps} reps, median [min-max]; "
        + (f"{processes}; " if args.interleave else "one engine process per system; ")
        + f"phases from the plugin's runner timers; wall time {time.time() - started:.0f} s.\n\n"
        + summarise_phases(rows, args.systems, args.concurrency)
    )
    write_results(args.out, args, rows, md)
    print(md)
    return 0


# -- periods ---------------------------------------------------------------------------

PERIODS_DOC = """Wall time of every engine step, grouped by what the step did (in-process engine).

    .venv/bin/python benchmarks/step_profile.py periods --system auto --concurrency 4
    .venv/bin/python benchmarks/step_profile.py periods --system vanilla-timed --concurrency 4

Systems as in ``cprofile``: ``vanilla-timed`` (vanilla vLLM on the plugin's worker),
``off`` / ``one-draft`` (``configs/eagle2-auto.yaml`` pinned to no drafts / one draft),
``auto`` (the sizer's own choice). Each repetition serves ``--concurrency`` MT-bench
first turns (``--prompts``; after an untimed load of the other set) and prints, per kind
of step (prefill or decode; draft passes run in the step; tree nodes verified in it;
batch size), the number of steps, the median period from one step's start to the next
(what the sizer charges: runner phases plus vLLM's scheduling and output processing),
the median drafting time, the deferred draft KV written, and the runner's own time.
It tells whether two arms really cost the same at a load: when one draft per request
and no drafts are within a few percent of each other, the sizer flips between them.
"""


def add_prompts_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", choices=["mtbench", "humaneval"], default="mtbench",
                   help="timed prompts (the untimed load uses the other set)")  # fmt: skip


def timed_and_untimed_prompts(name: str, tokenizer) -> tuple[list[str], list[str]]:
    """``--prompts``' 80 first turns, and the other set's for the untimed loads."""
    other = {"mtbench": "humaneval", "humaneval": "mtbench"}[name]
    return load_prompts(name, 80, tokenizer), load_prompts(other, 80, tokenizer)


def add_periods_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", choices=PERIODS_SYSTEMS, default="auto")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    add_prompts_arg(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--reps", type=int, default=3)
    add_model_args(p)


def periods(args, argv: list[str] | None) -> int:
    from vllm import SamplingParams

    from eagle_vllm.engine import runner as runner_module
    from eagle_vllm.engine import telemetry

    steps: list[tuple] = []
    step_period = telemetry.step_period
    previous = {"kind": "prefill"}

    def record(step, now: float):  # every step period the runner measures
        period = step_period(step, now)
        if period is None:
            return None
        kind = "decode" if step.decode_only else "prefill"
        if kind == "decode" and previous["kind"] == "prefill":
            kind = "decode, first after prefill"  # a suspected outlier, kept apart
        previous["kind"] = "decode" if step.decode_only else "prefill"
        key = (kind, step.passes, step.verified_nodes, step.batch)
        steps.append((key, period, step.draft_seconds, step.catch_up_seconds,
                      step.runner_seconds))  # fmt: skip
        return period

    runner_module.telemetry.step_period = record  # this process only: the engine runs in it

    llm = in_process_engine(args.system, args, args.concurrency)
    prompts, warm_prompts = timed_and_untimed_prompts(args.prompts, llm.get_tokenizer())
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
        bucket = sizer_bucket(sizing_table(llm), c)
        print(
            "  sizer's arms at this batch: passes,nodes: expected tokens | ms | tok/s per request"
        )
        for arm, row in bucket.items():
            if row["seconds"]:
                print(f"  {arm}: {row['expected_tokens']:.3f} | {1e3 * row['seconds']:.1f} | "
                      f"{row['expected_tokens'] / row['seconds']:.2f}")  # fmt: skip
    return 0


# -- cprofile --------------------------------------------------------------------------

CPROFILE_DOC = """cProfile of one timed ``generate()`` with the engine in this process.

    .venv/bin/python benchmarks/step_profile.py cprofile --system off --concurrency 1
    .venv/bin/python benchmarks/step_profile.py cprofile --system vanilla-timed --concurrency 1
    .venv/bin/python benchmarks/step_profile.py cprofile --system tree-1-4 \\
        --callees 'runner.py:421(propose_draft_token_ids)' 'proposer.py:183(propose)'

Systems: ``vanilla-timed`` (vanilla vLLM on the plugin's worker), ``off`` / ``one-draft``
/ ``tree-1-4`` / ``tree-2-6`` (``configs/eagle2-auto.yaml`` pinned to no drafts / one
draft / one pass of a 4-node tree / two passes of a 6-node tree), ``auto``. Drafting's
own functions, e.g. ``--callees '(draft_tree)' '(_draft_logprobs)'``. The engine runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profile sees the runner, the
drafter and the model. After an untimed warm-up on the same prompts, one ``generate()``
is profiled; prints the wall time, the per-step cost of a few landmarks (target
forward, its GEMMs, the drafter, the verifier) and the top functions by cumulative time.
Run it several times per system: two processes of the same system differ by a few
percent on a shared machine, so one run cannot separate systems closer than that.
"""
# (label, function name as cProfile reports it, file suffix)
LANDMARKS = [
    ("target forward", "_model_forward", "eagle_vllm/engine/runner.py"),
    ("oneDNN GEMMs", "<built-in method torch._ops._C.onednn_mm>", None),
    ("target LM head", "compute_logits", "models/llama.py"),
    ("drafter", "propose_draft_token_ids", "eagle_vllm/engine/runner.py"),
    ("verifier", "_sample", "eagle_vllm/engine/runner.py"),
    ("sample_tokens", "sample_tokens", "eagle_vllm/engine/runner.py"),
]


def landmarks(stats, steps: int) -> list[str]:
    lines = []
    for label, name, suffix in LANDMARKS:
        total = 0.0
        for (filename, _, function), (_, _, _, cumtime, _) in stats.stats.items():
            if function == name and (suffix is None or filename.endswith(suffix)):
                total += cumtime
        lines.append(f"{label}: {1000 * total / max(steps, 1):.2f} ms/step")
    return lines


def callees(stats, pattern: str, steps: int, top: int = 15) -> list[str]:
    """What the functions whose ``file:line(name)`` contains ``pattern`` spend their time
    in: per callee, cumulative ms per step (e.g. ``proposer.py:183(propose)``)."""
    rows: dict[str, float] = {}
    for (filename, line, function), (*_, callers) in stats.stats.items():
        for (c_file, c_line, c_func), timing in callers.items():
            if pattern in f"{c_file}:{c_line}({c_func})":
                name = f"{Path(filename).name}:{line}({function})"
                rows[name] = rows.get(name, 0.0) + timing[3]  # cumulative seconds
    ranked = sorted(rows.items(), key=lambda kv: -kv[1])[:top]
    return [f"  {1000 * t / max(steps, 1):7.3f} ms/step  {name}" for name, t in ranked]


def add_cprofile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", choices=CPROFILE_SYSTEMS, default="off")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--save", default=None, help="also write the raw profile here (pstats)")
    p.add_argument("--callees", nargs="*", default=[],
                   help="also break these functions down by callee, ms/step (substrings "
                   "of file:line(name), e.g. 'proposer.py:183(propose)')")  # fmt: skip
    add_model_args(p)


def cprofile(args, argv: list[str] | None) -> int:
    import cProfile
    import io
    import pstats

    from vllm import SamplingParams

    llm = in_process_engine(args.system, args, args.concurrency)
    prompts = load_prompts("mtbench", 80, llm.get_tokenizer())[: args.concurrency]
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True
    )
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (and prefix cache)

    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    profile.disable()
    seconds = time.perf_counter() - start

    stats = pstats.Stats(profile)
    if args.save:
        stats.dump_stats(args.save)
    steps = sum(
        calls
        for (filename, _, function), (calls, *_) in stats.stats.items()
        if function == "execute_model" and filename.endswith("eagle_vllm/engine/runner.py")
    )
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"system {args.system}, {args.concurrency} requests: {tokens} tokens in "
          f"{seconds:.3f} s under the profiler, {steps} steps")  # fmt: skip
    print("\n".join(landmarks(stats, steps)))
    for pattern in args.callees:
        print(f"callees of {pattern}:")
        print("\n".join(callees(stats, pattern, steps)))
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())
    return 0


# -- arms ------------------------------------------------------------------------------

ARMS_DOC = """What each of the auto sizer's arms costs per step, phase by phase, in one engine.

    .venv/bin/python benchmarks/step_profile.py arms --arms 0,1 1,2 1,3 1,4 2,9 2,16 4,16
    .venv/bin/python benchmarks/step_profile.py arms --arms 1,4 4,16 --first-pass both
    .venv/bin/python benchmarks/step_profile.py arms --prompts humaneval --arms auto 1,3 3,12

One in-process fp32 eager engine serving ``configs/eagle2-auto.yaml`` (or
``--auto-config``); for each arm ``passes,nodes`` in turn the sizer is pinned to it
(``TreeSizer.pinned``, as ``EAGLE_VLLM_SIZER_PIN`` does; ``auto``: the sizer chooses,
with what the engine has measured so far, and its decisions are listed by kind and
arm) and ``--concurrency`` first turns of ``--prompts`` (after an untimed load of the
other set) are decoded to ``--max-tokens``. Prints, per arm and repetition, output
tokens/s, engine steps, wall ms per step and the runner's phases in ms per step
(``eagle_vllm_timings``: ``target_forward`` is the target model's forward, ``draft``
the drafter, ``verify`` the rejection sampler, ``kv_compaction`` the accepted path's
K/V moves), then the sizer's prediction for the arm (tokens/s, tokens per request per
step, ms per step, and the nodes its trees hold where fewer than its size) beside what
the verified trees gave (tokens and nodes per tree). Every run starts with the suffix
source's response cache emptied, so a
prompt decoded by an earlier arm is not drafted from its own past answer. Rounds
interleave the arms, since this machine drifts. ``--profile
passes,nodes`` also runs that arm once more under ``torch.profiler`` and prints the
ops that took the most time (self CPU), with their calls: where a tree's extra nodes
cost time over a chain's (at batch 1, the CPU tree attention, ``attention/cpu_backend.py``).
"""


def _pin_arm(worker, arm: tuple[int, int] | None) -> bool:
    """Run on the worker (``collective_rpc``): pin the sizer to ``arm`` (one of its arms:
    ``arms`` checks them all first; None: the sizer chooses), zero the timers."""
    runner = worker.model_runner
    runner.sizer.pinned = arm
    runner.timings.snapshot(reset=True)
    return True


def _record_decisions(worker) -> bool:
    """Run on the worker: keep every decision the sizer commits (``_decisions``)."""
    sizer = worker.model_runner.sizer
    if not hasattr(sizer, "_decisions"):
        sizer._decisions = []
        commit = sizer.commit

        def recorded(decision):
            sizer._decisions.append(decision)
            return commit(decision)

        sizer.commit = recorded
    sizer._decisions.clear()
    return True


def _decision_summary(worker) -> str:
    """Run on the worker: the decisions committed since ``_record_decisions``, as
    ``kind arm xcount`` in order of first use."""
    from collections import Counter

    counts = Counter((d.kind, d.arm) for d in worker.model_runner.sizer._decisions)
    return " ".join(f"{kind} {d},{m} x{n}" for (kind, (d, m)), n in counts.items())


def _record_trees(worker) -> bool:
    """Run on the worker: count, from now on, the trees the sizer is told were verified
    (``_realised``): per tree, the drafts accepted and the nodes verified."""
    sizer = worker.model_runner.sizer
    if not hasattr(sizer, "_trees"):
        observe = sizer.observe_acceptance

        def counted(depths, valid, accepted, *args, **kwargs):
            verified = valid[:, 0]  # rows of trees verified as drafted
            sizer._trees[0] += int(verified.sum())
            sizer._trees[1] += int((accepted & valid)[:, 1:].sum())
            sizer._trees[2] += int(valid[verified].sum())
            return observe(depths, valid, accepted, *args, **kwargs)

        sizer.observe_acceptance = counted
    sizer._trees = [0, 0, 0]
    return True


def _realised(worker) -> str:
    """Run on the worker: what the trees counted since ``_record_trees`` gave: tokens per
    tree (accepted drafts plus the target's own), nodes per tree, trees."""
    trees, accepted, nodes = worker.model_runner.sizer._trees
    if not trees:
        return "no trees"
    return f"{1 + accepted / trees:.3f} tokens, {nodes / trees:.2f} nodes per tree, {trees} trees"


def _sizer_arms(worker) -> list[tuple[int, int]]:
    """Run on the worker: the sizer's arms."""
    return list(worker.model_runner.sizer.arms)


def _set_first_pass(worker, full: bool) -> bool:
    """Run on the worker: ``full`` makes the drafter's first pass run the last draft layer
    on every row, as before it ran only at the rows read (``--first-pass both``)."""
    import contextlib

    drafter = worker.model_runner.drafter
    if full:
        drafter._last_layer_outputs_only_at = lambda rows: contextlib.nullcontext()
    else:
        vars(drafter).pop("_last_layer_outputs_only_at", None)
    return True


def add_arms_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", nargs="+", default=["0,1", "1,2", "1,3", "1,4", "2,9", "2,16"],
                   help="passes,nodes pairs (the sizer's arms), or auto (the sizer free)")  # fmt: skip
    add_prompts_arg(p)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per run (default: --concurrency, one batch that drains; "
        "more keep --concurrency in flight, a new one starting as one ends)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the timed requests (T > 0: the sizer's "
                        "sampled mode, verification by rejection sampling)")  # fmt: skip
    p.add_argument("--reps", type=int, default=2)
    add_model_args(p)
    p.add_argument("--profile", nargs="*", default=[], help="arms to profile (torch.profiler)")
    p.add_argument("--top", type=int, default=25, help="ops per profile")
    p.add_argument("--first-pass", choices=("trimmed", "full", "both"), default="trimmed",
                   help="the drafter's first pass: the last layer at the rows read only "
                        "(trimmed, the plugin's), at every row (full), or each arm both "
                        "ways in turn (an A/B in one engine)")  # fmt: skip


def predicted(table: dict, concurrency: int, arm: tuple[int, int]) -> str:
    """The sizer's prediction for ``arm`` at ``concurrency`` requests: the throughput it
    compares arms by (requests x expected tokens / step cost), to set beside the measured
    one; the measured includes the prefill steps, which no arm's prediction holds. Where
    the arm's trees come out smaller than its size, the nodes they hold follow."""
    row = sizer_bucket(table, concurrency).get(f"{arm[0]},{arm[1]}") or {}
    seconds, tokens = row.get("seconds"), row.get("expected_tokens")
    if not seconds or tokens is None:
        return "unmeasured"
    nodes = row.get("expected_nodes", arm[1])
    held = f", {nodes:.2f} nodes" if nodes < arm[1] - 0.005 else ""
    return f"{concurrency * tokens / seconds:.1f} ({tokens:.3f}, {1e3 * seconds:.1f} ms{held})"


def arms(args, argv: list[str] | None) -> int:
    try:
        swept = [None if a == "auto" else tuple(int(x) for x in a.split(",")) for a in args.arms]
        profiled = [tuple(int(x) for x in a.split(",")) for a in args.profile]
    except ValueError:
        raise SystemExit(
            f"error: --arms/--profile: expected passes,nodes pairs, got {args.arms} {args.profile}"
        ) from None

    from vllm import SamplingParams

    c = args.concurrency
    n = args.requests or c
    if not c <= n <= 80:  # 80 first turns: no prompt twice in a run
        raise SystemExit(f"error: --requests must be between --concurrency ({c}) and 80")
    llm = in_process_engine("auto", args, c)  # max_num_seqs = c: c requests in flight
    known = [tuple(a) for a in llm.collective_rpc(_sizer_arms)[0]]
    unknown = [a for a in (*swept, *profiled) if a is not None and a not in known]
    if unknown:  # refused before any arm runs, not when the run reaches it
        raise SystemExit(
            f"error: --arms/--profile: {', '.join(f'{d},{m}' for d, m in unknown)} not among "
            f"the sizer's arms for this config: {' '.join(f'{d},{m}' for d, m in known)}"
        )
    prompts, warm_prompts = timed_and_untimed_prompts(args.prompts, llm.get_tokenizer())
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True
    )
    llm.generate(warm_prompts[:c], params, use_tqdm=False)
    modes = ("trimmed", "full") if args.first_pass == "both" else (args.first_pass,)
    print("arm (passes, nodes), rep[, first pass]: tok/s | steps | ms/step | "
          "runner phases, ms/step | the sizer's prediction for the arm: tok/s "
          "(tokens per request per step, ms per step[, nodes per tree]) | what the "
          "verified trees gave")  # fmt: skip
    for rep in range(args.reps):
        order = modes if rep % 2 == 0 else modes[::-1]  # neither always runs first
        for arm, mode in ((a, m) for a in swept for m in order):
            llm.collective_rpc(_set_first_pass, args=(mode == "full",))
            llm.collective_rpc(_pin_arm, args=(arm,))
            llm.collective_rpc(_record_trees)
            if arm is None:
                llm.collective_rpc(_record_decisions)
            batch = [prompts[(10 + 7 * rep + i) % 80] for i in range(n)]
            suffix_stats(llm, clear_cache=True)  # every run drafts from an empty response cache
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            phases = read_timings(llm, reset=True)
            steps = _engine_steps(phases)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            split = " ".join(
                f"{name}={1e3 * v['seconds'] / steps:.1f}" for name, v in sorted(phases.items())
            )
            label = f", {mode}" if len(modes) > 1 else ""
            prediction = "-" if arm is None else predicted(sizing_table(llm), c, arm)
            realised = llm.collective_rpc(_realised)[0]
            print(f"{arm or 'auto'}, {rep}{label}: {tokens / seconds:.1f} | {steps} | "
                  f"{1e3 * seconds / steps:.1f} | {split} | {prediction} | {realised}",
                  flush=True)  # fmt: skip
            if arm is None:  # what the sizer chose, counted by kind and arm
                print(f"  decisions: {llm.collective_rpc(_decision_summary)[0]}", flush=True)
    for arm in profiled:
        from torch.profiler import profile

        llm.collective_rpc(_pin_arm, args=(arm,))
        batch = [prompts[(40 + i) % 80] for i in range(c)]
        with profile() as prof:
            llm.generate(batch, params, use_tqdm=False)
        steps = _engine_steps(read_timings(llm, reset=True))
        print(f"\nprofile of {arm}: {steps} engine steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


# -- draft -----------------------------------------------------------------------------

DRAFT_DOC = """Where the drafter's time goes, part by part, for pinned sizer arms.

    .venv/bin/python benchmarks/step_profile.py draft --arms 1,4 2,6 3,9 --ops 25

One in-process fp32 eager engine serving ``configs/eagle2-auto.yaml`` (as ``arms``); for
each arm ``passes,nodes`` in turn the sizer is pinned to it and ``--concurrency``
MT-bench first turns are decoded to ``--max-tokens``, rounds interleaving the arms. The
drafter's parts are timed with wall clocks around them (ms per engine step):

* ``propose``: the whole drafter call (``EagleTreeProposer.propose``);
* ``first_pass``: the draft over the tokens just verified (``EagleTreeProposer.
  first_pass``: the platform's in-place attention in decode steps, vLLM's attention and
  input preparation in prompt steps);
* ``draft_tree``: expansion and rerank, and inside it ``lm_head`` (the draft LM head and
  log-softmax, every pass), ``prefix_kv`` (the tree passes' attention set up: node
  buffers where the prefix is read in place, else the prefix K/V gathered from the
  paged cache), ``layers`` (the draft's layers over each frontier, passes 2 and
  on), ``builder`` (the tree builder's steps and rerank) and ``tree_rest`` (what is left:
  masks, gathers);
* ``merge``: the suffix candidates merged into the trees;
* ``context_columns``: the step's extra draft columns for the requests' own tokens (the
  columns' table, each request's mask over it, the new columns' LM-head rows gathered;
  ``draft_vocab_context``);
* ``propose_rest``: the rest of ``propose``;
* ``context_sync`` (before ``propose``, outside it): the requests' new tokens added to
  their token sets.

``--layers direct modules`` runs each arm both ways in turn: the draft's decoder layers
called directly (``models/direct_layer.py``) and through vLLM's modules.

``--ops N`` also profiles each arm once more with ``torch.profiler`` and prints the N ops
that took the most self CPU time under each part of ``--ops-under`` (default ``propose``,
the whole drafter), with their calls per step.
"""
DRAFT_PARTS = ("propose", "first_pass", "draft_tree", "lm_head", "prefix_kv", "layers",
               "builder", "merge", "context_columns", "context_sync")  # fmt: skip


def _time_drafter_parts(worker) -> bool:
    """Run on the worker: wrap the drafter's parts in wall clocks (``_drafter_times``)."""
    import functools
    from collections import defaultdict

    from torch.profiler import record_function

    import eagle_vllm.engine.proposer as proposer_module

    drafter = worker.model_runner.drafter
    times = defaultdict(float)
    drafter._drafter_times = times

    def timed(part, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            start = time.perf_counter()
            try:
                with record_function(f"eagle_vllm.{part}"):
                    return fn(*a, **k)
            finally:
                times[part] += time.perf_counter() - start

        return run

    drafter.propose = timed("propose", drafter.propose)
    drafter.draft_tree = timed("draft_tree", drafter.draft_tree)
    drafter._draft_logprobs = timed("lm_head", drafter._draft_logprobs)
    drafter._prefix_attention_shims = timed("prefix_kv", drafter._prefix_attention_shims)
    drafter._step_context_columns = timed("context_columns", drafter._step_context_columns)
    runner = worker.model_runner
    runner._sync_context_vocab = timed("context_sync", runner._sync_context_vocab)
    # the draft's layers count as ``layers`` in the tree passes, not in the first pass
    in_first_pass = [False]
    first_pass = timed("first_pass", drafter.first_pass)

    def marked_first_pass(*a, **k):
        in_first_pass[0] = True
        try:
            return first_pass(*a, **k)
        finally:
            in_first_pass[0] = False

    decode = drafter.model.decode
    timed_decode = timed("layers", decode)
    drafter.first_pass = marked_first_pass
    drafter.model.decode = lambda *a, **k: (decode if in_first_pass[0] else timed_decode)(*a, **k)
    if not hasattr(proposer_module, "_drafter_times"):
        builder = proposer_module.TreeBuilder
        for name in ("__init__", "step", "finalize"):
            setattr(builder, name, timed("builder", getattr(builder, name)))
        proposer_module.depth_one_tree = timed("builder", proposer_module.depth_one_tree)
        proposer_module.merge_drafts = timed("merge", proposer_module.merge_drafts)
    # the module-level wrappers above add to the current drafter's clocks
    proposer_module._drafter_times = times
    return True


def _read_drafter_parts(worker) -> dict:
    """Run on the worker: the drafter's clocks in seconds since the last read (zeroed)."""
    import eagle_vllm.engine.proposer as proposer_module

    times = proposer_module._drafter_times
    snapshot = dict(times)
    times.clear()
    return snapshot


def _drafter_ops(prof, steps: int, top: int, part: str) -> str:
    """Self CPU time of the ops under the drafter's ``part`` ranges, ms per step."""
    from collections import defaultdict

    self_us, calls = defaultdict(float), defaultdict(int)

    def walk(event) -> None:
        for child in event.cpu_children:
            self_us[child.name] += child.self_cpu_time_total
            calls[child.name] += 1
            walk(child)

    for event in prof.events():
        if event.name == f"eagle_vllm.{part}":
            walk(event)
    rows = sorted(self_us.items(), key=lambda kv: -kv[1])[:top]
    return "\n".join(
        f"  {us / 1e3 / steps:7.3f} ms/step {calls[name] / steps:6.1f} calls/step  {name}"
        for name, us in rows
    )


def add_draft_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--arms", nargs="+", default=["1,4", "2,6", "3,9"],
                   help="passes,nodes pairs (the sizer's arms)")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--ops", type=int, default=0, help="ops per arm under the drafter")
    p.add_argument("--ops-under", nargs="+", default=["propose"], choices=DRAFT_PARTS,
                   help="the drafter's parts whose ops --ops lists")  # fmt: skip
    p.add_argument("--layers", nargs="+", default=["direct"], choices=("direct", "modules"),
                   help="the draft's decoder layers called directly (models/direct_layer.py) "
                        "or through vLLM's modules; both: each arm both ways in turn")  # fmt: skip


def _set_direct_layers(worker, direct: bool) -> bool:
    """Run on the worker: the draft's layers called directly or through vLLM's modules."""
    worker.model_runner.drafter.model.use_direct_layers = direct
    return True


def draft(args, argv: list[str] | None) -> int:
    from vllm import SamplingParams

    swept = [tuple(int(x) for x in a.split(",")) for a in args.arms]
    c = args.concurrency
    llm = in_process_engine("auto", args, c)
    known = [tuple(a) for a in llm.collective_rpc(_sizer_arms)[0]]
    unknown = [a for a in swept if a not in known]
    if unknown:
        raise SystemExit(f"error: --arms: {unknown} not among the sizer's arms: {known}")
    prompts = load_prompts("mtbench", 80, llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(load_prompts("humaneval", 80, llm.get_tokenizer())[:c], params, use_tqdm=False)
    llm.collective_rpc(_time_drafter_parts)
    print(f"$ {command_line(SCRIPT, argv)}")
    print("arm (passes, nodes), rep[, layers]: tok/s | steps | drafter parts, ms per engine step")
    both = len(args.layers) > 1
    for rep in range(args.reps):
        for arm, layers in ((a, v) for a in swept for v in args.layers):
            llm.collective_rpc(_set_direct_layers, args=(layers == "direct",))
            llm.collective_rpc(_pin_arm, args=(arm,))
            batch = [prompts[(10 + 7 * rep + i) % 80] for i in range(c)]
            suffix_stats(llm, clear_cache=True)
            llm.collective_rpc(_read_drafter_parts)
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            steps = _engine_steps(read_timings(llm, reset=True))
            parts = llm.collective_rpc(_read_drafter_parts)[0]
            ms = {k: 1e3 * parts.get(k, 0.0) / steps for k in DRAFT_PARTS}
            ms["tree_rest"] = ms["draft_tree"] - sum(
                ms[k] for k in ("lm_head", "prefix_kv", "layers", "builder")
            )
            ms["propose_rest"] = ms["propose"] - sum(
                ms[k] for k in ("first_pass", "draft_tree", "merge", "context_columns")
            )
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            split = " ".join(f"{k}={v:.2f}" for k, v in ms.items())
            label = f"{arm}, {rep}" + (f", {layers}" if both else "")
            print(f"{label}: {tokens / seconds:.1f} | {steps} | {split}", flush=True)
    if args.ops:
        from torch.profiler import profile

        llm.collective_rpc(_set_direct_layers, args=(args.layers[0] == "direct",))
        for arm in swept:
            llm.collective_rpc(_pin_arm, args=(arm,))
            suffix_stats(llm, clear_cache=True)
            with profile() as prof:
                llm.generate(prompts[40 : 40 + c], params, use_tqdm=False)
            steps = _engine_steps(read_timings(llm, reset=True))
            for part in args.ops_under:
                print(f"\nops under {part}, {arm}: {steps} engine steps")
                print(_drafter_ops(prof, steps, args.ops, part))
    return 0


# -- patterns --------------------------------------------------------------------------

PATTERNS_DOC = """Does turning drafts off, and back on, change how often drafts are accepted?

    .venv/bin/python benchmarks/step_profile.py patterns --pattern auto on alt alt5 batchoff

On the tests' tiny fp32 models (``tests/tiny_models.py``: the context-dependent target
and the noisy oracle draft), eagle2 topk 3 with ``total_tokens: auto``, the workload of
``tests/integration/test_auto_sizing.py``: 9 prompts in a batch, then the first 3 alone.
Each pattern runs in its own in-process engine and fixes the sizer's choice per step:
``auto`` (the sizer decides), ``on`` (one pass of 4 nodes every step), ``alt`` (off and
on, alternating), ``alt5`` (5 steps off, 5 on), ``probe`` (31 off, 1 on), ``batchoff``
(off while more than one request runs). Prints accepted first drafts over drafts, for
the batch phase and in all. If drafts-off steps left the draft KV wrong, acceptance
after them would fall.
"""
PATTERNS = {
    "on": [(1, 4)],
    "alt": [(0, 1), (1, 4)],
    "alt5": [(0, 1)] * 5 + [(1, 4)] * 5,
    "probe": [(0, 1)] * 31 + [(1, 4)],  # long runs off, one drafting step between
}


def run_pattern(pattern: str, root: Path) -> str:
    import itertools

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests/integration")]
    from conftest import ENGINE_KW, spec_metrics
    from test_eagle_chain import PROMPTS, greedy
    from tiny_models import build_draft, build_target

    from eagle_vllm import LLM
    from eagle_vllm.sizing import TreeSizer

    oracle = build_target(root / "target_oracle", oracle=True)
    target = build_target(root / "target", oracle=True, context=0.002)
    draft = build_draft(root / "draft_noisy", oracle, kind="oracle", noise=0.002, attn_noise=0.03)
    if pattern != "auto":
        cycle = itertools.cycle(PATTERNS.get(pattern, [(1, 4)]))

        def decide(self, batch_size, num_sampled=0):
            if pattern == "batchoff":
                arm = (0, 1) if batch_size > 1 else (1, 4)
            else:
                arm = next(cycle)
            self.history.append((batch_size, *arm))
            return arm

        TreeSizer.decide = decide  # this process only: the engine runs in it
    spec = {"method": "eagle2", "model": str(draft), "num_speculative_tokens": 3,
            "total_tokens": "auto", "topk": 3}  # fmt: skip
    llm = LLM(str(target), speculative_config=spec, **ENGINE_KW)
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    batch = spec_metrics(llm)
    for prompt in PROMPTS[:3]:
        llm.generate([prompt], greedy(), use_tqdm=False)
    total = spec_metrics(llm)

    def share(m: dict) -> str:
        first = m["num_accepted_tokens_per_pos"][0] if m["num_drafts"] else 0
        return f"{first}/{m['num_drafts']}"

    return f"{pattern}: batch phase {share(batch)}, in all {share(total)} first drafts accepted"


def add_patterns_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pattern", nargs="+", default=["auto", "on", "alt", "alt5", "batchoff"],
                   choices=["auto", "batchoff", *PATTERNS])  # fmt: skip
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def patterns(args, argv: list[str] | None) -> int:
    import subprocess
    import tempfile

    if args.worker:  # one pattern per process: the patch and the engine die with it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        print(run_pattern(args.worker, Path(tempfile.mkdtemp())), flush=True)
        return 0
    for pattern in args.pattern:
        out = subprocess.run([sys.executable, __file__, "patterns", "--worker", pattern],
                             capture_output=True, text=True, check=True)  # fmt: skip
        print(out.stdout.strip().splitlines()[-1], flush=True)
    return 0


# -- command line ----------------------------------------------------------------------

# mode: (one-line help, description, arguments, run)
MODES = {
    "phases": (
        "vanilla vs the plugin pinned off / to one draft / free: runner phases, ms per step",
        PHASES_DOC, add_phases_args, phases,
    ),
    "periods": (
        "every engine step's period, grouped by what the step did (in-process engine)",
        PERIODS_DOC, add_periods_args, periods,
    ),
    "cprofile": (
        "cProfile of one timed generate(): landmarks and top functions (in-process engine)",
        CPROFILE_DOC, add_cprofile_args, cprofile,
    ),
    "arms": (
        "each sizer arm pinned in turn in one engine: tok/s, ms per step, runner phases",
        ARMS_DOC, add_arms_args, arms,
    ),
    "draft": (
        "the drafter's parts, ms per step, for pinned arms (in-process engine)",
        DRAFT_DOC, add_draft_args, draft,
    ),
    "patterns": (
        "acceptance around drafts-off steps, on the tests' tiny models",
        PATTERNS_DOC, add_patterns_args, patterns,
    ),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return run_subcommands(__doc__, MODES, argv)


if __name__ == "__main__":
    sys.exit(main())
