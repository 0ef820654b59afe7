"""What a learner remembers of the offers the syncer took, and the steps an overwrite discarded.

A broadcast names the offer of each learner it merged (`Broadcast.merged_offers`), by its step. To
apply it (runtime/core/learner.py, the rule in algorithm/receive.py) the learner needs that offer's
values and counts: which of its unmerged steps are now in Theta_p. The ledger keeps them from the
take (`Learner.offer`, on the syncer's thread) until the merge that names the offer, and counts the
fragment-steps the paper's overwrite drops (`discarded_fragment_steps`), so that every step ends up
merged, discarded or unmerged exactly once. Its owner calls it under its lock.
"""

from __future__ import annotations

from absl import logging

from decoupled_diloco.runtime.core import messages

_MAX_COUNTS = 256  # taken offers' counts kept per fragment (a learner whose offers keep missing)


class TakeLedger:
  """One learner's taken offers, until a merge names them, and its discarded fragment-steps."""

  def __init__(self, learner: int):
    self._learner = learner
    # Per fragment, the last offer the syncer took. One is enough for the values: a take succeeds
    # only once every merge of this learner's earlier steps has been applied or an overwrite has
    # dropped those steps, and a merge that names an offer whose steps were dropped needs no values.
    self.taken: dict[int, messages.Offer] = {}
    # ... but it needs the counts. Per fragment, (steps, tokens) of every offer taken whose merge
    # this learner has not heard of yet, by offer step: a merge may name an offer after an
    # overwrite here dropped (and counted as discarded) its steps, and after a newer offer
    # replaced it in `taken`. Integers only; pruned as merges name later offers.
    self._counts: dict[int, dict[int, tuple[int, int]]] = {}
    # Steps dropped by an overwrite on receive (made after the merged offer, or never taken by any
    # merge), summed over fragments: the compute the paper's overwrite discards; and their tokens.
    self.discarded_steps = 0
    self.discarded_tokens = 0

  def record(self, offer: messages.Offer) -> None:
    """The syncer took `offer`."""
    self.taken[offer.fragment] = offer
    counts = self._counts.setdefault(offer.fragment, {})
    counts[offer.step] = (offer.steps, offer.tokens)
    if len(counts) > _MAX_COUNTS:  # a learner whose offers keep missing their rounds
      del counts[min(counts)]

  def merged(self, p: int, merged_step: int | None, since: int
             ) -> tuple[messages.Offer | None, bool]:
    """(the taken offer a broadcast of p merged, if its steps are still unmerged here; unknown),
    where the learner's unmerged steps of p start after step `since`.

    A merged offer whose steps an overwrite already dropped here (its step <= since) shares no
    step with the current progress: as if the merge had not taken this learner. That happens when
    the syncer took the offer from a publication made before an overwrite on its way was applied
    (again, possibly, after a round that rejected it). Those steps did reach Theta_p, though: the
    overwrite counted them as discarded, and by the counts `record` kept they leave that count.
    """
    if merged_step is None:
      return None, False
    counts = self._counts.get(p, {})
    merged_counts = counts.pop(merged_step, None)
    for older in [step for step in counts if step < merged_step]:
      del counts[older]  # in earlier rounds, whose merges are applied: never named now
    if merged_step <= since:
      if merged_counts is not None:
        # The syncer took this offer from a publication made before an overwrite here dropped
        # its steps (counted then as discarded): this merge took them in after all.
        self.discarded_steps -= merged_counts[0]
        self.discarded_tokens -= merged_counts[1]
      return None, False
    taken = self.taken.get(p)
    if taken is not None and taken.step == merged_step:
      del self.taken[p]
      return taken, False
    # Cannot happen while this learner object lives (offer() records before it returns). A learner
    # restored from a snapshot has no record: dropping its local progress is safe, keeping it
    # could merge those steps twice.
    logging.warning("learner %d: a merge of fragment %d took an offer at step %d that it has no "
                    "record of; overwriting", self._learner, p, merged_step)
    return None, True

  def discard(self, steps: int, tokens: int) -> None:
    """An overwrite dropped `steps` unmerged steps (`tokens` tokens)."""
    self.discarded_steps += steps
    self.discarded_tokens += tokens
