"""Several learners on one device (config.devices.learners_sharing_devices): turns, meshes, runs.

The runs are tiny (tests/conftest.py's tiny_settings): four learners on one fake CPU device train
and merge as four on four devices do, the identity outer step with one learner still tracks dp on
a device it shares with an idle second learner, and a sharing learner that fails stops nobody.
"""

import threading

import jax
import numpy as np
import pytest

from conftest import tiny_settings
from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import receive as receive_lib
from decoupled_diloco.lm import data as data_lib
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.lm import tokenizers
from decoupled_diloco.runtime.core import device_share
from decoupled_diloco.runtime.core import devices
from decoupled_diloco.runtime import train

_SHARED = dict(learner_mesh_shapes=((1, 1),), devices__learners_sharing_devices=4)


# ---- turns -----------------------------------------------------------------------------------


def test_turns_go_in_the_order_they_were_asked_and_never_beyond_the_slots():
  """Four threads step 50 times each through one DeviceTurns: whatever the interleaving, a turn
  is given in the order it was asked for (no learner overtakes one waiting before it), at most
  `slots` are held at once, and all are handed back."""
  turns = device_share.DeviceTurns(slots=2, history=1000)
  holding, most = [0], [0]
  guard = threading.Lock()

  def learner(m):
    for _ in range(50):
      turns.enter(m)
      with guard:
        holding[0] += 1
        most[0] = max(most[0], holding[0])
      with guard:
        holding[0] -= 1
      turns.leave(m)

  threads = [threading.Thread(target=learner, args=(m,)) for m in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert list(turns.admitted) == list(turns.asked)
  assert sorted(turns.admitted) == sorted(list(range(4)) * 50)
  assert most[0] <= 2 and turns.most_at_once <= 2
  assert turns.in_use == 0


def test_a_turn_handed_back_lets_the_next_in_line_go():
  turns = device_share.DeviceTurns(slots=1)
  turns.enter(0)
  entered = threading.Event()
  waiter = threading.Thread(target=lambda: (turns.enter(1), entered.set()))
  waiter.start()
  assert not entered.wait(0.2)  # one slot, held by learner 0
  turns.leave(0)
  assert entered.wait(30)
  waiter.join()
  with pytest.raises(RuntimeError, match="had not entered"):
    turns.leave(0)


def test_learners_that_share_devices_get_one_turns_per_group():
  groups = device_share.turns_for(4, 2)
  assert groups[0] is groups[1] and groups[2] is groups[3] and groups[0] is not groups[2]
  assert device_share.turns_for(3, 1) == [None] * 3


# ---- meshes ----------------------------------------------------------------------------------


def test_groups_of_learners_get_the_same_devices_and_the_syncer_the_next_one():
  meshes, syncer = devices.build_meshes(((1, 1),) * 4, 1, "cpu", learners_sharing_devices=2)
  assert [m.devices.flat[0].id for m in meshes] == [0, 0, 1, 1]
  assert meshes[0] == meshes[1]  # equal meshes: one compiled step serves both
  assert syncer.devices.flat[0].id == 2
  with pytest.raises(ValueError, match="shared by groups of config.devices.learners_sharing"):
    devices.build_meshes(((8, 1),) * 4, 0, "cpu", learners_sharing_devices=2)


# ---- runs ------------------------------------------------------------------------------------


def _run(tmp_path, step_hook=None, **overrides):
  run = train.build(tiny_settings(tmp_path, **overrides), step_hook=step_hook)
  return run, train.execute(run, progress=False)


@pytest.mark.slow  # 10 s; the identity test on a shared device stays in the default suite
def test_four_learners_on_one_device_train_and_merge_as_on_four_devices(tmp_path):
  """The same 96 steps of four learners, on one fake device and on four. Sharing changes when
  steps run, not what they compute: both merge every fragment, drop no step, and end in one band
  (3.06-3.12 nats in three runs of either layout, 0.02-0.04 apart; a trained model is far under
  ln 256 = 5.55, an untrained one near it)."""
  shared_run, shared = _run(tmp_path / "shared", num_steps=96, **_SHARED)
  _, apart = _run(tmp_path / "apart", num_steps=96, learner_mesh_shapes=((1, 1),))
  assert {d.id for l in shared_run.learners for d in l.mesh_devices} == {0}
  for summary in (shared, apart):
    assert summary["learner_steps"] == [96] * 4
    assert summary["learner_errors"] == [None] * 4
    assert summary["double_merged_offers"] == 0 and summary["unmerged_steps_at_end"] == [0] * 4
    assert summary["merges_before_flush"] > 0
    assert summary["final_eval_loss"] < 3.5
  assert {d["fragment"] for d in shared_run.syncer.tape if not d["final"]} == set(range(4))
  assert abs(shared["final_eval_loss"] - apart["final_eval_loss"]) < 0.2
  # From the start of the build, past its compiles; the four made their first steps in turn.
  assert shared["build_seconds"] < shared["first_step_s"] <= shared["last_first_step_s"]
  # Every step took its turn on the one device, and no turn is held after the run.
  turns = shared_run.learners[0]._turns
  assert turns is not None and all(l._turns is turns for l in shared_run.learners)
  assert turns.in_use == 0 and turns.most_at_once <= device_share.SLOTS
  assert sorted(set(turns.admitted)) == [0, 1, 2, 3]


def test_sharing_learners_start_compiled_and_publish_each_step_as_soon_as_it_has_completed(tmp_path):
  """Issue 44, two ways learners sharing a device lost goodput.

  With stacked layers (experiments/one_gpu.py's model) the syncer reads a fragment of a learner
  with a program on the learner's device, and a learner writes a merged one with another. Compiled
  at first use, the reads held the syncer's thread while it took every fragment's first offers:
  four learners sharing a fake CPU device ran on ~100 steps before the first merges came back, and
  those overwrites dropped 33-83 steps each (goodput 0.65). The build compiles them now: the first
  take and install of a run compile nothing.

  A step taken in turn has completed when its turn ends, but the learner published the state after
  step s (and reported step s) only once step s + 1 had completed, a whole turn of the group later:
  every offer was a step older than it could be. Now the state after step s is published before
  step s + 1 is dispatched."""
  model_lib._layer_of.clear_cache()  # pylint: disable=protected-access
  model_lib._with_layer.clear_cache()  # pylint: disable=protected-access
  published_at = {}  # step about to be made -> step of learner 0's latest publication then

  def hook(index, step):
    if index == 0:
      published_at[step] = run.learners[0].published.step

  run = train.build(tiny_settings(tmp_path, num_steps=4, num_learners=2, model__scan_layers=True,
                                  learner_mesh_shapes=((1, 1),),
                                  devices__learners_sharing_devices=2), step_hook=hook)
  compiled = (model_lib._layer_of._cache_size(), model_lib._with_layer._cache_size())  # pylint: disable=protected-access
  learner = run.learners[0]
  layout = learner.layout
  params = learner.published.params
  flat = learner.flat_params()  # what the syncer's takes read, every flat tensor
  shardings = layout.flat_shardings({n: a.sharding for n, a in params.items()})
  updates = {name: receive_lib.receive(np.asarray(value, np.float32), value, alpha=0.0,
                                       sharding=shardings[name])
             for name, value in flat.items() if layout.where[name][1] is not None}
  jax.block_until_ready(layout.set(params, updates))  # a merged fragment installed
  assert len(updates) == len(flat) - 2  # all but the embedding and the final norm: stacked
  assert compiled[0] >= 1 and compiled[1] >= 1, f"compiled at build (reads, writes): {compiled}"
  assert (model_lib._layer_of._cache_size(),  # pylint: disable=protected-access
          model_lib._with_layer._cache_size()) == compiled  # pylint: disable=protected-access
  summary = train.execute(run, progress=False)
  assert summary["learner_steps"] == [4] * 2 and summary["learner_errors"] == [None] * 2
  assert published_at == {0: 0, 1: 1, 2: 2, 3: 3}


_IDENTITY = dict(outer__name="sgd", outer__learning_rate=1.0, outer__momentum=0.0,
                 merge__keep_in_flight_progress=True, compression__outer_grad="fp32",
                 compression__broadcast="fp32")


def test_identity_outer_step_tracks_dp_on_a_device_shared_with_an_idle_learner(tmp_path):
  """One learner trains with the identity outer step (P = H = 2, tau = 1: a merge every step) on
  the devices it shares with a second learner, whose state, thread and step are there but which
  waits until the first is done and then leaves (it fails, and is not restarted) without a step.
  The first reads dp's batches (its own shard of two is another one), so its global model must be
  dp's model, as for a learner alone (tests/test_runtime.py)."""
  one = dict(learner_mesh_shapes=((2, 1),), num_steps=48)
  dp_run, dp = _run(tmp_path / "dp", mode="dp", num_learners=1, **one)
  settings = tiny_settings(tmp_path / "shared", num_learners=2, devices__learners_sharing_devices=2,
                           sync__num_fragments=2, sync__period=2, sync__overlap=1, max_restarts=0,
                           learner_step_delays_s=(0.01, 0.0), **_IDENTITY, **one)
  box = {}

  def idle_second_learner(learner, step):
    if learner == 1:
      box["run"].learners[0].finished_training.wait(300)
      raise RuntimeError("the idle learner leaves")

  run = train.build(settings, step_hook=idle_second_learner)
  box["run"] = run
  first, second = run.learners
  assert first.mesh_devices == second.mesh_devices
  first._batches = iter(data_lib.make_train_loader(  # what dp reads: the whole of the data
      _train_windows(settings), seq_len=settings.data.seq_len,
      batch_size=settings.data.batch_size, shard_index=0, num_shards=1, seed=settings.seed))
  shared = train.execute(run, progress=False)
  assert shared["learner_steps"] == [48, 0] and "idle learner" in shared["learner_errors"][1]
  assert shared["merges_due"] >= 20 and shared["merges_before_flush"] >= 2
  assert shared["double_merged_offers"] == 0 and shared["unmerged_steps_at_end"][0] == 0
  np.testing.assert_array_equal(first.losses, dp_run.learners[0].losses)  # dp's steps, exactly
  assert shared["final_eval_loss"] == pytest.approx(dp["final_eval_loss"], rel=1e-6)
  theta = run.syncer.global_params()
  learner = jax.device_get(first.flat_params())
  for name, value in theta.items():
    np.testing.assert_allclose(learner[name], value, rtol=0, atol=0)


def _train_windows(settings: settings_lib.RunSettings):
  data = settings.data
  return data_lib.load_dataset(
      data.source, tokenizer=tokenizers.load(data.tokenizer), text_field=data.text_field,
      seq_len=data.seq_len, eval_fraction=data.eval_fraction,
      validation_fraction=data.validation_fraction).train


def test_a_sharing_learner_that_fails_in_its_turn_stops_no_other(tmp_path):
  """Learner 2's step raises on the shared device at its step 6, inside its turn (a device error
  surfaces there), and it is not restarted: the turn goes back, the other three make all their
  steps and merge without it."""
  run = train.build(tiny_settings(tmp_path, max_restarts=0, **_SHARED))
  failing = run.learners[2]
  step = failing._train_step
  calls = [0]

  def device_lost(state, batch):
    calls[0] += 1
    if calls[0] == 7:
      raise RuntimeError("injected: the device lost learner 2's step")
    return step(state, batch)

  failing._train_step = device_lost
  summary = train.execute(run, progress=False)
  assert summary["learner_steps"] == [24, 24, 6, 24]
  assert "injected" in summary["learner_errors"][2]
  assert [e is None for e in summary["learner_errors"]] == [True, True, False, True]
  late = [d for d in run.syncer.tape if min(d["learner_steps"]) > 10]
  assert late and all(2 not in d["learners"] for d in late)
  assert run.learners[0]._turns.in_use == 0
  assert np.isfinite(summary["final_eval_loss"])


def test_the_one_gpu_experiment_scaled_down_puts_four_learners_and_dp_on_one_device(tmp_path):
  import importlib.util  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "one_gpu.py")
  spec = importlib.util.spec_from_file_location("one_gpu", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for size in ("cpu", "gpu"):
    config = module.get_config(size)
    config.workdir = str(tmp_path)
    decoupled = settings_lib.validate(config)
    assert decoupled.num_learners == 4 and decoupled.learner_devices == 1
    config.mode = "dp"
    dp = settings_lib.validate(config)
    assert dp.learner_mesh_shapes == ((1, 1),) and dp.learner_batch_size == 4 * (
        decoupled.data.batch_size)
  with pytest.raises(ValueError, match="one_gpu.py:tpu"):
    module.get_config("tpu")


def test_a_sharing_learner_that_crashes_rejoins_on_its_shared_device(tmp_path):
  """A crash of learner 1 at its step 8, repaired at once: its next incarnation is built on the
  device the four share, from a peer's state and Theta, takes its turns with the others again,
  and every learner makes all its steps."""
  run, summary = _run(tmp_path, chaos__schedule="crash@learner=1,step=8,down_s=0", **_SHARED)
  assert summary["rejoins"] == 1 and summary["learner_steps"] == [24] * 4
  assert summary["learner_errors"] == [None] * 4
  rejoined = run.learners[1]
  assert rejoined.incarnation == 1 and rejoined._turns is run.learners[0]._turns
  assert rejoined.steps_made > 0 and run.learners[0]._turns.in_use == 0
  assert summary["double_merged_offers"] == 0
