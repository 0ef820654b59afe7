"""Learners as threads of this process (config.runtime=threads), each on its own sub-mesh.

The learners' steps compile side by side before anything is written; the syncer is a thread of
this process too, and its links to the learners are calls (runtime/core/network.py).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime import assembly
from decoupled_diloco.runtime.core import device_share
from decoupled_diloco.runtime.records import job_state


class ThreadsTransport:
  """The learners and the syncer in this process (runtime/control/run.py's `Transport`)."""

  learners_in_processes = False

  def compile_learners(self, settings: settings_lib.RunSettings, learner_meshes, graphdef,
                       initial: dict[str, Any], tx, dataset, injector
                       ) -> tuple[list[tuple[Any, Any, Any, Any]], float]:
    # Each learner's step compiles for its own mesh, side by side on hosts with cores to spare
    # (XLA releases the GIL while it compiles; see compile_workers).
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(assembly.compile_workers(len(learner_meshes)),
                                               thread_name_prefix="compile") as pool:
      parts = list(pool.map(
          lambda index: assembly.learner_parts(settings, index, learner_meshes[index], graphdef,
                                               initial, tx, dataset),
          range(len(learner_meshes))))
    seconds = time.perf_counter() - started
    built = []
    for index, (train_step, state, shardings, batches, _) in enumerate(parts):
      if injector is not None:
        train_step = injector.wrap_train_step(index, train_step)  # nan faults corrupt its output
      built.append((train_step, state, shardings, batches))
    return built, seconds

  def start(self, settings: settings_lib.RunSettings) -> None:
    del settings  # nothing to start: the learners and the syncer are threads of this process

  def make_syncer(self, settings: settings_lib.RunSettings, crashed, *, metrics, network,
                  initial: dict[str, Any], syncer_mesh, shard: int | None = None) -> Any:
    del crashed  # a restarted syncer is made as the first was
    return assembly.make_local_syncer(settings, metrics=metrics, network=network,
                                      initial=initial, syncer_mesh=syncer_mesh, shard=shard)

  def start_learners(self, settings: settings_lib.RunSettings, built, *, syncer, port, metrics,
                     layout, fragments, cuts: dict[int, Any], held_back: Sequence[int],
                     step_hook, peer_repairing) -> list[Any]:
    learners = []
    # Learners on the same devices take turns on them (runtime/core/device_share.py).
    turns = device_share.turns_for(len(built), settings.devices.learners_sharing_devices)
    for index, (train_step, state, shardings, batches) in enumerate(built):
      cut = cuts.get(index)
      learner = assembly.make_learner(
          settings, index, train_step=train_step, state=state, shardings=shardings,
          batches=batches, fragments=fragments, layout=layout, syncer=port, metrics=metrics,
          snapshot=job_state.learner_snapshot(cut, state) if cut is not None else None,
          incarnation=cut.incarnation if cut is not None else 0, step_hook=step_hook,
          peer_repairing=peer_repairing, turns=turns[index])
      learners.append(learner)
      if syncer is not None and index not in held_back:
        syncer.attach(index, learner, step=learner.step, incarnation=learner.incarnation,
                      anchor_versions=learner.counters().anchor_versions if cut else None)
    return learners

  def repaired_at(self, devices_back: Callable[[int], float], learners: Sequence[Any]
                  ) -> Callable[[int], float]:
    del learners  # a learner thread is repaired once its devices are back
    return devices_back

  def lost_slice(self, learners: Sequence[Any]) -> Callable[[int], bool | None]:
    del learners  # a learner thread's failures are the application's
    return lambda m: False

  def finish(self, learners: Sequence[Any], syncer) -> None:
    del learners, syncer  # their threads have ended

  def shut_down(self, learners: Sequence[Any], syncer) -> None:
    del learners, syncer
