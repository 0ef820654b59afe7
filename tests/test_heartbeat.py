"""Heartbeat detection on its own: who is absent, given report times, step-time EMAs and now."""

import pytest

from decoupled_diloco.algorithm import heartbeat


def test_an_explicit_timeout_is_taken_as_is_whatever_the_step_time():
  assert heartbeat.timeout_s(0.3, None) == 0.3
  assert heartbeat.timeout_s(0.3, 100.0) == 0.3


def test_the_auto_timeout_is_a_multiple_of_the_step_time_ema_with_a_floor():
  assert heartbeat.timeout_s(0.0, 2.0) == pytest.approx(heartbeat.AUTO_MULTIPLE * 2.0)
  # A fast learner, and one that has not reported yet, get the floor.
  assert heartbeat.timeout_s(0.0, 0.01) == heartbeat.AUTO_FLOOR_S
  assert heartbeat.timeout_s(0.0, None) == heartbeat.AUTO_FLOOR_S


def test_a_learner_silent_past_its_timeout_is_absent_and_one_that_just_reported_is_not():
  now = 100.0
  last = {0: now - 0.1, 1: now - 0.5, 2: now - 0.29}
  assert heartbeat.absent(last, {}, now, configured_s=0.3) == {1}


def test_auto_timeouts_follow_each_learners_own_pace():
  """A learner whose steps take 2 s may be silent for 15 s; one whose steps take 0.1 s may not be
  silent past the floor. Silence exactly at the timeout is not yet absence."""
  now = 1000.0
  last = {0: now - 15.0, 1: now - 15.0, 2: now - heartbeat.AUTO_FLOOR_S}
  emas = {0: 2.0, 1: 0.1, 2: None}
  assert heartbeat.absent(last, emas, now, configured_s=0.0) == {1}


def test_a_report_takes_an_absent_learner_back():
  emas = {0: 0.1}
  assert heartbeat.absent({0: 10.0}, emas, 20.0, 0.0) == {0}
  assert heartbeat.absent({0: 19.99}, emas, 20.0, 0.0) == frozenset()


def _turn_taking_reports(n: int, step_s: float, steps: int, hung: tuple[int, int] | None = None):
  """Step reports (time, learner, step time) of n learners whose steps take turns on one device
  (runtime/core/device_share.py): turns go first come, first served, the device runs one step at a
  time, and a learner asks again as soon as its step has left the device, so the device runs the
  learners round and round. A learner measures a step from one completed step to the next and
  reports it once its next step has left the device (learner._train). `hung` = (learner, step):
  that learner stops after that step (it never asks for another turn)."""
  done = {m: [0.0] for m in range(n)}  # completion times, after the start at 0
  order, now = list(range(n)), 0.0
  while order:
    m = order.pop(0)
    now += step_s
    done[m].append(now)
    if len(done[m]) - 1 < steps and (hung is None or (m, len(done[m]) - 1) != hung):
      order.append(m)
  reports = []
  for m, ends in done.items():
    for step in range(1, len(ends) - 1):  # step k is reported when step k + 1 has completed
      reports.append((ends[step + 1], m, ends[step + 1] - ends[step - 1 if step == 1 else step]))
  return sorted(reports)


def test_learners_taking_turns_on_one_device_measure_a_turn_and_only_a_hung_one_is_absent():
  """Four learners share one device, each device step 1.5 s. What each measures as its step is a
  turn of all four, 6 s: its pace, so ten of them is the heartbeat of ten of its own steps and the
  grace window spans tau of them. The last learner's first report comes 12 s after the start,
  behind every peer's first step: past a lone learner's 5 s floor, within the 4 x 5 s of four on
  one device. When learner 2 hangs after its step 60, the others' turns shorten to 4.5 s, and only
  learner 2 is found absent, 10 x its EMA after its last report."""
  from decoupled_diloco.algorithm import grace  # pylint: disable=g-import-not-at-top
  n, step_s = 4, 1.5
  reports = _turn_taking_reports(n, step_s, steps=90, hung=(2, 60))
  estimator = grace.GraceEstimator(decay=0.9)
  last = {m: 0.0 for m in range(n)}
  absent_alone, found = set(), {}
  pending = list(reports)
  for tick in range(int(reports[-1][0] * 4) + 1):
    now = tick / 4
    while pending and pending[0][0] <= now:
      at, m, seconds = pending.pop(0)
      last[m] = at
      estimator = estimator.observe_step(m, seconds)
    emas = {m: ema.value for m, ema in estimator.step_times}
    absent_alone |= heartbeat.absent(last, emas, now, 0.0)
    for m in heartbeat.absent(last, emas, now, 0.0, sharing=n):
      found.setdefault(m, now)
    if now == 340.0:  # every learner is at its steady pace, learner 2 still trains
      for m in range(n):
        assert emas[m] == pytest.approx(n * step_s, rel=0.01)
      assert estimator.window(set(range(n)), overlap=2, gamma=0.5, cap=1e9) == pytest.approx(
          0.5 * 2 * n * step_s, rel=0.01)
  assert 3 in absent_alone  # a lone learner's floor would take the fourth for absent at the start
  assert set(found) == {2}
  hung_reported = max(at for at, m, _ in reports if m == 2)
  hung_ema = [ema.value for m, ema in estimator.step_times if m == 2][0]
  assert found[2] == pytest.approx(hung_reported + heartbeat.AUTO_MULTIPLE * hung_ema, abs=0.25)
  assert [m for m, ema in estimator.step_times if m != 2 and
          ema.value == pytest.approx((n - 1) * step_s, rel=0.02)] == [0, 1, 3]


def test_the_floor_grows_with_the_learners_that_share_the_devices():
  assert heartbeat.timeout_s(0.0, None, sharing=4) == 4 * heartbeat.AUTO_FLOOR_S
  assert heartbeat.timeout_s(0.0, 3.0, sharing=4) == pytest.approx(heartbeat.AUTO_MULTIPLE * 3.0)
  assert heartbeat.timeout_s(0.3, None, sharing=4) == 0.3  # an explicit timeout stays
