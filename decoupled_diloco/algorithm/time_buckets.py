"""Where each learner's wall time went, and the run's goodput and uptime.

Pure: fed by timestamps the runtime records (step intervals, failure, repair and first-step times,
hangs), it splits every second of a learner's window into exactly one bucket, so the buckets of a
learner add up to the window. The names are the simulator's (`sim/accounting.py`) where the two
mean the same thing, so a real run's breakdown sits beside a simulated one:

  useful         step time whose tokens reached the global model (merged into Theta)
  discarded      step time whose tokens an overwrite on receive dropped, or still unmerged at the end
  lost_progress  step time whose tokens were lost with a failed learner (the step in flight, and the
                 steps no merge had taken in); the simulator's LOST_PROGRESS
  idle_down      from a failure until the learner's devices are repaired; the simulator's IDLE_DOWN
  restart        from the repair until the new incarnation starts its first step (building it,
                 moving the peer's state and Theta to it); the simulator's RESTART
  idle           none of the above: before the first step, after the last (with a step budget, the
                 simulator's FINISHED), a hung learner, and waits at lock-step barriers once the
                 runtime reports them as `waits`

Which step seconds were useful is not known per step: a step's tokens reach each fragment of Theta
(or not) separately. The step time is apportioned by the learner's fragment-token accounting
(`made` = merged + discarded + lost + unmerged, per fragment, summed), so a learner that discarded
20% of its fragment-tokens spent 20% of its step time on discarded work.

goodput = Σ useful / Σ every bucket, over learners (the paper's "share of allocated chip time spent
on useful training", with every learner the same size); uptime = share of the window during which at
least one learner was stepping (`sim.accounting.uptime`'s meaning).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

# The goodput simulator's names for the same buckets (`sim/accounting.py`; a test keeps them
# equal): the pure layer imports nothing from above it, the simulator included.
RESTART = "restart"
LOST_PROGRESS = "lost_progress"
IDLE_DOWN = "idle_down"
USEFUL = "useful"
DISCARDED = "discarded"
IDLE = "idle"
BUCKETS = (USEFUL, DISCARDED, LOST_PROGRESS, IDLE_DOWN, RESTART, IDLE)

Interval = tuple[float, float]


@dataclasses.dataclass(frozen=True)
class LearnerTimeline:
  """One learner over every incarnation; times in seconds on one clock, intervals [start, end).

  `steps` holds its step intervals, the step in flight at each failure included (compute spent on
  steps it made); `waits` are stretches inside them when it did not compute (a hang). Tokens are
  fragment-tokens (tokens x fragments) of the steps it made in the window.
  """

  steps: Sequence[Interval] = ()
  down: Sequence[Interval] = ()  # failure -> repair
  restarting: Sequence[Interval] = ()  # repair -> first step of the next incarnation
  waits: Sequence[Interval] = ()
  made_tokens: int = 0
  discarded_tokens: int = 0  # dropped by overwrites, or unmerged at the end
  lost_tokens: int = 0  # lost with failed incarnations


def union(intervals: Iterable[Interval], start: float = float("-inf"),
          end: float = float("inf")) -> list[Interval]:
  """Disjoint sorted intervals covering the same time as `intervals`, clipped to [start, end)."""
  clipped = sorted((max(a, start), min(b, end)) for a, b in intervals)
  merged: list[Interval] = []
  for a, b in clipped:
    if b <= a:
      continue
    if merged and a <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], b))
    else:
      merged.append((a, b))
  return merged


def subtract(intervals: Iterable[Interval], holes: Iterable[Interval]) -> list[Interval]:
  """The time in `intervals` that is in none of `holes`."""
  out = []
  holes = union(holes)
  for a, b in union(intervals):
    for h0, h1 in holes:
      if h1 <= a or h0 >= b:
        continue
      if h0 > a:
        out.append((a, h0))
      a = max(a, h1)
      if a >= b:
        break
    if a < b:
      out.append((a, b))
  return out


def measure(intervals: Iterable[Interval]) -> float:
  return float(sum(b - a for a, b in union(intervals)))


def _compute(timeline: LearnerTimeline, start: float, end: float) -> list[Interval]:
  return subtract(union(timeline.steps, start, end), timeline.waits)


def learner_buckets(timeline: LearnerTimeline, start: float, end: float) -> dict[str, float]:
  """Seconds of [start, end) in each bucket; they add up to end - start.

  Precedence where intervals overlap (they should not): computing, then down, then restarting.
  """
  compute = _compute(timeline, start, end)
  down = subtract(union(timeline.down, start, end), compute)
  restarting = subtract(union(timeline.restarting, start, end), compute + down)
  compute_s = measure(compute)
  made = max(timeline.made_tokens, 0)
  discarded_share = min(max(timeline.discarded_tokens, 0) / made, 1.0) if made else 0.0
  lost_share = min(max(timeline.lost_tokens, 0) / made, 1.0 - discarded_share) if made else 0.0
  buckets = {
      USEFUL: compute_s * (1.0 - discarded_share - lost_share),
      DISCARDED: compute_s * discarded_share,
      LOST_PROGRESS: compute_s * lost_share,
      IDLE_DOWN: measure(down),
      RESTART: measure(restarting),
  }
  buckets[IDLE] = max((end - start) - sum(buckets.values()), 0.0)
  return buckets


def covered_seconds(timelines: Iterable[LearnerTimeline], start: float, end: float) -> float:
  """Seconds of [start, end) during which at least one learner was computing."""
  return measure(i for t in timelines for i in _compute(t, start, end))


@dataclasses.dataclass
class Accounting:
  """One stretch of a run (or several added up): each learner's buckets, the window, and how much
  of it some learner computed. A resumed run adds its own to the earlier segments' (`add`)."""

  window_s: float = 0.0
  covered_s: float = 0.0
  buckets: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)

  @property
  def goodput(self) -> float:
    total = sum(sum(b.values()) for b in self.buckets.values())
    return sum(b[USEFUL] for b in self.buckets.values()) / total if total > 0 else 0.0

  @property
  def uptime(self) -> float:
    return self.covered_s / self.window_s if self.window_s > 0 else 0.0

  def add(self, other: "Accounting") -> "Accounting":
    buckets = {}
    for m in sorted(set(self.buckets) | set(other.buckets)):
      mine, theirs = self.buckets.get(m, {}), other.buckets.get(m, {})
      buckets[m] = {k: mine.get(k, 0.0) + theirs.get(k, 0.0) for k in BUCKETS}
    return Accounting(self.window_s + other.window_s, self.covered_s + other.covered_s, buckets)

  def to_json(self) -> dict:
    return {"window_s": self.window_s, "covered_s": self.covered_s,
            "buckets": {str(m): dict(b) for m, b in self.buckets.items()}}

  @classmethod
  def from_json(cls, value: Mapping | None) -> "Accounting":
    if not value:
      return cls()
    return cls(float(value["window_s"]), float(value["covered_s"]),
               {int(m): {k: float(b.get(k, 0.0)) for k in BUCKETS}
                for m, b in value["buckets"].items()})


def account(timelines: Mapping[int, LearnerTimeline], start: float, end: float) -> Accounting:
  """The buckets of every learner over [start, end), and the seconds some learner computed."""
  return Accounting(
      window_s=max(end - start, 0.0),
      covered_s=covered_seconds(timelines.values(), start, end),
      buckets={m: learner_buckets(t, start, end) for m, t in sorted(timelines.items())})
