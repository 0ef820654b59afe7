"""A jax.profiler trace of a window of one learner's steps (config.profile_steps).

The trace covers the whole process while it runs (every learner thread, the syncer, transfers),
from the dispatch of step `first` to the completion of step `last`; it is written under `logdir`
as TensorBoard's profile plugin lays it out (plugins/profile/<run>/*.xplane.pb, plus a
*.trace.json.gz that Perfetto opens).
"""

from __future__ import annotations

from typing import Any

import jax
from absl import logging


class StepTrace:
  """Traces steps first..last (0-based: step k takes the state after k steps to k + 1)."""

  def __init__(self, first: int, last: int, logdir: str):
    self._first, self._last, self._logdir = first, last, logdir
    self._tracing = False

  def before_step(self, step: int) -> None:
    """Called before the step that starts from `step` completed steps is dispatched."""
    if step == self._first and not self._tracing:
      jax.profiler.start_trace(self._logdir, create_perfetto_trace=True)
      self._tracing = True

  def after_step(self, steps_done: int, state: Any) -> None:
    """Called once the step that makes `steps_done` is dispatched: waits for it at the window's
    end, so that the trace holds the last step's device work."""
    if self._tracing and steps_done == self._last + 1:
      jax.block_until_ready(state)
      self.close()
      logging.info("profile of steps %d-%d written under %s", self._first, self._last,
                   self._logdir)

  def close(self) -> None:
    """Ends a trace still running (the learner stopped or failed inside the window)."""
    if self._tracing:
      self._tracing = False
      jax.profiler.stop_trace()
