"""Load-aware tree sizing (``total_tokens: auto``): each step's tree from measurements.

Pure Python/torch, no vLLM imports; the runner feeds it (``engine/telemetry.py``) and
asks it once per step. Three parts:

* ``acceptance.py``: how often the j-th node of a tree is accepted, per class of
  request (greedy, sampled), hence a tree's expected tokens ``E(d, m)``; and
  ``SourceCalibration``, acceptance per draft source and depth, which puts EAGLE and
  suffix candidates on one scale in merged trees (``tree/merge.py``);
* ``costs.py``: the measured wall time of steps per batch size, tree size and draft
  passes;
* ``policy.py``: ``TreeSizer``, the choice of ``(passes, nodes)`` that maximises
  ``E / cost``, with explorations and probes to keep both measured.
"""

from eagle_vllm.sizing.acceptance import GREEDY, SAMPLED, AcceptanceStats, SourceCalibration
from eagle_vllm.sizing.costs import batch_bucket
from eagle_vllm.sizing.policy import (
    OFF,
    PROFILE_TRIALS,
    Decision,
    TreeSizer,
    candidate_sizes,
    check_profile,
)

__all__ = [
    "GREEDY",
    "OFF",
    "PROFILE_TRIALS",
    "SAMPLED",
    "AcceptanceStats",
    "SourceCalibration",
    "Decision",
    "TreeSizer",
    "batch_bucket",
    "candidate_sizes",
    "check_profile",
]
