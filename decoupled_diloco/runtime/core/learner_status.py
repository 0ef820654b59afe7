"""How a learner stands, at one instant: what its handle in another process reads.

A learner in a process of its own (config.runtime=ray) reports itself as one `LearnerStatus`
(runtime/core/handles.py), which its handle keeps and reads its counters and timestamps from.
"""

from __future__ import annotations

from typing import Any

from decoupled_diloco.runtime.core import handles


def status(learner: Any) -> handles.LearnerStatus:
  """How `learner` (a `Learner`) stands now.

  One instant for the accounting: the latest publication's counters, steps and discards (a process
  lost after this status loses what it did since; reading the live fields one by one could count a
  step made in between in one and not in the other)."""
  published = learner.published
  error = learner.error
  return handles.LearnerStatus(
      incarnation=learner.incarnation, step=learner.step, steps_made=published.steps_made,
      start_step=learner.start_step,
      num_losses=len(learner.losses), recent_losses=list(learner.losses[-handles.RECENT:]),
      recent_step_times=list(learner.step_times[-handles.RECENT:]),
      recent_step_ends=list(learner.step_ends[-handles.RECENT:]),
      num_steps_done=len(learner.step_times),
      first_step_done_at=learner.first_step_done_at,
      train_started_at=learner.train_started_at, failed_at=learner.failed_at,
      error=None if error is None else repr(error),
      finished_training=learner.finished_training.is_set(),
      discarded_fragment_tokens=published.discarded_fragment_tokens,
      discarded_fragment_steps=published.discarded_fragment_steps,
      barrier_wait_s=learner.barrier_wait_s,
      counters=(published.counter_steps, published.counter_tokens, published.anchor_versions),
      data_state=published.data_state, offers_made=learner.offers_made)
