"""``fit``'s progress display on stderr: steps, loss, grad norm and lr (when known), steps/s.

On a terminal it is a ``tqdm`` bar redrawn in place (tqdm limits the redraws to ten a
second, so ``log_every`` does not slow it down).  Anywhere else (a log file, CI: the stream
is not a tty) carriage-return redraws would pile up on one line, so it prints a plain line
every ``log_every`` steps and one for the last step, e.g.::

    step 20/150  loss 2.3127  grad_norm 0.8412  lr 0.003  11.84 steps/s  [00:01<00:10]

(steps/s there is the rate since the previous line).  ``enabled=False`` prints nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

from tqdm import tqdm

__all__ = ["Progress", "describe"]


class Progress:
    """The display of one fit call: ``update(record)`` per completed step (the record of
    ``callbacks.py``), ``restart_at(count)`` when a restart takes the count back, ``close()``."""

    def __init__(self, total: Optional[int], *, enabled: bool = True, log_every: int = 10, start: int = 0,
                 stream: Any = None) -> None:
        self.total, self.enabled, self.log_every = total, enabled, log_every
        self.stream = stream if stream is not None else sys.stderr
        self.count = start
        self.terminal = enabled and _is_terminal(self.stream)
        self._bar = None
        if self.terminal:
            self._bar = tqdm(total=total, initial=start, file=self.stream, unit="step", dynamic_ncols=True,
                             leave=True)
        self._start = time.perf_counter()
        self._mark = (start, self._start)  # (count, time) at the previous plain line
        self._unprinted: Optional[dict] = None  # the newest record no plain line showed yet

    def update(self, record: dict) -> None:
        self.count += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(describe(record), refresh=False)
            self._bar.update(1)
            return
        self._unprinted = record
        if self.count % self.log_every == 0:
            self._print_line()

    def restart_at(self, count: int) -> None:
        """A restart went back to a checkpoint: the count is ``count`` again."""
        self.count = count
        self._mark, self._unprinted = (count, time.perf_counter()), None
        if self._bar is not None:
            self._bar.n = self._bar.last_print_n = count
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._unprinted is not None:
            self._print_line()

    def _print_line(self) -> None:
        now = time.perf_counter()
        done, since = self.count - self._mark[0], now - self._mark[1]
        head = f"step {self.count}/{self.total}" if self.total else f"step {self.count}"
        elapsed = now - self._start
        timing = tqdm.format_interval(elapsed)
        if self.total and done > 0 and since > 0 and self.total >= self.count:
            timing += "<" + tqdm.format_interval((self.total - self.count) * since / done)
        rate = f"  {done / since:.2f} steps/s" if done > 0 and since > 0 else ""
        self.stream.write(f"{head}  {describe(self._unprinted)}{rate}  [{timing}]\n")
        self.stream.flush()
        self._mark, self._unprinted = (self.count, now), None


def describe(record: dict) -> str:
    """``loss 2.3127  grad_norm 0.8412  lr 0.003`` (the parts known), for the bar and the lines."""
    parts = []
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.4g}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.3g}")
    if record.get("skipped"):
        parts.append("skipped")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{tqdm.format_sizeof(record['tokens_per_s'])} tokens/s")
    if record.get("moe_load_max_mean") is not None:  # a mixture of experts' worst layer (mpmd/lm/moe_metrics.py)
        parts.append(f"expert load max/mean {record['moe_load_max_mean']:.2f}")
    return "  ".join(parts)


def _is_terminal(stream: Any) -> bool:
    """A tty with a width (a pseudo-terminal of size 0x0, as some CI runners give, makes tqdm
    print nothing: it gets the plain lines)."""
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # no file descriptor: tqdm picks a width
        return True
