"""Where a learner's processes go, and their start (config.runtime=ray).

A learner of one process goes anywhere with a free CPU, or to a host that advertises
config.ray.learner_resource; a learner of config.ray.processes_per_learner processes to a placement
group of one bundle per process, spread over distinct nodes; with config.ray.tpu_slice, to the hosts
of one TPU slice, process i on the slice's worker i (`ray_tpu_slices.SliceHome`). Each process is a
`ray_runtime.LearnerProcess` actor; the command holds a `ray_learner.RemoteLearner` per learner.
"""

from __future__ import annotations

import functools
import math
import secrets
from typing import Any

from absl import logging

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.transport import ray_learner
from decoupled_diloco.runtime.transport import ray_plumbing as plumbing
from decoupled_diloco.runtime.transport import ray_runtime
from decoupled_diloco.runtime.transport import ray_tpu_slices


def start_learners(settings: settings_lib.RunSettings, *, secret: bytes, port, metrics, layout,
                   cuts: dict[int, Any], step_hook=None) -> list[ray_learner.RemoteLearner]:
  """One actor per learner, each in its own process, or config.ray.processes_per_learner actors
  per learner, each with its share of the learner's devices (with config.ray.tpu_slice, one per
  host of the learner's slice); logs `learner M pid N` for each.

  `secret`: this job's MAC key (only the command, its syncer and its learners hold it); `cuts`:
  learner -> its `checkpoints.LearnerCut` in a resumed run."""
  import ray  # pylint: disable=g-import-not-at-top
  actor_class = ray.remote(ray_runtime.LearnerProcess)
  processes = settings.ray.processes_per_learner
  placed = []  # per learner: (its actors, its placement group or None, its slice home or None)
  for m in range(settings.num_learners):
    spawn = functools.partial(_start_processes, actor_class, settings, m, secret)
    if settings.ray.slice is not None:
      home = ray_tpu_slices.SliceHome(settings.ray.slice, spawn, plumbing.CALL_TIMEOUT_S)
      placed.append((home.move(cuts.get(m)), None, home))
    else:
      group = _placement_group(settings, m) if processes > 1 else None
      placed.append((spawn(group, cuts.get(m)), group, None))
  learners = []
  for m, (actors, group, home) in enumerate(placed):
    if processes > 1:
      pids = ray_learner.join_group(actors, m, secret)
    else:
      pids = [ray.get(actors[0].pid.remote(), timeout=plumbing.CALL_TIMEOUT_S * 5)]
    learners.append(ray_learner.RemoteLearner(
        m, actors if processes > 1 else actors[0], secret=secret, port=port, metrics=metrics,
        layout=layout, like=None,
        num_devices=math.prod(settings.learner_mesh_shapes[m]),
        device_kind="cpu" if settings.devices.platform == "cpu"
        else settings.devices.platform,
        incarnation=cuts[m].incarnation if m in cuts else 0,
        pid=pids if processes > 1 else pids[0], step_hook=step_hook,
        placement=group, home=home))
    where = f" on slice {home.slice.name}" if home is not None else ""
    for i, (pid, node) in enumerate(zip(pids, learners[-1].nodes)):
      logging.info("learner %d pid %d%s%s%s", m, pid,
                   f" (process {i} of {processes})" if processes > 1 else "", where,
                   plumbing.on_node(node))
  return learners


def _placement_group(settings: settings_lib.RunSettings, m: int):
  """A multi-process learner's placement group: one bundle per process, spread over distinct
  nodes on a cluster (a restarted actor comes back in its bundle, on the same node). A local Ray
  is one node: packed there."""
  from ray.util import placement_group  # pylint: disable=g-import-not-at-top
  processes = settings.ray.processes_per_learner
  resource = settings.ray.learner_resource
  group = placement_group([{"CPU": 1, **({resource: 1} if resource else {})}] * processes,
                          strategy="STRICT_SPREAD" if settings.ray.address else "PACK")
  if not group.wait(plumbing.CALL_TIMEOUT_S):
    raise RuntimeError(
        f"learner {m}: Ray could not place config.ray.processes_per_learner={processes} "
        f"processes within {plumbing.CALL_TIMEOUT_S:.0f} s (a cluster needs a node per "
        "process of a learner, each with a free CPU)")
  return group


def _start_processes(actor_class, settings: settings_lib.RunSettings, m: int, secret: bytes,
                     where, cut) -> list:
  """Learner m's actors, leader first: in the bundles of `where` (a multi-process learner's
  placement group, or a `ray_tpu_slices.Slice`: process i on the slice's worker i), else on a
  host with config.ray.learner_resource, else anywhere with a free CPU. `cut`: its checkpoint cut
  in a resumed run (None: from the seed, or a rejoin, which hands it its state)."""
  processes = settings.ray.processes_per_learner
  env = {"JAX_PLATFORMS": settings.devices.platform}
  if settings.devices.platform == "cpu":
    # (On an emulated TPU cluster, the fake devices stand in for the host's chips.)
    env["XLA_FLAGS"] = devices_lib.xla_flags_with_device_count(
        math.prod(settings.learner_mesh_shapes[m]) // processes)
  elif settings.devices.learners_sharing_devices > 1:
    # Learner processes that share a GPU: each JAX would take 75% of its memory at start-up.
    # Each takes its share of that instead, which its own memory check then holds it to.
    # Not run on a GPU so far.
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = (
        f"{0.75 / settings.devices.learners_sharing_devices:.4f}")
  tag = secrets.token_hex(4)
  actors = []
  for i in range(processes):
    if isinstance(where, ray_tpu_slices.Slice):
      placement = {"scheduling_strategy": where.strategy(i), "resources": where.resources()}
    elif where is not None:
      from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # pylint: disable=g-import-not-at-top
      placement = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
          where, placement_group_bundle_index=i)}
    elif settings.ray.learner_resource:
      placement = {"resources": {settings.ray.learner_resource: 1}}
    else:
      placement = {}
    actors.append(actor_class.options(
        name=f"learner-{m}-{tag}" + (f"-{i}" if processes > 1 else ""),
        # On a slice the command decides (supervisor.py): Ray restarts a process in its bundle for
        # as long as the learner stays on that slice, and a lost slice is left whole.
        max_restarts=-1 if settings.ray.slice is not None else max(settings.max_restarts, 0),
        # A multi-process learner's pulls wait in the call for the next step boundary.
        max_concurrency=8 if processes == 1 else 64, num_cpus=1,
        runtime_env={"env_vars": ray_tpu_slices.without_megascale(env)}, **placement,
    ).remote(settings, m, secret, cut, i))
  return actors
