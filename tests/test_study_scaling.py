"""scripts/study_scaling.py: the plan, the fitted exponent and the option arms, without training."""

import math
import pathlib

import ml_collections
import pytest

from tests.conftest import load_script

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(name="study", scope="module")
def _study_scaling():
  return load_script("study_scaling")


def test_the_fit_recovers_a_known_exponent_within_its_interval(study):
  params = [3e4, 1e5, 3e5, 3e4, 1e5, 3e5]
  noise = [1.03, 0.98, 1.02, 0.97, 1.01, 0.99]  # two seeds' scatter around the law
  gaps = [5.0 * (n / 1e4) ** -0.35 * e for n, e in zip(params, noise)]
  fit = study.fit_exponent(params, gaps)
  assert fit["low"] < 0.35 < fit["high"]
  assert fit["exponent"] == pytest.approx(0.35, abs=0.05)
  exact = study.fit_exponent([1e6, 1e7, 1e8], [2.0 * n ** -0.5 for n in (1e6, 1e7, 1e8)])
  assert exact["exponent"] == pytest.approx(0.5)
  assert exact["high"] - exact["low"] == pytest.approx(0, abs=1e-6)


def test_no_power_law_fits_a_gap_at_or_below_zero(study):
  fit = study.fit_exponent([1e5, 3e5, 1e6], [1.0, 0.5, -0.1])
  assert fit["exponent"] is None and "<= 0" in fit["why"]


def test_the_published_diloco_gaps_shrink_about_as_stated(study):
  by_n = study.PUBLISHED["DiLoCo M=4 (2503.09799 Table 4)"]
  fit = study.fit_exponent(list(by_n), list(by_n.values()))
  assert 0.3 < fit["exponent"] < 0.5


def test_every_size_of_the_plan_trains_the_same_tokens_per_parameter(study):
  params = {"a": 41_120, "b": 123_216, "c": 279_104, "d": 1_082_496}
  rows = study.plan(list(params), 15.0, params=params)
  for row in rows:  # equal but for rounding to whole steps
    assert row["tokens_per_param"] == pytest.approx(15.0, abs=study.TOKENS_PER_STEP / row["params"])
    assert row["tokens"] == row["steps"] * study.TOKENS_PER_STEP
  assert [r["steps"] for r in rows] == sorted(r["steps"] for r in rows)


def test_the_parameter_counts_are_the_models(study):
  assert study.num_params(study.SIZES["m"]) == 279_104  # tiny_cpu's model


def test_an_option_whose_field_is_missing_is_skipped_and_named(study):
  config = ml_collections.ConfigDict({"outer": {"momentum": 0.3},
                                      "merge": {"keep_in_flight_progress": False}})
  kept, skipped = study.option_arms(config)
  assert list(kept) == ["decoupled M=4, keep in-flight progress"]
  assert len(skipped) == 2
  assert any("config.outer.nesterov_delay does not exist" in s for s in skipped)
  assert any("config.outer.staleness_scaling does not exist" in s for s in skipped)
  config.outer.nesterov_delay = 0
  config.outer.staleness_scaling = "none"
  kept, skipped = study.option_arms(config)
  assert len(kept) == 3 and not skipped


def test_the_estimate_counts_the_option_arms_at_the_largest_size_only(study):
  rows = [{"size": "xs", "steps": 100}, {"size": "m", "steps": 500}]
  calib = {"xs": {"step_s": 0.1, "startup_s": 10.0}, "m": {"step_s": 1.0, "startup_s": 20.0}}
  plain, _ = study.estimate(rows, ["decoupled M=4"], [], 1, calib)
  assert plain == pytest.approx(10 + 10 + 20 + 500)
  with_option, how = study.estimate(rows, ["decoupled M=4"], ["x"], 2, calib)
  assert with_option == pytest.approx(2 * (plain + 20 + 500))
  assert all("measured" in h for h in how)
  assert math.isfinite(study.estimate(rows, ["dp"], [], 1, {})[0])  # from FLOPs
