"""Faults injected into the real runtime and the learners' rejoin (docs/design.md §6).

Each test runs the tiny config for real (learner threads on fake CPU meshes, the syncer) with
faults from `config.chaos` or a failing step hook, and checks an invariant the recovery promises.
"""

import threading
import time

import jax
import numpy as np
import pytest

from conftest import act_when
from conftest import hold_repair
from conftest import tiny_settings
from conftest import wait_until
from decoupled_diloco.runtime.control import slice_watch
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core import pathways
from decoupled_diloco.runtime import train


def _build(tmp_path, schedule="", step_hook=None, **overrides):
  return train.build(tiny_settings(tmp_path, chaos__schedule=schedule, **overrides),
                     step_hook=step_hook)


class _StepLog:
  """A step hook that records (time, learner, incarnation-agnostic step) of every step start."""

  def __init__(self):
    self.events = []
    self._lock = threading.Lock()

  def __call__(self, learner, step):
    with self._lock:
      self.events.append((time.monotonic(), learner, step))


def _record_installed_theta(run):
  """Keeps a copy of every Theta_p the syncer installs, by (fragment, version)."""
  theta, versions = run.syncer.model.received()
  installed = {(p, int(versions[p])): {n: np.array(theta[n]) for n in fragment.names}
               for p, fragment in enumerate(run.fragments)}
  install = run.syncer.model.install

  def recording_install(result, anchored=()):
    version = install(result, anchored)
    installed[result.fragment, version] = {n: np.array(v) for n, v in result.theta.items()}
    return version

  run.syncer.model.install = recording_install
  return installed


def test_a_crashed_learner_rejoins_with_the_syncers_theta_and_a_peers_optimizer_state(tmp_path):
  seen_at_first_step = {}

  def check_first_step(learner, step):
    current = run.learners[learner]
    if learner == 1 and current.incarnation == 1 and "params" not in seen_at_first_step:
      published = current.published
      seen_at_first_step.update(
          params={n: np.asarray(v) for n, v in current.flat_params().items()},
          versions=published.anchor_versions.copy(), step=step)

  run = _build(tmp_path, "crash@learner=1,step=6,down_s=0.5", step_hook=check_first_step,
               learner_step_delays_s=(0.05,) * 4)
  installed = _record_installed_theta(run)
  summary = train.execute(run, progress=False)

  assert summary["rejoins"] == 1 and summary["learner_errors"] == [None] * 4
  assert run.learners[1].incarnation == 1
  [fault] = summary["faults"]
  assert fault["fault"] == "crash" and fault["learner"] == 1 and fault["step"] == 6
  assert fault["restarted"] and fault["state_from"].startswith("learner ")
  assert fault["failed_at_s"] >= fault["at_s"]
  assert fault["repaired_at_s"] >= fault["at_s"] + 0.5
  assert fault["bytes_to_rejoiner"] > 0 and fault["repair_to_first_step_s"] > 0
  # Its parameters at its first step are Theta_p at the versions it is anchored at, every fragment.
  assert seen_at_first_step["step"] == fault["step_after"]
  for p, fragment in enumerate(run.fragments):
    theta = installed[p, int(seen_at_first_step["versions"][p])]
    for name in fragment.names:
      np.testing.assert_array_equal(seen_at_first_step["params"][name], theta[name])
  # It trained on to the end and took part in merges as its new incarnation.
  assert summary["learner_steps"] == [24] * 4
  assert any((1, 1) in zip(r["learners"], r["incarnations"]) for r in run.syncer.tape)
  assert summary["unmerged_steps_at_end"] == [0] * 4 and summary["double_merged_offers"] == 0


def test_a_learner_that_rejoins_at_its_peers_last_step_is_recorded_like_any_rejoin(tmp_path):
  """Learner 1 is down until learner 0 has finished: it rejoins at learner 0's last step and has
  no step left to make. Its rejoin still reaches metrics.jsonl and the tape (a rejoin record used
  to wait for a first step that never came)."""
  run = _build(tmp_path, "crash@learner=1,step=4,down_s=1", num_learners=2,
               learner_mesh_shapes=((2, 1), (2, 1)), tape=True)
  hold_repair(run, run.learners[0].finished_training.is_set)
  summary = train.execute(run, progress=False)
  assert summary["rejoins"] == 1 and summary["learner_steps"] == [24, 24]
  [failure] = summary["failures"]
  assert failure["step_after"] == 24 and failure["repair_to_first_step_s"] is None
  [record] = metrics_lib.read_records(str(tmp_path), "rejoin")
  assert record["step_after"] == 24 and record["learner"] == 1
  with open(tmp_path / "tape.jsonl", encoding="utf-8") as f:
    assert sum('"kind": "rejoin"' in line for line in f) == 1


def _assert_every_token_is_accounted_for(summary):
  tokens = summary["fragment_token_accounting"]
  assert tokens["made"] == (tokens["merged"] + tokens["discarded"] + tokens["lost_at_failures"]
                            + tokens["unmerged_at_end"])
  assert tokens["made"] == summary["tokens_trained"] * summary["num_fragments"]


def test_every_token_is_merged_discarded_lost_or_unmerged(tmp_path):
  run = _build(tmp_path, "crash@learner=2,step=6,down_s=0.2;crash@learner=2,step=15,down_s=0.2;"
                         "crash@learner=0,second=0.8,down_s=0.3",
               learner_step_delays_s=(0.05,) * 4)
  summary = train.execute(run, progress=False)
  assert summary["rejoins"] == 3
  tokens = summary["fragment_token_accounting"]
  assert tokens["lost_at_failures"] > 0 and tokens["discarded"] > 0
  _assert_every_token_is_accounted_for(summary)


def test_a_learner_whose_parameters_go_nan_is_rejected_restarted_and_theta_stays_finite(tmp_path):
  """nan@step=S corrupts the output of learner 1's step S + 1: it publishes that state after step
  S + 1 and learns of it from the loss of step S + 2, then fails (NonFiniteLoss). The hook holds it
  before step S + 2 until the syncer has taken the NaN state and rejected it, so the rejection is
  certain, not a race; without the hold the learner may fail before any round takes that state."""
  S = 8
  failed_at = []

  def hold_until_a_nan_offer_is_rejected(learner, step):
    if learner == 1 and step == S + 2 and run.learners[1].incarnation == 0:
      deadline = time.monotonic() + 20
      while not run.syncer.stats.rejected_offers["nonfinite"] and time.monotonic() < deadline:
        time.sleep(0.01)
      failed_at.append(step)

  run = _build(tmp_path, f"nan@learner=1,step={S}", step_hook=hold_until_a_nan_offer_is_rejected,
               learner_step_delays_s=(0.05,) * 4)
  summary = train.execute(run, progress=False)

  assert [(f["fault"], f["learner"], f["step"]) for f in summary["faults"]] == [("nan", 1, S)]
  [failure] = summary["failures"]
  assert failure["learner"] == 1 and failure["incarnation"] == 0 and failure["restarted"]
  assert "NonFiniteLoss" in failure["error"] and f"step {S + 2} is nan" in failure["error"]
  assert summary["rejoins"] == 1 and summary["learner_errors"] == [None] * 4
  assert failed_at == [S + 2] and summary["learner_steps"] == [24] * 4
  assert summary["rejected_offers"]["nonfinite"] >= 1
  # (Healthy offers may be rejected as outliers early in the warmup, as in the default run.)
  rejected = [r for r in metrics_lib.read_records(str(tmp_path), "rejected")
              if r["reason"] == "nonfinite"]
  assert rejected and all((r["learner"], r["incarnation"], r["step"]) == (1, 0, S + 1)
                          for r in rejected)
  # No merge took a state of learner 1's first incarnation after the corruption.
  for record in run.syncer.tape:
    for learner, incarnation, step in zip(record["learners"], record["incarnations"],
                                          record["learner_steps"]):
      assert (learner, incarnation) != (1, 0) or step <= S
  assert all(np.isfinite(v).all() for v in run.syncer.global_params().values())
  assert np.isfinite(summary["final_eval_loss"])
  assert summary["double_merged_offers"] == 0
  _assert_every_token_is_accounted_for(summary)


@pytest.mark.parametrize("keep", [False, True], ids=["overwrite", "keep_in_flight_progress"])
def test_every_token_is_accounted_for_when_the_syncer_rejects_outliers(tmp_path, keep):
  """A ratio of 1 makes every offer above the median of the accepted norms an outlier: many
  rejections among healthy learners, whose steps the overwrite discards or a later offer carries."""
  run = _build(tmp_path, merge__max_norm_ratio=1.0, merge__keep_in_flight_progress=keep)
  summary = train.execute(run, progress=False)
  assert summary["rejected_offers"]["outlier"] > 0
  assert summary["double_merged_offers"] == 0
  _assert_every_token_is_accounted_for(summary)


def test_a_failure_the_runtime_did_not_inject_is_healed_the_same_way(tmp_path):
  def device_error(learner, step):
    if learner == 0 and step == 5 and run.learners[0].incarnation == 0:
      raise RuntimeError("XlaRuntimeError: INTERNAL: device halted")

  run = _build(tmp_path, step_hook=device_error)
  summary = train.execute(run, progress=False)
  assert summary["faults"] == [] and summary["rejoins"] == 1
  [failure] = summary["failures"]
  assert "device halted" in failure["error"] and failure["state_from"].startswith("learner ")


def test_a_lost_slice_fails_only_its_learner_which_rejoins_once_its_slice_is_back(tmp_path):
  """Under Pathways: the error is pathwaysutils' lost slice, and the slice check the test's."""
  log = _StepLog()
  slice_back = threading.Event()
  came_back = []  # when the test brought the slice back
  checked = []  # the learners whose slices were checked

  def slices_active(m):
    checked.append(m)
    return slice_back.is_set()

  def lose_learner_1s_slice(learner, step):
    log(learner, step)
    if learner == 1 and step == 4 and run.learners[1].incarnation == 0:
      raise jax.errors.JaxRuntimeError(
          "DATA_LOSS: the slice of learner 1's devices went down while its program ran")
    if learner != 1 and step == 4:
      wait_until(lambda: first.failed_at is not None)  # its peers have steps left after the loss
    if learner != 1 and step == 20:
      wait_until(lambda: run.learners[1].incarnation == 1)  # and after it is back

  watch = slice_watch.SliceWatch(pathways.is_lost_slice, slices_active, poll_s=0.01)
  # max_restarts=0: a failure of the learner's own would keep it down for good.
  run = train.build(tiny_settings(tmp_path, max_restarts=0), step_hook=lose_learner_1s_slice,
                    lost_slices=watch)
  first = run.learners[1]
  polls_since_failure = []  # the supervisor's, each ended after it had recorded the failure
  poll = run.supervisor.poll

  def counted_poll():
    restarted = poll()
    if run.supervisor.records:
      polls_since_failure.append(restarted)
    return restarted

  run.supervisor.poll = counted_poll

  def others_stepped_on():  # and the supervisor has seen the failure: it would have rejoined it
    return first.failed_at is not None and len(polls_since_failure) >= 2 and all(
        sum(1 for t, m, _ in log.events if m == other and t > first.failed_at) >= 3
        for other in (0, 2, 3))

  def bring_slice_back():
    came_back.append(time.monotonic())
    still_down.append(run.learners[1] is first and not any(polls_since_failure))
    slice_back.set()

  still_down = []  # whether learner 1 was still its failed incarnation when its slice came back
  bring_back = act_when(others_stepped_on, bring_slice_back)
  summary = train.execute(run, progress=False)
  bring_back.join()
  [failure] = summary["failures"]
  assert failure["learner"] == 1 and "DATA_LOSS" in failure["error"]
  assert failure["cause"] == "lost_slice" and failure["restarted"]
  assert summary["lost_slice_failures"] == 1 and summary["application_failures"] == 0
  assert summary["rejoins"] == 1 and run.learners[1].incarnation == 1
  assert summary["learner_errors"] == [None] * 4 and summary["learner_steps"] == [24] * 4
  assert run.supervisor.restarts == [0] * 4  # nothing counted against max_restarts
  # It waited for its slice, checked only its own, and rejoined once a check found it back.
  assert still_down == [True] and set(checked) == {1}
  assert run.started_at + failure["slice_back_at_s"] >= came_back[0] - 1e-3
  assert failure["repaired_at_s"] >= failure["slice_back_at_s"]
  for other in (0, 2, 3):
    during = [t for t, m, _ in log.events if m == other and first.failed_at < t < came_back[0]]
    assert len(during) >= 3, f"learner {other} must train while learner 1's slice is down"


@pytest.mark.parametrize("error", [
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 2.0G on the device"),
    RuntimeError("a bug in the learner's step path"),
], ids=["JaxRuntimeError", "RuntimeError"])
def test_an_error_of_the_learners_own_fails_it_as_before_under_pathways(tmp_path, error):
  checked = []
  watch = slice_watch.SliceWatch(pathways.is_lost_slice, lambda m: checked.append(m) or True,
                                 poll_s=0.01)

  def fail(learner, step):
    if learner == 1 and step == 4 and run.learners[1].incarnation == 0:
      raise error

  run = train.build(tiny_settings(tmp_path, max_restarts=0), step_hook=fail, lost_slices=watch)
  summary = train.execute(run, progress=False)
  [failure] = summary["failures"]
  assert failure["cause"] == "application" and failure["restarted"] is False  # max_restarts=0
  assert summary["application_failures"] == 1 and summary["lost_slice_failures"] == 0
  assert summary["rejoins"] == 0 and summary["learner_errors"][1] == repr(error)
  assert checked == []  # no slice was waited for
  assert summary["learner_steps"][0] == 24 and np.isfinite(summary["final_eval_loss"])


def test_a_lost_slice_whose_slice_answers_at_once_is_the_learners_own_failure(tmp_path):
  """pathwaysutils reads an INTERNAL error as a lost slice; if the slice answers the first check,
  none was lost, and the failure counts against max_restarts: a learner failing so on its own
  does not rejoin without end."""
  checked = []
  watch = slice_watch.SliceWatch(pathways.is_lost_slice, lambda m: checked.append(m) or True,
                                 poll_s=0.01)

  def fail(learner, step):
    if learner == 1 and step >= 4:  # every incarnation, whatever step it rejoins at
      raise jax.errors.JaxRuntimeError("INTERNAL: a failure of the learner's own program")
    if learner != 1 and step == 20:  # the run lasts until the supervisor has given up on it
      wait_until(lambda: any(r.get("restarted") is False for r in run.supervisor.records))

  run = train.build(tiny_settings(tmp_path, max_restarts=1), step_hook=fail, lost_slices=watch)
  summary = train.execute(run, progress=False)
  first, second = summary["failures"]
  assert pathways.is_lost_slice(jax.errors.JaxRuntimeError("INTERNAL: x"))  # as pathwaysutils reads it
  assert (first["cause"], first["slices_answered_at_once"], first["restarted"]) == (
      "application", True, True)
  assert (second["cause"], second["restarted"]) == ("application", False)  # max_restarts=1
  assert summary["application_failures"] == 2 and summary["lost_slice_failures"] == 0
  assert checked == [1, 1] and run.supervisor.restarts[1] == 1


def test_a_learner_failing_more_than_max_restarts_stays_down_and_the_run_goes_on(tmp_path):
  given_up = lambda: any(not r.get("restarted", True) for r in run.supervisor.records)  # noqa: E731

  def always_fails(learner, step):
    if learner == 2 and step >= 6:
      raise RuntimeError("broken slice")
    if step == 20:
      # The others stop short of the end until learner 2 has failed a third time: a rejoin at
      # their last step would have no step left in which to fail.
      wait_until(given_up)

  run = _build(tmp_path, step_hook=always_fails, max_restarts=2)
  summary = train.execute(run, progress=False)
  assert [f["restarted"] for f in summary["failures"]] == [True, True, False]
  assert summary["rejoins"] == 2 and "broken slice" in summary["learner_errors"][2]
  assert summary["learner_steps"][0] == 24 and np.isfinite(summary["final_eval_loss"])


def test_the_others_keep_stepping_while_a_learner_is_down_and_the_rejoin_compiles_nothing(
    tmp_path):
  log = _StepLog()
  run = _build(tmp_path, "crash@learner=1,step=6,down_s=0.5", step_hook=log,
               learner_step_delays_s=(0.05,) * 4)
  # Down until each of the others has started 3 steps since learner 1 failed (a minute at most).
  failed_at = []

  def others_stepped_on():
    if run.learners[1].failed_at is None:
      return False
    if not failed_at:
      failed_at.append(run.learners[1].failed_at)
    return all(sum(1 for t, m, _ in log.events if m == other and t > failed_at[0]) >= 3
               for other in (0, 2, 3))

  hold_repair(run, others_stepped_on)
  train_step = run.learners[1]._train_step
  compiled_before = train_step._cache_size()
  summary = train.execute(run, progress=False)
  [fault] = summary["faults"]
  repaired = run.started_at + fault["repaired_at_s"]
  for other in (0, 2, 3):
    during = [t for t, m, _ in log.events if m == other and failed_at[0] < t < repaired]
    assert len(during) >= 3, f"learner {other} must train while learner 1 is down"
  assert train_step._cache_size() == compiled_before


def test_hang_and_slow_faults_stretch_that_learners_steps_only(tmp_path):
  # Learner 3 is slow for the rest of the run, so that its slow steps and learner 0's normal ones
  # are compared over the same stretch of the run, whatever the host's load.
  run = _build(tmp_path, "hang@learner=2,step=5,seconds=3;slow@learner=3,step=5,factor=4,"
                         "seconds=600", learner_step_delays_s=(0.05,) * 4)
  summary = train.execute(run, progress=False)
  assert sorted(f["fault"] for f in summary["faults"]) == ["hang", "slow"]
  hung_learner, normal_learner, slow_learner = run.learners[2], run.learners[0], run.learners[3]
  longest = int(np.argmax(hung_learner.step_times))
  hung = hung_learner.step_times[longest]
  assert hung >= 3.0
  # Learner 0 completed steps while learner 2 hung (its own log of step ends).
  hang = (hung_learner.step_ends[longest] - hung, hung_learner.step_ends[longest])
  assert sum(hang[0] < t < hang[1] for t in normal_learner.step_ends) >= 2, hang
  # Each slow step sleeps 3 times its own time after it: about 4x learner 0's steps.
  slow = np.median(slow_learner.step_times[6:])
  normal = np.median(normal_learner.step_times[6:])
  assert slow > 2 * normal, (slow, normal)
  assert summary["rejoins"] == 0 and summary["learner_steps"] == [24] * 4


@pytest.mark.parametrize("overrides, message", [
    ({"chaos__schedule": "crash@learner=7,step=1,down_s=1"}, "learner=7 is out of range"),
    ({"chaos__schedule": "syncer_crash@second=1,down_s=1", "mode": "dp"},
     "dp mode has no syncer"),
    ({"chaos__schedule": "syncer_crash@second=1,down_s=1", "mode": "streaming"},
     "need config.mode='decoupled'"),
    ({"chaos__schedule": "partition@learner=1,second=1,seconds=1", "mode": "diloco"},
     "partition faults cut the link"),
    ({"chaos__repair_shape": 0.0}, "config.chaos.repair_shape"),
    ({"max_restarts": -1}, "config.max_restarts"),
])
def test_bad_chaos_settings_are_refused_at_start_up(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    tiny_settings(tmp_path, **overrides)


def test_a_failure_is_noticed_and_healed_while_the_controller_is_busy_evaluating(tmp_path):
  run = _build(tmp_path, "crash@learner=1,step=6,down_s=0.2", eval_every=4,
               learner_step_delays_s=(0.05,) * 4)
  evaluate = run.evaluator
  healed_during_eval = []

  def slow_first_eval(params, _calls=[]):  # pylint: disable=dangerous-default-value
    _calls.append(1)
    if len(_calls) == 1:
      # An eval at real size takes seconds; learners keep training meanwhile. This one lasts until
      # learner 1 has failed and made its first step again (a minute at most).
      healed_during_eval.append(wait_until(
          lambda: run.learners[1].incarnation == 1 and run.learners[1].steps_made > 0))
    return evaluate(params)

  run.evaluator = slow_first_eval
  summary = train.execute(run, progress=False)
  [fault] = summary["faults"]
  assert fault["restarted"] and healed_during_eval == [True]


def test_a_late_learner_joins_mid_run_from_a_peer_and_theta(tmp_path):
  """config.late_learners: learner 3 is held back (not started, not in any round) until its join
  second, then starts from a peer's state and Theta, like a rejoin; nothing is counted twice."""
  joined_at = {}

  def first_step(learner, step):
    if learner == 3 and not joined_at:
      current = run.learners[3]
      joined_at.update(step=step, params={n: np.asarray(v) for n, v in
                                          current.flat_params().items()},
                       versions=current.published.anchor_versions.copy())

  run = _build(tmp_path, "join@learner=3,second=0.5", step_hook=first_step,
               late_learners=(3,), learner_step_delays_s=(0.05,) * 4)
  installed = _record_installed_theta(run)
  summary = train.execute(run, progress=False)
  assert summary["joins"] == 1 and summary["rejoins"] == 0 and summary["failures"] == []
  [join] = summary["faults"]
  assert join["fault"] == "join" and join["learner"] == 3 and join["second"] == 0.5
  assert join["joined_at_s"] >= 0.5 and join["state_from"].startswith("learner ")
  assert join["step"] == join["step_after"] == joined_at["step"] > 1
  assert join["bytes_to_rejoiner"] > 0 and join["repair_to_first_step_s"] > 0
  for p, fragment in enumerate(run.fragments):
    theta = installed[p, int(joined_at["versions"][p])]
    for name in fragment.names:
      np.testing.assert_array_equal(joined_at["params"][name], theta[name])
  # No round before the join took learner 3; after it, merges take its steps.
  merged_3 = [r for r in run.syncer.tape if 3 in r["learners"]]
  assert merged_3 and all(r["incarnations"][r["learners"].index(3)] == 1 for r in merged_3)
  assert summary["learner_steps"] == [24] * 4
  assert summary["tokens_trained"] == (3 * 24 + 24 - join["step_after"]) * (
      run.settings.learner_batch_size * run.settings.data.seq_len)
  assert summary["unmerged_steps_at_end"] == [0] * 4 and summary["double_merged_offers"] == 0
  _assert_every_token_is_accounted_for(summary)


@pytest.mark.parametrize("overrides, message", [
    ({"late_learners": (3,)}, "needs exactly one join@learner=3"),
    ({"chaos__schedule": "join@learner=2,second=1"}, "not in config.late_learners"),
    ({"late_learners": (0, 1, 2, 3), "chaos__schedule": ";".join(
        f"join@learner={m},second=1" for m in range(4))}, "must leave at least one"),
    ({"late_learners": (4,)}, r"config.late_learners=\(4,\) is invalid"),
    ({"late_learners": (1,), "chaos__schedule": "join@learner=1,second=1", "mode": "diloco"},
     "config.mode='decoupled' only"),
])
def test_bad_late_learners_are_refused_at_start_up(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    tiny_settings(tmp_path, **overrides)
