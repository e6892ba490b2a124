"""``eagle-vllm calibrate``: measure the load-aware sizer once, write a profile.

    eagle-vllm calibrate --target models/SmolLM2-135M-Instruct \\
        --config configs/eagle2-auto.yaml --out profiles/smollm2-cpu.json --dtype float32 \\
        --write-config profiles/eagle2-auto-smollm2-cpu.yaml

Serves MT-bench first turns with the config (``total_tokens: auto``) at each
concurrency level and temperature (greedy and sampled requests accept drafts at
different rates, and the sizer keeps both). At each, every arm of the sizer
(``sizing/``) runs in turn, a few steps at a time, in interleaved rounds, so that each
arm's cost and acceptance are measured several times, spread over the run, with a
suffix source's cache emptied before each batch of requests; then the sizer's tables
are written (``TreeSizer.export_profile``). SmolLM2-135M on 2 CPU cores:
about 4 minutes for the levels 1, 4, 16 and 64 at T=0 and T=1 (`make bench`).
With ``sizing_profile: FILE`` in the config, an engine starts from these costs and
acceptance rates instead of trying every arm in each new bucket while it serves; it
keeps measuring, and its own samples outvote the profile's. A profile describes one
machine, one target, dtype and thread setting, and one tree bound (the config's
``num_speculative_tokens``, ``topk`` and ``max_total_tokens``, checked when a config
is parsed). ``--write-config`` also writes a copy of the config that names the
profile (``sizing_profile``), ready for ``vllm serve --speculative-config``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_TEMPERATURES = (0.0, 1.0)
# every arm measured in 3 interleaved rounds of 3 steps: its cost window (9 samples) then
# spans the rounds, and one slow step or the machine's drift between arms measured at
# different times does not decide which arm wins
DEFAULT_VISITS, DEFAULT_STEPS_PER_VISIT = 3, 3
# prompt sets to calibrate on; ``mtbench-turn2`` keeps the first turns (what
# benchmarks/bench.py times) out of the calibration
PROMPT_SETS = ("mtbench", "mtbench-turn2", "humaneval")


def prompt_set(name: str, tokenizer) -> list[str]:
    """Raw prompts of a named set (chat turns in the target's chat template)."""
    from eagle_vllm.datasets import humaneval_prompts, mtbench_prompts

    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set '{name}'. Fix: use one of {list(PROMPT_SETS)}.")
    if name == "humaneval":
        return humaneval_prompts()
    turns = mtbench_prompts(1 if name == "mtbench-turn2" else 0)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in turns
    ]


def write_calibrated_config(config: str | Path, profile: str | Path, out: str | Path) -> Path:
    """Write ``config`` with ``sizing_profile: profile`` to ``out`` (YAML). Relative paths
    are rewritten relative to ``out``'s folder (a config's paths resolve against its
    own folder); the result is checked by parsing it."""
    import os

    import yaml

    from eagle_vllm.config import parse_speculative_config, read_config_file

    data = read_config_file(config)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    here = out.parent.resolve()
    model = Path(data["model"]).expanduser() if data.get("model") else None
    if model is not None and not model.is_absolute():
        model = Path(config).resolve().parent / model
        data["model"] = os.path.relpath(model.resolve(), here)
    data["sizing_profile"] = os.path.relpath(Path(profile).resolve(), here)
    header = (
        f"# {config} with the sizing profile measured by `eagle-vllm calibrate`\n"
        f"# ({Path(profile).name}): the load-aware sizer starts from its costs.\n"
    )
    out.write_text(header + yaml.safe_dump(data, sort_keys=False))
    parse_speculative_config(out)  # the profile must fit the config's tree bound
    return out


def calibrate(
    target: str,
    config: str,
    out: str | Path,
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY,
    max_tokens: int = 64,
    prompts: list[str] | str | None = None,
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES,
    visits: int = DEFAULT_VISITS,
    steps_per_visit: int = DEFAULT_STEPS_PER_VISIT,
    **engine_kwargs,
) -> dict:
    """Run ``config`` at each concurrency level and temperature and write the sizer's
    profile to ``out``. At each, the sizer runs every arm in turn, ``steps_per_visit``
    steps at a time, ``visits`` times over (``TreeSizer.start_sweep``; 0: the sizer
    chooses freely, measuring only what it tries), over as many batches of ``c`` requests
    of ``max_tokens`` tokens as that takes. ``prompts``: raw prompts, or the name of a set in
    ``PROMPT_SETS`` (default: MT-bench first turns in the chat template). A temperature
    above 0 measures the sampled requests' acceptance and the costs of steps with a
    sampled request (the profile's ``acceptance_sampled``, ``verify_seconds_sampled``
    and ``draft_seconds_sampled``)."""
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.config import EagleConfigError, parse_speculative_config

    cfg = parse_speculative_config(config, target=target)
    if not cfg.auto_size:
        raise EagleConfigError(
            f"speculative config '{config}': calibrate measures total_tokens: auto. "
            "Fix: use a config with total_tokens: auto (e.g. configs/eagle2-auto.yaml)."
        )
    if not concurrency or min(concurrency) < 1:
        raise ValueError(f"concurrency levels must be 1 or more, got {list(concurrency)}")
    if not temperatures or min(temperatures) < 0:
        raise ValueError(f"temperatures must be 0 or more, got {list(temperatures)}")
    if visits < 0 or steps_per_visit < 1:
        raise ValueError(
            f"visits must be 0 or more and steps per visit 1 or more, got {visits} and "
            f"{steps_per_visit}"
        )
    engine_kwargs.setdefault("max_num_seqs", max(concurrency))
    llm = LLM(target, speculative_config=config, **engine_kwargs)
    try:
        if prompts is None:
            prompts = prompt_set("mtbench", llm.get_tokenizer())
        elif isinstance(prompts, str):
            prompts = prompt_set(prompts, llm.get_tokenizer())
        start = time.perf_counter()
        for round_, temperature in enumerate(temperatures):
            params = SamplingParams(
                temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=round_
            )
            for level, c in enumerate(concurrency):
                first = 7 * level + 3 * round_
                left = llm.collective_rpc(
                    "eagle_vllm_sizing_sweep", args=(visits, steps_per_visit)
                )[0]
                # each request runs at least one decode step a call: a bound, not a hang
                for call in range(left + 1):
                    batch = [prompts[(first + c * call + i) % len(prompts)] for i in range(c)]
                    # a suffix source starts cold: the prompt set comes round again, and
                    # a cached answer to the same prompt would make deep drafts look sure
                    llm.collective_rpc("eagle_vllm_suffix", kwargs={"clear_cache": True})
                    llm.generate(batch, params, use_tqdm=False)
                    if llm.collective_rpc("eagle_vllm_sizing_sweep")[0] == 0:
                        break
        profile = llm.collective_rpc("eagle_vllm_sizing_profile")[0]
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
    profile["calibration"] = {
        "target": str(target),
        "config": str(config),
        "concurrency": list(concurrency),
        "temperatures": list(temperatures),
        "max_tokens": max_tokens,
        "visits": visits,
        "steps_per_visit": steps_per_visit,
        "engine_kwargs": {k: v for k, v in engine_kwargs.items() if _jsonable(v)},
        "seconds": round(time.perf_counter() - start, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    return profile


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="eagle-vllm calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="target model folder")
    p.add_argument("--config", required=True, help="speculative config with total_tokens: auto")
    p.add_argument("--out", required=True, help="profile to write (JSON)")
    p.add_argument(
        "--concurrency",
        default=",".join(map(str, DEFAULT_CONCURRENCY)),
        help="requests in flight, one level after another (%(default)s)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (%(default)s)")
    p.add_argument(
        "--temperatures",
        default=",".join(map(str, DEFAULT_TEMPERATURES)),
        help="each concurrency level at each (%(default)s): above 0 measures the sampled "
        "requests' acceptance",
    )
    p.add_argument("--visits", type=int, default=DEFAULT_VISITS,
                   help="rounds over every arm at each level (%(default)s; 0: the sizer "
                   "chooses freely and measures only what it tries)")  # fmt: skip
    p.add_argument("--steps-per-visit", type=int, default=DEFAULT_STEPS_PER_VISIT,
                   help="steps an arm runs each round (%(default)s)")  # fmt: skip
    p.add_argument("--prompts", choices=PROMPT_SETS, default="mtbench",
                   help="prompt set to serve (%(default)s)")  # fmt: skip
    p.add_argument("--write-config", default=None,
                   help="also write the config with sizing_profile set to --out (YAML)")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="as you serve it (%(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="as you serve it")
    args = p.parse_args(argv)
    try:
        levels = tuple(int(x) for x in args.concurrency.split(","))
    except ValueError:
        p.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    try:
        temperatures = tuple(float(x) for x in args.temperatures.split(","))
    except ValueError:
        p.error(f"--temperatures: expected comma-separated numbers, got {args.temperatures!r}")
    try:
        profile = calibrate(
            args.target,
            args.config,
            args.out,
            concurrency=levels,
            max_tokens=args.max_tokens,
            prompts=args.prompts,
            temperatures=temperatures,
            visits=args.visits,
            steps_per_visit=args.steps_per_visit,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager,
        )
    except ValueError as exc:  # EagleConfigError and bad levels: one clear line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    buckets = sorted({int(k.split(",")[0]) for k in profile["verify_seconds"]})
    print(f"{args.out}: costs for batch buckets {buckets}")
    if args.write_config:
        try:
            written = write_calibrated_config(args.config, args.out, args.write_config)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{written}: {args.config} with sizing_profile: {Path(args.out).resolve()}")
    return 0
