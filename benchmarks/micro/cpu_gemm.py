"""Cost of one linear layer against the tokens in a step, on this CPU, as vLLM runs it.

    .venv/bin/python benchmarks/micro/cpu_gemm.py

bf16 through torch (vLLM's fallback when its oneDNN bf16 linear cannot be built, e.g.
CPUs without AVX-512 BF16) and fp32 through vLLM's oneDNN handle, for SmolLM2's
gate/up projection (3072 x 576). Prints ms per call for 1, 4, 8 and 16 tokens.
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


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    from vllm import _custom_ops as ops

    torch.set_num_threads(2)
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
