"""Fast common-prefix length of two token-id lists, in pure Python."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["common_prefix_len"]


def common_prefix_len(a: Sequence[int], b: Sequence[int], b_start: int = 0) -> int:
    """Length of the common prefix of `a` and `b[b_start:]` (both lists, or both tuples).

    Compares growing chunks with slice equality (C speed), then bisects inside the first
    chunk that differs, so a long match costs O(n) C work and O(log n) Python steps.
    """
    n = min(len(a), len(b) - b_start)
    lo, step = 0, 32
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] == b[b_start + lo:b_start + hi]:
            lo, step = hi, step * 2
            continue
        while hi - lo > 8:  # a mismatch lies in [lo, hi)
            mid = (lo + hi) // 2
            if a[lo:mid] == b[b_start + lo:b_start + mid]:
                lo = mid
            else:
                hi = mid
        while a[lo] == b[b_start + lo]:
            lo += 1
        return lo
    return n
