"""Audits of a run's merge tape: pure functions over its records, no state and no I/O.

Each merge record names, per learner that took part, the learner steps its offer covered:
(since_steps[i], learner_steps[i]]. From those alone one can check what the runtime promises:

- no learner step is merged twice into the same fragment (`double_merged_offers`);
- after the final flush every learner's every step has reached every fragment of Theta
  (`unmerged_steps_at_end`).

These are measured, not assumed: `summary.json` reports both from the tape the syncer wrote.

A restarted learner counts its steps again from where it rejoined: records name each offer's
incarnation (absent: 0), and steps are compared within one incarnation only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def _offers(record: Mapping[str, Any]) -> Iterable[tuple[tuple[int, int], int, int]]:
  """((learner, incarnation), since, step) of each offer a merge took in."""
  incarnations = record.get("incarnations", [0] * len(record["learners"]))
  return zip(zip(record["learners"], incarnations), record["since_steps"],
             record["learner_steps"])


def lost_merges(tape: Sequence[Mapping[str, Any]], versions: Sequence[int]) -> list[int]:
  """Indices of the merges a restarted syncer does not hold: of a fragment p, a version newer
  than the `versions[p]` it restored (from its checkpoint, or the newest a live learner holds).

  A syncer process killed after a merge went on its tape and before its broadcasts left
  (runtime/transport/ray_syncer.py holds them until the command's copy of the tape has the record) took
  that merge down with it: no learner applied it, no checkpoint holds it, and the steps it took
  in are offered again. Records already marked lost are not counted again.
  """
  return [i for i, record in enumerate(tape)
          if not record.get("lost") and record["version"] > versions[record["fragment"]]]


def installed(tape: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """The merges of the tape that Theta kept: all but those a syncer crash lost (`lost`)."""
  return [record for record in tape if not record.get("lost")]


def double_merged_offers(tape: Sequence[Mapping[str, Any]]) -> int:
  """Offers that carried steps an earlier merge of the same fragment had already taken in.

  Walks the tape in merge order and keeps, per (learner, incarnation, fragment), the last learner
  step merged; an offer whose steps (since, step] start before it repeats merged progress.
  """
  merged_through: dict[tuple[int, int], int] = {}
  doubles = 0
  for record in installed(tape):
    p = record["fragment"]
    for learner, since, step in _offers(record):
      key = (learner, p)
      if since < merged_through.get(key, 0):
        doubles += 1
      merged_through[key] = max(merged_through.get(key, 0), step)
  return doubles


def unmerged_steps_at_end(tape: Sequence[Mapping[str, Any]], final_steps: Sequence[int],
                          num_fragments: int, incarnations: Sequence[int] | None = None,
                          start_steps: Sequence[int] | None = None) -> list[int]:
  """Per learner, its steps that never reached Theta: max over fragments of final_step - last
  merged step of that learner in that fragment (0 when every fragment took its last step).

  Only the learner's last incarnation counts (`incarnations[m]`, which started at
  `start_steps[m]`): what a failed one lost is reported with the failure. Steps that an overwrite
  on receive discarded by design (the paper's alpha = 0) are not counted: they were replaced, not
  lost.
  """
  incarnations = incarnations or [0] * len(final_steps)
  start_steps = start_steps or [0] * len(final_steps)
  last: dict[tuple[tuple[int, int], int], int] = {}
  for record in installed(tape):
    for key, _, step in _offers(record):
      last[key, record["fragment"]] = max(last.get((key, record["fragment"]), 0), step)
  return [max((final - max(start, last.get(((m, inc), p), 0)) for p in range(num_fragments)),
              default=0)
          for m, (final, inc, start) in enumerate(zip(final_steps, incarnations, start_steps))]


def merged_after_failure(tape: Sequence[Mapping[str, Any]], learner: int, incarnation: int,
                         anchor_versions: Sequence[int]) -> int:
  """Tokens of a failed incarnation's offers that merges took in after it stopped applying them.

  At its failure a learner's counters hold every token no applied merge has taken in, including
  those of offers a merge took in whose broadcast (version > its anchor version of the fragment)
  it never applied. Those tokens reached Theta; the rest of its counters were lost with it.
  """
  tokens = 0
  for record in installed(tape):
    if record["version"] <= anchor_versions[record["fragment"]]:
      continue
    for key, offered in zip(_offers(record), record["tokens"]):
      if key[0] == (learner, incarnation):
        tokens += offered
  return tokens


def applied_then_lost(tape: Sequence[Mapping[str, Any]], learner: int, incarnation: int,
                      anchor_versions: Sequence[int]) -> int:
  """Tokens of a failed incarnation's offers in merges it applied and a crashed syncer then lost.

  Applying a merge takes its offers' tokens out of the learner's counters; a syncer that crashed
  before any live learner or checkpoint held that Theta_p restarts below it and marks the merge
  lost (`lost_merges`). If the one incarnation that held it failed too, those tokens are in no
  counter and in no installed merge: lost with the two failures.
  """
  tokens = 0
  for record in tape:
    if not record.get("lost") or record["version"] > anchor_versions[record["fragment"]]:
      continue
    for key, offered in zip(_offers(record), record["tokens"]):
      if key[0] == (learner, incarnation):
        tokens += offered
  return tokens


def fingerprint(arrays: Mapping[str, Any]) -> str:
  """A fingerprint of named float arrays that changes with any bit of any of them: per array in
  name order, the sum (mod 2**64) and the xor of its 32-bit words. The event tape records one per
  offer and per merged Theta_p, and a replay meant to be exact compares its own against them.
  Not a cryptographic hash: it finds divergence, it does not defend against forgery."""
  parts = []
  for name in sorted(arrays):
    words = np.ascontiguousarray(np.asarray(arrays[name], np.float32)).reshape(-1).view(np.uint32)
    total = int(words.sum(dtype=np.uint64))
    xor = int(np.bitwise_xor.reduce(words)) if words.size else 0
    parts.append(f"{total:016x}{xor:08x}")
  return hashlib.sha256("".join(parts).encode()).hexdigest()[:24]


def params_sha256(arrays: Mapping[str, Any]) -> str:
  """sha256 of named arrays (name, dtype, shape and bytes, in name order): `summary.json`'s
  `params_sha256`, equal for two runs whose final parameters are bit-identical."""
  digest = hashlib.sha256()
  for name in sorted(arrays):
    value = np.ascontiguousarray(np.asarray(arrays[name]))
    digest.update(f"{name}:{value.dtype.str}:{value.shape};".encode())
    digest.update(value.tobytes())
  return digest.hexdigest()
