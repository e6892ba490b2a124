"""What the benchmark scripts share: prompts, named systems, engine settings, vLLM's
spec-decode counters, the plugin's timing and sizing RPCs, formatting, and running each
system in its own engine process.

Imported by ``bench.py`` and ``step_profile.py`` (``sys.path`` holds ``benchmarks/`` when
either runs as a script). Importing it loads neither vLLM nor eagle_vllm: each helper
imports what it needs when called, so every script's ``--help`` works without them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = str(ROOT / "models/SmolLM2-135M-Instruct")
DEFAULT_HEAD = str(ROOT / "heads/smollm2-135m-instruct-eagle")
DEFAULT_EAGLE3_HEAD = str(ROOT / "heads/smollm2-135m-instruct-eagle3")
DEFAULT_EAGLE_CONFIG = str(ROOT / "configs/eagle.yaml")
DEFAULT_EAGLE2_CONFIG = str(ROOT / "configs/eagle2.yaml")
DEFAULT_AUTO_CONFIG = str(ROOT / "configs/eagle2-auto.yaml")
DEFAULT_SUFFIX_CONFIG = str(ROOT / "configs/suffix.yaml")
DEFAULT_EAGLE2_SUFFIX_CONFIG = str(ROOT / "configs/eagle2-suffix.yaml")

# Every named system a benchmark can run; each script accepts a subset.
SYSTEMS = {
    "vanilla": "vLLM without speculation (the reference every ratio is against)",
    "ngram": "vLLM's built-in n-gram speculation",
    "vllm-eagle": "vLLM's built-in EAGLE chain with the same head",
    "vllm-eagle3": "vLLM's built-in EAGLE-3 chain (method eagle3) with --eagle3-head",
    "eagle": "eagle-vllm chain (--eagle-config)",
    "eagle2": "eagle-vllm tree (--eagle2-config)",
    "eagle2-auto": "eagle-vllm tree with load-aware sizing (--auto-config)",
    "suffix": "eagle-vllm model-free suffix trees (--suffix-config)",
    "eagle2-suffix": "eagle-vllm tree merged with suffix candidates (--eagle2-suffix-config)",
    "eagle2-auto-nosuffix": "--auto-config without its suffix section (the source's A/B)",
    "eagle2-auto-nocontext": "--auto-config with draft_vocab_context: false (its A/B)",
    "vllm-suffix": "vLLM's built-in suffix decoding (arctic-inference; --vllm-suffix-k drafts)",
    # on the plugin's worker, whose runner times the same phases as the plugin's own steps
    "vanilla-timed": "vanilla vLLM on the plugin's worker (its runner times the phases)",
    "ngram-timed": "vLLM's ngram set never to match (a 40-token n-gram) on the plugin's worker",
    # --auto-config with the sizer pinned to one arm (EAGLE_VLLM_SIZER_PIN), or free
    "off": "--auto-config pinned to no drafts (EAGLE_VLLM_SIZER_PIN=0,1)",
    "one-draft": "--auto-config pinned to one draft pass and a 2-node tree (1,2)",
    "tree-1-4": "--auto-config pinned to one pass of a 4-node tree (1,4)",
    "tree-2-6": "--auto-config pinned to two passes of a 6-node tree (2,6)",
    "auto": "--auto-config, the sizer's own choice",
}
# the systems served by eagle_vllm.LLM from one of their configs (args attribute)
PLUGIN_CONFIGS = {
    "eagle": "eagle_config",
    "eagle2": "eagle2_config",
    "eagle2-auto": "auto_config",
    "suffix": "suffix_config",
    "eagle2-suffix": "eagle2_suffix_config",
}
PLUGIN_SYSTEMS = tuple(PLUGIN_CONFIGS)
# vLLM's own speculative decoding (its CPU build mis-expands sampled batches)
STOCK_SPEC_SYSTEMS = ("ngram", "vllm-eagle", "vllm-eagle3", "vllm-suffix")
# the --auto-config systems: the arm ``passes,nodes`` every step is pinned to, or None (free)
PINS = {"off": "0,1", "one-draft": "1,2", "tree-1-4": "1,4", "tree-2-6": "2,6", "auto": None}


# -- prompts and counters --------------------------------------------------------------


PROMPT_SETS = ("mtbench", "mtbench-turn2", "humaneval")


def raw_prompts(dataset: str) -> list[str]:
    """The texts of a prompt set: MT-bench's 80 first (``mtbench``) or second
    (``mtbench-turn2``) turns, round-robin over its eight categories so that the first
    few mix them, or HumanEval's 164 stubs. ``mtbench:CATEGORY`` (or
    ``mtbench-turn2:CATEGORY``) is one category's ten, ``mtbench:writing`` for instance."""
    from eagle_vllm.datasets import humaneval_prompts, mtbench_prompts

    name, _, category = dataset.partition(":")
    if name in ("mtbench", "mtbench-turn2"):
        try:
            return mtbench_prompts(1 if name == "mtbench-turn2" else 0, category or None)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    if name == "humaneval" and not category:
        return humaneval_prompts()
    raise SystemExit(
        f"error: unknown prompt set '{dataset}'. Fix: one of {', '.join(PROMPT_SETS)}"
        " (MT-bench's also as mtbench:CATEGORY)."
    )


def load_prompts(dataset: str, n: int | None, tokenizer) -> list[str]:
    """The first ``n`` (None: all) prompts of a set: MT-bench turns in the target's chat
    template (a second turn alone, without its first), HumanEval stubs raw (completion)."""
    texts = raw_prompts(dataset)[:n]
    if dataset.startswith("humaneval"):
        return texts
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in texts
    ]


def interleaved_prompts(datasets: str, tokenizer) -> list[str]:
    """Every prompt of the comma-separated sets, taken round-robin (a set that runs out
    drops out), so any window of the pool mixes them."""
    sets = [load_prompts(name, None, tokenizer) for name in datasets.split(",")]
    return [s[i] for i in range(max(map(len, sets))) for s in sets if i < len(s)]


def generate_in_flight(llm, prompts: list, params, concurrency: int) -> list:
    """Decode ``prompts`` with ``concurrency`` requests in flight: the first
    ``concurrency`` start together and each finished request's slot goes to the next
    prompt, as a server with that many clients sees (a single batch instead drains: its
    last steps run fewer requests, the slower ones). Outputs in the prompts' order."""
    engine = llm.llm_engine
    waiting = list(enumerate(prompts))
    index_of: dict[str, int] = {}
    done: dict[int, object] = {}

    def start(count: int) -> None:
        for _ in range(min(count, len(waiting))):
            i, prompt = waiting.pop(0)
            (request_id,) = llm.enqueue([prompt], params, use_tqdm=False)
            # outputs carry the id vLLM was given, enqueue returns it with a random
            # suffix (vLLM 0.32's InputProcessor.assign_request_id): key by both
            index_of[request_id] = index_of[request_id.rsplit("-", 1)[0]] = i

    start(concurrency)
    while engine.has_unfinished_requests():
        finished = [out for out in engine.step() if out.finished]
        for out in finished:
            done[index_of[out.request_id]] = out
        start(len(finished))
    if len(done) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(done)} of {len(prompts)} requests never finished")
    return [done[i] for i in range(len(prompts))]


def spec_counters(llm) -> dict:
    """vLLM's own spec-decode counters (``vllm:spec_decode_*``), by short name."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.removeprefix("vllm:spec_decode_")] = (
                list(m.values) if hasattr(m, "values") else m.value
            )
    return out


def counters_delta(after: dict, before: dict) -> dict:
    """``after - before`` for two ``spec_counters`` readings (per-position lists too)."""
    out = {}
    for k, v in after.items():
        b = before.get(k, 0 if not isinstance(v, list) else [0] * len(v))
        out[k] = [x - y for x, y in zip(v, b)] if isinstance(v, list) else v - b
    return out


def tau(spec: dict) -> float | None:
    """Mean acceptance length ``1 + accepted / drafts`` of a counters delta (None: no drafts)."""
    drafts = spec.get("num_drafts", 0)
    return 1 + spec.get("num_accepted_tokens", 0) / drafts if drafts else None


def fmt_median(values: list[float], digits: int = 2) -> str:
    """``median [min-max]`` of repeated measurements (just the value when there is one)."""
    if not values:
        return "n/a"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


# -- engines ---------------------------------------------------------------------------


def engine_kwargs(
    dtype: str, max_num_seqs: int, max_model_len: int = 2048, log_stats: bool = True
) -> dict:
    """The settings every system of a run shares: eager, seed 0, one ``max_num_seqs``.
    ``log_stats`` keeps vLLM's stat loggers on (its spec-decode counters need them);
    without it vLLM's default applies."""
    kwargs = dict(
        dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=0,
        max_num_seqs=max_num_seqs,
    )  # fmt: skip
    if log_stats:
        kwargs["disable_log_stats"] = False
    return kwargs


def _edited_config(
    path: str, drop: str | None = None, draft_dtype: str | None = None, **overrides
) -> dict:
    """The config file at ``path`` as a dict (its model and sizing-profile paths made
    absolute), without the key ``drop``, with ``draft_dtype`` set if given and the keys ``overrides`` set."""
    import yaml

    path = Path(path).resolve()
    config = yaml.safe_load(path.read_text())
    config.pop(drop, None)
    config.update(overrides)
    if draft_dtype:
        config["draft_dtype"] = draft_dtype
    config["model"] = str((path.parent / config["model"]).resolve())
    if "sizing_profile" in config:  # relative to the file, as a config file's paths are
        config["sizing_profile"] = str((path.parent / config["sizing_profile"]).resolve())
    return config


def build_engine(system: str, args, **kwargs):
    """The engine of one named system (``SYSTEMS``) on ``args.target``, built with
    ``kwargs`` (``engine_kwargs``). Reads from ``args`` what the system needs:
    ``eagle_config`` / ``eagle2_config`` / ``auto_config``, ``head`` / ``eagle3_head`` and
    ``vllm_eagle_k`` (vllm-eagle / vllm-eagle3), ``ngram_k`` (ngram), and ``draft_dtype``
    (if set, it overrides the plugin configs' key). Pinned systems (``PINS``) set
    ``EAGLE_VLLM_SIZER_PIN`` in this process's environment, which the engine (in this
    process or its child) reads."""
    draft_dtype = getattr(args, "draft_dtype", None)
    if system == "eagle2-auto-nosuffix":  # --auto-config without its suffix section
        from eagle_vllm import LLM

        config = _edited_config(args.auto_config, drop="suffix", draft_dtype=draft_dtype)
        return LLM(args.target, speculative_config=config, **kwargs)
    if system == "eagle2-auto-nocontext":  # --auto-config without the context vocabulary
        from eagle_vllm import LLM

        config = _edited_config(args.auto_config, draft_dtype=draft_dtype,
                                draft_vocab_context=False)  # fmt: skip
        return LLM(args.target, speculative_config=config, **kwargs)
    if system in PLUGIN_SYSTEMS or system in PINS:
        from eagle_vllm import LLM

        if PINS.get(system):
            os.environ["EAGLE_VLLM_SIZER_PIN"] = PINS[system]
        config = getattr(args, PLUGIN_CONFIGS.get(system, "auto_config"))
        if draft_dtype:
            config = _edited_config(config, draft_dtype=draft_dtype)
        return LLM(args.target, speculative_config=config, **kwargs)
    import vllm

    if system == "vanilla":
        return vllm.LLM(args.target, **kwargs)
    if system == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.ngram_k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
        return vllm.LLM(args.target, speculative_config=spec, **kwargs)
    if system == "vllm-suffix":
        # arctic-inference's suffix tree, built alone by benchmarks/build_arctic_suffix.sh;
        # on PYTHONPATH too, for an engine-core process
        pkg = ROOT / ".arctic/pkg"
        if pkg.is_dir():
            sys.path.insert(0, str(pkg))
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(pkg), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
        try:
            import arctic_inference.suffix_decoding  # noqa: F401
        except ImportError as exc:
            raise SystemExit(
                f"error: vllm-suffix needs the arctic-inference package ({exc}). "
                "Fix: make vllm-suffix (benchmarks/build_arctic_suffix.sh), or drop the system."
            ) from None
        from eagle_vllm.config import WORKER_CLS

        # on the plugin's worker, which runs vLLM's own decoding unchanged and can empty
        # vLLM's suffix cache between measurements (RPC eagle_vllm_suffix)
        spec = {"method": "suffix", "num_speculative_tokens": args.vllm_suffix_k}
        return vllm.LLM(args.target, speculative_config=spec, worker_cls=WORKER_CLS, **kwargs)
    if system in ("vllm-eagle", "vllm-eagle3"):
        method, head = (
            ("eagle", args.head) if system == "vllm-eagle" else ("eagle3", args.eagle3_head)
        )
        spec = {"method": method, "model": head, "num_speculative_tokens": args.vllm_eagle_k}
        return vllm.LLM(args.target, speculative_config=spec, **kwargs)
    if system in ("vanilla-timed", "ngram-timed"):
        from eagle_vllm.config import WORKER_CLS

        if system == "vanilla-timed":
            return vllm.LLM(args.target, worker_cls=WORKER_CLS, **kwargs)
        never = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 40,
                 "prompt_lookup_max": 40}  # fmt: skip
        return vllm.LLM(args.target, worker_cls=WORKER_CLS, speculative_config=never, **kwargs)
    raise SystemExit(f"error: unknown system '{system}' (use {', '.join(SYSTEMS)})")


def shutdown(llm) -> None:
    """Stop the engine core now (not at interpreter exit)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def suffix_stats(llm, clear_cache: bool = False) -> dict:
    """The suffix source's totals ({} without one); ``clear_cache`` empties its cache of
    past responses first, so the next measurement starts cold (the seed corpus stays)."""
    return llm.collective_rpc("eagle_vllm_suffix", kwargs={"clear_cache": clear_cache})[0]


def suffix_delta(after: dict, before: dict) -> dict:
    """What one measurement added: accepted drafts per source, host time per step."""
    if not after:
        return {}
    accepted = {k: v - before.get("accepted", {}).get(k, 0) for k, v in after["accepted"].items()}
    steps = after["host_steps"] - before.get("host_steps", 0)
    seconds = after["host_seconds"] - before.get("host_seconds", 0.0)
    return {"accepted": accepted, "host_steps": steps, "host_seconds": seconds}


def reset_timings(llm) -> None:
    """Zero the plugin runner's phase timers (``eagle_vllm_timings`` RPC)."""
    llm.collective_rpc("eagle_vllm_timings", kwargs={"reset": True})


def read_timings(llm, reset: bool = False) -> dict:
    """Seconds and calls per runner phase since the last reset, rank 0's
    (``{"phase": {"seconds": s, "calls": n}}``); ``reset`` zeroes them after reading."""
    if reset:
        return llm.collective_rpc("eagle_vllm_timings", kwargs={"reset": True})[0]
    return llm.collective_rpc("eagle_vllm_timings")[0]


def sizing_table(llm) -> dict:
    """The load-aware sizer's table and recent choices, rank 0's (``eagle_vllm_sizing``)."""
    return llm.collective_rpc("eagle_vllm_sizing")[0]


def sizer_bucket(table: dict, batch: int) -> dict:
    """The sizer's per-arm figures for the batch bucket (next power of two) of ``batch``."""
    return table["buckets"].get(1 << max(0, (batch - 1).bit_length()), {})


# -- one engine process per system ----------------------------------------------------


def check_systems(systems: list[str], known) -> None:
    """Refuse unknown systems, and runs without vanilla (every ratio is against it)."""
    for system in systems:
        if system not in known:
            raise SystemExit(f"error: --systems: unknown '{system}' (use {', '.join(known)})")
    if "vanilla" not in systems:
        raise SystemExit("error: --systems must include vanilla: every ratio is against it")


def worker_env() -> dict:
    """The environment every system's process gets: the KV cache size
    (``VLLM_CPU_KVCACHE_SPACE``, 4 GiB unless set), threads bound to every core, and the
    venv's Intel OpenMP preloaded when it has one and ``LD_PRELOAD`` is not set."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and "LD_PRELOAD" not in env:
        # vLLM's CPU install guide preloads Intel OpenMP; its CPU worker warns that
        # speculative decoding loses much without it. Every system gets the same.
        env["LD_PRELOAD"] = str(iomp)
    return env


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
    """Run ``script ARGV --worker SYSTEM`` for each system, one after the other, each in its
    own process (its own engine, nothing shared); the worker writes its rows to
    ``OUT.SYSTEM.json``. ``argv`` (default ``sys.argv[1:]``) includes any subcommand.
    Same environment for all (``worker_env``).

    ``rounds`` > 0: repetitions interleaved, round r runs every system once with
    ``--reps 1 --first-rep r``, in reversed order every other round, so a slow phase of
    this shared machine (vanilla's speed can drift 25% between two repetitions minutes
    apart) lands on every system, not on the one that happened to run then."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    env = worker_env()
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


# -- output ----------------------------------------------------------------------------


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that made a result, as written in its ``OUT.md``."""
    return " ".join([".venv/bin/python", script, *(argv or sys.argv[1:])])


def write_results(out: str, args, rows: list[dict], md: str) -> None:
    """``OUT.json`` (the arguments and every row) and ``OUT.md``."""
    Path(out + ".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    Path(out + ".md").write_text(md)


def run_subcommands(doc: str, modes: dict, argv: list[str] | None) -> int:
    """Parse ``argv`` as one of ``modes`` (name -> (help, description, add_args, run)) and
    run it. The subcommand stays in argv (worker processes rerun it); ``run`` gets the
    mode's own arguments, so OUT.json records those alone."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="_mode", required=True, metavar="{" + ",".join(modes) + "}")
    for name, (short, description, add_args, _) in modes.items():
        add_args(
            sub.add_parser(
                name,
                help=short,
                description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    args = p.parse_args(argv)
    mode = vars(args).pop("_mode")
    return modes[mode][3](args, argv)
