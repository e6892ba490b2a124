"""What building a draft tree costs on the host, outside any engine.

    .venv/bin/python benchmarks/micro/builder_cost.py

``TreeBuilder`` (and ``depth_one_tree`` for one pass) over random draft log-probs of a
4096-token draft vocabulary, top-4, for the tree shapes the sizer picks: milliseconds per
tree (median of 7 rounds of 100), one thread. Only the public builder API is used, so the
same command run on an older checkout times that checkout's builder.

``--cold``: each tree is timed alone after a pass over a 640 MB buffer (median of 50), as
in an engine step, where the builder runs after the target's forward has streamed the
target's weights through the caches: then every op's dispatch misses the caches too.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagle_vllm.tree.builder import TreeBuilder, depth_one_tree  # noqa: E402

VOCAB, TOPK = 4096, 4
SHAPES = [(1, 1, 4), (1, 2, 6), (1, 4, 16), (16, 1, 4), (16, 2, 6)]  # batch, passes, nodes


def median_ms(build, rounds: int = 7, calls: int = 100) -> float:
    for _ in range(20):
        build()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            build()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return sorted(times)[rounds // 2]


def median_cold_ms(build, calls: int = 50) -> float:
    flush = torch.empty(160_000_000, dtype=torch.float32)  # larger than any cache
    for _ in range(5):
        build()
    times = []
    for _ in range(calls):
        flush.add_(1.0)
        start = time.perf_counter()
        build()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[calls // 2]


def build_tree(roots, logprobs, nodes: int, token_ids):
    """One tree of ``len(logprobs)`` passes, as the drafter builds it: it reads each
    frontier it feeds to a tree pass (tokens, parents, and the attention mask where the
    builder makes it)."""
    if len(logprobs) == 1:
        return depth_one_tree(roots, logprobs[0], TOPK, nodes, token_ids)
    builder = TreeBuilder(roots, TOPK, nodes, len(logprobs))
    for i, lp in enumerate(logprobs):
        frontier = builder.step(lp, token_ids)
        if i + 1 < len(logprobs):
            frontier.tokens, frontier.parent_frontier_index  # noqa: B018
            getattr(frontier, "ancestor_mask", None)
    return builder.finalize(pad_to=nodes)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cold", action="store_true", help="each tree after the caches are flushed")
    args = p.parse_args()
    timer = median_cold_ms if args.cold else median_ms
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    token_ids = torch.randperm(VOCAB * 8, generator=gen)[:VOCAB]
    for batch, passes, nodes in SHAPES:
        roots = torch.zeros(batch, dtype=torch.long)
        logprobs = [
            torch.log_softmax(torch.randn(batch, 1 if i == 0 else TOPK, VOCAB, generator=gen), -1)
            for i in range(passes)
        ]
        ms = timer(functools.partial(build_tree, roots, logprobs, nodes, token_ids))
        print(f"batch {batch:2d}, {passes} passes, {nodes:2d} nodes: {ms:.3f} ms")


if __name__ == "__main__":
    main()
