"""GPU cost of the Triton tree-attention kernel (``eagle_vllm/attention/triton_tree.py``).

Runs on a CUDA GPU with torch and triton only, without vLLM: it imports this checkout's
``eagle_vllm`` straight from the repository (the kernel and the torch reference need
nothing else), so it works on a GPU machine where vLLM is not installed.

For each (shape, batch, tree size, prefix) it builds a random paged KV cache in vLLM
0.32's default GPU layout (logical ``[num_blocks, Hkv, block_size, 2 * D]``, physical
NHD; random everywhere, never zeros; shuffled block tables), random trees, and times:

* ``triton``: ``tree_paged_attention`` (prefix read through the block table + tree mask);
* ``torch ref``: the CPU path's algorithm on the GPU: gather the paged K/V into dense
  tensors, then ``reference.prefix_tree_attention`` (masked SDPA);
* ``sdpa``: ``F.scaled_dot_product_attention`` over the same query rows and the same
  number of keys, dense and unmasked (flash backend where torch has it): what the same
  tokens cost a flash kernel without paging or a tree mask, i.e. a floor.

and checks the kernel against the reference. Shapes: SmolLM2-135M (9 q heads, 3 kv
heads, head 64) and a 7B-like model (32 q heads, 8 kv heads, head 128), one layer.
From the repository root:

    python benchmarks/micro/tree_attention_gpu.py [--dtype bfloat16] [--out FILE.md] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this repo's eagle_vllm, without installing it (or vLLM)
SHAPES = {"smollm2": (9, 3, 64), "7b": (32, 8, 128)}  # q heads, kv heads, head size
BATCHES = (1, 4, 16)
TREE_SIZES = (16, 32, 64)
PREFIXES = (256, 1024, 4096)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time the Triton tree-attention kernel against torch on a CUDA GPU "
        "(torch and triton only, no vLLM needed)."
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--quick", action="store_true", help="batch 4, tree 32, prefix 1024 only")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def random_parents(num_trees: int, num_nodes: int, gen):
    """Random trees in topological order (parent index < child index), root at 0."""
    import torch

    child = torch.arange(1, num_nodes)
    parents = (torch.rand(num_trees, num_nodes - 1, generator=gen) * child).long()
    return torch.cat([torch.full((num_trees, 1), -1), parents], dim=1)


def build_case(shape, batch, tree, prefix, dtype, block_size, seed, dev="cuda"):
    import torch

    from eagle_vllm.attention.triton_tree import (
        ancestor_bits_from_parents,
        ancestor_mask_from_parents,
    )

    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    seq = prefix + tree
    blocks_per_req = -(-seq // block_size)
    num_blocks = batch * blocks_per_req + 1
    # vLLM 0.32's default (LBNHC / NHD) cache: physical [B, N, H, 2D], logical [B, H, N, 2D]
    cache = torch.randn(num_blocks, block_size, hkv, 2 * d, device=dev, dtype=dtype)
    kv_cache = cache.permute(0, 2, 1, 3)
    perm = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_req] + 1
    block_table = perm.view(batch, blocks_per_req).to(torch.int32).to(dev)
    parents = random_parents(batch, tree, gen)
    num_nodes = torch.full((batch,), tree)
    return dict(
        query=torch.randn(batch, tree, hq, d, device=dev, dtype=dtype),
        kv_cache=kv_cache,
        block_table=block_table,
        root_pos=torch.full((batch,), prefix, device=dev),
        num_nodes=num_nodes.to(dev),
        ancestor_bits=ancestor_bits_from_parents(parents, num_nodes).to(dev),
        mask=ancestor_mask_from_parents(parents, num_nodes).to(dev),
        scale=d**-0.5,
        prefix=prefix,
        tree=tree,
    )


def run_triton(c):
    from eagle_vllm.attention.triton_tree import tree_paged_attention

    return tree_paged_attention(
        c["query"],
        c["kv_cache"],
        c["block_table"],
        c["root_pos"],
        c["num_nodes"],
        c["ancestor_bits"],
        c["scale"],
    )


def run_reference(c):
    """Gather prefix + tree K/V from the paged cache, then masked SDPA (the CPU algorithm)."""
    from eagle_vllm.attention.reference import prefix_tree_attention

    key_cache, value_cache = c["kv_cache"].transpose(1, 2).split(c["query"].shape[-1], dim=-1)
    prefix, tree = c["prefix"], c["tree"]
    bs = key_cache.shape[1]
    blocks = c["block_table"][:, : -(-(prefix + tree) // bs)].long()
    keys = key_cache[blocks].flatten(1, 2)  # [B, nblk * bs, H, D]
    values = value_cache[blocks].flatten(1, 2)
    return prefix_tree_attention(
        c["query"],
        keys[:, :prefix],
        values[:, :prefix],
        c["root_pos"],
        keys[:, prefix : prefix + tree],
        values[:, prefix : prefix + tree],
        c["mask"],
        c["scale"],
    )


def make_sdpa(c):
    """Dense unmasked SDPA over the same rows and key count; flash backend when available."""
    import torch
    import torch.nn.functional as F

    q = c["query"].transpose(1, 2).contiguous()  # [B, Hq, T, D]
    batch, hq, _, d = q.shape
    hkv = c["kv_cache"].shape[1]
    n_keys = c["prefix"] + c["tree"]
    k = torch.randn(batch, hkv, n_keys, d, device=q.device, dtype=q.dtype)
    v = torch.randn_like(k)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=c["scale"], enable_gqa=hq != hkv)

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return sdpa()

        flash()
        return flash, "flash"
    except (RuntimeError, ImportError):
        return sdpa, "auto"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "tree_attention_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False). "
            "On CPU, run benchmarks/micro/tree_attention_cpu.py; the kernel's CPU correctness test "
            "is tests/unit/test_triton_tree_attention.py (TRITON_INTERPRET=1).",
            file=sys.stderr,
        )
        return 2
    try:
        import triton
        from triton.testing import do_bench
    except ImportError:
        print("tree_attention_gpu.py needs triton (pip install triton).", file=sys.stderr)
        return 2

    dtype = getattr(torch, args.dtype)
    batches, trees, prefixes = (
        ((4,), (32,), (1024,)) if args.quick else (BATCHES, TREE_SIZES, PREFIXES)
    )
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    device = torch.cuda.get_device_name()
    rows, failures = [], 0
    for shape in args.shapes:
        for batch in batches:
            for tree in trees:
                for prefix in prefixes:
                    c = build_case(shape, batch, tree, prefix, dtype, args.block_size, args.seed)
                    out = run_triton(c)
                    ref = run_reference(c)
                    err = (out.float() - ref.float()).abs().max().item()
                    failures += err > tol
                    sdpa, backend = make_sdpa(c)
                    t_tri = do_bench(lambda c=c: run_triton(c))
                    t_ref = do_bench(lambda c=c: run_reference(c))
                    t_sdpa = do_bench(sdpa)
                    row = (shape, batch, tree, prefix, t_tri, t_ref, t_sdpa, backend, err)
                    rows.append(row)
                    print(" ".join(map(str, row)), flush=True)
                    del c, out, ref
                    torch.cuda.empty_cache()

    lines = [
        "# Tree attention on GPU: Triton kernel vs torch",
        "",
        f"`python benchmarks/micro/tree_attention_gpu.py` on {device}, {args.dtype}, block size "
        f"{args.block_size}, torch {torch.__version__}, triton {triton.__version__}; one layer, "
        "times in ms (triton.testing.do_bench). `torch ref` = paged gather + masked SDPA "
        "(the CPU path's algorithm); `sdpa` = dense unmasked SDPA over the same rows and keys "
        f"(a floor). `max err` = kernel vs torch ref (tolerance {tol:g}).",
        "",
        "| shape (q/kv heads, head) | batch | tree | prefix | triton | torch ref | sdpa "
        "| triton / sdpa | ref / triton | max err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, batch, tree, prefix, t_tri, t_ref, t_sdpa, backend, err in rows:
        hq, hkv, d = SHAPES[shape]
        lines.append(
            f"| {shape} ({hq}/{hkv}, {d}) | {batch} | {tree} | {prefix} | {t_tri:.3f} | "
            f"{t_ref:.3f} | {t_sdpa:.3f} ({backend}) | {t_tri / t_sdpa:.2f}x | "
            f"{t_ref / t_tri:.2f}x | {err:.1e} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)
    if failures:
        print(f"{failures} case(s) above the tolerance {tol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
