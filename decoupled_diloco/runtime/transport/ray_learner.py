"""The command's handle on a learner in processes of its own (config.runtime=ray).

`RemoteLearner` is read as a `Learner` is (`handles.LearnerHandle`): by the controller, the
supervisor, the checkpointer, goodput and the summary. A watcher thread per learner collects, with
a long poll, what its process posts to the syncer (step reports, its end, its exit) and the metrics
records it writes, and keeps the latest `handles.LearnerStatus` the process sent, from which the
handle reads the learner's counters and timestamps.

A learner process that dies (SIGKILL, out of memory, a lost host) is restarted by Ray
(`max_restarts`): its constructor builds a fresh learner that waits. The watcher sees the death as
the learner's error; the supervisor's rejoin (peer state and Theta, unchanged code) then calls
`respawn`, which hands the new process its snapshot and the next incarnation. A process of a
learner over several that dies or fails takes the learner's others down (`RemoteLearner._fail`),
and the learner rejoins as a whole in fresh processes (a new jax.distributed job, `join_group`).

A learner on a TPU slice (config.ray.tpu_slice) restarts in place, on the same slice, after an
application failure (its step raised, a process was killed on a live host); a slice that lost a
host (declared dead by Ray, its processes with it) is a lost slice, and the learner moves, whole,
to an intact one (`ray_tpu_slices.SliceHome.move`) before it rejoins. `lost_slice` tells the
supervisor which of the two it was: only application failures count against config.max_restarts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco.runtime.core import handles
from decoupled_diloco.runtime.core import learner_state
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.faults import injector as injector_lib
from decoupled_diloco.runtime.transport import ray_links
from decoupled_diloco.runtime.transport import ray_plumbing as plumbing
from decoupled_diloco.runtime.transport import ray_tpu_slices


@dataclasses.dataclass(frozen=True)
class RemoteDevice:
  """What the controller reads of a device in a learner's process: its kind (memory: unknown)."""

  device_kind: str

  def memory_stats(self) -> None:
    return None


class LearnerProcessDied(plumbing.ProcessDied):
  """The learner's process is gone."""


class RemoteLearner:
  """The driver's handle on a learner process: a `LearnerLink` for the syncer, and the view of a
  `Learner` that the controller, the supervisor and the summary read (`handles.LearnerHandle`,
  kept by a watcher thread)."""

  def __init__(self, index: int, actor, *, secret: bytes, port, metrics, layout, like,
               num_devices: int, device_kind: str, incarnation: int = 0, pid=None,
               step_hook=None, placement=None, home=None):
    """`actor`, `pid`: the learner's process, or the lists of its processes (leader first).
    `home`: with config.ray.tpu_slice, the learner's `ray_tpu_slices.SliceHome`."""
    self.index, self.incarnation = index, incarnation
    self._actors = list(actor) if isinstance(actor, (list, tuple)) else [actor]
    self.pids = list(pid) if isinstance(pid, (list, tuple)) else [pid]
    self._actor, self._secret, self._port, self._metrics = self._actors[0], secret, port, metrics
    self.layout, self.state_like = layout, like
    self.num_devices, self.device_kind = num_devices, device_kind
    self.pid = self.pids[0]
    import ray  # pylint: disable=g-import-not-at-top
    # The Ray nodes (hosts) its processes run on, leader first.
    self.nodes = ray.get([a.node.remote() for a in self._actors], timeout=plumbing.CALL_TIMEOUT_S)
    self._placement = placement  # a multi-process learner's placement group (all incarnations)
    self._home = home  # config.ray.tpu_slice: the slice it runs on (all incarnations)
    # Once this incarnation has failed, on a slice: whether it lost a host of it (None: not known
    # until its processes are back on the slice, or Ray declares one of its hosts dead).
    self._lost_slice: bool | None = None
    self._moved = False  # its processes were started afresh on another slice (`respawn`)
    # The lists the statuses' latest entries are appended to; the rest is read from `_status`.
    self.losses: list[float] = []
    self.step_times: list[float] = []
    self.step_ends: list[float] = []
    self._failed_at: float | None = None  # when the driver saw its process die or fail
    self.error: BaseException | None = None
    self.finished_training = threading.Event()
    self.barrier_waits: list[tuple[float, float]] = []
    self.rejected_calls = 0  # by its process (the leader's)
    self.replicas_agree: bool | None = None  # check_replicas
    self._status: handles.LearnerStatus | None = None
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
    return plumbing.sign(self._secret, method, self.index, self.incarnation, detail)

  def _call(self, method: str, *args, detail: str = ""):
    fn = getattr(self._actor, method)
    if method == "poll":
      return fn.remote(*args)
    return fn.remote(*args, self.incarnation, self._mac(method, detail))

  def _call_get(self, method: str, *args, detail: str = "",
                timeout: float = plumbing.CALL_TIMEOUT_S):
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
        return ray_links.gather_published(self._actors, False, 0.0, self._signed)
      return self._call_get("published", False, 0.0)
    except Exception:  # pylint: disable=broad-except
      steps, tokens, versions = self._status.counters
      return messages.Publication(
          step=self.step, params={}, since=np.full_like(steps, self.step), counter_steps=steps,
          counter_tokens=tokens, anchor_versions=np.full_like(versions, -1), anchors={},
          training=not self.finished_training.is_set())

  def full_publication(self, timeout_s: float) -> messages.Publication | None:
    try:
      if len(self._actors) > 1:
        return ray_links.gather_published(self._actors, True, timeout_s, self._signed)
      return self._call_get("published", True, timeout_s,
                            timeout=timeout_s + plumbing.CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      return None  # the peer died meanwhile

  # ---- the Learner view ------------------------------------------------------------------------

  @property
  def step(self) -> int:
    return self._status.step

  @property
  def steps_made(self) -> int:
    return self._status.steps_made

  @property
  def start_step(self) -> int:
    return self._status.start_step

  @property
  def first_step_done_at(self) -> float | None:
    return self._status.first_step_done_at

  @property
  def train_started_at(self) -> float | None:
    return self._status.train_started_at

  @property
  def failed_at(self) -> float | None:
    return self._status.failed_at or self._failed_at

  @property
  def discarded_fragment_tokens(self) -> int:
    return self._status.discarded_fragment_tokens

  @property
  def discarded_fragment_steps(self) -> int:
    return self._status.discarded_fragment_steps

  @property
  def barrier_wait_s(self) -> float:
    return self._status.barrier_wait_s

  @property
  def data_state(self) -> bytes | None:
    return self._status.data_state

  def start(self) -> None:
    import ray  # pylint: disable=g-import-not-at-top
    ray.get([a.start.remote(self.incarnation, self._mac("start")) for a in self._actors],
            timeout=plumbing.CALL_TIMEOUT_S)
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

  def counters(self) -> learner_state.Counters:
    return learner_state.Counters(*self._status.counters)

  @property
  def offers_made(self) -> np.ndarray:
    return np.asarray(self._status.offers_made).copy()

  def params(self):
    if len(self._actors) > 1:
      return self.full_publication(plumbing.CALL_TIMEOUT_S).params
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

  def respawn(self, snapshot: learner_state.LearnerSnapshot) -> "RemoteLearner":
    """The next incarnation, in this learner's process (Ray restarted it if it died)."""
    if snapshot.data_state is None:
      # A new process has a fresh loader: go on from the position the last publication had.
      snapshot = dataclasses.replace(snapshot, data_state=self.data_state)
    incarnation = self.incarnation + 1
    import ray  # pylint: disable=g-import-not-at-top
    try:
      actors = self._processes_to_rejoin()
      for actor in actors:
        plumbing.wait_until_up(actor, f"learner {self.index}")
      if len(actors) > 1:
        # Fresh processes (a failure ends all of them, `_fail`): a new jax.distributed job.
        join_group(actors, self.index, self._secret)
      mac = plumbing.sign(self._secret, "restore", self.index, incarnation)
      pids = ray.get([a.restore.remote(snapshot, incarnation, mac) for a in actors],
                     timeout=plumbing.CALL_TIMEOUT_S * 5)
      made = RemoteLearner(self.index, actors if len(actors) > 1 else actors[0],
                           secret=self._secret, port=self._port,
                           metrics=self._metrics, layout=self.layout, like=self.state_like,
                           num_devices=self.num_devices, device_kind=self.device_kind,
                           incarnation=incarnation, pid=pids, step_hook=self._step_hook,
                           placement=self._placement, home=self._home)
    except ray_tpu_slices.NoFreeSlice as err:
      raise handles.GoneWhileRestarting(
          f"learner {self.index}: its slice lost a host and {err}") from err
    except ray.exceptions.RayActorError as err:
      # Killed again while being restored (another fault, its host lost): Ray restarts it again.
      self._up_ref = None
      raise handles.GoneWhileRestarting(
          f"learner {self.index}: its process died while it rejoined ({type(err).__name__})"
      ) from err
    where = f" on slice {self._home.slice.name}" if self._home is not None else ""
    for i, (pid, node) in enumerate(zip(pids, made.nodes)):
      logging.info("learner %d pid %d (incarnation %d%s)%s%s", self.index, pid, incarnation,
                   f", process {i} of {len(pids)}" if len(pids) > 1 else "", where,
                   plumbing.on_node(node))
    return made

  def _processes_to_rejoin(self) -> list:
    """The processes the next incarnation runs in: this learner's own, which Ray restarted in
    place; after a lost slice, new ones on an intact slice (moved once: again only if that slice
    too lost a host before the rejoin went through)."""
    if self._home is None or not self._lost_slice:
      return self._actors
    if not self._moved or not self._home.intact():
      logging.warning("learner %d: slice %s lost a host; it moves, whole, to another",
                      self.index, self._home.slice.name if self._home.slice else "(none)")
      self._moved = False
      self._home.move()
      self._moved = True
      logging.info("learner %d claimed slice %s", self.index, self._home.slice.name)
    return self._home.actors

  def lost_slice(self) -> bool | None:
    """This failed incarnation, on a TPU slice: whether it lost a host of its slice (then it
    moves to another, and its restart does not count against config.max_restarts); None until
    that is known (`process_up`). Not on a slice: False (every failure counts, as ever)."""
    return False if self._home is None else self._lost_slice

  def process_up(self) -> bool:
    """Whether this learner's process answers (after a death: whether Ray has restarted it and its
    constructor has built a fresh learner). Never blocks: the supervisor polls it as the repair
    time, so a rejoin takes its peer's state once there is a process to hand it to."""
    import ray  # pylint: disable=g-import-not-at-top
    if self._home is not None and (self._lost_slice or
                                   not ray_tpu_slices.nodes_alive(self.nodes)):
      self._lost_slice = True  # a host of its slice is gone: respawn moves it to another
      # ... once Ray sees a free intact slice (the supervisor's thread would wait in the claim
      # otherwise), or right away if it moved already and only its rejoin failed.
      return ((self._moved and self._home.intact())
              or ray_tpu_slices.free_slice_seen(self._home.shape))
    if self._up_ref is None:
      self._up_ref = [a.pid.remote() for a in self._actors]
    ready, _ = ray.wait(self._up_ref, num_returns=len(self._up_ref), timeout=0)
    if len(ready) < len(self._up_ref):
      return False
    refs, self._up_ref = self._up_ref, None
    try:
      pids = ray.get(refs, timeout=0)
    except Exception:  # pylint: disable=broad-except
      return False  # still restarting: ask again at the next poll
    if self._home is not None:
      if set(pids) & set(self.pids):
        return False  # a process that was ended answered before it went: ask again
      self._lost_slice = False  # every process is back, on the same hosts: the slice is whole
    return True

  def end(self) -> None:
    """Stops watching and ends the learner's process (the run is over)."""
    import ray  # pylint: disable=g-import-not-at-top
    self._stopped.set()
    for actor in self._actors:
      ray.kill(actor, no_restart=True)
    if self._placement is not None:
      from ray.util import remove_placement_group  # pylint: disable=g-import-not-at-top
      remove_placement_group(self._placement)  # its CPUs back to the cluster
    if self._home is not None:
      self._home.release()  # its slice back to the cluster

  def kill(self) -> None:
    """SIGKILL to the learner's process (all of them), as a user's `kill -9` or the OOM killer
    would: through the process itself where it runs on another node (`ray_plumbing.kill_process`)."""
    for actor, node, pid in zip(self._actors, self.nodes, self.pids):
      plumbing.kill_process(node, pid, lambda a=actor: a.die.remote(*self._signed("die")))

  def lose_host(self) -> None:
    """Its leader's host lost with every process on it (config.chaos's node_loss): the Ray node
    is taken down (`ray_plumbing.lose_node`); a process kill where that node is the command's."""
    plumbing.lose_node(self.nodes[0], lambda: self._actor.lose_host.remote(
        *self._signed("lose_host")), fallback=self.kill)

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
                       for a in self._actors], timeout=plumbing.CALL_TIMEOUT_S)
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
      self._failed_at = self.failed_at or time.monotonic()
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
    if len(self._actors) > 1 or self._home is not None:
      # (On a slice also a single process: every incarnation starts in fresh processes, which is
      # how `process_up` tells its slice is whole.)
      self.kill()

  def _watch_other(self, i: int) -> None:
    """Watches process i of a multi-process learner (its leader's watcher reads the rest)."""
    import ray  # pylint: disable=g-import-not-at-top
    actor = self._actors[i]

    def gone(err: Exception) -> None:
      self._fail(LearnerProcessDied(
          f"learner {self.index} (incarnation {self.incarnation}): its process {i}, pid "
          f"{self.pids[i]}, is gone ({type(err).__name__})"))

    def take(news: dict[str, Any]) -> bool:
      status = news["status"]
      if status.incarnation != self.incarnation:
        return True
      if status.error is not None:
        self._fail(RuntimeError(f"learner {self.index} process {i}: {status.error}"))
        return False
      return news["thread_alive"]

    plumbing.watch(
        self._stopped,
        lambda: ray.get(actor.poll.remote(plumbing.LEARNER_POLL_S),
                        timeout=plumbing.CALL_TIMEOUT_S),
        take, gone, still=lambda: self.error is None)

  # ---- the watcher -----------------------------------------------------------------------------

  def _watch(self) -> None:
    plumbing.watch(
        self._stopped,
        lambda: self._call_get("poll", plumbing.LEARNER_POLL_S, timeout=plumbing.CALL_TIMEOUT_S),
        self._take, self._gone)

  def _gone(self, err: Exception) -> None:
    self._fail(LearnerProcessDied(
        f"learner {self.index} (incarnation {self.incarnation}, pid {self.pid}): its process "
        f"is gone ({type(err).__name__})"))

  def _take(self, news: dict[str, Any]) -> bool:
    """What a poll of the leader brought: False once there is nothing more to watch."""
    status = news["status"]
    if status.incarnation != self.incarnation:
      return True  # the process was restored for a later incarnation: this view is retired
    seen = self.step
    self._refresh(news)
    if self._step_hook is not None and self.step != seen and self.pid is not None:
      try:
        self._step_hook(self.index, self.step)
      except injector_lib.NodeLoss as failure:
        logging.warning("%s: its Ray node is taken down", failure)
        self.lose_host()
      except injector_lib.LearnerFailure as failure:
        logging.warning("%s: SIGKILL to its process, pid %d", failure, self.pid)
        self.kill()
    for message in news["posts"]:
      self._port.post(message)
    plumbing.forward_records(news["records"], self._metrics)
    if status.error is not None:
      # Its process posted the learner's exit itself (forwarded above).
      self._fail(RuntimeError(status.error), say_exit=False)
      return False
    return news["thread_alive"]  # not: ended (released after the flush)

  def _refresh(self, news: dict[str, Any]) -> None:
    """Keeps the poll's status, and appends its step times and losses new to this view."""
    status: handles.LearnerStatus = news["status"]
    new = status.num_steps_done - len(self.step_times)
    if new > 0:
      self.step_times.extend(status.recent_step_times[-new:])
      self.step_ends.extend(status.recent_step_ends[-new:])
    new_losses = status.num_losses - len(self.losses)
    if new_losses > 0:
      self.losses.extend(status.recent_losses[-new_losses:])
    self._status = status
    self.rejected_calls = news["rejected_calls"]
    if status.finished_training:
      self.finished_training.set()

def join_group(actors, index: int, secret: bytes) -> list[int]:
  """Starts a multi-process learner's jax.distributed job (the leader's host is its coordinator)
  and builds the learner in every process; returns their pids."""
  import ray  # pylint: disable=g-import-not-at-top
  coordinator = ray.get(actors[0].coordinator.remote(), timeout=plumbing.CALL_TIMEOUT_S)
  mac = plumbing.sign(secret, "join_group", index, 0, coordinator)
  return ray.get([a.join_group.remote(coordinator, mac) for a in actors],
                 timeout=plumbing.CALL_TIMEOUT_S * 5)
