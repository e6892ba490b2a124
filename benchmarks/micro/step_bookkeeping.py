"""Per-step bookkeeping the plugin adds to a batch-1 decode step, timed in isolation.

    .venv/bin/python benchmarks/micro/step_bookkeeping.py

Times, on one thread, the one-pass tree (``depth_one_tree``) against the general
``TreeBuilder`` (one ``step`` + ``finalize``) for a 4-node tree over a 4096-token draft
vocabulary, and the sizer's acceptance update (``AcceptanceStats.update``) for one
request's 4-node tree with the shipped ``eagle2-auto`` bound (depth 4, 16 nodes).
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle_vllm.sizing import AcceptanceStats
from eagle_vllm.tree.builder import TreeBuilder, depth_one_tree


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(1, 1, 4096, generator=gen), dim=-1)
    roots, token_ids = torch.tensor([5]), torch.arange(4096)

    def builder() -> None:
        tb = TreeBuilder(roots, 4, 4, 1)
        tb.step(logprobs, token_ids)
        tb.finalize(pad_to=4)

    stats = AcceptanceStats(max_passes=4, max_nodes=16)
    depths = torch.tensor([[0, 1, 1, 1]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    accepted = torch.tensor([[True, False, True, False]])
    rows = [
        ("TreeBuilder, 1 pass, 4 nodes", per_call_us(builder)),
        ("depth_one_tree, 4 nodes", per_call_us(lambda: depth_one_tree(roots, logprobs, 4, 4, token_ids))),
        ("AcceptanceStats.update, 4 nodes", per_call_us(lambda: stats.update(depths, valid, accepted))),
    ]  # fmt: skip
    for name, us in rows:
        print(f"{name:34s} {us:8.1f} us")


if __name__ == "__main__":
    main()
