"""When to stop proposing: the back-off rule of speculative decoding.

A draft that is rejected still costs a query row in the verify pass (and a
draft model's own pass). When a request's drafts are mostly wrong, as n-gram
lookup is on text that does not repeat, speculating makes it slower than
plain decoding. Two rules, both decided on the host before the proposer runs:

1. **Per request** (:class:`BackOff`): after each verification of ``d >= 1``
   drafts with ``a`` accepted, the request records ``(a, d)``, keeping its
   last ``window`` verifications. Once it has ``window`` of them and
   ``sum(a) / sum(d) < min_acceptance``, it *pauses*: it gets no drafts for
   the next ``pause`` steps, and its record is cleared. ``pause`` starts at
   ``min_pause`` steps and doubles each time the request backs off again,
   up to ``max_pause``; a full window at or above ``min_acceptance`` resets
   it to ``min_pause``. A step where the proposer finds nothing (no n-gram
   match) costs nothing and records nothing.
2. **Per step** (``SpeculativeConfig.disable_by_batch_size``, vLLM's name):
   with at least that many running requests no request gets drafts, since a
   large batch is compute-bound and extra query rows are no longer free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class _RequestRecord:
    history: deque = field(default_factory=deque)  # (accepted, drafted) per verification
    paused_until: int = -1  # the first step it may propose again
    pause: int = 0  # the current pause length (0: never backed off)


@dataclass
class BackOff:
    """The per-request back-off (see the module docstring for the rule).

    Args:
        window: verifications looked at.
        min_acceptance: the acceptance rate (accepted / drafted) below which a
            request pauses.
        min_pause / max_pause: the pause length, in engine steps, doubling
            between them.
    """

    window: int = 4
    min_acceptance: float = 0.25
    min_pause: int = 8
    max_pause: int = 128
    records: dict[str, _RequestRecord] = field(default_factory=dict)

    def may_propose(self, request_id: str, step: int) -> bool:
        """Whether the request may get drafts at engine step ``step``."""
        record = self.records.get(request_id)
        return record is None or step >= record.paused_until

    def record(self, request_id: str, num_accepted: int, num_drafts: int, step: int) -> None:
        """One verification of ``num_drafts >= 1`` drafts at ``step``; maybe pause."""
        record = self.records.setdefault(request_id, _RequestRecord())
        record.history.append((num_accepted, num_drafts))
        if len(record.history) > self.window:
            record.history.popleft()
        if len(record.history) < self.window:
            return
        accepted = sum(a for a, _ in record.history)
        drafted = sum(d for _, d in record.history)
        if accepted < self.min_acceptance * drafted:
            record.pause = min(max(2 * record.pause, self.min_pause), self.max_pause)
            record.paused_until = step + 1 + record.pause
            record.history.clear()
        else:
            record.pause = 0

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record."""
        self.records.pop(request_id, None)
