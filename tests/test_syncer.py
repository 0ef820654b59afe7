"""The syncer driven by scripted learners: rounds, quorum, grace, late and stale offers, the merge.

The learners here are `LearnerLink`s whose answers a test sets (an offer of numpy values, NOTHING or
STALE), so every round and every merged number is known in advance. No model, no learner thread.
"""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import HandClock
from conftest import default_settings
from decoupled_diloco.algorithm import compression
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import outer
from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.runtime.core import global_model as global_model_lib
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
from decoupled_diloco.settings import SyncSettings

NOTHING, STALE = messages.Answer.NOTHING, messages.Answer.STALE
SHAPES = {"embedder/embedding": (6, 4), "w": (8,), "v": (3, 5)}


class Scripted:
  """A LearnerLink whose answer per fragment a test sets: an Offer, NOTHING, STALE or a callable."""

  def __init__(self, index):
    self.index = index
    self.answers = {}
    self.asked = []  # (fragment, merged_through)
    self.received = []

  def offer(self, p, merged_through):
    self.asked.append((p, merged_through))
    answer = self.answers.get(p, NOTHING)
    return answer(merged_through) if callable(answer) else answer

  def deliver(self, broadcast):
    self.received.append(broadcast)


class NotLanded(np.ndarray):
  """A value whose copy to host RAM has not landed until `landed` is set."""

  landed = threading.Event()

  def is_ready(self):
    return self.landed.is_set()


def _syncer(*, num_learners=2, period=2, quorum=1, grace_gamma=0.0, grace_cap_s=1.0, overlap=1,
            num_devices=1, rule="rda", anchor="learner", outer_tx=None, initial=0.0,
            num_fragments=2, attached=None, max_norm_ratio=10.0, metrics=None,
            heartbeat_timeout_s=0.0, broadcast_delta="none", inner_learning_rates=None,
            clock=time.monotonic):
  shapes = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in SHAPES.items()}
  fragments = fragments_lib.partition(shapes, num_fragments, "balanced",
                                      embedding_names=("embedder/embedding",))
  sync = SyncSettings(num_fragments=num_fragments, period=period, overlap=overlap, quorum=quorum,
                      lock_step=False, grace_gamma=grace_gamma, grace_cap_s=grace_cap_s,
                      ema_decay=0.0, fragmentation="balanced",
                      heartbeat_timeout_s=heartbeat_timeout_s, elastic_lock_step=False)
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("learner",))
  syncer = syncer_lib.Syncer(
      sync=sync, fragments=fragments,
      initial_params={n: np.full(s, initial, np.float32) for n, s in SHAPES.items()},
      mesh=mesh, outer_tx=outer_tx or outer.make_outer_optimizer("sgd", 1.0, 0.0),
      merge=default_settings("merge", rule=rule, anchor=anchor, max_norm_ratio=max_norm_ratio),
      compression=default_settings("compression", outer_grad="fp32",
                                   broadcast_delta=broadcast_delta),
      num_learners=num_learners, num_workers=1, metrics=metrics,
      inner_learning_rates=inner_learning_rates, clock=clock)
  syncer.compile()
  learners = [Scripted(m) for m in range(num_learners if attached is None else attached)]
  for m, link in enumerate(learners):
    syncer.attach(m, link)
  return syncer, learners


def _offer(syncer, learner, p, value, *, step, since=0, anchor=0.0, anchor_version=0, cls=None,
           incarnation=0):
  names = syncer.model.fragments[p].names
  values = {}
  for n in names:
    values[n] = np.full(SHAPES[n], value, np.float32)
    if cls is not None:
      values[n] = values[n].view(cls)
  return messages.Offer(
      learner=learner, fragment=p, step=step, since=since, steps=step - since,
      tokens=100 * (step - since), anchor_version=anchor_version, values=values,
      anchor={n: np.full(SHAPES[n], anchor, np.float32) for n in names}, incarnation=incarnation)


def _step(syncer, learners, step, step_time_s=0.01):
  for m in learners:
    syncer.post(messages.StepReport(m, step, step_time_s, 100))


def _wait(condition, timeout=60.0):
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      raise AssertionError("timed out")
    time.sleep(0.005)


def _merge_ones_at_step_1(syncer, links, p, running):
  """Starts `syncer` and has it merge fragment p once: every learner offers 1.0 after step 1
  (four accepted norms: the robust merge's yardstick is filled)."""
  for link in links:
    link.answers[p] = _offer(syncer, link.index, p, 1.0, step=1)
  running(syncer)
  _step(syncer, range(len(links)), 1)
  _wait(lambda: syncer.stats.merges == 1)


def test_a_merge_is_on_the_tape_before_any_learner_is_sent_its_broadcast(running):
  """A runtime that copies the tape out of the syncer's process (runtime=ray) sends a merge's
  broadcasts once the copy holds its record: the record must be on the tape first."""
  syncer, links = _syncer(num_learners=2)
  seen = []
  for link in links:
    link.deliver = lambda broadcast, link=link: seen.append(
        (broadcast.version, [r["version"] for r in syncer.tape if r["fragment"] == 1]))
  _merge_ones_at_step_1(syncer, links, 1, running)  # fragment 1 is due at step 1
  assert seen == [(1, [1]), (1, [1])]


def _fragment_with(syncer, name):
  return next(f.index for f in syncer.model.fragments if name in f.names)


@pytest.fixture
def running():
  started = []

  def start(syncer):
    syncer.start()
    started.append(syncer)
    return syncer

  yield start
  for syncer in started:
    syncer.stop()
    syncer.join(5)


def _quorum_reached(syncer, p):
  round_ = syncer._rounds.get(p)  # pylint: disable=protected-access
  return round_ is not None and round_.quorum_at is not None


def test_round_merges_after_quorum_and_a_grace_window_that_admits_a_late_learner(running):
  clock = HandClock()
  syncer, (a, b) = _syncer(quorum=1, grace_gamma=0.5, grace_cap_s=0.4, clock=clock)
  p = 1  # due after step 1 (P = H = 2)
  a.answers[p] = _offer(syncer, 0, p, 1.0, step=1)
  running(syncer)
  # Step times of 2 s and overlap 1: slack = 2 s, window = min(0.5 * 2, 0.4) = 0.4 s.
  _step(syncer, [0, 1], 1, step_time_s=2.0)
  _wait(lambda: _quorum_reached(syncer, p))
  clock.advance(0.15)
  time.sleep(0.1)  # the syncer's loop runs meanwhile: it must not close the round
  assert not syncer.tape  # quorum reached, grace window still open
  b.answers[p] = _offer(syncer, 1, p, 3.0, step=1)  # answers within the window: admitted
  _wait(lambda: syncer.tape)
  decision = syncer.tape[0]
  assert decision["learners"] == [0, 1]
  assert decision["grace_window_s"] == pytest.approx(0.4)
  assert decision["grace_waited_s"] == pytest.approx(0.15)  # closed when the late offer came


def test_grace_window_closes_the_round_without_a_learner_that_stays_silent(running):
  clock = HandClock()
  syncer, (a, b) = _syncer(quorum=1, grace_gamma=0.5, grace_cap_s=0.3, clock=clock)
  a.answers[1] = _offer(syncer, 0, 1, 1.0, step=1)
  running(syncer)
  _step(syncer, [0, 1], 1, step_time_s=2.0)
  _wait(lambda: _quorum_reached(syncer, 1))
  clock.advance(0.29)
  time.sleep(0.1)
  assert not syncer.tape  # still inside the 0.3 s window
  clock.advance(0.02)
  _wait(lambda: syncer.tape)
  assert syncer.tape[0]["learners"] == [0]
  assert syncer.tape[0]["grace_waited_s"] == pytest.approx(0.31)
  assert (1, 0) in b.asked  # it was asked, and kept being asked while training


def test_round_without_quorum_closes_once_every_learner_has_answered(running):
  syncer, (a, b) = _syncer(quorum=2)
  a.answers[1] = _offer(syncer, 0, 1, 1.0, step=1)
  running(syncer)
  syncer.post(messages.TrainingDone(1, 1))  # learner 1 will make no step: NOTHING is final
  _step(syncer, [0], 1)
  _wait(lambda: syncer.stats.rounds_without_quorum == 1)
  assert syncer.stats.merges == 0 and not a.received


def test_offer_that_lands_after_its_round_closed_gets_weight_zero(running):
  syncer, (a, b) = _syncer(quorum=1, grace_gamma=0.0)
  NotLanded.landed.clear()
  a.answers[1] = _offer(syncer, 0, 1, 1.0, step=1)
  b.answers[1] = _offer(syncer, 1, 1, 5.0, step=1, cls=NotLanded)
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: syncer.tape)
  NotLanded.landed.set()
  assert syncer.tape[0]["learners"] == [0]
  assert syncer.stats.late_offers == 1


class _OnItsWay(messages.PendingAnswer):
  """An answer from a learner's process that lands once `NotLanded.landed` is set."""

  def __init__(self, answer):
    self._answer = answer

  @property
  def in_host_memory(self):
    return NotLanded.landed.is_set()

  def result(self):
    return self._answer


@pytest.mark.parametrize("late", ["copy_to_host", "offer_from_another_process",
                                  "nothing_from_another_process"])
def test_every_offer_taken_counts_as_sent_merged_or_not(running, late):
  """bytes_offered: what crossed the network learner -> syncer, the offers no merge took in
  included (a late one, still copying or still on its way when its round closed, read once it
  lands); an answer that lands as no offer carries none. bytes_up: the merged ones only."""
  syncer, (a, b) = _syncer(quorum=1, grace_gamma=0.0)
  NotLanded.landed.clear()
  a.answers[1] = _offer(syncer, 0, 1, 1.0, step=1)
  b.answers[1] = {
      "copy_to_host": lambda: _offer(syncer, 1, 1, 5.0, step=1, cls=NotLanded),
      "offer_from_another_process": lambda: _OnItsWay(_offer(syncer, 1, 1, 5.0, step=1)),
      "nothing_from_another_process": lambda: _OnItsWay(messages.Answer.NOTHING)}[late]()
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: syncer.tape)
  one = syncer.model.offer_wire_bytes(1)
  assert one == 4 * sum(syncer.model.fragments[1].sizes)  # fp32 outer gradients here
  assert syncer.stats.late_offers == 1
  NotLanded.landed.set()
  sent = one if late == "nothing_from_another_process" else 2 * one
  _wait(lambda: syncer.stats.bytes_offered == sent)
  assert syncer.stats.bytes_up == one


def test_offer_holding_merged_steps_is_refused_whatever_the_learner_says(running):
  """A learner that ignores merged_through (or a reordered message) cannot get steps merged twice:
  the syncer itself refuses an offer whose steps start before the last step merged."""
  syncer, (a, _) = _syncer(num_learners=2, period=2)
  p = 1
  a.answers[p] = lambda merged_through: _offer(syncer, 0, p, 1.0, step=1 + merged_through)
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: syncer.stats.merges == 1)
  _step(syncer, [0, 1], 3)  # p falls due again: the same steps (0, ...] are offered again
  _wait(lambda: syncer.stats.stale_answers > 3)
  assert syncer.stats.merges == 1
  assert (p, 1) in a.asked  # told what was merged
  assert tape_lib.double_merged_offers(syncer.tape) == 0


def test_duplicate_pushed_offer_of_a_learner_is_merged_once(running):
  syncer, (a, b) = _syncer(quorum=2)
  syncer._sync = SyncSettings(**{**syncer._sync.__dict__, "lock_step": True})
  running(syncer)
  syncer.post(_offer(syncer, 0, 1, 1.0, step=2))
  syncer.post(_offer(syncer, 0, 1, 2.0, step=2))
  syncer.post(_offer(syncer, 1, 1, 3.0, step=2))
  _wait(lambda: syncer.tape)
  assert syncer.tape[0]["learners"] == [0, 1]
  assert syncer.stats.late_offers == 1


def test_fragment_falling_due_while_its_sync_is_in_flight_is_synced_when_it_is_back(running):
  syncer, (a, b) = _syncer(period=2)
  p = 1
  release = threading.Event()
  compute = syncer._compute_merge

  def held(fragment, offers):
    if fragment == p:
      release.wait(10)
    return compute(fragment, offers)

  syncer._compute_merge = held
  a.answers[p] = lambda merged_through: _offer(syncer, 0, p, 1.0, step=merged_through + 2,
                                               since=merged_through)
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: p in syncer._merging)
  _step(syncer, [0, 1], 3)  # due again while the first sync of p is still merging
  _wait(lambda: syncer.stats.due_while_in_flight == 1)
  release.set()
  _wait(lambda: sum(d["fragment"] == p for d in syncer.tape) == 2)
  assert syncer.stats.merges_due == 3  # p at 1 and 3, fragment 0 at 2


def test_syncer_anchor_takes_the_outer_gradient_against_the_current_theta():
  """anchor="syncer": Delta = Theta_now - theta_m; anchor="learner": Delta = A_m - theta_m.
  Weighted average, outer SGD lr 0.5: Theta <- Theta - 0.5 Delta. By hand: learner 0 merges first
  (theta 2.0 at anchor v0 = 0): Theta1 = 0 - 0.5 (0 - 2) = 1. Then learner 1, also anchored at v0
  with theta 4.0: syncer anchor: Theta2 = 1 - 0.5 (1 - 4) = 2.5; learner anchor:
  Theta2 = 1 - 0.5 (0 - 4) = 3."""
  for anchor, expected in (("syncer", 2.5), ("learner", 3.0)):
    syncer, _ = _syncer(rule="average", anchor=anchor,
                        outer_tx=outer.make_outer_optimizer("sgd", 0.5, 0.0))
    p = 0
    for learner, value in ((0, 2.0), (1, 4.0)):
      offer = _offer(syncer, learner, p, value, step=2)  # both anchored at version 0
      syncer.model.install(syncer.model.merge(p, (offer,)), anchored=[0])
    for value in syncer.model.fragment_params(p).values():
      np.testing.assert_allclose(value, expected, rtol=1e-6, err_msg=anchor)


def test_sharded_and_one_device_syncer_merges_agree():
  """Four syncer shards (the stacked learner axis split, the RDA sums an all-reduce) give the
  one-device merge to 1e-6."""
  rng = np.random.default_rng(0)
  thetas = {}
  for devices in (1, 4):
    syncer, _ = _syncer(num_learners=3, num_devices=devices, rule="rda",
                        outer_tx=outer.make_outer_optimizer("sgd_nesterov", 0.7, 0.6))
    for p, fragment in enumerate(syncer.model.fragments):
      offers = []
      for m in range(3):
        offer = _offer(syncer, m, p, 0.0, step=3 + m)
        values = {n: np.asarray(rng.normal(size=SHAPES[n]), np.float32) for n in fragment.names}
        offers.append(messages.Offer(**{**offer.__dict__, "values": values}))
      result = syncer.model.merge(p, tuple(offers))
      thetas.setdefault(devices, {}).update(result.theta)
    rng = np.random.default_rng(0)  # the same offers for the next mesh
  assert "all-reduce" in syncer.model.program(0, syncer.model.fragments[0].names[0]).as_text()
  for name in SHAPES:
    np.testing.assert_allclose(thetas[4][name], thetas[1][name], rtol=1e-6, atol=1e-6)
    assert np.abs(thetas[1][name]).max() > 0.1


def test_outer_momentum_never_crosses_fragments():
  """Fragment A merged twice with Delta = -1 and fragment B once with Delta = +5 in between: A ends
  where two merges of A alone end (Nesterov lr 1, momentum 0.5: 1.5, then 1.5 + 1.75 = 3.25)."""
  syncer, _ = _syncer(outer_tx=outer.make_outer_optimizer("sgd_nesterov", 1.0, 0.5))
  a = _fragment_with(syncer, "w")
  b = 1 - a

  def merge(p, value):
    syncer.model.install(syncer.model.merge(p, (_offer(syncer, 0, p, value, step=2),)))

  merge(a, 1.0)  # offers are anchored at 0: Delta = 0 - 1 = -1
  merge(b, -5.0)
  merge(a, 1.0)
  np.testing.assert_allclose(syncer.model.fragment_params(a)["w"], 3.25, rtol=1e-6)


def test_history_is_kept_only_for_the_syncer_anchor_and_stays_bounded(running):
  for anchor in ("learner", "syncer"):
    syncer, (a, b) = _syncer(anchor=anchor, period=2)
    for link in (a, b):
      for p in (0, 1):
        # A learner that applies every merge at once: anchored at the newest version.
        link.answers[p] = lambda merged_through, m=link.index, p=p: _offer(
            syncer, m, p, 1.0, step=merged_through + 2, since=merged_through,
            anchor_version=syncer.model.version(p))
    running(syncer)
    for step in range(1, 41):
      for m in (0, 1):
        versions = np.asarray(syncer.model.versions, np.int64)  # learners hold the newest
        syncer.post(messages.StepReport(m, step, 0.01, 100, versions))
      # One fragment falls due a step (P = H = 2): each merged before the next step, so none
      # coalesces with the next however slowly the host runs the syncer.
      _wait(lambda step=step: syncer.stats.merges >= step)
    kept = [len(h) for h in syncer.model.kept_versions]
    if anchor == "learner":
      assert kept == [0, 0]
    else:
      assert max(kept) <= 3, kept


def test_an_error_in_a_learner_link_fails_the_syncer_and_flush_raises(running):
  syncer, (a, _) = _syncer()

  def broken(merged_through):
    raise OSError("link down")

  a.answers[1] = broken
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: syncer.error is not None)
  with pytest.raises(RuntimeError, match="the syncer failed"):
    syncer.flush(timeout=5)


def test_flush_waits_for_a_learner_still_applying_a_merge_and_takes_its_last_steps(running):
  syncer, (a, b) = _syncer()
  running(syncer)  # no step reported: nothing falls due before the flush
  applied = threading.Event()
  for link in (a, b):
    for p in (0, 1):
      link.answers[p] = lambda merged_through, m=link.index, p=p: (
          STALE if m == 1 and not applied.is_set()
          else _offer(syncer, m, p, 1.0 + m, step=6, since=merged_through))
  done = []
  thread = threading.Thread(target=lambda: done.append(syncer.flush(timeout=10)))
  thread.start()
  time.sleep(0.2)
  assert not done and not syncer.tape  # final rounds wait for learner 1's answer
  applied.set()
  thread.join(10)
  assert done == [True]
  assert sorted(tuple(d["learners"]) for d in syncer.tape) == [(0, 1), (0, 1)]
  assert all(d["final"] for d in syncer.tape)
  assert tape_lib.unmerged_steps_at_end(syncer.tape, [6, 6], 2) == [0, 0]


def test_clock_goes_on_with_the_fastest_learner_still_training(running):
  syncer, (a, b) = _syncer(period=4, num_fragments=2)
  running(syncer)
  for step in range(1, 9):
    syncer.post(messages.StepReport(0, step, 0.01, 100))
  syncer.post(messages.StepReport(1, 4, 0.01, 100))
  syncer.post(messages.TrainingDone(0, 8))
  _wait(lambda: syncer.clock == 8)
  for step in range(5, 9):  # learner 1 goes on alone: four more steps of the clock
    syncer.post(messages.StepReport(1, step, 0.01, 100))
  _wait(lambda: syncer.clock == 12)
  assert syncer.stats.merges_due == 6  # fragments due at 2, 4, 6, 8, 10, 12


def test_a_learner_attached_mid_run_takes_part_from_the_next_round(running):
  """attach() from another thread while the syncer runs (a rejoin or a late learner)."""
  syncer, (a, _) = _syncer(num_learners=3, attached=2, period=2)
  p = 1
  a.answers[p] = lambda merged_through: _offer(syncer, 0, p, 1.0, step=merged_through + 2,
                                               since=merged_through)
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: syncer.stats.merges == 1)
  late = Scripted(2)
  late.answers[p] = lambda merged_through: _offer(syncer, 2, p, 5.0, step=3)
  syncer.attach(2, late, step=2)
  _step(syncer, [0, 1, 2], 3)
  _wait(lambda: syncer.stats.merges == 2)
  assert syncer.tape[-1]["learners"] == [0, 2]
  assert late.received and late.received[-1].version == 2


def test_the_offer_of_a_learner_that_failed_before_its_round_closed_is_never_merged(running):
  """Spec §6: a failed learner's state is gone; an offer it made that no merge has taken in yet
  (here: still copying to host RAM when it fails) must not reach Theta."""
  syncer, (a, b) = _syncer(quorum=2, grace_gamma=0.0)
  NotLanded.landed.clear()
  a.answers[1] = _offer(syncer, 0, 1, 1.0, step=1)
  b.answers[1] = _offer(syncer, 1, 1, 5.0, step=1, cls=NotLanded)
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: (1, 0) in b.asked)
  syncer.post(messages.LearnerExit(1, 1, "LearnerFailure: devices lost"))
  _wait(lambda: syncer.tape)
  NotLanded.landed.set()
  assert syncer.tape[0]["learners"] == [0]
  assert syncer.stats.rejected_offers["stale_incarnation"] == 1
  for name in syncer.model.fragments[1].names:  # Theta_1 = 0 - (0 - 1): learner 0's offer only
    np.testing.assert_allclose(syncer.global_params()[name], 1.0, rtol=1e-6)


def test_a_restarted_learner_counts_its_steps_afresh_and_its_old_incarnation_is_ignored(running):
  syncer, (a, b) = _syncer(period=2, quorum=2)
  p = 1
  a.answers[p] = lambda merged_through: _offer(syncer, 0, p, 1.0, step=merged_through + 2,
                                               since=merged_through)
  b.answers[p] = lambda merged_through: _offer(syncer, 1, p, 1.0, step=9, since=0)
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: syncer.stats.merges == 1)  # learner 1 merged through its step 9
  syncer.post(messages.LearnerExit(1, 9, "LearnerFailure"))
  reborn = Scripted(1)
  # The new incarnation rejoined from a peer at step 3: its steps (3, 5] are new progress, though
  # the old incarnation had merged through step 9.
  reborn.answers[p] = lambda merged_through: _offer(syncer, 1, p, 2.0, step=5, since=3,
                                                       incarnation=1)
  syncer.attach(1, reborn, step=3, incarnation=1, anchor_versions=np.zeros(2, np.int64))
  # It is sent every fragment merged since the versions it holds (fragment 1 is at version 1).
  _wait(lambda: any(bc.fragment == p and bc.version == 1 for bc in reborn.received))
  syncer.post(_offer(syncer, 1, p, 7.0, step=10, since=9, incarnation=0))  # a straggler
  syncer.post(messages.StepReport(1, 10, 0.01, 100, incarnation=0))
  _step(syncer, [0], 3)
  syncer.post(messages.StepReport(1, 5, 0.01, 100, incarnation=1))
  _wait(lambda: syncer.stats.merges == 2)
  assert syncer.tape[-1]["learners"] == [0, 1] and syncer.tape[-1]["incarnations"] == [0, 1]
  assert syncer.tape[-1]["learner_steps"] == [4, 5]
  assert syncer.stats.rejected_offers["stale_incarnation"] == 1 and syncer.stats.stale_messages == 1
  assert tape_lib.double_merged_offers(syncer.tape) == 0


def test_a_nonfinite_and_an_outlier_offer_are_rejected_and_theta_is_the_merge_of_the_others(
    running, tmp_path):
  """Plain average, outer SGD lr 1. Round 1: four offers of 1.0 against Theta = 0 (Delta = -1 each,
  four norms accepted): Theta = 1. Round 2, anchored at 1: learner 0 offers 3.0 (Delta -2),
  learner 3 offers 2.0 (Delta -1), learner 1 a NaN, learner 2 a Delta 100x the accepted norms.
  Equal weights: Theta = 1 + (2 + 1) / 2 = 2.5, whatever learners 1 and 2 sent."""
  metrics = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
  syncer, links = _syncer(num_learners=4, quorum=4, rule="average", metrics=metrics)
  p = 1
  _merge_ones_at_step_1(syncer, links, p, running)
  for m, value in enumerate([3.0, np.nan, 101.0, 2.0]):
    links[m].answers[p] = _offer(syncer, m, p, value, step=3, since=1, anchor=1.0,
                                 anchor_version=1)
  _step(syncer, range(4), 3)
  _wait(lambda: syncer.stats.merges == 2)
  assert syncer.tape[-1]["learners"] == [0, 3]
  assert syncer.stats.rejected_offers == {"stale_incarnation": 0, "nonfinite": 1, "outlier": 1}
  for name in syncer.model.fragments[p].names:
    np.testing.assert_allclose(syncer.global_params()[name], 2.5, rtol=1e-6)
  # The broadcast names the merged offers only: the rejected learners' overwrite drops those steps.
  # (Learners 1 and 2 are also reminded of their offers the first merge took, which they applied.)
  assert links[0].received[-1].merged_offers == {0: 3, 3: 3}
  assert [links[m].received[-1].merged_offers for m in (1, 2)] == [{0: 3, 3: 3, m: 1}
                                                                   for m in (1, 2)]
  # Their steps were not merged: the next round asks them from where the last accepted merge ended.
  _step(syncer, range(4), 5)
  def last_asked(link):
    return [merged_through for q, merged_through in link.asked if q == p][-1]

  _wait(lambda: [last_asked(link) for link in links] == [3, 1, 1, 3])
  metrics.close()
  records = metrics_lib.read_records(str(tmp_path), "rejected")
  assert [(r["learner"], r["reason"], r["step"], r["fragment"]) for r in records] == [
      (1, "nonfinite", 3, p), (2, "outlier", 3, p)]
  size = sum(np.prod(SHAPES[n]) for n in syncer.model.fragments[p].names)
  # Per step: learner 2's Delta of 100 covers steps (1, 3].
  assert records[0]["norm"] is None and records[1]["norm"] == pytest.approx(50 * np.sqrt(size))
  assert records[1]["median"] == pytest.approx(np.sqrt(size))


def test_an_offer_covering_many_steps_is_judged_per_step_and_the_flush_merges_it(running):
  """Learner 1 rejoined behind its peers and no merge of p took it since: at the flush its offer
  covers 11 steps, the others' 1 step each, against a window of 1-step norms (soak: 11 steps of 3
  fragments left unmerged). Its outer gradient is 11x theirs because it covers 11x the steps, not
  because it diverged: judged per step it fits, and the flush merges everyone's last steps. A
  1-step offer as large is still an outlier."""
  syncer, links = _syncer(num_learners=4, quorum=4, rule="average")
  p = 1
  for link in links:
    link.answers[p] = _offer(syncer, link.index, p, 1.0, step=1)
  running(syncer)
  _step(syncer, range(4), 1)
  _wait(lambda: syncer.stats.merges == 1)  # four 1-step norms in p's window
  for link in links:
    link.answers[0] = _offer(syncer, link.index, 0, 1.0, step=12)
    since = 1 if link.index == 1 else 11
    link.answers[p] = _offer(syncer, link.index, p, 1.0 + (12 - since), step=12, since=since,
                             anchor=1.0, anchor_version=1)
  assert syncer.flush(timeout=10)
  final = [d for d in syncer.tape if d["final"] and d["fragment"] == p]
  assert [d["learners"] for d in final] == [[0, 1, 2, 3]]
  assert syncer.stats.rejected_offers["outlier"] == 0
  assert tape_lib.unmerged_steps_at_end(syncer.tape, [12] * 4, 2) == [0] * 4
  hasty = _offer(syncer, 1, p, 12.0, step=12, since=11, anchor=1.0, anchor_version=1)
  assert [r.reason for r in syncer.model.screen(p, [hasty]).rejected] == ["outlier"]


@pytest.mark.parametrize("per_learning_rate", [True, False])
def test_honest_offers_from_the_warmup_and_after_it_are_judged_per_unit_of_learning_rate(
    running, per_learning_rate):
  """A 100-step linear warmup (rate t / 100 at update t). Round 1 takes update 1 (rate 0.01); round 2
  updates 21..40 (rates sum to 6.1, 0.305 a step): each learner's Delta is its rates' sum, as an
  AdamW learner's roughly is. Per step, round 2 is 30x round 1 and every offer would be an outlier
  (CI at stop 24: three honest learners of four rejected so); per unit of learning rate the two
  rounds are alike and every learner is merged. Judged per step (no schedule), they are not."""
  rates = np.arange(100) / 100.0
  syncer, links = _syncer(num_learners=4, quorum=4, rule="average",
                          inner_learning_rates=rates if per_learning_rate else None)
  p = 1
  for link in links:
    link.answers[p] = _offer(syncer, link.index, p, -0.01 * (1 + link.index / 100), step=2, since=1)
  running(syncer)
  _step(syncer, range(4), 2)
  _wait(lambda: syncer.stats.merges == 1)
  theta = -0.01 * np.mean([1 + m / 100 for m in range(4)])
  for link in links:
    link.answers[p] = _offer(syncer, link.index, p, theta - 6.1 * (1 + link.index / 100), step=41,
                             since=21, anchor=theta, anchor_version=1)
  _step(syncer, range(4), 41)
  if per_learning_rate:
    _wait(lambda: syncer.stats.merges == 2)
    assert [d["learners"] for d in syncer.tape] == [[0, 1, 2, 3]] * 2
    assert syncer.stats.rejected_offers["outlier"] == 0
  else:
    # All four rejected (the window then starts again and a later round takes them: robust.py).
    _wait(lambda: syncer.stats.rejected_offers["outlier"] == 4)


def test_a_final_round_that_finds_the_yardstick_stale_runs_again(running):
  """Every learner's norm jumped 20x since p's window filled (few merges of p in a long run, or
  the learning-rate schedule): the flush rejects them all, which empties the window (robust.py).
  A regular round would take those steps next time; the flush has no next time, so it runs the
  final round again, and the steps are merged."""
  syncer, links = _syncer(num_learners=4, quorum=4, rule="average")
  p = 1
  _merge_ones_at_step_1(syncer, links, p, running)
  for link in links:
    link.answers[0] = _offer(syncer, link.index, 0, 1.0, step=2)
    link.answers[p] = _offer(syncer, link.index, p, 21.0, step=2, since=1, anchor=1.0,
                             anchor_version=1)
  assert syncer.flush(timeout=10)
  assert syncer.stats.rejected_offers["outlier"] == 4
  final = [d for d in syncer.tape if d["final"] and d["fragment"] == p]
  assert [d["learners"] for d in final] == [[0, 1, 2, 3]]
  assert tape_lib.unmerged_steps_at_end(syncer.tape, [2] * 4, 2) == [0] * 4


def test_a_round_whose_every_offer_is_rejected_changes_nothing(running):
  syncer, (a, b) = _syncer(num_learners=2, quorum=1)
  p = 1
  a.answers[p] = _offer(syncer, 0, p, np.inf, step=1)
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: syncer.stats.rejected_offers["nonfinite"] == 1)
  _wait(lambda: p not in syncer._merging)
  assert syncer.stats.merges == 0 and not syncer.tape and not a.received
  assert syncer.model.versions == (0, 0)
  for name in syncer.model.fragments[p].names:
    np.testing.assert_array_equal(syncer.global_params()[name], 0.0)


def test_a_lock_step_round_whose_every_offer_is_rejected_broadcasts_theta_unchanged(running):
  """Lock-step learners wait for a new version of every fragment they offered: without one they
  would stall until stall_timeout_s. They get Theta_p back at a new version, merging nobody."""
  syncer, (a, b) = _syncer(quorum=2)
  syncer._sync = SyncSettings(**{**syncer._sync.__dict__, "lock_step": True})
  p = 1
  running(syncer)
  syncer.post(_offer(syncer, 0, p, np.nan, step=2))
  syncer.post(_offer(syncer, 1, p, np.inf, step=2))
  _wait(lambda: a.received and b.received)
  broadcast = a.received[-1]
  assert (broadcast.fragment, broadcast.version, broadcast.merged_offers) == (p, 1, {})
  assert syncer.stats.rejected_offers["nonfinite"] == 2
  for name in syncer.model.fragments[p].names:
    np.testing.assert_array_equal(syncer.global_params()[name], 0.0)


def test_the_robust_merge_yardstick_survives_a_syncer_checkpoint(running):
  """A restarted syncer judges offers against the norms the lost one had accepted."""
  syncer, links = _syncer(num_learners=4, quorum=4, rule="average")
  p = 1
  _merge_ones_at_step_1(syncer, links, p, running)
  arrays, values = syncer.model.state()
  fresh, _ = _syncer(num_learners=4, quorum=4, rule="average")
  fresh.model.load_state(arrays, values)
  offers = [_offer(fresh, m, p, 101.0, step=3, since=1, anchor=1.0, anchor_version=1)
            for m in range(1)]
  assert [r.reason for r in fresh.model.screen(p, offers).rejected] == ["outlier"]


def test_a_restarted_syncer_never_merges_an_offer_anchored_before_the_theta_it_took_back(running):
  """The lost syncer merged learner 1's steps (0, 2] of fragment p as version 1 after its last
  checkpoint (version 0): the restored merge records know nothing of them. Learner 0 had applied
  version 1, so the restarted syncer takes it back from learner 0's anchor. Learner 1 had not,
  and offers the same steps again, anchored at version 0: merged again they would count twice,
  so the restarted syncer answers it as stale (`Syncer.recover`'s minimum anchor)."""
  saved = _syncer()[0].state()
  syncer, (a, b) = _syncer(quorum=1)
  p = 1
  versions = np.zeros(len(syncer.model.fragments), np.int64)
  versions[p] = 1
  in_p = set(syncer.model.fragments[p].names)
  anchors = {n: np.full(s, 1.0 if n in in_p else 0.0, np.float32) for n, s in SHAPES.items()}
  zeros = np.zeros(len(versions), np.int64)
  held_by_0 = messages.Publication(step=3, params={}, since=zeros + 2, counter_steps=zeros + 1,
                                   counter_tokens=zeros + 100, anchor_versions=versions,
                                   anchors=anchors, training=True)
  info = syncer.recover(saved, {0: held_by_0}, stats=syncer.stats, tape=[])
  assert info["fragments_from_learners"] == [p] and syncer.model.version(p) == 1
  b.answers[p] = _offer(syncer, 1, p, 5.0, step=2, since=0, anchor=0.0, anchor_version=0)
  running(syncer)
  _step(syncer, [0, 1], 1)
  _wait(lambda: syncer.stats.stale_answers >= 1)
  time.sleep(0.2)
  assert syncer.stats.merges == 0 and syncer.model.version(p) == 1
  for name in in_p:
    np.testing.assert_array_equal(syncer.global_params()[name], 1.0)


def test_a_restarted_syncer_passes_over_a_learner_whose_process_is_down():
  """A learner whose process died just before the syncer's restart gives the stand-in
  publication of runtime/transport/ray_learner.py (no state, every anchor version -1). With no
  other learner up, the restarted syncer keeps its own Theta (a Ray cluster test once died here
  on the stand-in's missing anchors)."""
  syncer, _ = _syncer(quorum=1)
  down = np.full(len(syncer.model.fragments), -1, np.int64)
  zeros = np.zeros(len(down), np.int64)
  stand_in = messages.Publication(step=40, params={}, since=zeros + 40, counter_steps=zeros,
                                  counter_tokens=zeros, anchor_versions=down, anchors={},
                                  training=True)
  info = syncer.recover(None, {0: stand_in}, stats=syncer.stats, tape=[])
  assert info["fragments_from_learners"] == [] and info["versions"] == [0] * len(down)


def test_a_restarted_syncer_marks_the_merges_its_predecessor_took_down_with_it_lost():
  """The lost syncer put version 1 of fragments p and q on its tape; learner 0 applied q's, but
  the process died before p's broadcasts left (runtime/transport/ray_syncer.py sends them once the
  command's copy of the tape has the record). The restarted syncer holds p at version 0: p's
  record is marked lost, so the tape's audits and token account leave it out (a Ray run's
  hand-kill test once counted it a double merge when the same steps were merged again)."""
  syncer, _ = _syncer(quorum=1)
  p, q = 1, 0
  versions = np.zeros(len(syncer.model.fragments), np.int64)
  versions[q] = 1
  zeros = np.zeros(len(versions), np.int64)
  anchors = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
  held_by_0 = messages.Publication(step=3, params={}, since=zeros + 2, counter_steps=zeros + 1,
                                   counter_tokens=zeros + 100, anchor_versions=versions,
                                   anchors=anchors, training=True)
  tape = [{"fragment": f, "version": 1, "learners": [0], "since_steps": [0],
           "learner_steps": [2], "tokens": [100]} for f in (q, p)]
  info = syncer.recover(None, {0: held_by_0}, stats=syncer.stats, tape=tape)
  assert info["lost_merges"] == 1 and info["versions"][p] == 0 and info["versions"][q] == 1
  assert info["lost_merge_versions"] == [[p, 1]]  # the tape file's reader marks it (event_tape.read)
  assert [r.get("lost", False) for r in syncer.tape] == [False, True]
  assert tape_lib.installed(syncer.tape) == [tape[0]]


def test_a_learner_that_stops_reporting_is_absent_after_the_timeout_and_back_when_it_reports(
    running, tmp_path):
  """Heartbeats: with K = 2 of 2, a silent learner holds a round only until its
  heartbeat timeout; then the round closes with the other's quorum, the silent one is not asked
  (an offer it makes meanwhile is not merged), and its next report takes it back. The syncer's
  clock moves only when the test says, so silence is measured, not the host's speed."""
  metrics = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
  timeout = 0.4
  clock = HandClock()
  syncer, (a, b) = _syncer(quorum=2, heartbeat_timeout_s=timeout, metrics=metrics, clock=clock)
  p = 1  # due at clock 1, 3, 5 (P = H = 2)
  a.answers[p] = lambda merged_through: _offer(syncer, 0, p, 1.0, step=merged_through + 2,
                                               since=merged_through)
  running(syncer)
  _step(syncer, [0], 1)  # learner 1 never reports: it is silent since it was attached
  _wait(lambda: p in syncer._rounds)  # pylint: disable=protected-access
  clock.advance(timeout / 2)
  _step(syncer, [0], 1)  # learner 0 stays alive
  time.sleep(0.1)  # the syncer's loop runs meanwhile: it must not give up on learner 1 yet
  assert not syncer.tape and syncer.stats.absences == 0  # the quorum of 2 still waits for it
  clock.advance(timeout / 2 + 0.01)
  _step(syncer, [0], 1)
  _wait(lambda: syncer.tape)
  assert syncer.tape[0]["learners"] == [0]
  assert syncer.stats.absences == 1 and syncer.stats.rounds_without_quorum == 0
  # While absent it is neither asked nor waited for: an offer it has now is not merged.
  b.answers[p] = _offer(syncer, 1, p, 5.0, step=3)
  asked_before = len(b.asked)
  _step(syncer, [0], 3)
  _wait(lambda: syncer.stats.merges == 2)
  assert syncer.tape[1]["learners"] == [0] and len(b.asked) == asked_before
  # It reports again (holding no merged version): taken back, sent the newer Theta_p, and asked.
  clock.advance(0.1)
  syncer.post(messages.StepReport(1, 3, 0.01, 100, np.zeros(2, np.int64)))
  _wait(lambda: syncer.stats.returns == 1)
  assert sum((bc.fragment, bc.version) == (p, 2) for bc in b.received) == 2  # merge + catch-up
  _step(syncer, [0, 1], 5)
  _wait(lambda: syncer.stats.merges == 3)
  assert syncer.tape[2]["learners"] == [0, 1]
  metrics.close()
  [absent] = metrics_lib.read_records(str(tmp_path), "absent")
  [back] = metrics_lib.read_records(str(tmp_path), "back")
  assert (absent["learner"], absent["timeout_s"]) == (1, timeout)
  assert absent["silent_s"] == pytest.approx(timeout + 0.01)
  assert (back["learner"], back["fragments_sent"]) == (1, [p])
  assert back["absent_s"] == pytest.approx(0.1)


# ---- the delta broadcast (config.compression.broadcast_delta) ----------------------------------


def _delta_model(fmt, shapes=(("w", (64, 48)), ("b", (100,)))):
  """A one-fragment global model with the delta broadcast in `fmt` (outer SGD, lr 1)."""
  shapes = dict(shapes)
  fragments = fragments_lib.partition(
      {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in shapes.items()}, 1, "balanced")
  rng = np.random.default_rng(0)
  return global_model_lib.GlobalModel(
      fragments=fragments,
      initial_params={n: rng.normal(0, 1, s).astype(np.float32) for n, s in shapes.items()},
      mesh=Mesh(np.array(jax.devices()[:1]), ("learner",)),
      outer_tx=outer.make_outer_optimizer("sgd", 1.0, 0.0),
      merge=default_settings("merge", rule="average"),
      compression=default_settings("compression", outer_grad="fp32", broadcast_delta=fmt),
      num_learners=1)


def _merge_random(model, anchors, version, k, rng):
  """Merges one offer whose outer gradient is random (anchored at `version`): Theta moves."""
  offer = messages.Offer(
      learner=0, fragment=0, step=k + 1, since=k, steps=1, tokens=100, anchor_version=version,
      values={n: a - rng.normal(0, 0.05, a.shape).astype(np.float32) for n, a in anchors.items()},
      anchor=anchors)
  result = model.merge(0, (offer,))
  return result, model.install(result)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "int2", "int1"])
def test_a_learner_applying_every_delta_holds_r_p_bit_for_bit_and_r_p_never_drifts(fmt):
  model = _delta_model(fmt)
  model.compile()
  rng = np.random.default_rng(1)
  anchors, version = model.fragment_params(0), 0  # the learner starts from the initial Theta
  num_params = sum(a.size for a in anchors.values())
  for k in range(60):
    result, version = _merge_random(model, anchors, version, k, rng)
    assert result.base_version == version - 1
    # The learner's rule (Learner._apply): anchor + decode(delta), in float32.
    anchors = {n: anchors[n] + compression.decode(result.wire[n]) for n in anchors}
    received, theta = model.received_fragment(0), model.fragment_params(0)
    nbytes = sum(enc.nbytes for enc in result.wire.values())
    assert nbytes == sum(compression.encoded_nbytes(a.size, fmt, 64) for a in anchors.values())
    for name, value in anchors.items():
      np.testing.assert_array_equal(value, received[name], err_msg=f"merge {k} {name}")
      if fmt in ("int8", "int4", "int2"):
        # Within half a step of the last delta's own scale, however many merges came before:
        # each delta carries the error the previous ones left.
        scale_N = np.repeat(result.wire[name].payload[1], 64)[: value.size].reshape(value.shape)
        err = np.abs(received[name].astype(np.float64) - theta[name])
        assert np.all(err <= scale_N / 2 * (1 + 1e-5) + 4e-7 * np.abs(theta[name])), (k, name)
  if fmt == "int4":
    # About 1/8 of a full fp32 broadcast: 4.5 bits a value at 64 values a scale.
    assert nbytes / (4 * num_params) == pytest.approx(4.5 / 32, rel=0.01)
  # No drift: a delta that had dropped its predecessors' error (Theta_new - Theta_old encoded)
  # would leave R_p a random walk of 60 such errors away from Theta; this one stays within the
  # worst error of one delta (each moves Theta by ~N(0, 0.05), at most ~0.25: int4 is off by
  # 0.25 / 14 at most, bf16 by 0.25 * 2^-8).
  drift = max(np.abs(received[n] - theta[n]).max() for n in theta)
  assert drift < {"bf16": 1e-3, "int8": 1e-3, "int4": 0.02, "int2": 0.13, "int1": 0.3}[fmt]


def test_the_delta_broadcast_holds_one_more_copy_of_the_parameters():
  model = _delta_model("int4")
  num_params = 64 * 48 + 100
  # Theta and R_p, 4 bytes a parameter each (plain SGD keeps no outer slot).
  assert model.steady_state_bytes() == model.held_bytes() == 8 * num_params
  assert _delta_model("none").held_bytes() == 4 * num_params


def test_a_restored_syncer_sends_a_keyframe_before_any_delta():
  """R_p is not checkpointed: after a restore the learners may hold another value than Theta_p,
  so the next merge of each fragment sends its full value, and deltas follow that keyframe."""
  model = _delta_model("int4")
  model.compile()
  rng = np.random.default_rng(2)
  anchors, version = model.fragment_params(0), 0
  for k in range(3):
    result, version = _merge_random(model, anchors, version, k, rng)
    anchors = {n: anchors[n] + compression.decode(result.wire[n]) for n in anchors}
  arrays, values = model.state()
  restored = _delta_model("int4")
  restored.compile()
  restored.load_state(arrays, values)
  result, version = _merge_random(restored, anchors, version, 3, rng)
  assert result.base_version is None and version == 4
  anchors = compression.decode_tree(result.wire)  # a keyframe: the value itself, fp32
  result, version = _merge_random(restored, anchors, version, 4, rng)
  assert result.base_version == 4
  anchors = {n: anchors[n] + compression.decode(result.wire[n]) for n in anchors}
  for name, value in restored.received_fragment(0).items():
    np.testing.assert_array_equal(anchors[name], value)


class Holder(Scripted):
  """A LearnerLink that holds its anchors and applies broadcasts as `Learner._apply` does (a
  delta only against the version it holds), and loses what is delivered while `cut` is set.
  Once `finish`ed it says which versions it holds after each broadcast it applies, as a finished
  learner's TrainingDone does (the flush waits for that)."""

  def __init__(self, index, syncer):
    super().__init__(index)
    self.anchors = syncer.model.params()
    self.versions = np.zeros(len(syncer.model.fragments), np.int64)
    self.cut = False
    self.ignored = 0
    self.lock = threading.Lock()
    self.finished = None  # the syncer it reports to once finished
    self.step = 0

  def finish(self, syncer, step):
    self.finished, self.step = syncer, step
    with self.lock:
      versions = self.versions.copy()
    syncer.post(messages.TrainingDone(self.index, step, 0, anchor_versions=versions))

  def deliver(self, broadcast):
    if self.cut:
      return
    self.received.append(broadcast)
    p = broadcast.fragment
    with self.lock:
      if broadcast.version <= self.versions[p]:
        return
      if broadcast.base_version is not None and broadcast.base_version != self.versions[p]:
        self.ignored += 1
        return
      for name, enc in broadcast.values.items():
        value = compression.decode(enc)
        self.anchors[name] = (value if broadcast.base_version is None
                              else self.anchors[name] + value)
      self.versions[p] = broadcast.version
      versions = self.versions.copy()
    if self.finished is not None:
      self.finished.post(messages.TrainingDone(self.index, self.step, 0,
                                               anchor_versions=versions))

  def report(self, syncer, step):
    with self.lock:
      versions = self.versions.copy()
    syncer.post(messages.StepReport(self.index, step, 0.01, 100, versions))


def _delta_syncer_and_holders(seed):
  """A syncer with int4 delta broadcasts (P = H = 2) and two attached Holders whose offers take
  2 noisy steps from the anchor they hold, naming its version."""
  syncer, _ = _syncer(period=2, broadcast_delta="int4", attached=0,
                      outer_tx=outer.make_outer_optimizer("sgd", 0.5, 0.0))
  links = [Holder(m, syncer) for m in range(2)]
  rng = np.random.default_rng(seed)
  for link in links:
    syncer.attach(link.index, link)
    for p in range(2):
      def answer(merged_through, link=link, p=p):
        names = syncer.model.fragments[p].names
        with link.lock:
          anchor = {n: link.anchors[n] for n in names}
          version = int(link.versions[p])
        return messages.Offer(
            learner=link.index, fragment=p, step=merged_through + 2, since=merged_through,
            steps=2, tokens=200, anchor_version=version, anchor=anchor,
            values={n: anchor[n] - rng.normal(0, 0.1, anchor[n].shape).astype(np.float32)
                    for n in names})
      link.answers[p] = answer
  return syncer, links


def test_a_learner_that_missed_a_delta_gets_a_keyframe_and_ends_equal_to_the_others(running):
  syncer, links = _delta_syncer_and_holders(3)
  running(syncer)
  for step in range(1, 41):
    links[1].cut = 10 <= step < 14  # a partition: learner 1 loses the broadcasts meanwhile
    for link in links:
      link.report(syncer, step)
    # One fragment falls due a step (P = H = 2): merged before the next step, so the partition
    # cuts the merges of its own steps however slowly the host runs the syncer.
    _wait(lambda step=step: syncer.stats.merges >= step)
  for link in links:
    link.finish(syncer, 40)
  assert syncer.flush(timeout=60)  # every merge made is delivered
  assert any(b.base_version is not None for b in links[0].received)  # deltas did travel
  assert syncer.stats.keyframes >= 1  # learner 1's, after the partition
  versions = np.asarray(syncer.model.versions)
  received = {n: v for p in range(2) for n, v in syncer.model.received_fragment(p).items()}
  for link in links:
    # Every learner holds R_p of the newest version, bit for bit: none applied a wrong delta.
    np.testing.assert_array_equal(link.versions, versions, err_msg=f"learner {link.index}")
    for name, value in received.items():
      np.testing.assert_array_equal(link.anchors[name], value, err_msg=f"{link.index} {name}")


def test_a_learner_whose_offer_names_the_base_version_gets_a_delta_before_its_report_says_so(
    running):
  """The syncer learns which Theta_p versions a learner holds from its step reports, which can lag
  behind its offers (a loaded host; a finished learner's last report, before the flush's merges).
  Its offer in the round names the version it holds for that fragment, and no other merge of the
  fragment can reach it before this one's broadcast: that is enough for a delta. (A CI run under
  load sent 26 keyframes in 32 merges, most at the flush.)"""
  syncer, links = _delta_syncer_and_holders(4)
  running(syncer)
  for step in range(1, 13):
    for link in links:  # reports that name no versions: the syncer's record stays at 0
      syncer.post(messages.StepReport(link.index, step, 0.01, 100, None))
    _wait(lambda step=step: syncer.stats.merges >= step)
  for link in links:
    link.finish(syncer, 12)
  assert syncer.flush(timeout=60)
  assert syncer.stats.keyframes == 0
  versions = np.asarray(syncer.model.versions)
  assert versions.min() >= 6  # fragments merged again and again, each time as a delta
  received = {n: v for p in range(2) for n, v in syncer.model.received_fragment(p).items()}
  for link in links:
    assert link.ignored == 0
    np.testing.assert_array_equal(link.versions, versions, err_msg=f"learner {link.index}")
    for name, value in received.items():
      np.testing.assert_array_equal(link.anchors[name], value, err_msg=f"{link.index} {name}")


# ---- staleness scaling (config.outer.staleness_scaling) ----------------------------------------


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("inverse", 1 / 3), ("inverse_sqrt",
                                                                              3 ** -0.5)])
def test_a_stale_offer_takes_a_step_shortened_by_its_staleness(rule, factor):
  # Outer SGD at lr 1, average rule: Theta moves by exactly the (scaled) outer gradient. Two
  # merges from offers anchored at version 0, then one more still anchored there: staleness 2.
  shapes = {"w": (3, 4)}
  fragments = fragments_lib.partition(
      {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in shapes.items()}, 1, "balanced")
  model = global_model_lib.GlobalModel(
      fragments=fragments, initial_params={"w": np.zeros((3, 4), np.float32)},
      mesh=Mesh(np.array(jax.devices()[:1]), ("learner",)),
      outer_tx=outer.make_outer_optimizer("sgd", 1.0, 0.0),
      merge=default_settings("merge", rule="average"),
      compression=default_settings("compression", outer_grad="fp32"), num_learners=1,
      staleness_scaling=rule)
  model.compile()
  anchor = {"w": np.zeros((3, 4), np.float32)}

  def offer(k):
    return messages.Offer(learner=0, fragment=0, step=k + 1, since=k, steps=1, tokens=100,
                          anchor_version=0, values={"w": np.full((3, 4), -0.5, np.float32)},
                          anchor=anchor)

  first = model.merge(0, (offer(0),))
  np.testing.assert_allclose(first.theta["w"], -0.5)  # staleness 0: the learner's values
  model.install(first)
  model.install(model.merge(0, (offer(1),)))
  before = model.fragment_params(0)["w"]
  stale = model.merge(0, (offer(2),))
  np.testing.assert_allclose(stale.theta["w"] - before, -0.5 * factor, rtol=1e-6)
