"""The simulated cluster: its physical parameters and its random failure, repair and pause times.

Spec §7: chip failures arrive as a Poisson process with a per-chip mean time between interruptions
(MTBI, 1 year in the paper); recovery delays follow a Weibull-type distribution. The paper did not
publish the slice size, the delay distribution, the restart and re-configuration times or the
checkpoint interval. They are the six fields of `ClusterParams` after `mtbi_years`, shared by every
system and every cluster size, and chosen once. The paper's goodput numbers are never an input.

A chip failure takes its whole slice (the unit of ICI connectivity, the unit every system schedules)
out of service. With S slices of c chips, each healthy slice fails at rate c / MTBI, so a job of
N chips sees failures at rate λ = N / MTBI (one every 26 s at N = 1.2M, MTBI = 1 year).

Every random duration — a slice's repair, a restart, a re-configuration — is drawn from a Weibull
distribution with the given mean and one shared shape k:
    D = mean · W / Γ(1 + 1/k),   W ~ Weibull(k),   so E[D] = mean.
k < 1 is the heavy tail seen in the field: most interruptions clear quickly, a few take far longer.
k = inf makes every duration exactly its mean (used by tests that check one failure's exact cost).
"""

import dataclasses
import math

import numpy as np

SECONDS_PER_YEAR = 365.25 * 24 * 3600.0
SECONDS_PER_DAY = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class ClusterParams:
  """Physical parameters of the simulated cluster, shared by all systems and all sizes.

  The defaults were chosen once, by physical reasoning and a small manual search over round values
  (listed in docs/design.md §7); they are not fitted per cell.
  """

  # Per-chip mean time between interruptions, in years. The paper's scenario (docs/design.md §7): 1
  # year. The question asked, not one of the six unpublished parameters.
  mtbi_years: float = 1.0
  # Chips per slice: the granularity at which hardware fails, is repaired and is scheduled. 256 is
  # one TPU v5e / v6e pod (a 16x16 ICI torus).
  slice_chips: int = 256
  # Shape k of the Weibull distribution of every random duration below. k < 1 is heavy-tailed, as
  # field repair and restart times are (most are quick, a few get stuck); 0.85 is a mild tail.
  # It matters through the restarts: a failure aborts a restart and a fresh (usually short) one
  # begins, which keeps DP's mean recovery below restart_s at extreme failure rates.
  weibull_shape: float = 0.85
  # Mean time until a failed slice is back in service (drain, reboot or swap the bad host, re-admit
  # the slice): about an hour. A 256-chip slice is then out q = 256·1 h / 1 year ≈ 2.9% of the time.
  repair_s: float = 3600.0
  # Mean pause of an elastic job (all its chips idle) to rebuild its mesh after it loses a slice,
  # and again to re-grow onto a repaired one: membership agreement and collective re-initialisation,
  # with compiled programs cached and the training state still in device memory.
  reconfig_s: float = 10.0
  # Mean restart of a non-elastic job: reschedule onto a spare slice, initialise devices, load the
  # compiled program, restore the last checkpoint from (peer-replicated) host memory.
  restart_s: float = 95.0
  # Training step time, which is also the checkpoint interval: with a failure every 13-200 s a DP
  # job must snapshot its state to host memory after every step (asynchronously), or it would lose
  # more than it keeps. A failure throws away the step in flight, in every system.
  step_s: float = 1.0

  def __post_init__(self):
    for name in ("mtbi_years", "slice_chips", "weibull_shape", "repair_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"ClusterParams.{name}={getattr(self, name)} must be > 0")
    for name in ("reconfig_s", "restart_s", "step_s"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"ClusterParams.{name}={getattr(self, name)} must be >= 0")

  @property
  def mtbi_s(self) -> float:
    return self.mtbi_years * SECONDS_PER_YEAR

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def num_slices(num_chips: float, slice_chips: int) -> int:
  """Slices of a job of `num_chips` chips: the nearest whole number, at least one.

  N / M is rarely a multiple of the slice size (150k / 16 = 9375 chips = 36.6 slices of 256); the job
  then holds round(N / slice_chips) slices of N / S chips each, which keeps its chip count exact.
  """
  if num_chips <= 0:
    raise ValueError(f"num_chips={num_chips} must be > 0")
  return max(1, int(round(num_chips / slice_chips)))


def slice_unavailability(chips_per_slice: float, params: ClusterParams) -> float:
  """Long-run share of time a slice is out of service: q = λ_s·E[D] / (1 + λ_s·E[D]).

  An alternating renewal process: up for Exp(λ_s) with λ_s = chips_per_slice / MTBI (a slice that is
  down cannot fail again), then down for a repair of mean E[D] = repair_s.
  """
  load = chips_per_slice / params.mtbi_s * params.repair_s
  return load / (1.0 + load)


class RandomStream:
  """Pre-drawn exponential, uniform and unit-mean Weibull variates, consumed one at a time.

  Event loops consume one or two variates per event; drawing them from numpy in blocks keeps the
  per-event cost at a list pop instead of a numpy call (the whole grid must run in seconds).
  """

  _BLOCK = 65536

  def __init__(self, rng: np.random.Generator, params: ClusterParams):
    self._rng = rng
    self._shape = params.weibull_shape
    self._fixed = math.isinf(params.weibull_shape)
    self._unit = 1.0 / math.gamma(1.0 + 1.0 / params.weibull_shape)
    self._exp, self._uni, self._dur = [], [], []

  def exponential(self) -> float:
    """A standard exponential variate (mean 1)."""
    if not self._exp:
      self._exp = self._rng.standard_exponential(self._BLOCK).tolist()
    return self._exp.pop()

  def uniform(self) -> float:
    if not self._uni:
      self._uni = self._rng.random(self._BLOCK).tolist()
    return self._uni.pop()

  def duration(self, mean_s: float) -> float:
    """A Weibull duration of mean `mean_s` and the cluster's shape."""
    if self._fixed:
      return mean_s
    if not self._dur:
      self._dur = (self._unit * self._rng.weibull(self._shape, self._BLOCK)).tolist()
    return mean_s * self._dur.pop()
