"""The syncer: quorum, grace window, merge and outer step, broadcast (docs/design.md §3-§5).

It runs in its own thread and owns all of its state. Fragments fall due on the clock of the fastest
learner still training. For a due fragment it opens a round and takes the fragment from every live
learner's latest publication (`LearnerLink.offer`, no round trip through the learner's step loop);
the copy to host RAM of each taken fragment runs on while the learners compute. Once K fresh offers
have landed it waits for the adaptive grace window (or until every live learner has answered), then
hands the merge to a worker thread: the outer gradients of the learners that are in are screened
(robust merge: one that is not finite, or an outlier against the norms the fragment accepted lately,
is rejected), the others are merged, the optax outer step runs, and the new Theta_p comes back to the
syncer's thread, which broadcasts it to every live learner. Absent or late learners contribute
weight 0; the syncer never waits for one. A rejected offer is as if it had not been taken: its steps
are not merged, and the broadcast does not name it, so its learner's overwrite discards them.

Heartbeats (docs/design.md §6): a learner still training whose step reports stop for longer than
its timeout (`algorithm/heartbeat.py`) is *absent*: rounds neither ask it nor wait for it, the
quorum counts the others, and an offer of it still copying is late (weight 0). It stays attached and
is still sent every broadcast (a hung learner applies them when it wakes). Its next report takes it
back, and the syncer then sends it every Theta_p newer than the versions that report says it holds:
broadcasts lost on the way (a partition, `runtime/core/network.py`) are made good. Every broadcast names,
for each learner, the last offer of it that a merge of the fragment took, so a learner that lost the
broadcast of that merge still counts those steps as merged, not discarded.

Delta broadcast (config.compression.broadcast_delta, `GlobalModel`): a merge sends the change of
Theta_p from R_p, the value the learners hold, to each learner whose last report says it holds R_p's
version, and a keyframe (R_p in full) to every other one: one whose broadcast was lost, one that
rejoined or was taken back since (those got keyframes then, too), or one whose report has not
caught up. A finished learner says which versions it holds in its TrainingDone, again after each
merge it applies, so it too gets deltas. A report never names a version
newer than the learner holds, and every way a learner comes to hold a version gives it R_p of that
version bit for bit, so no learner ever reconstructs a wrong Theta_p; a restarted syncer, which did
not keep R_p, sends keyframes only, until each fragment's next merge.

No step is merged twice: the syncer records, per learner and fragment, the last learner step a merge
took in (`merged_through`) and takes a later offer only if its steps start at or after it. After
training, `flush()` runs one final round per fragment that waits for every live learner's answer, so
the global model holds all the work.

In the lock-step modes (diloco, streaming) the learners push their offers and a round is a barrier:
it merges once every live learner has offered or has nothing, and, unless
`config.sync.elastic_lock_step`, once every learner that failed and is being repaired is back (its
rejoin answers the open rounds with nothing: its state since the last barrier is lost).

The global model itself (Theta_p, versions, outer states, the merge programs) is `GlobalModel`;
this module only runs the rounds around it. Memory: what `GlobalModel` holds (with the delta
broadcast that includes R_p, one more copy of the parameters), plus the host copies
of the offers in open rounds (at most one per live learner per open round). Nothing grows with the
number of steps.

Sharded (config.syncer.num_shards > 1, `runtime/core/syncer/sharded.py`): each shard is one of
these over the fragments it owns (`owned`, `algorithm/shards.py`), with their Theta_p, outer states,
rounds, merges and checkpoint; it hears every learner's reports, and opens, merges and broadcasts
rounds of its own fragments only. Fragments keep their numbers 0..P-1 everywhere.

The syncer is one class in five files, each a part of it over the same state, on the same thread:
this one (set-up, the controller's calls, the inbox), `syncer/rounds.py` (rounds, quorum, grace,
the flush), `syncer/merges.py` (the merge worker; install, broadcast, record),
`syncer/heartbeats.py` (absent learners) and `syncer/state.py` (checkpoints, the consistent cut).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import grace as grace_lib
from decoupled_diloco.runtime.core import global_model as global_model_lib
from decoupled_diloco.runtime.core import host_heap
from decoupled_diloco.runtime.core.syncer import merge_hold
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core import network as network_lib
from decoupled_diloco.runtime.core.syncer import heartbeats as syncer_heartbeats
from decoupled_diloco.runtime.core.syncer import merges as syncer_merge
from decoupled_diloco.runtime.core.syncer import rounds as syncer_rounds
from decoupled_diloco.runtime.core.syncer import state as syncer_state
# The syncer's public types, defined beside the code that fills them.
from decoupled_diloco.runtime.core.syncer.rounds import LearnerLink, SyncerStats
from decoupled_diloco.runtime.core.syncer.state import SyncerCut  # pylint: disable=unused-import

_FLUSH = object()  # flush() asks for the final rounds through the inbox
_CATCH_UP = object()  # a restarted syncer opens a round for every fragment


@dataclasses.dataclass(frozen=True)
class _Attach:
  learner: int
  link: LearnerLink
  step: int
  incarnation: int
  anchor_versions: np.ndarray | None  # the Theta_p versions it starts from; None = all at 0


@dataclasses.dataclass(frozen=True)
class _Release:
  hold: str  # release_cut(): the held cut of this token ends


@dataclasses.dataclass(frozen=True)
class _GiveUp:
  learner: int  # failed for good (config.max_restarts): no barrier waits for it any more


class Syncer(syncer_rounds.SyncerRounds, syncer_merge.SyncerMerges,
             syncer_heartbeats.SyncerHeartbeats, syncer_state.SyncerCheckpoints):
  """Holds Theta_p and one outer-optimizer state per fragment; merges asynchronously."""

  def __init__(
      self,
      *,
      sync: settings_lib.SyncSettings,
      fragments: Sequence[fragments_lib.Fragment],
      initial_params: Mapping[str, np.ndarray],
      mesh: Mesh,
      outer_tx: optax.GradientTransformation,
      merge: settings_lib.MergeSettings,
      compression: settings_lib.CompressionSettings,
      num_learners: int,
      num_workers: int,
      metrics: metrics_lib.MetricsWriter | None = None,
      network: network_lib.Network | None = None,
      inner_learning_rates: Sequence[float] | np.ndarray | None = None,
      learners_sharing_devices: int = 1,
      clock: Callable[[], float] = time.monotonic,
      staleness_scaling: str = "none",
      merge_delay_steps: int = 0,
      owned: Sequence[int] | None = None,
      shard: int | None = None,
      merge_threads: int = 2,
      heap_trim_every_s: float = 0.0,
  ):
    """`owned`: the fragments this syncer merges (a shard's); None: all. `shard`: its number
    among the shards (None: the syncer is not sharded), named in its records.
    `heap_trim_every_s`: after a merge, the process's freed C heap goes back to the OS if the
    syncer last looked this long ago and it holds enough free (runtime/core/host_heap.py); 0 =
    never."""
    # Seconds for the quorum and grace deadlines, heartbeats and timings on the tape. A test may
    # drive it by hand, so that a deadline falls where the test says, not where the host's load
    # puts it.
    self._now = clock
    self._sync = sync
    # Learners per set of devices: the heartbeat's floor before a first report grows with it.
    self._sharing = learners_sharing_devices
    self._network = network  # the links to the learners go through it (partitions)
    self._schedule = sync.schedule
    self._metrics = metrics
    self.model = global_model_lib.GlobalModel(
        fragments=fragments, initial_params=initial_params, mesh=mesh, outer_tx=outer_tx,
        merge=merge, compression=compression, num_learners=num_learners,
        inner_learning_rates=inner_learning_rates, staleness_scaling=staleness_scaling,
        owned=owned, merge_threads=merge_threads)
    self.shard = shard
    self._owns = frozenset(self.model.owned)  # due fragments this syncer opens rounds of
    self._lock = threading.Lock()  # guards _live against the controller's reads
    self._learners: dict[int, LearnerLink] = {}
    self._incarnations: dict[int, int] = {}
    self._live: set[int] = set()
    self._training: set[int] = set()
    self._absent: set[int] = set()  # live, but silent past the heartbeat timeout
    self._last_report_at: dict[int, float] = {}  # learner -> its last message (or attach)
    self._absent_at: dict[int, float] = {}
    # Lock-step, not elastic: learners that failed and will be restarted. The barrier (every open
    # round) waits for them; a rejoin or `give_up` ends the wait. `_given_up` never wait again.
    self._awaited: set[int] = set()
    self._given_up: set[int] = set()
    self._learner_steps: dict[int, int] = {}
    self._reported_anchors: dict[int, np.ndarray] = {}
    self._merged_through: dict[tuple[int, int], int] = {}
    self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    self._rounds: dict[int, syncer_rounds.Round] = {}
    self._late_answers = []
    self._merging: set[int] = set()
    self._owed: set[int] = set()  # fell due while in flight: opened as soon as it is back
    self._clock = 0
    self._lead: int | None = 0  # step of the fastest learner still training
    self._grace = grace_lib.GraceEstimator(sync.ema_decay)
    self._workers = concurrent.futures.ThreadPoolExecutor(num_workers, "syncer-merge")
    # config.syncer.merge_delay_steps: each merge holds its worker for that many steps of the clock.
    self._merge_hold = merge_hold.MergeHold(merge_delay_steps)
    self._cut: syncer_state.CutRequest | None = None
    # After a restart: per fragment, the version an offer's anchor must have reached (the learner
    # has applied every merge this syncer knows of, including those its predecessor made after
    # its last checkpoint, whose steps `_merged_through` may not show).
    self._min_anchor = np.zeros(len(fragments), np.int64)
    # none -> requested -> running (final rounds) -> applying (learners take the broadcasts) -> done
    self._flush_state = "none"
    self._flush_resent_at = 0.0
    self._flush_done = threading.Event()
    self._stop = threading.Event()
    self.stats = SyncerStats()
    self._heap = host_heap.HeapTrimmer(heap_trim_every_s, clock=clock)
    self.tape: list[dict[str, Any]] = []  # every merge decision, in order (docs/design.md §6)
    self.error: BaseException | None = None
    self.compile_seconds = 0.0
    self._thread = threading.Thread(
        target=self._run, name="syncer" if shard is None else f"syncer-shard-{shard}", daemon=True)

  # ---- set-up and control (controller thread) -------------------------------------------------

  def compile(self) -> None:
    """Compiles the merge programs ahead of time, so the first syncs compile nothing."""
    self.compile_seconds = self.model.compile()

  def attach(self, learner: int, link: LearnerLink, step: int = 0, incarnation: int = 0,
             anchor_versions: np.ndarray | None = None) -> None:
    """A learner joins (at start-up, later at `step`, or restarted as a new `incarnation`).

    It takes part from the next round on. `anchor_versions` are the Theta_p versions its state
    starts from: the syncer sends it every fragment merged since, so it misses no broadcast.
    """
    if self._network is not None:
      link = self._network.link(learner, link)
    self._inbox.put(_Attach(learner, link, step, incarnation, anchor_versions))

  def start(self) -> None:
    self._thread.start()

  def give_up(self, learner: int) -> None:
    """`learner` failed for good (it will not be restarted): lock-step barriers stop waiting
    for it. Through the inbox, so it is ordered after the learner's own exit message."""
    self._inbox.put(_GiveUp(learner))

  def stop(self) -> None:
    self._stop.set()
    self._inbox.put(None)
    self._merge_hold.moved()  # a held merge ends: nothing will move the clock any more

  def join(self, timeout: float | None = None) -> None:
    self._thread.join(timeout)
    self._workers.shutdown(wait=False, cancel_futures=True)
    self.model.close()  # the merge's own threads, else idle until the process ends

  def kill(self) -> None:
    """A crash (config.chaos's syncer_crash): the thread stops and what it held is lost, as a
    syncer process's state is with a SIGKILL (`ray_syncer.RemoteSyncer.kill`)."""
    self.stop()
    self.join(timeout=30)

  @property
  def process_died(self) -> bool:
    """A syncer in the command's process has no process of its own to lose (its failures are
    its `error`)."""
    return False

  @property
  def shard_stats(self) -> list[SyncerStats]:
    """Its counters as the one shard it is (a shard of a sharded syncer: its own)."""
    return [self.stats]

  def post(self, message: Any) -> None:
    """Learners call this; it only enqueues."""
    self._inbox.put(message)

  def flush(self, timeout: float | None = None) -> bool:
    """A last sync of every fragment with every live learner (after training): waits for it.

    Returns False if it did not finish within `timeout`; raises if the syncer failed.
    """
    # Through the inbox: the reports queued before it still advance the clock and open their
    # rounds, however far the syncer's thread lags behind the learners.
    self._inbox.put(_FLUSH)
    done = self._flush_done.wait(timeout)
    if self.error is not None:
      raise RuntimeError(f"the syncer failed: {self.error!r}") from self.error
    return done

  def request_cut(self, timeout_s: float, include_tape: bool = True, hold: str = ""
                  ) -> concurrent.futures.Future:
    """Asks for a consistent cut of the syncer and the live learners (a checkpoint's content).

    How it stays consistent with merges in flight: from the request on, no new round opens (a
    fragment that falls due is owed, and opened right after the cut); the rounds already open close
    and their merges are installed and broadcast as usual; then the syncer waits until every live
    learner has published a state that holds every current Theta_p version (it applies broadcasts
    at its next step boundary). At that instant no offer is in flight and no merge is half known to
    any learner, so the learners' publications and the syncer's state describe the same job. The
    learners never stop; only new merges wait, for about a step. In the lock-step modes, which
    sync on their own schedule, the syncer instead waits for such an instant between syncs.

    The future's result is a `SyncerCut`, or None if no such instant came within `timeout_s` (a
    hung learner): the caller tries again later.

    `hold` (a shard of a sharded syncer; a token naming the request): after its cut the syncer
    opens no round until `release_cut(hold)` (or `timeout_s` more), so that its fragments'
    versions stay those of its cut while the other shards take theirs (`syncer/sharded.py`); a
    release before the cut came withdraws the request.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(syncer_state.CutRequest(future, timeout_s, include_tape, hold=hold))
    return future

  def release_cut(self, hold: str) -> None:
    """Ends the hold of the cut asked for with this `hold` token (not a later one's): rounds open
    again."""
    self._inbox.put(_Release(hold))

  def request_state(self) -> concurrent.futures.Future:
    """The syncer's `state()` as read on its own thread (a syncer checkpoint's content)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(syncer_state.StateRequest(future))
    return future
  def catch_up(self) -> None:
    """Opens a round for every fragment (after a restart: none was merged while it was down)."""
    self._inbox.put(_CATCH_UP)
  def global_params(self) -> dict[str, np.ndarray]:
    """The global model Theta (all fragments)."""
    return self.model.params()

  def held_bytes(self) -> int:
    """Bytes of the arrays the syncer references now: the global model and the landed offers."""
    offers = sum(o.nbytes for r in list(self._rounds.values()) for o in list(r.offers.values()))
    return self.model.held_bytes() + offers

  def steady_state_bytes(self) -> int:
    """What held_bytes() must equal between rounds with anchor="learner"."""
    return self.model.steady_state_bytes()

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
        self._merge_hold.moved()  # the clock, the training learners or the flush may have moved
        self._check_heartbeats()
        self._poll_rounds()
        self._collect_landed_offers()
        self._close_ready_rounds()
        self._advance_flush()
        self._advance_cut()
    except BaseException as err:  # pylint: disable=broad-except
      self.error = err
      logging.exception("syncer failed")
      self._flush_done.set()
      if self._cut is not None and not self._cut.future.done():
        self._cut.future.set_result(None)

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
    if message is _FLUSH:
      self._flush_state = "requested"
      return
    if isinstance(message, syncer_state.StateRequest):
      message.future.set_result(self.state())
      return
    if isinstance(message, _Release):
      if self._cut is not None and self._cut.hold and self._cut.hold == message.hold:
        if not self._cut.future.done():  # released before its cut came: not wanted any more
          self._cut.future.set_result(None)
        self._end_cut()
      return
    if message is _CATCH_UP:
      if self._flush_state == "none":
        for p in self.model.owned:
          if p in self._rounds or p in self._merging:
            continue
          if self._cut is not None:
            self._owed.add(p)
          else:
            self._open_round(p, self._clock)
      return
    if isinstance(message, syncer_state.CutRequest):
      if self._cut is not None and not self._cut.future.done():  # (a held one is done)
        self._cut.future.set_result(None)  # superseded
      message.asked_at = self._now()
      self._cut = message
      with self._lock:
        live = sorted(self._live)
      for m in live:
        # A donating learner's publications carry its optimizer state only when asked.
        self._learners[m].want_full_state(message.timeout_s)
      return
    if self._from_earlier_incarnation(message):
      return
    if isinstance(message, (messages.StepReport, messages.TrainingDone)):
      self._last_report_at[message.learner] = self._now()  # its heartbeat
    if isinstance(message, messages.StepReport):
      self._learner_steps[message.learner] = message.step
      self._grace = self._grace.observe_step(message.learner, message.step_time_s)
      if message.anchor_versions is not None:
        self._reported_anchors[message.learner] = message.anchor_versions
      self._advance_clock()
    elif isinstance(message, syncer_rounds.MergeDone):
      self._finish_merge(message)
    elif isinstance(message, messages.Offer):
      self._accept_pushed(message)
    elif isinstance(message, messages.TrainingDone):
      self._learner_steps[message.learner] = message.step
      if message.anchor_versions is not None:
        self._reported_anchors[message.learner] = message.anchor_versions
      self._advance_clock()
      self._training.discard(message.learner)
      self._advance_clock()
    elif isinstance(message, messages.LearnerExit):
      with self._lock:
        self._live.discard(message.learner)
      self._training.discard(message.learner)
      self._absent.discard(message.learner)
      self._advance_clock()
      if (message.error and self._sync.lock_step and not self._sync.elastic_lock_step
          and message.learner not in self._given_up):
        self._awaited.add(message.learner)  # the lock-step barrier waits for its repair
      if message.error:
        # Its state is gone: what it offered and no merge has taken yet is never merged.
        self._drop_offers_of(message.learner)
        logging.warning("syncer: learner %d left at step %d (%s); merging without it",
                        message.learner, message.step, message.error)
    elif isinstance(message, _Attach):
      self._attach(message)
    elif isinstance(message, _GiveUp):
      self._given_up.add(message.learner)
      self._awaited.discard(message.learner)
    else:
      raise TypeError(f"syncer: unexpected message {message!r}")

  def _from_earlier_incarnation(self, message: Any) -> bool:
    """Whether a learner's message comes from an incarnation that has been replaced: ignored."""
    if (isinstance(message, (_Attach, syncer_rounds.MergeDone, _GiveUp, _Release))
        or not hasattr(message, "incarnation")):
      return False
    if message.incarnation >= self._incarnations.get(message.learner, 0):
      return False
    if isinstance(message, messages.Offer):
      self.stats.rejected_offers["stale_incarnation"] += 1
    else:
      self.stats.stale_messages += 1
    return True

  def _attach(self, message: _Attach) -> None:
    m = message.learner
    restarted = self._incarnations.get(m, message.incarnation) != message.incarnation
    with self._lock:
      self._live.add(m)  # here, not in attach(): no round may ask its link before it is known
    self._incarnations[m] = message.incarnation
    self._learners[m] = message.link
    self._learner_steps[m] = message.step
    self._last_report_at[m] = self._now()  # silent from now on counts
    self._absent.discard(m)
    if restarted:
      # Its steps count again from `step` (a peer's): records of the earlier incarnation go.
      self._drop_offers_of(m)
      for p in self.model.owned:
        self._merged_through[(m, p)] = message.step
      self._awaited.discard(m)
      if self._sync.lock_step:
        # It lost the steps of the rounds open now: it has answered them (with nothing), and
        # the barrier it held up merges the others; the broadcast reaches it too.
        for round_ in self._rounds.values():
          round_.answered.add(m)
    if message.anchor_versions is not None:
      self._reported_anchors[m] = np.asarray(message.anchor_versions)
      for p in self.model.owned:
        held = message.anchor_versions[p]
        version, wire = self.model.wire(p)
        if version > held:
          message.link.deliver(messages.Broadcast(p, version, wire))
    self._advance_clock()
    # Not the whole publication: over a network that would carry the learner's state (with
    # AdamW's moments, four times the model) for one flag.
    if getattr(message.link, "training", True):
      # A learner that finished while no syncer listened (its TrainingDone was lost) is not
      # training; one that finishes from now on says so after this.
      self._training.add(m)
