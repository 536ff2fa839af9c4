"""Per-step host tables copied to the device through reused pinned buffers (pinned_ring.py)."""

import numpy as np
import pytest
import torch

from radixlm.srt.executor.pinned_ring import RING_BUFFERS, PinnedRing


def test_upload_concatenates_the_parts_as_int32_and_splits_them_back():
    ring = PinnedRing(torch.device("cpu"))
    parts = [np.arange(5, dtype=np.int64), np.zeros(0, dtype=np.int64), np.array([7, -1], dtype=np.int32)]
    out = ring.upload(parts)
    assert [t.dtype for t in out] == [torch.int32] * 3
    assert [t.tolist() for t in out] == [[0, 1, 2, 3, 4], [], [7, -1]]


def test_a_cpu_upload_is_never_overwritten_by_the_next():
    ring = PinnedRing(torch.device("cpu"))
    first = ring.upload([np.full(4, 1)])
    for i in range(2 * RING_BUFFERS):
        ring.upload([np.full(4, i + 2)])
    assert first[0].tolist() == [1, 1, 1, 1]


@pytest.mark.gpu
def test_a_buffer_is_reused_only_after_its_copy_ran():
    """Copies queued behind a busy device still read what was staged for them, though the ring
    comes round to their buffer again meanwhile (and grows one)."""
    ring = PinnedRing(torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # the stream stays busy while every copy below is queued
    outs = [ring.upload([np.full(1000 * (i + 1), i, dtype=np.int64)])[0] for i in range(3 * RING_BUFFERS)]
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert out.numel() == 1000 * (i + 1) and bool((out == i).all())
