"""scripts/bench_sim_to_real.py's pure parts: a run's summary -> the simulator's parameters, the
replay of the run's crash schedule, and the table. No training."""

import math

import pytest

from decoupled_diloco.sim.cluster import SECONDS_PER_YEAR
from decoupled_diloco.sim.goodput import DecoupledOptions
from tests.conftest import load_script

bench = load_script("bench_sim_to_real")

TOKENS_PER_STEP = bench.BATCH_SIZE * bench.SEQ_LEN
FRAGMENTS = 24


def _buckets(useful, lost=0.0, down=0.0, restart=0.0, discarded=0.0, idle=0.0):
  return {"useful": useful, "discarded": discarded, "lost_progress": lost, "idle_down": down,
          "restart": restart, "idle": idle}


def _summary():
  """Two learners over a 20 s window, 1 s steps: learner 0 crashes once at 5 s, repaired 3 s
  later, restarts in 1 s and loses 2 steps of unmerged work; learner 1 never fails."""
  return {
      "goodput": 0.8,
      "time_buckets": {"0": _buckets(useful=14.0, lost=2.0, down=3.0, restart=1.0),
                       "1": _buckets(useful=20.0)},
      "tokens_trained": 36 * TOKENS_PER_STEP,  # 16 + 20 steps made
      "learner_steps": [20, 20],  # config.num_steps = 20: the budget ends with the window
      "num_fragments": FRAGMENTS,
      "failures": [{"learner": 0, "failed_at_s": 5.0, "repaired_at_s": 8.0,
                    "lost_fragment_tokens": 2 * FRAGMENTS * TOKENS_PER_STEP}],
  }


def test_measure_reads_the_window_step_restart_and_unmerged_loss_off_the_summary():
  m = bench.measure(_summary())
  assert m.window_s == pytest.approx(20.0)
  assert m.num_steps == 20
  assert m.first_steps_spread_s is None  # the summary has no first-step times
  assert m.step_s == pytest.approx(1.0)
  assert m.restart_s == pytest.approx(1.0)
  assert m.unmerged_lost_steps == pytest.approx(2.0)
  assert m.crashes == {0: [(5.0, 3.0)], 1: []}
  assert m.goodput == 0.8


def test_a_learner_mtbf_maps_to_a_one_chip_slice_with_that_mtbi():
  m = bench.measure(_summary())
  params = bench.cluster_params(m, mtbf_s=30.0, repair_s=3.0, repair_shape=0.85)
  assert params.slice_chips == 1
  assert params.mtbi_years * SECONDS_PER_YEAR == pytest.approx(30.0)
  assert (params.repair_s, params.weibull_shape) == (3.0, 0.85)
  assert (params.reconfig_s, params.step_s) == (pytest.approx(1.0), pytest.approx(1.0))
  never = bench.cluster_params(m, mtbf_s=0.0, repair_s=3.0, repair_shape=0.85)
  assert never.mtbi_years * SECONDS_PER_YEAR > 1e20  # mtbf_s=0: no random crashes


def _options(period_steps=0, receive_lag_steps=0.0):
  return DecoupledOptions(sync_period_steps=period_steps, receive_lag_steps=receive_lag_steps)


def test_the_replay_loses_n_minus_n2_over_2h_at_a_crash_before_h_steps():
  # Learner 0 runs 0-5 s, crashes on a step boundary (nothing in flight) n = 5 steps in, is down
  # 5-8 s, restarts 8-9 s and runs 9-20 s: 16 s. With H = 10 the crash loses 5 - 25/20 = 3.75
  # steps. Learner 1 runs 20 s. (16 - 3.75 + 20) / 40.
  m = bench.measure(_summary())
  params = bench.cluster_params(m, mtbf_s=30.0, repair_s=3.0, repair_shape=0.85)
  assert bench.simulate_replay(m, params, _options()).goodput == pytest.approx(36 / 40)
  replay = bench.simulate_replay(m, params, _options(period_steps=10))
  assert replay.goodput == pytest.approx((16 - 3.75 + 20) / 40)
  assert (replay.lost_steps, replay.crashes) == (pytest.approx(3.75), 1)


def test_the_replay_loses_h_over_2_at_a_crash_after_h_steps():
  m = bench.measure(_summary())
  params = bench.cluster_params(m, mtbf_s=30.0, repair_s=3.0, repair_shape=0.85)
  replay = bench.simulate_replay(m, params, _options(period_steps=4))  # n = 5 >= H = 4: 2 steps
  assert replay.goodput == pytest.approx((16 - 2 + 20) / 40)


def test_the_full_model_drops_d_of_every_h_steps_of_what_the_crash_left():
  # H = 10, d = 1: a tenth of every running second goes, of learner 0's 16 - 3.75 s and learner
  # 1's 20 s alike.
  m = bench.measure(_summary())
  params = bench.cluster_params(m, mtbf_s=30.0, repair_s=3.0, repair_shape=0.85)
  replay = bench.simulate_replay(m, params, _options(period_steps=10, receive_lag_steps=1.0))
  assert replay.goodput == pytest.approx(0.9 * (16 - 3.75 + 20) / 40)


def test_the_receive_lag_is_h_times_the_discarded_share_of_compute_on_the_fault_free_run():
  fault_free = {**_summary(), "failures": [],
                "time_buckets": {"0": _buckets(useful=17.0, discarded=2.0, lost=1.0, idle=1.0),
                                 "1": _buckets(useful=18.0, discarded=2.0, idle=1.0)}}
  runs = [(30.0, bench.measure(_summary())), (0.0, bench.measure(fault_free))]
  mtbf, base = bench.calibration_run(runs)
  assert mtbf == 0.0
  # 4 s discarded of 40 s of compute (the idle 2 s left out): d = 24 × 4 / 40.
  assert bench.calibrate_receive_lag(base, 24) == pytest.approx(2.4)


def test_without_a_fault_free_run_the_run_with_the_fewest_crashes_calibrates():
  twice = {**_summary(), "failures": _summary()["failures"] * 2}
  runs = [(10.0, bench.measure(twice)), (30.0, bench.measure(_summary()))]
  assert bench.calibration_run(runs)[0] == 30.0


def test_the_simulators_own_draws_without_crashes_give_full_goodput():
  m = bench.measure(_summary())
  params = bench.cluster_params(m, mtbf_s=0.0, repair_s=3.0, repair_shape=0.85)
  mean, std, crashes = bench.simulate_drawn(m, params, _options(period_steps=24), seeds=3)
  assert (mean, std, crashes) == (pytest.approx(1.0), pytest.approx(0.0), 0.0)


def test_the_table_adds_one_term_at_a_time_in_percent_and_signed_points():
  # H = 4, d = 0.4: the crash loses H/2 = 2 steps, as the runtime measured, and the overwrite a
  # tenth of the rest. 20 steps of 1 s fill the window: the budget adds nothing.
  m = bench.measure(_summary())
  r = bench.row(30.0, m, period_steps=4, receive_lag_steps=0.4, repair_s=3.0,
                repair_shape=0.85, sim_seeds=2)
  assert r["diff_paper_pts"] == pytest.approx(100 * (0.9 - 0.8))
  assert r["diff_unmerged_pts"] == pytest.approx(100 * (0.85 - 0.8))
  assert r["sim_full"] == pytest.approx(0.9 * 34 / 40)
  assert r["residual_pts"] == pytest.approx(100 * (0.765 - 0.8))
  text = bench.table([r])
  assert text.splitlines()[0].startswith("| MTBF s | crashes |")
  assert "| 30 | 1 | 1.000 | 1.00 | 2.0 | 2.0 | 80.0 | 90.0 | 85.0 | 76.5 | 76.5 |" in text
  assert text.endswith("| 0.0 | 0.0 | n/a | -3.5 |")


def _finished_early():
  """As `_summary`, with config.num_steps = 15 and first steps done 5.0 and 5.5 s into the build:
  learner 1 steps 0-15 s and idles 5 s; learner 0 makes 5 steps, is down 5-8 s, rejoins at its
  peer's step 8, restarts 8-9 s, makes 7 steps (2 of them lost) and idles 4 s."""
  return {**_summary(), "goodput": 25 / 40, "learner_steps": [15, 15],
          "tokens_trained": 27 * TOKENS_PER_STEP,
          "first_step_s": 5.0, "last_first_step_s": 5.5,
          "time_buckets": {"0": _buckets(useful=10.0, lost=2.0, down=3.0, restart=1.0, idle=4.0),
                           "1": _buckets(useful=15.0, idle=5.0)}}


def test_the_budget_ends_each_learner_at_its_steps_and_the_residual_subtracts_nothing():
  # H = 4, d = 0.4. Learner 1 makes its 15 s of steps by 15 s: 5 s finished. Learner 0 crashes at
  # 5 s (loses H/2 = 2 steps), rejoins at 8 s of a peer's steps, restarts until 9 s and makes the
  # last 7 by 16 s: 4 s finished. Useful: 0.9 × ((5 + 7 - 2) + 15) of 40 learner-seconds.
  m = bench.measure(_finished_early())
  assert (m.num_steps, m.step_s, m.first_steps_spread_s) == (15, pytest.approx(1.0),
                                                            pytest.approx(0.5))
  r = bench.row(30.0, m, period_steps=4, receive_lag_steps=0.4, repair_s=3.0,
                repair_shape=0.85, sim_seeds=2)
  assert r["sim_discard"] == pytest.approx(0.9 * (16 - 2 + 20) / 40)  # to the window's end
  assert r["sim_full"] == pytest.approx(0.9 * 25 / 40)
  assert r["sim_finished_pts"] == pytest.approx(100 * 9 / 40)
  assert r["idle_pts"] == pytest.approx(100 * 9 / 40)
  assert r["residual_pts"] == pytest.approx(100 * (0.9 * 25 / 40 - 25 / 40), abs=0.01)
  line = bench.table([r]).splitlines()[-1]
  assert "| 62.5 | 90.0 | 85.0 | 76.5 | 56.2 |" in line
  assert "| 22.5 | 22.5 | 0.5 |" in line


def test_the_full_bench_estimate_scales_training_by_steps_and_keeps_the_overhead():
  # 2 smoke runs of 40 steps: 60 s of process, 20 s of it training -> 40 s overhead + 100 s at
  # 200 steps, times 3 runs = 7 min.
  minutes = bench.estimate_full_minutes([60.0, 60.0], [20.0, 20.0], 40, 200, 3)
  assert minutes == pytest.approx(3 * 140 / 60)


def test_overrides_give_every_learner_the_step_delay_and_no_checkpoints():
  cfg = bench.overrides(17.0, 200, 0.25, 3.0, 0.85, 0)
  assert cfg["learner_step_delays_s"] == (0.25,) * bench.NUM_LEARNERS
  assert cfg["chaos.mtbf_s"] == 17.0 and cfg["checkpoint.every_steps"] == 0
  assert cfg["sync.period"] == bench.SYNC_PERIOD == 24
  assert not math.isnan(cfg["chaos.repair_s"])
