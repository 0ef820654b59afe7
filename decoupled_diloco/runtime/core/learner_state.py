"""The plain data a learner is made from and restarts from (runtime/core/learner.py).

Its options (one learner's share of the run's settings), the host snapshot of its whole state that
starts it again where it stopped, its counters, and the one call it makes on the syncer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import numpy as np

from decoupled_diloco.algorithm import schedule as schedule_lib
from decoupled_diloco.lm import inner


class SyncerLink(Protocol):
  """The one call a learner makes on the syncer: a non-blocking post."""

  def post(self, message: Any) -> None:
    ...


@dataclasses.dataclass
class LearnerSnapshot:
  """Host copy of a learner's whole state at a step boundary; restarts it where it stopped."""

  step: int
  train_state: inner.TrainState  # numpy leaves
  data_state: Any  # the grain iterator's get_state()
  counter_steps: np.ndarray  # [P]
  counter_tokens: np.ndarray  # [P]
  since: np.ndarray  # [P]
  anchors: dict[str, np.ndarray]
  anchor_versions: np.ndarray  # [P]
  # Lock-step: per fragment, the barriers (rounds) it has taken part in; None = its versions. A
  # rejoiner takes a peer's, so that it waits at the barrier the peer waits at.
  offers_made: np.ndarray | None = None


class Counters(NamedTuple):
  """Per fragment: steps and tokens no applied merge has taken in, and the Theta_p versions held."""

  steps: np.ndarray
  tokens: np.ndarray
  anchor_versions: np.ndarray


@dataclasses.dataclass(frozen=True)
class LearnerOptions:
  """One learner's share of the run's settings (`train.build` derives it; no defaults here)."""

  num_steps: int
  lock_step: bool
  schedule: schedule_lib.SyncSchedule | None  # lock-step modes offer on their own schedule
  alpha: float  # theta <- alpha*theta + (1-alpha)*Theta on receive; 0 = overwrite
  # On receiving a merge, keep the steps no merge has taken yet: theta <- Theta + (those steps), and
  # the counters keep them. False = the paper's plain overwrite, which drops them.
  keep_in_flight_progress: bool
  step_delay_s: float  # emulated slower hardware: each step takes its own time plus this
  # Emulated step-time noise: after each step the learner also sleeps a number of seconds drawn
  # uniformly from [0, 2 x this), from `noise_seed`'s own stream (mean this, std this / sqrt(3)).
  step_noise_s: float
  noise_seed: tuple[int, ...]
  log_every: int
  # Lock-step only: give up waiting for a merge after this long (config.stall_timeout_s).
  wait_timeout_s: float
  # (first, last) steps to trace with jax.profiler into profile_dir (config.profile_steps; learner
  # 0 only); None = no trace.
  profile_steps: tuple[int, int] | None
  profile_dir: str
