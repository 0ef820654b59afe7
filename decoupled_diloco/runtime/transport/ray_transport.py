"""Learners and the syncer as Ray processes (config.runtime=ray), behind the controller's
`Transport` (runtime/control/run.py): starts Ray, the syncer's actor
(runtime/transport/ray_syncer.py) and the learners' (runtime/transport/ray_runtime.py), and ends
them.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime.transport import ray_placement
from decoupled_diloco.runtime.transport import ray_runtime
from decoupled_diloco.runtime.transport import ray_syncer


class RayTransport:
  """Each learner a process of its own (or several), the syncer another; this process holds the
  controller, the evaluations and the links."""

  learners_in_processes = True

  def __init__(self):
    self._secret: bytes | None = None

  def compile_learners(self, settings: settings_lib.RunSettings, learner_meshes, graphdef,
                       initial: dict[str, Any], tx, dataset, injector
                       ) -> tuple[list[tuple[Any, Any, Any, Any]], float]:
    del settings, learner_meshes, graphdef, initial, tx, dataset, injector
    return [], 0.0  # each learner process compiles its own step

  def start(self, settings: settings_lib.RunSettings) -> None:
    self._secret = secrets.token_bytes(32)  # this job's MAC key (ray_runtime.py)
    ray_runtime.start_ray(settings.ray.address,
                          settings.num_learners * settings.ray.processes_per_learner,
                          num_syncers=settings.syncer.num_shards)

  def make_syncer(self, settings: settings_lib.RunSettings, crashed, *, metrics, network,
                  initial: dict[str, Any], syncer_mesh, shard: int | None = None) -> Any:
    """A process of its own (each shard's, of a sharded syncer); after a crash, the one Ray has
    restarted."""
    del network, initial, syncer_mesh  # it makes its own from the seed
    return ray_syncer.start_syncer(settings, self._secret, metrics, shard=shard) \
        if crashed is None else ray_syncer.restarted(crashed)

  def start_learners(self, settings: settings_lib.RunSettings, built, *, syncer, port, metrics,
                     layout, fragments, cuts: dict[int, Any], held_back: Sequence[int],
                     step_hook, peer_repairing) -> list[Any]:
    del built, fragments, held_back, peer_repairing
    learners = ray_placement.start_learners(settings, secret=self._secret, port=port,
                                            metrics=metrics, layout=layout, cuts=cuts,
                                            step_hook=step_hook)
    for learner in learners:
      cut = cuts.get(learner.index)
      syncer.attach(learner.index, learner, step=learner.step, incarnation=learner.incarnation,
                    anchor_versions=learner.counters().anchor_versions if cut else None)
    return learners

  def repaired_at(self, devices_back: Callable[[int], float], learners: Sequence[Any]
                  ) -> Callable[[int], float]:
    # A learner process is repaired once its devices are back (config.chaos's down_s) and Ray has
    # restarted it (runtime/transport/ray_runtime.py).
    return lambda m: devices_back(m) if learners[m].process_up() else math.inf

  def lost_slice(self, learners: Sequence[Any]) -> Callable[[int], bool | None]:
    # (`learners`: the run's list, whose entries the supervisor replaces at each rejoin.)
    return lambda m: learners[m].lost_slice()

  def finish(self, learners: Sequence[Any], syncer) -> None:
    for learner in learners:
      learner.check_replicas()  # a learner over several processes: are they still one?
    ray_runtime.shutdown(list(learners) + [syncer])

  def shut_down(self, learners: Sequence[Any], syncer) -> None:
    ray_runtime.shutdown(list(learners) + [syncer])
