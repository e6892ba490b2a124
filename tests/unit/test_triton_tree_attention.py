"""The GPU tree-attention kernel (``eagle_vllm/attention/triton_tree.py``), checked on CPU.

Triton is kept out of the main venv on purpose (beside it vLLM picks another model
runner); ``make setup`` installs it into ``.triton-pkgs``. The kernel tests run this
file as a subprocess with ``PYTHONPATH=.triton-pkgs``:

* ``interpreter`` (``TRITON_INTERPRET=1``): random paged caches (every slot random,
  shuffled block tables, vLLM 0.32 layouts NHD / HND / layer-interleaved and a
  (K, V) pair), several trees per batch (prefix 0, 1, several blocks, trees over 32
  nodes), GQA, fp32 / fp16 / bf16; compared with ``reference.prefix_tree_attention``
  on the dense K/V the cache was filled from. A wrong mask (a sibling made visible)
  must be caught by the same comparison.
* ``compile``: the kernel compiles to sm_80 / sm_90 cubins with the wheel's ptxas (no
  GPU needed), which the interpreter alone does not prove.

The mask helpers and the argument checks run in the main venv, without triton.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle_vllm.attention.reference import prefix_tree_attention
from eagle_vllm.attention.tree_batch import TreeBatch
from eagle_vllm.attention.triton_tree import (
    MAX_TREE_NODES,
    ancestor_bits_from_parents,
    ancestor_mask_from_parents,
    num_mask_words,
    pack_ancestor_mask,
    tree_paged_attention,
    unpack_ancestor_bits,
)

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
TRITON_PKGS = ROOT / ".triton-pkgs"


# --------------------------------------------------------------------------
# shared: random trees and paged caches
# --------------------------------------------------------------------------
def random_parents(g: torch.Generator, num_nodes: int, width: int) -> torch.Tensor:
    """``[width]`` parents of a random tree in topological order, -1 for root and padding."""
    parents = torch.full((width,), -1, dtype=torch.long)
    for i in range(1, num_nodes):
        parents[i] = int(torch.randint(0, i, (1,), generator=g))
    return parents


def make_cache(layout, num_blocks, block_size, num_kv_heads, head_size, dtype, g):
    """A random cache in one of vLLM 0.32's stride orders; returns (kv_cache, K view, V view).

    The views are what TRITON_ATTN / FLASH_ATTN use:
    ``kv_cache.transpose(1, 2).split(head_size, -1)``, ``[blocks, block_size, Hkv, D]``.
    """
    nb, bs, h, c = num_blocks, block_size, num_kv_heads, 2 * head_size
    if layout == "LBNHC":  # default, NHD: physical [B, N, H, C]
        cache = torch.randn(nb, bs, h, c, generator=g).to(dtype).permute(0, 2, 1, 3)
    elif layout == "LBHNC":  # HND: physical [B, H, N, C]
        cache = torch.randn(nb, h, bs, c, generator=g).to(dtype)
    elif layout == "BLNHC":  # layers interleaved per block: this layer is layer 1 of 2
        both = torch.randn(nb, 2, bs, h, c, generator=g).to(dtype)
        cache = both[:, 1].permute(0, 2, 1, 3)
    elif layout == "pair":  # a legacy [2, B, N, H, D] cache, passed as (K, V)
        kv = torch.randn(2, nb, bs, h, head_size, generator=g).to(dtype)
        return (kv[0], kv[1]), kv[0], kv[1]
    else:
        raise ValueError(layout)
    assert cache.shape == (nb, h, bs, c)
    key_cache, value_cache = cache.transpose(1, 2).split(head_size, dim=-1)
    return cache, key_cache, value_cache


def make_case(
    seed,
    prefix_lens,
    tree_sizes,
    *,
    num_q_heads=6,
    num_kv_heads=2,
    head_size=64,
    block_size=16,
    layout="LBNHC",
    dtype=torch.float32,
):
    """Random trees written into a random paged cache, plus the dense oracle inputs."""
    g = torch.Generator().manual_seed(seed)
    num_trees, width = len(prefix_lens), max(tree_sizes)
    root_pos = torch.tensor(prefix_lens)
    num_nodes = torch.tensor(tree_sizes)
    parents = torch.stack([random_parents(g, n, width) for n in tree_sizes])
    seq_len = max(p + width for p in prefix_lens)
    blocks_per_tree = -(-seq_len // block_size)
    num_blocks = num_trees * blocks_per_tree + 5  # spare blocks: random, never read
    block_table = torch.randperm(num_blocks, generator=g)[: num_trees * blocks_per_tree]
    block_table = block_table.view(num_trees, blocks_per_tree).to(torch.int32)
    kv_cache, key_cache, value_cache = make_cache(
        layout, num_blocks, block_size, num_kv_heads, head_size, dtype, g
    )
    # per tree: K/V of positions [0, root_pos + width), written through the block table
    keys = torch.randn(num_trees, seq_len, num_kv_heads, head_size, generator=g).to(dtype)
    values = torch.randn(num_trees, seq_len, num_kv_heads, head_size, generator=g).to(dtype)
    for r in range(num_trees):
        pos = torch.arange(prefix_lens[r] + tree_sizes[r])
        blocks = block_table[r, pos // block_size].long()
        key_cache[blocks, pos % block_size] = keys[r, pos]
        value_cache[blocks, pos % block_size] = values[r, pos]
    query = torch.randn(num_trees, width, num_q_heads, head_size, generator=g).to(dtype)
    node_idx = root_pos[:, None] + torch.arange(width)[None, :]
    node_idx = node_idx.clamp(max=seq_len - 1)
    gather = node_idx[:, :, None, None].expand(-1, -1, num_kv_heads, head_size)
    prefix = max(max(prefix_lens), 1)
    return dict(
        query=query,
        kv_cache=kv_cache,
        block_table=block_table,
        root_pos=root_pos,
        num_nodes=num_nodes,
        parents=parents,
        scale=head_size**-0.5,
        # the oracle's dense inputs: what was written, not read back from the cache
        prefix_k=keys[:, :prefix].float(),
        prefix_v=values[:, :prefix].float(),
        node_k=keys.gather(1, gather).float(),
        node_v=values.gather(1, gather).float(),
        valid=torch.arange(width)[None, :] < num_nodes[:, None],
    )


def oracle(case, mask):
    return prefix_tree_attention(
        case["query"].float(),
        case["prefix_k"],
        case["prefix_v"],
        case["root_pos"],
        case["node_k"],
        case["node_v"],
        mask,
        case["scale"],
    )


def max_err(out, ref, valid):
    return (out.float() - ref)[valid].abs().max().item()


# --------------------------------------------------------------------------
# main venv: mask helpers and argument checks (no triton)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("width", [1, 5, 31, 32, 33, 64, 65, 129])
def test_pack_unpack_roundtrip(width):
    g = torch.Generator().manual_seed(width)
    mask = torch.rand(3, 4, width, generator=g) < 0.5
    bits = pack_ancestor_mask(mask)
    assert bits.dtype == torch.int32 and bits.shape == (3, 4, -(-width // 32))
    assert torch.equal(unpack_ancestor_bits(bits, width), mask)


def test_pack_bit_order():
    mask = torch.zeros(1, 4, 40, dtype=torch.bool)
    mask[0, 0, 0] = True  # word 0, bit 0
    mask[0, 1, 31] = True  # word 0, bit 31: the int32 sign bit
    mask[0, 2, 33] = True  # word 1, bit 1
    mask[0, 3, :32] = True  # all bits of word 0
    bits = pack_ancestor_mask(mask)
    assert bits[0, :, 0].tolist() == [1, -(2**31), 0, -1]
    assert bits[0, :, 1].tolist() == [0, 0, 2, 0]


def test_bits_from_parents_match_tree_batch():
    g = torch.Generator().manual_seed(0)
    sizes = [1, 2, 7, 33, 40]
    width = max(sizes)
    parents = torch.stack([random_parents(g, n, width) for n in sizes])
    batch = TreeBatch(
        batch_rows=torch.arange(len(sizes)),
        root_index=torch.zeros(len(sizes), dtype=torch.long),
        root_pos=torch.zeros(len(sizes), dtype=torch.long),
        num_nodes=torch.tensor(sizes),
        parents=parents,
        depths=torch.zeros_like(parents),
        block_table=torch.zeros(len(sizes), 1, dtype=torch.int32),
    )
    mask = ancestor_mask_from_parents(parents, batch.num_nodes)
    assert torch.equal(mask, batch.ancestor_mask())
    bits = ancestor_bits_from_parents(parents, batch.num_nodes)
    assert torch.equal(unpack_ancestor_bits(bits, width), batch.ancestor_mask())
    # a hand-made tree: 0 -> 1, 0 -> 2, 2 -> 3
    bits = ancestor_bits_from_parents(torch.tensor([[-1, 0, 0, 2]]))
    assert bits[0, :, 0].tolist() == [0b0001, 0b0011, 0b0101, 0b1101]


def test_tree_size_limit():
    assert num_mask_words(MAX_TREE_NODES) == MAX_TREE_NODES // 32
    with pytest.raises(ValueError, match="total_tokens"):
        num_mask_words(MAX_TREE_NODES + 1)
    with pytest.raises(ValueError, match=str(MAX_TREE_NODES)):
        ancestor_bits_from_parents(torch.full((1, MAX_TREE_NODES + 1), -1))


def _args(case, **over):
    args = dict(
        query=case["query"],
        kv_cache=case["kv_cache"],
        block_table=case["block_table"],
        root_pos=case["root_pos"],
        num_nodes=case["num_nodes"],
        ancestor_bits=ancestor_bits_from_parents(case["parents"], case["num_nodes"]),
        scale=case["scale"],
    )
    args.update(over)
    return args


def test_unsupported_layouts_are_refused_before_triton_is_needed():
    case = make_case(0, [3], [2], num_q_heads=2, num_kv_heads=2, head_size=16)
    cache = case["kv_cache"]
    legacy = torch.randn(2, *cache.transpose(1, 2).shape[:3], 16)
    with pytest.raises(NotImplementedError, match=r"kv\[0\], kv\[1\]"):
        tree_paged_attention(**_args(case, kv_cache=legacy))
    quantized = torch.randn(*cache.shape[:3], 2 * 16 + 8)  # inline per-token-head scales
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='auto'"):
        tree_paged_attention(**_args(case, kv_cache=quantized))
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='auto'"):
        tree_paged_attention(**_args(case, kv_cache=cache.to(torch.float16)))
    with pytest.raises(ValueError, match="multiple"):
        tree_paged_attention(**_args(case, query=torch.randn(1, 2, 3, 16)))
    with pytest.raises(ValueError, match="int32"):
        tree_paged_attention(**_args(case, ancestor_bits=torch.zeros(1, 2, 1)))
    with pytest.raises(ValueError, match="root_index"):
        tree_paged_attention(**_args(case, query=case["query"][0]))


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is not None, reason="triton is importable here"
)
def test_without_triton_the_call_says_how_to_get_it():
    case = make_case(0, [3], [2], num_q_heads=2, num_kv_heads=2, head_size=16)
    with pytest.raises(ImportError, match="TRITON_INTERPRET=1"):
        tree_paged_attention(**_args(case))


# --------------------------------------------------------------------------
# the kernel, in a subprocess with .triton-pkgs on the path
# --------------------------------------------------------------------------
def _run_with_triton(mode: str, tmp_path: Path, timeout: int, interpret: bool):
    if not (TRITON_PKGS / "triton").is_dir():
        pytest.skip(f"{TRITON_PKGS} is absent: run `make setup` (it installs triton there)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TRITON_PKGS), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, mode],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(proc.stdout)
    print(f"[{mode}: {time.perf_counter() - start:.1f} s]")
    assert proc.returncode == 0, f"{mode} check failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert f"{mode} OK" in proc.stdout


def test_kernel_matches_reference_in_interpreter(tmp_path):
    _run_with_triton("interpreter", tmp_path, timeout=600, interpret=True)


def test_kernel_compiles_for_sm80_and_sm90(tmp_path):
    _run_with_triton("compile", tmp_path, timeout=600, interpret=False)


# --------------------------------------------------------------------------
# subprocess bodies
# --------------------------------------------------------------------------
def _check(name, case, tol, **kw):
    mask = ancestor_mask_from_parents(case["parents"], case["num_nodes"])
    out = tree_paged_attention(**_args(case), **kw)
    err = max_err(out, oracle(case, mask), case["valid"])
    print(f"  {name}: max err {err:.2e} (tol {tol:.0e})", flush=True)
    assert err < tol, f"{name}: max err {err} >= {tol}"
    return out


def _interpreter_main():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    # several trees per batch: prefix 0, 1, one block exactly, several blocks; a root-only
    # tree; a tree over 32 nodes (two mask words)
    mixed = dict(prefix_lens=[0, 1, 16, 45], tree_sizes=[4, 9, 1, 12])
    for layout in ("LBNHC", "LBHNC", "BLNHC", "pair"):
        _check(f"fp32 GQA 6/2 {layout}", make_case(1, **mixed, layout=layout), 1e-4)
    _check("fp32 two mask words", make_case(2, [20, 3], [40, 33], block_size=32), 1e-4)
    _check("fp32 MHA head 128", make_case(3, **mixed, num_q_heads=2, head_size=128), 1e-4)
    _check("fp32 GQA 8/2 head 48 (padded)", make_case(4, **mixed, num_q_heads=8, head_size=48), 1e-4)  # fmt: skip
    _check("fp32 small tiles", make_case(5, **mixed), 1e-4, block_k=16, block_m=16)
    _check("fp32 long prefix (10 blocks)", make_case(9, [150, 77], [7, 16]), 1e-4)
    for dtype, tol in ((torch.float16, 1e-2), (torch.bfloat16, 5e-2)):
        _check(f"{dtype} GQA 6/2", make_case(6, **mixed, dtype=dtype), tol)

    # flat vLLM query rows: tree r's node j is row root_index[r] + j; other rows untouched
    case = make_case(7, **mixed)
    r, n, hq, d = case["query"].shape
    root_index = torch.tensor([3, 3 + n + 2, 3 + 2 * n + 5, 3 + 3 * n + 6])
    total = int(root_index[-1]) + n + 1
    flat_q = torch.randn(total, hq, d)
    rows = root_index[:, None] + torch.arange(n)[None, :]
    flat_q[rows] = case["query"]
    out = torch.full_like(flat_q, 7.0)
    tree_paged_attention(**_args(case, query=flat_q), root_index=root_index, out=out)
    mask = ancestor_mask_from_parents(case["parents"], case["num_nodes"])
    err = max_err(out[rows], oracle(case, mask), case["valid"])
    written = torch.zeros(total, dtype=torch.bool)
    written[rows[case["valid"]]] = True
    assert err < 1e-4, err
    assert bool((out[~written] == 7.0).all()), "rows outside the trees were written"
    print(f"  flat query rows: max err {err:.2e}, other rows untouched", flush=True)

    # negative check: a sibling made visible must be caught by the comparison above
    case = make_case(8, [5, 30], [6, 5])
    case["parents"] = torch.tensor([[-1, 0, 0, 1, 2, 2], [-1, 0, 1, 2, 3, -1]])
    right = ancestor_mask_from_parents(case["parents"], case["num_nodes"])
    wrong = right.clone()
    wrong[0, 2, 1] = True  # node 2 sees its sibling 1
    wrong[0, 4, 1] = True  # node 4 sees its parent's sibling 1
    out = tree_paged_attention(**_args(case, ancestor_bits=pack_ancestor_mask(wrong)))
    err_right = max_err(out, oracle(case, right), case["valid"])
    err_wrong = max_err(out, oracle(case, wrong), case["valid"])
    print(
        f"  wrong mask: err vs right mask {err_right:.2e}, vs the same wrong mask {err_wrong:.2e}"
    )
    assert err_right > 1e-2, "a visible sibling went unnoticed"
    assert err_wrong < 1e-4, "the kernel does not follow the mask it is given"
    print("interpreter OK")


def _compile_main():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from eagle_vllm.attention.triton_tree import _kernel

    kernel = _kernel()
    pointers = {"Q", "K", "V", "Out", "BlockTable", "RootIndex", "RootPos", "NumNodes", "Bits"}
    for elem, head_size, group, arch in (("fp32", 64, 3, 90), ("bf16", 128, 4, 80)):
        signature = {}
        for name in kernel.arg_names:
            if name in pointers:
                signature[name] = {"BlockTable": "*i32", "Bits": "*i32"}.get(name, f"*{elem}")
                if name in ("RootIndex", "RootPos", "NumNodes"):
                    signature[name] = "*i64"
            elif name == "scale_log2":
                signature[name] = "fp32"
            elif name.isupper():
                signature[name] = "constexpr"
            else:
                signature[name] = "i32"
        group_pad = 1 << (group - 1).bit_length()
        constants = dict(
            HEAD_SIZE=head_size, HEAD_PAD=head_size, GROUP=group, GROUP_PAD=group_pad,
            BLOCK_NODES=64 // group_pad, BLOCK_K=64, BLOCK_SIZE=16, UPCAST=False,
        )  # fmt: skip
        start = time.perf_counter()
        compiled = triton.compile(
            ASTSource(kernel, signature, constants),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": 4, "num_stages": 2},
        )
        assert compiled.asm["cubin"], "no cubin"
        print(
            f"  {elem} head {head_size} group {group} sm_{arch}: "
            f"{time.perf_counter() - start:.1f} s, shared {compiled.metadata.shared} B"
        )
    print("compile OK")


if __name__ == "__main__":
    {"interpreter": _interpreter_main, "compile": _compile_main}[sys.argv[1]]()
