"""The syncer as a process of its own (config.runtime=ray): a Ray actor on CPU with its own mesh.

The `Syncer` is the same class as in the threaded runtime, built by the same
`assembly.make_local_syncer` steps, in a process whose JAX has `config.syncer.num_devices` CPU
devices. Its links to the learners (`LearnerLink`) are `ActorLearnerLink`s: actor calls on the
learners' processes, signed with the job's secret, answered through the object store
(`messages.PendingAnswer`). The command's process keeps the controller; `RemoteSyncer` is its
handle, read as it reads a `Syncer`:

- the learners' posts reach the syncer through the command (its watchers collect them, sign them
  and post them here, fire-and-forget); a post without a valid MAC (an outsider that looked the
  syncer actor up by name) is rejected, logged and counted (`rejected_calls`);
- a watcher thread keeps what the controller reads between calls: the merge counters (`stats`),
  the merge tape as it grows, the syncer's metrics records (written to the command's
  metrics.jsonl) and its error;
- at `stop()` it takes the final figures (Theta, the tape, held bytes) before the process ends, so
  the final evaluation and the summary read them as they read a stopped `Syncer`.

A syncer process that dies (config.chaos's `syncer_crash` is a SIGKILL of it here) is restarted by
Ray; its constructor builds a fresh syncer at the initial Theta, and the controller's unchanged
`SyncerKeeper` restores it from its newest syncer checkpoint and the learners' anchors.

A sharded syncer (config.syncer.num_shards > 1) is one such process per shard, each placed by
`config.ray.syncer_resource` on its own and restarted on its own: shard i's process builds the
syncer of the fragments it owns (`assembly.make_local_syncer(shard=i)`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.core import handles
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.transport import ray_links
from decoupled_diloco.runtime.transport import ray_plumbing as plumbing
from decoupled_diloco.runtime.transport import ray_tpu_slices

class _TapeGate:
  """Holds the syncer's broadcasts until the command holds every merge record before them.

  The command copies the merge tape out of this process by polling it (`RemoteSyncer._watch`);
  a broadcast sent straight to the learners could otherwise reach them while its merge's record
  is still only here, and a kill -9 of this process then would leave a merge that the learners
  hold (and whose tokens their counters dropped) missing from the command's tape and token
  account. The syncer puts a merge on its tape before it sends the merge's broadcasts; a
  broadcast waits until a poll's `tape_from` (what the command holds) covers the tape as it was
  when it was sent. A poll answers at once when there is news, so that is one round trip."""

  def __init__(self, tape_length):
    self._tape_length = tape_length
    self._lock = threading.Condition()
    self._held_by_command = 0
    self._waiting: list[tuple[int, Any, messages.Broadcast]] = []
    self._open = False

  # Sends happen under the lock (a delivery only enqueues an actor call), so a broadcast never
  # overtakes one held before it.

  def send(self, link, broadcast: messages.Broadcast) -> None:
    needed = self._tape_length()
    with self._lock:
      if not self._open and needed > self._held_by_command:
        self._waiting.append((needed, link, broadcast))
      else:
        link.deliver(broadcast)

  def command_holds(self, tape_length: int) -> None:
    """A poll says the command holds the tape's first `tape_length` records."""
    with self._lock:
      self._held_by_command = max(self._held_by_command, tape_length)
      ready = [w for w in self._waiting if w[0] <= self._held_by_command]
      self._waiting = [w for w in self._waiting if w[0] > self._held_by_command]
      for _, link, broadcast in ready:
        link.deliver(broadcast)
      self._lock.notify_all()

  def wait_sent(self, timeout_s: float) -> bool:
    """Waits until no broadcast is held (the command's next poll sends them): the final flush
    returns once its broadcasts are on their way, as they were before the gate."""
    with self._lock:
      return self._lock.wait_for(lambda: not self._waiting, timeout_s)

  def open(self) -> None:
    """Sends everything held, and from now on at once (the command stops polling)."""
    with self._lock:
      self._open = True
      ready, self._waiting = self._waiting, []
      for _, link, broadcast in ready:
        link.deliver(broadcast)
      self._lock.notify_all()


class _GatedLink:
  """A learner link whose broadcasts go through the `_TapeGate`."""

  def __init__(self, link, gate: _TapeGate):
    self._link, self._gate = link, gate

  def deliver(self, broadcast: messages.Broadcast) -> None:
    self._gate.send(self._link, broadcast)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._link, name)


class SyncerProcess:
  """The syncer in its own process (the body of the Ray actor; `RemoteSyncer` drives it)."""

  def __init__(self, settings: settings_lib.RunSettings, secret: bytes, shard: int | None = None):
    from decoupled_diloco.runtime import assembly  # pylint: disable=g-import-not-at-top
    self._secret = secret
    self.rejected_calls = 0
    self._records = plumbing.Mailbox(records_wake=True, taping=settings.tape)
    self.syncer = assembly.make_local_syncer(settings, metrics=self._records, shard=shard)
    self._gate = _TapeGate(lambda: len(self.syncer.tape))

  def _check(self, mac: str, method: str, learner: int, incarnation: int, detail: str = ""
             ) -> bool:
    if plumbing.mac_ok(self._secret, mac, method, learner, incarnation, detail):
      return True
    self.rejected_calls += 1
    logging.warning("syncer: rejected a %s call for learner %d without a valid MAC (not from this "
                    "job's driver); %d rejected so far", method, learner, self.rejected_calls)
    return False

  def pid(self) -> int:
    return os.getpid()

  def node(self) -> str:
    """The id of the Ray node (host) this process runs on."""
    import ray  # pylint: disable=g-import-not-at-top
    return ray.get_runtime_context().get_node_id()

  def lose_host(self) -> None:
    """config.chaos's node_loss@syncer: this host goes, with every process on it."""
    plumbing.take_down_this_node()

  def die(self) -> None:
    """SIGKILL to this process (RemoteSyncer.kill, where it is on another node than the command)."""
    plumbing.die_here()

  def compile_seconds(self) -> float:
    return self.syncer.compile_seconds

  def post(self, message: Any, mac: str) -> bool:
    """A learner's message, forwarded and signed by the command. False: rejected."""
    learner = getattr(message, "learner", -1)
    incarnation = getattr(message, "incarnation", 0)
    if not self._check(mac, "post", learner, incarnation, type(message).__name__):
      return False
    self.syncer.post(message)
    return True

  def attach(self, learner: int, actor, step: int, incarnation: int,
             anchor_versions: np.ndarray | None, mac: str) -> bool:
    if not self._check(mac, "attach", learner, incarnation):
      return False
    link = _GatedLink(ray_links.ActorLearnerLink(actor, learner, incarnation, self._secret,
                                                   len(self.syncer.model.fragments)), self._gate)
    self.syncer.attach(learner, link, step=step, incarnation=incarnation,
                       anchor_versions=anchor_versions)
    return True

  def start(self) -> None:
    self.syncer.start()

  def give_up(self, learner: int) -> None:
    self.syncer.give_up(learner)

  def catch_up(self) -> None:
    self.syncer.catch_up()

  def flush(self, timeout: float | None) -> bool:
    flushed = self.syncer.flush(timeout)
    # Its last merges' broadcasts go out at the command's next poll; the command stops the
    # learners after this returns, so they must be on their way first.
    self._gate.wait_sent(plumbing.CALL_TIMEOUT_S if timeout is None else max(timeout, 1.0))
    return flushed

  def request_cut(self, timeout_s: float, include_tape: bool, hold: str = ""):
    return self.syncer.request_cut(timeout_s, include_tape, hold=hold).result()

  def release_cut(self, hold: str) -> None:
    self.syncer.release_cut(hold)

  def request_state(self):
    return self.syncer.request_state().result()

  def load_state(self, state, with_history: bool) -> None:
    self.syncer.load_state(state, with_history=with_history)

  def recover(self, state, publications, stats, tape) -> dict[str, Any]:
    return self.syncer.recover(state, publications, stats=stats, tape=tape)

  def received(self):
    return self.syncer.model.received()

  def global_params(self) -> dict[str, np.ndarray]:
    return self.syncer.global_params()

  def final(self) -> dict[str, Any]:
    """What the summary reads of a stopped syncer."""
    syncer = self.syncer
    self._gate.open()  # the command takes the whole tape here and polls no more
    return {"params": syncer.global_params(), "held_bytes": syncer.held_bytes(),
            "steady_state_bytes": syncer.steady_state_bytes(), "stats": syncer.stats,
            "tape": list(syncer.tape)}

  def stop(self) -> None:
    self.syncer.stop()
    self.syncer.join(timeout=30)

  def poll(self, tape_from: int, timeout_s: float) -> dict[str, Any]:
    """Since the last poll: metrics records, the tape's new entries, the counters, the error."""
    self._gate.command_holds(tape_from)
    _, records = self._records.take(timeout_s)
    syncer = self.syncer
    tape = syncer.tape[tape_from:]
    error = syncer.error
    return {"records": records, "tape": list(tape), "stats": dataclasses.replace(syncer.stats),
            "error": None if error is None else repr(error), "clock": syncer.clock,
            "rejected_calls": self.rejected_calls}


class _RemoteModel:
  """`Syncer.model` as the controller reads it: Theta as the learners received it."""

  def __init__(self, owner: "RemoteSyncer"):
    self._owner = owner

  def received(self):
    return self._owner.get("received")


class RemoteSyncer:
  """The command's handle on the syncer's process, read as a `Syncer` is read."""

  def __init__(self, actor, secret: bytes, metrics, *, stats=None, tape=None, shard=None):
    from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib  # pylint: disable=g-import-not-at-top
    self._actor, self._secret, self._metrics = actor, secret, metrics
    self.shard = shard  # of a sharded syncer; None: the syncer is one process
    self.pid = self.get("pid")
    self.node = self.get("node")  # the Ray node (host) its process runs on
    self.compile_seconds = self.get("compile_seconds")
    self.model = _RemoteModel(self)
    self.stats = stats if stats is not None else syncer_lib.SyncerStats()
    self.tape: list[dict[str, Any]] = tape if tape is not None else []
    self.error: BaseException | None = None
    self.clock = 0
    self.rejected_calls = 0
    self._final: dict[str, Any] | None = None
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="watch-syncer", daemon=True)
    logging.info("syncer%s pid %d%s", "" if shard is None else f" shard {shard}", self.pid,
                 plumbing.on_node(self.node))

  def get(self, method: str, *args, timeout: float = plumbing.CALL_TIMEOUT_S):
    import ray  # pylint: disable=g-import-not-at-top
    try:
      return ray.get(getattr(self._actor, method).remote(*args), timeout=timeout)
    except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as err:
      # Its process died, or its host with the answer in its object store.
      raise handles.SyncerGone(f"the syncer's process is gone during {method} "
                               f"({type(err).__name__})") from err

  # ---- what the controller calls ---------------------------------------------------------------

  def post(self, message: Any) -> None:
    mac = plumbing.sign(self._secret, "post", getattr(message, "learner", -1),
                           getattr(message, "incarnation", 0), type(message).__name__)
    self._actor.post.remote(message, mac)

  def attach(self, learner: int, link, step: int = 0, incarnation: int = 0,
             anchor_versions: np.ndarray | None = None) -> None:
    mac = plumbing.sign(self._secret, "attach", learner, incarnation)
    try:
      self.get("attach", learner, link.actor, step, incarnation, anchor_versions, mac)
    except handles.SyncerGone as err:
      # The syncer's process died meanwhile (a rejoin takes seconds): the keeper attaches every
      # live learner, this one included, to the restored syncer.
      logging.warning("learner %d is attached once the syncer is back (%s)", learner, err)

  def start(self) -> None:
    self.get("start")
    self._thread.start()

  def give_up(self, learner: int) -> None:
    self.get("give_up", learner)

  def catch_up(self) -> None:
    self.get("catch_up")

  def compile(self) -> None:
    pass  # compiled in its process, at construction

  def flush(self, timeout: float | None = None) -> bool:
    done = self.get("flush", timeout,
                    timeout=(timeout or plumbing.CALL_TIMEOUT_S) + plumbing.CALL_TIMEOUT_S)
    self._raise_error()
    return done

  def _future(self, method: str, *args) -> concurrent.futures.Future:
    """The call's result, or None if the syncer's process died meanwhile (no cut, no state: the
    checkpoint is tried again later, after the keeper has restored the syncer)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def resolve():
      try:
        future.set_result(self.get(method, *args, timeout=None))
      except Exception as err:  # pylint: disable=broad-except
        logging.warning("syncer: %s got no answer (%s): nothing to write this time", method,
                        type(err).__name__)
        future.set_result(None)

    threading.Thread(target=resolve, daemon=True).start()
    return future

  def request_cut(self, timeout_s: float, include_tape: bool = True, hold: str = ""
                  ) -> concurrent.futures.Future:
    return self._future("request_cut", timeout_s, include_tape, hold)

  def release_cut(self, hold: str) -> None:
    try:
      self.get("release_cut", hold)
    except handles.SyncerGone:
      pass  # its process died: a restarted syncer holds no cut

  @property
  def shard_stats(self) -> list[Any]:
    return [self.stats]

  def request_state(self) -> concurrent.futures.Future:
    return self._future("request_state")

  def load_state(self, state, *, with_history: bool) -> None:
    self.get("load_state", state, with_history)

  def recover(self, state, publications, *, stats, tape) -> dict[str, Any]:
    self.stats, self.tape = stats, list(tape)
    info = self.get("recover", state, publications, stats, tape)
    # The process marked its copy of the tape; the command's copy alike.
    for i in tape_lib.lost_merges(self.tape, info["versions"]):
      self.tape[i]["lost"] = True
    return info

  def global_params(self) -> dict[str, np.ndarray]:
    if self._final is not None:
      return self._final["params"]
    return self.get("global_params")

  def held_bytes(self) -> int:
    return self._final["held_bytes"] if self._final is not None else 0

  def steady_state_bytes(self) -> int:
    return self._final["steady_state_bytes"] if self._final is not None else 0

  def stop(self) -> None:
    """Takes the final figures, then stops the syncer (its process ends with the run)."""
    if self._final is None and self.error is None and not self._stopped.is_set():
      try:
        self._final = self.get("final")
        self.stats, self.tape = self._final["stats"], self._final["tape"]
        self.get("stop")
      except Exception:  # pylint: disable=broad-except
        pass  # its process is gone: what the watcher kept stands
    self._stopped.set()

  def join(self, timeout: float | None = None) -> None:
    if self._thread.ident is not None:
      self._thread.join(timeout)

  def kill(self) -> None:
    """SIGKILL to the syncer's process (config.chaos's syncer_crash under runtime=ray)."""
    self._stopped.set()
    plumbing.kill_process(self.node, self.pid, self._actor.die.remote)

  def lose_host(self) -> None:
    """Its host lost with every process on it (config.chaos's node_loss@syncer)."""
    self._stopped.set()
    plumbing.lose_node(self.node, self._actor.lose_host.remote,
                       fallback=lambda: plumbing.kill_process(self.node, self.pid, lambda: None))

  def end(self) -> None:
    import ray  # pylint: disable=g-import-not-at-top
    self._stopped.set()
    ray.kill(self._actor, no_restart=True)

  # ---- the watcher -----------------------------------------------------------------------------

  @property
  def process_died(self) -> bool:
    """Its process died unplanned (the keeper then restores the syncer Ray restarts)."""
    return isinstance(self.error, plumbing.ProcessDied)

  def _raise_error(self) -> None:
    if self.error is not None:
      raise RuntimeError(f"the syncer failed: {self.error!r}") from self.error

  def _watch(self) -> None:
    plumbing.watch(self._stopped, lambda: self.get("poll", len(self.tape), plumbing.SYNCER_POLL_S),
                   self._take, self._gone)

  def _gone(self, err: Exception) -> None:
    self.error = plumbing.ProcessDied(
        f"the syncer's process (pid {self.pid}) is gone ({type(err).__name__})")

  def _take(self, status: dict[str, Any]) -> bool:
    """What a poll brought: False once there is nothing more to watch."""
    if self._stopped.is_set():
      return False
    self.tape.extend(status["tape"])
    self.stats, self.clock = status["stats"], status["clock"]
    self.rejected_calls = status["rejected_calls"]
    plumbing.forward_records(status["records"], self._metrics)
    if status["error"] is not None:
      self.error = RuntimeError(status["error"])
      return False
    return True

def start_syncer(settings: settings_lib.RunSettings, secret: bytes, metrics,
                 shard: int | None = None) -> RemoteSyncer:
  """The syncer actor (or shard `shard`'s) on CPU with its own devices; logs `syncer pid N`."""
  import ray  # pylint: disable=g-import-not-at-top
  name = f"syncer-{os.urandom(4).hex()}" + ("" if shard is None else f"-shard-{shard}")
  # Its mesh's devices, and one more that initialises the model (the initial Theta).
  env = {"JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": devices_lib.xla_flags_with_device_count(settings.syncer.num_devices + 1)}
  actor = ray.remote(SyncerProcess).options(
      name=name, max_restarts=-1, max_concurrency=16, num_cpus=1,
      # config.ray.syncer_resource: on (and restarted on) a host that advertises it.
      **({"resources": {settings.ray.syncer_resource: 1}} if settings.ray.syncer_resource else {}),
      # config.ray.tpu_slice: never on a TPU VM, whose CPU a learner's bundle on a spare slice
      # needs (and whose cores are its learner process's).
      **({"label_selector": ray_tpu_slices.not_on_tpu_hosts()} if settings.ray.slice else {}),
      runtime_env={"env_vars": env}).remote(settings, secret, shard)
  # Its process builds and compiles before it answers: the time a restarted syncer and every
  # learner get (a plain call's 120 s ran out on a loaded 2-core host).
  plumbing.wait_until_up(actor, "the syncer" if shard is None else f"syncer shard {shard}")
  made = RemoteSyncer(actor, secret, metrics, shard=shard)
  made.name = name  # another driver could look it up by this name (tests do)
  return made


def restarted(crashed: RemoteSyncer, timeout_s: float = 5 * plumbing.CALL_TIMEOUT_S
              ) -> RemoteSyncer:
  """The syncer after Ray restarted its process (a fresh syncer at the initial Theta); the
  keeper restores it."""
  what = "the syncer" if crashed.shard is None else f"syncer shard {crashed.shard}"
  plumbing.wait_until_up(crashed._actor, what, timeout_s, gone_pid=crashed.pid)  # pylint: disable=protected-access
  made = RemoteSyncer(crashed._actor, crashed._secret, crashed._metrics,  # pylint: disable=protected-access
                      stats=crashed.stats, tape=crashed.tape, shard=crashed.shard)
  made.name = crashed.name
  return made
