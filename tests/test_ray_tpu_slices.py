"""config.ray.tpu_slice on an emulated cluster of TPU VMs (`ray.cluster_utils.Cluster`, loopback
only): each learner is one whole v5p-16 slice, one process per host, and a slice that loses a host
is left whole for the spare.

Each TPU VM is a Ray node that Ray itself takes for one: its TPU_* settings (as GKE sets them on a
TPU VM) are in this process's environment while the node starts, so Ray advertises exactly what
it advertises on a real host (`TPU: 4`, the slice's name, `TPU-v5p-16-head` on worker 0,
`accelerator_type:TPU-V5P`) and sets the same labels (`ray.io/tpu-slice-name`, `-worker-id`,
`-topology`, `-pod-type`). Each host's four chips are four fake CPU devices of its process, which
talk over gloo. The MEGASCALE_* settings of a multislice job are in the environment every node
starts with. Never run on real TPU VMs."""

import contextlib
import os

import pytest

from decoupled_diloco.runtime import train
from decoupled_diloco.runtime.transport import ray_runtime  # sets Ray's loopback variable first
from decoupled_diloco.runtime.transport import ray_tpu_slices
from tests.conftest import act_when
from tests.conftest import ray_node_args
from tests.conftest import remove_ray_node
from tests.conftest import tiny_settings
from tests.conftest import token_account_closes

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

# Nine Ray nodes and five JAX processes started on 2 cores.
pytestmark = pytest.mark.timeout(900)

TPU_SLICE, POD_TYPE, TOPOLOGY, CHIPS_PER_HOST = "v5p:2x2x2", "v5p-16", "2x2x2", 4
SLICES = ("slice-a", "slice-b", "slice-c")  # two learners and a spare


@contextlib.contextmanager
def _environment(**values):
  saved = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key)
      else:
        os.environ[key] = value


def _add_tpu_vm(cluster, slice_name: str, worker: int):
  """A node Ray takes for host `worker` of TPU slice `slice_name`: Ray reads the node's TPU
  settings from this process's environment while it starts it (cluster_utils starts nodes from
  here), and its workers read them from theirs (the slice name, for `reserve_tpu_slice`)."""
  tpu = {"TPU_NAME": slice_name, "TPU_WORKER_ID": str(worker),
         "TPU_ACCELERATOR_TYPE": POD_TYPE, "TPU_TOPOLOGY": TOPOLOGY}
  args = ray_node_args(resources={"TPU": CHIPS_PER_HOST})
  args["env_vars"].update(tpu)
  with _environment(**tpu):
    return cluster.add_node(**args)


@pytest.fixture(scope="module")
def tpu_cluster(tmp_path_factory):
  """A head with no CPU (the driver's node: nothing is placed there), a CPU node for the syncer,
  and three 2-host v5p-16 slices. A lost node is dead to Ray within about two seconds."""
  cache = str(tmp_path_factory.mktemp("ray_jax_cache"))
  from ray.util import tpu as ray_tpu  # pylint: disable=g-import-not-at-top
  megascale = ray_tpu.get_tpu_coordinator_env_vars("127.0.0.1", num_slices=3, slice_id=0)
  with pytest.MonkeyPatch.context() as patch:
    for key, value in megascale.items():
      patch.setenv(key, value)  # every node and its workers start with them
    made = cluster_utils.Cluster(initialize_head=True, head_node_args=dict(
        ray_node_args(num_cpus=0), _system_config={"health_check_period_ms": 500,
                                                   "health_check_failure_threshold": 3}))
    cpu_node = made.add_node(**ray_node_args())
    for name in SLICES:
      for worker in range(2):
        _add_tpu_vm(made, name, worker)
    made.wait_for_nodes()
    ray.init(address=made.address)
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback only
    yield {"cluster": made, "cpu_node": cpu_node.node_id, "cache": cache}
    ray.shutdown()
    made.shutdown()


def _whereabouts(learner) -> list[dict]:
  actors = learner.actor if isinstance(learner.actor, list) else [learner.actor]
  return ray.get([a.whereabouts.remote() for a in actors], timeout=120)


def _one_learner_per_slice(places: list[list[dict]]) -> list[str]:
  """Each learner's processes: on the hosts of one slice, process i on worker i, in a
  jax.distributed job of their own, with no MEGASCALE_* setting. Returns the learners' slices."""
  for m, processes in enumerate(places):
    assert len({p["slice"] for p in processes}) == 1, (m, processes)
    assert [p["worker"] for p in processes] == ["0", "1"], (m, processes)
    assert [(p["process_index"], p["process_count"]) for p in processes] == [(0, 2), (1, 2)]
    assert [p["megascale"] for p in processes] == [{}, {}], (m, processes)
  return [processes[0]["slice"] for processes in places]


def _settings(tpu_cluster, tmp_path, **overrides):
  fields = dict(runtime="ray", num_learners=2, num_steps=32, learner_mesh_shapes=((4, 2),),
                checkpoint__every_steps=0, compilation_cache_dir=tpu_cluster["cache"],
                learner_step_delays_s=(0.3, 0.3), ray__address=tpu_cluster["cluster"].address,
                ray__tpu_slice=TPU_SLICE)
  fields.update(overrides)
  return tiny_settings(tmp_path, **fields)


def _execute(run, monkeypatch):
  """Runs `run` to its end; returns its summary and where every learner process was just
  before the run ended them."""
  last = {}
  real_shutdown = ray_runtime.shutdown

  def shutdown(parts):
    last["places"] = [_whereabouts(l) for l in run.learners]
    real_shutdown(parts)

  monkeypatch.setattr(ray_runtime, "shutdown", shutdown)
  summary = train.execute(run, progress=False)
  return summary, last["places"]


@pytest.mark.slow  # 57 s on 2 cores: four Ray nodes as TPU VMs; the suite keeps the placement tests
def test_each_learner_is_one_slice_and_a_lost_host_moves_it_whole_to_the_spare(
    tpu_cluster, tmp_path, monkeypatch):
  """Two learners, each a v5p-16 slice (a (4, 2) mesh over its 2 hosts' 8 chips). Learner 1's
  worker-1 host is removed at its step 4: its leader's next collective fails, Ray declares the
  host dead, and learner 1 leaves its slice whole for the spare, where it rejoins from learner
  0's state in two new processes. With config.max_restarts=0: a lost slice is no application
  failure, and does not count against it."""
  settings = _settings(tpu_cluster, tmp_path, max_restarts=0)
  assert settings.ray.processes_per_learner == 2  # the slice's hosts
  run = train.build(settings)
  first = _one_learner_per_slice([_whereabouts(l) for l in run.learners])
  assert len(set(first)) == 2 and set(first) < set(SLICES)
  assert run.syncer.node == tpu_cluster["cpu_node"]  # never on a TPU VM
  [spare] = set(SLICES) - set(first)
  lost = {}

  def remove():
    lost["step0"] = run.learners[0].step
    remove_ray_node(tpu_cluster["cluster"], run.learners[1].nodes[1])

  remover = act_when(lambda: run.learners[1].step >= 4, remove)
  summary, last = _execute(run, monkeypatch)
  remover.join()
  assert lost and lost["step0"] < 24  # learner 0 had steps ahead of it
  assert _one_learner_per_slice(last) == [first[0], spare]
  assert [l.incarnation for l in run.learners] == [0, 1]
  assert summary["learner_errors"] == [None, None] and summary["learner_steps"] == [32, 32]
  [failure] = summary["failures"]
  assert failure["learner"] == 1 and failure["cause"] == "lost_slice"
  assert failure["state_from"] == "learner 0"
  assert (summary["rejoins"], summary["lost_slice_failures"],
          summary["application_failures"]) == (1, 1, 0)
  assert summary["double_merged_offers"] == 0 and summary["unmerged_steps_at_end"] == [0, 0]
  token_account_closes(summary)
  assert summary["learner_replicas_agree"] == [True, True]
  assert not ray_tpu_slices.intact(settings.ray.slice, first[1])  # (its host is still gone)


@pytest.mark.slow  # the test above loses a slice in the default suite: ~50 s more here
def test_an_application_failure_on_a_slice_restarts_it_in_place_and_counts(
    tpu_cluster, tmp_path, monkeypatch):
  """config.chaos crashes learner 0 at its step 6 (a SIGKILL of its processes; its hosts live):
  Ray restarts both in their bundles, on the same slice, and learner 0 rejoins there, as
  incarnation 1. That restart counts against config.max_restarts, as any but a lost slice."""
  run = train.build(_settings(tpu_cluster, tmp_path, max_restarts=1,
                              chaos__schedule="crash@learner=0,step=6,down_s=0"))
  first = _one_learner_per_slice([_whereabouts(l) for l in run.learners])
  summary, last = _execute(run, monkeypatch)
  assert _one_learner_per_slice(last) == first
  assert [l.incarnation for l in run.learners] == [1, 0]
  assert summary["learner_errors"] == [None, None] and summary["learner_steps"] == [32, 32]
  [failure] = summary["failures"]
  assert failure["learner"] == 0 and failure["cause"] == "application"
  assert (summary["rejoins"], summary["lost_slice_failures"],
          summary["application_failures"]) == (1, 0, 1)
  assert summary["double_merged_offers"] == 0 and summary["unmerged_steps_at_end"] == [0, 0]
  token_account_closes(summary)


def test_megascale_settings_are_cleared_and_kept_out_of_a_learner_s_runtime_env():
  environ = {"MEGASCALE_NUM_SLICES": "3", "MEGASCALE_SLICE_ID": "0", "TPU_NAME": "slice-a"}
  assert ray_tpu_slices.without_megascale(environ) == {"TPU_NAME": "slice-a"}
  assert ray_tpu_slices.clear_megascale(environ) == ["MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"]
  assert environ == {"TPU_NAME": "slice-a"}
