"""The syncer's sizing (runtime/core/syncer/load.py): merges due per second, cores, and per shard."""

import math

import pytest

from decoupled_diloco.algorithm import shards as shards_lib
from decoupled_diloco.runtime.core.syncer import load as syncer_load


def _load(fragment_params, worker_cpu_s=1.0, timed_params=100, step_s=1.0, period=4):
  timing = syncer_load.MergeTiming(fragment=0, params=timed_params, learners=2, worker_s=1.0,
                                   worker_cpu_s=worker_cpu_s, install_s=0.0, bytes_up=0,
                                   bytes_down=0)
  return syncer_load.SyncerLoad(step_s=step_s, num_fragments=len(fragment_params), period=period,
                                learners=2, fragment_params=tuple(fragment_params), timing=timing)


def test_the_merges_due_per_second_and_the_cores_they_need_scale_with_each_fragment_s_params():
  load = _load([100, 100, 200, 400], worker_cpu_s=2.0)  # 2 CPU s per 100 parameters
  assert load.merges_per_s == pytest.approx(4 / 4)
  # Every fragment once per H x step = 4 s: (2 + 2 + 4 + 8) / 4.
  assert load.busy_s_per_s == pytest.approx(4.0)
  assert load.workers_needed == 4
  assert load.largest_merge_s == pytest.approx(8.0)
  assert not load.keeps_each_fragment_fresh  # 8 s of merge, a period of 4 s
  assert _load([100, 100], worker_cpu_s=2.0).keeps_each_fragment_fresh


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_each_shard_needs_the_cores_of_the_fragments_the_run_gives_it(num_shards):
  params = [700, 100, 300, 300, 200, 100]
  load = _load(params, worker_cpu_s=1.0)  # 1 CPU s per 100 parameters, a period of 4 s
  cores = load.shard_cores(num_shards)
  owner = shards_lib.assign(params, num_shards)
  assert len(cores) == num_shards
  for shard, need in enumerate(cores):
    busy = sum(params[p] / 100 for p in shards_lib.owned(owner, shard)) / 4
    assert need == max(1, math.ceil(busy))
  assert sum(cores) >= load.workers_needed  # a shard's cores serve its own fragments only
