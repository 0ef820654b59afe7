"""Goodput arithmetic of the runtime: intervals -> buckets -> goodput and uptime, by hand."""

import pytest

from decoupled_diloco.algorithm import time_buckets as tb

# Window [0, 10). Learner 0: three 1-s steps, then a step in flight from 3 until it fails at 3.5;
# down until the repair at 6; its next incarnation starts its first step at 6.5 and makes three 1-s
# steps; idle from 9.5. Of the 100 fragment-tokens it made, 20 were discarded by overwrites and 10
# lost with the failed incarnation.
CRASHED = tb.LearnerTimeline(
    steps=[(0, 1), (1, 2), (2, 3), (3, 3.5), (6.5, 7.5), (7.5, 8.5), (8.5, 9.5)],
    down=[(3.5, 6)], restarting=[(6, 6.5)],
    made_tokens=100, discarded_tokens=20, lost_tokens=10)
# Learner 1: steps from 0 to 8, hung from 2 to 4 inside a step; nothing discarded.
HUNG = tb.LearnerTimeline(steps=[(0, 2), (2, 5), (5, 8)], waits=[(2, 4)], made_tokens=80)


def test_a_crashed_learners_buckets_by_hand():
  buckets = tb.learner_buckets(CRASHED, 0.0, 10.0)
  # 6.5 s of compute: 70% useful, 20% discarded, 10% lost.
  assert buckets == pytest.approx({
      tb.USEFUL: 4.55, tb.DISCARDED: 1.3, tb.LOST_PROGRESS: 0.65, tb.IDLE_DOWN: 2.5,
      tb.RESTART: 0.5, tb.IDLE: 0.5})
  assert sum(buckets.values()) == pytest.approx(10.0)


def test_a_hang_is_idle_not_training():
  buckets = tb.learner_buckets(HUNG, 0.0, 10.0)
  assert buckets[tb.USEFUL] == pytest.approx(6.0)
  assert buckets[tb.IDLE] == pytest.approx(4.0)  # the 2-s hang and the last 2 s


def test_goodput_and_uptime_of_the_two_learners_by_hand():
  accounting = tb.account({0: CRASHED, 1: HUNG}, 0.0, 10.0)
  assert accounting.goodput == pytest.approx((4.55 + 6.0) / 20.0)
  # Someone computes on [0, 3.5) and [4, 9.5): 9 s of 10.
  assert accounting.uptime == pytest.approx(0.9)


def test_a_resumed_run_adds_its_segment_to_the_earlier_ones():
  first = tb.account({0: CRASHED, 1: HUNG}, 0.0, 10.0)
  second = tb.account({0: tb.LearnerTimeline(steps=[(0, 4)], made_tokens=10),
                       1: tb.LearnerTimeline(steps=[(0, 2)], made_tokens=10)}, 0.0, 4.0)
  whole = tb.Accounting.from_json(first.to_json()).add(second)
  assert whole.window_s == 14.0 and whole.covered_s == pytest.approx(13.0)
  assert whole.goodput == pytest.approx((4.55 + 6.0 + 4.0 + 2.0) / 28.0)
  assert whole.buckets[1][tb.IDLE] == pytest.approx(6.0)


def test_intervals_are_clipped_to_the_window_and_overlaps_count_once():
  timeline = tb.LearnerTimeline(steps=[(-1, 2), (1, 3)], down=[(2.5, 12)], made_tokens=1)
  buckets = tb.learner_buckets(timeline, 0.0, 10.0)
  assert buckets[tb.USEFUL] == pytest.approx(3.0)
  assert buckets[tb.IDLE_DOWN] == pytest.approx(7.0)  # from 3, where computing ends, to 10
  assert buckets[tb.IDLE] == pytest.approx(0.0)


def test_a_fault_free_learner_that_trains_the_whole_window_has_goodput_one():
  accounting = tb.account({0: tb.LearnerTimeline(steps=[(0, 5), (5, 10)], made_tokens=7)},
                          0.0, 10.0)
  assert accounting.goodput == 1.0 and accounting.uptime == 1.0


def test_the_bucket_names_are_the_simulators():
  from decoupled_diloco.sim import accounting  # pylint: disable=g-import-not-at-top
  assert (tb.RESTART, tb.LOST_PROGRESS, tb.IDLE_DOWN) == (
      accounting.RESTART, accounting.LOST_PROGRESS, accounting.IDLE_DOWN)
