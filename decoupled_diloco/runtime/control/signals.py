"""Stopping a run on SIGTERM or Ctrl-C: a checkpoint first, then `Interrupted`.

The main thread's handlers only note the signal; the controller's loop sees it, stops training and
writes a checkpoint the same command resumes from. A second signal exits at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from absl import logging

from decoupled_diloco.runtime.control import run as run_lib

if TYPE_CHECKING:
  from decoupled_diloco.runtime.control import checkpoint_cadence


class Interrupted(Exception):
  """The run was stopped by SIGTERM or Ctrl-C after writing a checkpoint (or with none to write)."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.signum = signum


# A second signal this soon after the first is the same one, not a user pressing Ctrl-C again:
# `timeout`, Slurm and a terminal signal the whole process group, so a run under a wrapper gets
# two SIGINTs a few ms apart (2 ms measured under `timeout`, 2026-11-26). A person pressing Ctrl-C
# twice on purpose takes longer than this.
SAME_SIGNAL_WINDOW_S = 1.0


class StopSignal:
  """SIGTERM / SIGINT handlers of the main thread: the first asks for a checkpoint and a clean
  stop, a second one more than SAME_SIGNAL_WINDOW_S later exits at once. Elsewhere (a run started
  from another thread) it does nothing: signals reach only the main thread."""

  def __init__(self, clock: Callable[[], float] = time.monotonic,
               exit_now: Callable[[int], None] = os._exit):  # pylint: disable=protected-access
    self.signum: int | None = None
    self._first_at: float | None = None
    self._clock = clock
    self._exit_now = exit_now
    self._previous: dict[int, Any] = {}

  def install(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      return
    for signum in (signal.SIGTERM, signal.SIGINT):
      self._previous[signum] = signal.signal(signum, self._handle)

  def uninstall(self) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def _handle(self, signum: int, frame) -> None:
    del frame
    now = self._clock()
    if self.signum is not None:
      if now - self._first_at < SAME_SIGNAL_WINDOW_S:
        return  # the process group's copy of the first signal
      logging.error("%s again: exiting at once, without a checkpoint",
                    signal.Signals(signum).name)
      logging.flush()
      self._exit_now(128 + signum)
      return
    self.signum, self._first_at = signum, now
    logging.warning("%s: writing a checkpoint, then stopping (send it again after %g s to exit "
                    "at once)", signal.Signals(signum).name, SAME_SIGNAL_WINDOW_S)


def stop_with_checkpoint(run: run_lib.Run, saver: checkpoint_cadence.Checkpointer,
                         signum: int) -> None:
  name = signal.Signals(signum).name
  if run.checkpoints is None:
    raise Interrupted(signum, f"stopped by {name} at step {max(l.step for l in run.learners)}; "
                              "no checkpoint written (config.checkpoint.every_steps=0)")
  path = saver.save_now(timeout_s=run.settings.stall_timeout_s,
                        train_seconds=time.perf_counter() - saver.train_started)
  saver.close()
  if path is None:
    raise Interrupted(signum, f"stopped by {name}; no consistent checkpoint could be taken, the "
                              f"newest on disk is in {run.checkpoints.directory}")
  raise Interrupted(signum, f"stopped by {name}; checkpoint written to {path}: run the same "
                            "command again to resume (config.restore=auto)")

