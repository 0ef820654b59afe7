"""Fires the faults of `config.chaos` inside a running job, through the paths real failures take.

A crash is an exception raised in the learner's step path, before its next step: on Pathways a lost
slice surfaces the same way, as an error on the next access to its arrays. The injector also plays
the cluster's repair service: it knows when a crashed learner's devices are back
(`repaired_at`), which is all the recovery code (`supervisor.py`) asks; it never learns whether a
failure was injected.

A hang blocks the learner's thread for its duration (a stale learner that wakes up with its old
state); a slow learner's steps are stretched by sleeping (factor - 1) step times after each. A
partition cuts the learner's links to the syncer (`network.Network`) for its duration: what would
cross is lost, and the learner trains on.

A nan fault corrupts the output of the learner's next step: every parameter tensor of the state
that step returns holds a NaN, as after a diverged update or silent data corruption on a device.
It goes through the step function itself (`wrap_train_step`), so the learner publishes and offers
that state like any other, and finds out only from the next step's loss, as it would for real.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from decoupled_diloco.lm import inner
from decoupled_diloco import chaos
from decoupled_diloco.runtime.core import network as network_lib

class LearnerFailure(RuntimeError):
  """A learner's devices failed: its device state is lost."""


class NodeLoss(LearnerFailure):
  """A learner's host is lost with every process on it (runtime=ray on a cluster: the transport
  takes the Ray node down, `ray_plumbing.lose_node`)."""


class FaultInjector:
  """Per learner, the faults still to fire; called on each learner's thread before every step."""

  def __init__(self, faults: Sequence[chaos.Fault], random_crashes: chaos.RandomCrashes | None,
               num_learners: int, *, on_fault: Callable[[dict[str, Any]], None] | None = None,
               clock: Callable[[], float] = time.monotonic):
    # The links between the learners and the syncer, which partitions cut: the runtime routes the
    # learners' posts and the syncer's pulls and broadcasts through it (runtime/core/network.py).
    self.network = network_lib.Network(clock)
    self._clock = clock
    self._on_fault = on_fault
    self._lock = threading.Lock()
    # Fired on the learners' threads; a join is not (the learner is not running): the supervisor
    # admits a late learner once `repaired_at` says its devices are there.
    self._pending = {m: [f for f in faults if f.learner == m and f.kind != "join"]
                     for m in range(num_learners)}
    self._joins = {f.learner: f for f in faults if f.kind == "join"}
    # Fired by the controller (`syncer_keeper.SyncerKeeper`), not on a learner's thread.
    self.syncer_faults = [f for f in faults if f.kind == "syncer_crash" or (
        f.kind == chaos.NODE_LOSS and f.learner is None)]
    self.checkpoint_faults = [f for f in faults if f.kind == "corrupt_checkpoint"]
    self._random = {m: random_crashes.crashes(m) for m in range(num_learners)
                    } if random_crashes is not None and random_crashes.enabled else {}
    self._next_random = {m: next(gen) for m, gen in self._random.items()}
    self._repaired_at: dict[int, float] = {m: math.inf for m in self._joins}  # set by start()
    self._slow_until: dict[int, tuple[float, float]] = {}  # learner -> (until, factor)
    self._corrupt_next: set[int] = set()  # learners whose next step's output gets a NaN
    self._nan_learners = {f.learner for f in faults if f.kind == "nan"}
    self._last_call: dict[int, float] = {}
    self._stop = threading.Event()
    self._started_at: float | None = None
    self._offset_s = 0.0
    self.records: list[dict[str, Any]] = []

  def start(self, started_at: float | None = None) -> None:
    """Training starts (now by default): `second=` triggers count from here (plus, in a resumed
    run, the seconds trained before)."""
    started_at = self._clock() if started_at is None else started_at
    self._started_at = started_at - self._offset_s
    with self._lock:
      for m, join in self._joins.items():
        self._repaired_at[m] = min(self._repaired_at[m], self._started_at + join.second)

  def record_join(self, learner: int, step: int, **extra) -> dict[str, Any]:
    """Late `learner` joined at `step` (the supervisor admitted it): its `join` fault record,
    kept (and updated by the caller) in `records`."""
    join = self._joins[learner]
    return self._record(join, learner, step, self.elapsed(), second=join.second, **extra)

  def resume(self, elapsed_s: float, fired: Sequence[dict[str, Any]],
             steps: Sequence[int]) -> None:
    """A resumed run: training had gone on for `elapsed_s` before, the faults in `fired` (their
    records) have happened, and learner m stands at `steps[m]`. Those faults, the step-triggered
    ones before where their learner stands, and the random ones before `elapsed_s`, do not fire
    again. Call before `start`."""
    done = {(r["fault"], r["learner"], r["source"]) for r in fired}
    with self._lock:
      for m, pending in self._pending.items():
        self._pending[m] = [f for f in pending if (f.kind, m, f.source) not in done
                            and not (f.step is not None and f.step < steps[m])]
      for m, upcoming in self._next_random.items():
        while upcoming.second < elapsed_s:
          upcoming = next(self._random[m])
        self._next_random[m] = upcoming
    self._offset_s = elapsed_s

  def stop(self) -> None:
    """Ends any hang at once (the run is shutting down)."""
    self._stop.set()

  def elapsed(self) -> float:
    return 0.0 if self._started_at is None else self._clock() - self._started_at

  def clock_at(self, elapsed_s: float) -> float:
    """The clock time of a record's `at_s` (seconds into the run's training, earlier segments
    of a resumed run included)."""
    return (self._clock() if self._started_at is None else self._started_at) + elapsed_s

  def repaired_at(self, learner: int) -> float:
    """When the devices of `learner` can be used again (clock time); -inf if they never failed.

    Not "now": a caller compares it with a time it read before asking, which "now" would always
    exceed, and a failure that took no device down (a non-finite loss, a software error in a run
    with faults) would then wait for a repair forever.
    """
    with self._lock:
      return self._repaired_at.get(learner, -math.inf)

  def wrap_train_step(self, learner: int, train_step: Callable[[Any, Any], tuple[Any, Any]]
                      ) -> Callable[[Any, Any], tuple[Any, Any]]:
    """`train_step` of `learner`, whose output state a nan fault corrupts (see the module
    docstring). The step itself where no nan fault is scheduled for that learner.

    The state is the learner's train state: a NamedTuple with a `params` dict of arrays.
    """
    if learner not in self._nan_learners:
      return train_step

    def step(state, batch):
      new_state, step_metrics = train_step(state, batch)
      with self._lock:
        corrupt = learner in self._corrupt_next
        self._corrupt_next.discard(learner)
      if corrupt:
        new_state = new_state._replace(params=jax.tree.map(with_nan, new_state.params))
      return new_state, step_metrics

    step.donates_state = inner.donates_state(train_step)  # the learner copies what it publishes
    return step

  def step_hook(self, learner: int, step: int) -> None:
    """Before step `step` of `learner`, on its thread: fires what is due (may raise)."""
    if self._started_at is None:
      return
    now, elapsed = self._clock(), self.elapsed()
    self._stretch(learner, now)
    due = self._take_due(learner, step, elapsed)
    for fault in due:
      self._fire(fault, learner, step, elapsed)

  # ---- internals -------------------------------------------------------------------------------

  def _take_due(self, learner: int, step: int, elapsed: float) -> list[chaos.Fault]:
    with self._lock:
      pending = self._pending[learner]
      due = [f for f in pending if f.due(step, elapsed)]
      self._pending[learner] = [f for f in pending if f not in due]
      upcoming = self._next_random.get(learner)
      if upcoming is not None and upcoming.due(step, elapsed):
        due.append(upcoming)
        self._next_random[learner] = next(self._random[learner])
    # A crash ends the step path: the faults fired before it in the same boundary go first.
    return sorted(due, key=lambda f: f.kind in ("crash", chaos.NODE_LOSS))

  def _record(self, fault: chaos.Fault, learner: int, step: int, elapsed: float,
              **extra) -> dict[str, Any]:
    record = {"fault": fault.kind, "learner": learner, "step": step, "at_s": round(elapsed, 3),
              "source": fault.source, **extra}
    with self._lock:
      self.records.append(record)
    logging.warning("fault: %s of learner %d before step %d at %.1f s (%s)", fault.kind, learner,
                    step, elapsed, fault.source)
    if self._on_fault is not None:
      self._on_fault(record)
    return record

  def _fire(self, fault: chaos.Fault, learner: int, step: int, elapsed: float) -> None:
    if fault.kind == "crash":
      with self._lock:
        self._repaired_at[learner] = self._clock() + fault.down_s
      self._record(fault, learner, step, elapsed, down_s=round(fault.down_s, 3))
      raise LearnerFailure(f"learner {learner}: its devices failed before step {step}")
    if fault.kind == chaos.NODE_LOSS:
      self._record(fault, learner, step, elapsed)
      raise NodeLoss(f"learner {learner}: its host was lost before step {step}")
    if fault.kind == "hang":
      self._record(fault, learner, step, elapsed, seconds=fault.seconds)
      self._stop.wait(fault.seconds)
    elif fault.kind == "nan":
      self._record(fault, learner, step, elapsed)
      with self._lock:
        self._corrupt_next.add(learner)
    elif fault.kind == "partition":
      record = self._record(fault, learner, step, elapsed, seconds=fault.seconds,
                            ended_at_s=round(elapsed + fault.seconds, 3))
      self.network.partition(learner, fault.seconds, record)
    elif fault.kind == "slow":
      self._record(fault, learner, step, elapsed, seconds=fault.seconds, factor=fault.factor)
      with self._lock:
        self._slow_until[learner] = (self._clock() + fault.seconds, fault.factor)

  def _stretch(self, learner: int, now: float) -> None:
    """While `learner` is slow, sleep (factor - 1) times the time its last step took."""
    last, self._last_call[learner] = self._last_call.get(learner), now
    with self._lock:
      until, factor = self._slow_until.get(learner, (0.0, 1.0))
    if last is None or now >= until:
      return
    # `last` is taken after the previous stretch: now - last is one step's own time.
    self._stop.wait((factor - 1.0) * (now - last))
    self._last_call[learner] = self._clock()


def with_nan(x: jax.Array) -> jax.Array:
  """`x` with its first value NaN (same shape, dtype and sharding).

  Through the host, not `x.at[...].set`: an eager device op compiles a program per tensor shape,
  and while the learner's thread compiled them, merges of every fragment arrived in the tiny run
  and overwrote the NaNs before any step read them. Thread runtime only: every shard of `x` is
  addressable here.
  """
  host = np.array(x)
  host.flat[0] = np.nan
  return jax.device_put(host, x.sharding)
