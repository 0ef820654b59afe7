"""The syncer: quorum, grace window, fragment merge and outer step, broadcast (spec §3-§5).

It runs in its own thread on a mesh of CPU devices. For every fragment that falls due it pulls the
fragment from every live learner, waits for a quorum of K fresh answers, then for the adaptive grace
window (or until every live learner has answered), merges the outer gradients of the learners that
are in and runs the optax outer step, then sends the new Theta_p to every live learner. Absent or
late learners contribute weight 0; the syncer never waits for one.

The merge of one fragment is one jitted computation over the syncer mesh: the learners' outer
gradients are stacked on a leading axis sharded over the syncer devices, each shard forms its
learners' weighted terms, and the sums that RDA and the weighted average need become one all-reduce.
The pure math lives in `merge` and `outer`; this module only moves data and calls them.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from decoupled_diloco import compression
from decoupled_diloco import devices as devices_lib
from decoupled_diloco import fragments as fragments_lib
from decoupled_diloco import grace as grace_lib
from decoupled_diloco import merge
from decoupled_diloco import messages
from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco import outer
from decoupled_diloco.settings import SyncSettings

_FLOAT_BYTES = 4


class LearnerLink(Protocol):
  """What the syncer calls on a learner: both calls only enqueue."""

  def request(self, fragment: int) -> None:
    ...

  def deliver(self, broadcast: messages.Broadcast) -> None:
    ...


@dataclasses.dataclass(frozen=True)
class MergeOptions:
  rule: str = "rda"
  weighting: str = "tokens_sq_over_steps"
  anchor: str = "learner"
  outer_grad_format: str = "bf16"
  broadcast_format: str = "fp32"
  block_size: int = 64


@dataclasses.dataclass
class _Round:
  """One sync of one fragment, from falling due to its broadcast."""

  fragment: int
  clock: int  # global step at which it fell due
  opened_at: float
  quorum: int
  requested: set[int]
  use_grace: bool
  offers: dict[int, messages.Offer] = dataclasses.field(default_factory=dict)
  quorum_at: float | None = None
  deadline: float | None = None
  final: bool = False  # part of the flush after training


@dataclasses.dataclass
class SyncerStats:
  merges: int = 0
  bytes_up: int = 0  # learner -> syncer, encoded outer gradients
  bytes_down: int = 0  # syncer -> learners, encoded Theta_p, once per receiving learner
  bytes_allreduce: int = 0  # across syncer shards (ring all-reduce of the merge terms)
  late_offers: int = 0  # arrived after their round closed: weight 0
  rounds_without_quorum: int = 0
  due_while_in_flight: int = 0  # a fragment fell due again before its last sync finished


class Syncer:
  """Holds Theta_p and one outer-optimizer state per fragment; merges asynchronously."""

  def __init__(
      self,
      *,
      sync: SyncSettings,
      fragments: Sequence[fragments_lib.Fragment],
      initial_params: Mapping[str, np.ndarray],
      mesh: Mesh,
      outer_tx: optax.GradientTransformation,
      options: MergeOptions,
      num_learners: int,
      metrics: metrics_lib.MetricsWriter | None = None,
  ):
    self._sync = sync
    self._schedule = sync.schedule
    self._fragments = tuple(fragments)
    self._mesh = mesh
    self._tx = outer_tx
    self._options = options
    self._num_learners = num_learners
    self._metrics = metrics
    shards = mesh.devices.size
    self._padded_learners = -(-num_learners // shards) * shards
    self._replicated = NamedSharding(mesh, PartitionSpec())
    self._by_learner = NamedSharding(mesh, PartitionSpec(devices_lib.SYNCER_AXIS))
    self._lock = threading.Lock()
    self._theta = [{n: np.asarray(initial_params[n], np.float32) for n in f.names}
                   for f in self._fragments]
    self._versions = [0] * len(self._fragments)
    # Theta_p of each version some live learner may still be anchored at (anchor="syncer" needs it).
    self._history = [{0: dict(theta)} for theta in self._theta]
    self._opt_states = [jax.device_put(self._tx.init(theta), self._replicated)
                        for theta in self._theta]
    self._merge_fns = [self._build_merge_fn(f) for f in self._fragments]
    self._learners: dict[int, LearnerLink] = {}
    self._live: set[int] = set()
    self._learner_steps: dict[int, int] = {}
    self._learner_anchor_versions: dict[tuple[int, int], int] = {}
    self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    self._copying: list[messages.Offer] = []  # offers whose host copy has not landed yet
    self._rounds: dict[int, _Round] = {}
    self._clock = 0
    self._grace = grace_lib.GraceEstimator(sync.ema_decay)
    self._flush_state = "none"  # none -> requested -> running -> done
    self._flush_done = threading.Event()
    self._stop = threading.Event()
    self.stats = SyncerStats()
    self.tape: list[dict[str, Any]] = []  # every merge decision, in order (spec §6)
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="syncer", daemon=True)

  # ---- set-up and control (controller thread) -------------------------------------------------

  def _build_merge_fn(self, fragment: fragments_lib.Fragment):
    average_names = frozenset(fragment.embedding_names)
    rule, tx = self._options.rule, self._tx

    def merge_and_step(theta, opt_state, deltas, weights):
      delta = merge.merge_fragment(deltas, weights, average_names=average_names, rule=rule)
      return outer.outer_step(tx, theta, opt_state, delta)

    return jax.jit(merge_and_step,
                   in_shardings=(self._replicated, self._replicated, self._by_learner,
                                 self._by_learner),
                   out_shardings=(self._replicated, self._replicated))

  def compile(self) -> None:
    """Compiles every fragment's merge ahead of time, so the first syncs cost no compilation."""
    for p, fn in enumerate(self._merge_fns):
      deltas = {n: np.zeros((self._padded_learners,) + v.shape, np.float32)
                for n, v in self._theta[p].items()}
      weights = np.zeros(self._padded_learners, np.float32)
      self._merge_fns[p] = fn.lower(self._theta[p], self._opt_states[p], deltas, weights).compile()

  def attach(self, learner: int, link: LearnerLink) -> None:
    with self._lock:
      self._learners[learner] = link
      self._live.add(learner)
      self._learner_steps.setdefault(learner, 0)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    self._inbox.put(None)

  def join(self, timeout: float | None = None) -> None:
    self._thread.join(timeout)

  def post(self, message: Any) -> None:
    """Learners call this; it only enqueues."""
    self._inbox.put(message)

  def flush(self, timeout: float | None = None) -> bool:
    """A last sync of every fragment with every live learner (after training): waits for it."""
    self._flush_state = "requested"
    self._inbox.put(None)
    return self._flush_done.wait(timeout)

  def global_params(self) -> dict[str, np.ndarray]:
    """A copy of the global model Theta (all fragments)."""
    with self._lock:
      return {n: v for theta in self._theta for n, v in theta.items()}

  @property
  def clock(self) -> int:
    return self._clock

  @property
  def live_learners(self) -> frozenset[int]:
    with self._lock:
      return frozenset(self._live)

  # ---- the syncer's own thread ---------------------------------------------------------------

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        self._receive(self._wait_timeout())
        self._collect_landed_offers()
        if not self._sync.lock_step and self._flush_state == "none":
          self._advance_clock()
        self._close_ready_rounds()
        self._advance_flush()
    except BaseException as err:  # pylint: disable=broad-except
      self.error = err
      logging.exception("syncer failed")
      self._flush_done.set()

  def _wait_timeout(self) -> float:
    if self._copying:
      return 0.002  # poll the copies in flight; the syncer never blocks on a learner's device
    deadlines = [r.deadline for r in self._rounds.values() if r.deadline is not None]
    if not deadlines:
      return 0.05
    return min(max(min(deadlines) - time.monotonic(), 0.0), 0.05)

  def _receive(self, timeout: float) -> None:
    try:
      message = self._inbox.get(timeout=timeout)
    except queue.Empty:
      return
    while True:  # drain what is queued; None is only a wake-up
      if message is not None:
        self._handle(message)
      try:
        message = self._inbox.get_nowait()
      except queue.Empty:
        return

  def _handle(self, message: Any) -> None:
    if isinstance(message, messages.StepReport):
      self._learner_steps[message.learner] = message.step
      self._grace = self._grace.observe_step(message.learner, message.step_time_s)
    elif isinstance(message, messages.Offer):
      self._copying.append(message)
    elif isinstance(message, messages.LearnerExit):
      with self._lock:
        self._live.discard(message.learner)
      if message.error:
        logging.warning("syncer: learner %d left at step %d (%s); merging without it",
                        message.learner, message.step, message.error)

  def _collect_landed_offers(self) -> None:
    """Offers enter their round once their copy to host RAM has landed."""
    still_copying = []
    for offer in self._copying:
      if offer.in_host_memory:
        self._accept(offer)
      else:
        still_copying.append(offer)
    self._copying = still_copying

  def _accept(self, offer: messages.Offer) -> None:
    self._learner_anchor_versions[(offer.learner, offer.fragment)] = offer.anchor_version
    round_ = self._rounds.get(offer.fragment)
    if round_ is None and self._sync.lock_step and self._flush_state == "none":
      round_ = self._open_round(offer.fragment, offer.step, request=False)
    if round_ is None or offer.learner in round_.offers:
      self.stats.late_offers += 1
      return
    round_.offers[offer.learner] = offer

  def _advance_clock(self) -> None:
    """Fragments fall due on the clock of the fastest live learner (spec §3)."""
    live_steps = [s for m, s in self._learner_steps.items() if m in self._live]
    now = max(live_steps, default=self._clock)
    for step in range(self._clock + 1, now + 1):
      for p in self._schedule.due_fragments(step):
        if p in self._rounds:
          self.stats.due_while_in_flight += 1
        else:
          self._open_round(p, step, request=True)
    self._clock = max(self._clock, now)

  def _open_round(self, p: int, clock: int, *, request: bool, final: bool = False) -> _Round:
    live = set(self._live)
    if self._sync.lock_step or final:
      quorum, use_grace = max(len(live), 1), False
    else:
      quorum, use_grace = self._sync.quorum, True
    round_ = _Round(p, clock, time.monotonic(), quorum, live, use_grace, final=final)
    self._rounds[p] = round_
    if request:
      for m in live:
        self._learners[m].request(p)
    return round_

  def _close_ready_rounds(self) -> None:
    now = time.monotonic()
    for p in list(self._rounds):
      round_ = self._rounds[p]
      fresh = [o for o in round_.offers.values() if o.fresh]
      waiting_for = (round_.requested & self._live) - set(round_.offers)
      if round_.quorum_at is None and len(fresh) >= min(round_.quorum, max(len(self._live), 1)):
        round_.quorum_at = now
        self._grace = self._grace.observe_quorum(now - round_.opened_at)
        window = 0.0
        if round_.use_grace:
          window = self._grace.window(self._live, overlap=self._sync.overlap,
                                      gamma=self._sync.grace_gamma, cap=self._sync.grace_cap_s)
        round_.deadline = now + window
      if round_.quorum_at is not None:
        if now >= round_.deadline or not waiting_for:
          del self._rounds[p]
          self._merge(round_, fresh)
      elif not waiting_for:
        # Everyone live has answered and the quorum is still out of reach: nothing to merge.
        del self._rounds[p]
        self.stats.rounds_without_quorum += 1

  def _advance_flush(self) -> None:
    if self._flush_state == "requested" and not self._rounds:
      self._flush_state = "running"
      for p in range(len(self._fragments)):
        self._open_round(p, self._clock, request=True, final=True)
    elif self._flush_state == "running" and not self._rounds:
      self._flush_state = "done"
      self._flush_done.set()

  # ---- merge, outer step, broadcast --------------------------------------------------------------

  def _merge(self, round_: _Round, offers: list[messages.Offer]) -> None:
    if not offers:
      self.stats.rounds_without_quorum += 1
      return
    start = time.monotonic()
    p, opts = round_.fragment, self._options
    offers = sorted(offers, key=lambda o: o.learner)
    names = self._fragments[p].names
    stacked = {n: np.zeros((self._padded_learners,) + self._theta[p][n].shape, np.float32)
               for n in names}
    bytes_up = 0
    for offer in offers:
      encoded = offer.encode_outer_gradient(opts.outer_grad_format, opts.block_size)
      bytes_up += sum(e.nbytes for e in encoded.values())
      for n in names:
        delta = compression.decode(encoded[n])
        if opts.anchor == "syncer":
          # Delta = Theta_now - theta_m = (anchor_m - theta_m) + (Theta_now - anchor_m).
          delta = delta + (self._theta[p][n] - self._history[p][offer.anchor_version][n])
        stacked[n][offer.learner] = delta
    tokens = np.zeros(self._padded_learners, np.float32)
    steps = np.zeros(self._padded_learners, np.float32)
    for offer in offers:
      tokens[offer.learner], steps[offer.learner] = offer.tokens, offer.steps
    weights = np.asarray(merge.learner_weights(tokens, steps, opts.weighting), np.float32)
    encoded_at = time.monotonic()
    theta, opt_state = self._merge_fns[p](self._theta[p], self._opt_states[p], stacked, weights)
    theta = {n: np.asarray(v) for n, v in theta.items()}
    merged_at = time.monotonic()
    wire = compression.encode_tree(theta, opts.broadcast_format, opts.block_size)
    received = compression.decode_tree(wire)
    with self._lock:
      self._theta[p] = theta
      self._opt_states[p] = opt_state
      self._versions[p] += 1
      version = self._versions[p]
      live = sorted(self._live)
    self._remember(p, version, received, live)
    broadcast = messages.Broadcast(p, version, wire, {o.learner: o.step for o in offers})
    for m in live:
      self._learners[m].deliver(broadcast)
    sync_s = time.monotonic() - start
    self._grace = self._grace.observe_sync(sync_s)
    shards = self._mesh.devices.size
    terms = sum(v.size for v in theta.values()) + 2 * len(theta)  # w*phi(Delta), w*|Delta|, w
    self.stats.merges += 1
    self.stats.bytes_up += bytes_up
    self.stats.bytes_down += broadcast.nbytes * len(live)
    self.stats.bytes_allreduce += 2 * (shards - 1) * terms * _FLOAT_BYTES
    decision = {
        "fragment": p, "version": version, "clock": round_.clock, "final": round_.final,
        "learners": [o.learner for o in offers],
        "weights": [float(weights[o.learner]) for o in offers],
        "tokens": [o.tokens for o in offers], "steps": [o.steps for o in offers],
        "learner_steps": [o.step for o in offers],
        "anchor_versions": [o.anchor_version for o in offers],
        "quorum_wait_s": round((round_.quorum_at or start) - round_.opened_at, 5),
        "grace_window_s": round((round_.deadline or start) - (round_.quorum_at or start), 5),
        "grace_waited_s": round(start - (round_.quorum_at or start), 5),
        "encode_s": round(encoded_at - start, 5), "merge_s": round(merged_at - encoded_at, 5),
        "sync_s": round(sync_s, 5), "bytes_up": bytes_up,
        "bytes_down": broadcast.nbytes * len(live),
    }
    self.tape.append(decision)
    if self._metrics is not None:
      self._metrics.write("merge", decision, step=self.stats.merges, scalars={
          "syncer/participants": len(offers), "syncer/grace_waited_s": decision["grace_waited_s"],
          "syncer/bytes_learner_syncer": self.stats.bytes_up + self.stats.bytes_down})

  def _remember(self, p: int, version: int, values: dict[str, np.ndarray], live: list[int]) -> None:
    """Keeps the Theta_p versions a live learner may still be anchored at; drops the rest."""
    history = self._history[p]
    history[version] = values
    oldest = min((self._learner_anchor_versions.get((m, p), 0) for m in live), default=version)
    for old in [v for v in history if v < oldest]:
      del history[old]
