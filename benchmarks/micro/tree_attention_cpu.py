"""CPU cost of the plugin's tree attention against vLLM's own CPU attention kernel.

Same shapes as SmolLM2-135M (9 query heads, 3 KV heads, head 64), block size 128,
random K/V written with vLLM's own cache writer (never zeros). For each (batch,
prefix length, verified tokens) it times:

* vLLM: ``cpu_attention_with_kv_cache`` with a causal mask (what a chain costs);
* fused / torch: ``TreeCPUAttentionImpl.forward`` when every row is a tree row (vLLM's
  kernel is then skipped), by each of its two paths: the fused C++ op
  (``attention/cpu_tree_op.py``, the prefix read in place) and the torch fallback
  (the prefix gathered from the paged cache, then masked SDPA over prefix + ancestors);

and checks that with a chain-shaped (causal) mask all give the same output.

    .venv/bin/python benchmarks/micro/tree_attention_cpu.py [--out benchmarks/results/tree_attention_cpu.md]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

H_Q, H_KV, D, BLOCK = 9, 3, 64, 128


def _time(fn, reps: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def run_case(batch: int, prefix: int, tokens: int, dtype: torch.dtype) -> dict:
    from types import SimpleNamespace

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from eagle_vllm.attention import cpu_tree_op
    from eagle_vllm.attention.cpu_backend import TreeCPUAttentionImpl
    from eagle_vllm.attention.tree_batch import TreeBatch

    g = torch.Generator().manual_seed(0)
    isa = _get_attn_isa(dtype, BLOCK, D)
    seq = prefix + tokens
    blocks_per_req = -(-seq // BLOCK)
    kv_cache = torch.zeros(batch * blocks_per_req + 1, H_KV, BLOCK, 2 * D, dtype=dtype)
    block_table = (torch.randperm(batch * blocks_per_req, generator=g) + 1).view(batch, -1)
    block_table = block_table.to(torch.int32)
    pos = torch.arange(seq)
    slots = (block_table[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).reshape(-1)
    keys = torch.randn(batch * seq, H_KV, D, generator=g).to(dtype)
    values = torch.randn(batch * seq, H_KV, D, generator=g).to(dtype)
    view = kv_cache.view(kv_cache.shape[0], H_KV, BLOCK * 2, D)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip

    query = torch.randn(batch * tokens, H_Q, D, generator=g).to(dtype)
    out = torch.empty_like(query)
    query_start = torch.arange(batch + 1, dtype=torch.int32) * tokens
    seq_lens = torch.full((batch,), seq, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=H_Q, num_kv_heads=H_KV, head_dim=D, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto",
    )  # fmt: skip
    scale = D**-0.5

    def vllm_kernel():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start, seq_lens=seq_lens, scale=scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
            scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=1.0,
            v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip

    node_k = keys.view(batch, seq, H_KV, D)[:, prefix:].reshape(-1, H_KV, D)
    node_v = values.view(batch, seq, H_KV, D)[:, prefix:].reshape(-1, H_KV, D)
    chain = torch.arange(-1, tokens - 1).expand(batch, -1)  # a chain: the causal mask
    # the plugin's own path; of the impl it reads only these (its __init__ needs a config)
    impl = TreeCPUAttentionImpl.__new__(TreeCPUAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = H_Q, H_KV, D, scale
    layer = SimpleNamespace(isa=isa, layer_name="layer")
    metadata = SimpleNamespace(num_actual_tokens=batch * tokens)
    tree_out = torch.empty(batch * tokens, H_Q * D, dtype=dtype)

    def new_step() -> TreeBatch:
        return TreeBatch(
            batch_rows=torch.arange(batch),
            root_index=torch.arange(batch) * tokens,
            root_pos=torch.full((batch,), prefix),
            num_nodes=torch.full((batch,), tokens),
            parents=chain.clone(),
            depths=torch.arange(tokens).expand(batch, -1).clone(),
            block_table=block_table,
        )

    step = new_step()

    def tree():  # one layer; the step's plan (masks, indices) is built at the first call
        metadata.eagle_tree_batch = step  # as vllm_surface.attach_tree_batch hands it
        impl.forward(layer, query, node_k, node_v, kv_cache, metadata, tree_out)
        return tree_out

    def plan():  # once per step, for all layers (the torch path also builds its mask)
        p = new_step().attention_plan(dtype, BLOCK)
        if path == "torch":
            p.mask  # noqa: B018 (a lazy property: built on first use)

    vllm_kernel()
    row = {"batch": batch, "prefix": prefix, "tokens": tokens, "vllm_ms": _time(vllm_kernel)}
    for path in ("fused", "torch"):
        os.environ["EAGLE_VLLM_TREE_ATTENTION"] = path
        cpu_tree_op.load.cache_clear()
        if path == "fused" and cpu_tree_op.load() is None:
            raise SystemExit("the fused op did not build (see the warning above)")
        step = new_step()
        err = (tree().view(-1, H_Q, D).float() - out.float()).abs().max().item()
        row |= {f"{path}_ms": _time(tree), f"{path}_plan_ms": _time(plan), f"{path}_err": err}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/tree_attention_cpu.md")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prefixes", default="256,1024")
    parser.add_argument("--tokens", default="4,9,16,32", help="nodes per tree (a chain's shape)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    rows = []
    for dtype in (torch.float32,):
        for batch in ints(args.batches):
            for prefix in ints(args.prefixes):
                for tokens in ints(args.tokens):
                    r = run_case(batch, prefix, tokens, dtype)
                    rows.append(r)
                    print(r, flush=True)
    lines = [
        "# Tree attention on CPU vs vLLM's CPU attention kernel",
        "",
        f"Command: `.venv/bin/python benchmarks/micro/tree_attention_cpu.py` (fp32, {torch.get_num_threads()}"
        " threads, SmolLM2 shapes: 9 q heads, 3 kv heads, head 64, block 128). Best of 3x20.",
        "`fused` and `torch` are the plugin's tree attention in one layer",
        "(`TreeCPUAttentionImpl`, every row a tree row), which replaces vLLM's kernel in a",
        "tree step: the fused C++ op (the prefix read in place from the paged cache) and the",
        "torch fallback (the prefix gathered, then masked SDPA). `plan` is built once per",
        "step for all layers (indices; the torch path's additive mask too). `max err`",
        "compares each with vLLM's kernel on a chain-shaped (causal) mask.",
        "",
        "| batch | prefix | tokens/request | vLLM kernel ms | fused ms | fused / vLLM |"
        " torch ms | torch / vLLM | plan ms fused / torch | max err fused / torch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['prefix']} | {r['tokens']} | {r['vllm_ms']:.3f} | "
            f"{r['fused_ms']:.3f} | {r['fused_ms'] / r['vllm_ms']:.1f}x | {r['torch_ms']:.3f} | "
            f"{r['torch_ms'] / r['vllm_ms']:.1f}x | {r['fused_plan_ms']:.3f} / "
            f"{r['torch_plan_ms']:.3f} | {r['fused_err']:.1e} / {r['torch_err']:.1e} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
