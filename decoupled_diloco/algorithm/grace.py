"""The adaptive grace window (docs/design.md §4), as pure functions over moving averages.

After a fragment's quorum is reached the syncer may wait a little longer to admit more learners, but
only inside the slack that the tau-step overlap leaves, so that no learner is ever blocked:

    slack = tau * xi_step - (xi_quorum + xi_sync)
    grace = clamp(gamma * slack, 0, cap)

xi_step is the inner-step time of the slowest live learner, xi_quorum the time from a fragment falling
due to its quorum, xi_sync the time of merge + outer step + transfer; each is an EMA.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Ema:
  """An exponential moving average; `value` is None until the first observation."""

  decay: float
  value: float | None = None

  def update(self, x: float) -> "Ema":
    if self.value is None:
      return dataclasses.replace(self, value=float(x))
    return dataclasses.replace(self, value=self.decay * self.value + (1.0 - self.decay) * float(x))

  def get(self, default: float = 0.0) -> float:
    return default if self.value is None else self.value


def grace_window(*, overlap: int, step_time: float, quorum_time: float, sync_time: float,
                 gamma: float, cap: float) -> float:
  """Seconds the syncer may wait after quorum: clamp(gamma * slack, 0, cap) (docs/design.md §4)."""
  slack = overlap * step_time - (quorum_time + sync_time)
  return min(max(gamma * slack, 0.0), cap)


@dataclasses.dataclass(frozen=True)
class GraceEstimator:
  """The three EMAs the grace window needs; immutable, each update returns a new estimator."""

  decay: float
  step_times: tuple[tuple[int, Ema], ...] = ()  # (learner, EMA of its step time)
  quorum: Ema | None = None
  sync: Ema | None = None

  def observe_step(self, learner: int, seconds: float) -> "GraceEstimator":
    table = dict(self.step_times)
    table[learner] = table.get(learner, Ema(self.decay)).update(seconds)
    return dataclasses.replace(self, step_times=tuple(sorted(table.items())))

  def observe_quorum(self, seconds: float) -> "GraceEstimator":
    return dataclasses.replace(self, quorum=(self.quorum or Ema(self.decay)).update(seconds))

  def observe_sync(self, seconds: float) -> "GraceEstimator":
    return dataclasses.replace(self, sync=(self.sync or Ema(self.decay)).update(seconds))

  def slowest_step_time(self, live: frozenset[int] | set[int]) -> float:
    times = [ema.get() for learner, ema in self.step_times if learner in live]
    return max(times, default=0.0)

  def window(self, live, *, overlap: int, gamma: float, cap: float) -> float:
    return grace_window(
        overlap=overlap,
        step_time=self.slowest_step_time(live),
        quorum_time=(self.quorum or Ema(self.decay)).get(),
        sync_time=(self.sync or Ema(self.decay)).get(),
        gamma=gamma,
        cap=cap,
    )


def to_dict(estimator: GraceEstimator) -> dict:
  """The estimator as plain JSON values (for checkpoints)."""
  return {"decay": estimator.decay,
          "step_times": [[learner, ema.value] for learner, ema in estimator.step_times],
          "quorum": estimator.quorum.value if estimator.quorum else None,
          "sync": estimator.sync.value if estimator.sync else None}


def from_dict(values: dict) -> GraceEstimator:
  """The inverse of `to_dict`."""
  decay = values["decay"]
  return GraceEstimator(
      decay=decay,
      step_times=tuple((int(m), Ema(decay, v)) for m, v in values["step_times"]),
      quorum=Ema(decay, values["quorum"]) if values["quorum"] is not None else None,
      sync=Ema(decay, values["sync"]) if values["sync"] is not None else None)
