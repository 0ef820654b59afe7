"""The lock-step baselines (DiLoCo, Streaming DiLoCo): a learner's offers on the schedule, and its
barrier.

In the decoupled mode a learner never waits for the syncer; in these two, by design, it offers the
fragments the schedule makes due after a step without being asked, and before step t+1 waits until
every fragment whose sync started at t - tau is back (`LearnerOptions.schedule`). These functions are
parts of the learner's step loop (runtime/core/learner.py), on its thread and its state.
"""

from __future__ import annotations

import time
from typing import Any

# pylint: disable=protected-access


def push_due_offers(learner: Any) -> None:
  """diloco / streaming: offer the fragments due after this step, without being asked."""
  due = learner._options.schedule.due_fragments(learner.step)
  if not due:
    return
  published = learner._publish(learner._state)
  for p in due:
    offer = learner._offer_from(published, p)
    with learner._lock:
      learner._record_taken(offer)
    learner._offers_made[p] += 1
    learner._syncer.post(offer)


def wait_for_due_merges(learner: Any) -> None:
  """diloco / streaming: before step t+1, every fragment whose sync started at t - tau is back."""
  schedule = learner._options.schedule
  start = learner.step - schedule.overlap
  if start < 1:
    return
  began = time.monotonic()
  deadline = began + learner._options.wait_timeout_s
  try:
    for p in schedule.due_fragments(start):
      while learner._anchor_versions[p] < learner._offers_made[p]:
        if learner._stop.is_set():
          return
        now = time.monotonic()
        if learner._peer_repairing is not None and learner._peer_repairing():
          # A peer is down and the barrier waits for its repair, however long that takes: not
          # a stall. The timeout counts again from when no peer is being repaired.
          deadline = now + learner._options.wait_timeout_s
        if now > deadline:
          raise TimeoutError(
              f"learner {learner.index}: merge of fragment {p} did not come back within "
              f"{learner._options.wait_timeout_s} s (config.stall_timeout_s, lock-step mode)")
        learner._serve(timeout=0.05)
  finally:
    ended = time.monotonic()
    learner.barrier_wait_s += ended - began
    if ended - began > 1e-3:
      learner.barrier_waits.append((began, ended))
