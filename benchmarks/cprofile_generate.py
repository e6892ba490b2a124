"""cProfile of one timed ``generate()`` with the engine in this process.

    .venv/bin/python benchmarks/cprofile_generate.py --system off --concurrency 1
    .venv/bin/python benchmarks/cprofile_generate.py --system vanilla-timed --concurrency 1
    .venv/bin/python benchmarks/cprofile_generate.py --system tree-1-4 \
        --callees 'runner.py:421(propose_draft_token_ids)' 'proposer.py:183(propose)'

Systems: ``vanilla-timed`` (vanilla vLLM on the plugin's worker), ``off`` / ``one-draft``
/ ``tree-1-4`` / ``tree-2-6`` (``configs/eagle2-auto.yaml`` pinned to no drafts / one
draft / one pass of a 4-node tree / two passes of a 6-node tree), ``auto``. Drafting's
own functions, e.g. ``--callees '(draft_tree)' '(_draft_logprobs)'``. The engine runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profile sees the runner, the
drafter and the model. After an untimed warm-up on the same prompts, one ``generate()``
is profiled; prints the wall time, the per-step cost of a few landmarks (target
forward, its GEMMs, the drafter, the verifier) and the top functions by cumulative time.
Run it several times per system: on this machine two processes of the same system
differ by a few percent (see BENCHMARKS.md, session 6).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

PINS = {"off": "0,1", "one-draft": "1,2", "tree-1-4": "1,4", "tree-2-6": "2,6", "auto": None}
# (label, function name as cProfile reports it, file suffix)
LANDMARKS = [
    ("target forward", "_model_forward", "eagle_vllm/engine/runner.py"),
    ("oneDNN GEMMs", "<built-in method torch._ops._C.onednn_mm>", None),
    ("target LM head", "compute_logits", "models/llama.py"),
    ("drafter", "propose_draft_token_ids", "eagle_vllm/engine/runner.py"),
    ("verifier", "_sample", "eagle_vllm/engine/runner.py"),
    ("sample_tokens", "sample_tokens", "eagle_vllm/engine/runner.py"),
]


def landmarks(stats: pstats.Stats, steps: int) -> list[str]:
    lines = []
    for label, name, suffix in LANDMARKS:
        total = 0.0
        for (filename, _, function), (_, _, _, cumtime, _) in stats.stats.items():
            if function == name and (suffix is None or filename.endswith(suffix)):
                total += cumtime
        lines.append(f"{label}: {1000 * total / max(steps, 1):.2f} ms/step")
    return lines


def callees(stats: pstats.Stats, pattern: str, steps: int, top: int = 15) -> list[str]:
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


def in_process_engine(system: str, target: str, auto_config: str, concurrency: int):
    """An fp32 eager engine in this process (the profiler and patches see its runner):
    ``vanilla-timed`` or ``configs/eagle2-auto.yaml`` pinned per ``PINS``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    common = dict(dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                  max_num_seqs=max(concurrency, 1))  # fmt: skip
    if system == "vanilla-timed":
        import vllm

        from eagle_vllm.config import WORKER_CLS

        return vllm.LLM(target, worker_cls=WORKER_CLS, **common)
    if PINS[system]:
        os.environ["EAGLE_VLLM_SIZER_PIN"] = PINS[system]
    from eagle_vllm import LLM

    return LLM(target, speculative_config=auto_config, **common)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--system", choices=["vanilla-timed", *PINS], default="off")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--save", default=None, help="also write the raw profile here (pstats)")
    p.add_argument("--callees", nargs="*", default=[],
                   help="also break these functions down by callee, ms/step (substrings "
                   "of file:line(name), e.g. 'proposer.py:183(propose)')")  # fmt: skip
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--auto-config", default=str(ROOT / "configs/eagle2-auto.yaml"))
    args = p.parse_args(argv)

    from bench import _prompts
    from vllm import SamplingParams

    llm = in_process_engine(args.system, args.target, args.auto_config, args.concurrency)
    prompts = _prompts("mtbench", 80, llm.get_tokenizer())[: args.concurrency]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
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


if __name__ == "__main__":
    raise SystemExit(main())
