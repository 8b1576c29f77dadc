"""Wall-clock allowances for long jobs (``data.regen_max_minutes``, ``train.max_minutes``, ``eval.max_minutes``).

The demo must fit its time budget on whatever machine runs it, so its stages stop early -- regeneration keeps the
conversations answered so far, training shortens its schedule, evaluation runs fewer prompts -- instead of
running over. Limits count from when a job starts; ``None`` means no limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from eagle.errors import EagleError


class Deadline:
    """``minutes`` of wall time from construction (None: never expires)."""

    def __init__(self, minutes: float | None, clock: Callable[[], float] = time.monotonic):
        check_minutes(minutes, "a time limit")
        self.minutes = minutes
        self.clock = clock
        self.start = clock()

    @property
    def limited(self) -> bool:
        return self.minutes is not None

    def elapsed(self) -> float:
        """Seconds since the start."""
        return self.clock() - self.start

    def remaining(self) -> float:
        """Seconds left (``inf`` without a limit, negative once past it)."""
        return math.inf if self.minutes is None else self.minutes * 60.0 - self.elapsed()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def fits(self, seconds: float) -> bool:
        """Whether a piece of work expected to take ``seconds`` would end within the limit."""
        return self.remaining() >= seconds


def check_minutes(value: float | None, name: str) -> None:
    """Raise EagleError unless ``value`` is a positive number of minutes or None (``name`` is the config key)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise EagleError(f"{name} must be a positive number of minutes or null (no limit), got {value!r}")
