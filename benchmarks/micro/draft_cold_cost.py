"""A draft pass's parts with the caches warm and cold: what bounds a pass at batch 1.

    .venv/bin/python benchmarks/micro/draft_cold_cost.py
    .venv/bin/python benchmarks/micro/draft_cold_cost.py --draft-dtype int8 --rows 1 4 16

In an engine step the drafter runs right after the target's forward, which streams the
target's weights (540 MB for SmolLM2-135M in fp32) through the caches, so the draft's
own weights (its decoder layer, fc and LM-head rows: 13 MB in bf16) come from memory.
This builds ``configs/eagle2-auto.yaml``'s engine in this process and times, on the
worker, the draft model's calls repeated back to back (warm) and each after a pass over
a 640 MB buffer (cold): ``decode`` (fc and the decoder layer over ``rows`` rows, its
attention replaced by a stand-in that returns the queries) and ``draft_logits`` (the
reduced LM head). Medians of 30 calls, ms.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_profile import add_model_args, in_process_engine  # noqa: E402


def _time_parts(worker, rows_list: list[int], calls: int) -> dict:
    """Run on the worker: warm and cold medians (ms) of the draft model's parts."""
    import functools
    import time

    import torch

    model = worker.model_runner.drafter.model
    hidden = model.config.hidden_size
    layer = model.model.layers[0]

    class QueriesBack(torch.nn.Module):
        def forward(self, q, k, v):
            return q.clone()

    original = layer.self_attn.attn
    layer.self_attn.attn = QueriesBack()
    flush = torch.empty(160_000_000, dtype=torch.float32)  # larger than any cache
    out = {}
    try:
        with torch.inference_mode():
            for rows in rows_list:
                ids = torch.randint(0, 1000, (rows,))
                features = torch.randn(rows, hidden)
                positions = torch.arange(rows) + 100
                parts = {
                    "decode": functools.partial(model.decode, ids, features, positions),
                    "draft_logits": functools.partial(model.draft_logits, features),
                }
                for name, fn in parts.items():
                    for _ in range(5):
                        fn()
                    warm, cold = [], []
                    for _ in range(calls):
                        start = time.perf_counter()
                        fn()
                        warm.append(time.perf_counter() - start)
                    for _ in range(calls):
                        flush.add_(1.0)
                        start = time.perf_counter()
                        fn()
                        cold.append(time.perf_counter() - start)
                    out[f"{name}, {rows} rows"] = (
                        1e3 * sorted(warm)[calls // 2],
                        1e3 * sorted(cold)[calls // 2],
                    )
    finally:
        layer.self_attn.attn = original
    out["draft GEMM dtype"] = str(model.gemm_dtype)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(p)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    llm = in_process_engine("auto", args, 1)
    parts = llm.collective_rpc(_time_parts, args=(args.rows, args.calls))[0]
    print(f"$ .venv/bin/python benchmarks/micro/draft_cold_cost.py {' '.join(sys.argv[1:])}")
    print(f"draft GEMM dtype: {parts.pop('draft GEMM dtype')}")
    print("part: warm ms | cold ms (medians)")
    for name, (warm, cold) in parts.items():
        print(f"{name}: {warm:.3f} | {cold:.3f}")


if __name__ == "__main__":
    main()
