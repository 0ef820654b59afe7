"""When the job's checkpoints are taken: every config.checkpoint.every_steps, at the end, and on a
stop signal; and the run's history each one carries, which a resumed run adds its own to.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco.runtime.control import run as run_lib
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
from decoupled_diloco.runtime.records import checkpoints as checkpoints_lib
from decoupled_diloco.runtime.records import goodput as goodput_lib
from decoupled_diloco.runtime.records import job_state


class Checkpointer:
  """Takes the job's checkpoints: every config.checkpoint.every_steps of the clock, the final
  one, and one on a stop signal. A cut is asked of the syncer (dp mode: the learner's latest
  publication is one) and written in the background while the learners train."""

  def __init__(self, run: run_lib.Run, evals: list[dict[str, Any]], started: float):
    self._run = run
    self._evals = evals
    self._started = started
    self.train_started = started
    every = run.settings.checkpoint.every_steps
    clock = max((l.step for l in run.learners), default=0)
    self._next = (clock // every + 1) * every if every else None
    self._pending: concurrent.futures.Future | None = None  # a cut asked for, not yet taken
    self._pending_due = 0  # the clock it was due at
    self._asked: Any = None  # the syncer it was asked of

  def tick(self, clock: int) -> None:
    """From the controller's loop: asks for a cut when one is due, writes it when it comes."""
    run = self._run
    if run.checkpoints is None:
      return
    run.checkpoints.raise_if_failed()
    if self._pending is not None:
      future = self._pending
      if future.done():
        self._pending = None
        self._write(future.result())
      elif self._drop_orphan():
        self._next = self._pending_due  # asked again once the new syncer is up
      return
    if clock < self._next or clock >= run.settings.num_steps:
      return  # the final checkpoint is taken after the flush
    if run.supervisor is not None and run.supervisor.pending:
      return  # a learner is down: the cut waits until it is back
    if run.restarter is not None and run.restarter.pending:
      return  # the dp job is down
    if run.keeper is not None and run.keeper.down:
      return  # and until the syncer is
    due, self._next = self._next, self._next + run.settings.checkpoint.every_steps
    self._pending, self._pending_due = self._ask(timeout_s=self._cut_timeout(), min_step=due), due

  def _drop_orphan(self) -> bool:
    """Drops the pending cut if it was asked of a syncer that crashed since (asked just before
    its crash, it is never answered), so that the new one is asked; returns whether it did."""
    if self._asked is self._run.syncer:
      return False
    logging.warning("the checkpoint cut due at step %d was asked of the syncer that crashed; "
                    "asking its successor", self._pending_due)
    self._pending = None
    return True

  def save_now(self, timeout_s: float, train_seconds: float) -> str | None:
    """Takes a cut now and starts writing it; returns its path (None: no checkpoint)."""
    run = self._run
    if run.checkpoints is None:
      return None
    if self._pending is not None and not self._drop_orphan():
      self._pending.result(timeout=timeout_s)  # superseded below
      self._pending = None
    cut = self._ask(timeout_s=timeout_s).result(timeout=timeout_s + 5)
    return self._write(cut, train_seconds=train_seconds)

  def _cut_timeout(self) -> float:
    times = [np.mean(l.step_times[-10:]) for l in self._run.learners if l.step_times]
    return max(5.0, 10.0 * max(times, default=0.0))

  def _ask(self, timeout_s: float, min_step: int = 0) -> concurrent.futures.Future:
    """A cut, as a future; dp mode: of step `min_step` or later (the clock it was due at; a
    learner's publication runs one step behind its clock)."""
    run = self._run
    self._asked = run.syncer
    if run.syncer is not None:
      return run.syncer.request_cut(timeout_s)
    future: concurrent.futures.Future = concurrent.futures.Future()
    if run.restarter is not None and run.restarter.pending:
      future.set_result(None)  # the dp job is down: its state is lost, there is nothing to cut
      return future
    learner = run.learners[0]  # dp: a publication is a consistent state by itself
    published = learner.full_publication(timeout_s, min_step)  # holding the optimizer state
    future.set_result(None if published is None else syncer_lib.SyncerCut(
        None, {0: published}, {0: learner.incarnation}, learner.step))
    return future

  def _write(self, cut: syncer_lib.SyncerCut | None, train_seconds: float | None = None
             ) -> str | None:
    run = self._run
    if cut is None:
      return None
    if not cut.publications:
      # Every learner was down at the cut: no state to resume from (the syncer's alone is not a
      # job). The next cut is tried at the next interval.
      logging.warning("checkpoint skipped: no learner was up at the cut")
      return None
    if train_seconds is None:
      train_seconds = time.perf_counter() - self.train_started
    learners = [job_state.learner_cut(m, cut.incarnations[m], pub)
                for m, pub in sorted(cut.publications.items())]
    # Numbered by the fastest learner's step: it only grows, and the final one is num_steps (the
    # syncer's clock runs ahead of every learner once the fastest has finished).
    clock = max(c.step for c in learners)
    job = checkpoints_lib.JobCut(clock, learners, cut.state,
                                 self._history(cut, train_seconds))
    run.checkpoints.save_job(job)
    path = os.path.join(run.checkpoints.directory, "job", str(clock))
    run.metrics.write("checkpoint", {"clock": clock, "path": path,
                                     "learners": sorted(cut.publications)})
    logging.info("checkpoint of step %d: %s (written in the background)", clock, path)
    return path

  def _history(self, cut: syncer_lib.SyncerCut, train_seconds: float) -> dict[str, Any]:
    """The run so far, as of the cut: what a run resumed from it adds its own to."""
    run, base = self._run, self._run.history
    supervisor = run.supervisor
    retired = run_lib.retired(run)
    steps_made, discarded_steps, discarded_tokens, absent_data = [], [], [], {}
    for m, current in enumerate(run.learners):
      this_run = [l for l in retired if l.index == m]
      made = sum(l.steps_made for l in this_run)
      if m in cut.publications and current not in retired:
        made += cut.publications[m].step - current.start_step
        this_run.append(current)
      else:
        absent_data[str(m)] = (current.data_position() or b"").decode()
      steps_made.append(base["steps_made"][m] + made)
      discarded_steps.append(base["discarded_fragment_steps"][m] +
                             sum(l.discarded_fragment_steps for l in this_run))
      discarded_tokens.append(base["discarded_fragment_tokens"][m] +
                              sum(l.discarded_fragment_tokens for l in this_run))
    faults = [dict(f) for f in run.injector.records] if run.injector is not None else []
    faults += [dict(f) for f in run.keeper.fault_records] if run.keeper is not None else []
    faults += [dict(f) for f in run.corrupter.records] if run.corrupter is not None else []
    failures = supervisor.summary_records() if supervisor is not None else []
    failures += run.restarter.summary_records() if run.restarter is not None else []
    barrier_wait = base.get("barrier_wait_seconds", [0.0] * len(run.learners))
    return {
        "barrier_wait_seconds": [barrier_wait[m] + sum(
            l.barrier_wait_s for l in run.learners + retired if l.index == m)
            for m in range(len(run.learners))],
        "steps_made": steps_made,
        "discarded_fragment_steps": discarded_steps,
        "discarded_fragment_tokens": discarded_tokens,
        "incarnations": [l.incarnation for l in run.learners],
        "start_steps": list(supervisor.start_steps) if supervisor else list(base["start_steps"]),
        "restarts": list(supervisor.restarts) if supervisor else list(base["restarts"]),
        "evals": list(self._evals),
        "faults": list(base["faults"]) + faults,
        "failures": list(base["failures"]) + failures,
        "train_seconds": base["train_seconds"] + train_seconds,
        "wall_seconds": base["wall_seconds"] + time.perf_counter() - self._started,
        "resumes": list(base["resumes"]),
        "dropped_learners": list(base.get("dropped_learners", ())),
        "absent_data": absent_data,
        "time_accounting": goodput_lib.whole_run(
            run, started_at=run.started_at, ended_at=time.monotonic(), final=False).to_json(),
    }

  def close(self, raise_errors: bool = True) -> None:
    run = self._run
    if run.checkpoints is None:
      return
    try:
      run.checkpoints.close()
    except Exception:  # pylint: disable=broad-except
      if raise_errors:
        raise
      logging.exception("writing a checkpoint failed")
