"""The single-controller runtime: M learners on their own meshes plus a syncer.

`train_and_evaluate(settings)` partitions the devices, builds and compiles the learners and the
syncer, runs them, prints progress, evaluates the global model (the syncer's Theta; the learner's own
parameters in dp mode) and writes `workdir/summary.json`. It only moves data and calls the pure
pieces (fragments, merge, outer, schedule) through the learner and syncer.

It takes the `RunSettings` that `settings.validate` returned at the entry point, never the raw
config: no field can skip validation, and a misspelt field cannot silently read as a default.

This module is the entry: it picks the transport (config.runtime: threads of this process, or Ray
processes) and hands it to the build (runtime/control/launch.py); the controller runs the result
(runtime/control/controller.py), or replays a recording on it (runtime/control/replay.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import logging

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime.control import launch
from decoupled_diloco.runtime.control import run as run_lib
from decoupled_diloco.runtime.control import slice_watch
from decoupled_diloco.runtime.control.controller import execute
from decoupled_diloco.runtime.control.replay import replay
from decoupled_diloco.runtime.control.run import Run, global_params
from decoupled_diloco.runtime.control.signals import Interrupted
from decoupled_diloco.runtime.transport import ray_transport
from decoupled_diloco.runtime.transport import threads

__all__ = ["Interrupted", "Run", "build", "execute", "global_params", "replay",
           "train_and_evaluate"]


def transport_for(settings: settings_lib.RunSettings) -> run_lib.Transport:
  """Where config.runtime runs the learners and the syncer: threads of this process, or Ray
  processes (Ray itself is imported only when it starts)."""
  if settings.runtime == "ray":
    return ray_transport.RayTransport()
  return threads.ThreadsTransport()


def build(settings: settings_lib.RunSettings, *,
          step_hook: Callable[[int, int], None] | None = None,
          with_syncer: bool = True,
          lost_slices: slice_watch.SliceWatch | None = None) -> Run:
  """Partitions devices, builds learners and syncer and compiles their steps. `lost_slices`:
  which learner failures are lost slices, and when those are back (by default pathwaysutils'
  answers under Pathways, none elsewhere)."""
  return launch.build_run(settings, transport_for(settings), step_hook=step_hook,
                          with_syncer=with_syncer, lost_slices=lost_slices)


def train_and_evaluate(settings: settings_lib.RunSettings) -> dict[str, Any]:
  run = build(settings)
  logging.info("built %d learner(s), %d parameters, %d fragment(s) in %.1f s", len(run.learners),
               run.num_params, len(run.fragments), run.build_seconds)
  return replay(run) if settings.replay else execute(run)
