"""The host tier's background pinning waits while a load from the host or disk tier runs
(host_segments.PinningGate), but never keeps a copy waiting for a segment."""

import time

import pytest
import torch

from radixlm.srt.executor.host_segments import HostSegments, PinningGate


def test_a_gate_without_deferral_does_not_wait():
    start = time.monotonic()
    PinningGate().wait(lambda: False)
    assert time.monotonic() - start < 0.05


def test_a_deferral_holds_the_pinning_until_it_expires_unless_a_copy_needs_it():
    gate = PinningGate()
    gate.defer(0.2)
    gate.defer(0.05)  # a shorter deferral never cuts a longer one short
    start = time.monotonic()
    gate.wait(lambda: True)  # a copy waits for a segment: no deferral holds
    assert time.monotonic() - start < 0.05
    gate.wait(lambda: False)
    assert time.monotonic() - start >= 0.2


@pytest.mark.gpu
def test_pinning_waits_for_a_deferral_but_a_copy_that_needs_a_segment_gets_it():
    gate = PinningGate()
    gate.defer(30.0)
    segments = HostSegments(2, lambda _: (4 << 20,), torch.uint8, pinned=True, gate=gate)
    try:
        time.sleep(0.3)
        assert segments.allocated_bytes == 0  # nothing pinned while deferred
        start = time.monotonic()
        first = segments.get(0)
        assert time.monotonic() - start < 10 and first.numel() == 4 << 20
        host = first[:16].fill_(7)
        assert torch.equal(host.to("cuda", non_blocking=True).cpu(), host)
    finally:
        segments.close()
