"""Lost slices: which learner failures are a slice that went down, and when that slice is back.

Under Pathways a slice that goes down fails the learner on it with an error that pathwaysutils
classifies (runtime/core/pathways.py). The supervisor restarts that learner through the same
rejoin as a crash, but only once its slice answers again, and without counting it against
config.max_restarts, which bounds a learner that keeps failing on its own (supervisor.py).

Whether a slice is back is a health check that runs a program on the slice and may block for as
long as the slice is down. So each lost learner is waited for on a thread of its own, every
config.devices.slice_poll_s: the supervisor only reads the answer, and neither its other rejoins,
nor the other learners, nor the syncer wait for a check.

The classification and the check are both given: `for_pathways` makes them from pathwaysutils,
and a test (which has no Pathways backend) passes its own check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from absl import logging

from decoupled_diloco.runtime.core import pathways


class SliceWatch:
  """Classifies failures as lost slices, and waits for each lost learner's slices to be back."""

  def __init__(self, is_lost_slice: Callable[[BaseException], bool],
               slices_active: Callable[[int], bool], poll_s: float,
               clock: Callable[[], float] = time.monotonic):
    self.is_lost_slice = is_lost_slice  # error -> whether it is a slice that went down
    self._slices_active = slices_active  # learner -> whether all its slices answer (may block)
    self._poll_s = poll_s
    self._clock = clock
    self._lock = threading.Lock()
    self._back_at: dict[int, float | None] = {}  # lost learner -> when its slices were back
    self._at_once: dict[int, bool] = {}  # lost learner -> whether its first check found them up
    self._stop = threading.Event()

  def watch(self, learner: int) -> None:
    """`learner` lost its slice: checks it from now on, on a thread of its own, until it is back."""
    with self._lock:
      self._back_at[learner] = None
    threading.Thread(target=self._wait_for, args=(learner,), name=f"slice-watch-{learner}",
                     daemon=True).start()

  def back_at(self, learner: int) -> float | None:
    """When the lost slices of `learner` were found back (clock time); None while they are not."""
    with self._lock:
      return self._back_at.get(learner)

  def answered_at_once(self, learner: int) -> bool:
    """Whether the first check after `learner`'s failure found its slices up: no slice was down
    then, so the error, whatever pathwaysutils reads in it, was the learner's own."""
    with self._lock:
      return self._at_once.get(learner, False)

  def forget(self, learner: int) -> None:
    """`learner` has rejoined: a later loss is watched afresh."""
    with self._lock:
      self._back_at.pop(learner, None)
      self._at_once.pop(learner, None)

  def stop(self) -> None:
    """Ends the waits (the run is over); a check under way still returns into nothing."""
    self._stop.set()

  def _wait_for(self, learner: int) -> None:
    first = True
    while not self._stop.is_set():
      if self._active(learner):
        with self._lock:
          if learner in self._back_at:
            self._back_at[learner] = self._clock()
            self._at_once[learner] = first
        return
      first = False
      self._stop.wait(self._poll_s)

  def _active(self, learner: int) -> bool:
    try:
      return self._slices_active(learner)
    except Exception as err:  # pylint: disable=broad-except
      # A check that fails answers "not yet": the slice may still be coming up.
      logging.warning("learner %d: checking whether its slice is back failed (%r); again in "
                      "%.1f s", learner, err, self._poll_s)
      return False


def for_pathways(learner_devices: Sequence[Sequence], poll_s: float) -> SliceWatch:
  """Under Pathways: failures classified by pathwaysutils, and learner m's slices (those of
  `learner_devices[m]`) checked by its health check."""
  return SliceWatch(pathways.is_lost_slice,
                    lambda m: pathways.slices_active(learner_devices[m]), poll_s)
