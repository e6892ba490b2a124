"""Verification / acceptance of draft chains and trees: pure torch, no vLLM imports.

Rules served (see ``docs/lossless-verification.md``):

* :func:`greedy_verify_choices` / :func:`greedy_walk_lists` -- the argmax walk
  (temperature 0) from the target's choice at every node, as tensors or Python lists.
* :func:`tree_verify_with_draws` -- exact for any tree not depending on the verifier's
  randomness (top-k / EAGLE-2 dynamic trees), with the caller's sampler; needs only
  target draws.
* :func:`sampled_chain_verify` -- standard speculative sampling, exact when each draft
  was sampled from the draft ``q``.

Oracles (tests only, never called when serving) are imported from
:mod:`eagle_vllm.verify.reference`: ``greedy_verify``, ``deterministic_tree_verify``,
``sampled_tree_verify``, ``position_uniforms``.
"""

from eagle_vllm.verify.greedy import (
    VerifyResult,
    child_with_token,
    greedy_verify_choices,
    greedy_walk_lists,
)
from eagle_vllm.verify.rejection import (
    chain_parents,
    draw_uniforms,
    sample_from_probs,
    sampled_chain_verify,
    tree_verify_with_draws,
)

__all__ = [
    "VerifyResult",
    "chain_parents",
    "child_with_token",
    "draw_uniforms",
    "greedy_verify_choices",
    "greedy_walk_lists",
    "sample_from_probs",
    "sampled_chain_verify",
    "tree_verify_with_draws",
]
