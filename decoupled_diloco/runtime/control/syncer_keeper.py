"""Keeps the syncer going: saves its state, and restarts it after a crash (docs/design.md §6).

Every `config.checkpoint.syncer_every_s` the syncer's own state (Theta, the outer state of every
fragment, versions, merge records, clock, grace EMAs) is read on its thread and written with orbax
in the background. When the syncer crashes (a `syncer_crash` fault: its process state is lost) the
learners keep training: what they post goes nowhere (`SyncerPort` drops it and counts it), nothing
they do waits for the syncer. After the repair delay a new syncer is built and compiled, restores
the newest syncer checkpoint that reads back whole, and takes for every fragment the newest Theta_p
a live learner holds if that is newer (`Syncer.recover`): a crash loses at most the outer momentum
since the last checkpoint, never a merge a learner received. Versions stay monotonic.

Before it reads the learners' anchors the new syncer waits until every live learner has published a
state after the crash (bounded): whatever the old syncer delivered to their inboxes is then applied
and shows in their publications.

A sharded syncer has one keeper per shard (`shard_keeper.py`), each saving, crashing and restoring
its own shard (`shard`) from that shard's own checkpoints while the other shards merge on.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging

from decoupled_diloco import chaos
from decoupled_diloco.runtime.records import checkpoints as checkpoints_lib
from decoupled_diloco.runtime.core import handles
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core import network as network_lib

_DRAIN_TIMEOUT_S = 10.0  # longest a restart waits for the learners to apply what they were sent


class SyncerPort:
  """What the learners post to: the running syncer, or nothing while it is down (posts are lost,
  as they would be to a dead process, and counted). A post of a learner cut off by a partition
  (`network`) is lost before it leaves, and counted in that partition's record."""

  def __init__(self, syncer: handles.SyncerHandle | None,
               network: network_lib.Network | None = None):
    self._syncer = syncer
    self._network = network
    self._lock = threading.Lock()
    self.dropped = 0

  def post(self, message: Any) -> None:
    if self._network is not None and self._network.lost(getattr(message, "learner", None)):
      return
    syncer = self._syncer
    if syncer is None:
      with self._lock:
        self.dropped += 1
      return
    syncer.post(message)

  def connect(self, syncer: handles.SyncerHandle | None) -> None:
    self._syncer = syncer


class SyncerKeeper:
  """Periodic syncer checkpoints; crash and restart of the syncer. Driven by the controller."""

  def __init__(self, *, syncer: handles.SyncerHandle, port: SyncerPort,
               make_syncer: Callable[[handles.SyncerHandle], handles.SyncerHandle],
               learners: list[handles.LearnerHandle],
               checkpoints: checkpoints_lib.Checkpoints | None, every_s: float,
               faults: Sequence[chaos.Fault], metrics: metrics_lib.MetricsWriter | None = None,
               clock: Callable[[], float] = time.monotonic, shard: int | None = None):
    """`shard`: the shard of a sharded syncer this keeper keeps (its checkpoints are its own);
    None: the syncer is not sharded."""
    self.syncer = syncer  # the current one (while down: the crashed one, stopped)
    self.shard = shard
    self._name = "the syncer" if shard is None else f"syncer shard {shard}"
    self._port = port
    self._make_syncer = make_syncer
    self._learners = learners
    self._checkpoints = checkpoints
    self._every_s = every_s
    self._faults = sorted(faults, key=lambda f: f.second)
    self._metrics = metrics
    self._clock = clock
    self._started_at = clock()
    self._last_save = clock()
    self._pending_state: concurrent.futures.Future | None = None
    self._down: dict[str, Any] | None = None  # the crash being healed
    self.records: list[dict[str, Any]] = []  # one per crash, with what the restart restored
    self.fault_records: list[dict[str, Any]] = []

  @property
  def down(self) -> bool:
    return self._down is not None

  def start(self, started_at: float, elapsed_before_s: float = 0.0,
            fired: Sequence[dict[str, Any]] = ()) -> None:
    """Training started at `started_at` (clock time), `elapsed_before_s` after the run's start
    (a resumed run); the faults in `fired` have already happened."""
    self._started_at = started_at - elapsed_before_s
    self._last_save = started_at
    done = {r["source"] for r in fired if r["fault"] == "syncer_crash" or (
        r["fault"] == "node_loss" and r["learner"] is None)}
    self._faults = [f for f in self._faults if f.source not in done
                    and f.second >= elapsed_before_s]

  def _elapsed(self, t: float | None = None) -> float:
    return round((self._clock() if t is None else t) - self._started_at, 3)

  def tick(self) -> None:
    """From the controller's loop: saves, crashes and restarts what is due."""
    now = self._clock()
    if self._down is None:
      self._save_if_due(now)
      if self._faults and self._elapsed(now) >= self._faults[0].second:
        fault = self._faults.pop(0)
        self._crash(fault.source, fault.down_s, now, kind=fault.kind)
      elif self.syncer.process_died:
        # runtime=ray: the syncer's process died unplanned (a kill -9 by hand, the OOM killer).
        # Ray has restarted it already: restore it now, as after an injected crash.
        self._crash(f"its process died ({self.syncer.error})", 0.0, now, planned=False)
    elif now >= self._down["restart_at"]:
      try:
        self._restart()
      except handles.SyncerGone as err:
        # runtime=ray: the restarted process died too (another fault, its host lost): Ray
        # restarts it again; so does this, a moment later.
        logging.warning("%s: its restart failed (%s); trying again", self._name, err)
        self._port.connect(None)
        self._down["restart_at"] = self._clock() + 1.0

  def _save_if_due(self, now: float) -> None:
    if self._checkpoints is None or not self._every_s:
      return
    if self._pending_state is not None:
      if self._pending_state.done():
        state = self._pending_state.result()
        self._pending_state = None
        if state is not None:  # None: the syncer's process died before it answered (runtime=ray)
          self._checkpoints.save_syncer(self.syncer.stats.merges, state, shard=self.shard)
      return
    if now - self._last_save >= self._every_s:
      self._last_save = now
      self._pending_state = self.syncer.request_state()

  def _crash(self, source: str, down_s: float, now: float, planned: bool = True,
             kind: str = "syncer_crash") -> None:
    crashed = self.syncer
    self._port.connect(None)
    if kind == "node_loss":  # its host lost (runtime=ray on a cluster); Ray restarts it elsewhere
      crashed.lose_host()
    elif planned:  # (an unplanned crash is dead already)
      crashed.kill()  # as a real crash: SIGKILL of a syncer process (runtime=ray), or its thread
    self._pending_state = None
    record = {"fault": kind, "learner": None, "step": None,
              "at_s": self._elapsed(now), "source": source, "down_s": round(down_s, 3)}
    if self.shard is not None:
      record["shard"] = self.shard
    self.fault_records.append(record)
    if self._metrics is not None:
      self._metrics.write("fault", record)
    logging.warning("fault: %s crashed at %.1f s (%s); the learners train on", self._name,
                    record["at_s"], source)
    self._down = {"record": record, "crashed_at": now, "restart_at": now + down_s,
                  "steps": {l.index: l.published.step for l in self._learners if l.alive},
                  "dropped_before": self._port.dropped}

  def _drained(self, down: dict[str, Any]) -> bool:
    """Every live learner has published a state after the one it held at the crash (or
    finished training, when it applies what arrives within milliseconds)."""
    return all(l.published.step > down["steps"].get(l.index, -1) + 1 or not l.published.training
               for l in self._learners if l.alive)

  def _restart(self) -> None:
    down = self._down
    restarted_at = self._clock()
    deadline = restarted_at + _DRAIN_TIMEOUT_S
    while not self._drained(down) and self._clock() < deadline:
      time.sleep(0.01)
    drained = self._clock()
    syncer = self._make_syncer(self.syncer)  # (the crashed one, until now)
    restored, source = None, "the initial Theta (no syncer checkpoint)"
    if self._checkpoints is not None:
      self._checkpoints.wait()
      found = self._checkpoints.restore_syncer(shard=self.shard)
      if found is not None:
        restored, source = found.cut.syncer, found.path
    self._port.connect(syncer)  # posts queue in its inbox until it starts
    live = [l for l in self._learners if l.alive]
    info = syncer.recover(restored, {l.index: l.published for l in live},
                          stats=self.syncer.stats, tape=self.syncer.tape)
    for learner in live:
      published = learner.published
      syncer.attach(learner.index, learner, step=published.step, incarnation=learner.incarnation,
                    anchor_versions=published.anchor_versions)
    self.syncer = syncer
    syncer.start()
    syncer.catch_up()
    back = self._clock()
    record = down["record"]
    record.update(back_at_s=self._elapsed(back), restored_from=source,
                  drain_s=round(drained - restarted_at, 3),
                  restart_build_s=round(back - drained, 3),
                  posts_lost=self._port.dropped - down["dropped_before"], **info)
    self.records.append(record)
    self._down = None
    self._last_save = back
    if self._metrics is not None:
      self._metrics.write("syncer_restart", record)
    logging.info("%s is back at %.1f s from %s; %d fragment(s) took a newer Theta_p from the "
                 "learners", self._name, record["back_at_s"], source,
                 len(info["fragments_from_learners"]))
