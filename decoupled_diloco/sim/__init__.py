"""Cluster-scale simulators, independent of the training runtime (numpy only, no JAX).

  cluster      the cluster's six physical parameters; failure, repair and pause times
  elastic_job  an elastic data-parallel job at slice granularity (elastic DP, one learner)
  dp_job       a synchronous non-elastic data-parallel job
  accounting   goodput, badput buckets (ml-goodput-measurement names), uptime
  goodput      whole systems: dp, elastic_dp, decoupled with M learners
  bandwidth    cross-datacenter bandwidth and wall-clock model, DP vs Decoupled DiLoCo
  published    the paper's figures, for comparison only (never an input)
"""

from decoupled_diloco.sim.cluster import ClusterParams
from decoupled_diloco.sim.goodput import (DECOUPLED, DP, ELASTIC_DP, SYSTEMS, DecoupledOptions,
                                          SystemResult, simulate_grid, simulate_system, system_key)

__all__ = [
    "ClusterParams", "DecoupledOptions", "SystemResult", "simulate_system", "simulate_grid",
    "system_key", "SYSTEMS", "DP", "ELASTIC_DP", "DECOUPLED",
]
