"""dp mode's answer to a failure: the whole job stops, and restarts from its newest checkpoint.

A data-parallel job is one program over all its devices: when any of them fails (on Pathways, an
error on the next access to its arrays) the job as a whole is gone. What a cluster does then is what
`JobRestarter` does, in this process: wait until the failed devices are repaired (the injector's
`repaired_at`, a failure that took no device down is repaired at once), start the job again, which
compiles its step again and reads its newest whole-job checkpoint back (train state and grain
iterator position: the path a resumed run takes, `job_state.learner_snapshot`), and train on from
that checkpoint's step. With no checkpoint yet it starts again from the initial state, step 0.

The restart's own seconds (compile and restore) are measured, not assumed, and the steps made after
the checkpoint are lost: they were trained (`tokens_trained` counts them, once) but are not in the
model, and each failure's record says how many (`steps_lost`). A nan fault ends the same way: the
non-finite loss fails the learner, and the job restarts from the last checkpoint, which a good
checkpoint interval keeps clear of the corruption.

Only the controller thread calls `tick()`; the restart runs on it, as nothing else of a dp job
runs while the job is down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from absl import logging

from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.core import learner_state
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.records import checkpoints as checkpoints_lib
from decoupled_diloco.runtime.records import job_state


class JobRestarter:
  """Restarts the dp job (its one learner) from the newest checkpoint after each failure."""

  def __init__(self, learners: list[learner_lib.Learner], *,
               checkpoints: checkpoints_lib.Checkpoints | None,
               resumed_from: checkpoints_lib.RestoredCheckpoint | None,
               compile_step: Callable[[], Callable],
               initial_state: Callable[[], learner_state.LearnerSnapshot],
               repaired_at: Callable[[int], float],
               max_restarts: int, metrics: metrics_lib.MetricsWriter | None = None,
               clock: Callable[[], float] = time.monotonic):
    self.learners = learners  # the run's list: a restart replaces its one entry
    self._checkpoints = checkpoints
    self._resumed_from = resumed_from
    # Where a restart goes when no checkpoint has been written: the initial state, made again
    # from the seed as a restarted job makes it (not kept: a copy of a large model's train state).
    self._initial_state = initial_state
    self._compile_step = compile_step
    self._repaired_at = repaired_at
    self._max_restarts = max_restarts
    self._metrics = metrics
    self._clock = clock
    self._started_at = clock()
    self._down: dict[str, Any] | None = None  # the failure being repaired
    self._waiting_back: dict[str, Any] | None = None  # restarted, first step not done yet
    self.retired: list[learner_lib.Learner] = []  # failed incarnations, for the accounting
    self.records: list[dict[str, Any]] = []

  def start(self, started_at: float) -> None:
    """Training started at `started_at` (clock time): records count their seconds from there."""
    self._started_at = started_at

  @property
  def pending(self) -> bool:
    """The job is down (failed, waiting for its repair or restarting): the run is not over."""
    learner = self.learners[0]
    return self._down is not None or (learner.error is not None and learner not in self.retired)

  def tick(self) -> None:
    """From the controller's loop: notices a failure, restarts once repaired."""
    learner, now = self.learners[0], self._clock()
    if self._waiting_back is not None and learner.first_step_done_at is not None:
      record, self._waiting_back = self._waiting_back, None
      record["back_at_s"] = self._elapsed(learner.first_step_done_at)
      self._write(record)
    if self._down is None:
      if learner.error is None or learner in self.retired:
        return
      self._on_failure(learner, now)
    if now >= self._repaired_at(0):
      self._restart()

  def _elapsed(self, t: float) -> float:
    return round(t - self._started_at, 3)

  def _on_failure(self, learner: learner_lib.Learner, now: float) -> None:
    self.retired.append(learner)
    if self._waiting_back is not None:  # failed again before its first step: never back
      self._write(self._waiting_back)
      self._waiting_back = None
    if len(self.records) >= self._max_restarts:
      raise RuntimeError(
          f"the dp job failed at step {learner.step} ({learner.error!r}) after "
          f"{len(self.records)} restarts (config.max_restarts={self._max_restarts})"
      ) from learner.error
    self._down = {"learner": 0, "incarnation": learner.incarnation, "step": learner.step,
                  "failed_at_s": self._elapsed(now), "error": repr(learner.error)}
    self.records.append(self._down)
    logging.warning("the dp job failed at step %d (%r): it restarts from its newest checkpoint "
                    "once repaired", learner.step, learner.error)

  def _newest_state(self, like) -> tuple[learner_state.LearnerSnapshot, str]:
    """The newest checkpoint on disk, else the one the run resumed from, else the initial state."""
    if self._checkpoints is not None:
      self._checkpoints.wait()  # a write still in flight is the newest one
      restored = self._checkpoints.restore_job() if self._checkpoints.steps() else None
      if restored is not None:
        [cut] = restored.cut.learners
        return job_state.learner_snapshot(cut, like), restored.path
    if self._resumed_from is not None:
      [cut] = self._resumed_from.cut.learners
      return job_state.learner_snapshot(cut, like), self._resumed_from.path
    return self._initial_state(), "initial state"

  def _restart(self) -> None:
    record, self._down = self._down, None
    failed = self.learners[0]
    failed.join(timeout=10)  # its thread has ended or is only posting its exit
    began = self._clock()
    train_step = self._compile_step()
    compiled = self._clock()
    snapshot, source = self._newest_state(failed.state_like)
    new = failed.respawn(snapshot, train_step)
    restart_s = self._clock() - began
    self.learners[0] = new
    new.start()
    lost = failed.step - new.step
    record.update(restarted=True, repaired_at_s=self._elapsed(began), restart_s=round(restart_s, 3),
                  compile_s=round(compiled - began, 3),
                  restored_from=source, restored_step=new.step, steps_lost=lost,
                  incarnation_after=new.incarnation)
    self._waiting_back = record
    logging.info("the dp job restarted from %s at step %d in %.1f s (compile and restore); %d "
                 "step(s) made after it are lost", source, new.step, restart_s, lost)

  def _write(self, record: dict[str, Any]) -> None:
    if self._metrics is not None:
      self._metrics.write("job_restart", dict(record))

  def summary_records(self) -> list[dict[str, Any]]:
    return [dict(r) for r in self.records]
