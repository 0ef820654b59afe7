"""The syncer's state: what a checkpoint of it holds, a consistent cut, and a restarted syncer.

`state()` is everything a restarted syncer needs (the global model, which learner steps merges
took, the clock, the grace estimator, the counters), read on the syncer's thread; `load_state`
restores it before the syncer starts, and `recover` adds what the live learners hold that is newer.
A cut (`Syncer.request_cut`) is the syncer's state and every live learner's publication at one
instant with no merge in flight: a job checkpoint's content.

These are methods of `Syncer` (`syncer/syncer.py`), over the state its `__init__` sets up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco.algorithm import grace as grace_lib
from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.runtime.core import global_model as global_model_lib
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core.syncer import rounds as syncer_rounds


@dataclasses.dataclass(frozen=True)
class StateRequest:
  future: concurrent.futures.Future


@dataclasses.dataclass
class CutRequest:
  """request_cut(): a consistent cut of the syncer and the live learners, or None on timeout."""

  future: concurrent.futures.Future
  timeout_s: float
  include_tape: bool
  asked_at: float = 0.0
  # A shard's cut (`Syncer.request_cut(hold=TOKEN)`): once taken, no round opens until released
  # by that token (`held` then, since `held_at`).
  hold: str = ""
  held: bool = False
  held_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class SyncerCut:
  """The syncer's state and every live learner's publication at one instant, consistent: no
  merge in flight, and every publication holds exactly the current Theta_p versions."""

  state: dict[str, Any]  # Syncer.state()
  publications: dict[int, messages.Publication]
  incarnations: dict[int, int]
  clock: int


class SyncerCheckpoints:
  """The state's part of `Syncer`: state(), load_state(), recover() and the consistent cut."""

  # Set up by `Syncer.__init__`.
  _now: Callable[[], float]
  model: global_model_lib.GlobalModel
  _lock: threading.Lock
  _learners: dict[int, syncer_rounds.LearnerLink]
  _incarnations: dict[int, int]
  _live: set[int]
  _learner_steps: dict[int, int]
  _reported_anchors: dict[int, np.ndarray]
  _merged_through: dict[tuple[int, int], int]
  _rounds: dict[int, syncer_rounds.Round]
  _merging: set[int]
  _owed: set[int]
  _clock: int
  _lead: int | None
  _grace: grace_lib.GraceEstimator
  _cut: CutRequest | None
  _min_anchor: np.ndarray
  _flush_state: str
  stats: syncer_rounds.SyncerStats
  tape: list[dict[str, Any]]

  def recover(self, state: Mapping[str, Any] | None,
              publications: Mapping[int, messages.Publication], *,
              stats: syncer_rounds.SyncerStats, tape: list[dict[str, Any]]) -> dict[str, Any]:
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
    # A learner whose process is down gives a stand-in without state (every version -1).
    holding = [pub for pub in publications.values() if pub.anchors]
    for p in self.model.owned:
      fragment = self.model.fragments[p]
      newest = max(holding, key=lambda pub: pub.anchor_versions[p], default=None)
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
            "fragments_from_learners": from_learners, "lost_merges": len(lost),
            # Which: the event tape's reader marks those merge records lost (event_tape.read).
            "lost_merge_versions": [[int(self.tape[i]["fragment"]), int(self.tape[i]["version"])]
                                    for i in lost]}
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
      self.stats = syncer_rounds.SyncerStats(**stats, rejected_offers=rejected)
      self.tape = list(values.get("tape", []))
  def _advance_cut(self) -> None:
    """Takes the cut asked for once no merge is in flight and every live learner holds every
    current version (request_cut); gives up after its timeout."""
    request = self._cut
    if request is None:
      return
    if request.held:
      if self._now() - request.held_at > request.timeout_s:
        logging.warning("syncer: a held cut was not released within %.1f s; merging again",
                        request.timeout_s)
        self._end_cut()
      return
    cut = None
    if not self._rounds and not self._merging and self._flush_state in ("none", "done"):
      # (A shard's versions of the fragments it owns: the others are other shards' to hold.)
      owned = list(self.model.owned)
      versions = np.asarray(self.model.versions)[owned]
      with self._lock:
        live = sorted(self._live)
      publications = {m: self._learners[m].published for m in live}
      if all(np.array_equal(np.asarray(pub.anchor_versions)[owned], versions)
             and pub.opt_state is not None for pub in publications.values()):
        cut = SyncerCut(self.state(include_tape=request.include_tape), publications,
                        {m: self._incarnations.get(m, 0) for m in live}, self._clock)
    timed_out = self._now() - request.asked_at > request.timeout_s
    if cut is None and not timed_out:
      return
    if cut is None:
      logging.warning("syncer: no consistent cut within %.1f s (a learner did not apply the "
                      "latest merges); the checkpoint is tried again later", request.timeout_s)
    request.future.set_result(cut)
    if cut is not None and request.hold:
      request.held, request.held_at = True, self._now()  # until release_cut()
      return
    self._end_cut()

  def _end_cut(self) -> None:
    """No cut is asked for any more: the rounds owed meanwhile open."""
    self._cut = None
    for p in sorted(self._owed):
      if p not in self._rounds and p not in self._merging:
        self._open_owed(p)
