"""A radix tree as indented text, for debugging and tests."""

from __future__ import annotations

from .cache import RadixCache


def format_tree(cache: RadixCache, max_tokens: int = 8) -> str:
    """One line per node, indented by depth, under a line per namespace."""
    lines: list[str] = []
    for ns, root in cache._roots.items():
        lines.append(f"namespace {ns!r}:")
        stack = [(child, 1) for child in reversed(root.children.values())]
        while stack:  # iterative: long conversations make deep trees
            node, depth = stack.pop()
            head = " ".join(map(str, node.key[:max_tokens]))
            more = " ..." if len(node.key) > max_tokens else ""
            lines.append(f"{'  ' * depth}[{head}{more}] len={len(node.key)} lock={node.lock_ref} t={node.last_access}")
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
    return "\n".join(lines)
