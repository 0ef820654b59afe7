"""Whole-job checkpoints: a stopped run resumes where its checkpoint was cut and finishes the same
run; damaged checkpoints are skipped; a checkpoint of another experiment is refused."""

import json
import os
import signal
import time

import pytest

from decoupled_diloco.runtime.records import checkpoints
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime import train
from tests.conftest import tiny_settings
from tests.conftest import wait_until

EVERY = 8


def _settings(workdir, **overrides):
  return tiny_settings(workdir, **{"checkpoint__every_steps": EVERY, **overrides})


def _sigterm_at(step):
  """A step hook that sends this process SIGTERM before learner 0's step `step` (once)."""
  sent = []

  def hook(learner, at):
    if learner == 0 and at == step and not sent:
      sent.append(at)
      os.kill(os.getpid(), signal.SIGTERM)

  return hook


def _interrupted_then_resumed(workdir, stop_at, **overrides):
  run = train.build(_settings(workdir, **overrides), step_hook=_sigterm_at(stop_at))
  with pytest.raises(train.Interrupted, match="checkpoint written to") as stopped:
    train.execute(run, progress=False)
  assert stopped.value.signum == signal.SIGTERM
  resumed = train.build(_settings(workdir, **overrides))
  assert resumed.restored is not None
  cut_at = resumed.restored.cut.clock
  # It resumes from the checkpoint the stop wrote (its cut one or two steps around the stop).
  assert str(stopped.value).split("checkpoint written to ")[1].split(":")[0] == (
      resumed.restored.path)
  assert stop_at - 2 <= cut_at < resumed.settings.num_steps
  return train.execute(resumed, progress=False), cut_at


def test_a_dp_run_stopped_by_sigterm_resumes_to_the_same_model(tmp_path):
  """dp is deterministic: train state, optimizer state and data position all come back exactly,
  so the resumed run ends bit for bit where the uninterrupted one does."""
  whole = train.execute(train.build(_settings(tmp_path / "whole", mode="dp")), progress=False)
  resumed, cut_at = _interrupted_then_resumed(tmp_path / "stopped", 10, mode="dp")
  assert resumed["final_eval_loss"] == whole["final_eval_loss"]
  assert resumed["tokens_trained"] == whole["tokens_trained"]
  assert resumed["learner_steps"] == whole["learner_steps"]
  assert [r["clock"] for r in resumed["resumes"]] == [cut_at]
  # metrics.jsonl goes on: the stopped run's records, then the resumed run's, whose times go on
  # from the cut's.
  records = metrics_lib.read_records(str(tmp_path / "stopped"))
  steps = [r["step"] for r in records if r["kind"] == "learner"]
  assert 1 in steps and steps[-1] == whole["learner_steps"][0]
  [cut] = [r for r in records if r["kind"] == "checkpoint" and r["clock"] == cut_at]
  assert records[-1]["kind"] == "eval" and records[-1]["time_s"] > cut["time_s"]


# Step delays keep the learners from finishing the 24 steps before the stop's cut is taken.
_SLOW = {"learner_step_delays_s": (0.03,) * 4}


def test_a_decoupled_run_resumes_without_merging_or_counting_any_step_twice(tmp_path):
  summary, _ = _interrupted_then_resumed(tmp_path, 10, **_SLOW)
  num_steps = tiny_settings(tmp_path).num_steps
  assert summary["learner_steps"] == [num_steps] * 4
  assert summary["tokens_trained"] == num_steps * 4 * 4 * 32  # steps x learners x batch x seq
  assert summary["double_merged_offers"] == 0
  assert summary["unmerged_steps_at_end"] == [0] * 4
  tokens = summary["fragment_token_accounting"]
  assert tokens["made"] == tokens["merged"] + tokens["discarded"] + tokens["unmerged_at_end"]
  assert tokens["made"] == summary["tokens_trained"] * summary["num_fragments"]


def test_a_resumed_lock_step_run_finishes(tmp_path):
  summary, _ = _interrupted_then_resumed(tmp_path, 10, mode="diloco", **_SLOW)
  assert summary["learner_steps"] == [tiny_settings(tmp_path).num_steps] * 4
  assert summary["double_merged_offers"] == 0


def _flip_bytes(directory):
  """Flips bytes in the largest file under `directory` (a damaged disk or a torn write)."""
  files = [os.path.join(root, f) for root, _, names in os.walk(directory) for f in names]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    data = bytearray(f.read())
    for i in range(len(data) // 2, len(data) // 2 + 64):
      data[i] ^= 0xFF
    f.seek(0)
    f.write(data)
  return largest


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path):
  first = train.execute(train.build(_settings(tmp_path, mode="dp")), progress=False)
  numbers = [c["number"] for c in first["checkpoints_written"]]
  assert len(numbers) >= 2 and numbers[-1] == first["learner_steps"][0]
  _flip_bytes(os.path.join(tmp_path, "checkpoints", "job", str(numbers[-1]), "arrays"))
  run = train.build(_settings(tmp_path, mode="dp"))
  assert run.restored.cut.clock == numbers[-2]
  [skipped] = run.restored.skipped
  assert skipped["number"] == numbers[-1] and skipped["reason"]
  summary = train.execute(run, progress=False)
  assert summary["resumes"][-1]["skipped"][0]["number"] == numbers[-1]
  assert summary["tokens_trained"] == first["tokens_trained"]


def test_a_dp_checkpoint_holds_the_step_it_was_due_at_not_the_one_before(tmp_path):
  # The learner pauses before step EVERY + 1: the controller sees the clock at EVERY while the
  # learner's newest publication (one step behind its clock) is still of step EVERY - 1. Then it
  # holds before step EVERY + 2, its newest publication of step EVERY, until the first checkpoint
  # is written: that one must be of step EVERY, never the one before.
  def pause(learner, at):
    del learner
    if at == EVERY:
      time.sleep(0.5)
    if at == EVERY + 1:
      wait_until(lambda: run.checkpoints.saved)

  run = train.build(_settings(tmp_path, mode="dp"), step_hook=pause)
  summary = train.execute(run, progress=False)
  numbers = [c["number"] for c in summary["checkpoints_written"]]
  assert numbers[0] == EVERY and numbers[-1] == run.settings.num_steps, numbers


def test_a_checkpoint_of_another_experiment_is_refused_naming_the_field(tmp_path):
  train.execute(train.build(_settings(tmp_path, mode="dp")), progress=False)
  with pytest.raises(checkpoints.CheckpointError, match=r"config\.model\.mlp_dim=64 there, 128"):
    train.build(_settings(tmp_path, mode="dp", model__mlp_dim=128))
  with pytest.raises(checkpoints.CheckpointError, match="restore='none' but"):
    train.build(_settings(tmp_path, mode="dp", restore="none"))


def test_a_checkpoint_written_before_a_field_existed_is_of_the_same_experiment(tmp_path):
  """A checkpoint's fingerprint without a field added since reads as that field's value before it
  existed (settings.ADDED_FIELDS): a run upgraded mid-way resumes; another value is refused."""
  settings = _settings(tmp_path)
  here = checkpoints.fingerprint(settings)
  saver = checkpoints.Checkpoints(str(tmp_path / "ckpt"), None, here)
  older = {k: v for k, v in here.items() if k != "ray.tpu_slice"}
  saver._check_fingerprint({"fingerprint": older}, "older")  # pylint: disable=protected-access
  with pytest.raises(checkpoints.CheckpointError, match=r"config\.ray\.tpu_slice='v5p:2x2x2' there"):
    saver._check_fingerprint({"fingerprint": {**older, "ray.tpu_slice": "'v5p:2x2x2'"}},  # pylint: disable=protected-access
                             "other")


def test_restore_latest_without_a_checkpoint_fails_before_building(tmp_path):
  with pytest.raises(checkpoints.CheckpointError, match="no checkpoint in"):
    train.build(_settings(tmp_path, restore="latest"))


def test_a_missing_restore_path_is_a_config_error(tmp_path):
  with pytest.raises(ValueError, match=r"config\.restore=.*no such checkpoint directory"):
    _settings(tmp_path, restore=str(tmp_path / "nowhere"))


def test_checkpoint_settings_are_validated(tmp_path):
  with pytest.raises(ValueError, match=r"config\.checkpoint\.keep=0"):
    _settings(tmp_path, checkpoint__keep=0)
  with pytest.raises(ValueError, match=r"config\.checkpoint\.every_steps=-1"):
    _settings(tmp_path, checkpoint__every_steps=-1)
  with pytest.raises(ValueError, match=r"config\.restore=''"):
    _settings(tmp_path, restore="")


def test_a_relative_workdir_gets_its_checkpoints_written_and_resumed(tmp_path, monkeypatch):
  """orbax takes absolute paths only; the default workdir (workdir/tiny_cpu) is relative."""
  monkeypatch.chdir(tmp_path)
  first = train.execute(train.build(_settings("relative", mode="dp")), progress=False)
  assert first["checkpoints_written"]
  assert os.path.isdir(tmp_path / "relative" / "checkpoints" / "job" / str(first["learner_steps"][0]))
  run = train.build(_settings("relative", mode="dp"))
  assert run.restored.cut.clock == first["learner_steps"][0]
  run.metrics.close()


def test_a_checkpoint_path_resumes_from_that_checkpoint(tmp_path):
  first = train.execute(train.build(_settings(tmp_path / "a", mode="dp")), progress=False)
  older = first["checkpoints_written"][-2]
  run = train.build(_settings(tmp_path / "b", mode="dp", restore=older["path"]))
  assert run.restored.cut.clock == older["number"]
  summary = train.execute(run, progress=False)
  assert summary["final_eval_loss"] == first["final_eval_loss"]
  with open(os.path.join(tmp_path, "b", "summary.json"), encoding="utf-8") as f:
    assert json.load(f)["resumes"][0]["from"] == older["path"]
