"""The event tape of a run, and its replay with no race (docs/checkpoints_and_replay.md).

A decoupled run's outcome depends on thread timing: which offers each merge took, from which of a
learner's publications, and before which of its steps each learner applied which merge. The tape,
`workdir/tape.jsonl` (config.tape), records exactly that as the run goes:

- `config`: every config field (its repr), first;
- `take` (a learner's): the syncer took fragment p from the learner's publication (step, index);
- `apply` (a learner's): the learner applied Theta_p version v at its step boundary `step`, after
  `publications` publications of that step, naming the offer of its that the merge took (`merged`);
- `respawn` (the first event of a restarted learner's incarnation): the step and the batches its
  failed predecessor had taken, the Theta versions it received and the peer publication whose
  optimizer state and step it started from;
- `merge` (the syncer's): a screened round: every offer (learner, incarnation, step, publication),
  which were accepted, the new version (null: all rejected), fingerprints of each offer and of the
  new Theta_p (`algorithm/tape.py`);
- the job's faults, rejoins, syncer restarts and checkpoints (metrics.TAPE_KINDS).

A learner writes its takes and applies under its own lock, numbered (`seq`) in the order its state
changed, so the tape orders them even though the syncer's thread makes the takes.

`replay` reruns the recording in one thread: each learner makes its steps and its takes and
applies in its recorded order; a merge runs once the offers it took exist, in recorded order. A
learner's publication (step s, index n) holds its steps up to s and the merges it applied at s
after fewer than n+1 publications of s: the replay keeps exactly the states later takes name.
Exact replay (the recording's settings): every offer and every Theta_p is compared with its
recorded fingerprint, and the first that differs stops the replay, named (`ReplayDiverged`).
Counterfactual replay (other merge.*, outer.* or compression.* settings): the same arrival
pattern, everything else recomputed; nothing is compared.

A crashed learner and its rejoin replay too: its events stop, and at its `respawn` the replay
makes the new incarnation as the supervisor did (`rejoin.rejoin_snapshot`) from the recorded
versions and the peer's publication. A slow, hung (absent, then back) or partitioned learner
changed only the timing and which messages got through, which the tape holds; the NaN of a nan
fault the replay puts into the same step's output, as the injector did. What it does not replay
yet (load() refuses it, saying so): syncer restarts, dp job restarts, late joins, corrupted checkpoints, a
rejoin with a fresh optimizer state, resumed runs, lock-step and dp modes, and learner processes
(config.runtime=ray writes only the syncer's events).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco import errors
from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import compression
from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.lm import data as data_lib
from decoupled_diloco.runtime.faults import injector
from decoupled_diloco.runtime.core import learner_replay
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import rejoin

TAPE_FILE = "tape.jsonl"
FORMAT = 1
# Settings a replay may change and stay on the recorded arrival pattern: what the syncer computes
# from the offers and what a learner does with a merge (a counterfactual replay).
COUNTERFACTUAL = ("merge.", "outer.", "compression.")
# Settings that change neither what a learner computes nor what the syncer does with offers: the
# timing, quorum and grace settings and the faults made the arrival pattern, which the tape holds.
IGNORED = ("workdir", "replay", "tape", "restore", "checkpoint.", "log_every", "eval_every",
           "eval_batches", "stall_timeout_s", "max_restarts", "profile_steps",
           "compilation_cache_dir", "donate_state", "runtime", "ray.", "syncer.",
           "learner_step_delays_s", "learner_step_noise_s", "sync.", "chaos.", "late_learners",
           "devices.slice_poll_s")
# ... except these sync fields, which shape the fragments themselves.
_SYNC_STRUCTURE = ("sync.num_fragments", "sync.fragmentation")
# Fields added since tape format 1, each with the value a recording made before it ran as: such a
# recording replayed at that value is an exact replay, not a counterfactual one.
_ADDED_FIELDS = settings_lib.ADDED_FIELDS
# A learner's own events: its takes and applies, and the respawn that starts an incarnation.
_LEARNER_KINDS = ("take", "apply", "respawn")
# Records of a restart a replay does not follow yet.
_RESTART_KINDS = ("syncer_restart", "job_restart")
# Faults a replay follows: a crashed learner's events stop and a new incarnation starts from a
# peer's state (its `respawn`); a slow, hung or partitioned learner only changed the timing and
# which messages got through, which the tape holds; a nan fault's NaN the replay puts where the
# injector did.
_LEARNER_FAULTS = ("crash", "slow", "hang", "partition", "nan")


class TapeError(errors.InputError):
  """A tape this replay cannot follow (or the replay's settings cannot follow it), said why."""


class ReplayDiverged(RuntimeError):
  """An exact replay met an offer or a merged Theta_p unlike the recording's, or a tape whose
  events contradict each other."""


def settings_record(settings: settings_lib.RunSettings) -> dict[str, str]:
  """Every config field of `settings`, dotted name -> repr of its value (the tape's `config`).
  The bundled corpus is recorded as its config value, '': its resolved path names this checkout's
  copy, which a replay in another checkout (another clone, another revision) does not have."""
  values = {}
  for name in settings_lib.config_fields():
    node = settings
    for part in name.split("."):
      node = getattr(node, part, None) if node is not None else None
    values[name] = repr(node)
  if getattr(settings.data, "source", None) == data_lib.default_corpus_path():
    values["data.source"] = repr("")
  return values


def changed_fields(recorded: Mapping[str, str], now: Mapping[str, str]) -> dict[str, list[str]]:
  """The fields a replay's settings change against the recording's, by what they do to it:
  `counterfactual` (allowed: the replay recomputes), `ignored` (no effect), `structural` (the tape
  cannot be followed)."""
  out = {"counterfactual": [], "ignored": [], "structural": []}
  for name in sorted(set(recorded) | set(now)):
    if recorded.get(name, _ADDED_FIELDS.get(name)) == now.get(name):
      continue
    if name.startswith(COUNTERFACTUAL):
      out["counterfactual"].append(name)
    elif name.startswith(IGNORED) and name not in _SYNC_STRUCTURE:
      out["ignored"].append(name)
    else:
      out["structural"].append(name)
  return out


@dataclasses.dataclass
class Tape:
  """A recorded run's tape, read back."""

  path: str
  config: dict[str, str]
  learner_events: dict[int, list[dict[str, Any]]]  # per learner, in `seq` order
  merges: list[dict[str, Any]]  # in the order the syncer made them
  events: list[dict[str, Any]]  # faults, checkpoints, absences
  revision: dict[str, Any] | None = None  # the code that recorded it (records/revision.py)


def counterfactual(recorded: dict[str, str], now: dict[str, str]) -> list[dict[str, str]]:
  """The fields a replay recomputes with, each as field, recorded value, replayed value (reprs):
  what the log and the summary's `replay_counterfactual` list."""
  return [{"field": name, "recorded": recorded.get(name), "replayed": now.get(name)}
          for name in changed_fields(recorded, now)["counterfactual"]]


def read(path: str) -> list[dict[str, Any]]:
  """Every record of a tape file in order, each merge a restarted syncer lost marked `"lost": True`.

  A `syncer_restart` record names the merges its predecessor put on the tape and took down with it
  (`lost_merge_versions`: [fragment, version] pairs; `algorithm/tape.lost_merges`): of each pair,
  the newest merge record before the restart is the lost one (the restarted syncer makes that
  fragment's version again). Raises json.JSONDecodeError naming the line of a cut record."""
  records = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as err:
        raise json.JSONDecodeError(f"line {number} of {path} is not JSON ({err.msg})", err.doc,
                                   err.pos) from err
  newest: dict[tuple[int, int], dict[str, Any]] = {}  # (fragment, version) -> its last merge
  for record in records:
    if record["kind"] == "merge" and record.get("version") is not None:
      newest[(record["fragment"], record["version"])] = record
    elif record["kind"] == "syncer_restart":
      for fragment, version in record.get("lost_merge_versions", ()):
        lost = newest.pop((fragment, version), None)
        if lost is not None:
          lost["lost"] = True
  return records


def load(workdir: str) -> Tape:
  """Reads `workdir/tape.jsonl`; a tape this replay cannot follow fails, saying why."""
  path = os.path.join(workdir, TAPE_FILE)
  configs, merges, events = [], [], []
  learner_events: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
  try:
    records = read(path)
  except json.JSONDecodeError as err:
    raise TapeError(f"config.replay={workdir!r}: {err}; a run killed while writing it leaves a "
                     "cut last line") from err
  for record in records:
    kind = record["kind"]
    if kind == "config":
      configs.append(record)
    elif kind in _LEARNER_KINDS:
      learner_events[record["learner"]].append(record)
    elif kind == "merge":
      merges.append(record)
    else:
      events.append(record)
  if not configs or configs[0].get("format") != FORMAT:
    raise TapeError(f"config.replay={workdir!r}: {path} does not start with a config record of "
                     f"tape format {FORMAT}")
  if len(configs) > 1:
    raise TapeError(f"config.replay={workdir!r}: the recorded run was resumed from a checkpoint "
                     "(its tape has a config record per start); replaying a resumed run is not "
                     "built yet")
  unfollowed = sorted({e["kind"] if e["kind"] != "fault" else f"fault {e.get('fault')}"
                       for e in events if e["kind"] in _RESTART_KINDS or (
                           e["kind"] == "fault" and e.get("fault") not in _LEARNER_FAULTS)})
  if unfollowed:
    raise TapeError(f"config.replay={workdir!r}: the recorded run had faults a replay does not "
                    f"follow yet ({', '.join(unfollowed)}); it replays learner failures and "
                    f"rejoins ({', '.join(_LEARNER_FAULTS)})")
  if merges and not learner_events:
    raise TapeError(f"config.replay={workdir!r}: the tape holds the syncer's merges but no "
                     "learner's takes and applies (a run with config.runtime=ray records only "
                     "the syncer's events)")
  for m, events_of in learner_events.items():
    events_of.sort(key=lambda e: (e.get("incarnation", 0), e["seq"]))
    incarnation = 0
    for event in events_of:
      if event.get("incarnation", 0) != incarnation:
        if event["kind"] != "respawn" or event["incarnation"] != incarnation + 1:
          raise TapeError(f"config.replay={workdir!r}: learner {m}'s incarnation "
                          f"{event.get('incarnation')} does not start with its respawn")
        if event["peer"] is None:
          raise TapeError(f"config.replay={workdir!r}: learner {m}'s incarnation "
                          f"{event['incarnation']} restarted with a fresh optimizer state (no "
                          "healthy peer); replaying that is not built yet")
        incarnation = event["incarnation"]
  return Tape(path, configs[0]["config"], dict(learner_events), merges, events,
              configs[0].get("revision"))


@dataclasses.dataclass
class ReplayOutcome:
  exact: bool  # the recording's settings (up to `ignored` fields): every fingerprint compared
  changed: dict[str, list[str]]
  merges: int  # merges that made a new Theta_p
  rounds: int  # screened rounds, those included
  takes: int
  applies: int
  respawns: int  # learner incarnations made again
  steps: list[int]  # per learner, its final step
  seconds: float


class _LearnerCursor:
  """One learner's place in its recorded events, and the publications that later takes (and
  peers' respawns) name, by (incarnation, step, index)."""

  def __init__(self, learner, events: Sequence[dict[str, Any]], nan_steps: Sequence[int] = ()):
    self.learner = learner
    self.events = list(events)
    # A nan fault corrupted the output of the step this learner made from each of these steps
    # (runtime/faults/injector.py), the first time it made it: the replay does the same.
    self.nan_steps = set(nan_steps)
    self.next = 0
    # A merge applied after n publications of the current step is in publications n, n+1, ...:
    # the state now is that of publications with index >= `tag` at this step.
    self.tag = 0
    # (incarnation, step, index) -> how many takes and respawns still name that publication
    self.wanted = collections.Counter((e.get("incarnation", 0), e["step"], e["publication"])
                                      for e in self.events if e["kind"] == "take")
    self.kept: dict[tuple[int, int, int], messages.Publication] = {}
    # The CRC of this incarnation's batches after each of them (index = batches taken), and the
    # recorded ones still to compare, as (batches, crc); the last count that compared equal.
    self.crcs = [learner.data_crc]
    self.pending_crcs: list[tuple[int, int]] = []
    self.crc_ok = 0

  def expect_crc(self, batches: int, crc: int) -> None:
    self.pending_crcs.append((batches, crc))
    self.check_crcs()

  def check_crcs(self) -> None:
    """Compares the recorded CRCs of this incarnation's batches that the replay has reached."""
    for batches, crc in list(self.pending_crcs):
      if batches >= len(self.crcs):
        continue
      if self.crcs[batches] != crc:
        raise ReplayDiverged(
            f"learner {self.learner.index} (incarnation {self.learner.incarnation}): the batches "
            f"it trained on differ from the recording's from one of its batches {self.crc_ok + 1}"
            f"-{batches} (steps {self.learner.start_step + self.crc_ok + 1}-"
            f"{self.learner.start_step + batches}; other data, tokenizer or seed?)")
      self.crc_ok = max(self.crc_ok, batches)
      self.pending_crcs.remove((batches, crc))

  def keep_for(self, below: int | None) -> None:
    """Before the state changes: keeps the publication of the state now for every take still
    to come that names one of the current step with index in [tag, below) (None: no bound)."""
    incarnation, step, publication = self.learner.incarnation, self.learner.step, None
    for key, count in self.wanted.items():
      if count and key[:2] == (incarnation, step) and key[2] >= self.tag and (
          below is None or key[2] < below) and key not in self.kept:
        publication = publication or learner_replay.publication(self.learner)
        self.kept[key] = publication

  def advance_to(self, step: int) -> None:
    while self.learner.step < step:
      self.keep_for(None)
      before = self.learner.step
      learner_replay.step(self.learner)
      if before in self.nan_steps:
        self.nan_steps.discard(before)
        learner_replay.corrupt(self.learner, injector.with_nan)
      self.crcs.append(self.learner.data_crc)
      self.tag = 0
      self.check_crcs()

  def replace(self, learner) -> None:
    """A new incarnation of the learner goes on from here."""
    self.learner, self.tag = learner, 0
    self.crcs, self.pending_crcs, self.crc_ok = [learner.data_crc], [], 0

  def holds(self, incarnation: int, step: int, index: int) -> bool:
    """Whether publication (step, index) of `incarnation` is kept, or is the state now or a later
    one of this incarnation with no apply in between still to come."""
    if (incarnation, step, index) in self.kept:
      return True
    if incarnation != self.learner.incarnation or self.learner.step > step or (
        self.learner.step == step and index < self.tag):
      return False
    for event in self.events[self.next:]:  # the next apply of this incarnation comes after it?
      if event.get("incarnation", 0) != incarnation:
        break
      if event["kind"] == "apply":
        return event["step"] > step or event["publications"] > index
    return True

  def publication(self, incarnation: int, step: int, index: int) -> messages.Publication:
    key = (incarnation, step, index)
    self.wanted[key] -= 1
    if key in self.kept:
      return self.kept[key] if self.wanted[key] else self.kept.pop(key)
    if incarnation == self.learner.incarnation and self.learner.step <= step and (
        self.learner.step < step or index >= self.tag):
      self.advance_to(step)
      return learner_replay.publication(self.learner)
    raise ReplayDiverged(f"learner {self.learner.index}: the tape names its publication {index} "
                         f"of step {step} (incarnation {incarnation}), which the replay does not "
                         f"hold (it is at step {self.learner.step}, incarnation "
                         f"{self.learner.incarnation})")


def check_replayable(tape: Tape, now_settings: Mapping[str, str]) -> dict[str, list[str]]:
  """Raises TapeError if the run of `now_settings` cannot replay `tape` (settings that shape what
  it computes differ); else `changed_fields`. The build (control/launch.py) asks before anything
  compiles."""
  changed = changed_fields(tape.config, now_settings)
  if changed["structural"]:
    first, *others = changed["structural"]
    also = f" (also {', '.join('config.' + k for k in others[:4])})" if others else ""
    raise TapeError(f"config.{first}={now_settings.get(first, '(absent)')} cannot change in a "
                    f"replay: the recording has {tape.config.get(first, '(absent)')}, and it shapes "
                    f"what the run computes{also}. Only merge.*, outer.* and compression.* may "
                    "differ (a counterfactual replay); leave the rest to the recording")
  return changed


def replay(run, tape: Tape, now_settings: Mapping[str, str]) -> ReplayOutcome:
  """Reruns `tape` on `run` (built by `train.build`, nothing started): its learners and the
  syncer's global model. Returns how it went; the global model and the learners end in the
  replayed state. Raises ReplayDiverged where an exact replay differs from the recording."""
  started = time.perf_counter()
  changed = check_replayable(tape, now_settings)
  exact = not changed["counterfactual"]
  model = run.syncer.model
  num_steps = run.settings.num_steps
  nan_steps = collections.defaultdict(list)
  for event in tape.events:
    if event["kind"] == "fault" and event.get("fault") == "nan":
      nan_steps[event["learner"]].append(event["step"])
  cursors = {m: _LearnerCursor(l, tape.learner_events.get(m, ()), nan_steps[m])
             for m, l in enumerate(run.learners)}
  for cursor in cursors.values():  # a respawn takes a peer's publication
    for event in cursor.events:
      if event["kind"] == "respawn":
        cursors[event["peer"]].wanted[(event["peer_incarnation"], event["peer_step"],
                                       event["peer_publication"])] += 1
  # Per fragment, for each of its merges, the oldest anchor version any later offer of it names:
  # the versions a merge with anchor="syncer" must keep.
  later_anchors: list[int | None] = [None] * len(tape.merges)
  oldest: dict[int, int] = {}
  for i in range(len(tape.merges) - 1, -1, -1):
    record = tape.merges[i]
    p = record["fragment"]
    later_anchors[i] = oldest.get(p)
    oldest[p] = min([oldest.get(p, record["version"] or 0), *record["anchor_versions"]])
  offers: dict[tuple[int, int, int, int, int], messages.Offer] = {}
  # (p, version) -> Theta_p as broadcast; version 0 is the initial Theta_p.
  wire: dict[tuple[int, int], Any] = {(p, 0): model.wire(p)[1]
                                      for p in range(len(model.fragments))}
  merged_through: dict[tuple[int, int], int] = {}  # (learner, p) -> its last step merged into p
  naming: dict[tuple[int, int], dict[int, int]] = {}  # (p, version) -> learner -> that step
  respawned: set[int] = set()
  merged = rounds = takes = applies = respawns = 0
  next_merge = 0
  while True:
    progressed = False
    while next_merge < len(tape.merges):
      record = tape.merges[next_merge]
      p = record["fragment"]
      keys = [(m, incarnation, p, step, pub) for m, incarnation, step, pub in record["offers"]]
      if not all(k in offers for k in keys):
        break
      round_offers = tuple(offers[k] for k in keys)
      if exact:
        for (m, _, step, _), offer, recorded in zip(record["offers"], round_offers,
                                                     record["offer_fingerprints"]):
          if tape_lib.fingerprint(offer.values) != recorded:
            raise ReplayDiverged(
                f"fragment {p}, round of version {record['version']}: learner {m}'s offer of "
                f"its step {step} differs from the recording's (other code, data or seed?)")
      screening = model.screen(p, round_offers)
      model.keep_screening(screening)
      accepted = [any(o is a for a in screening.accepted) for o in round_offers]
      if exact and accepted != record["accepted"]:
        raise ReplayDiverged(f"fragment {p}, round of version {record['version']}: the screen "
                             f"accepted {accepted}, the recording {record['accepted']}")
      rounds += 1
      if screening.accepted:
        if record["version"] is None:
          raise ReplayDiverged(f"fragment {p}: a round the recording rejected whole merges here "
                               "(a counterfactual screen): the recorded pattern has no version "
                               "for it")
        result = model.merge(p, screening.accepted)
        later = later_anchors[next_merge]
        version = model.install(result, [record["version"]] if later is None else [later])
        if version != record["version"]:
          raise ReplayDiverged(f"fragment {p}: the replay made version {version} where the "
                               f"recording made {record['version']}")
        if exact and tape_lib.fingerprint(result.theta) != record["theta_fingerprint"]:
          raise ReplayDiverged(
              f"fragment {p} version {version}: the merged Theta_p differs from the "
              f"recording's (its offers: learner, step = "
              f"{[(o.learner, o.step) for o in screening.accepted]})")
        # In full: a learner of the recording that applied this version held exactly this
        # value, whether a delta broadcast or a keyframe brought it.
        wire[(p, version)] = model.keyframe(result)
        # What the syncer names to each learner with this version: its last offer of p merged.
        for o in screening.accepted:
          merged_through[(o.learner, p)] = max(merged_through.get((o.learner, p), 0), o.step)
        naming[(p, version)] = {m: s for (m, q), s in merged_through.items() if q == p and s > 0}
        merged += 1
      elif record["version"] is not None:
        raise ReplayDiverged(f"fragment {p} version {record['version']}: every offer was "
                             "rejected here, the recording merged them")
      next_merge += 1
      progressed = True
    for m, cursor in cursors.items():
      while cursor.next < len(cursor.events):
        event = cursor.events[cursor.next]
        incarnation = event.get("incarnation", 0)
        if event["kind"] == "take":
          p = event["fragment"]
          published = cursor.publication(incarnation, event["step"], event["publication"])
          if exact and "data_crc" in event:
            cursor.expect_crc(event["batches"], event["data_crc"])
          offer = learner_replay.take(cursor.learner, published, p, event["publication"])
          offers[(m, incarnation, p, offer.step, event["publication"])] = offer
          takes += 1
        elif event["kind"] == "apply":
          p = event["fragment"]
          if (p, event["version"]) not in wire:
            break  # its merge has not run yet
          cursor.advance_to(event["step"])
          if cursor.learner.step != event["step"]:
            raise ReplayDiverged(f"learner {m}: the tape applies fragment {p} version "
                                 f"{event['version']} at step {event['step']}, after its step "
                                 f"{cursor.learner.step}")
          expected = naming.get((p, event["version"]), {}).get(m)
          # (A restarted learner is named by merges the syncer made around its attach: their
          # order against the replay's merges is not on the tape.)
          if exact and m not in respawned and event["merged"] != expected:
            raise ReplayDiverged(
                f"fragment {p} version {event['version']}: learner {m} applied it as the merge "
                f"of its offer of step {event['merged']}, but the replayed merges took "
                f"{'none of its offers' if expected is None else f'its step {expected}'}")
          cursor.keep_for(event["publications"])
          named = {} if event["merged"] is None else {m: event["merged"]}
          learner_replay.apply(cursor.learner, messages.Broadcast(p, event["version"],
                                                                  wire[(p, event["version"])], named))
          cursor.tag = event["publications"]
          applies += 1
        else:  # respawn: a new incarnation from Theta as received and a peer's state
          versions = event["versions"]
          peer = cursors[event["peer"]]
          if not all((p, v) in wire for p, v in enumerate(versions)) or not peer.holds(
              event["peer_incarnation"], event["peer_step"], event["peer_publication"]):
            break  # a merge it received, or the peer's state it started from, is still to come
          published = peer.publication(event["peer_incarnation"], event["peer_step"],
                                       event["peer_publication"])
          failed = cursor.learner
          cursor.advance_to(event["failed_step"])
          learner_replay.fail(failed, event["failed_batches"])
          theta = {}
          for p, v in enumerate(versions):
            theta.update(compression.decode_tree(wire[(p, v)]))
          snapshot = rejoin.rejoin_snapshot(
              theta, np.asarray(versions, np.int64), failed.layout, published,
              event["failed_step"], None, None)
          new = failed.respawn(snapshot)
          if new.incarnation != incarnation:
            raise ReplayDiverged(f"learner {m}: the replay made incarnation {new.incarnation} "
                                 f"where the tape has {incarnation}")
          nan_left = cursor.nan_steps
          cursor.replace(new)
          cursor.nan_steps = nan_left
          run.learners[m] = new
          for p in range(len(versions)):
            merged_through[(m, p)] = event["step"]
          respawned.add(m)
          respawns += 1
        cursor.next += 1
        progressed = True
    if not progressed:
      break
  if next_merge < len(tape.merges):
    record = tape.merges[next_merge]
    raise ReplayDiverged(f"the tape cannot be followed: fragment {record['fragment']}'s round of "
                         f"version {record['version']} names offers {record['offers']} no "
                         "learner's takes made")
  stuck = {m: c.events[c.next] for m, c in cursors.items() if c.next < len(c.events)}
  if stuck:
    raise ReplayDiverged(f"the tape cannot be followed: learner events wait for merges or peer "
                         f"states it does not hold: {stuck}")
  for cursor in cursors.values():
    cursor.advance_to(num_steps)
    learner_replay.finish(cursor.learner)
  logging.info("replayed %s: %d rounds (%d merges), %d takes, %d applies, %d respawns in %.1f s",
               tape.path, rounds, merged, takes, applies, respawns, time.perf_counter() - started)
  return ReplayOutcome(exact, changed, merged, rounds, takes, applies, respawns,
                       [c.learner.step for c in cursors.values()],
                       round(time.perf_counter() - started, 3))
