"""What extracting training features costs: the target's forward through transformers, as
``eagle_vllm/train/features.py`` runs it (``model.model(..., output_hidden_states=True)``),
in float32 and in bfloat16.

    .venv/bin/python benchmarks/micro/feature_forward.py

Random token ids in batches of ``--batch`` sequences of ``--length`` tokens; prints tokens
per second per dtype (the best of ``--reps`` forwards, after one warm-up forward).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from eagle_vllm.config import cpu_has_bf16_gemm

    print(f"AVX-512 BF16 or AMX: {cpu_has_bf16_gemm()}, torch threads: {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (args.batch, args.length), generator=gen)
        best = float("inf")
        with torch.inference_mode():
            model.model(input_ids=ids[:2], output_hidden_states=True)
            for _ in range(args.reps):
                start = time.perf_counter()
                model.model(input_ids=ids, output_hidden_states=True)
                best = min(best, time.perf_counter() - start)
        print(f"{str(dtype).removeprefix('torch.')}: {ids.numel() / best:.0f} tok/s")


if __name__ == "__main__":
    main()
