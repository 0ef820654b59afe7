"""Robust merge: which outer gradients a merge of fragment p may take in (docs/design.md §6).

A learner that diverged, or whose devices corrupted its state, offers an outer gradient
Delta_m = anchor - theta_m that is not finite or far larger than its peers'. One such offer would
move Theta_p (every learner then inherits it), so the syncer judges each offer before the merge:

- *nonfinite*: ||Delta_m|| is NaN or inf (some value of Delta_m is), rejected always;
- *outlier*: ||Delta_m|| > max_norm_ratio x the median of the last `WINDOW` accepted norms of that
  fragment (max_norm_ratio = 0: no outlier test). The median, not the mean: one huge norm that got
  in, or a few, barely moves it.

The caller passes norms per unit of inner learning rate (`StepScale`, `GlobalModel.screen`): the
norm divided by the sum of the learners' learning rates over the inner steps the offer covers.
Offers of one fragment cover 1 step or 11 (a learner that rejoined behind its peers), and an AdamW
step moves each parameter by about its learning rate, so an honest offer moves about as far as the
learning rates of its steps take it. Per step alone was not enough: the first round of a fragment
covers a few steps early in the warmup, the next a whole period at a rate 10-20x larger, and honest
offers of three learners out of four were rejected that way (CI, stop 24; 24 offers in the default
run). Without a schedule (`StepScale(None)`) the norm is per step.

Only accepted norms enter the window, so a learner that keeps offering outliers never makes itself
look normal. But honest norms can still drift (the loss level, the gradient noise), and with the
accepted window alone every later offer of a fragment that outgrew it would be rejected forever.
So when offers of `DISAGREEING_LEARNERS` different learners were rejected as outliers and none was
accepted since, the yardstick is taken to be stale, not all of them: the window is emptied and
refills from the next offers. A lone bad learner never empties it (any accepted peer offer
confirms the yardstick); several bad learners at once can, and are then tested again once
`MIN_ACCEPTED` norms are back in.

The norm is taken over the whole fragment (all its tensors), in float64, so that it is inf or NaN
exactly when a value is, never by overflow of the sum of squares.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

REASONS = ("nonfinite", "outlier")

# Norms kept per fragment: enough for a stable median over several rounds of M learners, few enough
# that it follows the slow drift of the norms (learning-rate schedule, loss level).
WINDOW = 32
# No outlier test before this many norms were accepted: the median of one or two offers is no
# yardstick. With M >= 4 learners one or two rounds fill it.
MIN_ACCEPTED = 4
# Learners whose outlier offers, with none accepted in between, overrule the window (see above).
# Two: one learner is the suspect; two that agree with each other against the history are the
# evidence that the scale moved. A run of one learner needs only itself.
DISAGREEING_LEARNERS = 2


class StepScale:
  """What an offer's outer-gradient norm is divided by before it is judged: the sum of the inner
  learning rates of the steps it covers, or their number when no schedule is given.

  `learning_rates[t]` is the rate of the update that takes a learner from step t to step t + 1
  (the same schedule for every learner). An offer published after step `step` covering `steps`
  steps covers the updates step - steps .. step - 1. A warmup that starts at 0 gives the first
  update no rate at all; an honest offer of that update alone moved nothing, so the sum is floored
  at the smallest positive rate, never 0.
  """

  def __init__(self, learning_rates: Sequence[float] | np.ndarray | None):
    if learning_rates is None:
      self._cumulative = None
      return
    rates = np.asarray(learning_rates, np.float64).ravel()
    if rates.size == 0 or not np.all(np.isfinite(rates)) or np.any(rates < 0):
      raise ValueError(f"learning rates must be finite and >= 0, at least one; got {rates[:4]}...")
    positive = rates[rates > 0]
    if positive.size == 0:
      raise ValueError("learning rates are all 0: no step moves a parameter")
    self._cumulative = np.concatenate([[0.0], np.cumsum(rates)])
    self._floor = float(positive.min())

  def __call__(self, step: int, steps: int) -> float:
    if self._cumulative is None:
      return float(max(steps, 1))
    end = min(max(int(step), 0), self._cumulative.size - 1)
    start = min(max(end - int(steps), 0), end)
    return max(float(self._cumulative[end] - self._cumulative[start]), self._floor)


def fragment_norm(deltas: Iterable[np.ndarray]) -> float:
  """||Delta|| over every tensor of a fragment, accumulated in float64.

  Takes the tensors one at a time (a generator keeps one in memory). A float32 value squared never
  overflows float64, so the result is finite exactly when every value is.
  """
  total = 0.0
  for delta in deltas:
    flat = np.asarray(delta, np.float64).ravel()
    total += float(flat @ flat)
  return math.sqrt(total)


@dataclasses.dataclass(frozen=True)
class NormWindow:
  """One fragment's yardstick: the last `size` accepted outer-gradient norms, oldest first, and the
  learners rejected as outliers since the last accepted offer. Immutable."""

  size: int = WINDOW
  norms: tuple[float, ...] = ()
  outliers: frozenset[int] = frozenset()

  def accept(self, norms: Iterable[float]) -> "NormWindow":
    kept = (self.norms + tuple(float(n) for n in norms))[-self.size:]
    return dataclasses.replace(self, norms=kept)

  def after_round(self, learners: Sequence[int], verdicts: Sequence["Verdict"],
                  num_learners: int) -> "NormWindow":
    """The window once a round's verdicts are in (see the module docstring).

    An accepted offer confirms the window: its norm goes in and the outliers are forgiven. With none
    accepted, the round's outlier learners add up until `DISAGREEING_LEARNERS` of them (or every
    learner of a smaller run) empty the window. A non-finite offer says nothing about the scale.
    """
    accepted = [v.norm for v in verdicts if v.reason is None]
    if accepted:
      return dataclasses.replace(self.accept(accepted), outliers=frozenset())
    outliers = self.outliers | {m for m, v in zip(learners, verdicts) if v.reason == "outlier"}
    if len(outliers) >= min(DISAGREEING_LEARNERS, num_learners):
      return dataclasses.replace(self, norms=(), outliers=frozenset())
    return dataclasses.replace(self, outliers=frozenset(outliers))

  def median(self, min_accepted: int = MIN_ACCEPTED) -> float | None:
    """The median of the window, or None while it holds fewer than `min_accepted` norms."""
    if len(self.norms) < max(min_accepted, 1):
      return None
    return float(np.median(self.norms))


class Verdict(NamedTuple):
  """Whether an offer may be merged: `reason` is None (accepted) or one of REASONS."""

  reason: str | None
  norm: float
  median: float | None  # the yardstick it was compared with (None: no outlier test yet)


def judge(norm: float, accepted: NormWindow, max_norm_ratio: float) -> Verdict:
  """The verdict on an outer gradient of norm `norm` against a fragment's accepted norms.

  Not finite: rejected. Larger than max_norm_ratio x the window's median: rejected as an outlier;
  no test when max_norm_ratio is 0, while the window holds fewer than MIN_ACCEPTED norms, or when
  its median is 0 (every accepted offer was a no-op: nothing to scale a ratio by).
  """
  median = accepted.median()
  if not math.isfinite(norm):
    return Verdict("nonfinite", norm, median)
  if max_norm_ratio > 0 and median is not None and median > 0 and norm > max_norm_ratio * median:
    return Verdict("outlier", norm, median)
  return Verdict(None, norm, median)


def judge_round(learners: Sequence[int], norms: Sequence[float], window: NormWindow,
                max_norm_ratio: float, num_learners: int
                ) -> tuple[tuple[Verdict, ...], NormWindow]:
  """Verdicts on the offers of one round (learner `learners[i]`, norm `norms[i]`), each against the
  window as it stood before the round, so offers of one round never vouch for each other; and the
  window after the round."""
  verdicts = tuple(judge(norm, window, max_norm_ratio) for norm in norms)
  return verdicts, window.after_round(learners, verdicts, num_learners)
