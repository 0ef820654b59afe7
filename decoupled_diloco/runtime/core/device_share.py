"""Learners that share devices take turns on them (config.devices.learners_sharing_devices).

Each learner keeps its own mesh, state, thread and step; what they share is the devices' time.
Nothing else makes that share fair: a GPU runs one stream's programs in the order they were
dispatched, but XLA:CPU runs the programs of several threads on one device at once, in no set
order. Four threads stepping a 1024 x 1024 matmul on one fake CPU device, each dispatching a step
ahead as a learner does, saw two of them starved for 2.2-2.4 s, 17-30 of their own mean steps,
while the other two ran (2 cores, 2026-11-26). To the syncer a starved learner is a hung one: its
heartbeat stops while its peers report. So learners on the same devices go through one
`DeviceTurns`: a learner waits for its turn before it dispatches a step and hands the turn on once
that step has left the devices, first come, first served. At most `slots` steps of the group are
on the devices at once: 2, so that on a GPU the next learner's step is already queued behind the
one running (the stream does not wait for a Python thread to dispatch), on a CPU no step waits
behind more than one other, and the device holds at most two steps' temporaries
(runtime/hardware/device_memory.py counts them). The price: a learner no longer dispatches its next step
before its last one completes, so its host work between steps overlaps its peers' steps instead
of its own. Four tiny learners on one fake CPU device made 0.86x and 0.92x the tokens/s with
turns as without (one run each way, twice, alternated, on a loaded 2-core box), and in those runs
their longest step was 2.8-5.5x their median with turns, 2.7-5.1x without: the framework's own
host work between steps kept the free-for-all fairer than the bare loop above. Since a step has
completed when its turn ends, the learner publishes the state after it (and reports the step) then,
not after its next turn as a learner that dispatches ahead does (runtime/core/learner.py; issue 44).

What each learner then measures: its step time (from one completed step to the next, on its own
thread) is one turn of the whole group, n x the device's time for one step when n learners train.
That is its pace, the one quantity the heartbeat (ten of its own steps, algorithm/heartbeat.py)
and the grace window (tau of the slowest learner's steps, algorithm/grace.py) need in wall
seconds; the syncer only widens the heartbeat's floor for the first report, which comes after
every learner of the group has made its first step. Tokens/s per device count each second of the
shared devices once (throughput.shared_steps_outside), not once per learner.

Under config.runtime=ray each learner is a process of its own and nothing here is shared between
them: processes on one GPU are time-sliced by its driver, not by this.
"""

from __future__ import annotations

import collections
import threading

SLOTS = 2  # steps of one group on its devices at once


class DeviceTurns:
  """First come, first served turns on one set of devices, at most `slots` steps at once.

  `enter(learner)` before dispatching a step (it returns once it is that learner's turn),
  `leave(learner)` once the step has completed (or failed: it never holds the devices after).
  `admitted` keeps the order of the last turns given, for tests and logs.
  """

  def __init__(self, slots: int = SLOTS, history: int = 1024):
    if slots < 1:
      raise ValueError(f"slots={slots} must be >= 1")
    self._slots = slots
    self._cond = threading.Condition()
    self._waiting: collections.deque[int] = collections.deque()
    self._running: collections.Counter[int] = collections.Counter()
    self.asked: collections.deque[int] = collections.deque(maxlen=history)
    self.admitted: collections.deque[int] = collections.deque(maxlen=history)
    self.most_at_once = 0

  @property
  def slots(self) -> int:
    return self._slots

  @property
  def in_use(self) -> int:
    """Turns held now: steps of the group on its devices."""
    with self._cond:
      return sum(self._running.values())

  def enter(self, learner: int) -> None:
    with self._cond:
      self._waiting.append(learner)
      self.asked.append(learner)
      while self._waiting[0] != learner or sum(self._running.values()) >= self._slots:
        self._cond.wait()
      self._waiting.popleft()
      self._running[learner] += 1
      self.admitted.append(learner)
      self.most_at_once = max(self.most_at_once, sum(self._running.values()))
      self._cond.notify_all()  # the next in line may have a free slot too

  def leave(self, learner: int) -> None:
    with self._cond:
      if self._running[learner] <= 0:
        raise RuntimeError(f"learner {learner} left devices it had not entered")
      self._running[learner] -= 1
      self._cond.notify_all()


def turns_for(num_learners: int, learners_sharing_devices: int) -> list[DeviceTurns | None]:
  """One `DeviceTurns` per group of learners that share devices, each learner's entry its group's;
  None for every learner when none share."""
  if learners_sharing_devices <= 1:
    return [None] * num_learners
  groups = [DeviceTurns() for _ in range(0, num_learners, learners_sharing_devices)]
  return [groups[m // learners_sharing_devices] for m in range(num_learners)]
