"""What a learner's and the syncer's processes (config.runtime=ray) share: how the command hears
from them, and how they tell the command's calls from anyone else's.

- A process's mailbox (`Mailbox`): what it posts to the command and the metrics records it writes
  wait there until the command's watcher for it collects them with a long poll (one call returns as
  soon as there is news, or after the poll period); `forward_records` writes them to the command's
  metrics.jsonl and event tape.
- The watcher loop (`watch`): polls the process until the command stops watching, and reports a
  call that raised (the process is gone) once.
- Fencing: every call the command makes carries a MAC (HMAC-SHA256, `sign`) keyed by a per-job
  secret that only the command makes and hands to its actors, over what the call does, to whom, and
  which incarnation it expects; a process checks it (`mac_ok`) and rejects (and counts) the rest.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from absl import logging

LEARNER_POLL_S = 0.2  # the longest a watcher's call waits in a learner's process for news
SYNCER_POLL_S = 0.1  # the longest a watcher's call waits in the syncer's process for news
CALL_TIMEOUT_S = 120.0  # a blocking call on a process (state for a rejoin or a cut)

TAPE = "tape"  # a record that goes to the event tape, not to metrics.jsonl


class RejectedCall(Exception):
  """A call on a learner's process without a valid MAC, or for another incarnation."""


class ProcessDied(RuntimeError):
  """A learner's or the syncer's process is gone (killed, out of memory, its host lost)."""


def sign(secret: bytes, method: str, learner: int, incarnation: int, detail: str = "") -> str:
  """The MAC a call carries: over what it does, to whom, and which incarnation it expects."""
  text = f"{method}|{learner}|{incarnation}|{detail}".encode()
  return hmac.new(secret, text, hashlib.sha256).hexdigest()


def mac_ok(secret: bytes, mac: str, method: str, learner: int, incarnation: int,
           detail: str = "") -> bool:
  """Whether `mac` is this job's MAC of the call (compared in constant time)."""
  return hmac.compare_digest(mac, sign(secret, method, learner, incarnation, detail))


class Mailbox:
  """A process's posts to the command (a learner's `SyncerLink`) and its metrics writer: both wait
  here for the command's watcher.

  `records_wake`: whether a record alone answers a waiting poll (the syncer's, whose records are
  its news) or waits for the next post or the poll period (a learner's)."""

  def __init__(self, *, records_wake: bool, taping: bool = False):
    self._posts: collections.deque = collections.deque()
    self._records: collections.deque = collections.deque()
    self._records_wake = records_wake
    self.news = threading.Condition()
    self.taping = taping  # config.tape: the syncer's merges go to the command's event tape

  def post(self, message: Any) -> None:
    with self.news:
      self._posts.append(message)
      self.news.notify_all()

  def write(self, kind: str, record: dict[str, Any], *, step: int | None = None,
            scalars: dict[str, float] | None = None) -> None:
    """The process's metrics writer: its records go to the command's metrics.jsonl."""
    with self.news:
      self._records.append((kind, record, step, scalars))
      if self._records_wake:
        self.news.notify_all()

  def tape_event(self, kind: str, record: dict[str, Any]) -> None:
    self.write(TAPE, {"kind": kind, "record": record})

  def take(self, timeout_s: float) -> tuple[list, list]:
    """The posts and records since the last take, after waiting up to `timeout_s` for news."""
    with self.news:
      if not self._posts and not (self._records_wake and self._records):
        self.news.wait(timeout_s)
      posts, records = list(self._posts), list(self._records)
      self._posts.clear()
      self._records.clear()
    return posts, records


def forward_records(records: list, metrics) -> None:
  """Writes a process's records, collected by a poll, to the command's metrics writer (a tape
  event to its event tape)."""
  for kind, record, step, scalars in records:
    if kind == TAPE:
      metrics.tape_event(record["kind"], record["record"])
    else:
      metrics.write(kind, record, step=step, scalars=scalars)


def watch(stopped: threading.Event, poll: Callable[[], Any], take: Callable[[Any], bool],
          gone: Callable[[Exception], None], *, still: Callable[[], bool] = lambda: True) -> None:
  """A watcher thread's loop: `poll()`s a process while neither `stopped` is set nor `still()` is
  false, and hands each status to `take`, which returns False when there is nothing more to
  watch. A poll that raises (the process is gone) ends it: `gone(error)` unless `stopped` is set
  (the command ended the process itself)."""
  while not stopped.is_set() and still():
    try:
      status = poll()
    except Exception as err:  # pylint: disable=broad-except
      if not stopped.is_set():
        gone(err)
      return
    if not take(status):
      return


def wait_until_up(actor, name: str, timeout_s: float = 5 * CALL_TIMEOUT_S,
                  gone_pid: int | None = None) -> int:
  """Waits while Ray restarts an actor's process (its constructor builds afresh); returns its
  pid. `gone_pid`: the process that died, which may still answer for a moment (a lost node's
  processes outlive its raylet by a second or two): its answers do not count."""
  import ray  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      pid = ray.get(actor.pid.remote(), timeout=timeout_s)
      if pid != gone_pid:
        return pid
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
      pass
    if time.monotonic() > deadline:
      raise RuntimeError(f"{name}: its process did not come back within {timeout_s} s")
    time.sleep(0.2)


def on_node(node_id: str) -> str:
  """' on node <id>' where the Ray holds several nodes (a cluster: which host a process landed on
  is worth a log line), else '' (a local Ray is one node)."""
  import ray  # pylint: disable=g-import-not-at-top
  alive = sum(1 for n in ray.nodes() if n["Alive"])
  return f" on node {node_id[:12]}" if alive > 1 else ""


def take_down_this_node() -> None:
  """In a learner's or the syncer's process, as its host is lost: SIGKILL to every other process
  the node's raylet (this process's parent) started (the other workers there), to the raylet,
  whose object store goes with it, and to this process. The cluster declares the node dead at its
  next missed health checks. (The workers go too: one whose raylet died goes on answering calls
  for seconds.)"""
  import signal  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top  (Ray's own dependency)
  raylet = psutil.Process(os.getppid())
  for process in raylet.children(recursive=True):
    if process.pid != os.getpid():
      try:
        process.send_signal(signal.SIGKILL)
      except psutil.NoSuchProcess:
        pass
  raylet.send_signal(signal.SIGKILL)
  os.kill(os.getpid(), signal.SIGKILL)


def kill_process(node_id: str, pid: int, die: Callable[[], Any]) -> None:
  """SIGKILL to a learner's or the syncer's process, as a `kill -9` or the OOM killer would: from
  here (`os.kill` of its pid) where it runs on the command's own node, else by its own `die` call
  (fire-and-forget): on another machine its pid names some other process, or none."""
  import ray  # pylint: disable=g-import-not-at-top
  if node_id != ray.get_runtime_context().get_node_id():
    die()
    return
  import signal  # pylint: disable=g-import-not-at-top
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass  # gone already


def die_here() -> None:
  """In a learner's or the syncer's process: SIGKILL to itself (`kill_process` on another node)."""
  import signal  # pylint: disable=g-import-not-at-top
  os.kill(os.getpid(), signal.SIGKILL)


def lose_node(node_id: str, take_down: Callable[[], Any], fallback: Callable[[], None]) -> None:
  """Has the process on node `node_id` take its node down (`take_down`: a fire-and-forget call of
  its `lose_host`), or calls `fallback` (a process kill) where that node is the command's own:
  its loss would end the command's Ray."""
  import ray  # pylint: disable=g-import-not-at-top
  if node_id == ray.get_runtime_context().get_node_id():
    logging.warning("node %s is the command's own: a process kill instead of its loss",
                    node_id[:12])
    fallback()
    return
  take_down()
