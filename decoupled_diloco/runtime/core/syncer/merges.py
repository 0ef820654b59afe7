"""The syncer's merges: screen and merge on a worker thread, then install, broadcast and record.

A closed round's offers go to a worker thread (`concurrent.futures`, `config.syncer.num_workers`),
which screens their outer gradients and runs the merge and the outer step (`GlobalModel.screen`,
`merge`): the syncer's thread installs nothing of that fragment meanwhile. The result comes back
through the syncer's inbox; the syncer's thread installs the new Theta_p, puts the decision on the
tape, and broadcasts it to every live learner: a delta to each whose last report says it holds the
delta's base version, a keyframe to every other one. Every broadcast names, for each learner, the
last offer of it that a merge of the fragment took, so a learner that lost the broadcast of that
merge still counts those steps as merged, not discarded.

These are methods of `Syncer` (`syncer/syncer.py`), over the state its `__init__` sets up.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import grace as grace_lib
from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.runtime.core import global_model as global_model_lib
from decoupled_diloco.runtime.core.syncer import merge_hold
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core.syncer import rounds as syncer_rounds

_FLOAT_BYTES = 4


class SyncerMerges:
  """The merges' part of `Syncer`: the worker's merge, then install, broadcast and record."""

  # Set up by `Syncer.__init__`.
  _now: Callable[[], float]
  _sync: settings_lib.SyncSettings
  _metrics: metrics_lib.MetricsWriter | None
  model: global_model_lib.GlobalModel
  _lock: threading.Lock
  _learners: dict[int, syncer_rounds.LearnerLink]
  _incarnations: dict[int, int]
  _live: set[int]
  _reported_anchors: dict[int, np.ndarray]
  _merged_through: dict[tuple[int, int], int]
  _rounds: dict[int, syncer_rounds.Round]
  _merging: set[int]
  _clock: int
  _training: set[int]
  _flush_state: str
  _stop: threading.Event
  _merge_hold: merge_hold.MergeHold
  _grace: grace_lib.GraceEstimator
  stats: syncer_rounds.SyncerStats
  tape: list[dict[str, Any]]
  shard: int | None

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

  def _merge_on_worker(self, p: int, offers: tuple[messages.Offer, ...]):
    """(when a worker took the merge up and when it was done, on the syncer's clock, and
    `_compute_merge`'s result).

    With config.syncer.merge_delay_steps the worker first holds the merge for that many learner
    steps (`syncer/merge_hold.py`): the time a slower syncer would take, counted as its queue time."""
    self._merge_hold.wait(max(o.step for o in offers), lambda: self._clock,
                          self._merges_released)
    started = self._now()
    result = self._compute_merge(p, offers)
    return started, self._now(), result

  def _merges_released(self) -> bool:
    """Read on a worker: the clock will not move again, so a held merge may go on."""
    return self._stop.is_set() or self._flush_state != "none" or not self._training

  def _compute_merge(self, p: int, offers: tuple[messages.Offer, ...]
                     ) -> tuple[global_model_lib.Screening, global_model_lib.MergeResult | None]:
    """Runs on a worker thread: the syncer's thread installs nothing of fragment p meanwhile.

    Screens the offers first: Theta_p never moves from a rejected one. None: all were rejected.
    """
    screening = self.model.screen(p, offers)
    # The accepted offers' wires are the merge's input only: not held while the result waits.
    prepared, screening = screening.prepared, dataclasses.replace(screening, prepared=None)
    if not screening.accepted:
      # Lock-step learners wait for a new version of p: they get Theta_p back, unchanged.
      return screening, self.model.unchanged(p) if self._sync.lock_step else None
    return screening, self.model.merge(p, screening.accepted, prepared)

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

  def _finish_merge(self, done: syncer_rounds.MergeDone) -> None:
    # (a worker's error fails here)
    started_at, finished_at, (screening, result) = done.future.result()
    self.stats.busy_s += finished_at - started_at
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
    # A learner's reports can lag behind its offer (a loaded host; a finished learner's last
    # report before the flush): the offer names the version of Theta_p it holds, and no other
    # merge of p reaches it before this broadcast.
    offered = {o.learner: o.anchor_version for o in current}
    keyframe, sends = None, []
    for m in live:
      sent = broadcast
      held = max(self._held_version(m, p), offered.get(m, -1))
      if broadcast.base_version is not None and held != broadcast.base_version:
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
    if self.shard is not None:
      decision["shard"] = self.shard  # which shard of a sharded syncer merged it
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
    # The merge's arrays are freed now; the heap they leave goes back to the OS now and then
    # (after the broadcasts: a learner waits for none of it).
    trimmed_s = self._heap.maybe_trim()
    if trimmed_s is not None:
      stats.heap_trims += 1
      stats.heap_trim_s += trimmed_s

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
