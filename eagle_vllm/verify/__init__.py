"""Verification / acceptance of draft chains and trees: pure torch, no vLLM imports.

Rules (see ``docs/lossless-verification.md``):

* :func:`greedy_verify` -- argmax walk (temperature 0).
* :func:`deterministic_tree_verify` -- exact for any tree not depending on the
  verifier's randomness (top-k / EAGLE-2 dynamic trees); needs only target probs.
  :func:`tree_verify_with_draws` is the same rule with the caller's sampler.
* :func:`sampled_tree_verify` / :func:`sampled_chain_verify` -- recursive rejection
  sampling, exact only when the children were sampled from the draft ``q`` (i.i.d.
  with ``replacement=True``, sequentially without replacement with ``False``).
"""

from eagle_vllm.verify.greedy import (
    VerifyResult,
    greedy_verify,
    greedy_verify_choices,
    greedy_walk_lists,
)
from eagle_vllm.verify.rejection import (
    chain_parents,
    deterministic_tree_verify,
    draw_uniforms,
    sample_from_probs,
    sampled_chain_verify,
    sampled_tree_verify,
    tree_verify_with_draws,
)

__all__ = [
    "VerifyResult",
    "chain_parents",
    "deterministic_tree_verify",
    "draw_uniforms",
    "greedy_verify",
    "greedy_verify_choices",
    "greedy_walk_lists",
    "sample_from_probs",
    "sampled_chain_verify",
    "sampled_tree_verify",
    "tree_verify_with_draws",
]
