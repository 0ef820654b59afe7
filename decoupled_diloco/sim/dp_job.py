"""A synchronous, non-elastic data-parallel job, simulated event by event (the `dp` system).

Mechanics:
  * The job trains on all its N chips at once; each chip fails at rate 1 / MTBI, so the job is
    interrupted at rate λ = N / MTBI.
  * The state is snapshotted to host memory after every step (`step_s`), asynchronously.
  * Any failure stops the whole job: the step in flight is lost and the job restarts from the last
    snapshot, a restart of random length D (mean `restart_s`). A failure during a restart aborts it
    and a new one starts.
  * The failed slice is swapped for a healthy one from the cluster's spare pool as part of the
    restart. A fixed-size job cannot run without a full mesh, so operators keep such a pool for it;
    its chips are not charged to the job. This flatters the baseline: the elastic systems, built to
    run through a repair, are charged for their slices under repair.

A restart completes once it runs D without a failure, so the job runs a share L(λ) = E[exp(−λ·D)]
of the time (renewal argument: a run lasts 1/λ on average, a recovery (1/L − 1)/λ), and
    goodput = (1 − λ·step_s/2) · E[exp(−λ·D)]   (to first order in λ·step_s).
For a fixed D this is exp(−λ·D): a restart that must fit between two failures dooms a large job.
Field restart times are heavy-tailed (Weibull shape < 1): most restarts are short, and a failure
that aborts a long one replaces it by a fresh, usually short one, so the mean recovery (1/L − 1)/λ
stays below restart_s (about 0.7·restart_s at 2.4M chips, where λ·restart_s ≈ 7) instead of
growing like (exp(λ·D) − 1)/λ.
"""

import math
from typing import Optional, Sequence

import numpy as np

from decoupled_diloco.sim import accounting
from decoupled_diloco.sim.cluster import ClusterParams, RandomStream


def simulate_dp_job(
    num_chips: float,
    params: ClusterParams,
    horizon_s: float,
    rng: np.random.Generator,
    *,
    warmup_s: float = 0.0,
    failure_times_s: Optional[Sequence[float]] = None,
) -> accounting.JobTrace:
  """Simulates one non-elastic DP job of `num_chips` chips over [0, horizon_s) after a warm-up.

  Args:
    num_chips: chips of the job's mesh (all of N).
    params: the cluster's physical parameters (repair times do not matter here: spares do).
    horizon_s: measured wall-clock time.
    rng: numpy generator; the only source of randomness.
    warmup_s: simulated before t = 0 and not measured.
    failure_times_s: scripted failures instead of the Poisson process (tests of one failure's cost).
      No warm-up is simulated then.

  Returns:
    The job's trace: useful chip-seconds, badput buckets, pause intervals.
  """
  if horizon_s <= 0:
    raise ValueError(f"horizon_s={horizon_s} must be > 0")
  fail_rate = num_chips / params.mtbi_s
  step_s, restart_s = params.step_s, params.restart_s
  rand = RandomStream(rng, params)
  scripted = None if failure_times_s is None else sorted(failure_times_s, reverse=True)
  if scripted is not None:
    warmup_s = 0.0

  t = -warmup_s
  running, run_start, restart_end = True, t, math.inf
  run_time = lost = restart = 0.0  # seconds of the whole mesh, from t = 0 on
  pauses, pause_start, num_failures = [], 0.0, 0

  while True:
    if scripted is None:
      t_fail = t + rand.exponential() / fail_rate
    else:
      t_fail = scripted[-1] if scripted else math.inf
    t_next = min(t_fail, restart_end, horizon_s)
    a = t if t > 0.0 else 0.0
    if t_next > a:
      if running:
        run_time += t_next - a
      else:
        restart += t_next - a
    t = t_next
    if t >= horizon_s:
      break

    if t == restart_end:  # training again from the last snapshot
      running, run_start, restart_end = True, t, math.inf
      if t > 0.0:
        pauses.append((max(pause_start, 0.0), t))
    else:  # a failure: stop everything, or abort the restart in progress
      if scripted:
        scripted.pop()
      if running:
        if t > 0.0:
          # Steps run back to back from the restart; the one in flight is lost.
          lost += min((t - run_start) % step_s if step_s > 0 else 0.0, t)
          num_failures += 1
        running, pause_start = False, t
      restart_end = t + rand.duration(restart_s)

  if not running:
    pauses.append((max(pause_start, 0.0), horizon_s))
  badput = accounting.empty_badput()
  badput[accounting.RESTART] = restart * num_chips
  badput[accounting.LOST_PROGRESS] = lost * num_chips
  return accounting.JobTrace(
      num_chips=num_chips,
      horizon_s=horizon_s,
      useful=(run_time - lost) * num_chips,
      badput=badput,
      pauses_Kx2=accounting.pauses_array(pauses),
      num_failures=num_failures,
  )
