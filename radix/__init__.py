"""The prefix cache: a radix tree over token ids whose nodes hold KV slot indices (no torch)."""

from radixlm.radix.cache import MatchResult, RadixCache, TreeNode
from radixlm.radix.prefix import common_prefix_len

__all__ = ["MatchResult", "RadixCache", "TreeNode", "common_prefix_len"]
