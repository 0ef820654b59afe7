"""Audits of a run's merge tape: pure functions over its records, no state and no I/O.

Each merge record names, per learner that took part, the learner steps its offer covered:
(since_steps[i], learner_steps[i]]. From those alone one can check what the runtime promises:

- no learner step is merged twice into the same fragment (`double_merged_offers`);
- after the final flush every learner's every step has reached every fragment of Theta
  (`unmerged_steps_at_end`).

These are measured, not assumed: `summary.json` reports both from the tape the syncer wrote.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _offers(record: Mapping[str, Any]) -> Iterable[tuple[int, int, int]]:
  """(learner, since, step) of each offer a merge took in."""
  return zip(record["learners"], record["since_steps"], record["learner_steps"])


def double_merged_offers(tape: Sequence[Mapping[str, Any]]) -> int:
  """Offers that carried steps an earlier merge of the same fragment had already taken in.

  Walks the tape in merge order and keeps, per (learner, fragment), the last learner step merged;
  an offer whose steps (since, step] start before it repeats merged progress.
  """
  merged_through: dict[tuple[int, int], int] = {}
  doubles = 0
  for record in tape:
    p = record["fragment"]
    for learner, since, step in _offers(record):
      key = (learner, p)
      if since < merged_through.get(key, 0):
        doubles += 1
      merged_through[key] = max(merged_through.get(key, 0), step)
  return doubles


def unmerged_steps_at_end(tape: Sequence[Mapping[str, Any]], final_steps: Sequence[int],
                          num_fragments: int) -> list[int]:
  """Per learner, its steps that never reached Theta: max over fragments of final_step - last
  merged step of that learner in that fragment (0 when every fragment took its last step).

  Steps that an overwrite on receive discarded by design (the paper's alpha = 0) are not counted:
  they were replaced, not lost.
  """
  last: dict[tuple[int, int], int] = {}
  for record in tape:
    for learner, _, step in _offers(record):
      key = (learner, record["fragment"])
      last[key] = max(last.get(key, 0), step)
  return [max((final - last.get((m, p), 0) for p in range(num_fragments)), default=0)
          for m, final in enumerate(final_steps)]
