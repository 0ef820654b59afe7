"""Fires `corrupt_checkpoint@second=T`: the newest checkpoint on disk gets damaged.

A damaged disk block or a torn write: bytes flipped in one file of the newest job checkpoint's
`arrays` item, the item orbax itself reads back without complaint. The run does not notice (it
never reads its own checkpoints back); a later resume does, through the CRC-32 of every array
(`checkpoints.py`), and falls back to the previous checkpoint, saying which and why in
`summary.json`'s `resumes[].skipped`. If the run writes a newer checkpoint afterwards, the damage
never matters: that is the case the fault checks too.

Driven by the controller's loop (`tick`), like the syncer's crash (`syncer_keeper.py`): a checkpoint
is a whole-job object, no learner's step path touches it. Before damaging, it waits for the writes
in flight to land, so "the newest on disk" is the newest the run asked for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging

from decoupled_diloco import chaos
from decoupled_diloco.runtime.records import checkpoints as checkpoints_lib
from decoupled_diloco.runtime.core import metrics as metrics_lib

FLIPPED_BYTES = 64


def flip_bytes(directory: str, count: int = FLIPPED_BYTES) -> tuple[str, int]:
  """Flips `count` bytes in the middle of the largest file under `directory` (the one that holds
  array bytes); returns (its path, bytes flipped)."""
  files = [os.path.join(root, f) for root, _, names in os.walk(directory) for f in names]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    data = bytearray(f.read())
    start = max(len(data) // 2 - count // 2, 0)
    flipped = min(count, len(data) - start)
    for i in range(start, start + flipped):
      data[i] ^= 0xFF
    f.seek(0)
    f.write(data)
  return largest, flipped


class CheckpointCorrupter:
  """The run's corrupt_checkpoint faults, fired from the controller's loop when their time comes."""

  def __init__(self, faults: Sequence[chaos.Fault],
               checkpoints: checkpoints_lib.Checkpoints | None,
               metrics: metrics_lib.MetricsWriter | None = None,
               clock: Callable[[], float] = time.monotonic):
    self._faults = sorted(faults, key=lambda f: f.second)
    self._checkpoints = checkpoints
    self._metrics = metrics
    self._clock = clock
    self._started_at = clock()
    self.records: list[dict[str, Any]] = []

  def start(self, started_at: float, elapsed_before_s: float = 0.0,
            fired: Sequence[dict[str, Any]] = ()) -> None:
    """Training started at `started_at` (clock time), `elapsed_before_s` into the run (a resumed
    run); the faults in `fired` have happened already, and so has any due before the resume."""
    self._started_at = started_at - elapsed_before_s
    done = {r["source"] for r in fired if r["fault"] == "corrupt_checkpoint"}
    self._faults = [f for f in self._faults if f.source not in done
                    and f.second >= elapsed_before_s]

  def tick(self) -> None:
    """From the controller's loop: damages the newest checkpoint for each fault that is due."""
    while self._faults and self._clock() - self._started_at >= self._faults[0].second:
      self._fire(self._faults.pop(0))

  def _fire(self, fault: chaos.Fault) -> None:
    at_s = round(self._clock() - self._started_at, 3)
    record = {"fault": "corrupt_checkpoint", "learner": None, "step": None, "at_s": at_s,
              "source": fault.source, "damaged": False, "checkpoint": None, "number": None,
              "file": None, "bytes_flipped": 0}
    numbers = []
    if self._checkpoints is not None:
      self._checkpoints.wait()  # the writes in flight land first
      numbers = self._checkpoints.steps()
    if numbers:
      path = os.path.join(self._checkpoints.directory, "job", str(numbers[-1]))
      damaged, flipped = flip_bytes(os.path.join(path, "arrays"))
      record.update(damaged=True, checkpoint=path, number=numbers[-1], file=os.path.relpath(damaged, path),
                    bytes_flipped=flipped)
      logging.warning("fault: checkpoint %s damaged at %.1f s (%d bytes flipped in %s)", path,
                      at_s, flipped, record["file"])
    else:
      record["why_not"] = "no checkpoint on disk yet"
      logging.warning("fault: corrupt_checkpoint at %.1f s found no checkpoint on disk", at_s)
    self.records.append(record)
    if self._metrics is not None:
      self._metrics.write("fault", record)
