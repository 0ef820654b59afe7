"""Learners as processes (config.runtime=ray): each learner is a Ray actor with its own JAX.

The learner is the same `Learner` as in the threaded runtime, built by the same
`assembly.learner_parts`, running in a process of its own on its own devices (fake CPU devices are
requested in that process before its JAX starts). This module holds that process
(`LearnerProcess`, the actor's body; `ray_placement.py` places and starts the actors); only the
links differ:

- The syncer's pulls (`LearnerLink.offer`) are actor calls. The answer travels back through Ray's
  object store as host arrays; until it has landed the syncer holds a `messages.PendingAnswer` among
  the round's copying offers, exactly where a threaded learner's copy to host RAM would be: a pull
  never blocks the syncer or the learner. Broadcasts are fire-and-forget actor calls
  (`runtime/transport/ray_links.py`).
- A learner's posts to the syncer (step reports, its end, its exit) and its metrics records wait in
  its process (`ray_plumbing.Mailbox`) until the driver's watcher thread for it collects them (a
  long poll: one call returns as soon as there is something, or after
  `ray_plumbing.LEARNER_POLL_S`), with the learner's `handles.LearnerStatus`, so the supervisor,
  the checkpointer, goodput and the summary read a `RemoteLearner` (`runtime/transport/
  ray_learner.py`) as they read a `Learner`.
- A learner process that dies (SIGKILL, out of memory, a lost host) is restarted by Ray
  (`max_restarts`): its constructor builds a fresh learner that waits. The watcher sees the death as
  the learner's error; the supervisor's rejoin (peer state and Theta, unchanged code) then calls
  `respawn`, which hands the new process its snapshot and the next incarnation.

Fencing: every call the driver makes on a learner's process carries the incarnation the driver
expects there and a MAC (HMAC-SHA256) keyed by a per-job secret that only the driver makes and hands
to its actors. A call without a valid MAC (another driver on the same cluster that looked the actor
up by name) or for another incarnation is rejected, logged and counted (`rejected_calls`); nothing it
carried reaches the learner's state.

A learner over several hosts (config.ray.processes_per_learner = K > 1) is K actors, one per host
(a placement group spreads them over distinct nodes of a cluster), that join a jax.distributed job
of their own and run the same `Learner` in lock-step on the learner's global mesh; the leader,
process 0, proposes at every step boundary what changes their state, and all of them do it
(`learner.ProcessGroup`, `_Agreement`). Broadcasts go to all K. The leader answers a pull at once
from its latest publication; the others then give their pieces of that publication, put together
where the answer lands (`PendingGroup`); a full state (a cut, a peer's rejoin) is captured by all
K at one boundary and put together likewise (`gather_published`). A process that dies or fails
takes the learner's others down (`RemoteLearner._fail`), and the learner rejoins as a whole in K
fresh processes.

The controller stays in the driver's process; the syncer is an actor of its own
(`runtime/transport/ray_syncer.py`).
"""

from __future__ import annotations

import os

# Read by Ray when it is imported: a local cluster then keeps every connection on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import hashlib
import json
import math
import socket
from typing import Any

import jax
import numpy as np
from absl import logging

import decoupled_diloco
from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime.core import agreement as agreement_lib
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.core import learner_state
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.transport import ray_plumbing as plumbing
from decoupled_diloco.runtime.transport import ray_tpu_slices

# Keep a local cluster on loopback (the guide's verified setting) and Ray's token auth on.
# RAY_worker_niceness: Ray starts its workers at nice 15, as background work; a learner or the
# syncer is the job itself, and at 15 it starves behind any other process of the host (under
# load, 3% of a core each: a Ray test that takes 30 s idle took over 10 min). Each worker reads
# it from its own environment (the job's runtime_env), on a cluster too.
LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_worker_niceness": "0"}


def package_root() -> str:
  """The directory that holds the package: first on the workers' PYTHONPATH, so that every actor
  imports this very copy of it, installed or not."""
  return os.path.dirname(os.path.dirname(os.path.abspath(decoupled_diloco.__file__)))


def start_ray(address: str, num_processes: int, num_syncers: int = 1) -> None:
  """Starts a local Ray inside this process (`address` "") or joins a cluster ("auto" or an
  address). A local one listens on loopback only; Ray's own token authentication stays on."""
  import ray  # pylint: disable=g-import-not-at-top
  global _started_here
  if ray.is_initialized():
    return
  for key, value in LOCAL_ENV.items():
    os.environ.setdefault(key, value)
  root = package_root()
  runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
      p for p in (root, os.environ.get("PYTHONPATH", "")) if p), **LOCAL_ENV}}
  if address:
    ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING,
             log_to_driver=True)
  else:
    # One CPU slot per learner process (`num_processes`) and one per syncer process (a shard
    # each, `num_syncers`): Ray does not hold a learner back for want of cores (the processes
    # share this host's cores as the threads did).
    ray.init(num_cpus=num_processes + num_syncers, include_dashboard=False, runtime_env=runtime_env,
             logging_level=logging.WARNING, log_to_driver=True, _node_ip_address="127.0.0.1")
    _started_here = True


def shutdown(learners) -> None:
  """Ends the learners' (and the syncer's) processes, and the local Ray this command started."""
  import ray  # pylint: disable=g-import-not-at-top
  if not ray.is_initialized():
    return
  for part in learners:
    if part is not None:  # (no syncer: a run without one)
      part.end()
  if _started_here:
    ray.shutdown()


_started_here = False  # whether start_ray started the Ray this process uses


def _host(tree: Any) -> Any:
  return jax.tree.map(np.asarray, jax.device_get(tree))




_AGREEMENT_BYTES = 8192  # what a leader's proposal may take (json), sent to every process


class _Agreement:
  """`learner.ProcessGroup` over the learner's own jax.distributed job: the leader's proposal, as
  json bytes, goes to every process with `multihost_utils.broadcast_one_to_all`."""

  def __init__(self, leader: bool):
    self.leader = leader

  def agree(self, proposal: dict[str, Any] | None) -> dict[str, Any]:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    buffer = np.zeros(_AGREEMENT_BYTES, np.uint8)
    if self.leader:
      raw = json.dumps(proposal).encode()
      if len(raw) > _AGREEMENT_BYTES - 4:
        raise ValueError(f"a learner leader's proposal of {len(raw)} bytes exceeds "
                         f"{_AGREEMENT_BYTES - 4}")
      buffer[:4] = np.frombuffer(len(raw).to_bytes(4, "little"), np.uint8)
      buffer[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
    agreed = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    size = int.from_bytes(agreed[:4].tobytes(), "little")
    return json.loads(agreed[4:4 + size].tobytes())


class LearnerProcess:
  """One learner in its own process (the body of the Ray actor; `RemoteLearner` drives it), or
  with config.ray.processes_per_learner > 1 one process of a learner that spans several: process
  0 leads, and all of them run the learner in lock-step (`learner.ProcessGroup`)."""

  def __init__(self, settings: settings_lib.RunSettings, index: int, secret: bytes,
               cut=None, process: int = 0):
    """`cut`: this learner's `checkpoints.LearnerCut` in a resumed run (None: from the seed).
    A process of a multi-process learner builds nothing until `join_group`: its JAX must join
    the learner's jax.distributed job before it starts."""
    # Before anything starts a JAX backend: a TPU VM of a multislice job carries MEGASCALE_*
    # settings (inherited from the raylet), with which libtpu would join every slice into one
    # synchronous job; each learner is a job of its own (ray_tpu_slices.py).
    cleared = ray_tpu_slices.clear_megascale()
    if cleared:
      logging.info("learner %d process %d: cleared %s", index, process, ", ".join(cleared))
    self._settings, self._index, self._secret, self._cut = settings, index, secret, cut
    self._process = process
    self._processes = settings.ray.processes_per_learner
    self.rejected_calls = 0
    self._learner = None
    self._started = False
    if self._processes == 1:
      self._build(cut)

  def _build(self, cut) -> None:
    settings, index = self._settings, self._index
    from decoupled_diloco.lm import model as model_lib  # pylint: disable=g-import-not-at-top
    from decoupled_diloco.runtime import assembly  # pylint: disable=g-import-not-at-top
    shape = settings.learner_mesh_shapes[index]
    if settings.devices.platform == "cpu":
      devices_lib.request_fake_cpu_devices(math.prod(shape) // self._processes)
    assembly.use_compilation_cache(settings.compilation_cache_dir)
    # This process's jax.distributed job is the learner: its devices, one slice, are all its.
    (mesh,), _ = devices_lib.build_meshes((shape,), 0, settings.devices.platform, one_job=True)
    dataset = assembly.load_dataset(settings)
    graphdef, initial = assembly.initial_params(settings, mesh)
    tx = assembly.inner_optimizer(settings)
    train_step, state, shardings, batches, self.compile_s = assembly.learner_parts(
        settings, index, mesh, graphdef, initial, tx, dataset, own_process=True)
    fragments = assembly.make_fragments(settings)
    self._outbox = plumbing.Mailbox(records_wake=False)
    leader = self._process == 0
    group = _Agreement(leader) if self._processes > 1 else None
    # Only the leader of a multi-process learner posts, writes metrics and answers the driver's
    # polls for the learner; the others' state is the same.
    self._make = lambda snap, inc: assembly.make_learner(
        settings, index, train_step=train_step, state=state, shardings=shardings,
        batches=batches, fragments=fragments, syncer=self._outbox if leader else None,
        metrics=self._outbox if leader else None,
        layout=model_lib.param_layout(settings.model), snapshot=snap, incarnation=inc,
        group=group)
    from decoupled_diloco.runtime.records import job_state  # pylint: disable=g-import-not-at-top
    snapshot = job_state.learner_snapshot(cut, state) if cut is not None else None
    self._learner = self._make(snapshot, cut.incarnation if cut is not None else 0)
    self._started = False

  # ---- a learner over several processes --------------------------------------------------------

  def coordinator(self) -> str:
    """The leader: an address for the learner's jax.distributed coordinator (this host, a free
    port)."""
    import ray  # pylint: disable=g-import-not-at-top
    host = ray.util.get_node_ip_address() if self._settings.ray.address else "127.0.0.1"
    with socket.socket() as probe:
      probe.bind((host, 0))
      port = probe.getsockname()[1]
    return f"{host}:{port}"

  def join_group(self, coordinator: str, mac: str) -> int:
    """Joins the learner's jax.distributed job (once per process) and builds the learner on the
    whole mesh. Returns the process id."""
    if not plumbing.mac_ok(self._secret, mac, "join_group", self._index, 0, coordinator):
      self.rejected_calls += 1
      raise plumbing.RejectedCall(f"learner {self._index}: join_group without a valid MAC")
    if self._learner is None:
      if self._settings.devices.platform == "cpu":
        # Before JAX starts its backends (its device count: the actor's XLA_FLAGS).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(coordinator_address=coordinator,
                                 num_processes=self._processes, process_id=self._process,
                                 initialization_timeout=int(5 * plumbing.CALL_TIMEOUT_S))
      self._build(self._cut)
    return os.getpid()

  def offer_part(self, p: int, merged_through: int, incarnation: int, mac: str):
    """The leader of a multi-process learner: a pull, answered at once from its latest
    publication as a learner of one process answers it, with its own pieces of the fragment
    (`learner.local_shards`); the others give theirs of the same publication (`offer_piece`)."""
    self._check(mac, "offer", incarnation, f"{p}")
    answer = self._learner.offer(p, merged_through)
    if isinstance(answer, messages.Offer):
      answer = dataclasses.replace(answer, values=agreement_lib.local_shards(answer.values))
    return answer

  def offer_piece(self, p: int, step: int, publication: int, incarnation: int, mac: str):
    """Another process of a multi-process learner: its pieces of fragment p of the publication
    its leader just answered a pull from; None if it does not hold that publication."""
    self._check(mac, "offer_piece", incarnation, f"{p}:{step}:{publication}")
    offer = self._learner.offer_of(p, step, publication, plumbing.CALL_TIMEOUT_S)
    return None if offer is None else agreement_lib.local_shards(offer.values)

  def group_published(self, full: bool, timeout_s: float, incarnation: int, mac: str):
    """The leader: (boundary, its capture of the whole state there) if `full` (asked for, within
    `timeout_s`) or while one is wanted anyway; otherwise (None, the latest publication without
    its arrays: counters, versions and anchors)."""
    self._check(mac, "published", incarnation)
    learner = self._learner
    if full or learner.wants_full_state():
      # Asked for: the capture of the last boundary or a later one. Wanted anyway: any kept.
      after = learner.boundaries - 1 if full else -1
      found = learner.capture(timeout_s if full else 0.0, after=after)
      if found is not None:
        return found
      if full:
        return None, None
    return None, dataclasses.replace(learner.published, params={}, opt_state=None,
                                     state_step=None)

  def replica_digests(self, incarnation: int, mac: str) -> dict[str, list[str]]:
    """Per piece of each parameter this process holds (name and bounds): the digests of its
    copies, one per device that holds it. The command checks that every copy of a piece, in
    every process of the learner, is the same (`RemoteLearner.check_replicas`)."""
    self._check(mac, "replica_digests", incarnation)
    digests: dict[str, set[str]] = {}
    for name, array in sorted(self._learner.published.params.items()):
      for shard in array.addressable_shards:
        bounds = tuple(sl.indices(n)[:2] for sl, n in zip(shard.index, array.shape))
        data = np.ascontiguousarray(np.asarray(shard.data))
        digests.setdefault(f"{name}{bounds}", set()).add(hashlib.sha256(data.tobytes()).hexdigest())
    return {piece: sorted(d) for piece, d in digests.items()}

  def capture_part(self, boundary: int, timeout_s: float, incarnation: int, mac: str):
    """This process's capture of the whole state at `boundary`, or None if it has none."""
    self._check(mac, "published", incarnation)
    found = self._learner.capture(timeout_s, boundary=boundary)
    return None if found is None else found[1]

  # ---- fencing ---------------------------------------------------------------------------------

  def _check(self, mac: str, method: str, incarnation: int, detail: str = "") -> None:
    if not plumbing.mac_ok(self._secret, mac, method, self._index, incarnation, detail):
      self.rejected_calls += 1
      logging.warning("learner %d: rejected a %s call without a valid MAC (not from this job's "
                      "driver); %d rejected so far", self._index, method, self.rejected_calls)
      raise plumbing.RejectedCall(f"learner {self._index}: {method} without a valid MAC")
    if self._learner is None:
      raise plumbing.RejectedCall(f"learner {self._index}: not built yet (join_group)")
    if incarnation != self._learner.incarnation:
      self.rejected_calls += 1
      logging.warning("learner %d: rejected a %s call for incarnation %d (this is %d)",
                      self._index, method, incarnation, self._learner.incarnation)
      raise plumbing.RejectedCall(
          f"learner {self._index}: {method} for incarnation {incarnation}, this is "
          f"incarnation {self._learner.incarnation}")

  # ---- calls from the driver -------------------------------------------------------------------

  def pid(self) -> int:
    return os.getpid()

  def node(self) -> str:
    """The id of the Ray node (host) this process runs on."""
    import ray  # pylint: disable=g-import-not-at-top
    return ray.get_runtime_context().get_node_id()

  def whereabouts(self) -> dict[str, Any]:
    """Where this process runs and in which job: its TPU slice and worker (Ray's node labels), its
    jax.distributed process index and count once built, and any MEGASCALE_* setting it holds."""
    import ray  # pylint: disable=g-import-not-at-top
    labels = ray.get_runtime_context().get_node_labels()
    built = self._learner is not None
    return {"pid": os.getpid(), "slice": labels.get(ray_tpu_slices.SLICE_NAME_LABEL),
            "worker": labels.get(ray_tpu_slices.WORKER_ID_LABEL),
            "process_index": jax.process_index() if built else None,
            "process_count": jax.process_count() if built else None,
            "megascale": {k: v for k, v in os.environ.items()
                          if k.startswith(ray_tpu_slices.MEGASCALE_PREFIX)}}

  def lose_host(self, incarnation: int, mac: str) -> None:
    """config.chaos's node_loss: this host goes, with every process on it."""
    self._check(mac, "lose_host", incarnation)
    plumbing.take_down_this_node()

  def die(self, incarnation: int, mac: str) -> bool:
    """SIGKILL to this process (RemoteLearner.kill, where the process is on another node than the
    command's). False, and it lives: the call was for another incarnation, or not the driver's."""
    try:
      self._check(mac, "die", incarnation)
    except plumbing.RejectedCall:
      return False  # said by _check's warning; a fire-and-forget call has no reader for it
    plumbing.die_here()
    return True

  def start(self, incarnation: int, mac: str) -> None:
    self._check(mac, "start", incarnation)
    if not self._started:
      self._started = True
      self._learner.start()

  def restore(self, snapshot: learner_state.LearnerSnapshot, incarnation: int, mac: str) -> int:
    """A rejoin: the next incarnation from `snapshot` (a fresh process, or one whose learner
    failed). Returns the process id."""
    if not plumbing.mac_ok(self._secret, mac, "restore", self._index, incarnation):
      self._check(mac, "restore", incarnation)  # counts and raises
    old = self._learner
    old.stop()
    old.join(timeout=30)
    self._learner = self._make(snapshot, incarnation)
    self._started = False
    return os.getpid()

  def offer(self, p: int, merged_through: int, incarnation: int, mac: str):
    self._check(mac, "offer", incarnation, f"{p}")
    answer = self._learner.offer(p, merged_through)
    if isinstance(answer, messages.Offer):
      # Delta_m in the wire format, encoded here: what crosses the network is what the syncer
      # counts (summary.json's bytes_learner_to_syncer), as a learner's host would send it.
      compression = self._settings.compression
      answer = answer.for_the_wire(compression.outer_grad, compression.block_size)
    return answer

  def deliver(self, broadcast: messages.Broadcast, incarnation: int, mac: str) -> bool:
    """Fire-and-forget: a rejected call returns False (logged and counted) instead of raising,
    which nobody would read."""
    try:
      self._check(mac, "deliver", incarnation, f"{broadcast.fragment}:{broadcast.version}")
    except plumbing.RejectedCall:
      return False
    self._learner.deliver(broadcast)
    return True

  def want_full_state(self, seconds: float, incarnation: int, mac: str) -> bool:
    try:
      self._check(mac, "want_full_state", incarnation)
    except plumbing.RejectedCall:
      return False
    self._learner.want_full_state(seconds)
    return True

  def published(self, full: bool, timeout_s: float, incarnation: int, mac: str):
    """The latest publication in host arrays (with the optimizer state if `full`), or None."""
    self._check(mac, "published", incarnation)
    learner = self._learner
    published = learner.full_publication(timeout_s) if full else learner.published
    if published is None:
      return None
    return dataclasses.replace(published, params=_host(published.params),
                               opt_state=_host(published.opt_state),
                               state_step=_host(published.state_step))

  def training(self, incarnation: int, mac: str) -> bool:
    """Whether the latest publication is of a learner still training (the syncer's attach)."""
    self._check(mac, "training", incarnation)
    return self._learner.training

  def stop(self, incarnation: int, mac: str) -> None:
    self._check(mac, "stop", incarnation)
    self._learner.stop()

  def release(self, incarnation: int, mac: str) -> None:
    self._check(mac, "release", incarnation)
    self._learner.release()

  def poll(self, timeout_s: float) -> dict[str, Any]:
    """What happened since the last poll: posts, metrics records, and the learner's status."""
    posts, records = self._outbox.take(timeout_s)
    learner = self._learner
    # Whether it lives is read before its status: a thread that applies the flush's broadcast and
    # ends between the two would otherwise leave the watcher its counters from before the apply
    # (summary.json's unmerged_at_end counted merged tokens again).
    alive = learner.alive or not self._started
    return {"status": learner.status(), "posts": posts, "records": records,
            "thread_alive": alive, "rejected_calls": self.rejected_calls}
