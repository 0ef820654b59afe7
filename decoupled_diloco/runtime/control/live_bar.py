"""A live progress bar between the progress lines, where the log goes to a terminal.

The progress lines (`step N/num_steps | ...`, one per config.log_every steps) are what users and
scripts parse, and they stay as they are. Between two of them a person at a terminal sees nothing
move for a minute; the bar, redrawn in place on the log's stream (absl logs to stderr), shows the
fastest learner's step. Each log record clears it first, so a line never starts after a bar. A pipe
or a file gets no bar: nothing but the log lines there.
"""

from __future__ import annotations

import logging as std_logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from absl import logging

_WIDTH = 30  # characters of the bar itself


class LiveBar:
  """`show(step)` redraws at most every `interval_s`; `close()` clears it and stops clearing."""

  def __init__(self, total: int, stream: TextIO | None = None,
               clock: Callable[[], float] = time.monotonic, interval_s: float = 0.5):
    self._total = total
    self._stream = stream if stream is not None else sys.stderr
    self._clock = clock
    self._interval_s = interval_s
    self._last_drawn: float | None = None
    self._shown = False
    self._lock = threading.Lock()  # log records of other threads clear it
    isatty = getattr(self._stream, "isatty", None)
    self.enabled = bool(isatty and isatty())
    self._clear_first = _ClearFirst(self)
    if self.enabled:
      logging.get_absl_handler().addFilter(self._clear_first)

  def show(self, step: int) -> None:
    if not self.enabled:
      return
    now = self._clock()
    if self._last_drawn is not None and now - self._last_drawn < self._interval_s:
      return
    done = min(max(step, 0), self._total)
    filled = _WIDTH * done // max(self._total, 1)
    with self._lock:
      self._stream.write(f"\r[{'#' * filled}{'.' * (_WIDTH - filled)}] step {done}/{self._total}")
      self._stream.flush()
      self._shown = True
    self._last_drawn = now

  def clear(self) -> None:
    with self._lock:
      if self._shown:
        self._stream.write("\r\033[K")
        self._stream.flush()
        self._shown = False

  def close(self) -> None:
    self.clear()
    if self.enabled:
      logging.get_absl_handler().removeFilter(self._clear_first)


class _ClearFirst(std_logging.Filter):
  """A filter that passes every record, clearing the bar before the handler writes it."""

  def __init__(self, bar: LiveBar):
    super().__init__()
    self._bar = bar

  def filter(self, record: std_logging.LogRecord) -> bool:
    del record
    self._bar.clear()
    return True
