"""Cost of linear layers against the tokens in a step, on this CPU, as vLLM runs them.

    .venv/bin/python benchmarks/micro/cpu_gemm.py
    .venv/bin/python benchmarks/micro/cpu_gemm.py --stack

bf16 through torch (vLLM's fallback when its oneDNN bf16 linear cannot be built, e.g.
CPUs without AVX-512 BF16) and fp32 through vLLM's oneDNN handle, for SmolLM2's
gate/up projection (3072 x 576). Prints ms per call for 1, 4, 8 and 16 tokens; one
weight, read from the cache after the first call.

``--stack``: the GEMMs of SmolLM2-135M's 30 decoder layers (qkv 960 x 576, o 576 x 576,
gate/up 3072 x 576, down 576 x 1536; the LM head left out) in turn, each weight its own,
so every call reads its weight from memory as a target forward does. fp32 through
vLLM's oneDNN handle and through torch, ms per stack (the best of 5) for 1-16 tokens:
what each verified token adds to a target step at batch 1.
"""

from __future__ import annotations

import argparse
import time

import torch


def bench(fn, reps: int = 300) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


# SmolLM2-135M's decoder GEMMs per layer (out, in) and its layers
STACK_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
STACK_LAYERS = 30


def stack(ops) -> None:
    """``--stack``: every decoder GEMM of the model in turn, cache-cold."""
    weights = [torch.randn(n, k) for _ in range(STACK_LAYERS) for n, k in STACK_SHAPES]
    handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]
    print(f"{len(weights)} GEMMs, {sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB fp32")
    for tokens in (1, 2, 3, 5, 9, 16):
        inputs = {k: torch.randn(tokens, k) for k in {k for _, k in STACK_SHAPES}}
        row = []
        for name, run in (
            ("fp32 oneDNN", lambda i, x: ops.onednn_mm(handles[i], x, None)),
            ("fp32 torch", lambda i, x: torch.nn.functional.linear(x, weights[i])),
        ):
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    run(i, inputs[w.shape[1]])
                best = min(best, time.perf_counter() - start)
            row.append(f"{name} {best * 1e3:.1f} ms")
        print(f"{tokens:3d} tokens: " + ", ".join(row))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stack", action="store_true",
                        help="the model's 120 decoder GEMMs in turn, cache-cold")  # fmt: skip
    args = parser.parse_args()
    from vllm import _custom_ops as ops

    torch.set_num_threads(2)
    if args.stack:
        stack(ops)
        return
    print("avx512_bf16:", torch.cpu._is_avx512_bf16_supported())
    weight = torch.randn(3072, 576)
    w_bf16 = weight.to(torch.bfloat16)
    try:
        ops.create_onednn_mm(w_bf16.t(), 32)
        print("oneDNN bf16 linear: available")
    except RuntimeError as exc:
        print("oneDNN bf16 linear: unavailable:", str(exc)[:60])
    handle = ops.create_onednn_mm(weight.t(), 32)
    for tokens in (1, 4, 8, 16):
        x = torch.randn(tokens, 576)
        xb = x.to(torch.bfloat16)
        bf16 = bench(lambda xb=xb: torch.nn.functional.linear(xb, w_bf16))
        fp32 = bench(lambda x=x: ops.onednn_mm(handle, x, None))
        print(f"{tokens:3d} tokens: bf16 torch {bf16:.3f} ms, fp32 oneDNN {fp32:.3f} ms")


if __name__ == "__main__":
    main()
