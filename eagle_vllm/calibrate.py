"""``eagle-vllm calibrate``: measure the load-aware sizer once, write a profile.

    eagle-vllm calibrate --target models/SmolLM2-135M-Instruct \\
        --config configs/eagle2-auto.yaml --out profiles/smollm2-cpu.json --dtype float32

Serves MT-bench first turns with the config (``total_tokens: auto``) at each
concurrency level, long enough for the sizer to measure, in every batch bucket, each
arm that could win (``sizing.py``), then writes its tables (``TreeSizer.export_profile``).
With ``sizing_profile: FILE`` in the config, an engine starts from these costs and
acceptance rates instead of trying every arm in each new bucket while it serves; it
keeps measuring, and its own samples outvote the profile's. A profile describes one
machine, one target, dtype and thread setting, and one tree bound (the config's
``num_speculative_tokens``, ``topk`` and ``max_total_tokens``, checked when a config
is parsed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


def calibrate(
    target: str,
    config: str,
    out: str | Path,
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY,
    max_tokens: int = 64,
    prompts: list[str] | None = None,
    **engine_kwargs,
) -> dict:
    """Run ``config`` at each concurrency level and write the sizer's profile to ``out``.
    ``prompts``: raw prompts (default: MT-bench first turns in the chat template)."""
    from vllm import SamplingParams

    from eagle_vllm import LLM
    from eagle_vllm.config import EagleConfigError, parse_speculative_config
    from eagle_vllm.datasets import mtbench_prompts

    cfg = parse_speculative_config(config, target=target)
    if not cfg.auto_size:
        raise EagleConfigError(
            f"speculative config '{config}': calibrate measures total_tokens: auto. "
            "Fix: use a config with total_tokens: auto (e.g. configs/eagle2-auto.yaml)."
        )
    if not concurrency or min(concurrency) < 1:
        raise ValueError(f"concurrency levels must be 1 or more, got {list(concurrency)}")
    engine_kwargs.setdefault("max_num_seqs", max(concurrency))
    llm = LLM(target, speculative_config=config, **engine_kwargs)
    try:
        if prompts is None:
            tokenizer = llm.get_tokenizer()
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                )
                for q in mtbench_prompts(0)
            ]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        for level, c in enumerate(concurrency):
            batch = [prompts[(7 * level + i) % len(prompts)] for i in range(c)]
            llm.generate(batch, params, use_tqdm=False)
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
        "max_tokens": max_tokens,
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
    p.add_argument("--dtype", default="auto", help="as you serve it (%(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="as you serve it")
    args = p.parse_args(argv)
    try:
        levels = tuple(int(x) for x in args.concurrency.split(","))
    except ValueError:
        p.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    try:
        profile = calibrate(
            args.target,
            args.config,
            args.out,
            concurrency=levels,
            max_tokens=args.max_tokens,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager,
        )
    except ValueError as exc:  # EagleConfigError and bad levels: one clear line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    buckets = sorted({int(k.split(",")[0]) for k in profile["verify_seconds"]})
    print(f"{args.out}: costs for batch buckets {buckets}")
    return 0
