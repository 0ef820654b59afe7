"""Tokens/s per device and MFU (runtime/core/throughput.py): the arithmetic, the peak table, and what a
run reports in its progress line and summary.json; the profiler window (config.profile_steps)."""

import glob
import logging
import os

import pytest

from conftest import tiny_settings
from decoupled_diloco.lm import flops
from decoupled_diloco.runtime.core import throughput
from decoupled_diloco.runtime import train


@pytest.mark.parametrize("kind,peak", [
    ("TPU v5", 459e12), ("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v6 lite", 918e12),
    ("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA H100 PCIe", 756.5e12),
    ("NVIDIA H200", 989.5e12), ("TPU v4", 275e12),
    ("NVIDIA A100-SXM4-40GB", 312e12), ("cpu", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_flops_come_from_the_device_kind_and_unknown_kinds_have_none(kind, peak):
  assert throughput.peak_flops_per_s(kind) == (pytest.approx(peak) if peak else None)


def test_mfu_is_achieved_over_peak_and_null_without_a_peak():
  # 1000 tokens in 2 device-seconds at 6e9 FLOPs per token: 3e12 FLOP/s per device.
  measured = throughput.throughput(1000, 2.0, 6e9, peak=12e12)
  assert measured.tokens_per_s_per_device == 500
  assert measured.achieved_flops_per_s_per_device == 3e12
  assert measured.mfu == 0.25
  assert throughput.throughput(1000, 2.0, 6e9, peak=None).mfu is None
  assert throughput.throughput(0, 0.0, 6e9, peak=12e12).tokens_per_s_per_device is None


def test_steps_that_overlap_an_evaluation_are_left_out():
  # Steps ending at 1, 2, 3, 4, each 1 s long; an evaluation from 2.5 to 2.7 overlaps the third.
  count, seconds = throughput.steps_outside([1.0, 2.0, 3.0, 4.0], [1.0] * 4, [(2.5, 2.7)])
  assert (count, seconds) == (3, 3.0)
  # Touching a step's boundary is no overlap.
  assert throughput.steps_outside([1.0, 2.0], [1.0, 1.0], [(1.0, 1.0)]) == (2, 2.0)


# Slow, so that the default suite stays under 10 min (8 s; the throughput arithmetic stays in
# the tests above).
@pytest.mark.slow
def test_a_run_reports_throughput_and_traces_the_profiled_steps(tmp_path, caplog):
  settings = tiny_settings(tmp_path, profile_steps=(2, 3))
  with caplog.at_level(logging.INFO, logger="absl"):
    summary = train.execute(train.build(settings), progress=True)
  per_token = flops.model_flops_per_token(settings.model, settings.data.seq_len)
  assert summary["model_flops_per_token"] == per_token
  assert summary["device_kind"] == "cpu" and summary["peak_flops_per_s_per_device"] is None
  assert summary["mfu"] is None  # no peak for a CPU
  assert summary["tokens_per_s_per_device"] > 0
  assert summary["achieved_flops_per_s_per_device"] == pytest.approx(
      summary["tokens_per_s_per_device"] * per_token)
  # Per device: a learner on 2 devices makes half its tokens/s per device. The final evaluation
  # came after every step, so no step is left out here.
  tokens_per_step = settings.learner_batch_size * settings.data.seq_len
  device_seconds = sum(steps / rate * 2 for steps, rate in
                       zip(summary["learner_steps"], summary["learner_steps_per_s"]))
  assert summary["tokens_per_s_per_device"] == pytest.approx(
      sum(summary["learner_steps"]) * tokens_per_step / device_seconds)
  progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
  assert progress and all(" | tok/s/dev " in line for line in progress), progress
  assert not any("mfu" in line for line in progress)  # unknown on CPU: not printed
  # The trace of learner 0's steps 2-3, where TensorBoard's profile plugin looks for it.
  traces = glob.glob(os.path.join(settings.workdir, "profile", "plugins", "profile", "*",
                                  "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


@pytest.mark.parametrize("steps", [(3, 2), (-1, 2), (0, 24), (1,)])
def test_profile_steps_outside_the_run_are_refused_naming_the_field(tmp_path, steps):
  with pytest.raises(ValueError, match=r"config\.profile_steps=.*config\.num_steps=24"):
    tiny_settings(tmp_path, profile_steps=steps)


def test_learners_taking_turns_on_devices_count_each_second_of_them_once():
  """Two learners take turns on one device, 1 s per step: each measures 2 s per step (a turn of
  both). Their steps cover [0, 8] once, not 16 device-seconds; a step inside an evaluation window
  is left out with its seconds, and a learner that is down leaves its peer's steps counted as
  they ran (faster, 1 s each)."""
  a = ([2.0, 4.0, 6.0, 8.0], [2.0, 2.0, 2.0, 2.0])
  b = ([3.0, 5.0, 7.0, 9.0], [3.0, 2.0, 2.0, 2.0])
  counts, seconds = throughput.shared_steps_outside([a, b], [])
  assert counts == [4, 4] and seconds == pytest.approx(9.0)
  counts, seconds = throughput.shared_steps_outside([a, b], [(6.5, 6.6)])
  assert counts == [3, 3] and seconds == pytest.approx(9.0 - 1.0)  # (6, 7] left out, by both
  alone = ([10.0, 11.0, 12.0], [1.0, 1.0, 1.0])
  counts, seconds = throughput.shared_steps_outside([a, alone], [])
  assert counts == [4, 3] and seconds == pytest.approx(8.0 + 3.0)
