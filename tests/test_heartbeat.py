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
