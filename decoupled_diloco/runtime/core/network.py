"""The links between the learners and the syncer, which a `partition` fault cuts.

A learner reaches the syncer through one call (`SyncerPort.post`: step reports, TrainingDone,
exits) and the syncer reaches a learner through two (`LearnerLink.offer`, the pull of a fragment,
and `deliver`, a broadcast). A `partition@learner=M,...,seconds=T` fault cuts all three for learner
M during T seconds: what would cross is *lost*, not delayed, as on a real network whose connection
dropped. The learner keeps training meanwhile; nothing on either side is told that a partition
happened. The syncer sees a learner that stopped reporting (heartbeat detection,
`algorithm/heartbeat.py`) and, when its reports come back, sends it the Theta_p versions it lacks.

Every message lost is counted in the partition's fault record (`messages_lost`, with the pulls the
syncer tried, which it retries every few milliseconds, counted apart as `pulls_lost`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from decoupled_diloco.runtime.core import messages


class Network:
  """Which learners are cut off now, and what their partitions lost. Thread-safe."""

  def __init__(self, clock: Callable[[], float] = time.monotonic):
    self._clock = clock
    self._lock = threading.Lock()
    self._cuts: dict[int, tuple[float, dict[str, Any]]] = {}  # learner -> (until, fault record)

  def partition(self, learner: int, seconds: float, record: dict[str, Any]) -> None:
    """Cuts `learner` off for `seconds` from now; losses are counted into `record`."""
    record.setdefault("messages_lost", 0)
    record.setdefault("pulls_lost", 0)
    with self._lock:
      self._cuts[learner] = (self._clock() + seconds, record)

  def _cut(self, learner: int | None) -> dict[str, Any] | None:
    """The record of the partition `learner` is in now, or None (the link is up)."""
    if learner is None or not self._cuts:
      return None
    with self._lock:
      cut = self._cuts.get(learner)
      if cut is None:
        return None
      if self._clock() >= cut[0]:
        del self._cuts[learner]  # healed
        return None
      return cut[1]

  def lost(self, learner: int | None, what: str = "messages_lost") -> bool:
    """Whether something crossing `learner`'s link now is lost (and counts it if so)."""
    record = self._cut(learner)
    if record is None:
      return False
    with self._lock:
      record[what] += 1
    return True

  def link(self, learner: int, link: Any) -> "PartitionedLink":
    """The syncer's side of `learner`'s link: `link` behind this network."""
    return PartitionedLink(learner, link, self)


class PartitionedLink:
  """A `syncer.LearnerLink` whose pulls and broadcasts are lost while its learner is cut off."""

  def __init__(self, learner: int, link: Any, network: Network):
    self._learner = learner
    self._link = link
    self._network = network

  def offer(self, fragment: int, merged_through: int) -> messages.Offer | messages.Answer:
    if self._network.lost(self._learner, "pulls_lost"):
      return messages.Answer.UNREACHABLE
    return self._link.offer(fragment, merged_through)

  def deliver(self, broadcast: messages.Broadcast) -> None:
    if self._network.lost(self._learner):
      return
    self._link.deliver(broadcast)

  @property
  def published(self) -> messages.Publication:
    # Read for checkpoints only, by the controller's side: not a message on this link.
    return self._link.published

  @property
  def training(self) -> bool:
    return self._link.training  # read at attach, by the controller's side too

  def want_full_state(self, seconds: float) -> None:
    self._link.want_full_state(seconds)  # for checkpoints too: not a message either
