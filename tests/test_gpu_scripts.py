"""scripts/gpu_triage.py and scripts/gpu_quality.py, ready for a lent GPU: their --dry_run runs
every phase at toy size on fake CPU devices and leaves a report with every figure in it."""

import functools
import json
import math
import pathlib
import subprocess
import sys

import pytest

from conftest import load_script
from decoupled_diloco import settings

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(name="dry_runs", scope="module")
def _dry_runs(tmp_path_factory):
  """Both scripts' dry runs, started together (each is mostly one busy thread at a time)."""
  procs = {}
  for name in ("gpu_triage", "gpu_quality"):
    tmp = tmp_path_factory.mktemp(name)
    procs[name] = (tmp, subprocess.Popen(
        [sys.executable, str(_ROOT / "scripts" / f"{name}.py"), "--dry_run",
         f"--out_dir={tmp / 'results'}", f"--workdir={tmp / 'work'}", "--budget_s=300"],
        cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  reports = {}
  for name, (tmp, proc) in procs.items():
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    (json_path,) = (tmp / "results").glob(f"{name}_cpu_*.json")
    assert json_path.with_suffix(".md").read_text().startswith("# GPU")
    reports[name] = json.loads(json_path.read_text())
  return reports


def test_the_triage_dry_run_judges_every_phase(dry_runs):
  report = dry_runs["gpu_triage"]
  assert report["card"] == "cpu" and report["dry_run"]
  phases = report["phases"]
  assert set(phases) == {"a", "b", "c", "d"}
  # a: dp twice bit-identical, the identity outer step on it (one learner, fake CPU devices).
  a = phases["a"]["verdict"]
  assert [r["status"] for r in phases["a"]["runs"]] == ["done"] * 4
  assert a["dp_bit_identical"] is True and a["identity_within_0.1%"] is True
  assert abs(a["identity_gap_to_dp"]) <= 1e-3
  # Every step's training loss was compared: on CPU the identity runs make dp's steps exactly.
  assert all(len(r["step_losses"]) == r["learner_steps"][0] for r in phases["a"]["runs"])
  assert a["dp_steps_apart"] == 0
  assert a["identity_1_first_step_apart_from_dp"] == a["identity_2_first_step_apart_from_dp"] == 0
  assert all(r["status"] == "skipped" for r in phases["b"]["runs"])  # no cuDNN on a CPU
  c = phases["c"]["verdict"]
  assert c["tokens_per_s_over_dp"] > 0 and 0 < c["goodput"] <= 1 and c["late_offers"] >= 0
  assert c["merges_due"] > 0 and isinstance(c["goodput_target_met"], bool)
  assert 0 < c["flush_seconds"] <= c["end_seconds"] < c["wall_seconds"] and c["dp_end_seconds"] > 0
  # d: the trial is run and recorded; on a CPU it stops at cuDNN's refusal of the platform
  # (test_settings checks that its variable lifts the sharing refusal).
  d = phases["d"]["verdict"]
  assert d["status"] == "failed" and d["refused_at_validation"] and d["crashed"] is False
  assert "config.model.attention='cudnn'" in d["error_tail"]


def test_the_quality_dry_run_builds_its_corpus_and_compares_three_arms(dry_runs):
  report = dry_runs["gpu_quality"]
  phases = report["phases"]
  corpus = phases["corpus"]["code_corpus"]
  assert len(corpus["fingerprint"]) == 64 and corpus["bytes"] <= 400_000
  assert corpus["available_bytes"] > corpus["bytes"]  # the dry run builds 400 kB of them
  assert phases["size"]["chosen"]["steps"] > 0
  arms = phases["arms"]
  assert list(arms) == ["dp", "decoupled M=4", "streaming M=4"]
  assert all(r["status"] == "done" and math.isfinite(r["final_eval_loss"]) for r in arms.values())
  verdict = phases["verdict"]
  assert verdict["step"] == phases["size"]["chosen"]["steps"]
  for key in ("decoupled_gap_to_dp", "streaming_gap_to_dp", "decoupled_over_streaming"):
    assert abs(verdict[key]) < 0.5, key
  assert verdict["law_gap"] > 0 and isinstance(verdict["decoupled_within_law"], bool)


def test_the_trial_variable_is_the_one_the_settings_read():
  triage = load_script("gpu_triage")
  assert triage.CUDNN_SHARING_TRIAL_ENV == settings.CUDNN_SHARING_TRIAL_ENV


def test_the_quality_size_is_the_largest_that_fits_corpus_and_time():
  quality = load_script("gpu_quality")
  assert quality.law_gap(35e6) == pytest.approx(0.02)
  assert quality.law_gap(10e6) == pytest.approx(0.031, abs=5e-4)  # the issue's +3.1%
  fit = functools.partial(quality.choose_size, quality.SIZES, seq_len=512, batch=32,
                          flops_per_s=1e12)
  enough = fit(train_windows=10**9, train_seconds=10**9)
  assert enough["chosen"]["size"] == "42m" and not enough["chosen"]["below_20_tokens_per_param"]
  # 130 MB of windows of 513 bytes: 20 tokens per parameter stop below 6.5M parameters.
  corpus_bound = fit(train_windows=130_000_000 // 513, train_seconds=10**9)
  assert corpus_bound["chosen"]["size"] == "6m"
  assert all(r["tokens"] >= 20 * r["num_params"] for r in corpus_bound["table"])
  none = fit(train_windows=10**9, train_seconds=1.0)
  assert none["chosen"]["size"] == "4m" and none["chosen"]["below_20_tokens_per_param"]
