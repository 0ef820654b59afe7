"""corrupt_checkpoint@second=T: the newest checkpoint on disk is damaged; a resume skips it for the
previous one and says why."""

import time

import pytest

from conftest import tiny_settings
from decoupled_diloco.runtime.faults import checkpoint_faults
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime import train

EVERY = 8
STALL_S = 2.0


def _settings(workdir, schedule, **overrides):
  return tiny_settings(workdir, chaos__schedule=schedule, checkpoint__every_steps=EVERY,
                       **overrides)


def _written(run):
  return [c["number"] for c in run.checkpoints.saved if c["kind"] == "job"]


@pytest.mark.slow  # 36 s on CI; the fallback itself is tests/test_checkpoints.py's, in the default run
def test_a_corrupted_newest_checkpoint_is_skipped_at_resume_for_the_previous_one(tmp_path):
  """The fault fires once the second checkpoint (cut around step 16) is written (its clock jumps
  past T then, so the test does not race the run); then every learner stops stepping, and the run
  dies of the stall before it writes another checkpoint, as a job whose host is lost would. The
  resume finds the second damaged and takes the first."""
  run = train.build(_settings(tmp_path, "corrupt_checkpoint@second=3600",
                              stall_timeout_s=STALL_S, learner_step_delays_s=(0.05,) * 4))
  jump = [0.0]
  run.corrupter = checkpoint_faults.CheckpointCorrupter(
      run.injector.checkpoint_faults, run.checkpoints, run.metrics,
      clock=lambda: time.monotonic() + jump[0])
  held = set()

  def hook(learner, step):
    if step <= 2 * EVERY or learner in held:
      return
    if not jump[0] and len(_written(run)) >= 2:
      jump[0] = 10_000.0
    if not jump[0]:
      time.sleep(0.2)  # slower, never blocked: the cut needs every learner stepping
      return
    # The cut is taken: wait for the fault (the corrupter first waits for the write to land),
    # then the job stops: no learner steps again.
    deadline = time.monotonic() + 60
    while not run.corrupter.records and time.monotonic() < deadline:
      time.sleep(0.02)
    held.add(learner)
    time.sleep(STALL_S + 1.5)

  for learner in run.learners:
    learner._step_hook = hook  # pylint: disable=protected-access
  with pytest.raises(RuntimeError, match="no learner made a step"):
    train.execute(run, progress=False)

  [fault] = [r for r in metrics_lib.read_records(str(tmp_path), "fault")
             if r["fault"] == "corrupt_checkpoint"]
  first, second = _written(run)[:2]
  assert fault["damaged"] and fault["number"] == second and len(_written(run)) == 2
  assert fault["file"].startswith("arrays/") and fault["bytes_flipped"] > 0
  resumed = train.build(_settings(tmp_path, ""))
  assert resumed.restored.cut.clock == first
  summary = train.execute(resumed, progress=False)
  [skipped] = summary["resumes"][-1]["skipped"]
  assert skipped["number"] == second and skipped["path"] == fault["checkpoint"]
  assert "CRC-32" in skipped["reason"] or "rror" in skipped["reason"]
  assert summary["learner_steps"] == [tiny_settings(tmp_path).num_steps] * 4
  # Goodput covers the whole run: the buckets of the segment before the checkpoint, from its
  # history, and the resumed run's, as wall_seconds does.
  assert resumed.history["time_accounting"]["window_s"] > 0.3
  for buckets in summary["time_buckets"].values():
    assert sum(buckets.values()) == pytest.approx(summary["wall_seconds"], abs=0.2)


@pytest.mark.slow  # 32 s on CI (two builds); the fault's refusal without checkpoints stays below
def test_with_no_checkpoint_on_disk_yet_nothing_is_damaged_and_the_fault_says_so(tmp_path):
  summary = train.execute(train.build(_settings(tmp_path, "corrupt_checkpoint@second=0")),
                          progress=False)
  [fault] = summary["faults"]
  assert fault["fault"] == "corrupt_checkpoint" and not fault["damaged"]
  assert fault["checkpoint"] is None and fault["why_not"] == "no checkpoint on disk yet"
  assert summary["checkpoints_written"]  # the run went on and wrote its own
  assert train.build(_settings(tmp_path, "")).restored.skipped == []


def test_corrupt_checkpoint_without_checkpoints_is_refused_naming_the_fields(tmp_path):
  with pytest.raises(ValueError, match=r"config\.chaos\.schedule=.*checkpoint\.every_steps=0"):
    tiny_settings(tmp_path, chaos__schedule="corrupt_checkpoint@second=1")
