"""The supervisor on its own, over stand-in learners and a stand-in syncer: which restarts count
against config.max_restarts, and that a rejoin still building keeps the run from ending."""

import threading
import types

import numpy as np

from decoupled_diloco.runtime.control import supervisor as supervisor_lib
from decoupled_diloco.runtime.core import learner_state


class _Learner:
  """What the supervisor reads of a learner; `respawn` calls `on_respawn` first."""

  def __init__(self, index, incarnation=0, error=None, on_respawn=lambda: None):
    self.index, self.incarnation, self.error = index, incarnation, error
    self.step, self.layout, self.step_times, self.offers_made = 5, None, [], None
    self.first_step_done_at, self.batches_taken = None, None
    self.published = types.SimpleNamespace(step=5)
    self.finished_training = threading.Event()
    if error is not None:
      self.finished_training.set()  # as a failed learner's handle does
    self._on_respawn = on_respawn

  @property
  def alive(self):
    return self.error is None

  def counters(self):
    zeros = np.zeros(2, np.int64)
    return learner_state.Counters(zeros, zeros, zeros)

  def join(self, timeout=None):
    del timeout

  def full_publication(self, timeout_s):
    del timeout_s

  def respawn(self, snapshot):
    del snapshot
    self._on_respawn()
    return _Learner(self.index, self.incarnation + 1)

  def tape_respawn(self, **fields):
    del fields

  def start(self):
    pass


class _Syncer:
  def __init__(self):
    self.model = types.SimpleNamespace(
        received=lambda: ({"w": np.zeros(2, np.float32)}, np.zeros(2, np.int64)))
    self.given_up = []

  def attach(self, m, learner, **fields):
    del m, learner, fields

  def give_up(self, m):
    self.given_up.append(m)


def _supervisor(learners, syncer, lost_slice, monkeypatch, max_restarts=0):
  snapshot = lambda *args: types.SimpleNamespace(  # noqa: E731
      step=args[4], train_state=types.SimpleNamespace(opt_state={}))
  monkeypatch.setattr(supervisor_lib, "rejoin_snapshot", snapshot)
  return supervisor_lib.Supervisor(learners, lambda: syncer, init_opt_state=None,
                                   repaired_at=lambda m: 0.0, max_restarts=max_restarts,
                                   lost_slice=lost_slice)


def test_a_lost_slice_rejoins_without_counting_against_max_restarts(monkeypatch):
  learners = [_Learner(0), _Learner(1, error=RuntimeError("gloo all-reduce failed"))]
  supervisor = _supervisor(learners, _Syncer(), lambda m: True, monkeypatch, max_restarts=0)
  assert supervisor.poll()
  assert learners[1].incarnation == 1 and supervisor.restarts == [0, 0]
  [record] = supervisor.records
  assert record["restarted"] and record["cause"] == "lost_slice"


def test_an_application_failure_known_only_once_repaired_is_given_up_past_max_restarts(
    monkeypatch):
  """On a slice, whether a failure lost a host is known only once the learner's processes are
  back: the supervisor waits for that before it gives up on an application failure."""
  learners = [_Learner(0), _Learner(1, error=RuntimeError("step raised"))]
  syncer, known = _Syncer(), {"lost": None}
  supervisor = _supervisor(learners, syncer, lambda m: known["lost"], monkeypatch)
  supervisor._repaired_at = lambda m: float("inf")  # pylint: disable=protected-access
  assert not supervisor.poll()
  assert supervisor.pending and syncer.given_up == []  # not known yet: not given up
  known["lost"] = False
  supervisor._repaired_at = lambda m: 0.0  # pylint: disable=protected-access
  supervisor.poll()
  [record] = supervisor.records
  assert record["restarted"] is False and record["cause"] == "application"
  assert syncer.given_up == [1] and learners[1].incarnation == 0 and not supervisor.pending


def test_the_run_stays_pending_while_a_rejoin_is_still_building(monkeypatch):
  """A rejoin in new processes (on another TPU slice) builds for seconds while its peer may
  finish: every learner then looks finished, the failed one included, and only `pending` keeps
  the controller from ending the run under the rejoining learner."""
  building, go_on = threading.Event(), threading.Event()

  def build():
    building.set()
    go_on.wait()

  learners = [_Learner(0), _Learner(1, error=RuntimeError("host lost"), on_respawn=build)]
  learners[0].finished_training.set()  # the peer has made its last step
  supervisor = _supervisor(learners, _Syncer(), lambda m: True, monkeypatch)
  poller = threading.Thread(target=supervisor.poll)
  poller.start()
  building.wait()
  assert all(l.finished_training.is_set() for l in supervisor.learners) and supervisor.pending
  go_on.set()
  poller.join()
  assert supervisor.learners[1].incarnation == 1 and not supervisor.pending
