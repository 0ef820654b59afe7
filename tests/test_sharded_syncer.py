"""The syncer sharded M ways (config.syncer.num_shards, docs/design.md §2): each shard owns some
fragments and their Theta_p, outer states, rounds, merges and checkpoint; the controller reads the
shards as one syncer; a lost shard is restored from its own checkpoint while the others merge on.

Scripted shards (no model) check ownership and the held cut exactly; one tiny threaded run checks
the whole: every fragment merged by its owner, a shard crash restored, the token account closed.
"""

import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import default_settings
from conftest import token_account_closes
from conftest import tiny_settings
from conftest import wait_until
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import outer
from decoupled_diloco.runtime import train
from decoupled_diloco.runtime.control import run as run_lib
from decoupled_diloco.runtime.control import shard_keeper
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core.syncer import sharded as sharded_syncer
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
from decoupled_diloco.runtime.core.syncer import rounds as syncer_rounds
from decoupled_diloco.runtime.records import checkpoints as checkpoints_lib
from decoupled_diloco.settings import SyncSettings

SHAPES = {"embedder/embedding": (6, 4), "w": (8,), "v": (3, 5), "u": (7,)}


class Scripted:
  """A learner link whose every fragment offers `value` over steps (since, step]: set by the test."""

  def __init__(self, index, num_fragments):
    self.index, self.step, self.since = index, 0, 0
    self.versions = np.zeros(num_fragments, np.int64)
    self.received = []

  def offer(self, p, merged_through):
    if self.step <= max(self.since, merged_through):
      return messages.Answer.NOTHING
    names = [n for n in SHAPES if n in self.fragment_names[p]]
    return messages.Offer(
        learner=self.index, fragment=p, step=self.step, since=max(self.since, merged_through),
        steps=self.step - max(self.since, merged_through), tokens=10, anchor_version=0,
        values={n: np.full(SHAPES[n], 1.0 + self.index, np.float32) for n in names},
        anchor={n: np.zeros(SHAPES[n], np.float32) for n in names})

  def deliver(self, broadcast):
    self.received.append(broadcast)
    self.versions[broadcast.fragment] = broadcast.version

  @property
  def published(self):
    none = np.zeros(len(self.versions), np.int64)
    return messages.Publication(step=self.step, params={}, since=none, counter_steps=none,
                                counter_tokens=none, anchor_versions=self.versions.copy(),
                                anchors={}, training=True, opt_state=())

  def want_full_state(self, seconds):
    del seconds


def _shards(num_fragments=4, owner=(0, 1, 1, 0)):
  shapes = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in SHAPES.items()}
  fragments = fragments_lib.partition(shapes, num_fragments, "round_robin",
                                      embedding_names=("embedder/embedding",))
  sync = SyncSettings(num_fragments=num_fragments, period=num_fragments, overlap=1, quorum=1,
                      lock_step=False, grace_gamma=0.0, grace_cap_s=1.0, ema_decay=0.0,
                      fragmentation="round_robin", heartbeat_timeout_s=0.0,
                      elastic_lock_step=False)
  shards = []
  for shard in range(max(owner) + 1):
    made = syncer_lib.Syncer(
        sync=sync, fragments=fragments,
        initial_params={n: np.zeros(s, np.float32) for n, s in SHAPES.items()},
        mesh=Mesh(np.array(jax.devices()[shard:shard + 1]), ("learner",)),
        outer_tx=outer.make_outer_optimizer("sgd", 1.0, 0.0),
        merge=default_settings("merge"), compression=default_settings(
            "compression", outer_grad="fp32"), num_learners=2, num_workers=1,
        owned=[p for p, s in enumerate(owner) if s == shard], shard=shard)
    made.compile()
    shards.append(made)
  return sharded_syncer.ShardedSyncer(shards, owner), fragments


def _learners(syncer, fragments):
  links = [Scripted(m, len(fragments)) for m in range(2)]
  for link in links:
    link.fragment_names = [f.names for f in fragments]
    syncer.attach(link.index, link)
  return links


def _step(syncer, links, step):
  for link in links:
    link.step = step
    syncer.post(messages.StepReport(link.index, step, 0.01, 10,
                                    anchor_versions=link.versions.copy()))


@pytest.fixture
def running():
  started = []
  yield lambda syncer: (syncer.start(), started.append(syncer))
  for syncer in started:
    syncer.stop()
    syncer.join(timeout=10)


def test_each_shard_merges_the_fragments_it_owns_and_the_shards_read_as_one_syncer(running):
  syncer, fragments = _shards()
  links = _learners(syncer, fragments)
  running(syncer)
  for step in range(1, 5):  # each of the 4 fragments falls due once (P = H = 4)
    _step(syncer, links, step)
  # (A merge is on the tape before its broadcasts leave: wait for those.)
  assert wait_until(lambda: all(len(link.received) == 4 for link in links), timeout_s=60)
  for shard, owned in ((0, {0, 3}), (1, {1, 2})):
    part = syncer.shards[shard]
    assert {r["fragment"] for r in part.tape} == owned
    assert all(r["shard"] == shard for r in part.tape)
    # Theta_p of the fragments it owns, and nothing of the others.
    assert set(part.global_params()) == {n for p in owned for n in fragments[p].names}
  by_fragment = {}
  for b in links[0].received:
    by_fragment.setdefault(b.fragment, []).append(b.version)
  assert by_fragment == {0: [1], 1: [1], 2: [1], 3: [1]}
  theta, versions = syncer.model.received()
  assert versions.tolist() == [1, 1, 1, 1] and set(theta) == set(SHAPES)
  assert set(syncer.global_params()) == set(SHAPES)
  assert syncer.stats.merges == 4 and [s.merges for s in syncer.shard_stats] == [2, 2]
  assert syncer.stats.merges_due == 4  # each shard counts the fragments it owns


def test_a_held_cut_opens_no_round_until_its_own_token_releases_it(running):
  syncer, fragments = _shards()
  links = _learners(syncer, fragments)
  shard = syncer.shards[0]
  running(syncer)
  cut = shard.request_cut(timeout_s=60, hold="mine").result(timeout=60)
  assert cut is not None and cut.state["json"]["model"]["versions"] == [0, 0, 0, 0]
  _step(syncer, links, 4)  # every fragment falls due: shard 0's two are owed while it is held
  assert wait_until(lambda: shard.stats.merges_due == 2)
  shard.release_cut("an earlier request's")  # a late release of another cut ends nothing
  shard.request_state().result(timeout=60)  # (read on its thread: after the release above)
  assert sorted(shard._owed) == [0, 3] and not shard._rounds  # pylint: disable=protected-access
  assert wait_until(lambda: syncer.shards[1].stats.merges == 2)  # shard 1 merges meanwhile
  assert shard.stats.merges == 0
  shard.release_cut("mine")
  assert wait_until(lambda: shard.stats.merges == 2)  # its owed rounds opened and merged


def test_the_whole_syncer_s_cut_is_every_shard_s_state_at_one_instant(running):
  syncer, fragments = _shards()
  links = _learners(syncer, fragments)
  running(syncer)
  for step in range(1, 5):
    _step(syncer, links, step)
  assert wait_until(lambda: syncer.stats.merges == 4)
  cut = syncer.request_cut(timeout_s=60).result(timeout=120)
  assert cut is not None and sorted(cut.publications) == [0, 1]
  parts = sharded_syncer.split_state(cut.state, 2)
  for part, owned in zip(parts, ((0, 3), (1, 2))):
    assert set(part["json"]["model"]["names"]) == {n for q in owned for n in fragments[q].names}
    assert [part["json"]["model"]["versions"][p] for p in owned] == [1, 1]
  with pytest.raises(ValueError, match="config.syncer.num_shards=3"):
    sharded_syncer.split_state(cut.state, 3)
  # Both shards merge again after the cut (their holds were released).
  for step in range(6, 10):
    _step(syncer, links, step)
  assert wait_until(lambda: [s.merges for s in syncer.shard_stats] == [4, 4])


def test_the_shards_counters_add_up_and_a_learner_s_absence_counts_once():
  one = syncer_rounds.SyncerStats(merges=3, busy_s=0.5, absences=1, returns=1)
  other = syncer_rounds.SyncerStats(merges=4, busy_s=0.25, absences=1, returns=1)
  one.rejected_offers["outlier"] = 2
  both = sharded_syncer.combined_stats([one, other])
  assert both.merges == 7 and both.busy_s == 0.75
  assert both.absences == 1 and both.returns == 1
  assert both.rejected_offers["outlier"] == 2


class _Port:
  def __init__(self):
    self.posted = []
    self.dropped = 0

  def post(self, message):
    self.posted.append(message)


def test_a_learner_s_posts_reach_every_shard_and_an_offer_only_its_owner():
  ports = [_Port(), _Port()]
  port = shard_keeper.ShardedPort(ports, owner=(0, 1, 1, 0))
  report = messages.StepReport(0, 1, 0.1, 10)
  port.post(report)
  offer = messages.Offer(0, 2, 1, 0, 1, 10, 0, {}, {})
  port.post(offer)
  assert ports[0].posted == [report] and ports[1].posted == [report, offer]


def test_two_shards_train_a_run_and_a_lost_shard_is_restored_while_the_other_merges_on(tmp_path):
  """A tiny run with 2 shards under threads, shard 1 crashed (config.chaos) once the learners
  are a quarter in; its restart is held until shard 0 has merged twice more (it must merge on
  alone). Every merge is its fragment's owner's, shard 1 comes back from its own checkpoint,
  every step is merged once and the token account closes."""
  crashed = []

  def hold_learners(learner, step):
    del learner
    if step == 12:  # the crash comes while every learner still has most of its steps ahead
      wait_until(lambda: bool(crashed), timeout_s=60)

  run = train.build(tiny_settings(
      tmp_path, num_steps=48, syncer__num_shards=2, checkpoint__every_steps=16,
      checkpoint__syncer_every_s=0.05, chaos__schedule="syncer_crash@shard=1,second=0,down_s=0"),
      step_hook=hold_learners)
  keepers = run.keeper.keepers
  merges = {}
  # pylint: disable=protected-access
  tick, crash, restart = keepers[1].tick, keepers[1]._crash, keepers[1]._restart
  faults, keepers[1]._faults = keepers[1]._faults, []

  def tick_with_the_fault_once_checkpointed():
    # Shard 1 has written a checkpoint of its own before its crash: it comes back from it.
    if faults and run.checkpoints.steps("syncer_shard_1"):
      keepers[1]._faults, faults[:] = list(faults), []
    tick()

  def crash_noting_the_other(*args, **kwargs):
    merges["at_crash"] = keepers[0].syncer.stats.merges
    crash(*args, **kwargs)
    crashed.append(True)

  def restart_once_the_other_merged_on():
    wait_until(lambda: keepers[0].syncer.stats.merges >= merges["at_crash"] + 2, timeout_s=60)
    merges["at_restart"] = keepers[0].syncer.stats.merges
    restart()

  keepers[1].tick = tick_with_the_fault_once_checkpointed
  keepers[1]._crash = crash_noting_the_other
  keepers[1]._restart = restart_once_the_other_merged_on
  # pylint: enable=protected-access
  first_shard_0 = keepers[0].syncer
  summary = train.execute(run, progress=False)

  token_account_closes(summary)  # every shard's merges are on the one syncer's tape
  assert merges["at_restart"] >= merges["at_crash"] + 2  # shard 0 merged while 1 was down
  assert keepers[0].syncer is first_shard_0 and not keepers[0].records  # never lost
  [fault] = summary["faults"]
  assert fault["fault"] == "syncer_crash" and fault["shard"] == 1
  assert "/checkpoints/syncer_shard_1/" in fault["restored_from"]
  assert summary["syncer_restarts"] == 1
  # Every merge is its fragment's owner's; each shard holds its own fragments only.
  owner = run.syncer.owner
  assert sorted(set(owner)) == [0, 1]
  assert all(r["shard"] == owner[r["fragment"]] for r in run.syncer.tape)
  assert summary["syncer_shard_fragments"] == [[p for p in range(4) if owner[p] == s]
                                               for s in (0, 1)]
  assert summary["merges_per_shard"] == [
      sum(1 for r in run.syncer.tape if r["shard"] == s) for s in (0, 1)]
  assert sum(summary["merges_per_shard"]) == summary["merges"]
  assert all(s > 0 for s in summary["syncer_busy_seconds_per_shard"])
  assert summary["learner_steps"] == [48] * 4 and summary["double_merged_offers"] == 0
  assert summary["unmerged_steps_at_end"] == [0] * 4
  # The job's final checkpoint holds both shards' Theta: the global model, read back whole.
  saved = checkpoints_lib.read_model(str(tmp_path / "checkpoints"))
  final = run_lib.global_params(run)
  assert saved.clock == 48 and set(saved.params) == set(final)
  for name, value in final.items():
    np.testing.assert_array_equal(saved.params[name], value)


def test_a_run_recorded_with_two_shards_replays_bit_for_bit_on_one_syncer(tmp_path):
  """The tape holds each fragment's merges in their order, whichever shard made them: a replay
  runs them on one global model (config.syncer.num_shards is 1 there) to the same bits."""
  fields = dict(num_steps=16, syncer__num_shards=2, learner_step_delays_s=(0.02,) * 4)
  summary = train.execute(train.build(tiny_settings(tmp_path / "recorded", **fields)),
                          progress=False)
  assert all(m > 0 for m in summary["merges_per_shard"])
  settings = tiny_settings(tmp_path / "replayed", replay=str(tmp_path / "recorded"), **fields)
  assert settings.syncer.num_shards == 1
  replayed = train.replay(train.build(settings), progress=False)
  assert replayed["replay_exact"] and replayed["params_equal_to_recording"]
  assert replayed["merges"] == summary["merges"]
  assert replayed["params_sha256"] == summary["params_sha256"]
  assert replayed["learner_params_sha256"] == summary["learner_params_sha256"]
