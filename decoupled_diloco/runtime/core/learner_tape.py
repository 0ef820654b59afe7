"""One learner incarnation's part of the event tape (config.tape), and the CRC of the data it read.

With the tape on, a learner writes each change of its state (a take, an apply, its respawn) as one
event, numbered in the order its state changed; the replay (runtime/records/event_tape.py) makes
them again in that order. Its takes also carry the CRC of the inputs of every batch this incarnation
took from its loader, so that a replay on other data stops at its first take instead of diverging
silently. Its learner (runtime/core/learner.py) calls it under its lock.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np


class LearnerTape:
  """The events of one learner incarnation on the tape, and its data CRC."""

  def __init__(self, metrics: Any, learner: int, incarnation: int):
    self._metrics = metrics  # a MetricsWriter, taping or not; None: no tape
    self._learner = learner
    self._incarnation = incarnation
    self._seq = 0  # this learner's events on the event tape so far
    self.data_crc = 0  # of the batches' inputs, with the tape on or in a replay
    self.replaying = False  # made by the replay: the CRC is kept with the tape off too

  @property
  def taping(self) -> bool:
    return self._metrics is not None and getattr(self._metrics, "taping", False)

  def event(self, kind: str, **fields) -> None:
    """One of this learner's events, numbered in the order its state changed."""
    if not self.taping:
      return
    self._seq += 1
    self._metrics.tape_event(kind, {"learner": self._learner, "incarnation": self._incarnation,
                                    "seq": self._seq, **fields})

  def crc_with(self, batch: dict[str, np.ndarray]) -> int:
    """The data CRC once `batch` is folded in (unchanged with no tape and no replay)."""
    crc = self.data_crc
    if self.taping or self.replaying:
      crc = zlib.crc32(np.ascontiguousarray(batch["inputs"]).tobytes(), crc)
    return crc
