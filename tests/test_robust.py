"""The robust merge's verdict on one outer gradient, by hand (algorithm/robust.py)."""

import math

import numpy as np
import pytest

from decoupled_diloco.algorithm import robust


def _window(*norms):
  return robust.NormWindow().accept(norms)


def test_a_nonfinite_outer_gradient_is_rejected_even_with_no_history():
  for norm in (math.nan, math.inf):
    assert robust.judge(norm, robust.NormWindow(), 10.0).reason == "nonfinite"
    assert robust.judge(norm, _window(1, 1, 1, 1), 0.0).reason == "nonfinite"


def test_an_outlier_is_a_norm_above_ratio_times_the_median_of_the_accepted_ones():
  window = _window(1.0, 2.0, 3.0, 100.0)  # median 2.5: the one large norm barely moves it
  assert robust.judge(25.0, window, 10.0) == robust.Verdict(None, 25.0, 2.5)
  assert robust.judge(25.1, window, 10.0) == robust.Verdict("outlier", 25.1, 2.5)
  assert robust.judge(0.0, window, 10.0).reason is None  # small is never an outlier


def test_no_outlier_test_before_min_accepted_norms_or_at_ratio_zero_or_median_zero():
  short = _window(*[1.0] * (robust.MIN_ACCEPTED - 1))
  assert robust.judge(1e6, short, 10.0) == robust.Verdict(None, 1e6, None)
  full = _window(*[1.0] * robust.MIN_ACCEPTED)
  assert robust.judge(1e6, full, 10.0).reason == "outlier"
  assert robust.judge(1e6, full, 0.0).reason is None
  assert robust.judge(1e6, _window(0.0, 0.0, 0.0, 0.0), 10.0).reason is None


def test_the_window_keeps_the_last_norms_only():
  window = robust.NormWindow(size=3).accept([1.0, 2.0]).accept([3.0, 4.0])
  assert window.norms == (2.0, 3.0, 4.0)
  assert robust.NormWindow().accept(range(100)).norms == tuple(float(n) for n in range(68, 100))


def test_offers_of_one_round_are_judged_against_the_window_before_it():
  """Two huge offers in one round do not vouch for each other; the accepted one goes in."""
  window = _window(1.0, 1.0, 1.0, 1.0)
  verdicts, after = robust.judge_round([0, 1, 2, 3], [2.0, 50.0, 50.0, math.nan], window, 10.0,
                                       num_learners=4)
  assert [v.reason for v in verdicts] == [None, "outlier", "outlier", "nonfinite"]
  assert after.norms == (1.0, 1.0, 1.0, 1.0, 2.0) and after.outliers == frozenset()


def _rounds(window, rounds, num_learners=4):
  """Judges rounds of {learner: norm} one after the other; returns the reasons and the window."""
  reasons = []
  for offers in rounds:
    verdicts, window = robust.judge_round(list(offers), list(offers.values()), window, 10.0,
                                          num_learners)
    reasons.append([v.reason for v in verdicts])
  return reasons, window


def test_a_lone_outlier_learner_never_moves_the_yardstick():
  """Learner 3 offers 100x the norms of the others round after round: each of its offers is
  rejected, each accepted peer offer forgives nothing it did, and the window stays at 1."""
  rounds = [{3: 100.0}, {0: 1.0, 3: 100.0}, {3: 100.0}, {1: 1.0}, {3: 100.0}] * 4
  reasons, window = _rounds(_window(1.0, 1.0, 1.0, 1.0), rounds)
  assert all(r == "outlier" for offers, rs in zip(rounds, reasons)
             for m, r in zip(offers, rs) if m == 3)
  assert set(window.norms) == {1.0} and window.outliers == frozenset({3})


def test_when_two_learners_outgrow_the_window_and_none_fits_it_the_window_starts_again():
  """Every learner's norm jumps 20x (a warmup: the first round covered one step at a tiny rate).
  Two different learners rejected with none accepted: the yardstick was stale, not the learners."""
  reasons, window = _rounds(_window(1.0, 1.0, 1.0, 1.0),
                            [{0: 20.0}, {0: 21.0}, {2: 20.0}, {1: 22.0, 3: 20.0}])
  assert reasons == [["outlier"], ["outlier"], ["outlier"], [None, None]]
  assert window.norms == (22.0, 20.0) and window.outliers == frozenset()


def test_a_single_learner_run_starts_the_window_again_after_one_outlier():
  reasons, window = _rounds(_window(1.0, 1.0, 1.0, 1.0), [{0: 20.0}, {0: 20.0}], num_learners=1)
  assert reasons == [["outlier"], [None]] and window.norms == (20.0,)


def test_a_nonfinite_offer_says_nothing_about_the_scale():
  reasons, window = _rounds(_window(1.0, 1.0, 1.0, 1.0), [{0: math.nan}, {1: math.inf}])
  assert reasons == [["nonfinite"], ["nonfinite"]]
  assert window.norms == (1.0,) * 4 and window.outliers == frozenset()


def test_fragment_norm_is_over_every_tensor_and_nonfinite_exactly_when_a_value_is():
  deltas = [np.full((2, 2), 1.0, np.float32), np.array([3.0], np.float32)]
  assert robust.fragment_norm(iter(deltas)) == pytest.approx(math.sqrt(4 + 9))
  # float32 values whose squares overflow float32 still give a finite norm.
  big = [np.full(4, 3e38, np.float32)]
  assert math.isfinite(robust.fragment_norm(big))
  for bad in (np.nan, np.inf):
    poisoned = [deltas[0], np.array([0.0, bad], np.float32)]
    assert not math.isfinite(robust.fragment_norm(poisoned))


def test_the_step_scale_is_the_sum_of_the_learning_rates_of_the_steps_an_offer_covers():
  per_step = robust.StepScale(None)
  assert per_step(step=12, steps=11) == 11.0 and per_step(step=5, steps=0) == 1.0
  scale = robust.StepScale([0.0, 0.1, 0.2, 0.3, 0.3])
  assert scale(step=3, steps=2) == pytest.approx(0.1 + 0.2)  # updates 1 and 2
  assert scale(step=5, steps=5) == pytest.approx(0.9)
  # Update 0 of a warmup from 0 moved nothing: floored at the smallest positive rate, never 0.
  assert scale(step=1, steps=1) == pytest.approx(0.1)
  # Out of range (a restored offer, a step past the schedule) is clamped to it.
  assert scale(step=9, steps=2) == pytest.approx(0.3 + 0.3)
  assert scale(step=2, steps=7) == pytest.approx(0.1)
  for bad in ([], [0.0, 0.0], [0.1, -0.1], [0.1, math.nan]):
    with pytest.raises(ValueError, match="learning rates"):
      robust.StepScale(bad)
