"""When a request drafts: speculation pays only while its drafts are accepted.

A verify step is not free: drafting reads the newest token on the host, so on a GPU the step
runs in lockstep (no overlap with the host's work), and it feeds 1 + K rows; on an H200 at
batch 1 it cost about 1.8 plain overlapped decode steps. So a request drafts while its verify
steps accept about one draft or more on average, and otherwise decodes plainly for a while
(overlapped, when no one else drafts either). Pauses double with each failure in a row and
are forgotten once drafting pays again. Finding nothing to draft (no n-gram match) costs no
verify forward, only the overlap of the step that looked, so it pauses less: not at all the
first time (copying text often has such gaps), then 1, 2, 4, ... steps. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# Accepted drafts per verify step (a running average) at which drafting pays.
PAYING_ACCEPTED = 1.0
# Weight of the newest verify step in that average.
ACCEPTED_AVG_WEIGHT = 0.5
# Decode steps without drafting after a verify step that did not pay: the first pause, and the
# longest after many in a row.
FIRST_BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 64
# The longest pause after steps in a row with nothing to draft.
NO_DRAFT_MAX_BACKOFF_STEPS = 16


@dataclass
class DraftPacing:
    """One request's drafting state. The decode manager drafts only when `due`, calls `skipped()`
    for each decode step it sat out and `no_draft()` when drafting found nothing; the scheduler
    calls `verified(accepted)` when it commits a verify step."""

    # The average starts (and restarts after each pause) at the bar, so that the next verify
    # step is judged on its own result.
    mean_accepted: float = PAYING_ACCEPTED
    unpaid: int = 0  # verify steps in a row that left the average below the bar
    no_drafts: int = 0  # steps in a row that found nothing to draft
    backoff: int = 0  # decode steps left without drafting

    @property
    def due(self) -> bool:
        return self.backoff == 0

    def skipped(self) -> None:
        self.backoff -= 1

    def no_draft(self) -> None:
        self.no_drafts += 1
        self.backoff = min(NO_DRAFT_MAX_BACKOFF_STEPS, 2 ** min(self.no_drafts, 8) // 4)  # 0, 1, 2, 4, ...

    def verified(self, accepted: int) -> None:
        self.no_drafts = 0
        self.mean_accepted += ACCEPTED_AVG_WEIGHT * (accepted - self.mean_accepted)
        if self.mean_accepted >= PAYING_ACCEPTED:
            self.unpaid = 0
            return
        self.unpaid += 1
        self.backoff = min(MAX_BACKOFF_STEPS, FIRST_BACKOFF_STEPS * 2 ** min(self.unpaid - 1, 8))
        self.mean_accepted = PAYING_ACCEPTED
