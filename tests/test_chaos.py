"""The fault schedule and random crashes (config.chaos): parsing, errors that name the event, draws."""

import math

import numpy as np
import pytest

from decoupled_diloco import chaos


def test_every_kind_parses_with_its_keys():
  faults = chaos.parse_schedule(
      "crash@learner=1,step=100,down_s=5; hang@learner=0,step=7,seconds=2.5;"
      "slow@learner=2,second=3,factor=4,seconds=10;partition@learner=3,step=1,seconds=1;"
      "nan@learner=0,step=50;join@learner=3,second=20;syncer_crash@second=30,down_s=3;"
      "corrupt_checkpoint@second=40", num_learners=4)
  assert [f.kind for f in faults] == ["crash", "hang", "slow", "partition", "nan", "join",
                                      "syncer_crash", "corrupt_checkpoint"]
  crash, hang, slow, _, nan, join, syncer, corrupt = faults
  assert (crash.learner, crash.step, crash.second, crash.down_s) == (1, 100, None, 5.0)
  assert (hang.seconds, slow.factor, slow.second, slow.step) == (2.5, 4.0, 3.0, None)
  assert (nan.learner, nan.step, join.second) == (0, 50, 20.0)
  assert (syncer.learner, syncer.second, syncer.down_s, corrupt.second) == (None, 30.0, 3.0, 40.0)
  assert crash.source == "crash@learner=1,step=100,down_s=5"


def test_a_node_loss_names_a_learner_or_the_syncer():
  learner, syncer = chaos.parse_schedule("node_loss@learner=2,step=9; node_loss@syncer,second=4",
                                         num_learners=4)
  assert (learner.kind, learner.learner, learner.step, learner.second) == ("node_loss", 2, 9, None)
  assert (syncer.kind, syncer.learner, syncer.step, syncer.second) == ("node_loss", None, None, 4.0)


def test_a_syncer_crash_names_a_shard_or_crashes_every_shard():
  one, every, host = chaos.parse_schedule(
      "syncer_crash@shard=1,second=3,down_s=2;syncer_crash@second=4,down_s=1;"
      "node_loss@syncer,shard=0,second=5", num_learners=4)
  assert (one.kind, one.shard, one.second, one.down_s) == ("syncer_crash", 1, 3.0, 2.0)
  assert every.shard is None  # as before shards existed: the whole syncer's state is lost
  assert (host.kind, host.shard, host.learner) == ("node_loss", 0, None)
  chaos.check_shards((one, every, host), num_shards=2)
  with pytest.raises(ValueError, match=r"event 0 \('syncer_crash@shard=1,second=3,down_s=2'\): "
                     r"shard=1 is out of range: config.syncer.num_shards=1 has shard\(s\) 0..0"):
    chaos.check_shards((one, every, host), num_shards=1)


def test_an_empty_schedule_has_no_faults():
  assert chaos.parse_schedule("", 2) == ()
  assert chaos.parse_schedule("  ", 2) == ()


@pytest.mark.parametrize("text, message", [
    ("explode@learner=0,step=1", "unknown kind 'explode'; known kinds: crash, hang"),
    ("crash", "needs keys after '@'"),
    ("crash@learner=0,step=1", "crash needs down_s"),
    ("crash@step=1,down_s=1", "crash needs learner"),
    ("crash@learner=4,step=1,down_s=1", "learner=4 is out of range: the run has learners 0..3"),
    ("crash@learner=-1,step=1,down_s=1", "learner=-1 must be >= 0"),
    ("crash@learner=0,step=-5,down_s=1", "step=-5 must be >= 0"),
    ("crash@learner=0,step=1.5,down_s=1", "step='1.5' must be an integer"),
    ("crash@learner=0,step=1,down_s=soon", "down_s='soon' must be a number"),
    ("crash@learner=0,down_s=1", "one of step= or second="),
    ("crash@learner=0,step=1,second=2,down_s=1", "one of step= or second="),
    ("crash@learner=0,step=1,down_s=1,color=red", "crash takes no key 'color'"),
    ("crash@learner=0,learner=1,step=1,down_s=1", "learner is given twice"),
    ("crash@learner=0,step", "'step' is not key=value"),
    ("hang@learner=0,step=1,seconds=0", "seconds=0 must be > 0"),
    ("slow@learner=0,step=1,factor=0.5,seconds=1", "factor=0.5 must be >= 1"),
    ("join@learner=0,step=3", "join takes no key 'step'"),
    ("syncer_crash@learner=0,second=1,down_s=1", "syncer_crash takes no key 'learner'"),
    ("syncer_crash@down_s=1", "syncer_crash needs second="),
    ("syncer_crash@shard=-1,second=1,down_s=1", "shard=-1 must be >= 0"),
    ("syncer_crash@shard=x,second=1,down_s=1", "shard='x' must be an integer"),
    ("crash@learner=0,shard=1,step=1,down_s=1", "crash takes no key 'shard'"),
    ("corrupt_checkpoint@second=inf", "second=inf must be >= 0"),
    ("node_loss@step=3", "node_loss needs learner= (or syncer)"),
    ("node_loss@syncer", "node_loss@syncer needs second="),
    ("node_loss@syncer,step=3", "node_loss takes no key 'step'; it takes second, shard (or "
                                "node_loss@syncer,second=T)"),
    ("node_loss@learner=0,step=1,down_s=2", "node_loss takes no key 'down_s'"),
])
def test_a_bad_event_is_named_with_what_is_wrong(text, message):
  with pytest.raises(ValueError) as err:
    chaos.parse_schedule(f"nan@learner=0,step=1;{text}", num_learners=4)
  assert str(err.value).startswith(f"config.chaos.schedule event 1 ({text!r}): ")
  assert message in str(err.value)


def test_a_stray_separator_is_an_error():
  with pytest.raises(ValueError, match="event 1 is empty"):
    chaos.parse_schedule("nan@learner=0,step=1;;nan@learner=1,step=1", 2)


def test_a_trailing_separator_is_an_error_not_a_silent_no_op():
  with pytest.raises(ValueError, match="event 1 is empty"):
    chaos.parse_schedule("nan@learner=0,step=1;", 2)


def test_a_fault_fires_at_its_step_or_time():
  by_step = chaos.Fault("crash", learner=0, step=10, down_s=1)
  by_time = chaos.Fault("crash", learner=0, second=2.0, down_s=1)
  assert [by_step.due(s, 99.0) for s in (9, 10, 11)] == [False, True, True]
  assert [by_time.due(99, t) for t in (1.9, 2.0)] == [False, True]


def test_joins_must_match_the_late_learners():
  joins = chaos.parse_schedule("join@learner=2,second=5", 3)
  chaos.check_joins(joins, late_learners=(2,))
  with pytest.raises(ValueError, match=r"learner 2 is not in config.late_learners=\(\)"):
    chaos.check_joins(joins, late_learners=())
  with pytest.raises(ValueError, match="needs exactly one join@learner=1"):
    chaos.check_joins(joins, late_learners=(1, 2))


def test_random_crashes_depend_only_on_seed_and_learner():
  plan = chaos.RandomCrashes(mtbf_s=10.0, repair_s=2.0, repair_shape=0.85, seed=3)
  first = [next(iter(plan.crashes(1))) for _ in range(2)]
  assert first[0] == first[1]
  other_seed = chaos.RandomCrashes(10.0, 2.0, 0.85, seed=4)
  assert next(other_seed.crashes(1)) != first[0]
  assert next(plan.crashes(0)) != first[0]


def test_random_crashes_have_the_configured_means_and_never_overlap():
  plan = chaos.RandomCrashes(mtbf_s=10.0, repair_s=2.0, repair_shape=0.85, seed=0)
  crashes = plan.crashes(0)
  faults = [next(crashes) for _ in range(20_000)]
  downs = np.array([f.down_s for f in faults])
  starts = np.array([f.second for f in faults])
  ups = starts[1:] - (starts[:-1] + downs[:-1])  # time from a repair to the next failure
  assert np.all(ups > 0)
  assert math.isclose(ups.mean(), 10.0, rel_tol=0.03)
  assert math.isclose(downs.mean(), 2.0, rel_tol=0.03)
  assert all(f.kind == "crash" and f.source == "random" for f in faults)


def test_a_share_of_the_random_faults_are_node_losses_at_the_same_times():
  def draws(fraction):
    faults = chaos.RandomCrashes(10.0, 2.0, 0.85, seed=5, node_loss_fraction=fraction).crashes(1)
    return [next(faults) for _ in range(2000)]

  crashes, half, all_lost = draws(0.0), draws(0.5), draws(1.0)
  assert [f.second for f in crashes] == [f.second for f in half] == [f.second for f in all_lost]
  assert {f.kind for f in crashes} == {"crash"} and {f.kind for f in all_lost} == {"node_loss"}
  share = sum(f.kind == "node_loss" for f in half) / len(half)
  assert 0.45 < share < 0.55
  assert all(f.down_s == 0.0 for f in half if f.kind == "node_loss")


def test_random_mode_is_off_at_mtbf_zero():
  assert list(chaos.RandomCrashes(0.0, 2.0, 0.85, seed=0).crashes(0)) == []


@pytest.mark.parametrize("kwargs, field", [
    ({"mtbf_s": -1.0}, "config.chaos.mtbf_s"),
    ({"repair_s": "x"}, "config.chaos.repair_s"),
    ({"repair_shape": 0.0}, "config.chaos.repair_shape"),
    ({"node_loss_fraction": 1.5}, "config.chaos.node_loss_fraction"),
])
def test_bad_random_settings_name_the_field(kwargs, field):
  args = {"mtbf_s": 10.0, "repair_s": 1.0, "repair_shape": 1.0, "seed": 0, **kwargs}
  with pytest.raises(ValueError, match=field):
    chaos.RandomCrashes(**args)
