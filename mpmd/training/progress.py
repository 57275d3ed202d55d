"""A small progress bar for ``fit``: steps, loss and steps/s on one line (stderr)."""

from __future__ import annotations

import sys
import time
from typing import Optional

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: Optional[int], enabled: bool = True, stream=None, width: int = 24) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = stream or sys.stderr
        self.count = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0

    def update(self, loss: float) -> None:
        self.count += 1
        now = time.perf_counter()
        if not self.enabled or (now - self._last_draw < 0.1 and self.count != self.total):
            return
        self._last_draw = now
        rate = self.count / max(now - self.start, 1e-9)
        if self.total:
            filled = int(self.width * self.count / self.total)
            bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.count}/{self.total}"
        else:
            bar = f"step {self.count}"
        self.stream.write(f"\r{bar}  loss {loss:.4f}  {rate:.2f} steps/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.count:
            self.stream.write("\n")
            self.stream.flush()
