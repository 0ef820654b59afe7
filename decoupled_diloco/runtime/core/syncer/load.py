"""What the syncer must do to keep up with learners of a given step time, from merges timed here.

Each of the P fragments falls due every H steps of the clock (the fastest learner's), so P / (H x
step seconds) merges per second; each takes the M learners' fragment p, screens and merges their
outer gradients and steps Theta_p (a worker thread: `Syncer._compute_merge`), then installs it
(the syncer's thread). The seconds of one merge are measured here, on this host's CPU, with the
syncer's own program (`GlobalModel.screen`, `merge`, `install`, compiled for the fragment's real
tensor shapes) on a fragment of the model: the median one, whose size most merges have, in wall
and in CPU seconds (on a shared host the wall clock includes other jobs' turns). A merge
costs in proportion to its parameters times its learners (every step of it is elementwise over
the stacked outer gradients), so the others, the embedding's included, are scaled from it (the
embedding's plain average costs less than RDA: an upper bound there). A worker per core is
assumed: `syncer.num_workers` >= the merge CPU seconds falling due per second. Sharded
(`config.syncer.num_shards`), each shard owns the fragments `algorithm/shards.py` gives it, balanced
by bytes, and needs the cores of its own fragments' merges: `shard_cores`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import numpy as np
from jax.sharding import Mesh

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import shards as shards_lib
from decoupled_diloco.algorithm import outer
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.core import global_model
from decoupled_diloco.runtime.core import messages


@dataclasses.dataclass(frozen=True)
class MergeTiming:
  """One fragment's merge, timed on this host."""

  fragment: int
  params: int
  learners: int
  worker_s: float  # screen + merge: a worker thread's part, wall seconds
  # The same in CPU seconds of this process (every thread): what a merge costs a core, whatever
  # else the host runs meanwhile.
  worker_cpu_s: float
  install_s: float  # the syncer thread's part
  bytes_up: int  # the learners' encoded outer gradients
  bytes_down: int  # the encoded Theta_p, sent to each learner


@dataclasses.dataclass(frozen=True)
class SyncerLoad:
  step_s: float  # the clock's step: the fastest learner's
  num_fragments: int
  period: int
  learners: int
  fragment_params: tuple[int, ...]
  timing: MergeTiming

  @property
  def merges_per_s(self) -> float:
    return self.num_fragments / (self.period * self.step_s)

  def merge_s(self, params: int) -> float:
    """A worker's CPU seconds for a fragment of `params` parameters, scaled from the timed one."""
    return self.timing.worker_cpu_s * params / self.timing.params

  @property
  def busy_s_per_s(self) -> float:
    """Worker seconds falling due per second: every fragment once per H steps."""
    return sum(self.merge_s(n) for n in self.fragment_params) / (self.period * self.step_s)

  @property
  def workers_needed(self) -> int:
    return max(1, math.ceil(self.busy_s_per_s))

  @property
  def largest_merge_s(self) -> float:
    return self.merge_s(max(self.fragment_params))

  @property
  def keeps_each_fragment_fresh(self) -> bool:
    """Whether one core merges the largest fragment within its period: a fragment's merges run
    one after another, so more cores cannot hide a merge longer than H steps."""
    return self.largest_merge_s <= self.period * self.step_s

  def shard_cores(self, num_shards: int) -> list[int]:
    """Cores each of `num_shards` shards needs for the merges of the fragments it owns (owners as
    the run assigns them: by bytes, and every fragment's bytes are its parameters')."""
    owner = shards_lib.assign(self.fragment_params, num_shards)
    busy = [0.0] * num_shards
    for p, shard in enumerate(owner):
      busy[shard] += self.merge_s(self.fragment_params[p]) / (self.period * self.step_s)
    return [max(1, math.ceil(b)) for b in busy]


def fragments(settings: settings_lib.RunSettings) -> tuple[fragments_lib.Fragment, ...]:
  return fragments_lib.partition(model_lib.param_shapes(settings.model),
                                 settings.sync.num_fragments, settings.sync.fragmentation,
                                 embedding_names=(model_lib.EMBEDDING_NAME,))


def median_fragment(settings: settings_lib.RunSettings) -> fragments_lib.Fragment:
  parts = sorted(fragments(settings), key=lambda f: (sum(f.sizes), f.index))
  return parts[len(parts) // 2]


def time_merge(settings: settings_lib.RunSettings, fragment: fragments_lib.Fragment, *,
               repeats: int = 1, seed: int = 0) -> MergeTiming:
  """`repeats` merges of `fragment` (after one that warms up) with every learner offering, the
  run's merge, outer-optimizer and wire settings; the median. Each learner's offer refers to the
  same arrays (the merge reads each once per learner all the same), so the host holds one copy."""
  shapes = model_lib.param_shapes(settings.model)
  rng = np.random.default_rng(seed)
  initial = {n: rng.standard_normal(shapes[n].shape, np.float32) * 0.02 for n in fragment.names}
  # A learner's values reach the syncer as its published device arrays (XLA's buffers, 64-byte
  # aligned); a numpy array from the generator is 16-byte aligned, which XLA copies on every call
  # (a 134 MB tensor: 0.12 s of the merge's 0.3 s here), a cost no run pays.
  values = {n: jax.device_put(v + rng.standard_normal(v.shape, np.float32) * 1e-3)
            for n, v in initial.items()}
  learners = settings.num_learners
  model = global_model.GlobalModel(
      fragments=(dataclasses.replace(fragment, index=0),), initial_params=initial,
      mesh=Mesh(np.array(jax.devices("cpu")[:1]), (devices_lib.SYNCER_AXIS,)),
      outer_tx=outer.make_outer_optimizer(settings.outer.name, settings.outer.learning_rate,
                                          settings.outer.momentum, settings.outer.nesterov_delay),
      staleness_scaling=settings.outer.staleness_scaling,
      merge=settings.merge, compression=settings.compression, num_learners=learners,
      merge_threads=settings.syncer.merge_threads)
  model.compile()
  worker, worker_cpu, install = [], [], []
  result = None
  for step in range(repeats + 1):
    # The learner's anchor, as it holds it: a host view of an XLA buffer (aligned, as above).
    anchor = {n: np.asarray(jax.device_put(a)) for n, a in model.received_fragment(0).items()}
    offers = tuple(messages.Offer(
        learner=m, fragment=0, step=step + 1, since=step, steps=1, tokens=1000,
        anchor_version=model.version(0), values=values, anchor=anchor)
        for m in range(learners))
    started, cpu = time.perf_counter(), time.process_time()
    screening = model.screen(0, offers)
    model.keep_screening(screening)
    result = model.merge(0, screening.accepted, screening.prepared)
    merged, merged_cpu = time.perf_counter(), time.process_time()
    model.install(result)
    if step:  # the first compiles nothing but touches every page for the first time
      worker.append(merged - started)
      worker_cpu.append(merged_cpu - cpu)
      install.append(time.perf_counter() - merged)
  bytes_down = sum(e.nbytes for e in result.wire.values()) * learners
  return MergeTiming(fragment.index, int(sum(fragment.sizes)), learners,
                     statistics.median(worker), statistics.median(worker_cpu),
                     statistics.median(install), int(result.bytes_up), int(bytes_down))


def load(settings: settings_lib.RunSettings, step_s: float, timing: MergeTiming) -> SyncerLoad:
  sync = settings.sync
  return SyncerLoad(step_s, sync.num_fragments, sync.period, settings.num_learners,
                    tuple(int(sum(f.sizes)) for f in fragments(settings)), timing)
