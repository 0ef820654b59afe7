"""Restarts failed learners as new incarnations on their own meshes (docs/design.md §6, rejoin).

Decoupled and lock-step modes alike; in a lock-step mode the rejoiner also takes the barrier its
peer waits at (`LearnerSnapshot.offers_made`). dp mode restarts the whole job instead
(`job_restart.py`).

`start()` runs `poll()` on the supervisor's own thread every 50 ms, so a repair is acted on at once
even while the controller thread evaluates (an eval at real size takes seconds). A learner whose thread ended with an error has
failed, whatever the cause: the supervisor records what the failure lost (the learner's steps that
no merge had taken in), waits until its devices are repaired (`repaired_at`, the cluster's answer;
now for a failure that took no device down), and starts the next incarnation:

- inner state: the AdamW moments and step count of the healthy peer with the newest publication
  (in-memory peer state, no stop of the peer: publications are immutable device arrays); with no
  healthy peer, fresh moments at the failed learner's last step;
- parameters: the syncer's current Theta_p of every fragment, with those versions as anchors and
  counters at 0 (`GlobalModel.received`); the syncer sends whatever it merges after that read;
- data: its own loader, whose position the host kept (a thread runtime's host survives a device
  failure; a process runtime will take it from the learner's checkpoint).

The failed incarnation's state is never read again: only its host-side counters, to account for
what it lost. Each restart is a record in `records` and a `rejoin` line in metrics.jsonl.

A failure is the learner's own (`cause` "application": a bug, a non-finite loss, a crash fault) or
its slice lost (`cause` "lost_slice"): under Pathways as pathwaysutils classifies the error
(slice_watch.py), under config.ray.tpu_slice a host of the learner's TPU slice lost (it moves whole
to another slice). A lost slice does not count against `max_restarts`: that bound is for a learner
that keeps failing on its own, and a long run on preemptible slices would spend any budget on
lost ones. Under Pathways a lost slice waits for its slice to answer again instead of
`repaired_at`; pathwaysutils reads INTERNAL, NOT_FOUND and DEADLINE_EXCEEDED errors as lost slices
too, and one whose slices answer at the first check was no slice lost: it becomes the learner's
own failure (else a learner failing so on its own would rejoin without end). Under Ray which it
was is known only once the learner's processes are back or a host is declared dead (`cause` None
until then), so for such a learner the decision to give up waits for its repair.

A late learner (`config.late_learners`, a scavenged slice: docs/failures.md) joins through the same
path as a rejoin (docs/design.md §6): it is built but neither started nor attached to the syncer,
waits like a failed learner whose devices come back at its `join@` second, then starts from a peer's
state and Theta as incarnation 1. Its record is a `join` fault (`on_join`), not a failure: it lost
nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from decoupled_diloco.runtime.control import slice_watch as slice_watch_lib
from decoupled_diloco.runtime.core import handles
from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
# Here too, for callers of `supervisor.rejoin_snapshot`.
from decoupled_diloco.runtime.core.rejoin import rejoin_snapshot

# A failure record's `cause`: the learner's own failure, or its slice lost (slice_watch.py).
APPLICATION = "application"
LOST_SLICE = "lost_slice"


class Supervisor:
  """Watches the learners; replaces a failed one with its next incarnation once repaired."""

  def __init__(self, learners: list[learner_lib.Learner],
               syncer: Callable[[], syncer_lib.Syncer | None], *,
               init_opt_state: Callable[[Any], Any], repaired_at: Callable[[int], float],
               max_restarts: int, metrics: metrics_lib.MetricsWriter | None = None,
               late_learners: tuple[int, ...] = (),
               on_join: Callable[..., dict[str, Any]] | None = None,
               lost_slices: slice_watch_lib.SliceWatch | None = None,
               lost_slice: Callable[[int], bool | None] = lambda m: False,
               clock: Callable[[], float] = time.monotonic):
    self.learners = learners  # the run's list: a restart replaces its entry
    self._syncer = syncer  # the running syncer; None while it is down (a rejoin then waits)
    self._init_opt_state = init_opt_state
    self._repaired_at = repaired_at
    self._max_restarts = max_restarts
    # config.ray.tpu_slice: whether failed learner m lost a host of its slice (None: not known yet).
    self._lost_slice = lost_slice
    self._metrics = metrics
    # Under Pathways: which failures are lost slices, and when those are back (None: none are).
    self._lost_slices = lost_slices
    self._clock = clock
    self._started_at = clock()
    self._failed: dict[int, dict[str, Any]] = {}  # learner -> record of the failure being healed
    # Late learners wait as failed ones do, until their devices are there (their join second).
    for m in late_learners:
      self._failed[m] = {"learner": m, "_joining": True}
    self._on_join = on_join
    # learner -> (its rejoin or join record, when its devices were repaired)
    self._waiting_first_step: dict[int, tuple[dict[str, Any], float]] = {}
    self.restarts = [0] * len(learners)  # per learner, restarts counted against max_restarts
    self.retired: list[learner_lib.Learner] = []  # failed incarnations, for the accounting
    self.start_steps = [0] * len(learners)  # where each learner's current incarnation started
    self.records: list[dict[str, Any]] = []
    self.error: BaseException | None = None  # a restart that failed (the run then fails)
    self._lock = threading.Lock()  # one poll at a time: the thread's and the controller's last
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

  def start(self, started_at: float, poll_every_s: float = 0.05) -> None:
    """Training started at `started_at` (clock time; records count their seconds from there):
    polls on its own thread until `stop()`."""
    self._started_at = started_at
    self._poll_every_s = poll_every_s
    self._thread.start()

  def stop(self) -> None:
    """Stops polling, then polls once more (a learner that rejoined at the very end)."""
    self._stop.set()
    self._stop_watching()
    if self._thread.is_alive():
      self._thread.join()
    if self.error is None:
      self.poll()
    with self._lock:
      # A learner that rejoined at its last step (its peer's step was num_steps) never makes a
      # first step: its record still goes to the metrics and the tape, without that time.
      for m in sorted(self._waiting_first_step):
        record, _ = self._waiting_first_step.pop(m)
        record["repair_to_first_step_s"] = None
        self._write(record)

  def _run(self) -> None:
    try:
      while not self._stop.wait(self._poll_every_s):
        self.poll()
    except BaseException as err:  # pylint: disable=broad-except
      self.error = err
      logging.exception("supervisor failed")

  @property
  def pending(self) -> bool:
    """A failed learner waits for its repair or restart, or has not been seen yet: the run is
    not over."""
    return bool(self._failed) or any(l.error is not None and l not in self.retired
                                     for l in list(self.learners))

  @property
  def repairing(self) -> bool:
    """A failed learner waits for its repair or restart: a lock-step barrier waiting for it is
    not stalled."""
    return bool(self._failed) or any(l.error is not None and l not in self.retired
                                     for l in list(self.learners)
                                     if self.restarts[l.index] < self._max_restarts)

  def halt(self) -> None:
    """Stops polling at once (the run is being shut down)."""
    self._stop.set()
    self._stop_watching()

  def _stop_watching(self) -> None:
    if self._lost_slices is not None:
      self._lost_slices.stop()

  def poll(self) -> bool:
    """Records new failures, restarts repaired learners. Returns whether a learner restarted."""
    with self._lock:
      return self._poll()

  def _poll(self) -> bool:
    now = self._clock()
    restarted = False
    for m, learner in enumerate(self.learners):
      if learner.error is not None and m not in self._failed and learner not in self.retired:
        self._on_failure(m, learner, now)
      if m in self._failed and self._repaired(m, now) and self._syncer() is not None:
        self._rejoin(m)
        restarted = True
      waiting = self._waiting_first_step.get(m)
      if waiting is not None and self.learners[m].first_step_done_at is not None:
        record, repaired = self._waiting_first_step.pop(m)
        record["repair_to_first_step_s"] = round(self.learners[m].first_step_done_at - repaired, 3)
        self._write(record)
    return restarted

  def _repaired(self, m: int, now: float) -> bool:
    """Failed learner m can start again: its lost slice is back, or its devices are repaired."""
    record = self._failed[m]
    if record.get("_watched"):
      if self._lost_slices.back_at(m) is None:
        return False
      if not self._lost_slices.answered_at_once(m):
        return True
      # Its slices never went down: the learner's own failure after all.
      self._lost_slices.forget(m)
      del record["_watched"]
      record.update(cause=APPLICATION, slices_answered_at_once=True)
      logging.warning("learner %d: its slices answered the first check, so %s was its own error",
                      m, record["error"])
      if self.restarts[m] >= self._max_restarts:
        del self._failed[m]
        self._give_up(m, record)
        return False
    return now >= self._repaired_at(m)

  def _elapsed(self, t: float) -> float:
    return round(t - self._started_at, 3)

  def _on_failure(self, m: int, learner: learner_lib.Learner, now: float) -> None:
    counters = learner.counters()
    self.retired.append(learner)
    watched = self._lost_slices is not None and self._lost_slices.is_lost_slice(learner.error)
    record = {"learner": m, "incarnation": learner.incarnation, "step": learner.step,
              "failed_at_s": self._elapsed(now), "error": repr(learner.error),
              "cause": LOST_SLICE if watched else self._cause(m),
              "unmerged_fragment_steps": int(counters.steps.sum()),
              # Per fragment, what its host-side counters held and the Theta_p versions it had
              # applied: the summary subtracts what merges in flight still took in.
              "counter_tokens": counters.tokens.tolist(),
              "anchor_versions": counters.anchor_versions.tolist()}
    if watched:
      record["_watched"] = True  # waits for slice_watch's check, not for repaired_at
    self.records.append(record)
    if record.get("_watched"):
      self._failed[m] = record
      self._lost_slices.watch(m)
      logging.warning("learner %d lost its slice at step %d (%r); it rejoins once the slice is back",
                      m, learner.step, learner.error)
      return
    if record["cause"] == APPLICATION and self.restarts[m] >= self._max_restarts:
      self._give_up(m, record)
      return
    self._failed[m] = record
    logging.warning("learner %d failed at step %d (%r); it held %d fragment-steps no applied merge "
                    "had taken in; it restarts once repaired", m, learner.step, learner.error,
                    record["unmerged_fragment_steps"])

  def _cause(self, m: int) -> str | None:
    """Under config.ray.tpu_slice: lost_slice if a host of learner m's slice was lost, None while
    that is not known; otherwise application."""
    lost = self._lost_slice(m)
    return None if lost is None else LOST_SLICE if lost else APPLICATION

  def _give_up(self, m: int, record: dict[str, Any]) -> None:
    """Learner m has failed once more than config.max_restarts allows: it stays down."""
    record["restarted"] = False
    syncer = self._syncer()
    if syncer is not None:
      syncer.give_up(m)  # a lock-step barrier stops waiting for it
    logging.error("learner %d failed at step %d and has been restarted %d times "
                  "(config.max_restarts): the run goes on without it", m, record["step"],
                  self.restarts[m])
    self._write(record)

  def _healthy_peer(self, m: int) -> learner_lib.Learner | None:
    peers = [l for l in self.learners if l.index != m and l.alive]
    return max(peers, key=lambda l: l.published.step, default=None)

  def holds_back(self, m: int) -> bool:
    """Learner m is late and has not joined yet: not started, not attached."""
    return self._failed.get(m, {}).get("_joining", False)

  def _rejoin(self, m: int) -> None:
    # The record stays in `_failed` until the new incarnation is in `learners`: a rejoin that
    # builds for long (new processes, on another TPU slice) keeps the run `pending`, where the
    # controller would otherwise see every learner finished (the failed one too) and end the run.
    record = self._failed[m]
    joining = record.get("_joining", False)
    failed = self.learners[m]
    if not joining:
      failed.join(timeout=10)  # it has failed; its thread is only posting its exit
      if record["cause"] is None:
        record["cause"] = self._cause(m) or APPLICATION  # known now that it is repaired
      if record["cause"] == APPLICATION and self.restarts[m] >= self._max_restarts:
        del self._failed[m]
        self._give_up(m, record)
        return
    repaired = self._clock()
    syncer = self._syncer()
    try:
      theta, versions = syncer.model.received()
    except handles.SyncerGone as err:
      logging.warning("learner %d rejoins once the syncer is back (%s)", m, err)
      return
    layout = failed.layout
    peer = self._healthy_peer(m)
    # A donating learner publishes its optimizer state only when asked: at its next step.
    recent = np.mean(peer.step_times[-10:]) if peer is not None and peer.step_times else 0.0
    published = peer.full_publication(max(5.0, 10.0 * recent)) if peer is not None else None
    if published is not None:
      source = f"learner {peer.index}"
    else:
      peer = None
      source = "fresh optimizer state (no healthy peer)"
    snapshot = rejoin_snapshot(theta, versions, layout, published, failed.step,
                               self._init_opt_state,
                               peer.offers_made if peer is not None else None)
    step, opt_state = snapshot.step, snapshot.train_state.opt_state
    try:
      new = failed.respawn(snapshot)
    except handles.GoneWhileRestarting as err:
      logging.warning("%s; it rejoins once its process is back", err)
      return
    # The event tape (runtime/records/event_tape.py): what a replay needs to make this incarnation again.
    new.tape_respawn(
        failed_incarnation=failed.incarnation, failed_step=failed.step,
        failed_batches=failed.batches_taken, step=step, versions=versions.tolist(),
        peer=None if peer is None else peer.index,
        peer_incarnation=None if peer is None else peer.incarnation,
        peer_step=None if published is None else published.step,
        peer_publication=None if published is None else published.index)
    self.learners[m] = new
    del self._failed[m]
    self.start_steps[m] = step
    if record.get("_watched"):
      record["slice_back_at_s"] = self._elapsed(self._lost_slices.back_at(m))
      self._lost_slices.forget(m)
    if not joining and record["cause"] == APPLICATION:
      self.restarts[m] += 1
    syncer.attach(m, new, step=step, incarnation=new.incarnation, anchor_versions=versions)
    new.start()
    theta_bytes = sum(int(v.nbytes) for v in theta.values())
    opt_bytes = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
                    for x in jax.tree.leaves(opt_state))
    if joining:
      record = self._on_join(m, step) if self._on_join is not None else {"learner": m}
      record.update(joined_at_s=self._elapsed(repaired))
    record.update(restarted=True, repaired_at_s=self._elapsed(repaired),
                  incarnation_after=new.incarnation, step_after=step, state_from=source,
                  bytes_to_rejoiner=theta_bytes + opt_bytes,
                  rejoin_build_s=round(self._clock() - repaired, 3))
    self._waiting_first_step[m] = (record, repaired)
    logging.info("learner %d %s as incarnation %d at step %d (state from %s, %.1f MB)",
                 m, "joined" if joining else "rejoined", new.incarnation, step, source,
                 record["bytes_to_rejoiner"] / 1e6)

  def _write(self, record: dict[str, Any]) -> None:
    if self._metrics is not None:
      self._metrics.write("rejoin", {k: v for k, v in record.items() if not k.startswith("_")
                                     and k not in ("counter_tokens", "anchor_versions")})

  def summary_records(self) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in self.records]
