"""The prefix cache: a radix tree over token ids whose nodes hold KV slot indices (no torch)."""

from .cache import MatchResult, RadixCache, TreeNode
from .prefix import common_prefix_len

__all__ = ["MatchResult", "RadixCache", "TreeNode", "common_prefix_len"]
