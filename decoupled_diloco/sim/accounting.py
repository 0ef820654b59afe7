"""Goodput accounting: where the allocated chip-time of a simulated job went.

goodput = useful chip-seconds / (allocated chips × wall-clock seconds), and every allocated
chip-second lands in exactly one place: useful training or one badput bucket, so
goodput + Σ badput = 1. The buckets follow Google's ml-goodput-measurement `BadputType`s
(`ML_GOODPUT_BADPUT_TYPES`), so a simulated breakdown can be set beside a real run's later.
"""

from typing import NamedTuple

import numpy as np

# Badput buckets, in chip-seconds.
RESTART = "restart"  # a non-elastic job re-initialising after a failure (restart_s on average)
RECONFIGURATION = "reconfiguration"  # an elastic job paused to shrink or re-grow its mesh
LOST_PROGRESS = "lost_progress"  # work since the last checkpoint (the step in flight), lost
IDLE_DOWN = "idle_down"  # chips of slices under repair (or repaired and about to rejoin)
STALE = "stale"  # discounted share of a rejoining learner's first (stale) steps, decoupled only
DISCARDED = "discarded"  # a learner's progress the overwrite on receive dropped, decoupled only
# A job that has made its step budget, until the horizon (a finite run: it waits for the others).
FINISHED = "finished"

BUCKETS = (RESTART, RECONFIGURATION, LOST_PROGRESS, IDLE_DOWN, STALE, DISCARDED, FINISHED)

# The ml-goodput-measurement BadputType(s) each bucket would be reported under.
ML_GOODPUT_BADPUT_TYPES = {
    RESTART: ("TPU_INITIALIZATION", "TRAINING_PREP", "PROGRAM_STARTUP",
              "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"),
    RECONFIGURATION: ("INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",),
    LOST_PROGRESS: ("WASTED_PROGRESS_FROM_DISRUPTION",),
    IDLE_DOWN: ("INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",),
    STALE: ("OTHER",),
    DISCARDED: ("OTHER",),
    FINISHED: ("OTHER",),
}


class JobTrace(NamedTuple):
  """What one simulated job (a DP job, an elastic job or one learner) did over the horizon.

  All chip-time is in chip-seconds; `pauses_Kx2` holds the [start, end) wall-clock intervals (s,
  within [0, horizon_s]) during which the job as a whole made no progress.
  """

  num_chips: float
  horizon_s: float
  useful: float
  badput: dict
  pauses_Kx2: np.ndarray
  num_failures: int  # failures that hit the job's running mesh


def empty_badput() -> dict:
  return {bucket: 0.0 for bucket in BUCKETS}


def pauses_array(pauses: list) -> np.ndarray:
  return np.asarray(pauses, dtype=np.float64).reshape(-1, 2)


def goodput(traces) -> float:
  """Σ useful / Σ allocated over jobs that together form one system (e.g. the M learners)."""
  allocated = sum(tr.num_chips * tr.horizon_s for tr in traces)
  return sum(tr.useful for tr in traces) / allocated


def badput_shares(traces) -> dict:
  """Each bucket's share of the allocated chip-time, summed over the system's jobs."""
  allocated = sum(tr.num_chips * tr.horizon_s for tr in traces)
  return {b: sum(tr.badput[b] for tr in traces) / allocated for b in BUCKETS}


def paused_time_of_all(pauses: list, horizon_s: float) -> float:
  """Wall-clock time during which every job is paused at once (the system as a whole stops).

  `pauses` is one array of disjoint [start, end) intervals per job. A sweep over all interval ends:
  +1 at a start, -1 at an end; the system is stopped while the count equals the number of jobs.
  """
  num_jobs = len(pauses)
  if num_jobs == 0:
    return 0.0
  if any(len(p) == 0 for p in pauses):
    return 0.0
  starts = np.concatenate([p[:, 0] for p in pauses])
  ends = np.concatenate([p[:, 1] for p in pauses])
  times = np.concatenate([starts, ends])
  steps = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
  # At equal times process ends before starts, so touching intervals do not count as overlap.
  order = np.lexsort((steps, times))
  times, steps = times[order], steps[order]
  count = np.cumsum(steps)
  widths = np.diff(np.append(times, horizon_s))
  return float(np.sum(widths[count == num_jobs]))


def uptime(traces) -> float:
  """Share of wall-clock time during which at least one of the system's jobs advances."""
  horizon_s = traces[0].horizon_s
  return 1.0 - paused_time_of_all([tr.pauses_Kx2 for tr in traces], horizon_s) / horizon_s
