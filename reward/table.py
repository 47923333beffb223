"""Which scorer serves each domain: the built-ins of `rollwire.reward.scorers.SCORERS`,
the image domains (`rollwire.reward.images.IMAGE_SCORERS`), the `code` domain on its
sandbox (`rollwire.reward.code`), and a run's custom scorers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rollwire.reward.code import CodeScorer
from rollwire.reward.images import IMAGE_SCORERS
from rollwire.reward.scorers import SCORERS, Score, ScoreInput, load_scorer
from rollwire.services.core.sandbox import Limits, Sandbox

if TYPE_CHECKING:
    from rollwire.services.core.config import SandboxConfig


def code_scorer(sandbox: SandboxConfig) -> Callable[[ScoreInput], Score]:
    """The `code` domain's scorer on `sandbox`; raises SandboxUnavailable where it cannot run."""
    return CodeScorer(
        Sandbox(sandbox.kind, max_parallel=sandbox.max_parallel, python=sandbox.python),
        Limits(
            timeout_s=sandbox.timeout_seconds,
            memory_mb=sandbox.memory_mb,
            file_mb=sandbox.file_mb,
            processes=sandbox.processes,
        ),
    )


def scorer_table(
    custom: dict[str, str], sandbox: SandboxConfig | None = None
) -> dict[str, tuple[str, Callable[[ScoreInput], Score]]]:
    """Built-in scorers, the `code` domain on `sandbox` (when given), and the configured
    custom ones (which may override a built-in domain)."""
    table = {**SCORERS, **IMAGE_SCORERS}
    if sandbox is not None:
        table["code"] = (f"code_score ({sandbox.kind} sandbox)", code_scorer(sandbox))
    for domain, spec in custom.items():
        table[domain] = (spec, load_scorer(spec))
    return table
