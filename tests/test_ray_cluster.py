"""config.runtime=ray on a cluster of several Ray nodes on this machine (`ray.cluster_utils.Cluster`,
loopback only): the learners and the syncer placed on their hosts by custom resources
(config.ray.learner_resource, config.ray.syncer_resource), and a whole host lost mid-run with
every process on it (`Cluster.remove_node`), as a lost TPU host or GPU node."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from decoupled_diloco.runtime import train
from decoupled_diloco.runtime.transport import ray_runtime  # noqa: F401 (Ray's loopback first)
from tests.conftest import act_when
from tests.conftest import ray_node_args
from tests.conftest import remove_ray_node
from tests.conftest import token_account_closes
from tests.conftest import tiny_flags
from tests.conftest import tiny_settings

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

# Six Ray nodes (each its own raylet and object store) and the actors' JAX start-ups on 2 cores.
pytestmark = pytest.mark.timeout(900)

LEARNER_HOST, SYNCER_HOST = "learner_host", "syncer_host"
_CACHE = {"dir": ""}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  """A head (the driver's node), three learner hosts (two learners and a spare) and two syncer
  hosts (the syncer and a spare), all on loopback. The head has the most CPUs and none of the
  custom resources: Ray's default scheduling prefers the caller's node, so an actor that did not
  ask for its host's resource would land there, and the placement asserts would fail. A lost node
  is dead to Ray within about two seconds (health checks every 0.5 s)."""
  _CACHE["dir"] = str(tmp_path_factory.mktemp("ray_jax_cache"))
  made = cluster_utils.Cluster(initialize_head=True, head_node_args=dict(
      ray_node_args(None, num_cpus=8), _system_config={"health_check_period_ms": 500,
                                        "health_check_failure_threshold": 3}))
  for resource in (LEARNER_HOST,) * 3 + (SYNCER_HOST,) * 2:
    made.add_node(**ray_node_args(resource))
  made.wait_for_nodes()
  ray.init(address=made.address)
  assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback only
  yield made
  ray.shutdown()
  made.shutdown()


def _settings(cluster, tmp_path, **overrides):
  fields = dict(runtime="ray", num_learners=2, num_steps=40, checkpoint__every_steps=0,
                learner_mesh_shapes=((1, 1),), compilation_cache_dir=_CACHE["dir"],
                max_restarts=1, learner_step_delays_s=(0.3, 0.3), ray__address=cluster.address,
                ray__learner_resource=LEARNER_HOST, ray__syncer_resource=SYNCER_HOST)
  fields.update(overrides)
  return tiny_settings(tmp_path, **fields)


def _hosts(resource: str) -> set[str]:
  return {n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]}


@pytest.fixture(autouse=True)
def hosts_back(cluster):
  """After each test, the hosts it lost are added back (from the main thread: Ray's node start
  sets a signal handler), so that every test starts from three learner and two syncer hosts."""
  yield
  alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
  for node in [n for n in cluster.worker_nodes if n.node_id not in alive]:
    cluster.remove_node(node, allow_graceful=False)  # one a node_loss fault took down: forgotten
  for resource, count in ((LEARNER_HOST, 3), (SYNCER_HOST, 2)):
    for _ in range(count - len(_hosts(resource))):
      cluster.add_node(**ray_node_args(resource))
  cluster.wait_for_nodes()


@pytest.mark.slow  # the host-loss test below checks the learners' placement in the default suite
def test_the_learners_and_the_syncer_run_on_the_hosts_their_resources_name(cluster, tmp_path):
  run = train.build(_settings(cluster, tmp_path, num_steps=8))
  learner_nodes = [l.nodes[0] for l in run.learners]
  syncer_node = run.syncer.node
  summary = train.execute(run, progress=False)
  assert len(set(learner_nodes)) == 2 and set(learner_nodes) <= _hosts(LEARNER_HOST)
  assert syncer_node in _hosts(SYNCER_HOST)
  assert summary["learner_steps"] == [8, 8] and summary["learner_errors"] == [None, None]


def test_a_learner_s_host_lost_mid_run_it_rejoins_on_the_spare_host(cluster, tmp_path):
  """Learner 1's node is removed at its step 4 (its raylet, object store and every process on it
  killed at once), and the syncer's process is killed (kill -9) in the same moment: learner 0
  trains on, Ray restarts learner 1's actor on the spare learner host and the syncer's process,
  the syncer is restored, and learner 1 rejoins from learner 0's state and finishes every step."""
  run = train.build(_settings(cluster, tmp_path))
  first = [l.nodes[0] for l in run.learners]
  assert len(set(first)) == 2 and set(first) <= _hosts(LEARNER_HOST)
  lost = {}

  def remove():
    lost["step0"], lost["syncer_pid"] = run.learners[0].step, run.syncer.pid
    remove_ray_node(cluster, first[1])
    os.kill(lost["syncer_pid"], signal.SIGKILL)  # this machine's pid: a kill -9 on its host

  remover = act_when(lambda: run.learners[1].step >= 4, remove)
  summary = train.execute(run, progress=False)
  remover.join()
  assert lost and lost["step0"] < 32  # learner 0 had most of its steps ahead of it
  now = [l.nodes[0] for l in run.learners]
  assert now[0] == first[0] and now[1] != first[1]
  assert now[1] in _hosts(LEARNER_HOST) and now[1] not in first  # on the spare
  assert [l.incarnation for l in run.learners] == [0, 1]
  assert summary["learner_errors"] == [None, None] and summary["learner_steps"] == [40, 40]
  [failure] = summary["failures"]
  assert failure["learner"] == 1 and "its process is gone" in failure["error"]
  assert failure["state_from"] == "learner 0" and summary["rejoins"] == 1
  assert summary["syncer_restarts"] == 1 and run.keeper.syncer.pid != lost["syncer_pid"]
  assert summary["double_merged_offers"] == 0 and summary["merges"] >= 4
  # Every merge the learners hold is on the command's tape, also those made just before the
  # syncer's process died (ray_syncer's _TapeGate: without it three fragment-steps were in no
  # bucket once).
  token_account_closes(summary)


@pytest.mark.slow  # the test above loses a learner's host in the default suite
def test_the_syncer_s_host_lost_mid_run_it_is_restored_on_the_spare_host(cluster, tmp_path):
  """The syncer's node is removed once both learners have made 4 steps: Ray restarts the syncer's
  actor on the other syncer host, the keeper restores it from its checkpoint and the learners'
  newest publications, and merging goes on."""
  run = train.build(_settings(cluster, tmp_path, checkpoint__every_steps=8))
  first = run.syncer.node
  lost = {}

  def remove():
    lost["pid"] = run.syncer.pid
    remove_ray_node(cluster, first)

  remover = act_when(lambda: min(l.step for l in run.learners) >= 4, remove)
  summary = train.execute(run, progress=False)
  remover.join()
  assert lost
  assert run.keeper.syncer.node != first
  assert summary["syncer_restarts"] == 1 and run.keeper.syncer.pid != lost["pid"]
  assert summary["learner_errors"] == [None, None] and summary["learner_steps"] == [40, 40]
  assert summary["double_merged_offers"] == 0 and summary["merges"] >= 4
  token_account_closes(summary)


@pytest.mark.slow  # two learners of two processes each on four hosts, one host lost: ~1 min here
@pytest.mark.parametrize("lost_process", [1, 0], ids=["follower_host", "leader_host"])
def test_a_multi_process_learner_losing_one_host_rejoins_as_a_whole_on_the_spare(
    cluster, tmp_path, lost_process):
  """Two learners of two processes each, every process on a host of its own (a placement group
  spread over distinct learner hosts). The host of one of learner 1's processes is removed (its
  follower's: the leader's next collective fails; its leader's: the driver's watch of it fails),
  the command ends the learner's other process (through that process's own call: it is on another
  node), Ray places the lost bundle on the spare host, and learner 1 rejoins as a whole, from
  learner 0's state, while learner 0 trains on."""
  for _ in range(5 - len(_hosts(LEARNER_HOST))):  # four processes and a spare
    cluster.add_node(**ray_node_args(LEARNER_HOST))
  cluster.wait_for_nodes()
  run = train.build(_settings(cluster, tmp_path, num_steps=48, ray__processes_per_learner=2,
                              learner_mesh_shapes=((2, 1),), checkpoint__every_steps=16))
  first = [list(l.nodes) for l in run.learners]
  assert len({n for nodes in first for n in nodes}) == 4  # one host per process
  lost = {}

  def remove():
    lost["step0"] = run.learners[0].step
    remove_ray_node(cluster, first[1][lost_process])

  remover = act_when(lambda: run.learners[1].step >= 4, remove)
  summary = train.execute(run, progress=False)
  remover.join()
  assert lost and lost["step0"] < 40
  assert run.learners[0].nodes == first[0] and run.learners[0].incarnation == 0
  assert first[1][lost_process] not in run.learners[1].nodes
  assert run.learners[1].incarnation == 1
  assert summary["learner_errors"] == [None, None] and summary["learner_steps"] == [48, 48]
  [failure] = summary["failures"]
  assert failure["learner"] == 1 and failure["state_from"] == "learner 0"
  assert summary["rejoins"] == 1 and summary["double_merged_offers"] == 0
  assert summary["unmerged_steps_at_end"] == [0, 0]
  token_account_closes(summary)
  assert summary["learner_replicas_agree"] == [True, True]


_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _alive_actors() -> list[str]:
  return [a["ActorClassName"] for a in ray._private.state.actors().values()  # pylint: disable=protected-access
          if a["State"] != "DEAD"]


@pytest.mark.slow  # two commands in processes of their own: ~50 s here
def test_the_command_killed_mid_run_leaves_no_actor_and_the_same_command_resumes(
    cluster, tmp_path):
  """kill -9 of the command (the driver: controller, supervisor, checkpointer) once its job
  checkpoint of step 16 is on disk: every actor it started ends with it (Ray ends the actors of a
  dead owner), and the same command again resumes from the newest job checkpoint and finishes
  with the token account closed."""
  workdir = tmp_path / "run"
  command = [sys.executable, "-m", "decoupled_diloco.main", "--config=experiments/tiny_cpu.py",
             *tiny_flags(runtime="ray", num_learners=2, num_steps=48,
                         learner_mesh_shapes="((1,1),)", learner_step_delays_s="(0.3,0.3)",
                         max_restarts=1, checkpoint__every_steps=8, workdir=str(workdir),
                         compilation_cache_dir=_CACHE["dir"], ray__address=cluster.address,
                         ray__learner_resource=LEARNER_HOST, ray__syncer_resource=SYNCER_HOST)]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT),
                                                                  os.environ.get("PYTHONPATH")])))
  env.pop("XLA_FLAGS", None)  # the command asks for its fake devices itself, as a user's does
  jobs = workdir / "checkpoints" / "job"
  with open(tmp_path / "first.log", "w", encoding="utf-8") as log:
    first = subprocess.Popen(command, cwd=_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (jobs / "16").is_dir() and first.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    assert first.poll() is None, (tmp_path / "first.log").read_text()  # still running
    assert len(_alive_actors()) == 3  # two learners and the syncer
    first.send_signal(signal.SIGKILL)
    first.wait()
  deadline = time.monotonic() + 30
  while _alive_actors() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert _alive_actors() == []  # nothing of the dead command's run is left on the cluster
  newest = max(int(p.name) for p in jobs.iterdir() if p.name.isdigit())
  second = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
  assert second.returncode == 0, second.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  [resume] = summary["resumes"]
  assert resume["from"] == str(jobs / str(newest)) and resume["clock"] == newest >= 16
  assert summary["learner_steps"] == [48, 48] and summary["learner_errors"] == [None, None]
  assert summary["double_merged_offers"] == 0
  token_account_closes(summary)
  assert _alive_actors() == []


@pytest.mark.slow  # the removal test above loses a learner's host in the default suite
def test_node_losses_from_the_chaos_schedule_take_a_learner_s_and_the_syncer_s_hosts_down(
    cluster, tmp_path, monkeypatch):
  """config.chaos's node_loss: the command has learner 1's process take its Ray node down at its
  step 4 (the raylet, the object store and every process on the node go), and the syncer's at
  6 s. Both come back on the spare hosts, as after a host lost for real. Learner 0's process is
  then crashed at its step 40: on another node than the command's, so by its own SIGKILL, never by
  a pid the command signals (a pid names another process, or none, on another machine)."""
  run = train.build(_settings(cluster, tmp_path, num_steps=64, checkpoint__every_steps=8,
                              chaos__schedule="node_loss@learner=1,step=4;"
                                              "node_loss@syncer,second=6;"
                                              "crash@learner=0,step=40,down_s=0"))
  first_learner, first_syncer = run.learners[1].nodes[0], run.syncer.node
  crashed_pid = run.learners[0].pid
  assert run.learners[0].nodes[0] != ray.get_runtime_context().get_node_id()
  signalled = []
  real_kill = os.kill

  def recording_kill(pid, sig):
    signalled.append(pid)
    real_kill(pid, sig)

  monkeypatch.setattr(os, "kill", recording_kill)
  summary = train.execute(run, progress=False)
  monkeypatch.undo()
  assert crashed_pid not in signalled and run.learners[0].incarnation == 1
  alive = _hosts(LEARNER_HOST) | _hosts(SYNCER_HOST)
  assert first_learner not in alive and first_syncer not in alive  # both nodes are dead
  assert run.learners[1].nodes[0] in _hosts(LEARNER_HOST) and run.learners[1].incarnation == 1
  assert run.keeper.syncer.node in _hosts(SYNCER_HOST)
  by_target = {f["learner"]: f for f in summary["faults"]}
  assert by_target[1]["fault"] == by_target[None]["fault"] == "node_loss"
  assert by_target[1]["step"] == 4 and by_target[None]["at_s"] >= 6
  assert by_target[0]["fault"] == "crash" and by_target[0]["step"] == 40
  assert summary["rejoins"] == 2 and summary["syncer_restarts"] == 1
  # (Learner 1 rejoins from learner 0's state, or from Theta alone if learner 0 is down by then.)
  assert sorted(f["learner"] for f in summary["failures"]) == [0, 1]
  assert summary["learner_errors"] == [None, None] and summary["learner_steps"] == [64, 64]
  assert summary["double_merged_offers"] == 0
  token_account_closes(summary)
