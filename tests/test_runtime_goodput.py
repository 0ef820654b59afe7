"""Goodput of a real run: each learner's wall time in the simulator's buckets."""

import pytest

from conftest import tiny_settings
from decoupled_diloco.algorithm import time_buckets as tb
from decoupled_diloco.runtime import train

DOWN_S = 1.0
_SLOW = {"learner_step_delays_s": (0.05,) * 4}


def _run(tmp_path, schedule=""):
  return train.execute(train.build(tiny_settings(tmp_path, chaos__schedule=schedule, **_SLOW)),
                       progress=False)


def _assert_buckets_fill_the_wall_time(summary):
  assert set(summary["time_buckets"]) == {"0", "1", "2", "3"}
  for buckets in summary["time_buckets"].values():
    assert set(buckets) == set(tb.BUCKETS)
    assert sum(buckets.values()) == pytest.approx(summary["wall_seconds"], rel=0.1, abs=0.2)


def test_a_crashed_learner_is_down_while_repaired_and_goodput_drops(tmp_path):
  clean = _run(tmp_path / "clean")
  crashed = _run(tmp_path / "crashed", f"crash@learner=1,step=6,down_s={DOWN_S}")
  _assert_buckets_fill_the_wall_time(clean)
  _assert_buckets_fill_the_wall_time(crashed)
  assert crashed["rejoins"] == 1
  down = crashed["time_buckets"]["1"]
  # Down from its failure to its repair (down_s after the fault fired, a few microseconds before
  # the failure), then restarting until its next incarnation's first step.
  assert down[tb.IDLE_DOWN] >= DOWN_S - 0.01
  assert down[tb.RESTART] > 0 and down[tb.LOST_PROGRESS] > 0
  for m in ("0", "2", "3"):
    assert crashed["time_buckets"][m][tb.IDLE_DOWN] == 0.0
    assert crashed["time_buckets"][m][tb.RESTART] == 0.0
  assert clean["time_buckets"]["1"][tb.IDLE_DOWN] == 0.0
  # Goodput drops where the time went: the crashed learner's useful share is below each of its
  # peers' in the same run (two runs would meet other loads of the host).
  shares = {m: b[tb.USEFUL] / sum(b.values()) for m, b in crashed["time_buckets"].items()}
  assert shares["1"] < min(shares[m] for m in ("0", "2", "3")), shares
  assert 0 < crashed["goodput"] < 1 and 0 < clean["goodput"] <= 1
  # The others trained while learner 1 was down: the job as a whole never stopped.
  assert crashed["uptime"] > 0.8 and clean["uptime"] > 0.8
