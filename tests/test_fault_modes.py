"""The same faults in dp and lock-step modes, with their real consequence (docs/failures.md).

dp: a crash stops the whole job, which restarts from its newest checkpoint; the steps after it are
lost and counted. diloco: every learner waits at the next barrier for the failed one, or, with
config.sync.elastic_lock_step, the barrier drops it until it is back.
"""

import time

import pytest

from conftest import hold_repair
from conftest import tiny_settings
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime import train

TOKENS_PER_STEP = 4 * 4 * 32  # dp: batch_size x num_learners sequences of seq_len


def _dp(tmp_path, schedule, **overrides):
  settings = tiny_settings(tmp_path, mode="dp", chaos__schedule=schedule, **overrides)
  return train.execute(train.build(settings), progress=False)


def test_a_dp_crash_restarts_the_job_from_its_newest_checkpoint_and_counts_the_lost_steps(
    tmp_path):
  # learner=2: in dp mode its devices are part of the one job, which they stop.
  summary = _dp(tmp_path, "crash@learner=2,step=14,down_s=0.3", checkpoint__every_steps=6)
  [fault] = summary["faults"]
  assert fault["fault"] == "crash" and fault["step"] == 14 and fault["restarted"]
  checkpoint = fault["restored_step"]
  assert 6 <= checkpoint < 14 and fault["restored_from"].endswith(f"job/{checkpoint}")
  assert fault["steps_lost"] == 14 - checkpoint
  assert fault["repaired_at_s"] >= fault["at_s"] + 0.3  # the repair counts from the fault
  assert fault["restart_s"] > 0 and fault["back_at_s"] >= fault["repaired_at_s"] + fault["restart_s"]
  assert summary["job_restarts"] == 1 and summary["steps_lost_at_restarts"] == 14 - checkpoint
  # Trained = in the final model + lost, each step counted once.
  assert summary["learner_steps"] == [24]
  assert summary["tokens_trained"] == (24 + 14 - checkpoint) * TOKENS_PER_STEP
  assert summary["tokens_lost_at_restarts"] == (14 - checkpoint) * TOKENS_PER_STEP
  [restart] = metrics_lib.read_records(str(tmp_path), "job_restart")
  assert restart["steps_lost"] == 14 - checkpoint


def test_a_dp_crash_before_any_checkpoint_restarts_from_the_initial_state(tmp_path):
  summary = _dp(tmp_path, "crash@learner=0,step=5,down_s=0.1")
  [fault] = summary["faults"]
  assert fault["restored_from"] == "initial state" and fault["restored_step"] == 0
  assert fault["steps_lost"] == 5 and summary["learner_steps"] == [24]
  assert summary["tokens_trained"] == (24 + 5) * TOKENS_PER_STEP


def _diloco(tmp_path, elastic, merge_s=0.0, hold_repair_until=None):
  """A lock-step run whose learner 1 crashes at step 6, down 1.5 s; with `hold_repair_until(run)`,
  down until that holds too (conftest.hold_repair)."""
  settings = tiny_settings(tmp_path, mode="diloco", sync__elastic_lock_step=elastic,
                           learner_step_delays_s=(0.1,) * 4,
                           chaos__schedule="crash@learner=1,step=6,down_s=1.5")
  run = train.build(settings)
  if merge_s:
    merge = run.syncer.model.merge

    def slow_merge(*args, **kwargs):
      time.sleep(merge_s)  # merges slower than a step: a learner that did not wait would step on
      return merge(*args, **kwargs)

    run.syncer.model.merge = slow_merge
  if hold_repair_until is not None:
    hold_repair(run, lambda: hold_repair_until(run))
  return run, train.execute(run, progress=False)


def _step_9_ended(learner):
  """When `learner`'s step 9 completed (time.monotonic()): after it had crossed the barrier of
  step 8, which a lock-step learner waits at before it starts step 9."""
  return learner.step_ends[8]


def test_in_diloco_every_learner_waits_at_the_barrier_for_the_failed_one(tmp_path):
  run, summary = _diloco(tmp_path, elastic=False, merge_s=0.3)
  assert summary["rejoins"] == 1 and summary["learner_steps"] == [24] * 4
  [fault] = summary["faults"]
  # No peer crossed the barrier of step 8 before learner 1's devices came back (fault records
  # count their seconds from the run's start).
  repaired = run.started_at + fault["repaired_at_s"]
  assert all(_step_9_ended(run.learners[m]) > repaired for m in (0, 2, 3)), fault
  waits = summary["barrier_wait_seconds"]
  # Goodput counts those waits as idle, not as training.
  buckets = summary["time_buckets"]
  assert all(buckets[str(m)]["idle"] >= 0.95 * waits[m] for m in (0, 2, 3)), (buckets, waits)
  # Every round merged every learner present: the one at step 8 waited for learner 1's rejoin
  # (which had lost its steps since step 4), the later ones took its new incarnation in.
  assert [r["learners"] for r in run.syncer.tape if r["clock"] == 8] == [[0, 2, 3]]
  assert all(1 in r["learners"] for r in run.syncer.tape if r["clock"] > 8)
  assert fault["step_after"] == 8
  # The rejoiner starts at the barrier its peers wait at: every round takes every learner's
  # offer at the round's own step, none a round ahead.
  assert all(set(r["learner_steps"]) == {r["clock"]} for r in run.syncer.tape if not r["final"])
  assert summary["double_merged_offers"] == 0
  # And goes on from the Theta that round made, as its peers do: no step of it is overwritten.
  assert summary["discarded_progress"] == [0.0] * 4


def test_with_elastic_lock_step_the_barrier_drops_the_failed_learner(tmp_path):
  # Learner 1 stays down until its peers have passed two barriers without it (or a minute went
  # by, as it would without elasticity: the peers would wait at step 8 for it).
  run, summary = _diloco(tmp_path, elastic=True, hold_repair_until=lambda run: all(
      run.learners[m].step >= 12 for m in (0, 2, 3)))
  assert summary["rejoins"] == 1 and summary["learner_steps"] == [24] * 4
  [fault] = summary["faults"]
  # Rounds went on without learner 1 while it was down, and took it back once it had rejoined.
  assert [r["learners"] for r in run.syncer.tape if r["clock"] == 8] == [[0, 2, 3]]
  assert any((1, 1) in zip(r["learners"], r["incarnations"]) for r in run.syncer.tape)
  # Its peers crossed the barrier of step 8 before it was back, and it rejoined where they were.
  repaired = run.started_at + fault["repaired_at_s"]
  assert all(_step_9_ended(run.learners[m]) < repaired for m in (0, 2, 3)), fault
  assert fault["step_after"] >= 12
  assert summary["double_merged_offers"] == 0


def test_a_long_repair_does_not_time_out_the_learners_waiting_at_the_barrier(tmp_path):
  """stall_timeout_s below the repair: the wait is legitimate, not a stall. The timeout is well
  above a step on a loaded host (at 1 s, all four learners once took longer over an ordinary
  step with both cores busy) and the repair more than twice the timeout."""
  settings = tiny_settings(tmp_path, mode="diloco", stall_timeout_s=3.0,
                           learner_step_delays_s=(0.02,) * 4,
                           chaos__schedule="crash@learner=1,step=6,down_s=6.5")
  summary = train.execute(train.build(settings), progress=False)
  assert summary["learner_errors"] == [None] * 4 and summary["learner_steps"] == [24] * 4


@pytest.mark.parametrize("mode", ["dp", "diloco"])
def test_syncer_crash_is_refused_outside_decoupled_mode_naming_the_field(tmp_path, mode):
  with pytest.raises(ValueError, match=r"config\.chaos\.schedule=.*syncer_crash.*decoupled"):
    tiny_settings(tmp_path, mode=mode, chaos__schedule="syncer_crash@second=1,down_s=1")


def test_elastic_lock_step_is_validated():
  from decoupled_diloco import settings as settings_lib  # pylint: disable=g-import-not-at-top
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top
  config = tiny_cpu.get_config()
  config.sync.elastic_lock_step = None  # a config file may set anything, not only a bool
  with pytest.raises(ValueError, match=r"config\.sync\.elastic_lock_step=None is invalid"):
    settings_lib.validate(config)


def test_dp_takes_every_learners_faults_and_fails_as_often_as_all_their_devices(tmp_path):
  settings = tiny_settings(tmp_path, mode="dp", chaos__mtbf_s=40.0,
                           chaos__schedule="crash@learner=3,step=5,down_s=1")
  assert [f.learner for f in settings.chaos.faults] == [0]
  assert settings.chaos.mtbf_s == 40.0 and settings.chaos.random_crashes.mtbf_s == 10.0
