"""The adaptive grace window of docs/design.md §4."""

import pytest

from decoupled_diloco.algorithm import grace


def test_grace_is_gamma_times_the_overlap_slack():
  # slack = 2 * 0.5 - (0.1 + 0.2) = 0.7 s; gamma 0.5 -> 0.35 s
  assert grace.grace_window(overlap=2, step_time=0.5, quorum_time=0.1, sync_time=0.2,
                            gamma=0.5, cap=10.0) == pytest.approx(0.35)


def test_grace_is_clamped_to_zero_and_cap():
  assert grace.grace_window(overlap=1, step_time=0.1, quorum_time=0.3, sync_time=0.3,
                            gamma=0.9, cap=1.0) == 0.0
  assert grace.grace_window(overlap=2, step_time=10.0, quorum_time=0.0, sync_time=0.0,
                            gamma=0.9, cap=1.0) == 1.0


def test_ema_starts_at_first_observation_then_decays():
  ema = grace.Ema(0.9).update(1.0)
  assert ema.get() == 1.0
  assert ema.update(2.0).get() == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)
  assert grace.Ema(0.9).get(default=3.0) == 3.0


def test_window_uses_the_slowest_live_learner():
  est = grace.GraceEstimator(decay=0.0)
  est = est.observe_step(0, 0.2).observe_step(1, 0.6).observe_step(2, 5.0)
  est = est.observe_quorum(0.1).observe_sync(0.1)
  # learner 2 is not live: slowest live step 0.6 -> slack = 2 * 0.6 - 0.2 = 1.0
  assert est.slowest_step_time({0, 1}) == 0.6
  assert est.window({0, 1}, overlap=2, gamma=0.5, cap=5.0) == pytest.approx(0.5)
