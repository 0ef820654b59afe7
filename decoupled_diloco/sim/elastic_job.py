"""An elastic data-parallel job at slice granularity, simulated event by event.

Mechanics (the `elastic_dp` system, and each learner of `decoupled`):
  * The job holds S slices of c chips. Each healthy slice fails at rate c / MTBI.
  * A failure of a slice in the mesh throws away the step in flight and pauses the whole job for a
    re-configuration (rebuild the mesh on the survivors, mean `reconfig_s`). Nothing else is lost:
    the surviving data-parallel replicas hold the full training state.
  * The failed slice is repaired after a random delay (mean `repair_s`). A repaired slice re-joins
    at once, which pauses the job for another re-configuration (re-grow).
  * A slice that comes back during a re-configuration joins in that same one. A failure during a
    re-configuration aborts it: a new one, of fresh random length, starts then.
  * While running, every chip of the mesh trains usefully; chips of slices under repair are idle.

Two terms of a decoupled learner, both off by default (the paper's model):
  * `unmerged_period_s` = H·step_s: a crash also loses, for every fragment, the steps made since the
    syncer last took that fragment in, or since the learner's restart if later (`unmerged_lost_s`).
  * `discard_share` = d/H: the overwrite on receive drops d steps of a fragment's progress at each of
    its merges, one every H steps, so that share of every running second's work (DISCARDED).

A finite run, off by default (the paper's model runs every job to the horizon): `step_budget_s`,
config.num_steps × step_s. Once the job has made that many seconds of steps it is done, and its
chips are FINISHED until the horizon, where the run's window ends with its last learner. What
counts is the runtime's step counter: completed steps (the step in flight at a crash is not one;
the unmerged steps a crash loses are, as the learner's counter keeps them). A job that lost every
slice restarts from a peer's step, as a crashed learner does (`runtime/core/rejoin.py`:
`step_after` is the healthy peer's newest published step), so it skips ahead: to the steps of a
peer that ran since t = 0 without a stop, read at the repair, before the re-configuration. A job
that rejoins at or past its budget is done there (the runtime's rejoiner at num_steps makes no
step). The peer is an idealisation: the runtime's healthiest peer may itself have skipped ahead
and be a restart behind.

For λ = N / MTBI failures per second and pauses of mean r, each failure costs about two pauses
(shrink, re-grow), step_s/2 of lost work, and its slice's chips for a repair, so to first order
    goodput ≈ (1 − q) · (1 − λ·step_s/2) / (1 + 2·λ·r),
q = slice unavailability (`cluster.slice_unavailability`). The simulation is exact where this
approximates: pauses that overlap, heavy-tailed pauses cut short by a new failure (which makes the
mean pause shorter as failures get more frequent), a job left with no slice.
"""

import heapq
import math
from typing import Optional, Sequence

import numpy as np

from decoupled_diloco.sim import accounting
from decoupled_diloco.sim.cluster import ClusterParams, RandomStream, num_slices


def unmerged_lost_s(ran_s: float, period_s: float) -> float:
  """Expected work a crashed decoupled learner loses besides the step in flight, `ran_s` after its
  restart (or the run's start), when the syncer takes each fragment in every `period_s`.

  A fragment's progress since its last take-in (or since the restart, if later) is lost with the
  learner. Take-ins are staggered evenly over the period, so the time since fragment p's last one is
  U·H with U ~ Uniform[0, 1), and averaged over fragments the loss is
      E[min(n, U·H)] = n − n²/(2H) for n < H,   H/2 for n ≥ H,
  n = `ran_s`, H = `period_s`. A continuous approximation: take-ins fall on step boundaries at P
  discrete phases, and a merge lands a few steps after its take-in (that lag is the overwrite's
  discard, `discard_share`). `period_s` = 0: nothing (the paper's model).
  """
  if period_s <= 0.0 or ran_s <= 0.0:
    return 0.0
  if ran_s >= period_s:
    return period_s / 2.0
  return ran_s - ran_s * ran_s / (2.0 * period_s)


def simulate_elastic_job(
    num_chips: float,
    params: ClusterParams,
    horizon_s: float,
    rng: np.random.Generator,
    *,
    warmup_s: float = 0.0,
    rejoin_stale_s: float = 0.0,
    rejoin_discount: float = 0.0,
    failure_times_s: Optional[Sequence[float]] = None,
    repair_durations_s: Optional[Sequence[float]] = None,
    unmerged_period_s: float = 0.0,
    discard_share: float = 0.0,
    step_budget_s: float = math.inf,
) -> accounting.JobTrace:
  """Simulates one elastic job of `num_chips` chips over [0, horizon_s) after a warm-up.

  Args:
    num_chips: chips allocated to the job (N for elastic DP, N/M for one learner).
    params: the cluster's physical parameters.
    horizon_s: measured wall-clock time.
    rng: numpy generator; the only source of randomness.
    warmup_s: simulated before t = 0 and not measured, so slices under repair reach steady state.
    rejoin_stale_s: after each pause, the job's first `rejoin_stale_s` seconds of steps are stale
      (decoupled learners: until fresh fragments arrive, ~H steps).
    rejoin_discount: share of those stale steps' useful work that does not count (0 = none).
    failure_times_s: scripted failures instead of the Poisson process: at each of these times one
      slice of the mesh fails (tests of one failure's cost). No warm-up is simulated then.
    repair_durations_s: with `failure_times_s`, the repair time of each scripted failure, in the
      same order (a fault schedule a real run drew, replayed); None = drawn as usual.
    unmerged_period_s: seconds between two take-ins of one fragment by the syncer (H·step_s). A
      failure then also loses `unmerged_lost_s` of the steps run since the last pause before the
      step in flight (decoupled learners: the progress no merge had taken in yet). 0 = only the
      step in flight, a DP snapshot per step.
    discard_share: share of every running second's work that the overwrite on receive drops
      (decoupled learners: d/H, d steps of a fragment's progress dropped at each of its merges).
    step_budget_s: seconds of completed steps after which the job is done (config.num_steps ×
      step_s), counted from t = 0, skipping ahead to a non-stop peer's at a restart from no slice
      (module docstring); its chips are FINISHED from then to the horizon, and no later failure
      hits it. inf: it runs to the horizon (the paper's model).

  Returns:
    The job's trace: useful chip-seconds, badput buckets, pause intervals.
  """
  if horizon_s <= 0:
    raise ValueError(f"horizon_s={horizon_s} must be > 0")
  if not 0.0 <= rejoin_discount <= 1.0:
    raise ValueError(f"rejoin_discount={rejoin_discount} must be in [0, 1]")
  if not unmerged_period_s >= 0.0:
    raise ValueError(f"unmerged_period_s={unmerged_period_s} must be >= 0")
  if not 0.0 <= discard_share <= 1.0:
    raise ValueError(f"discard_share={discard_share} must be in [0, 1]")
  if not step_budget_s > 0.0:
    raise ValueError(f"step_budget_s={step_budget_s} must be > 0")
  if repair_durations_s is not None and (
      failure_times_s is None or len(repair_durations_s) != len(failure_times_s)):
    raise ValueError("repair_durations_s needs failure_times_s of the same length, one repair per "
                     f"failure (got {None if failure_times_s is None else len(failure_times_s)} "
                     f"failures, {len(repair_durations_s)} repairs)")
  total_slices = num_slices(num_chips, params.slice_chips)
  chips = num_chips / total_slices  # per slice
  slice_rate = chips / params.mtbi_s
  reconfig_s, repair_s, step_s = params.reconfig_s, params.repair_s, params.step_s
  rand = RandomStream(rng, params)
  inf = math.inf
  scripted = None if failure_times_s is None else sorted(failure_times_s, reverse=True)
  scripted_repairs = None if repair_durations_s is None else [
      d for _, d in sorted(zip(failure_times_s, repair_durations_s), reverse=True)]
  if scripted is not None:
    warmup_s = 0.0

  t = -warmup_s
  in_mesh = total_slices  # slices the job trains on (or will, once the current pause ends)
  waiting = 0  # repaired slices that join when the current pause ends
  repairs = []  # heap of repair completion times
  # pause_end is infinite while paused with no slice left: the next repair restarts the job.
  paused, pause_start, pause_end = False, 0.0, inf
  run_since = t  # steps run back to back from here
  stale_until = -inf
  kept = 1.0 - discard_share  # of a running chip-second's work, what no overwrite drops
  useful = reconfig = idle = stale = lost = discarded = 0.0  # chip-seconds from t = 0 on
  pauses, num_failures = [], 0
  made = 0.0  # seconds of completed steps from t = 0 on: the step counter × step_s
  finished_at = horizon_s  # when the job made its step budget

  while True:
    healthy = in_mesh + waiting
    if scripted is None:
      t_fail = t + rand.exponential() / (healthy * slice_rate) if healthy else inf
    else:
      t_fail = scripted[-1] if scripted and healthy else inf
    t_repair = repairs[0] if repairs else inf
    t_done = inf if paused else max(t, 0.0) + step_budget_s - made
    t_next = min(t_fail, t_repair, pause_end, t_done, horizon_s)

    a = t if t > 0.0 else 0.0
    if t_next > a:
      dt = t_next - a
      idle += (total_slices - in_mesh) * chips * dt
      mesh_time = in_mesh * chips * dt
      if paused:
        reconfig += mesh_time
      else:
        made += dt
        discarded += mesh_time * discard_share
        mesh_time *= kept
        if stale_until > a and rejoin_discount:
          discounted = in_mesh * chips * (min(t_next, stale_until) - a) * kept * rejoin_discount
          stale += discounted
          mesh_time -= discounted
        useful += mesh_time
    t = t_next
    if t >= horizon_s:
      break

    if t == t_done:
      finished_at = t
      break
    if t == pause_end:
      in_mesh += waiting
      waiting = 0
      if t > 0.0:
        pauses.append((max(pause_start, 0.0), t))
      paused, pause_end = False, inf
      run_since = t
      stale_until = t + rejoin_stale_s
    elif t == t_repair:
      heapq.heappop(repairs)
      waiting += 1
      if not paused:
        paused, pause_start, pause_end = True, t, t + rand.duration(reconfig_s)
      elif pause_end == inf:  # the job had no slice left; this one restarts it, at a peer's step
        made = max(made, t, 0.0)
        if made >= step_budget_s:
          finished_at = t
          break
        pause_end = t + rand.duration(reconfig_s)
    else:  # a failure of one healthy slice, uniformly at random (scripted: one of the mesh)
      if scripted:
        scripted.pop()
        hit_mesh = in_mesh > 0
      else:
        hit_mesh = rand.uniform() * healthy < in_mesh
      if hit_mesh:
        if t > 0.0:
          num_failures += 1
          if not paused:
            # The step in flight (and the unmerged steps before it) was counted as useful, stale
            # or discarded so far, in the shares every running second is split into: move it to
            # lost.
            ran = min(t - run_since, t)
            in_flight = min((t - run_since) % step_s, t) if step_s > 0.0 else 0.0
            gone = in_flight + unmerged_lost_s(ran - in_flight, unmerged_period_s)
            made -= in_flight
            stale_part = max(0.0, min(t, stale_until) - (t - gone)) * rejoin_discount
            useful -= in_mesh * chips * kept * (gone - stale_part)
            stale -= in_mesh * chips * kept * stale_part
            discarded -= in_mesh * chips * discard_share * gone
            lost += in_mesh * chips * gone
        in_mesh -= 1
      else:
        waiting -= 1
      repair = scripted_repairs.pop() if scripted_repairs else rand.duration(repair_s)
      heapq.heappush(repairs, t + repair)
      if not paused:
        paused, pause_start = True, t
      # A new (or restarted) re-configuration, without the failed slice.
      pause_end = t + rand.duration(reconfig_s) if in_mesh + waiting > 0 else inf

  if paused or finished_at < horizon_s:  # a finished job makes no progress either
    pauses.append((max(pause_start if paused else finished_at, 0.0), horizon_s))
  badput = accounting.empty_badput()
  badput[accounting.FINISHED] = num_chips * (horizon_s - finished_at)
  badput[accounting.RECONFIGURATION] = reconfig
  badput[accounting.LOST_PROGRESS] = lost
  badput[accounting.IDLE_DOWN] = idle
  badput[accounting.STALE] = stale
  badput[accounting.DISCARDED] = discarded
  return accounting.JobTrace(
      num_chips=num_chips,
      horizon_s=horizon_s,
      useful=useful,
      badput=badput,
      pauses_Kx2=accounting.pauses_array(pauses),
      num_failures=num_failures,
  )
