"""Goodput of DP, elastic DP and Decoupled DiLoCo on an N-chip cluster (docs/design.md §7).

Each system is simulated from its own mechanics, never derived from another system's result:
  * `dp`: one non-elastic data-parallel job over all N chips (`dp_job`): any failure stops
    everything, loses the step in flight and restarts from the last (per-step) snapshot.
  * `elastic_dp`: one elastic job over all N chips (`elastic_job`): a failure pauses all N chips for
    a re-configuration, then training goes on with one slice fewer.
  * `decoupled`: M learners of N/M chips, each an elastic job with its own failures; a failure costs
    only its learner. The syncer never stops while one learner runs, so the system is up unless all
    M learners are paused at once. Options, all off by default (`DecoupledOptions`): a rejoining
    learner's first steps discounted, a crash losing the progress no merge had taken in, the
    overwrite on receive dropping a share of every step, a finite run of so many steps.

goodput = Σ useful chip-s / (N × horizon); uptime = share of time the system as a whole advances.
The rule of thumb of the paper (M learners at N chips ≈ one elastic learner at N/M chips) is not
built in: it follows because a learner's failures, pauses and down slices scale with its own size.
"""

import dataclasses
import math

import numpy as np

from decoupled_diloco.sim import accounting
from decoupled_diloco.sim.cluster import SECONDS_PER_DAY, ClusterParams
from decoupled_diloco.sim.dp_job import simulate_dp_job
from decoupled_diloco.sim.elastic_job import simulate_elastic_job

DP, ELASTIC_DP, DECOUPLED = "dp", "elastic_dp", "decoupled"
SYSTEMS = (DP, ELASTIC_DP, DECOUPLED)


@dataclasses.dataclass(frozen=True)
class DecoupledOptions:
  """Decoupled-only knobs; the defaults add nothing to the elastic learner mechanics."""

  # Steps after each pause during which a learner trains on stale fragments, until the syncer's
  # broadcasts have refreshed every fragment: one sync period, H = 24 steps (docs/design.md §3).
  rejoin_stale_steps: int = 24
  # Share of those steps' work that does not count. 0: none (the paper's token weights already give
  # such steps a small say in the merge, docs/design.md §6).
  rejoin_discount: float = 0.0
  # H, the steps between two take-ins of a fragment by the syncer (config.sync.period, 24), to
  # model what a crashed learner loses besides the step in flight: for every fragment, the steps it
  # made since the syncer last took that fragment in (or since the learner's restart), H/2 on
  # average once it has run H steps (elastic_job.unmerged_lost_s; scripts/bench_sim_to_real.py
  # checks it against the runtime). 0: only the step in flight, as the paper's model counts a
  # failure.
  sync_period_steps: int = 0
  # d, the steps of a fragment's progress the overwrite on receive drops at each of its merges
  # (config.merge.keep_in_flight_progress=False: what the learner made on that fragment while its
  # merge was in flight), so a share d / H of every running second's work. Needs sync_period_steps.
  # 0: nothing dropped.
  receive_lag_steps: float = 0.0
  # config.num_steps: a learner that has made them is done and waits for the others until the
  # horizon (FINISHED; elastic_job's `step_budget_s`, with a rejoiner skipping ahead to a peer's
  # step). 0: unbounded, every learner trains to the horizon (the paper's model).
  steps_per_learner: int = 0

  def __post_init__(self):
    if self.sync_period_steps < 0:
      raise ValueError(f"DecoupledOptions.sync_period_steps={self.sync_period_steps} must be >= 0")
    if self.steps_per_learner < 0:
      raise ValueError(f"DecoupledOptions.steps_per_learner={self.steps_per_learner} must be >= 0")
    if self.receive_lag_steps and not self.sync_period_steps:
      raise ValueError(f"DecoupledOptions.receive_lag_steps={self.receive_lag_steps} needs "
                       "sync_period_steps > 0: the share of work it drops is d / H")
    if not 0.0 <= self.receive_lag_steps <= self.sync_period_steps:
      raise ValueError(f"DecoupledOptions.receive_lag_steps={self.receive_lag_steps} must be "
                       f"between 0 and sync_period_steps={self.sync_period_steps}")

  def learner_terms(self, step_s: float) -> dict:
    """The decoupled terms of one learner's `simulate_elastic_job`, for steps of `step_s`."""
    return {"rejoin_stale_s": self.rejoin_stale_steps * step_s,
            "rejoin_discount": self.rejoin_discount,
            "unmerged_period_s": self.sync_period_steps * step_s,
            "discard_share": (self.receive_lag_steps / self.sync_period_steps
                              if self.sync_period_steps else 0.0),
            "step_budget_s": (self.steps_per_learner * step_s if self.steps_per_learner
                              else math.inf)}


@dataclasses.dataclass(frozen=True)
class SystemResult:
  """Goodput, uptime and badput shares (all in [0, 1]) of one system at one cluster size."""

  system: str
  num_chips: int
  num_learners: int
  goodput: float
  uptime: float
  badput: dict
  num_failures: int

  @property
  def key(self) -> str:
    return system_key(self.system, self.num_learners)


def system_key(system: str, num_learners: int = 1) -> str:
  """'dp', 'elastic_dp' or 'decoupled_m<M>': the keys of the goodput table."""
  return f"{DECOUPLED}_m{num_learners}" if system == DECOUPLED else system


def warmup_seconds(params: ClusterParams) -> float:
  """Simulated before measuring: long enough for the slices under repair to reach steady state."""
  return 8.0 * params.repair_s


def simulate_system(
    system: str,
    num_chips: int,
    params: ClusterParams = ClusterParams(),
    *,
    num_learners: int = 1,
    horizon_days: float = 3.0,
    seed: int = 0,
    decoupled: DecoupledOptions = DecoupledOptions(),
) -> SystemResult:
  """Simulates `system` on `num_chips` chips for `horizon_days` days (after a warm-up)."""
  if system not in SYSTEMS:
    raise ValueError(f"system={system!r} must be one of {SYSTEMS}")
  if num_chips <= 0:
    raise ValueError(f"num_chips={num_chips} must be > 0")
  if horizon_days <= 0:
    raise ValueError(f"horizon_days={horizon_days} must be > 0")
  if system == DECOUPLED and not 1 <= num_learners <= num_chips / params.slice_chips:
    raise ValueError(f"num_learners={num_learners} must be between 1 and num_chips / slice_chips="
                     f"{num_chips / params.slice_chips:g}: a learner holds at least one slice")
  if system != DECOUPLED and num_learners != 1:
    raise ValueError(f"num_learners={num_learners} only applies to system='decoupled', not {system!r}")

  horizon_s = horizon_days * SECONDS_PER_DAY
  warmup_s = warmup_seconds(params)
  # One independent stream per (seed, system, size, learner): results do not depend on run order.
  root = np.random.SeedSequence([seed, SYSTEMS.index(system), int(num_chips), num_learners])
  if system == DP:
    traces = [simulate_dp_job(num_chips, params, horizon_s, np.random.default_rng(root),
                              warmup_s=warmup_s)]
  elif system == ELASTIC_DP:
    traces = [simulate_elastic_job(num_chips, params, horizon_s, np.random.default_rng(root),
                                   warmup_s=warmup_s)]
  else:
    traces = [
        simulate_elastic_job(num_chips / num_learners, params, horizon_s,
                             np.random.default_rng(child), warmup_s=warmup_s,
                             **decoupled.learner_terms(params.step_s))
        for child in root.spawn(num_learners)
    ]
  return SystemResult(
      system=system,
      num_chips=int(num_chips),
      num_learners=num_learners,
      goodput=accounting.goodput(traces),
      uptime=accounting.uptime(traces),
      badput=accounting.badput_shares(traces),
      num_failures=sum(tr.num_failures for tr in traces),
  )


def simulate_grid(
    chips,
    learner_counts,
    params: ClusterParams = ClusterParams(),
    *,
    horizon_days: float = 3.0,
    seed: int = 0,
    decoupled: DecoupledOptions = DecoupledOptions(),
) -> dict:
  """{key: [SystemResult per chip count]} for dp, elastic_dp and decoupled with each M."""
  configs = [(DP, 1), (ELASTIC_DP, 1)] + [(DECOUPLED, m) for m in learner_counts]
  return {
      system_key(system, m): [
          simulate_system(system, n, params, num_learners=m, horizon_days=horizon_days,
                          seed=seed, decoupled=decoupled)
          for n in chips
      ]
      for system, m in configs
  }
