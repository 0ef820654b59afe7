"""The syncer: quorum, grace window, fragment merge and outer step, broadcast (spec §3-§5).

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

Heartbeats (issue 9, detection): a learner still training whose step reports stop for longer than
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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import grace as grace_lib
from decoupled_diloco.algorithm import heartbeat
from decoupled_diloco.algorithm import robust
from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.runtime.core import global_model as global_model_lib
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core import network as network_lib

_FLOAT_BYTES = 4


class LearnerLink(Protocol):
  """What the syncer calls on a learner; none of it waits for the learner's step loop."""

  def offer(self, fragment: int, merged_through: int) -> messages.Offer | messages.Answer:
    ...

  def deliver(self, broadcast: messages.Broadcast) -> None:
    ...

  @property
  def published(self) -> messages.Publication:  # only for checkpoints (request_cut)
    ...

  def want_full_state(self, seconds: float) -> None:  # publications with the optimizer state
    ...


@dataclasses.dataclass
class _Round:
  """One sync of one fragment, from falling due to its merge."""

  fragment: int
  clock: int  # global step at which it fell due
  opened_at: float
  quorum: int
  use_grace: bool
  poll: bool  # take offers from the learners' publications (False: lock-step learners push them)
  final: bool = False  # part of the flush after training: waits for every live learner
  offers: dict[int, messages.Offer] = dataclasses.field(default_factory=dict)  # landed in host RAM
  copying: dict[int, tuple[messages.Offer, float]] = dataclasses.field(default_factory=dict)
  answered: set[int] = dataclasses.field(default_factory=set)  # finished, nothing fresh to give
  landed_at: float | None = None  # when the last offer in it landed
  quorum_at: float | None = None
  deadline: float | None = None


_FLUSH = object()  # flush() asks for the final rounds through the inbox
_CATCH_UP = object()  # a restarted syncer opens a round for every fragment


@dataclasses.dataclass(frozen=True)
class _StateRequest:
  future: concurrent.futures.Future


@dataclasses.dataclass
class _CutRequest:
  """request_cut(): a consistent cut of the syncer and the live learners, or None on timeout."""

  future: concurrent.futures.Future
  timeout_s: float
  include_tape: bool
  asked_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class SyncerCut:
  """The syncer's state and every live learner's publication at one instant, consistent: no
  merge in flight, and every publication holds exactly the current Theta_p versions."""

  state: dict[str, Any]  # Syncer.state()
  publications: dict[int, messages.Publication]
  incarnations: dict[int, int]
  clock: int


@dataclasses.dataclass(frozen=True)
class _Attach:
  learner: int
  link: LearnerLink
  step: int
  incarnation: int
  anchor_versions: np.ndarray | None  # the Theta_p versions it starts from; None = all at 0


@dataclasses.dataclass(frozen=True)
class _GiveUp:
  learner: int  # failed for good (config.max_restarts): no barrier waits for it any more


@dataclasses.dataclass(frozen=True)
class _MergeDone:
  round_: _Round
  offers: tuple[messages.Offer, ...]
  closed_at: float
  future: concurrent.futures.Future


@dataclasses.dataclass
class SyncerStats:
  merges: int = 0
  final_merges: int = 0  # merges of the flush after training
  merges_due: int = 0  # times a fragment fell due during training
  bytes_up: int = 0  # learner -> syncer, encoded outer gradients
  bytes_down: int = 0  # syncer -> learners, encoded Theta_p, once per receiving learner
  bytes_allreduce: int = 0  # across syncer shards (ring all-reduce of the merge terms)
  late_offers: int = 0  # taken, but landed after their round closed: weight 0
  stale_answers: int = 0  # a learner had not yet applied a merge of its earlier steps: asked again
  rounds_without_quorum: int = 0  # regular rounds that closed with fewer than K fresh offers
  empty_rounds: int = 0  # rounds in which no live learner had a step to give (nothing to merge)
  due_while_in_flight: int = 0  # a fragment fell due again before its last sync finished
  peak_held_bytes: int = 0  # most the syncer held at once (see the module docstring)
  # Offers dropped, never merged, by reason: an earlier incarnation of a restarted learner, an outer
  # gradient that is not finite or an outlier (robust.REASONS).
  rejected_offers: dict[str, int] = dataclasses.field(
      default_factory=lambda: {"stale_incarnation": 0, **{r: 0 for r in robust.REASONS}})
  stale_messages: int = 0  # reports of an earlier incarnation, ignored
  absences: int = 0  # a learner found silent for longer than its heartbeat timeout
  returns: int = 0  # an absent learner reported again and was taken back
  catch_up_fragments: int = 0  # Theta_p sent to a learner taken back, newer than it held
  # Delta broadcast: full values of R_p sent to a learner in place of a delta it could not apply
  # (its last report named another version than the delta's base).
  keyframes: int = 0


class Syncer:
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
  ):
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
        inner_learning_rates=inner_learning_rates)
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
    self._rounds: dict[int, _Round] = {}
    self._merging: set[int] = set()
    self._owed: set[int] = set()  # fell due while in flight: opened as soon as it is back
    self._clock = 0
    self._lead: int | None = 0  # step of the fastest learner still training
    self._grace = grace_lib.GraceEstimator(sync.ema_decay)
    self._workers = concurrent.futures.ThreadPoolExecutor(num_workers, "syncer-merge")
    self._cut: _CutRequest | None = None
    # After a restart: per fragment, the version an offer's anchor must have reached (the learner
    # has applied every merge this syncer knows of, including those its predecessor made after
    # its last checkpoint, whose steps `_merged_through` may not show).
    self._min_anchor = np.zeros(len(fragments), np.int64)
    self._flush_state = "none"  # none -> requested -> running -> done
    self._flush_done = threading.Event()
    self._stop = threading.Event()
    self.stats = SyncerStats()
    self.tape: list[dict[str, Any]] = []  # every merge decision, in order (spec §6)
    self.error: BaseException | None = None
    self.compile_seconds = 0.0
    self._thread = threading.Thread(target=self._run, name="syncer", daemon=True)

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

  def join(self, timeout: float | None = None) -> None:
    self._thread.join(timeout)
    self._workers.shutdown(wait=False, cancel_futures=True)

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

  def request_cut(self, timeout_s: float, include_tape: bool = True
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
    """
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(_CutRequest(future, timeout_s, include_tape))
    return future

  def request_state(self) -> concurrent.futures.Future:
    """The syncer's `state()` as read on its own thread (a syncer checkpoint's content)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(_StateRequest(future))
    return future

  def recover(self, state: Mapping[str, Any] | None,
              publications: Mapping[int, messages.Publication], *, stats: SyncerStats,
              tape: list[dict[str, Any]]) -> dict[str, Any]:
    """A restarted syncer, before it starts: its predecessor's newest checkpointed state (None:
    none, the initial one), then for every fragment the newest Theta_p a live learner holds as its
    anchor if that is newer (every merge the predecessor installed and sent reached every live
    learner, so the newest anchors hold them all; one it put on the tape and died before sending
    is marked `lost` there). Only the outer state since the checkpoint is lost.
    `stats` and `tape`, the record of what happened, carry over. Returns what was restored."""
    if state is not None:
      self.load_state(state, with_history=False)
    self.stats, self.tape = stats, tape
    restored_versions = list(self.model.versions)
    from_learners = []
    for p, fragment in enumerate(self.model.fragments):
      newest = max(publications.values(), key=lambda pub: pub.anchor_versions[p], default=None)
      if newest is not None and self.model.take_newer(
          p, int(newest.anchor_versions[p]), {n: newest.anchors[n] for n in fragment.names}):
        from_learners.append(p)
    # Merges the predecessor put on the tape but took down with it (killed before their
    # broadcasts left): the audits and the token account leave them out.
    lost = tape_lib.lost_merges(self.tape, self.model.versions)
    for i in lost:
      self.tape[i]["lost"] = True
    self._min_anchor = np.asarray(self.model.versions, np.int64)
    # Delta broadcast: R_p was not checkpointed, and the learners' anchors may differ from the
    # Theta_p just restored; each fragment's next merge sends its full value.
    self.model.require_keyframes()
    self._lead = None  # the clock goes on from the learners' next reports, without a burst
    return {"checkpoint_versions": restored_versions, "versions": list(self.model.versions),
            "fragments_from_learners": from_learners, "lost_merges": len(lost)}

  def catch_up(self) -> None:
    """Opens a round for every fragment (after a restart: none was merged while it was down)."""
    self._inbox.put(_CATCH_UP)

  def state(self, include_tape: bool = False) -> dict[str, Any]:
    """{"arrays", "json"}: everything a restarted syncer needs, read on the syncer's thread (or
    before it starts). `include_tape` adds the merge tape (a job checkpoint's history)."""
    arrays, model = self.model.state()
    values = {
        "model": model,
        "merged_through": [[m, p, step] for (m, p), step in sorted(self._merged_through.items())],
        "clock": self._clock,
        "lead": self._lead,
        "learner_steps": {str(m): s for m, s in self._learner_steps.items()},
        "incarnations": {str(m): i for m, i in self._incarnations.items()},
        "reported_anchors": {str(m): np.asarray(a).tolist()
                             for m, a in self._reported_anchors.items()},
        "grace": grace_lib.to_dict(self._grace),
        "stats": dataclasses.asdict(self.stats),
    }
    if include_tape:
      values["tape"] = list(self.tape)
    return {"arrays": arrays, "json": values}

  def load_state(self, state: Mapping[str, Any], *, with_history: bool) -> None:
    """Restores `state()` before the syncer starts. `with_history`: also the counters and the
    tape (a resumed job); False for a restarted syncer, whose run keeps its own."""
    values = state["json"]
    self.model.load_state(state["arrays"], values["model"])
    self._merged_through = {(int(m), int(p)): int(step)
                            for m, p, step in values["merged_through"]}
    self._clock = int(values["clock"])
    self._lead = values["lead"]
    self._grace = grace_lib.from_dict(values["grace"])
    self._incarnations = {int(m): int(i) for m, i in values["incarnations"].items()}
    if with_history:
      stats = dict(values["stats"])
      rejected = {**self.stats.rejected_offers, **stats.pop("rejected_offers", {})}
      self.stats = SyncerStats(**stats, rejected_offers=rejected)
      self.tape = list(values.get("tape", []))

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
      if self._cut is not None:
        self._cut.future.set_result(None)

  def _wait_timeout(self) -> float:
    if any(r.copying for r in self._rounds.values()):
      return 0.002  # poll the copies in flight; the syncer never blocks on a learner's device
    if any(r.poll for r in self._rounds.values()):
      return 0.005  # a learner may publish without a step (it applied a merge after training)
    deadlines = [r.deadline for r in self._rounds.values() if r.deadline is not None]
    if not deadlines:
      return 0.05
    return min(max(min(deadlines) - self._now(), 0.0), 0.05)

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
    if isinstance(message, _StateRequest):
      message.future.set_result(self.state())
      return
    if message is _CATCH_UP:
      if self._flush_state == "none":
        for p in range(len(self.model.fragments)):
          if p in self._rounds or p in self._merging:
            continue
          if self._cut is not None:
            self._owed.add(p)
          else:
            self._open_round(p, self._clock)
      return
    if isinstance(message, _CutRequest):
      if self._cut is not None:
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
    elif isinstance(message, _MergeDone):
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
    if isinstance(message, (_Attach, _MergeDone, _GiveUp)) or not hasattr(message, "incarnation"):
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
      for p in range(len(self.model.fragments)):
        self._merged_through[(m, p)] = message.step
      self._awaited.discard(m)
      if self._sync.lock_step:
        # It lost the steps of the rounds open now: it has answered them (with nothing), and
        # the barrier it held up merges the others; the broadcast reaches it too.
        for round_ in self._rounds.values():
          round_.answered.add(m)
    if message.anchor_versions is not None:
      self._reported_anchors[m] = np.asarray(message.anchor_versions)
      for p, held in enumerate(message.anchor_versions):
        version, wire = self.model.wire(p)
        if version > held:
          message.link.deliver(messages.Broadcast(p, version, wire))
    self._advance_clock()
    published = getattr(message.link, "published", None)
    if published is None or published.training:
      # A learner that finished while no syncer listened (its TrainingDone was lost) is not
      # training; one that finishes from now on says so after this.
      self._training.add(m)

  def _held_version(self, m: int, p: int) -> int:
    """The version of Theta_p learner m's last report (or its attach) says it holds; 0 before.
    Never newer than what it holds: it applies broadcasts before it reports."""
    held = self._reported_anchors.get(m)
    return 0 if held is None else int(held[p])

  def _naming_last_merged(self, m: int, broadcast: messages.Broadcast) -> messages.Broadcast:
    """`broadcast` as sent to learner m: it also names the last offer of m that a merge of the
    fragment took. In order that is one m has applied already (a no-op there); after a lost
    broadcast (a partition) it tells m that those steps are in Theta_p, so its overwrite does not
    count them as discarded too."""
    p = broadcast.fragment
    merged = self._merged_through.get((m, p), 0)
    if m in broadcast.merged_offers or merged <= 0:
      return broadcast
    return dataclasses.replace(broadcast, merged_offers={**broadcast.merged_offers, m: merged})

  # ---- heartbeats ------------------------------------------------------------------------------

  def _check_heartbeats(self) -> None:
    """Marks absent the learners silent past their timeout, takes back those that reported.

    Only learners still training are watched (a finished one has no step to report); the
    lock-step modes wait for every learner by design and are not watched.
    """
    if self._sync.lock_step:
      return
    now = self._now()
    watched = self._live & self._training
    emas = {m: ema.value for m, ema in self._grace.step_times}
    absent = heartbeat.absent({m: self._last_report_at.get(m, now) for m in watched}, emas, now,
                              self._sync.heartbeat_timeout_s, self._sharing)
    for m in sorted(absent - self._absent):
      self._mark_absent(m, now, heartbeat.timeout_s(self._sync.heartbeat_timeout_s, emas.get(m),
                                                    self._sharing))
    for m in sorted(self._absent - absent):
      if m in self._live:
        self._take_back(m, now)
      else:
        self._absent.discard(m)

  def _mark_absent(self, m: int, now: float, timeout_s: float) -> None:
    self._absent.add(m)
    self._absent_at[m] = now
    self.stats.absences += 1
    for round_ in self._rounds.values():
      # Its offers still on their way are late: weight 0 (the flush still waits for them).
      if not round_.final and round_.copying.pop(m, None) is not None:
        self.stats.late_offers += 1
    record = {"learner": m, "incarnation": self._incarnations.get(m, 0),
              "step": self._learner_steps.get(m, 0),
              "silent_s": round(now - self._last_report_at.get(m, now), 3),
              "timeout_s": round(timeout_s, 3)}
    logging.warning("syncer: learner %d has not reported for %.2f s (timeout %.2f s, "
                    "config.sync.heartbeat_timeout_s): absent, merging without it", m,
                    record["silent_s"], timeout_s)
    if self._metrics is not None:
      self._metrics.write("absent", record)

  def _take_back(self, m: int, now: float) -> None:
    """m reported again: it counts from the next poll on, and gets every Theta_p newer than the
    versions its report says it holds (it may have lost broadcasts meanwhile)."""
    self._absent.discard(m)
    self.stats.returns += 1
    held = self._reported_anchors.get(m)
    sent, nbytes = [], 0
    for p in range(len(self.model.fragments)):
      if held is not None and self.model.version(p) <= held[p]:
        continue
      version, wire = self.model.wire(p)
      if version == 0:
        continue  # never merged: it holds the initial Theta_p
      broadcast = self._naming_last_merged(m, messages.Broadcast(p, version, wire))
      self._learners[m].deliver(broadcast)
      sent.append(p)
      nbytes += broadcast.nbytes
    self.stats.catch_up_fragments += len(sent)
    self.stats.bytes_down += nbytes
    record = {"learner": m, "incarnation": self._incarnations.get(m, 0),
              "step": self._learner_steps.get(m, 0),
              "absent_s": round(now - self._absent_at.pop(m, now), 3), "fragments_sent": sent,
              "bytes_sent": nbytes}
    logging.info("syncer: learner %d reports again at step %d: taken back, sent %d newer "
                 "fragment(s)", m, record["step"], len(sent))
    if self._metrics is not None:
      self._metrics.write("back", record)

  def _drop_offers_of(self, m: int) -> None:
    for round_ in self._rounds.values():
      dropped = round_.offers.pop(m, None) or round_.copying.pop(m, None)
      if dropped is not None:
        self.stats.rejected_offers["stale_incarnation"] += 1
      round_.answered.discard(m)

  def _advance_clock(self) -> None:
    """Fragments fall due on the clock of the fastest learner still training (spec §3).

    The clock advances by the progress of that learner; when it finishes (or fails), the clock goes
    on at the pace of the next fastest, so slower learners keep being synced to their last step.
    """
    if self._sync.lock_step or self._flush_state != "none":
      return  # lock-step learners push their offers; the flush syncs everything once more
    steps = [self._learner_steps.get(m, 0) for m in self._training]
    lead = max(steps) if steps else None
    if lead is not None and self._lead is not None and lead > self._lead:
      for _ in range(lead - self._lead):
        self._clock += 1
        for p in self._schedule.due_fragments(self._clock):
          self._fall_due(p)
    self._lead = lead

  def _fall_due(self, p: int) -> None:
    self.stats.merges_due += 1
    if p in self._rounds or p in self._merging:
      self.stats.due_while_in_flight += 1
      self._owed.add(p)
    elif self._cut is not None:
      self._owed.add(p)  # opened right after the cut (request_cut)
    else:
      self._open_round(p, self._clock)

  def _open_round(self, p: int, clock: int, *, final: bool = False, poll: bool = True) -> _Round:
    if self._sync.lock_step or final:
      quorum, use_grace = max(len(self._live), 1), False
    else:
      quorum, use_grace = self._sync.quorum, True
    round_ = _Round(p, clock, self._now(), quorum, use_grace, poll, final=final)
    self._rounds[p] = round_
    return round_

  def _poll_rounds(self) -> None:
    """Takes the due fragments from the learners' latest publications."""
    for p, round_ in self._rounds.items():
      if not round_.poll:
        continue
      for m in sorted(self._live - self._absent):
        if m in round_.offers or m in round_.copying or m in round_.answered:
          continue
        answer = self._learners[m].offer(p, self._merged_through.get((m, p), 0))
        if isinstance(answer, messages.PendingAnswer):
          # A learner in another process: its answer is on its way (runtime/transport/ray_runtime.py).
          round_.copying[m] = (answer, self._now())
        else:
          self._admit(round_, m, answer, copying=True)

  def _admit(self, round_: _Round, m: int, answer: messages.Offer | messages.Answer, *,
             copying: bool) -> None:
    """Learner m's answer to round_: an offer (still copying to host RAM, or landed), or none."""
    p = round_.fragment
    merged_through = self._merged_through.get((m, p), 0)
    if isinstance(answer, messages.Offer) and (
        answer.since < merged_through or answer.anchor_version < self._min_anchor[p]):
      answer = messages.Answer.STALE  # holds merged steps, whatever the learner says
    if isinstance(answer, messages.Offer):
      if copying:
        round_.copying[m] = (answer, self._now())
      else:
        round_.offers[m] = answer
        round_.landed_at = self._now()
    elif answer is messages.Answer.STALE:
      self.stats.stale_answers += 1
    elif answer is messages.Answer.NOTHING and m not in self._training:
      round_.answered.add(m)  # it will make no new step: nothing to wait for

  def _accept_pushed(self, offer: messages.Offer) -> None:
    """Lock-step learners push their offers; the first one of a fragment opens its round."""
    p = offer.fragment
    round_ = self._rounds.get(p)
    if round_ is None and p not in self._merging and self._flush_state == "none":
      round_ = self._open_round(p, offer.step, poll=False)
    if offer.since < self._merged_through.get((offer.learner, p), 0):
      self.stats.stale_answers += 1  # holds steps a merge already took in
      return
    if round_ is None or offer.learner in round_.offers or offer.learner in round_.copying:
      self.stats.late_offers += 1
      return
    round_.copying[offer.learner] = (offer, self._now())

  def _collect_landed_offers(self) -> None:
    """Offers enter their round once their copy to host RAM has landed."""
    now = self._now()
    for round_ in self._rounds.values():
      for m, (offer, _) in list(round_.copying.items()):
        if offer.in_host_memory:
          del round_.copying[m]
          if isinstance(offer, messages.PendingAnswer):
            answer = offer.result()  # in host RAM already: the learner's process sent it
            if self._from_earlier_incarnation(answer):
              continue  # counted in rejected_offers.stale_incarnation
            self._admit(round_, m, answer, copying=False)
            continue
          round_.offers[m] = offer
          round_.landed_at = now

  def _close_ready_rounds(self) -> None:
    now = self._now()
    for p in list(self._rounds):
      round_ = self._rounds[p]
      fresh = [o for o in round_.offers.values() if o.fresh]
      # The flush waits for every live learner; a regular round neither waits for nor counts an
      # absent one (heartbeats).
      live = self._live if round_.final else self._live - self._absent
      waiting_for = live - set(round_.offers) - round_.answered
      if not live:
        self._close(round_, [])
        continue
      if self._sync.lock_step and not round_.final:
        # A barrier: every learner present has offered (or has nothing), and, unless
        # config.sync.elastic_lock_step, every learner being repaired is back.
        if not waiting_for and not self._awaited:
          self._close(round_, fresh)
        continue
      if round_.final:
        if not waiting_for:
          self._close(round_, fresh)
        continue
      if round_.quorum_at is None and len(fresh) >= min(round_.quorum, len(live)):
        round_.quorum_at = now
        self._grace = self._grace.observe_quorum(now - round_.opened_at)
        window = 0.0
        if round_.use_grace:
          window = self._grace.window((self._training & live) or live, overlap=self._sync.overlap,
                                      gamma=self._sync.grace_gamma, cap=self._sync.grace_cap_s)
        round_.deadline = now + window
      if round_.quorum_at is not None:
        if now >= round_.deadline or not waiting_for:
          self._close(round_, fresh)
      elif not waiting_for:
        # Everyone live has answered and the quorum is still out of reach: nothing to merge.
        self._close(round_, [])

  def _close(self, round_: _Round, offers: list[messages.Offer]) -> None:
    p = round_.fragment
    del self._rounds[p]
    self.stats.late_offers += len(round_.copying)  # taken, still copying: weight 0
    if not offers:
      if not any(o.fresh for o in round_.offers.values()) and not (self._live & self._training):
        self.stats.empty_rounds += 1  # nobody had a step left: no quorum was missed
      elif not round_.final:
        self.stats.rounds_without_quorum += 1
      self._open_owed(p)
      return
    offers = tuple(sorted(offers, key=lambda o: o.learner))
    self._merging.add(p)
    closed_at = self._now()
    future = self._workers.submit(self._merge_on_worker, p, offers)
    future.add_done_callback(
        lambda f: self._inbox.put(_MergeDone(round_, offers, closed_at, f)))

  def _open_owed(self, p: int) -> None:
    if p in self._owed and self._cut is None:
      self._owed.discard(p)
      if self._flush_state == "none":
        self._open_round(p, self._clock)

  def _advance_flush(self) -> None:
    if self._flush_state == "requested" and not self._rounds and not self._merging:
      self._flush_state = "running"
      self._owed.clear()  # the final rounds sync every fragment
      for p in range(len(self.model.fragments)):
        self._open_round(p, self._clock, final=True)
    elif self._flush_state == "running" and not self._rounds and not self._merging:
      self._flush_state = "done"
      self._flush_done.set()

  def _advance_cut(self) -> None:
    """Takes the cut asked for once no merge is in flight and every live learner holds every
    current version (request_cut); gives up after its timeout."""
    request = self._cut
    if request is None:
      return
    cut = None
    if not self._rounds and not self._merging and self._flush_state in ("none", "done"):
      versions = np.asarray(self.model.versions)
      with self._lock:
        live = sorted(self._live)
      publications = {m: self._learners[m].published for m in live}
      if all(np.array_equal(pub.anchor_versions, versions) and pub.opt_state is not None
             for pub in publications.values()):
        cut = SyncerCut(self.state(include_tape=request.include_tape), publications,
                        {m: self._incarnations.get(m, 0) for m in live}, self._clock)
    timed_out = self._now() - request.asked_at > request.timeout_s
    if cut is None and not timed_out:
      return
    if cut is None:
      logging.warning("syncer: no consistent cut within %.1f s (a learner did not apply the "
                      "latest merges); the checkpoint is tried again later", request.timeout_s)
    self._cut = None
    request.future.set_result(cut)
    for p in sorted(self._owed):
      if p not in self._rounds and p not in self._merging:
        self._open_owed(p)

  def _merge_on_worker(self, p: int, offers: tuple[messages.Offer, ...]):
    """(when a worker took the merge up, on the syncer's clock, and `_compute_merge`'s result)."""
    return self._now(), self._compute_merge(p, offers)

  def _compute_merge(self, p: int, offers: tuple[messages.Offer, ...]
                     ) -> tuple[global_model_lib.Screening, global_model_lib.MergeResult | None]:
    """Runs on a worker thread: the syncer's thread installs nothing of fragment p meanwhile.

    Screens the offers first: Theta_p never moves from a rejected one. None: all were rejected.
    """
    screening = self.model.screen(p, offers)
    if not screening.accepted:
      # Lock-step learners wait for a new version of p: they get Theta_p back, unchanged.
      return screening, self.model.unchanged(p) if self._sync.lock_step else None
    return screening, self.model.merge(p, screening.accepted)

  def _tape_merge(self, p: int, offers: tuple[messages.Offer, ...],
                  screening: global_model_lib.Screening,
                  result: global_model_lib.MergeResult | None, version: int | None,
                  final: bool) -> None:
    """The event tape's record of a screened round: every offer it screened (a rejected one moves
    the fragment's norm window too), the new version, and fingerprints of the offers and of the
    new Theta_p, which a replay meant to be exact compares against its own."""
    if self._metrics is None or not getattr(self._metrics, "taping", False):
      return
    accepted = {id(o) for o in screening.accepted}
    self._metrics.tape_event("merge", {
        "fragment": p, "version": version, "final": final,
        "offers": [[o.learner, o.incarnation, o.step, o.publication] for o in offers],
        "anchor_versions": [o.anchor_version for o in offers],
        "accepted": [id(o) in accepted for o in offers],
        "offer_fingerprints": [tape_lib.fingerprint(o.values) for o in offers],
        "theta_fingerprint": None if result is None else tape_lib.fingerprint(result.theta)})

  # ---- back on the syncer's thread: install, broadcast, record -----------------------------------

  def _finish_merge(self, done: _MergeDone) -> None:
    started_at, (screening, result) = done.future.result()  # a worker's error fails here
    round_, offers = done.round_, screening.accepted
    p = round_.fragment
    self.model.keep_screening(screening)
    for rejection in screening.rejected:
      self._record_rejection(p, rejection)
    if result is None:  # every offer was rejected: Theta_p, its version and outer state stay
      self._tape_merge(p, done.offers, screening, None, None, round_.final)
      # (lock-step modes get `unchanged`, a new version of the same Theta_p)
      self._merging.discard(p)
      self._open_owed(p)
      if round_.final and not screening.window.norms and any(
          r.reason == "outlier" for r in screening.rejected):
        # Learners that agree with each other against the fragment's history emptied its window
        # (robust.py: the yardstick was stale, not they). During training the next round takes
        # their steps; the flush has no next round, so it runs this one again.
        self._open_round(p, self._clock, final=True)
      return
    with self._lock:
      live = sorted(self._live)
    version = self.model.install(result, self._anchored_versions(p, live))
    self._tape_merge(p, done.offers, screening, result, version, round_.final)
    # Records describe the current incarnation only: a learner restarted while this merge ran
    # counts its steps again from its new start.
    current = [o for o in offers if o.incarnation == self._incarnations.get(o.learner, 0)]
    for offer in current:
      key = (offer.learner, p)
      self._merged_through[key] = max(self._merged_through.get(key, 0), offer.step)
    broadcast = messages.Broadcast(p, version, result.wire, {o.learner: o.step for o in current},
                                   base_version=result.base_version)
    keyframe, sends = None, []
    for m in live:
      sent = broadcast
      if broadcast.base_version is not None and self._held_version(m, p) != broadcast.base_version:
        if keyframe is None:
          keyframe = dataclasses.replace(broadcast, values=self.model.keyframe(result),
                                         base_version=None)
        sent = keyframe
        self.stats.keyframes += 1
      sends.append((m, self._naming_last_merged(m, sent)))
    bytes_down = sum(sent.nbytes for _, sent in sends)
    now = self._now()
    self._merging.discard(p)
    sync_s = now - done.closed_at
    self._grace = self._grace.observe_sync(sync_s)
    shards = self.model.mesh.devices.size
    terms = sum(v.size for v in result.theta.values()) + 2 * len(result.theta)  # w*phi, w*|D|, w
    stats = self.stats
    stats.merges += 1
    stats.final_merges += int(round_.final)
    stats.bytes_up += result.bytes_up
    stats.bytes_down += bytes_down
    stats.bytes_allreduce += 2 * (shards - 1) * terms * _FLOAT_BYTES
    stats.peak_held_bytes = max(stats.peak_held_bytes,
                                self.held_bytes() + sum(o.nbytes for o in done.offers))
    quorum_at = round_.quorum_at or done.closed_at
    decision = {
        "fragment": p, "version": version, "clock": round_.clock, "final": round_.final,
        "learners": [o.learner for o in offers],
        "incarnations": [o.incarnation for o in offers],
        "weights": [float(result.weights[o.learner]) for o in offers],
        "tokens": [o.tokens for o in offers], "steps": [o.steps for o in offers],
        "learner_steps": [o.step for o in offers],
        "since_steps": [o.since for o in offers],
        "anchor_versions": [o.anchor_version for o in offers],
        # ||Delta_m|| per step, the robust merge's yardstick
        "norms": [round(n, 6) for n in screening.norms],
        "quorum_wait_s": round(quorum_at - round_.opened_at, 5),
        "grace_window_s": round((round_.deadline or quorum_at) - quorum_at, 5),
        "grace_waited_s": round(done.closed_at - quorum_at, 5),
        "copy_s": round(max((round_.landed_at or round_.opened_at) - round_.opened_at, 0.0), 5),
        "queue_s": round(started_at - done.closed_at, 5),
        "encode_s": round(result.encode_s, 5), "merge_s": round(result.merge_s, 5),
        "broadcast_s": round(result.wire_s, 5),
        "sync_s": round(sync_s, 5), "bytes_up": result.bytes_up,
        "bytes_down": bytes_down,
    }
    # On the tape before any learner can hold the merge: a runtime whose tape is copied out of
    # this process (runtime/transport/ray_syncer.py) sends the broadcasts once the copy has the record, so
    # a merge some learner applied is never missing from the command's tape.
    self.tape.append(decision)
    for m, sent in sends:
      self._learners[m].deliver(sent)
    if self._metrics is not None:
      self._metrics.write("merge", decision, step=stats.merges, scalars={
          "syncer/participants": len(offers), "syncer/grace_waited_s": decision["grace_waited_s"],
          "syncer/sync_s": sync_s,
          "syncer/bytes_learner_syncer": stats.bytes_up + stats.bytes_down})
    self._open_owed(p)

  def _record_rejection(self, p: int, rejection: global_model_lib.Rejection) -> None:
    offer = rejection.offer
    self.stats.rejected_offers[rejection.reason] += 1
    median = "none yet" if rejection.median is None else f"{rejection.median:.4g}"
    logging.warning("syncer: rejected learner %d's offer of fragment %d (step %d, incarnation %d): "
                    "%s outer gradient, norm per unit of learning rate %.4g, median of accepted ones %s",
                    offer.learner, p, offer.step, offer.incarnation, rejection.reason,
                    rejection.norm, median)
    if self._metrics is not None:
      # A norm that is not finite is written as null: metrics.jsonl stays strict JSON.
      self._metrics.write("rejected", {
          "learner": offer.learner, "incarnation": offer.incarnation, "fragment": p,
          "step": offer.step, "reason": rejection.reason,
          "norm": rejection.norm if math.isfinite(rejection.norm) else None,
          "median": rejection.median})

  def _anchored_versions(self, p: int, live: list[int]) -> list[int]:
    """Versions of fragment p that a live learner, or an offer in an open round, may be anchored
    at: each learner's last reported version (0 before its first report)."""
    anchored = [int(self._reported_anchors[m][p]) if m in self._reported_anchors else 0
                for m in live]
    round_ = self._rounds.get(p)
    if round_ is not None:
      anchored += [o.anchor_version for o in round_.offers.values()]
      anchored += [o.anchor_version for o, _ in round_.copying.values()]
    return anchored
