"""When each fragment is synced: the staggered schedule of Streaming DiLoCo (docs/design.md §3).

Each of the P fragments is synced every H inner steps, the fragments evenly staggered so that the
communication load is spread over the period: fragment p's phase is offset(p) = p·H/P. With
P = H = 24 one fragment starts a sync at every step.

Conventions (all steps are inner steps, counted from 1; "after step t" is the boundary between inner
steps t and t+1):

- Fragment p is *due* after step t when t >= 1 and t ≡ offset(p) (mod H). So fragment 0 first syncs
  after step H, fragment p > 0 after step offset(p), and every fragment every H steps after that.
  The first round of fragment p > 0 is thus a short one of offset(p) steps; in exchange the schedule
  is in its steady state from step 1 (with P = H, exactly one fragment is due after every step),
  instead of idling the network for the first H steps.
- A sync started after step s is applied after step s + τ (the overlap τ): its communication runs
  while the learner computes inner steps s+1 .. s+τ. τ = 0 is the blocking, lock-step case.
"""

from __future__ import annotations

import dataclasses
import numbers


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SyncSchedule:
  """The sync schedule of P fragments with period H and overlap τ.

  Attributes:
    num_fragments: P (``config.sync.num_fragments``).
    period: H, inner steps between two syncs of the same fragment (``config.sync.period``).
    overlap: τ, inner steps between the start of a fragment's sync and when its result is applied
      (``config.sync.overlap``); used by lock-step modes and the simulator.
  """

  num_fragments: int
  period: int
  overlap: int

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    """Raise ValueError naming the config field if the schedule is not well formed."""
    P, H, tau = self.num_fragments, self.period, self.overlap
    if not _is_int(P) or P < 1:
      raise ValueError(f"config.sync.num_fragments={P!r} must be an integer >= 1")
    if not _is_int(H) or H < 1:
      raise ValueError(f"config.sync.period={H!r} must be an integer >= 1")
    if H % P:
      # Offsets p·H/P must be whole steps and evenly spaced; this also means P <= H, so no two
      # fragments ever start on the same step.
      raise ValueError(
          f"config.sync.period={H} must be a multiple of config.sync.num_fragments={P}"
      )
    if not _is_int(tau) or not 0 <= tau < H:
      # A fragment's sync must be applied before its next sync starts H steps later.
      raise ValueError(
          f"config.sync.overlap={tau!r} must be an integer in [0, config.sync.period={H})"
      )

  @property
  def stride(self) -> int:
    """H / P: inner steps between the starts of consecutive fragments."""
    return self.period // self.num_fragments

  def _check_fragment(self, p: int) -> None:
    if not 0 <= p < self.num_fragments:
      raise ValueError(f"fragment {p} is not in [0, num_fragments={self.num_fragments})")

  def offset(self, p: int) -> int:
    """The phase of fragment p within the period: p·H // P."""
    self._check_fragment(p)
    return p * self.period // self.num_fragments

  def first_step(self, p: int) -> int:
    """The first step after which fragment p is due: offset(p), or H for offset 0."""
    return self.offset(p) or self.period

  def is_due(self, p: int, step: int) -> bool:
    """Whether a sync of fragment p starts after inner step ``step`` (steps count from 1)."""
    return step >= 1 and step % self.period == self.offset(p)

  def due_fragments(self, step: int) -> tuple[int, ...]:
    """The fragments whose sync starts after ``step``: at most one, since P <= H."""
    phase = step % self.period
    if step < 1 or phase % self.stride:
      return ()
    return (phase // self.stride,)

  def apply_step(self, start_step: int) -> int:
    """The step after which a sync started after ``start_step`` is applied: start_step + τ."""
    return start_step + self.overlap

  def round_index(self, p: int, step: int) -> int:
    """How many syncs of fragment p have started up to and including ``step``."""
    return max(0, (step - self.first_step(p)) // self.period + 1)

  def in_flight(self, step: int) -> tuple[int, ...]:
    """Fragments in flight at the boundary after ``step``, before results are applied there.

    That is every sync started after a step s <= ``step`` and applied after step s + τ >= ``step``.
    At most ⌈(τ+1)·P/H⌉ of them: the starts of τ+1 consecutive steps, spaced H/P apart.
    """
    started = []
    for s in range(max(1, step - self.overlap), step + 1):
      started.extend(self.due_fragments(s))
    return tuple(started)
