"""A syncer slower than its learners, emulated in learner steps (config.syncer.merge_delay_steps).

Each merge holds the worker thread that took it up until the syncer's clock (the fastest learner
still training, docs/design.md §3) has moved `steps` steps past where it stood then, and past the
newest offer in the merge: a merge takes `steps` learner steps of that worker, and its result
reaches a learner more than `steps` steps after the state it offered, however fast the host runs
(the clock may not yet count the step an offer was taken at: the syncer reads step reports in
batches, and a busy host can leave a few unread when it takes an offer). With fewer workers than
`steps` x the merges falling due per step the merges fall behind and rounds coalesce, as they do
when a real syncer cannot keep up (issue 41: the lagging regime). The hold waits on the clock,
never on a timer: the lag is the same in steps on an idle and on a loaded host.

The hold ends early once no learner is training any more, the flush is asked for or the syncer
stops: the clock would not move again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class MergeHold:
  """Holds merges on their worker threads until the clock has moved on; 0 steps holds nothing."""

  def __init__(self, steps: int):
    self.steps = steps
    self._moved = threading.Condition()

  def wait(self, newest_offer: int, clock: Callable[[], int], released: Callable[[], bool]
           ) -> None:
    """On a worker thread: until `clock()` is `steps` past both its value now and the step
    `newest_offer` of the merge's newest offer, or `released()`."""
    if not self.steps:
      return
    until = max(clock(), newest_offer) + self.steps
    with self._moved:
      self._moved.wait_for(lambda: clock() >= until or released())

  def moved(self) -> None:
    """The clock or what `released` reads may have changed (called on the syncer's thread)."""
    if self.steps:
      with self._moved:
        self._moved.notify_all()
