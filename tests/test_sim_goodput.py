"""Tests for sim: the failure simulator behind the goodput table (docs/design.md §7)."""

import dataclasses
import math
import pathlib

import numpy as np
import pytest

from decoupled_diloco.sim import accounting, goodput
from decoupled_diloco.sim.cluster import ClusterParams, slice_unavailability
from decoupled_diloco.sim.dp_job import simulate_dp_job
from decoupled_diloco.sim.elastic_job import simulate_elastic_job, unmerged_lost_s

PARAMS = ClusterParams()
# Every duration exactly its mean, so one failure has an exact, hand-computable cost.
FIXED = dataclasses.replace(PARAMS, weibull_shape=math.inf)
NEVER_FAILS = dataclasses.replace(PARAMS, mtbi_years=1e15)
SLICES, CHIPS_PER_SLICE = 100, 256
N = SLICES * CHIPS_PER_SLICE
HORIZON_S = 20_000.0


def _rng(seed=0):
  return np.random.default_rng(seed)


def _allocated(trace):
  return trace.num_chips * trace.horizon_s


def _assert_chip_time_adds_up(trace):
  total = trace.useful + sum(trace.badput.values())
  assert total == pytest.approx(_allocated(trace), rel=1e-9)


# ---- no failures -------------------------------------------------------------------------------


@pytest.mark.parametrize("system, learners", [("dp", 1), ("elastic_dp", 1), ("decoupled", 4)])
def test_without_failures_goodput_and_uptime_are_100_percent(system, learners):
  result = goodput.simulate_system(system, 150_000, NEVER_FAILS, num_learners=learners,
                                   horizon_days=1.0)
  assert result.goodput == pytest.approx(1.0, abs=1e-12)
  assert result.uptime == 1.0
  assert result.num_failures == 0
  assert all(v == pytest.approx(0.0, abs=1e-12) for v in result.badput.values())


def test_an_empty_failure_script_loses_nothing():
  for simulate in (simulate_dp_job, simulate_elastic_job):
    trace = simulate(N, FIXED, HORIZON_S, _rng(), failure_times_s=[])
    assert trace.useful == _allocated(trace)
    assert len(trace.pauses_Kx2) == 0


# ---- the cost of one failure, system by system -------------------------------------------------


def test_one_failure_costs_dp_one_restart_of_all_chips_and_the_step_in_flight():
  t_fail = 1000.3  # 0.3 s into a 1 s step
  trace = simulate_dp_job(N, FIXED, HORIZON_S, _rng(), failure_times_s=[t_fail])
  assert trace.badput[accounting.RESTART] == pytest.approx(N * FIXED.restart_s)
  assert trace.badput[accounting.LOST_PROGRESS] == pytest.approx(N * 0.3)
  assert trace.useful == pytest.approx(N * (HORIZON_S - FIXED.restart_s - 0.3))
  np.testing.assert_allclose(trace.pauses_Kx2, [[t_fail, t_fail + FIXED.restart_s]])
  _assert_chip_time_adds_up(trace)


def test_one_failure_costs_elastic_two_pauses_the_step_in_flight_and_one_slice_repair():
  t_fail, r, repair = 1000.3, FIXED.reconfig_s, FIXED.repair_s
  trace = simulate_elastic_job(N, FIXED, HORIZON_S, _rng(), failure_times_s=[t_fail])
  # Shrink at the failure, re-grow when the slice is back: both pause the 99 surviving slices.
  np.testing.assert_allclose(trace.pauses_Kx2, [[t_fail, t_fail + r],
                                                [t_fail + repair, t_fail + repair + r]])
  assert trace.badput[accounting.RECONFIGURATION] == pytest.approx(2 * r * (N - CHIPS_PER_SLICE))
  # The failed slice idles from the failure until the end of the re-grow pause.
  assert trace.badput[accounting.IDLE_DOWN] == pytest.approx(CHIPS_PER_SLICE * (repair + r))
  assert trace.badput[accounting.LOST_PROGRESS] == pytest.approx(N * 0.3)
  assert trace.badput[accounting.RESTART] == 0.0  # no checkpoint restore: survivors hold the state
  _assert_chip_time_adds_up(trace)


def test_one_failure_in_decoupled_costs_only_its_learner():
  m, t_fail = 4, 1000.3
  learners = [simulate_elastic_job(N / m, FIXED, HORIZON_S, _rng(i),
                                   failure_times_s=[t_fail] if i == 0 else [])
              for i in range(m)]
  elastic = simulate_elastic_job(N, FIXED, HORIZON_S, _rng(), failure_times_s=[t_fail])
  # The other learners and the syncer never stop: the system as a whole stays up.
  assert accounting.uptime(learners) == 1.0
  assert accounting.uptime([elastic]) < 1.0
  assert all(tr.useful == _allocated(tr) for tr in learners[1:])
  # The pauses cost N/M chips instead of N; the repaired slice costs the same in both.
  loss_decoupled = 1.0 - accounting.goodput(learners)
  loss_elastic = 1.0 - accounting.goodput([elastic])
  pause_elastic = elastic.badput[accounting.RECONFIGURATION]
  pause_learner = learners[0].badput[accounting.RECONFIGURATION]
  assert pause_learner == pytest.approx(2 * FIXED.reconfig_s * (N / m - CHIPS_PER_SLICE))
  assert pause_elastic == pytest.approx(2 * FIXED.reconfig_s * (N - CHIPS_PER_SLICE))
  assert loss_decoupled < loss_elastic


def test_a_failure_during_a_reconfiguration_restarts_it():
  t1, t2 = 1000.0, 1004.0  # the second failure arrives 4 s into a 10 s pause
  trace = simulate_elastic_job(N, FIXED, HORIZON_S, _rng(), failure_times_s=[t1, t2])
  assert trace.pauses_Kx2[0].tolist() == pytest.approx([t1, t2 + FIXED.reconfig_s])
  _assert_chip_time_adds_up(trace)


def test_a_failure_during_a_dp_restart_starts_a_new_restart():
  t1, t2 = 1000.0, 1050.0
  trace = simulate_dp_job(N, FIXED, HORIZON_S, _rng(), failure_times_s=[t1, t2])
  np.testing.assert_allclose(trace.pauses_Kx2, [[t1, t2 + FIXED.restart_s]])
  assert trace.num_failures == 1  # the second one hit a job that was already down


# ---- accounting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("system, learners", [("dp", 1), ("elastic_dp", 1), ("decoupled", 8)])
def test_goodput_and_badput_buckets_add_up_to_one(system, learners):
  result = goodput.simulate_system(system, 300_000, PARAMS, num_learners=learners,
                                   horizon_days=0.5)
  assert result.goodput + sum(result.badput.values()) == pytest.approx(1.0, abs=1e-9)
  assert 0.0 < result.goodput < 1.0 and result.num_failures > 0


def test_uptime_counts_only_the_time_when_every_learner_is_paused():
  pauses = [np.array([[0.0, 10.0], [50.0, 60.0]]), np.array([[5.0, 20.0], [55.0, 58.0]])]
  # Both paused during [5, 10) and [55, 58): 8 s of 100.
  assert accounting.paused_time_of_all(pauses, 100.0) == pytest.approx(8.0)
  # Touching intervals do not overlap.
  assert accounting.paused_time_of_all([np.array([[0.0, 5.0]]), np.array([[5.0, 9.0]])],
                                       100.0) == 0.0
  # A learner that never pauses keeps the system up.
  assert accounting.paused_time_of_all([pauses[0], np.zeros((0, 2))], 100.0) == 0.0


def test_a_rejoin_discount_moves_stale_steps_to_badput():
  plain = goodput.simulate_system("decoupled", 300_000, PARAMS, num_learners=4, horizon_days=0.5)
  options = goodput.DecoupledOptions(rejoin_stale_steps=24, rejoin_discount=0.5)
  stale = goodput.simulate_system("decoupled", 300_000, PARAMS, num_learners=4, horizon_days=0.5,
                                  decoupled=options)
  assert plain.badput[accounting.STALE] == 0.0
  assert stale.badput[accounting.STALE] > 0.0
  assert stale.goodput == pytest.approx(plain.goodput - stale.badput[accounting.STALE], abs=1e-9)


# One learner of one chip, as the runtime's learners are: every duration exact, step 1 s,
# restart 2 s after the repair.
ONE_CHIP = dataclasses.replace(FIXED, slice_chips=1, step_s=1.0, reconfig_s=2.0)


def test_the_unmerged_loss_grows_as_n_minus_n2_over_2h_then_stays_at_h_over_2():
  # E[min(n, U·H)], U uniform: every fragment's progress since its last take-in, averaged.
  assert unmerged_lost_s(0.0, 24.0) == 0.0
  assert unmerged_lost_s(6.0, 24.0) == pytest.approx(6.0 - 36.0 / 48.0)
  assert unmerged_lost_s(24.0, 24.0) == pytest.approx(12.0)
  assert unmerged_lost_s(100.0, 24.0) == pytest.approx(12.0)
  assert unmerged_lost_s(100.0, 0.0) == 0.0  # off: the paper's model


def test_a_crash_before_h_steps_loses_n_minus_n2_over_2h_besides_the_step_in_flight():
  # H = 10 s. Runs 0-5.5 s, fails 0.5 s into a step with n = 5 s run before it: loses
  # 0.5 + 5 - 25/20 = 4.25 s. Repaired 3 s later at 8.5 s, restarts for 2 s and runs 10.5-20 s.
  trace = simulate_elastic_job(1, ONE_CHIP, 20.0, _rng(), failure_times_s=[5.5],
                               repair_durations_s=[3.0], unmerged_period_s=10.0)
  assert trace.badput[accounting.LOST_PROGRESS] == pytest.approx(0.5 + 3.75)
  assert trace.useful == pytest.approx(5.5 - 4.25 + 9.5)
  assert trace.badput[accounting.IDLE_DOWN] == pytest.approx(3.0 + 2.0)
  _assert_chip_time_adds_up(trace)


def test_a_crash_after_h_steps_loses_h_over_2_and_the_clock_restarts_at_the_restart():
  # H = 4 s. The crash at 12.5 s (n = 12 s >= H) loses 0.5 + 2; repaired at 13.5 s, restarted at
  # 15.5 s; the crash at 17.25 s (n = 1 s since the restart) loses 0.75 + 1 - 1/8.
  trace = simulate_elastic_job(1, ONE_CHIP, 20.0, _rng(), failure_times_s=[12.5, 17.25],
                               repair_durations_s=[1.0, 1.0], unmerged_period_s=4.0)
  assert trace.badput[accounting.LOST_PROGRESS] == pytest.approx(2.5 + 1.625)
  assert trace.useful == pytest.approx((12.5 - 2.5) + (1.75 - 1.625))
  _assert_chip_time_adds_up(trace)


def test_the_discard_share_drops_that_share_of_every_running_second():
  trace = simulate_elastic_job(1, ONE_CHIP, 20.0, _rng(), discard_share=0.25)
  assert trace.useful == pytest.approx(15.0)
  assert trace.badput[accounting.DISCARDED] == pytest.approx(5.0)
  _assert_chip_time_adds_up(trace)


def test_work_lost_at_a_crash_comes_out_of_useful_and_discarded_in_proportion():
  # As the n < H case: 15 s of running, 4.25 s of it lost, a quarter of each discarded.
  trace = simulate_elastic_job(1, ONE_CHIP, 20.0, _rng(), failure_times_s=[5.5],
                               repair_durations_s=[3.0], unmerged_period_s=10.0,
                               discard_share=0.25)
  assert trace.badput[accounting.LOST_PROGRESS] == pytest.approx(4.25)
  assert trace.useful == pytest.approx(0.75 * (15.0 - 4.25))
  assert trace.badput[accounting.DISCARDED] == pytest.approx(0.25 * (15.0 - 4.25))
  _assert_chip_time_adds_up(trace)


def test_scripted_repairs_need_one_per_failure():
  with pytest.raises(ValueError, match="repair_durations_s"):
    simulate_elastic_job(1, ONE_CHIP, 20.0, _rng(), failure_times_s=[5.0],
                         repair_durations_s=[1.0, 2.0])


def test_the_unmerged_and_discard_options_lower_decoupled_goodput():
  run = lambda options: goodput.simulate_system("decoupled", 300_000, PARAMS, num_learners=4,
                                                horizon_days=0.5, decoupled=options)
  plain = run(goodput.DecoupledOptions())
  unmerged = run(goodput.DecoupledOptions(sync_period_steps=24))
  full = run(goodput.DecoupledOptions(sync_period_steps=24, receive_lag_steps=2.0))
  assert unmerged.badput[accounting.LOST_PROGRESS] > plain.badput[accounting.LOST_PROGRESS]
  assert plain.badput[accounting.DISCARDED] == unmerged.badput[accounting.DISCARDED] == 0.0
  assert full.badput[accounting.DISCARDED] > 0.0
  assert full.goodput < unmerged.goodput < plain.goodput
  # The same failures (same seed): the discard only splits what was useful.
  assert full.goodput + full.badput[accounting.DISCARDED] == pytest.approx(
      unmerged.goodput, abs=1e-9)


def test_a_receive_lag_needs_a_sync_period():
  with pytest.raises(ValueError, match="receive_lag_steps.*sync_period_steps"):
    goodput.DecoupledOptions(receive_lag_steps=2.0)
  with pytest.raises(ValueError, match="receive_lag_steps"):
    goodput.DecoupledOptions(sync_period_steps=24, receive_lag_steps=30.0)


# ---- a finite run: the step budget --------------------------------------------------------------


def test_a_job_that_made_its_steps_is_finished_and_no_later_failure_hits_it():
  # 12 steps of 1 s: done at 12 s, finished 12-20 s; the failure scripted at 15 s never comes.
  trace = simulate_elastic_job(1, ONE_CHIP, 20.0, _rng(), failure_times_s=[15.0],
                               repair_durations_s=[3.0], step_budget_s=12.0)
  assert trace.useful == pytest.approx(12.0)
  assert trace.badput[accounting.FINISHED] == pytest.approx(8.0)
  assert trace.num_failures == 0
  np.testing.assert_allclose(trace.pauses_Kx2, [[12.0, 20.0]])  # finished: no progress either
  _assert_chip_time_adds_up(trace)


def test_a_crashed_learner_rejoins_at_a_peers_step_and_skips_ahead():
  # Fails 0.5 s into its 6th step at 5.5 s (5 steps made), repaired at 8.5 s: a peer that never
  # stopped has made 8.5 s of steps, so it goes on from there after its 2 s restart (10.5 s) and
  # makes its 12th second of steps at 14 s, not at 10.5 + 7 = 17.5 s.
  trace = simulate_elastic_job(1, ONE_CHIP, 20.0, _rng(), failure_times_s=[5.5],
                               repair_durations_s=[3.0], step_budget_s=12.0)
  assert trace.useful == pytest.approx(5.0 + 3.5)
  assert trace.badput[accounting.LOST_PROGRESS] == pytest.approx(0.5)
  assert trace.badput[accounting.IDLE_DOWN] == pytest.approx(3.0 + 2.0)
  assert trace.badput[accounting.FINISHED] == pytest.approx(20.0 - 14.0)
  np.testing.assert_allclose(trace.pauses_Kx2, [[5.5, 10.5], [14.0, 20.0]])
  _assert_chip_time_adds_up(trace)


def test_a_learner_repaired_past_its_budget_is_finished_at_the_repair():
  # Down 10-14 s with a 12 s budget: it rejoins at a peer's 14 s of steps, past 12, with no step
  # left to make (the runtime's rejoiner at config.num_steps), so no restart either.
  trace = simulate_elastic_job(1, ONE_CHIP, 20.0, _rng(), failure_times_s=[10.0],
                               repair_durations_s=[4.0], step_budget_s=12.0)
  assert trace.useful == pytest.approx(10.0)
  assert trace.badput[accounting.IDLE_DOWN] == pytest.approx(4.0)
  assert trace.badput[accounting.FINISHED] == pytest.approx(6.0)
  np.testing.assert_allclose(trace.pauses_Kx2, [[10.0, 20.0]])
  _assert_chip_time_adds_up(trace)


def test_with_surviving_slices_the_step_in_flight_is_made_again():
  # Two 1-chip slices; one fails 0.5 s into the 6th step: the survivor keeps the 5 steps (no skip
  # ahead), re-configures 5.5-7.5 s (the failed slice, repaired at 6.5 s, joins in that pause),
  # and makes the other 5 of a 10 s budget 7.5-12.5 s. Then 2 chips × 7.5 s finished.
  trace = simulate_elastic_job(2, ONE_CHIP, 20.0, _rng(), failure_times_s=[5.5],
                               repair_durations_s=[1.0], step_budget_s=10.0)
  assert trace.useful == pytest.approx(2 * 5.0 + 2 * 5.0)
  assert trace.badput[accounting.LOST_PROGRESS] == pytest.approx(2 * 0.5)
  assert trace.badput[accounting.RECONFIGURATION] == pytest.approx(2.0)
  assert trace.badput[accounting.IDLE_DOWN] == pytest.approx(2.0)
  assert trace.badput[accounting.FINISHED] == pytest.approx(2 * 7.5)
  _assert_chip_time_adds_up(trace)


def test_steps_per_learner_is_a_step_budget_of_that_many_steps():
  assert goodput.DecoupledOptions().learner_terms(0.5)["step_budget_s"] == math.inf
  assert goodput.DecoupledOptions(steps_per_learner=200).learner_terms(0.5)[
      "step_budget_s"] == pytest.approx(100.0)
  with pytest.raises(ValueError, match="steps_per_learner"):
    goodput.DecoupledOptions(steps_per_learner=-1)
  # Learners that never fail and make their steps in half the horizon: half of it finished, and
  # the system as a whole stops then.
  half = int(0.5 * 86_400 / PARAMS.step_s)
  result = goodput.simulate_system("decoupled", 150_000, NEVER_FAILS, num_learners=4,
                                   horizon_days=1.0,
                                   decoupled=goodput.DecoupledOptions(steps_per_learner=half))
  assert result.goodput == pytest.approx(0.5)
  assert result.badput[accounting.FINISHED] == pytest.approx(0.5)
  assert result.uptime == pytest.approx(0.5)


# ---- agreement with the closed forms ------------------------------------------------------------


def test_dp_goodput_follows_the_renewal_formula():
  # Fixed restarts: the job runs exp(−λ·R) of the time, and loses half a step per failure.
  chips = 300_000
  lam = chips / PARAMS.mtbi_s
  result = goodput.simulate_system("dp", chips, FIXED, horizon_days=8.0)
  expected = math.exp(-lam * FIXED.restart_s) * (1 - lam * FIXED.step_s / 2)
  assert result.goodput == pytest.approx(expected, rel=0.04)


def test_elastic_goodput_follows_the_first_order_formula():
  chips = 150_000
  q = slice_unavailability(chips / round(chips / PARAMS.slice_chips), PARAMS)
  lam = chips * (1 - q) / PARAMS.mtbi_s  # only slices in service fail
  expected = (1 - q) * (1 - lam * PARAMS.step_s / 2) / (1 + 2 * lam * PARAMS.reconfig_s)
  result = goodput.simulate_system("elastic_dp", chips, PARAMS, horizon_days=2.0)
  assert result.goodput == pytest.approx(expected, abs=0.01)


# ---- the paper's qualitative claims -------------------------------------------------------------


def test_more_learners_give_higher_goodput_at_fixed_chips():
  chips = 600_000
  values = [goodput.simulate_system("dp", chips, PARAMS, horizon_days=0.5).goodput,
            goodput.simulate_system("elastic_dp", chips, PARAMS, horizon_days=0.5).goodput]
  values += [goodput.simulate_system("decoupled", chips, PARAMS, num_learners=m,
                                     horizon_days=0.5).goodput for m in (2, 4, 8, 16)]
  assert values == sorted(values)
  assert values[-1] - values[0] > 0.5  # 16 learners vs DP: more than 50 points


@pytest.mark.parametrize("chips, learners", [(1_200_000, 8), (600_000, 4), (1_200_000, 2)])
def test_rule_of_thumb_m_learners_at_n_chips_match_one_elastic_job_at_n_over_m(chips, learners):
  decoupled = goodput.simulate_system("decoupled", chips, PARAMS, num_learners=learners,
                                      horizon_days=2.0)
  elastic = goodput.simulate_system("elastic_dp", chips // learners, PARAMS, horizon_days=2.0)
  # Within 1.5 goodput points, about the seed-to-seed spread of a 2-day run.
  assert decoupled.goodput == pytest.approx(elastic.goodput, abs=0.015)


def test_with_many_learners_the_system_never_stops_as_a_whole():
  result = goodput.simulate_system("decoupled", 2_400_000, PARAMS, num_learners=8,
                                   horizon_days=0.5)
  elastic = goodput.simulate_system("elastic_dp", 2_400_000, PARAMS, horizon_days=0.5)
  assert result.uptime > 0.9999
  assert elastic.uptime < 0.5


# ---- reproducibility, honesty, errors ----------------------------------------------------------


def test_a_seed_reproduces_a_run_and_another_seed_changes_it():
  run = lambda seed: goodput.simulate_system("elastic_dp", 150_000, PARAMS, horizon_days=0.25,
                                             seed=seed)
  assert run(3) == run(3)
  assert run(3).goodput != run(4).goodput


def test_the_simulator_never_reads_the_papers_numbers():
  # Only the scripts import `published`, to print the paper beside our results.
  for path in pathlib.Path(goodput.__file__).parent.glob("*.py"):
    if path.name != "published.py":
      imports = [line for line in path.read_text().splitlines()
                 if line.lstrip().startswith(("import ", "from "))]
      assert not any("published" in line for line in imports), path.name


@pytest.mark.parametrize("field, value", [("slice_chips", 0), ("repair_s", -1.0),
                                          ("reconfig_s", -1.0), ("weibull_shape", 0.0)])
def test_bad_parameters_name_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    ClusterParams(**{field: value})


def test_bad_learner_counts_name_the_flag():
  with pytest.raises(ValueError, match="num_learners"):
    goodput.simulate_system("decoupled", 1000, PARAMS, num_learners=8)
  with pytest.raises(ValueError, match="num_learners"):
    goodput.simulate_system("dp", 150_000, PARAMS, num_learners=4)
  with pytest.raises(ValueError, match="system"):
    goodput.simulate_system("async", 150_000, PARAMS)
