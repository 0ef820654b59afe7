"""Learners as processes (config.runtime=ray): each learner is a Ray actor with its own JAX.

The learner is the same `Learner` as in the threaded runtime, built by the same
`assembly.learner_parts`, running in a process of its own on its own devices (fake CPU devices are
requested in that process before its JAX starts). Only the links differ:

- The syncer's pulls (`LearnerLink.offer`) are actor calls. The answer travels back through Ray's
  object store as host arrays; until it has landed the syncer holds a `messages.PendingAnswer` among
  the round's copying offers, exactly where a threaded learner's copy to host RAM would be: a pull
  never blocks the syncer or the learner. Broadcasts are fire-and-forget actor calls.
- A learner's posts to the syncer (step reports, its end, its exit) and its metrics records wait in
  its process until the driver's watcher thread for it collects them (a long poll: one call returns
  as soon as there is something, or after `_POLL_S`); the watcher also mirrors the counters and
  timestamps the controller reads (step, step times, losses, errors), so the supervisor, the
  checkpointer, goodput and the summary read a `RemoteLearner` as they read a `Learner`.
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

import collections  # pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import hashlib
import hmac
import json
import math
import secrets
import signal
import socket
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.faults import injector as injector_lib
from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.core import messages

_POLL_S = 0.2  # the longest a watcher's call waits in the learner's process for news
_CALL_TIMEOUT_S = 120.0  # a blocking call on a learner's process (state for a rejoin or a cut)
# Keep a local cluster on loopback (the guide's verified setting) and Ray's token auth on.
# RAY_worker_niceness: Ray starts its workers at nice 15, as background work; a learner or the
# syncer is the job itself, and at 15 it starves behind any other process of the host (under
# load, 3% of a core each: a Ray test that takes 30 s idle took over 10 min). Each worker reads
# it from its own environment (the job's runtime_env), on a cluster too.
LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_worker_niceness": "0"}


class RejectedCall(Exception):
  """A call on a learner's process without a valid MAC, or for another incarnation."""


def sign(secret: bytes, method: str, learner: int, incarnation: int, detail: str = "") -> str:
  """The MAC a call carries: over what it does, to whom, and which incarnation it expects."""
  text = f"{method}|{learner}|{incarnation}|{detail}".encode()
  return hmac.new(secret, text, hashlib.sha256).hexdigest()


def start_ray(address: str, num_processes: int) -> None:
  """Starts a local Ray inside this process (`address` "") or joins a cluster ("auto" or an
  address). A local one listens on loopback only; Ray's own token authentication stays on."""
  import ray  # pylint: disable=g-import-not-at-top
  global _started_here
  if ray.is_initialized():
    return
  for key, value in LOCAL_ENV.items():
    os.environ.setdefault(key, value)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
      p for p in (root, os.environ.get("PYTHONPATH", "")) if p), **LOCAL_ENV}}
  if address:
    ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING,
             log_to_driver=True)
  else:
    # One CPU slot per learner process (`num_processes`) and one for the syncer: Ray does not
    # hold a learner back for want of cores (the processes share this host's cores as the
    # threads did).
    ray.init(num_cpus=num_processes + 1, include_dashboard=False, runtime_env=runtime_env,
             logging_level=logging.WARNING, log_to_driver=True, _node_ip_address="127.0.0.1")
    _started_here = True


def shutdown(learners) -> None:
  """Ends the learners' (and the syncer's) processes, and the local Ray this command started."""
  import ray  # pylint: disable=g-import-not-at-top
  if not ray.is_initialized():
    return
  for part in learners:
    if hasattr(part, "end"):
      part.end()
  if _started_here:
    ray.shutdown()


_started_here = False  # whether start_ray started the Ray this process uses


def _host(tree: Any) -> Any:
  return jax.tree.map(np.asarray, jax.device_get(tree))


class _Outbox:
  """The learner's `SyncerLink` in its process: posts wait here for the driver's watcher."""

  def __init__(self):
    self._posts: collections.deque = collections.deque()
    self._records: collections.deque = collections.deque()
    self.news = threading.Condition()

  def post(self, message: Any) -> None:
    with self.news:
      self._posts.append(message)
      self.news.notify_all()

  def write(self, kind: str, record: dict[str, Any], *, step: int | None = None,
            scalars: dict[str, float] | None = None) -> None:
    """The learner's metrics writer: its records go to the driver's metrics.jsonl."""
    with self.news:
      self._records.append((kind, record, step, scalars))

  def take(self, timeout_s: float) -> tuple[list, list]:
    with self.news:
      if not self._posts:
        self.news.wait(timeout_s)
      posts, records = list(self._posts), list(self._records)
      self._posts.clear()
      self._records.clear()
    return posts, records


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
    (mesh,), _ = devices_lib.build_meshes((shape,), 0, settings.devices.platform)
    dataset = assembly.load_dataset(settings)
    graphdef, initial = assembly.initial_params(settings, mesh)
    tx = assembly.inner_optimizer(settings)
    train_step, state, shardings, batches, self.compile_s = assembly.learner_parts(
        settings, index, mesh, graphdef, initial, tx, dataset, own_process=True)
    fragments = assembly.make_fragments(settings)
    self._outbox = _Outbox()
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
    if not hmac.compare_digest(mac, sign(self._secret, "join_group", self._index, 0,
                                         coordinator)):
      self.rejected_calls += 1
      raise RejectedCall(f"learner {self._index}: join_group without a valid MAC")
    if self._learner is None:
      if self._settings.devices.platform == "cpu":
        # Before JAX starts its backends (its device count: the actor's XLA_FLAGS).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(coordinator_address=coordinator,
                                 num_processes=self._processes, process_id=self._process,
                                 initialization_timeout=int(5 * _CALL_TIMEOUT_S))
      self._build(self._cut)
    return os.getpid()

  def offer_part(self, p: int, merged_through: int, incarnation: int, mac: str):
    """The leader of a multi-process learner: a pull, answered at once from its latest
    publication as a learner of one process answers it, with its own pieces of the fragment
    (`learner.local_shards`); the others give theirs of the same publication (`offer_piece`)."""
    self._check(mac, "offer", incarnation, f"{p}")
    answer = self._learner.offer(p, merged_through)
    if isinstance(answer, messages.Offer):
      answer = dataclasses.replace(answer, values=learner_lib.local_shards(answer.values))
    return answer

  def offer_piece(self, p: int, step: int, publication: int, incarnation: int, mac: str):
    """Another process of a multi-process learner: its pieces of fragment p of the publication
    its leader just answered a pull from; None if it does not hold that publication."""
    self._check(mac, "offer_piece", incarnation, f"{p}:{step}:{publication}")
    offer = self._learner.offer_of(p, step, publication, _CALL_TIMEOUT_S)
    return None if offer is None else learner_lib.local_shards(offer.values)

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
    expected = sign(self._secret, method, self._index, incarnation, detail)
    if not hmac.compare_digest(mac, expected):
      self.rejected_calls += 1
      logging.warning("learner %d: rejected a %s call without a valid MAC (not from this job's "
                      "driver); %d rejected so far", self._index, method, self.rejected_calls)
      raise RejectedCall(f"learner {self._index}: {method} without a valid MAC")
    if self._learner is None:
      raise RejectedCall(f"learner {self._index}: not built yet (join_group)")
    if incarnation != self._learner.incarnation:
      self.rejected_calls += 1
      logging.warning("learner %d: rejected a %s call for incarnation %d (this is %d)",
                      self._index, method, incarnation, self._learner.incarnation)
      raise RejectedCall(f"learner {self._index}: {method} for incarnation {incarnation}, this is "
                         f"incarnation {self._learner.incarnation}")

  # ---- calls from the driver -------------------------------------------------------------------

  def pid(self) -> int:
    return os.getpid()

  def start(self, incarnation: int, mac: str) -> None:
    self._check(mac, "start", incarnation)
    if not self._started:
      self._started = True
      self._learner.start()

  def restore(self, snapshot: learner_lib.LearnerSnapshot, incarnation: int, mac: str) -> int:
    """A rejoin: the next incarnation from `snapshot` (a fresh process, or one whose learner
    failed). Returns the process id."""
    if not hmac.compare_digest(mac, sign(self._secret, "restore", self._index, incarnation)):
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
      # Host arrays: the object store carries them to the syncer's process.
      answer = dataclasses.replace(answer, values={n: np.asarray(v, np.float32)
                                                   for n, v in answer.values.items()})
    return answer

  def deliver(self, broadcast: messages.Broadcast, incarnation: int, mac: str) -> bool:
    """Fire-and-forget: a rejected call returns False (logged and counted) instead of raising,
    which nobody would read."""
    try:
      self._check(mac, "deliver", incarnation, f"{broadcast.fragment}:{broadcast.version}")
    except RejectedCall:
      return False
    self._learner.deliver(broadcast)
    return True

  def want_full_state(self, seconds: float, incarnation: int, mac: str) -> bool:
    try:
      self._check(mac, "want_full_state", incarnation)
    except RejectedCall:
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
    # One instant for the accounting: the latest publication's counters, steps and discards (a
    # process lost after this poll loses what it did since; reading the live fields one by one
    # could count a step made in between in one and not in the other).
    published = learner.published
    error = learner.error
    return {
        "incarnation": learner.incarnation, "posts": posts, "records": records,
        "step": learner.step, "steps_made": published.steps_made,
        "start_step": learner.start_step,
        "losses": len(learner.losses), "new_losses": list(learner.losses[-64:]),
        "step_times": list(learner.step_times[-64:]), "step_ends": list(learner.step_ends[-64:]),
        "num_steps_done": len(learner.step_times),
        "first_step_done_at": learner.first_step_done_at,
        "train_started_at": learner.train_started_at, "failed_at": learner.failed_at,
        "error": None if error is None else repr(error),
        "finished_training": learner.finished_training.is_set(),
        "thread_alive": learner.alive or not self._started,
        "discarded_fragment_tokens": published.discarded_fragment_tokens,
        "discarded_fragment_steps": published.discarded_fragment_steps,
        "barrier_wait_s": learner.barrier_wait_s,
        "counters": (published.counter_steps, published.counter_tokens,
                     published.anchor_versions),
        "data_state": published.data_state, "published_step": published.step,
        "offers_made": learner.offers_made, "rejected_calls": self.rejected_calls,
    }


@dataclasses.dataclass(frozen=True)
class RemoteDevice:
  """What the controller reads of a device in a learner's process: its kind (memory: unknown)."""

  device_kind: str

  def memory_stats(self) -> None:
    return None


class ProcessDied(RuntimeError):
  """A learner's or the syncer's process is gone (killed, out of memory, its host lost)."""


class LearnerProcessDied(ProcessDied):
  """The learner's process is gone."""


class PendingRay(messages.PendingAnswer):
  """An actor call's answer to a pull, on its way through the object store."""

  def __init__(self, ref):
    self._ref = ref

  @property
  def in_host_memory(self) -> bool:
    import ray  # pylint: disable=g-import-not-at-top
    ready, _ = ray.wait([self._ref], timeout=0, fetch_local=True)
    return bool(ready)

  def result(self) -> messages.Offer | messages.Answer:
    import ray  # pylint: disable=g-import-not-at-top
    try:
      return ray.get(self._ref, timeout=_CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      return messages.Answer.UNREACHABLE  # the process died or refused: ask again later


class PendingGroup(messages.PendingAnswer):
  """A multi-process learner's answer to a pull, on its way: the leader's answer, then the other
  processes' pieces of the same publication, put together."""

  def __init__(self, actors, p: int, merged_through: int, incarnation: int, sign_call):
    """`sign_call(method, detail)`: a call's MAC."""
    self._actors, self._p, self._incarnation, self._sign = actors, p, incarnation, sign_call
    self._leader = actors[0].offer_part.remote(p, merged_through, incarnation,
                                               sign_call("offer", f"{p}"))
    self._pieces = None  # refs of the other processes' pieces, once the leader has answered
    self._answer = None

  def _leader_answered(self) -> bool:
    """Whether the leader has answered (then the others are asked for their pieces)."""
    import ray  # pylint: disable=g-import-not-at-top
    if self._answer is not None:
      return True
    ready, _ = ray.wait([self._leader], timeout=0, fetch_local=True)
    if not ready:
      return False
    self._take_leader(timeout=0)
    return True

  def _take_leader(self, timeout: float) -> None:
    import ray  # pylint: disable=g-import-not-at-top
    try:
      self._answer = ray.get(self._leader, timeout=timeout)
    except Exception:  # pylint: disable=broad-except
      self._answer = messages.Answer.UNREACHABLE
    if isinstance(self._answer, messages.Offer):
      step, publication = self._answer.step, self._answer.publication
      mac = self._sign("offer_piece", f"{self._p}:{step}:{publication}")
      self._pieces = [a.offer_piece.remote(self._p, step, publication, self._incarnation, mac)
                      for a in self._actors[1:]]

  @property
  def in_host_memory(self) -> bool:
    import ray  # pylint: disable=g-import-not-at-top
    if not self._leader_answered():
      return False
    if self._pieces is None:
      return True  # STALE, NOTHING or unreachable: nothing more to fetch
    ready, _ = ray.wait(self._pieces, num_returns=len(self._pieces), timeout=0, fetch_local=True)
    return len(ready) == len(self._pieces)

  def result(self) -> messages.Offer | messages.Answer:
    import ray  # pylint: disable=g-import-not-at-top
    if self._answer is None:
      self._take_leader(timeout=_CALL_TIMEOUT_S)
    first = self._answer
    if not isinstance(first, messages.Offer):
      return first
    try:
      pieces = ray.get(self._pieces, timeout=_CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      pieces = [None]
    if any(piece is None for piece in pieces):
      # Another process lost the publication or died. The leader recorded the take; a merge
      # without this offer treats its steps as not merged, as after any lost answer.
      return messages.Answer.UNREACHABLE
    values = learner_lib.assemble([first.values, *pieces])
    return dataclasses.replace(first, values={n: np.asarray(v, np.float32)
                                              for n, v in values.items()})


def gather_published(actors, full: bool, timeout_s: float, sign_call
                     ) -> messages.Publication | None:
  """A multi-process learner's publication: the leader's, with the whole state put together from
  every process's capture of the same boundary when there is one (`full`: asked for). None if a
  full one could not be had within `timeout_s`. `sign_call(method)` gives a call's incarnation
  and MAC."""
  import ray  # pylint: disable=g-import-not-at-top
  boundary, published = ray.get(actors[0].group_published.remote(
      full, timeout_s, *sign_call("published")), timeout=timeout_s + _CALL_TIMEOUT_S)
  if boundary is None:
    return published
  parts = [published] + ray.get(
      [a.capture_part.remote(boundary, timeout_s, *sign_call("published")) for a in actors[1:]],
      timeout=timeout_s + _CALL_TIMEOUT_S)
  if any(part is None for part in parts):
    return None if full else dataclasses.replace(published, params={}, opt_state=None,
                                                 state_step=None)
  return dataclasses.replace(
      published, params=learner_lib.assemble([part.params for part in parts]),
      opt_state=learner_lib.assemble([part.opt_state for part in parts]),
      state_step=learner_lib.assemble([part.state_step for part in parts]))


def wait_until_up(actor, name: str, timeout_s: float = 5 * _CALL_TIMEOUT_S) -> int:
  """Waits while Ray restarts an actor's process (its constructor builds afresh); returns its
  pid."""
  import ray  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      return ray.get(actor.pid.remote(), timeout=timeout_s)
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
      if time.monotonic() > deadline:
        raise RuntimeError(f"{name}: its process did not come back within {timeout_s} s")
      time.sleep(0.2)


class ActorLearnerLink:
  """The syncer's `LearnerLink` to a learner process (used in the syncer's process): signed actor
  calls, answers through the object store."""

  def __init__(self, actor, index: int, incarnation: int, secret: bytes, num_fragments: int):
    """`actor`: the learner's actor, or the list of its processes' actors (leader first)."""
    self._actors = list(actor) if isinstance(actor, (list, tuple)) else [actor]
    self._actor, self._index, self._incarnation, self._secret = (
        self._actors[0], index, incarnation, secret)
    self._num_fragments = num_fragments

  def _mac(self, method: str, detail: str = "") -> str:
    return sign(self._secret, method, self._index, self._incarnation, detail)

  def offer(self, p: int, merged_through: int) -> messages.PendingAnswer:
    if len(self._actors) > 1:
      return PendingGroup(self._actors, p, merged_through, self._incarnation, self._mac)
    return PendingRay(self._actor.offer.remote(p, merged_through, self._incarnation,
                                               self._mac("offer", f"{p}")))

  def deliver(self, broadcast: messages.Broadcast) -> None:
    mac = self._mac("deliver", f"{broadcast.fragment}:{broadcast.version}")
    for actor in self._actors:  # every process of the learner; its leader says when to apply it
      actor.deliver.remote(broadcast, self._incarnation, mac)

  def want_full_state(self, seconds: float) -> None:
    self._actor.want_full_state.remote(seconds, self._incarnation, self._mac("want_full_state"))

  @property
  def published(self) -> messages.Publication:
    """The learner's latest publication; while its process is down or restarting (a checkpoint's
    cut may ask meanwhile), a stand-in with no state and no Theta_p version, which no cut takes."""
    import ray  # pylint: disable=g-import-not-at-top
    try:
      if len(self._actors) > 1:
        return gather_published(self._actors, False, 0.0,
                                lambda method: (self._incarnation, self._mac(method)))
      return ray.get(self._actor.published.remote(False, 0.0, self._incarnation,
                                                  self._mac("published")), timeout=_CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      none = np.zeros(self._num_fragments, np.int64)
      return messages.Publication(
          step=-1, params={}, since=none, counter_steps=none, counter_tokens=none,
          anchor_versions=np.full(self._num_fragments, -1, np.int64), anchors={}, training=True)


class RemoteLearner:
  """The driver's handle on a learner process: a `LearnerLink` for the syncer, and the view of a
  `Learner` that the controller, the supervisor and the summary read (kept by a watcher thread)."""

  def __init__(self, index: int, actor, *, secret: bytes, port, metrics, layout, like,
               num_devices: int, device_kind: str, incarnation: int = 0, pid=None,
               data_state: bytes | None = None, step_hook=None, placement=None):
    """`actor`, `pid`: the learner's process, or the lists of its processes (leader first)."""
    self.index, self.incarnation = index, incarnation
    self._actors = list(actor) if isinstance(actor, (list, tuple)) else [actor]
    self.pids = list(pid) if isinstance(pid, (list, tuple)) else [pid]
    self._actor, self._secret, self._port, self._metrics = self._actors[0], secret, port, metrics
    self.layout, self.state_like = layout, like
    self.num_devices, self.device_kind = num_devices, device_kind
    self.pid = self.pids[0]
    self._placement = placement  # a multi-process learner's placement group (all incarnations)
    self.step = self.start_step = self.steps_made = 0
    self.losses: list[float] = []
    self.step_times: list[float] = []
    self.step_ends: list[float] = []
    self.first_step_done_at = self.train_started_at = self.failed_at = None
    self.error: BaseException | None = None
    self.finished_training = threading.Event()
    self.discarded_fragment_tokens = self.discarded_fragment_steps = 0
    self.barrier_wait_s = 0.0
    self.barrier_waits: list[tuple[float, float]] = []
    self.rejected_calls = 0
    self.replicas_agree: bool | None = None  # check_replicas
    self._counters = None
    self._offers_made = None
    self.data_state = data_state
    self._up_ref = None  # a pid call in flight (process_up)
    # config.chaos: called as hook(learner, step) for each step the watcher sees; a crash it
    # raises (injector.LearnerFailure) becomes a SIGKILL of the learner's process.
    self._step_hook = step_hook
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._watch, name=f"watch-learner-{index}", daemon=True)
    # A multi-process learner: a watcher per other process, which fails the learner if that
    # process dies or fails.
    self._others = [threading.Thread(target=self._watch_other, args=(i,), daemon=True,
                                     name=f"watch-learner-{index}-{i}")
                    for i in range(1, len(self._actors))]
    self._refresh(self._call_get("poll", 0.0))

  # ---- calls -----------------------------------------------------------------------------------

  def _mac(self, method: str, detail: str = "") -> str:
    return sign(self._secret, method, self.index, self.incarnation, detail)

  def _call(self, method: str, *args, detail: str = ""):
    fn = getattr(self._actor, method)
    if method == "poll":
      return fn.remote(*args)
    return fn.remote(*args, self.incarnation, self._mac(method, detail))

  def _call_get(self, method: str, *args, detail: str = "", timeout: float = _CALL_TIMEOUT_S):
    import ray  # pylint: disable=g-import-not-at-top
    return ray.get(self._call(method, *args, detail=detail), timeout=timeout)

  @property
  def actor(self):
    """The learner's actor, or its processes' actors (the syncer's process calls it through an
    `ActorLearnerLink`)."""
    return self._actor if len(self._actors) == 1 else list(self._actors)

  def _signed(self, method: str) -> tuple[int, str]:
    return self.incarnation, self._mac(method)

  @property
  def published(self) -> messages.Publication:
    """The latest publication, read from the learner's process. While that process is down or
    restarting (the syncer may ask for a checkpoint's cut meanwhile): a stand-in that holds no
    state and no Theta_p version, so no cut can include it."""
    try:
      if len(self._actors) > 1:
        return gather_published(self._actors, False, 0.0, self._signed)
      return self._call_get("published", False, 0.0)
    except Exception:  # pylint: disable=broad-except
      steps, tokens, versions = self._counters
      return messages.Publication(
          step=self.step, params={}, since=np.full_like(steps, self.step), counter_steps=steps,
          counter_tokens=tokens, anchor_versions=np.full_like(versions, -1), anchors={},
          training=not self.finished_training.is_set())

  def full_publication(self, timeout_s: float) -> messages.Publication | None:
    try:
      if len(self._actors) > 1:
        return gather_published(self._actors, True, timeout_s, self._signed)
      return self._call_get("published", True, timeout_s, timeout=timeout_s + _CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      return None  # the peer died meanwhile

  # ---- the Learner view ------------------------------------------------------------------------

  def start(self) -> None:
    import ray  # pylint: disable=g-import-not-at-top
    ray.get([a.start.remote(self.incarnation, self._mac("start")) for a in self._actors],
            timeout=_CALL_TIMEOUT_S)
    self._thread.start()
    for thread in self._others:
      thread.start()

  def stop(self) -> None:
    try:
      self._call("stop")
    except Exception:  # pylint: disable=broad-except
      pass
    self._stopped.set()

  def release(self) -> None:
    self._call("release")

  def join(self, timeout: float | None = None) -> None:
    if self._thread.ident is not None:
      self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None

  @property
  def mesh_devices(self) -> list[RemoteDevice]:
    return [RemoteDevice(self.device_kind)] * self.num_devices

  def counters(self) -> learner_lib.Counters:
    return learner_lib.Counters(*self._counters)

  @property
  def offers_made(self) -> np.ndarray:
    return np.asarray(self._offers_made).copy()

  def params(self):
    if len(self._actors) > 1:
      return self.full_publication(_CALL_TIMEOUT_S).params
    return self._call_get("published", False, 0.0).params

  # The event tape: a learner process records no takes or applies yet (runtime/records/event_tape.py
  # refuses such a tape), so neither its respawn nor the batches it took are recorded.
  batches_taken = None

  def tape_respawn(self, **fields) -> None:
    del fields

  def data_position(self) -> bytes | None:
    """The data position of the latest publication the watcher saw (a checkpoint cut without
    this learner keeps it). A process may have read a step or two past it, or died: the driver
    cannot read a dead process's loader, so a resumed run may read those batches again."""
    return self.data_state

  def respawn(self, snapshot: learner_lib.LearnerSnapshot) -> "RemoteLearner":
    """The next incarnation, in this learner's process (Ray restarted it if it died)."""
    if snapshot.data_state is None:
      # A new process has a fresh loader: go on from the position the last publication had.
      snapshot = dataclasses.replace(snapshot, data_state=self.data_state)
    incarnation = self.incarnation + 1
    import ray  # pylint: disable=g-import-not-at-top
    for actor in self._actors:
      wait_until_up(actor, f"learner {self.index}")
    if len(self._actors) > 1:
      # Fresh processes (a failure ends all of them, `_fail`): a new jax.distributed job.
      join_group(self._actors, self.index, self._secret)
    mac = sign(self._secret, "restore", self.index, incarnation)
    pids = ray.get([a.restore.remote(snapshot, incarnation, mac) for a in self._actors],
                   timeout=_CALL_TIMEOUT_S * 5)
    for i, pid in enumerate(pids):
      logging.info("learner %d pid %d (incarnation %d%s)", self.index, pid, incarnation,
                   f", process {i} of {len(pids)}" if len(pids) > 1 else "")
    return RemoteLearner(self.index, self.actor, secret=self._secret, port=self._port,
                         metrics=self._metrics, layout=self.layout, like=self.state_like,
                         num_devices=self.num_devices, device_kind=self.device_kind,
                         incarnation=incarnation, pid=pids, data_state=snapshot.data_state,
                         step_hook=self._step_hook, placement=self._placement)

  def process_up(self) -> bool:
    """Whether this learner's process answers (after a death: whether Ray has restarted it and its
    constructor has built a fresh learner). Never blocks: the supervisor polls it as the repair
    time, so a rejoin takes its peer's state once there is a process to hand it to."""
    import ray  # pylint: disable=g-import-not-at-top
    if self._up_ref is None:
      self._up_ref = [a.pid.remote() for a in self._actors]
    ready, _ = ray.wait(self._up_ref, num_returns=len(self._up_ref), timeout=0)
    if len(ready) < len(self._up_ref):
      return False
    refs, self._up_ref = self._up_ref, None
    try:
      ray.get(refs, timeout=0)
      return True
    except Exception:  # pylint: disable=broad-except
      return False  # still restarting: ask again at the next poll

  def end(self) -> None:
    """Stops watching and ends the learner's process (the run is over)."""
    import ray  # pylint: disable=g-import-not-at-top
    self._stopped.set()
    for actor in self._actors:
      ray.kill(actor, no_restart=True)
    if self._placement is not None:
      from ray.util import remove_placement_group  # pylint: disable=g-import-not-at-top
      remove_placement_group(self._placement)  # its CPUs back to the cluster

  def kill(self) -> None:
    """SIGKILL to the learner's process (all of them), as a user's `kill -9` or the OOM killer
    would."""
    for pid in self.pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass  # gone already

  def check_replicas(self) -> bool | None:
    """A multi-process learner after its last step: whether every copy of every piece of its
    parameters, on every device of every process, is the same (processes that applied a merge at
    different steps would hold different copies, and train on silently). Sets `replicas_agree`;
    None for a learner of one process, or one that failed."""
    import ray  # pylint: disable=g-import-not-at-top
    if len(self._actors) == 1 or self.error is not None:
      return None
    try:
      parts = ray.get([a.replica_digests.remote(self.incarnation, self._mac("replica_digests"))
                       for a in self._actors], timeout=_CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      return None
    copies: dict[str, set[str]] = {}
    for part in parts:
      for piece, digests in part.items():
        copies.setdefault(piece, set()).update(digests)
    differ = sorted(piece for piece, digests in copies.items() if len(digests) > 1)
    self.replicas_agree = not differ
    if differ:
      logging.error("learner %d: its processes hold different copies of %d parameter piece(s), "
                    "e.g. %s", self.index, len(differ), differ[:3])
    return self.replicas_agree

  def _fail(self, error: BaseException, *, say_exit: bool = True) -> None:
    """The learner's process died or failed: it trains no more, and the syncer hears of its exit.
    A multi-process learner's other processes, which would wait for the lost one in their next
    agreement or collective, are ended too; Ray restarts all of them, and the learner rejoins as
    a whole (a new jax.distributed job)."""
    if self.error is None:
      self.failed_at = self.failed_at or time.monotonic()
      self.error = error
      if say_exit:
        # What a failed learner thread posts last, said for a process that cannot say it (killed,
        # or about to be ended with its group): the syncer stops counting on it, and its final
        # flush does not wait for a learner that was given up (config.max_restarts).
        self._port.post(messages.LearnerExit(self.index, self.step, repr(error),
                                             self.incarnation))
      if len(self._actors) > 1:
        logging.warning("%s; ending its other processes (pids %s)", error, self.pids)
      else:
        logging.warning("%s", error)
    # As a failed learner thread does: it trains no more. (Without this, a learner given up after
    # config.max_restarts kept the run waiting for its last step forever.)
    self.finished_training.set()
    if len(self._actors) > 1:
      self.kill()

  def _watch_other(self, i: int) -> None:
    """Watches process i of a multi-process learner (its leader's watcher reads the rest)."""
    import ray  # pylint: disable=g-import-not-at-top
    actor = self._actors[i]
    while not self._stopped.is_set() and self.error is None:
      try:
        status = ray.get(actor.poll.remote(_POLL_S), timeout=_CALL_TIMEOUT_S)
      except Exception as err:  # pylint: disable=broad-except
        if not self._stopped.is_set():
          self._fail(LearnerProcessDied(
              f"learner {self.index} (incarnation {self.incarnation}): its process {i}, pid "
              f"{self.pids[i]}, is gone ({type(err).__name__})"))
        return
      if status["incarnation"] != self.incarnation:
        continue
      if status["error"] is not None:
        self._fail(RuntimeError(f"learner {self.index} process {i}: {status['error']}"))
        return
      if not status["thread_alive"]:
        return

  # ---- the watcher -----------------------------------------------------------------------------

  def _watch(self) -> None:
    while not self._stopped.is_set():
      try:
        status = self._call_get("poll", _POLL_S, timeout=_CALL_TIMEOUT_S)
      except Exception as err:  # pylint: disable=broad-except
        if self._stopped.is_set():
          return
        self._fail(LearnerProcessDied(
            f"learner {self.index} (incarnation {self.incarnation}, pid {self.pid}): its process "
            f"is gone ({type(err).__name__})"))
        return
      if status["incarnation"] != self.incarnation:
        continue  # the process was restored for a later incarnation: this view is retired
      seen = self.step
      self._refresh(status)
      if self._step_hook is not None and self.step != seen and self.pid is not None:
        try:
          self._step_hook(self.index, self.step)
        except injector_lib.LearnerFailure as failure:
          logging.warning("%s: SIGKILL to its process, pid %d", failure, self.pid)
          self.kill()
      for message in status["posts"]:
        self._port.post(message)
      for kind, record, step, scalars in status["records"]:
        self._metrics.write(kind, record, step=step, scalars=scalars)
      if status["error"] is not None:
        # Its process posted the learner's exit itself (forwarded above).
        self._fail(RuntimeError(status["error"]), say_exit=False)
        return
      if not status["thread_alive"]:
        return  # ended (released after the flush)

  def _refresh(self, status: dict[str, Any]) -> None:
    done = status["num_steps_done"]
    new = done - len(self.step_times)
    if new > 0:
      self.step_times.extend(status["step_times"][-new:])
      self.step_ends.extend(status["step_ends"][-new:])
    new_losses = status["losses"] - len(self.losses)
    if new_losses > 0:
      self.losses.extend(status["new_losses"][-new_losses:])
    self.step, self.steps_made = status["step"], status["steps_made"]
    self.start_step = status["start_step"]
    self.first_step_done_at = status["first_step_done_at"]
    self.train_started_at = status["train_started_at"]
    self.failed_at = status["failed_at"] or self.failed_at
    self.discarded_fragment_tokens = status["discarded_fragment_tokens"]
    self.discarded_fragment_steps = status["discarded_fragment_steps"]
    self.barrier_wait_s = status["barrier_wait_s"]
    self._counters = status["counters"]
    self._offers_made = status["offers_made"]
    self.data_state = status["data_state"]
    self.rejected_calls = status["rejected_calls"]
    if status["finished_training"]:
      self.finished_training.set()


def join_group(actors, index: int, secret: bytes) -> list[int]:
  """Starts a multi-process learner's jax.distributed job (the leader's host is its coordinator)
  and builds the learner in every process; returns their pids."""
  import ray  # pylint: disable=g-import-not-at-top
  coordinator = ray.get(actors[0].coordinator.remote(), timeout=_CALL_TIMEOUT_S)
  mac = sign(secret, "join_group", index, 0, coordinator)
  return ray.get([a.join_group.remote(coordinator, mac) for a in actors],
                 timeout=_CALL_TIMEOUT_S * 5)


def start_learners(settings: settings_lib.RunSettings, *, secret: bytes, port, metrics, layout,
                   cuts: dict[int, Any], step_hook=None) -> list[RemoteLearner]:
  """One actor per learner, each in its own process, or config.ray.processes_per_learner actors
  per learner, each with its share of the learner's devices; logs `learner M pid N` for each.

  `secret`: this job's MAC key (only the command, its syncer and its learners hold it); `cuts`:
  learner -> its `checkpoints.LearnerCut` in a resumed run."""
  import ray  # pylint: disable=g-import-not-at-top
  actor_class = ray.remote(LearnerProcess)
  processes = settings.ray.processes_per_learner
  groups = []
  groups_placed = {}  # learner -> its placement group (multi-process learners)
  for m, shape in enumerate(settings.learner_mesh_shapes):
    env = {"JAX_PLATFORMS": settings.devices.platform}
    if settings.devices.platform == "cpu":
      env["XLA_FLAGS"] = devices_lib.xla_flags_with_device_count(math.prod(shape) // processes)
    elif settings.devices.learners_sharing_devices > 1:
      # Learner processes that share a GPU: each JAX would take 75% of its memory at start-up.
      # Each takes its share of that instead, which its own memory check then holds it to.
      # Not run on a GPU so far.
      env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = (
          f"{0.75 / settings.devices.learners_sharing_devices:.4f}")
    tag = secrets.token_hex(4)
    placement = {}
    if processes > 1:
      # One process per host: a placement group of one bundle per process, spread over distinct
      # nodes on a cluster (a restarted actor comes back in its bundle, on the same node). A
      # local Ray is one node: packed there.
      from ray.util import placement_group  # pylint: disable=g-import-not-at-top
      from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # pylint: disable=g-import-not-at-top
      group = placement_group([{"CPU": 1}] * processes,
                              strategy="STRICT_SPREAD" if settings.ray.address else "PACK")
      if not group.wait(_CALL_TIMEOUT_S):
        raise RuntimeError(
            f"learner {m}: Ray could not place config.ray.processes_per_learner={processes} "
            f"processes within {_CALL_TIMEOUT_S:.0f} s (a cluster needs a node per process of a "
            "learner, each with a free CPU)")
      groups_placed[m] = group
      placement = {i: PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
                   for i in range(processes)}
    groups.append([actor_class.options(
        name=f"learner-{m}-{tag}" + (f"-{i}" if processes > 1 else ""),
        max_restarts=max(settings.max_restarts, 0),
        # A multi-process learner's pulls wait in the call for the next step boundary.
        max_concurrency=8 if processes == 1 else 64, num_cpus=1, runtime_env={"env_vars": env},
        **({"scheduling_strategy": placement[i]} if placement else {}),
    ).remote(settings, m, secret, cuts.get(m), i) for i in range(processes)])
  learners = []
  for m, actors in enumerate(groups):
    if processes > 1:
      pids = join_group(actors, m, secret)
    else:
      pids = [ray.get(actors[0].pid.remote(), timeout=_CALL_TIMEOUT_S * 5)]
    for i, pid in enumerate(pids):
      logging.info("learner %d pid %d%s", m, pid,
                   f" (process {i} of {processes})" if processes > 1 else "")
    learners.append(RemoteLearner(
        m, actors if processes > 1 else actors[0], secret=secret, port=port, metrics=metrics,
        layout=layout, like=None,
        num_devices=math.prod(settings.learner_mesh_shapes[m]),
        device_kind="cpu" if settings.devices.platform == "cpu"
        else settings.devices.platform,
        incarnation=cuts[m].incarnation if m in cuts else 0,
        pid=pids if processes > 1 else pids[0], step_hook=step_hook,
        placement=groups_placed.get(m)))
  return learners
