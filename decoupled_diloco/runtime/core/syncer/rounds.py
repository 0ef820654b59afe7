"""The syncer's rounds: a fragment falls due, its offers are taken and land, and the round closes
(docs/design.md §3-§4).

A round is one sync of one fragment. It opens when the fragment falls due on the clock of the
fastest learner still training (or, in the lock-step modes, at the first pushed offer), takes the
fragment from every live learner's latest publication, lets each taken offer land in host RAM, and
closes once K fresh offers are in and the adaptive grace window has passed (or every live learner
has answered); a lock-step round is a barrier instead, and the flush's final rounds wait for every
live learner. A closed round with offers goes to a merge worker (`syncer/merges.py`); a fragment
that fell due meanwhile is owed, and opened as soon as it is back.

These are methods of `Syncer` (`syncer/syncer.py`), run on the syncer's thread over the state its
`__init__` sets up; the data types here are the ones every part of the syncer shares.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import grace as grace_lib
from decoupled_diloco.algorithm import robust
from decoupled_diloco.runtime.core import global_model as global_model_lib
from decoupled_diloco.runtime.core import messages

# How long an answer given up (its round closed first) is waited for, for its bytes only
_LATE_ANSWER_WAIT_S = 30.0
# After its final rounds the flush waits for every live learner to report holding each Theta_p;
# one still behind after this long is sent it again, in full
_FLUSH_RESEND_S = 2.0


class LearnerLink(Protocol):
  """What the syncer calls on a learner; none of it waits for the learner's step loop."""

  def offer(self, fragment: int, merged_through: int) -> messages.Offer | messages.Answer:
    ...

  def deliver(self, broadcast: messages.Broadcast) -> None:
    ...

  @property
  def published(self) -> messages.Publication:  # only for checkpoints (request_cut)
    ...

  @property
  def training(self) -> bool:  # its latest publication's: read when it attaches
    ...

  def want_full_state(self, seconds: float) -> None:  # publications with the optimizer state
    ...


@dataclasses.dataclass
class Round:
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


@dataclasses.dataclass(frozen=True)
class MergeDone:
  round_: Round
  offers: tuple[messages.Offer, ...]
  closed_at: float
  future: concurrent.futures.Future


@dataclasses.dataclass
class SyncerStats:
  merges: int = 0
  final_merges: int = 0  # merges of the flush after training
  merges_due: int = 0  # times a fragment fell due during training
  bytes_up: int = 0  # learner -> syncer, encoded outer gradients
  # learner -> syncer, every offer taken, merged or not (late, judged stale), encoded: what
  # crossed the network (the interface counters of scripts/bench_sites.py see these)
  bytes_offered: int = 0
  bytes_down: int = 0  # syncer -> learners, encoded Theta_p, once per receiving learner
  bytes_allreduce: int = 0  # across syncer shards (ring all-reduce of the merge terms)
  late_offers: int = 0  # taken, but landed after their round closed: weight 0
  stale_answers: int = 0  # a learner had not yet applied a merge of its earlier steps: asked again
  rounds_without_quorum: int = 0  # regular rounds that closed with fewer than K fresh offers
  empty_rounds: int = 0  # rounds in which no live learner had a step to give (nothing to merge)
  due_while_in_flight: int = 0  # a fragment fell due again before its last sync finished
  # Seconds its merge workers spent screening, merging and encoding rounds (a sharded syncer's
  # summary gives it per shard: how busy each one was).
  busy_s: float = 0.0
  peak_held_bytes: int = 0  # most the syncer held at once (see syncer.py's docstring)
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
  # Theta_p sent again, in full, to a learner whose reports after the flush's final rounds still
  # did not say it held it (a broadcast lost on the way)
  flush_resent_fragments: int = 0
  # The C heap's freed memory handed back to the OS after merges (runtime/core/host_heap.py,
  # config.syncer.heap_trim_every_s): how often, and the seconds it took the syncer's thread.
  heap_trims: int = 0
  heap_trim_s: float = 0.0


class SyncerRounds:
  """The rounds' part of `Syncer`: open, take offers, land them, close at quorum and grace."""

  # Set up by `Syncer.__init__`.
  _now: Callable[[], float]
  _sync: settings_lib.SyncSettings
  _schedule: Any
  model: global_model_lib.GlobalModel
  _learners: dict[int, LearnerLink]
  _live: set[int]
  _training: set[int]
  _absent: set[int]
  _awaited: set[int]
  _learner_steps: dict[int, int]
  _merged_through: dict[tuple[int, int], int]
  _rounds: dict[int, Round]
  _merging: set[int]
  _owed: set[int]
  _inbox: queue.SimpleQueue[Any]
  _clock: int
  _lead: int | None
  _grace: grace_lib.GraceEstimator
  _workers: concurrent.futures.ThreadPoolExecutor
  _owns: frozenset[int]
  _min_anchor: np.ndarray
  _cut: Any  # syncer_state.CutRequest | None: no round opens while a cut is asked for
  _flush_state: str
  _flush_done: threading.Event
  _flush_resent_at: float
  _reported_anchors: dict[int, np.ndarray]
  _lock: threading.Lock
  # Answers from other processes still on their way when their round closed: (answer, fragment,
  # when), read for bytes_offered once they land (`_count_late_answers`)
  _late_answers: list[tuple[messages.PendingAnswer, int, float]]
  stats: SyncerStats

  def _wait_timeout(self) -> float:
    if any(r.copying for r in self._rounds.values()):
      return 0.002  # poll the copies in flight; the syncer never blocks on a learner's device
    if self._late_answers:
      return 0.01  # late answers, read for their bytes only
    if any(r.poll for r in self._rounds.values()):
      return 0.005  # a learner may publish without a step (it applied a merge after training)
    deadlines = [r.deadline for r in self._rounds.values() if r.deadline is not None]
    if not deadlines:
      return 0.05
    return min(max(min(deadlines) - self._now(), 0.0), 0.05)
  def _drop_offers_of(self, m: int) -> None:
    for round_ in self._rounds.values():
      dropped = round_.offers.pop(m, None) or round_.copying.pop(m, None)
      if dropped is not None:
        self.stats.rejected_offers["stale_incarnation"] += 1
      round_.answered.discard(m)

  def _advance_clock(self) -> None:
    """Fragments fall due on the clock of the fastest learner still training (docs/design.md §3).

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
          if p in self._owns:  # (a shard's: another shard opens the others)
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

  def _open_round(self, p: int, clock: int, *, final: bool = False, poll: bool = True) -> Round:
    if self._sync.lock_step or final:
      quorum, use_grace = max(len(self._live), 1), False
    else:
      quorum, use_grace = self._sync.quorum, True
    round_ = Round(p, clock, self._now(), quorum, use_grace, poll, final=final)
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

  def _admit(self, round_: Round, m: int, answer: messages.Offer | messages.Answer, *,
             copying: bool) -> None:
    """Learner m's answer to round_: an offer (still copying to host RAM, or landed), or none."""
    p = round_.fragment
    merged_through = self._merged_through.get((m, p), 0)
    if isinstance(answer, messages.Offer):
      self.stats.bytes_offered += self.model.offer_wire_bytes(p)  # taken: it travelled
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
    self.stats.bytes_offered += self.model.offer_wire_bytes(p)
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
    if self._late_answers:
      self._count_late_answers()
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

  def _count_in_flight(self, copying, p: int) -> None:
    """Answers still on their way from another process, given up: their bytes travel all the
    same. Each is read once it lands (`_count_late_answers`): an offer counts, a STALE or NOTHING
    does not, and one that never lands (its learner cut off, or gone) never travelled."""
    now = self._now()
    self._late_answers.extend((answer, p, now) for answer, _ in copying
                          if isinstance(answer, messages.PendingAnswer))

  def _count_late_answers(self) -> None:
    """bytes_offered of the given-up answers that have landed since (`_count_in_flight`)."""
    now, waiting = self._now(), []
    for answer, p, since in self._late_answers:
      if answer.in_host_memory:
        if isinstance(answer.result(), messages.Offer):
          self.stats.bytes_offered += self.model.offer_wire_bytes(p)
      elif now - since < _LATE_ANSWER_WAIT_S:
        waiting.append((answer, p, since))
    self._late_answers = waiting

  def _close(self, round_: Round, offers: list[messages.Offer]) -> None:
    p = round_.fragment
    del self._rounds[p]
    self.stats.late_offers += len(round_.copying)  # taken, still copying: weight 0
    self._count_in_flight(round_.copying.values(), p)
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
        lambda f: self._inbox.put(MergeDone(round_, offers, closed_at, f)))

  def _open_owed(self, p: int) -> None:
    if p in self._owed and self._cut is None:
      self._owed.discard(p)
      if self._flush_state == "none":
        self._open_round(p, self._clock)

  def _advance_flush(self) -> None:
    if self._flush_state == "requested" and not self._rounds and not self._merging:
      self._flush_state = "running"
      self._owed.clear()  # the final rounds sync every fragment
      for p in self.model.owned:
        self._open_round(p, self._clock, final=True)
    elif self._flush_state == "running" and not self._rounds and not self._merging:
      self._flush_state = "applying"
      self._flush_resent_at = self._now()
    if self._flush_state == "applying":
      lagging = self._lagging_learners()
      if not lagging:
        self._flush_state = "done"
        self._flush_done.set()
      elif self._now() - self._flush_resent_at >= _FLUSH_RESEND_S:
        self._flush_resent_at = self._now()
        self._resend(lagging)

  def _lagging_learners(self) -> dict[int, list[int]]:
    """The live learners whose last report says they do not yet hold every Theta_p of this
    syncer, with those fragments. The flush's broadcasts are sent once its final rounds close,
    but over a network sent is not applied: the command releases the learners once the flush
    returns, and a release that overtook a broadcast would leave its merged steps in the
    learner's counters (counted again as unmerged) and Theta out of its hands."""
    with self._lock:
      live = sorted(self._live)
    lagging = {}
    for m in live:
      held = self._reported_anchors.get(m)
      if held is None:
        continue  # no report of versions to judge by (a learner's TrainingDone always has one)
      behind = [p for p in self.model.owned if held[p] < self.model.version(p)]
      if behind:
        lagging[m] = behind
    return lagging

  def _resend(self, lagging: dict[int, list[int]]) -> None:
    """Theta_p in full again to each learner still behind after _FLUSH_RESEND_S: a broadcast
    lost on the way (a partition) or a delta it could not apply (not holding its base)."""
    for m, fragments in lagging.items():
      for p in fragments:
        version, wire = self.model.wire(p)
        broadcast = self._naming_last_merged(m, messages.Broadcast(p, version, wire))
        self._learners[m].deliver(broadcast)
        self.stats.bytes_down += broadcast.nbytes
        self.stats.flush_resent_fragments += 1
