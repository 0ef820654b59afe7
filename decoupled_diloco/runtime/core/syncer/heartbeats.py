"""The syncer's heartbeats: which learners are absent, and taking them back (detection).

A learner still training whose step reports stop for longer than its timeout
(`algorithm/heartbeat.py`) is *absent*: rounds neither ask it nor wait for it, the quorum counts the
others, and an offer of it still copying is late (weight 0). It stays attached and is still sent
every broadcast (a hung learner applies them when it wakes). Its next report takes it back, and the
syncer then sends it every Theta_p newer than the versions that report says it holds: broadcasts
lost on the way (a partition, `runtime/core/network.py`) are made good.

These are methods of `Syncer` (`syncer/syncer.py`), run on the syncer's thread over the state its
`__init__` sets up.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from absl import logging

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import grace as grace_lib
from decoupled_diloco.algorithm import heartbeat
from decoupled_diloco.runtime.core import global_model as global_model_lib
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core.syncer import rounds as syncer_rounds


class SyncerHeartbeats:
  """The heartbeats' part of `Syncer`: marks learners absent and takes them back."""

  # Set up by `Syncer.__init__`.
  _now: Callable[[], float]
  _sync: settings_lib.SyncSettings
  _sharing: int
  _metrics: metrics_lib.MetricsWriter | None
  model: global_model_lib.GlobalModel
  _learners: dict[int, syncer_rounds.LearnerLink]
  _incarnations: dict[int, int]
  _live: set[int]
  _training: set[int]
  _absent: set[int]
  _last_report_at: dict[int, float]
  _absent_at: dict[int, float]
  shard: int | None
  _learner_steps: dict[int, int]
  _reported_anchors: dict[int, np.ndarray]
  _rounds: dict[int, syncer_rounds.Round]
  _grace: grace_lib.GraceEstimator
  stats: syncer_rounds.SyncerStats

  def _check_heartbeats(self) -> None:
    """Marks absent the learners silent past their timeout, takes back those that reported.

    Only learners still training are watched (a finished one has no step to report); the
    lock-step modes wait for every learner by design and are not watched.
    """
    if self._sync.lock_step:
      return
    now = self._now()
    watched = self._live & self._training
    emas = {m: ema.value for m, ema in self._grace.step_times}
    absent = heartbeat.absent({m: self._last_report_at.get(m, now) for m in watched}, emas, now,
                              self._sync.heartbeat_timeout_s, self._sharing)
    for m in sorted(absent - self._absent):
      self._mark_absent(m, now, heartbeat.timeout_s(self._sync.heartbeat_timeout_s, emas.get(m),
                                                    self._sharing))
    for m in sorted(self._absent - absent):
      if m in self._live:
        self._take_back(m, now)
      else:
        self._absent.discard(m)

  def _mark_absent(self, m: int, now: float, timeout_s: float) -> None:
    self._absent.add(m)
    self._absent_at[m] = now
    self.stats.absences += 1
    for round_ in self._rounds.values():
      # Its offers still on their way are late: weight 0 (the flush still waits for them).
      taken = None if round_.final else round_.copying.pop(m, None)
      if taken is not None:
        self.stats.late_offers += 1
        self._count_in_flight([taken], round_.fragment)
    record = {"learner": m, "incarnation": self._incarnations.get(m, 0),
              "step": self._learner_steps.get(m, 0),
              "silent_s": round(now - self._last_report_at.get(m, now), 3),
              "timeout_s": round(timeout_s, 3)}
    if self.shard is not None:
      record["shard"] = self.shard  # each shard of a sharded syncer hears every learner
    logging.warning("syncer: learner %d has not reported for %.2f s (timeout %.2f s, "
                    "config.sync.heartbeat_timeout_s): absent, merging without it", m,
                    record["silent_s"], timeout_s)
    if self._metrics is not None:
      self._metrics.write("absent", record)

  def _take_back(self, m: int, now: float) -> None:
    """m reported again: it counts from the next poll on, and gets every Theta_p newer than the
    versions its report says it holds (it may have lost broadcasts meanwhile)."""
    self._absent.discard(m)
    self.stats.returns += 1
    held = self._reported_anchors.get(m)
    sent, nbytes = [], 0
    for p in self.model.owned:
      if held is not None and self.model.version(p) <= held[p]:
        continue
      version, wire = self.model.wire(p)
      if version == 0:
        continue  # never merged: it holds the initial Theta_p
      broadcast = self._naming_last_merged(m, messages.Broadcast(p, version, wire))
      self._learners[m].deliver(broadcast)
      sent.append(p)
      nbytes += broadcast.nbytes
    self.stats.catch_up_fragments += len(sent)
    self.stats.bytes_down += nbytes
    record = {"learner": m, "incarnation": self._incarnations.get(m, 0),
              "step": self._learner_steps.get(m, 0),
              "absent_s": round(now - self._absent_at.pop(m, now), 3), "fragments_sent": sent,
              "bytes_sent": nbytes}
    if self.shard is not None:
      record["shard"] = self.shard
    logging.info("syncer: learner %d reports again at step %d: taken back, sent %d newer "
                 "fragment(s)", m, record["step"], len(sent))
    if self._metrics is not None:
      self._metrics.write("back", record)
