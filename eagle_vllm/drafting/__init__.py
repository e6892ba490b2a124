"""Drafting sources other than the EAGLE head: pure Python, no vLLM imports.

:mod:`eagle_vllm.drafting.suffix` is model-free suffix decoding (as in ArcticInference and
vLLM's ``suffix`` method): a depth-bounded suffix index over each request's own text (prompt
plus the tokens generated so far) and over the responses of recently finished requests,
from which it proposes a small draft tree in the layout of the EAGLE-2 builder's nodes
(:mod:`eagle_vllm.tree.layout`). It runs no model: its candidates cost host time only, and
they are verified by the same exact rules as the head's, so using them never changes what
the target samples. It is the drafting counterpart of :mod:`eagle_vllm.tree`.
"""

from .suffix import (
    CacheKey,
    GlobalSuffixCache,
    RequestSuffixes,
    SuffixCandidates,
    SuffixIndex,
    cache_key,
    candidates_to_tree,
    propose,
)

__all__ = [
    "CacheKey",
    "GlobalSuffixCache",
    "RequestSuffixes",
    "SuffixCandidates",
    "SuffixIndex",
    "cache_key",
    "candidates_to_tree",
    "propose",
]
