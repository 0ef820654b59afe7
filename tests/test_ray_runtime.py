"""config.runtime=ray: every learner a process of its own (a Ray actor on a local, loopback-only
Ray), the same learner and syncer code as the threaded runtime."""

import collections
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

import decoupled_diloco
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.transport import ray_plumbing
from decoupled_diloco.runtime.transport import ray_runtime
from decoupled_diloco.runtime.transport import ray_syncer
from decoupled_diloco.runtime import train
from tests.conftest import act_when
from tests.conftest import tiny_settings
from tests.conftest import token_account_closes
from tests.conftest import wait_until

ray = pytest.importorskip("ray")

# Starting Ray and its learner and syncer processes, each importing JAX and loading its programs,
# took 4 min for one test on a 2-core host under full load: past the suite's 5-min default.
pytestmark = pytest.mark.timeout(900)


# The learner and syncer processes share one compilation cache (set by `local_ray`): a process
# Ray restarts loads its programs instead of compiling them again, as a real run's restarts do.
_CACHE = {"dir": ""}


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
  """One local Ray for the module (loopback only; starting one takes seconds)."""
  _CACHE["dir"] = str(tmp_path_factory.mktemp("ray_jax_cache"))
  ray_runtime.start_ray("", num_processes=4)  # two learners of two processes each
  ray_runtime._started_here = False  # the runs below leave it up  # pylint: disable=protected-access
  node = ray.nodes()[0]
  assert node["NodeManagerAddress"] == "127.0.0.1"  # nothing listens beyond loopback
  yield
  ray.shutdown()


def _settings(tmp_path, **overrides):
  fields = dict(runtime="ray", num_learners=2, num_steps=32, checkpoint__every_steps=0,
                learner_mesh_shapes=((1, 1),), compilation_cache_dir=_CACHE["dir"])
  fields.update(overrides)
  return tiny_settings(tmp_path, **fields)


@pytest.mark.slow  # the kill test below trains and merges too
def test_learner_processes_train_and_merge(tmp_path):
  run = train.build(_settings(tmp_path))
  pids = [l.pid for l in run.learners]
  assert len(set(pids)) == 2 and os.getpid() not in pids  # each learner in its own process
  summary = train.execute(run, progress=False)
  assert summary["learner_errors"] == [None, None]
  assert summary["learner_steps"] == [32, 32]
  assert summary["merges"] >= 8 and summary["double_merged_offers"] == 0
  assert summary["unmerged_steps_at_end"] == [0, 0]
  accounting = summary["fragment_token_accounting"]
  assert accounting["merged"] + accounting["discarded"] == accounting["made"] > 0
  assert summary["final_eval_loss"] < 5.0  # bytes start at ln(256) = 5.55 nats


@pytest.mark.slow  # tests/test_ray_cluster.py loses a learner's host and kills the syncer by hand
def test_a_learner_and_the_syncer_killed_by_hand_are_restarted_and_training_goes_on(tmp_path):
  """kill -9 of learner 1's process and of the syncer's, at once, mid-run: learner 0 trains on,
  Ray restarts both processes, learner 1 rejoins from learner 0's state, the syncer is restored,
  and every step is made and accounted for. (The test below also has config.chaos kill them.)"""
  run = train.build(_settings(tmp_path, num_steps=48, max_restarts=1,
                              learner_step_delays_s=(0.4, 0.4)))
  first_pids = [l.pid for l in run.learners]
  killed = {}

  def kill_both():
    killed["step"], killed["syncer_pid"] = run.learners[0].step, run.syncer.pid
    os.kill(run.learners[1].pid, signal.SIGKILL)
    os.kill(killed["syncer_pid"], signal.SIGKILL)

  killer = act_when(lambda: run.learners[1].step >= 4, kill_both)
  summary = train.execute(run, progress=False)
  killer.join()
  assert killed and killed["step"] < 40  # learner 0 had most of its steps ahead of it
  assert run.learners[0].pid == first_pids[0] and run.learners[1].pid != first_pids[1]
  assert [l.incarnation for l in run.learners] == [0, 1]
  assert summary["learner_errors"] == [None, None]
  assert summary["learner_steps"] == [48, 48]
  [failure] = summary["failures"]
  assert failure["learner"] == 1 and "its process is gone" in failure["error"]
  assert failure["state_from"] == "learner 0" and summary["rejoins"] == 1
  assert summary["syncer_restarts"] == 1 and run.syncer.pid != killed["syncer_pid"]
  # (The syncer is down for seconds of a short run: a few merges.)
  assert summary["double_merged_offers"] == 0 and summary["merges"] >= 4
  accounting = summary["fragment_token_accounting"]
  # Every merge the learners hold is on the command's tape, also the ones made just before the
  # syncer's process died (runtime/transport/ray_syncer.py's _TapeGate; without it a CI run found made
  # 42496 vs 42112 accounted: three fragment-steps in no bucket).
  assert accounting["made"] == sum(accounting[k] for k in (
      "merged", "discarded", "lost_at_failures", "unmerged_at_end")), accounting


@pytest.mark.slow  # tests/test_ray_cluster.py kills a learner and the syncer in the default suite
def test_processes_killed_by_chaos_and_by_hand_are_restarted_and_training_goes_on(tmp_path):
  """config.chaos crashes learner 0 at step 8 and the syncer at 5 s (SIGKILLs of their
  processes); once learner 0 is back, learner 1's process is killed by hand (kill -9), and once
  the syncer is back, its process too. Ray restarts each process, each learner rejoins from the
  other's state, the syncer is restored both times, and every step is made."""
  run = train.build(_settings(
      tmp_path, num_steps=80, max_restarts=2, learner_step_delays_s=(0.4, 0.4),
      checkpoint__every_steps=16,  # cuts are asked for while processes are down
      chaos__schedule="crash@learner=0,step=8,down_s=1;syncer_crash@second=5,down_s=1"))
  first_pids = [l.pid for l in run.learners]
  syncer_pid = run.syncer.pid
  killed = {}

  def wait_for(condition) -> bool:
    deadline = time.monotonic() + 120
    while not condition():
      first = run.learners[0]
      if time.monotonic() > deadline or (first.finished_training.is_set() and first.error is None):
        return False  # learner 0 made its last step (a failed one trains no more, too)
      time.sleep(0.01)
    return True

  def kill_once_the_other_is_back():
    if not wait_for(lambda: run.learners[0].incarnation == 1
                    and run.learners[0].first_step_done_at is not None):
      return
    killed["step"] = run.learners[1].step
    run.learners[1].kill()  # kill -9 of the learner's process
    if not wait_for(lambda: run.keeper.records):  # the injected syncer crash has been healed
      return
    killed["syncer_pid"] = run.keeper.syncer.pid
    os.kill(killed["syncer_pid"], signal.SIGKILL)  # kill -9 of the syncer's process, unplanned

  killer = threading.Thread(target=kill_once_the_other_is_back, daemon=True)
  killer.start()
  summary = train.execute(run, progress=False)
  killer.join()
  assert "syncer_pid" in killed, killed  # both kills happened while learner 0 still trained
  assert killed["step"] < 80  # learner 1 was still training when its process was killed
  # Both processes died and Ray started new ones; each learner is its second incarnation.
  assert all(l.pid != pid for l, pid in zip(run.learners, first_pids))
  assert [l.incarnation for l in run.learners] == [1, 1]
  assert summary["learner_errors"] == [None, None]
  assert summary["learner_steps"] == [80, 80]
  assert summary["rejoins"] == 2
  by_learner = {f["learner"]: f for f in summary["failures"]}
  assert all("its process is gone" in f["error"] for f in by_learner.values())
  assert by_learner[0]["state_from"] == "learner 1" and by_learner[1]["state_from"] == "learner 0"
  crash, injected, by_hand = sorted(summary["faults"], key=lambda f: (f["fault"], f["at_s"]))
  assert crash["fault"] == "crash" and crash["learner"] == 0 and crash["step"] >= 8
  assert crash["repaired_at_s"] >= crash["at_s"] + 1.0  # its down_s
  # The syncer's process was killed twice (SIGKILL: by config.chaos, then by hand), restarted by
  # Ray and restored each time; training and merging went on.
  assert injected["fault"] == by_hand["fault"] == "syncer_crash"
  assert "its process died" in by_hand["source"] and summary["syncer_restarts"] == 2
  assert len({syncer_pid, killed["syncer_pid"], run.syncer.pid}) == 3
  assert len(run.syncer.tape) == summary["merges"] > 8
  assert summary["double_merged_offers"] == 0 and summary["merges"] >= 8
  # The event tape: the syncer processes' merges reach the command's tape.jsonl, beside the faults
  # and restarts; learner processes record no takes or applies yet (a replay refuses this tape).
  with open(tmp_path / "tape.jsonl", encoding="utf-8") as f:
    kinds = collections.Counter(json.loads(line)["kind"] for line in f)
  assert kinds["merge"] > 8 and kinds["fault"] >= 2 and kinds["syncer_restart"] == 2
  assert kinds["rejoin"] == 2 and kinds["take"] == kinds["apply"] == 0
  accounting = summary["fragment_token_accounting"]
  assert accounting["made"] == sum(accounting[k] for k in (
      "merged", "discarded", "lost_at_failures", "unmerged_at_end"))


@pytest.mark.slow  # 2 learner and 2 shard processes and a shard's restart: ~70 s on 2 cores
def test_a_syncer_shard_killed_by_hand_is_restored_while_the_other_shard_merges_on(tmp_path):
  """config.syncer.num_shards=2: each shard a process of its own. kill -9 of shard 1's process
  mid-run, once it has a checkpoint of its own: Ray restarts it, and its keeper restores it from
  that checkpoint, held until shard 0 (never touched) has merged twice more alone. The run
  finishes, every merge is its fragment's owner's, and the token account closes."""
  run = train.build(_settings(tmp_path, num_steps=48, syncer__num_shards=2,
                              learner_step_delays_s=(0.2, 0.2), checkpoint__every_steps=16,
                              checkpoint__syncer_every_s=0.2))
  shards, keepers = run.syncer.shards, run.keeper.keepers
  first_pids = [shard.pid for shard in shards]
  assert len(set(first_pids + [l.pid for l in run.learners] + [os.getpid()])) == 5
  own = tmp_path / "checkpoints" / "syncer_shard_1"
  killed = {}

  def kill_shard_1():
    killed["step"], killed["merges_0"] = run.learners[0].step, shards[0].stats.merges
    os.kill(first_pids[1], signal.SIGKILL)

  restart = keepers[1]._restart  # pylint: disable=protected-access

  def restart_once_shard_0_merged_on():
    # (The keeper restores it on the controller's thread: shard 0 and the learners go on.)
    assert wait_until(lambda: keepers[0].syncer.stats.merges >= killed["merges_0"] + 2, 120)
    killed["merges_0_at_restart"] = keepers[0].syncer.stats.merges
    restart()

  keepers[1]._restart = restart_once_shard_0_merged_on  # pylint: disable=protected-access
  killer = act_when(lambda: run.learners[0].step >= 8 and own.is_dir() and any(
      d.name.isdigit() for d in own.iterdir()), kill_shard_1)
  summary = train.execute(run, progress=False)
  killer.join()
  assert killed and killed["step"] < 40  # the learners had most of their steps ahead
  assert killed["merges_0_at_restart"] >= killed["merges_0"] + 2
  assert keepers[0].syncer.pid == first_pids[0] and keepers[1].syncer.pid != first_pids[1]
  [fault] = summary["faults"]
  assert fault["fault"] == "syncer_crash" and fault["shard"] == 1
  assert "its process died" in fault["source"]
  assert "/checkpoints/syncer_shard_1/" in fault["restored_from"]
  assert summary["syncer_restarts"] == 1
  owner = run.syncer.owner
  assert all(r["shard"] == owner[r["fragment"]] for r in run.syncer.tape)
  assert all(m > 0 for m in summary["merges_per_shard"])
  assert summary["learner_steps"] == [48, 48] and summary["double_merged_offers"] == 0
  assert summary["unmerged_steps_at_end"] == [0, 0]
  token_account_closes(summary)


# Slow, so that the default suite stays under 10 min (16 s; the threads runtime's give-up test
# stays, in test_self_healing.py).
@pytest.mark.slow
def test_a_learner_process_given_up_after_max_restarts_leaves_the_run_to_finish_without_it(
    tmp_path):
  """config.max_restarts=0 and learner 1's process killed (config.chaos) at step 3: the run goes
  on without it and ends. (Before, the command waited forever for its last step.)"""
  run = train.build(_settings(tmp_path, num_steps=24, max_restarts=0,
                              learner_step_delays_s=(0.1, 0.1),
                              chaos__schedule="crash@learner=1,step=3,down_s=1"))
  summary = train.execute(run, progress=False)
  assert summary["learner_steps"][0] == 24 and summary["learner_steps"][1] < 24
  assert summary["learner_errors"][0] is None and "its process is gone" in summary[
      "learner_errors"][1]
  assert summary["rejoins"] == 0 and summary["unmerged_steps_at_end"][0] == 0


# ---- a learner over several processes (config.ray.processes_per_learner) ------------------------

_IDENTITY = dict(outer__name="sgd", outer__learning_rate=1.0, outer__momentum=0.0,
                 merge__keep_in_flight_progress=True, compression__outer_grad="fp32",
                 compression__broadcast="fp32", sync__num_fragments=2, sync__period=2,
                 sync__overlap=1)


# Slow, so that the default suite stays under 10 min (14 s; the processes' agreement stays in
# test_learner_group.py, and the identity step against dp under threads).
@pytest.mark.slow
def test_a_learner_over_two_processes_with_the_identity_outer_step_tracks_dp(tmp_path):
  """One learner whose model axis spans two processes (mesh (1, 2), one device each): every pull
  is put together from both processes' halves, every broadcast is applied by both at the same
  step. With the identity outer step the run must track dp: a piece lost or a broadcast applied
  at different steps in the two processes moves the loss. (tests/test_learner_group.py checks
  the agreement itself without Ray.)"""
  one = dict(num_learners=1, learner_mesh_shapes=((1, 2),), num_steps=32)
  dp = train.execute(train.build(tiny_settings(tmp_path / "dp", mode="dp", **one)),
                     progress=False)
  run = train.build(_settings(tmp_path / "group", ray__processes_per_learner=2,
                              learner_step_delays_s=(0.01,), **_IDENTITY, **one))
  assert len(set(run.learners[0].pids)) == 2 and os.getpid() not in run.learners[0].pids
  summary = train.execute(run, progress=False)
  assert summary["learner_errors"] == [None] and summary["learner_steps"] == [32]
  # Merges ran while it trained. How many depends on the host's load: a fragment falling due
  # while its merge is in flight waits for it (tests/test_runtime.py's identity test, too).
  assert summary["merges_before_flush"] >= 2 and summary["double_merged_offers"] == 0
  assert summary["unmerged_steps_at_end"] == [0]
  assert summary["final_eval_loss"] == pytest.approx(dp["final_eval_loss"], rel=1e-6)
  assert summary["learner_replicas_agree"] == [True]


@pytest.mark.slow  # two learners of two processes each, and a restart of two: ~1 min here
def test_a_killed_process_of_a_multi_process_learner_takes_its_learner_down_and_it_rejoins(
    tmp_path):
  """kill -9 of the second process of learner 1 (of two, two processes each): its leader's next
  collective fails, the command ends the learner's other process, Ray restarts both, and
  learner 1 rejoins as a whole, from learner 0's state put together from learner 0's two
  processes. Checkpoints are cut throughout from both learners' processes."""
  run = train.build(_settings(tmp_path, num_steps=48, max_restarts=1,
                              ray__processes_per_learner=2, learner_mesh_shapes=((2, 1),),
                              learner_step_delays_s=(0.3, 0.3), checkpoint__every_steps=16))
  first_pids = [list(l.pids) for l in run.learners]
  killed = {}

  def kill_one():
    killed["step"] = run.learners[0].step
    os.kill(first_pids[1][1], signal.SIGKILL)

  killer = act_when(lambda: run.learners[1].step >= 4, kill_one)
  summary = train.execute(run, progress=False)
  killer.join()
  assert killed and killed["step"] < 40
  assert run.learners[0].pids == first_pids[0]
  assert not set(run.learners[1].pids) & set(first_pids[1])  # both of its processes are new
  assert [l.incarnation for l in run.learners] == [0, 1]
  assert summary["learner_errors"] == [None, None]
  assert summary["learner_steps"] == [48, 48]
  [failure] = summary["failures"]
  assert failure["learner"] == 1 and failure["state_from"] == "learner 0"
  assert summary["rejoins"] == 1 and summary["double_merged_offers"] == 0
  assert summary["unmerged_steps_at_end"] == [0, 0]
  accounting = summary["fragment_token_accounting"]
  assert accounting["made"] == sum(accounting[k] for k in (
      "merged", "discarded", "lost_at_failures", "unmerged_at_end")), accounting
  assert (tmp_path / "checkpoints" / "job" / "48").is_dir()  # the final cut, of both learners
  # Each learner's two processes hold the same copy of its (replicated) parameters: they applied
  # every merge at the same step.
  assert summary["learner_replicas_agree"] == [True, True]


def test_a_broadcast_waits_until_the_command_holds_its_merge_s_record():
  """ray_syncer._TapeGate: a kill -9 of the syncer's process may come before the command has
  polled a merge's record; the learners must not hold that merge then (its tokens would be in no
  bucket of the token account: a CI run found 3 fragment-steps so before the gate)."""
  tape, delivered = [], []

  class Link:
    index = 3

    def deliver(self, broadcast):
      delivered.append(broadcast)

  gate = ray_syncer._TapeGate(lambda: len(tape))  # pylint: disable=protected-access
  link = ray_syncer._GatedLink(Link(), gate)  # pylint: disable=protected-access
  assert link.index == 3  # the rest of the link is the learner's
  tape.append({"version": 1})  # a merge, then its broadcast
  link.deliver("merge 1")
  gate.command_holds(0)
  assert delivered == []  # the command does not hold the merge's record yet
  gate.command_holds(1)
  assert delivered == ["merge 1"]
  link.deliver("a catch-up of merge 1")  # nothing on the tape the command lacks: at once
  assert delivered[-1] == "a catch-up of merge 1"
  tape.append({"version": 2})
  link.deliver("merge 2")
  assert delivered[-1] != "merge 2"
  assert not gate.wait_sent(0.01)  # (the final flush waits so for the command's next poll)
  gate.open()  # the command took the final tape
  link.deliver("merge 3")
  assert delivered[-2:] == ["merge 2", "merge 3"]


def test_a_call_from_outside_the_job_is_rejected_and_counted(tmp_path):
  run = train.build(_settings(tmp_path, num_steps=16))
  try:
    # The job's processes run at the command's priority, not as Ray's background workers (15).
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert [os.getpriority(os.PRIO_PROCESS, p.pid) for p in [*run.learners, run.syncer]] == \
        [ours] * 3
    learner = run.learners[1]
    actor = learner._actor  # what another driver would get from ray.get_actor(name)
    before = learner.published.params
    forged = ray_plumbing.sign(b"not the job's secret", "deliver", 1, 0, "0:1")
    bogus = messages.Broadcast(0, 1, {})
    assert ray.get(actor.deliver.remote(bogus, 0, forged)) is False  # fire-and-forget: refused
    stale = ray_plumbing.sign(learner._secret, "offer", 1, 5, "0")  # a later incarnation's
    with pytest.raises(ray.exceptions.RayTaskError, match="for incarnation 5"):
      ray.get(actor.offer.remote(0, 0, 5, stale))
    status = ray.get(actor.poll.remote(0.0))
    assert status["rejected_calls"] == 2  # both logged and counted
    after = learner.published.params
    assert all(np.array_equal(before[n], after[n]) for n in before)
    # The syncer's process, looked up by name as another driver would, takes no post without
    # the job's MAC: an outsider's offer (a lock-step push) and its step report are refused.
    syncer = ray.get_actor(run.syncer.name)
    offer = messages.Offer(learner=0, fragment=0, step=5, since=0, steps=5, tokens=640,
                           anchor_version=0, values={}, anchor={}, incarnation=0)
    report = messages.StepReport(0, 5, 0.1, 128, incarnation=0)
    forged = ray_plumbing.sign(b"not the job's secret", "post", 0, 0, "Offer")
    assert ray.get(syncer.post.remote(offer, forged)) is False
    assert ray.get(syncer.post.remote(report, "0" * 64)) is False
    assert ray.get(syncer.poll.remote(0, 0.0))["rejected_calls"] == 2
  finally:
    ray_runtime.shutdown(list(run.learners) + [run.syncer])


def test_the_workers_import_path_holds_this_copy_of_the_package():
  root = ray_runtime.package_root()
  assert os.path.samefile(os.path.join(root, "decoupled_diloco", "__init__.py"),
                          decoupled_diloco.__file__)
