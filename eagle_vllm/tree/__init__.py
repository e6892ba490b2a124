"""Draft-tree construction: pure torch, no vLLM imports.

Oracles (tests only, never called when serving: ``check_tree``, ``truncate``,
``chain_tree``, ``ancestor_mask``, ...) are imported from :mod:`eagle_vllm.tree.reference`.
"""

from .builder import Frontier, TreeBuilder
from .layout import DraftTree, root_only_tree

__all__ = ["DraftTree", "Frontier", "TreeBuilder", "root_only_tree"]
