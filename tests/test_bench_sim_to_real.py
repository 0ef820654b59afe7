"""scripts/bench_sim_to_real.py's pure parts: a run's summary -> the simulator's parameters, the
replay of the run's crash schedule, and the table. No training."""

import math

import pytest

from decoupled_diloco.sim.cluster import SECONDS_PER_YEAR
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
      "num_fragments": FRAGMENTS,
      "failures": [{"learner": 0, "failed_at_s": 5.0, "repaired_at_s": 8.0,
                    "lost_fragment_tokens": 2 * FRAGMENTS * TOKENS_PER_STEP}],
  }


def test_measure_reads_the_window_step_restart_and_unmerged_loss_off_the_summary():
  m = bench.measure(_summary())
  assert m.window_s == pytest.approx(20.0)
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


def test_the_replay_with_the_unmerged_term_gives_the_hand_computed_goodput():
  # Learner 0: runs 0-5 s, crash (no step in flight: 5 s is a step boundary), down 5-8, restarts
  # 8-9, runs 9-20: 16 s; the term takes 2 s of it. Learner 1: 20 s. (16 - 2 + 20) / 40 = 0.85.
  m = bench.measure(_summary())
  params = bench.cluster_params(m, mtbf_s=30.0, repair_s=3.0, repair_shape=0.85)
  assert bench.simulate_replay(m, params, unmerged_lost_steps=0.0) == pytest.approx(36 / 40)
  assert bench.simulate_replay(m, params, unmerged_lost_steps=2.0) == pytest.approx(34 / 40)


def test_the_simulators_own_draws_without_crashes_give_full_goodput():
  m = bench.measure(_summary())
  params = bench.cluster_params(m, mtbf_s=0.0, repair_s=3.0, repair_shape=0.85)
  mean, std = bench.simulate_drawn(m, params, unmerged_lost_steps=2.0, seeds=3)
  assert (mean, std) == (pytest.approx(1.0), pytest.approx(0.0))


def test_the_table_gives_percent_and_signed_points_per_rate():
  m = bench.measure(_summary())
  r = bench.row(30.0, m, repair_s=3.0, repair_shape=0.85, sim_seeds=2)
  assert r["diff_before_pts"] == pytest.approx(100 * (0.9 - 0.8))
  assert r["diff_after_pts"] == pytest.approx(100 * (0.85 - 0.8))
  text = bench.table([r])
  assert text.splitlines()[0].startswith("| MTBF s | crashes |")
  assert "| 30 | 1 | 1.000 | 1.00 | 2.0 | 80.0 | 90.0 | +10.0 | 85.0 | +5.0 |" in text
  assert text.endswith("| 0.0 | 0.0 | +5.0 |")  # no discarded or idle time: all 5 points left


def test_the_full_bench_estimate_scales_training_by_steps_and_keeps_the_overhead():
  # 2 smoke runs of 40 steps: 60 s of process, 20 s of it training -> 40 s overhead + 100 s at
  # 200 steps, times 3 runs = 7 min.
  minutes = bench.estimate_full_minutes([60.0, 60.0], [20.0, 20.0], 40, 200, 3)
  assert minutes == pytest.approx(3 * 140 / 60)


def test_overrides_give_every_learner_the_step_delay_and_no_checkpoints():
  cfg = bench.overrides(17.0, 200, 0.25, 3.0, 0.85, 0)
  assert cfg["learner_step_delays_s"] == (0.25,) * bench.NUM_LEARNERS
  assert cfg["chaos.mtbf_s"] == 17.0 and cfg["checkpoint.every_steps"] == 0
  assert not math.isnan(cfg["chaos.repair_s"])
