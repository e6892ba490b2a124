"""Counter-based randomness keyed by (seed, sequence position): reproducible seeds.

A seeded request must give the same output every time. With speculation, how
many random draws a step consumes depends on the drafts, and the drafts depend
on floating-point details of the batch a request happened to share. If draws
came from one stream per request, a different draft anywhere would shift every
later draw. Keying each draw by the position of the token it decides makes a
seeded request's output a function of (seed, the target's distributions) only:
the token at position t is drawn with randomness keyed by (seed, t) whichever
step, tree or draft produced the candidates. Every seeded draw, in the verifier's
walk and in vLLM's own sampler (bonus tokens, steps without drafts), is made by vLLM's
sampler with the generator ``position_generator(seed, t)``: the walk calls that
sampler too (``engine/sampler.py``), so it does not matter which of them decides t,
whatever the platform's sampler does with the generator (vLLM 0.32 on CPU draws a
seed from it for a fused Gumbel-max; on CUDA, Exp(1) values for an exponential race).

Exactness is unaffected: along a sequence each position's key seeds one draw,
and keys at distinct positions are independent values of a well-mixed 64-bit
hash (SplitMix64's finaliser), so every emitted token is an exact draw from its
distribution. Pure torch, vectorised, the same on every device and
tensor-parallel rank. ``eagle_vllm.verify.reference.position_uniforms`` reads the
keys as uniforms, for the tests of that independence.
"""

from __future__ import annotations

import torch
from torch import Tensor

# SplitMix64 constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB

# Separate streams for separate uses of one (seed, position).
DOMAIN_WALK = 1  # reserved: the walk's own uniforms (now only reference.position_uniforms)
DOMAIN_SAMPLER = 2  # vLLM's sampler: every seeded draw (walk, bonus, plain next-token)


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: Tensor) -> Tensor:
    """SplitMix64 finaliser on int64 tensors (wrapping arithmetic)."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def position_keys(seeds: Tensor, positions: Tensor, domain: int) -> Tensor:
    """int64 keys ``[B, ...]`` for ``seeds [B]`` and ``positions [B, ...]``."""
    seeds = seeds.to(torch.int64).view(-1, *([1] * (positions.dim() - 1)))
    k = mix64(seeds * _GOLDEN + domain)
    return mix64(k + positions.to(torch.int64) * _GOLDEN)


def position_generator(
    seed: int, position: int, domain: int = DOMAIN_SAMPLER, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A torch generator seeded from (seed, position), for samplers that take one."""
    return position_generators([seed], [position], domain, device)[0]


def position_generators(
    seeds: list[int],
    positions: list[int] | Tensor,
    domain: int = DOMAIN_SAMPLER,
    device: str | torch.device = "cpu",
) -> list[torch.Generator]:
    """:func:`position_generator` of each (seed, position) pair, the keys hashed together."""
    if not seeds:
        return []
    keys = position_keys(
        torch.tensor(seeds, dtype=torch.int64),
        torch.as_tensor(positions, dtype=torch.int64).view(-1),
        domain,
    )
    made = []
    for key in keys.tolist():
        generator = torch.Generator(device=device)
        generator.manual_seed(key & ((1 << 63) - 1))
        made.append(generator)
    return made
