"""Which prompt ordinals a run has finished with, and how.

Every prompt the orchestrator draws carries a monotonic ordinal; its group ends
exactly one way: trained (acknowledged by a trainer checkpoint), or dropped with
a reason ("stale" by the buffer; "filtered" or "failed" as the orchestrator
reports). The ledger is what a restarted orchestrator resumes from: ordinals
below its `frontier` are all finished, finished ones above are listed, and any
ordinal up to `highest` that is neither finished nor held is a gap to run again.

The ledger stays compact however long the run: the frontier moves up as the
gaps below it close.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OrdinalLedger:
    frontier: int = 0
    """Every ordinal below this is finished."""
    above: set[int] = field(default_factory=set)
    """Finished ordinals at or above the frontier."""
    highest: int = -1
    """The highest ordinal seen at all (finished, held or in part)."""
    outcomes: dict[str, int] = field(default_factory=dict)
    """Groups finished, by outcome ("trained", "stale", "filtered", "failed", ...)."""

    def finished(self, ordinal: int) -> bool:
        return ordinal < self.frontier or ordinal in self.above

    def saw(self, ordinal: int) -> None:
        self.highest = max(self.highest, ordinal)

    def finish(self, ordinal: int, outcome: str) -> bool:
        """Records that `ordinal` ended with `outcome`; False if it had already ended."""
        self.saw(ordinal)
        if self.finished(ordinal):
            return False
        self.above.add(ordinal)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        while self.frontier in self.above:
            self.above.discard(self.frontier)
            self.frontier += 1
        return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "frontier": self.frontier,
            "above": sorted(self.above),
            "highest": self.highest,
            "outcomes": dict(self.outcomes),
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> OrdinalLedger:
        return cls(
            frontier=int(data["frontier"]),
            above={int(o) for o in data["above"]},
            highest=int(data["highest"]),
            outcomes={str(k): int(v) for k, v in data["outcomes"].items()},
        )

    def gaps(self, held: set[int]) -> list[int]:
        """Ordinals up to `highest` that are neither finished nor in `held`: to run again."""
        return [
            o
            for o in range(self.frontier, self.highest + 1)
            if o not in self.above and o not in held
        ]
