"""What a long build stage reports: progress lines (a callable taking one line) and stage seconds."""

from __future__ import annotations

import time
from collections.abc import Callable

Progress = Callable[[str], None]


def quiet(_: str) -> None:
    """A Progress that says nothing."""


class Clock:
    """Seconds per build stage, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 2)
        self._last = now
