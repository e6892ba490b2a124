"""Draft-tree construction: pure torch, no vLLM imports."""

from .builder import Frontier, TreeBuilder
from .layout import (
    DraftTree,
    ancestor_mask,
    chain_tree,
    check_tree,
    children_arrays,
    leaf_mask,
    paths,
    retrieve_indices,
    root_only_tree,
    truncate,
)

__all__ = [
    "DraftTree",
    "Frontier",
    "TreeBuilder",
    "ancestor_mask",
    "chain_tree",
    "check_tree",
    "children_arrays",
    "leaf_mask",
    "paths",
    "retrieve_indices",
    "root_only_tree",
    "truncate",
]
