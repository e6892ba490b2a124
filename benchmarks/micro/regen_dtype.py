"""Tokens per second of batched greedy generation in float32 and in bfloat16: what
``eagle-vllm train --regen-dtype auto`` chooses between on a CPU with AVX-512 BF16 or AMX.

The same ShareGPT first turns (skipping the first 3000 conversations, prompts under 3000
characters) answered by the target in one ``LLM.chat`` call per dtype, each in its own
process, 256 sequences in flight, as the regeneration runs them:

    VLLM_CPU_KVCACHE_SPACE=5 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python benchmarks/micro/regen_dtype.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(target: str, dtype: str, num_prompts: int, max_tokens: int) -> None:
    from vllm import LLM, SamplingParams

    from eagle_vllm.datasets import sharegpt_conversations

    firsts = ([m for m in c if m["role"] == "user"][:1] for c in sharegpt_conversations(
        4 * num_prompts, skip=3000))  # fmt: skip
    prompts = [p for p in firsts if p and len(p[0]["content"]) < 3000][:num_prompts]
    llm = LLM(target, dtype=dtype, enforce_eager=True, max_model_len=2048, max_num_seqs=256,
              seed=0)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.chat(prompts[:8], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    print(f"| {dtype} | {len(outs)} | {prompt} | {generated} | {seconds:.1f} | "
          f"{generated / seconds:.1f} |", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=192)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        measure(args.target, args.worker, args.prompts, args.max_tokens)
        return
    print("| dtype | prompts | prompt tokens | generated tokens | seconds | generated tok/s |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):  # a fresh process per dtype
        out = subprocess.run(
            [sys.executable, __file__, "--worker", dtype, "--target", args.target,
             "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        print("\n".join(line for line in out.stdout.splitlines() if line.startswith("| ")))


if __name__ == "__main__":
    main()
