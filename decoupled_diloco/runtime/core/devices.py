"""Splitting one controller's devices into M learner meshes plus a CPU syncer mesh.

Single-controller, Pathways-style: one process sees every device and carves it into disjoint learner
meshes, each inside one slice (a TPU slice, a GPU host, or a run of fake CPU devices: which devices
a learner gets is runtime/core/slices.py's) and a syncer mesh of CPU devices. On a CPU-only box
learners and syncer share the fake host devices; on TPU or GPU the syncer takes the host's CPU
devices. Under Pathways (JAX_PLATFORMS=proxy) the learners' TPU chips are the proxy backend's
(pathways.py). With config.devices.learners_sharing_devices = n, consecutive groups of n learners get
one set of devices between them (each its own Mesh object over the same devices): M learners on
one GPU. How their steps share those devices is runtime/core/device_share.py's.
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from decoupled_diloco import errors
from decoupled_diloco.runtime.core import pathways
from decoupled_diloco.runtime.core import slices as slices_lib

# Every learner mesh has all three axes; a (data, model) shape has fsdp = 1 (see model.py's rules).
LEARNER_AXES = ("data", "fsdp", "model")
SYNCER_AXIS = "learner"

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def use_platform(platform: str) -> None:
  """Before JAX starts its backends: a CPU run starts JAX's CPU backend only; a Pathways run
  (JAX_PLATFORMS names the proxy) has pathwaysutils register the proxy backend first.

  With libtpu installed (the `tpu` extra) JAX would otherwise start its TPU backend too, which on
  a host without TPU chips looks for them and prints warnings. A JAX_PLATFORMS the user set
  stands; gpu and tpu runs keep JAX's choice (the accelerator, and the CPU the syncer runs on).
  Every entry passes here before anything touches JAX (runtime/control/launch.py's build).
  """
  if pathways.in_use():
    if platform != pathways.PLATFORM:
      raise errors.InputError(
          f"config.devices.platform={platform!r} but JAX_PLATFORMS={pathways.jax_platforms()!r} "
          f"names Pathways' proxy backend, whose devices are TPU chips: set "
          f"config.devices.platform={pathways.PLATFORM!r}")
    pathways.initialize()
    return
  if platform != "cpu" or os.environ.get("JAX_PLATFORMS") or _backends_initialised():
    return
  jax.config.update("jax_platforms", "cpu")


def request_fake_cpu_devices(count: int) -> None:
  """Asks XLA for `count` host devices. Must run before JAX initialises its backends."""
  if count <= 0:
    return
  if _backends_initialised():
    have = len(jax.devices("cpu"))
    if have < count:
      raise errors.InputError(
          f"config.devices.num_fake_cpu_devices={count} but JAX already started with {have} CPU "
          f"devices; set XLA_FLAGS={_COUNT_FLAG}={count} before JAX initialises")
    return
  os.environ["XLA_FLAGS"] = xla_flags_with_device_count(count)


def xla_flags_with_device_count(count: int) -> str:
  """This process's XLA_FLAGS with the fake CPU device count set to `count`: what a process of
  this job (a Ray learner or syncer) is started with, so the user's other XLA flags reach it."""
  flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
  return f"{flags} {_COUNT_FLAG}={count}".strip()


def learner_axes(shape: tuple[int, ...]) -> tuple[int, int, int]:
  """(data, fsdp, model) of a config.learner_mesh_shapes entry, (data, model) or (data, fsdp,
  model)."""
  if len(shape) == 2:
    return (shape[0], 1, shape[1])
  return tuple(shape)


def _backends_initialised() -> bool:
  # jax keeps its backends in xla_bridge; asking jax.devices() would initialise them.
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return bool(getattr(xla_bridge, "_backends", {}))


def build_meshes(
    learner_mesh_shapes: tuple[tuple[int, ...], ...],
    syncer_devices: int,
    platform: str,
    learners_sharing_devices: int = 1,
    *,
    fake_slice_size: int = 0,
    tpu_topologies: tuple[str, ...] = (),
    one_job: bool = False,
    syncer_shards: int = 1,
) -> tuple[list[Mesh], Mesh | None]:
  """Partitions the devices into learner meshes (data, fsdp, model) and a syncer mesh (learner,).

  Every learner's mesh lies inside one slice (runtime/core/slices.py: a TPU slice, a host, or on
  fake CPU devices a run of `fake_slice_size`), of the TPU generation its `tpu_topologies` entry
  names; each group of `learners_sharing_devices` consecutive learners (of one shape: settings.py
  checks it) gets the same devices. `one_job`: the devices are one learner's whatever slices they
  span (dp mode's one synchronous job, whose all-reduce is what it costs; a learner process of
  the Ray runtime, whose jax.distributed job is its slice). The syncer takes the CPU devices no
  learner holds (a CPU-only run) or the first CPU devices (on TPU / GPU, where the host CPUs are
  separate from the accelerators). A sharded syncer (`syncer_shards`) gets `syncer_devices` per
  shard, all in one mesh that `shard_meshes` divides.
  """
  devices = platform_devices(platform)
  syncer_devices *= syncer_shards
  per_shard = (f" x config.syncer.num_shards={syncer_shards}" if syncer_shards > 1 else "")
  sharing = learners_sharing_devices
  needed = sum(math.prod(shape) for shape in learner_mesh_shapes[::sharing])
  cpu_shared = platform == "cpu"
  total_needed = needed + (syncer_devices if cpu_shared else 0)
  if total_needed > len(devices):
    shared = (f" shared by groups of config.devices.learners_sharing_devices={sharing}"
              if sharing > 1 else "")
    raise errors.InputError(
        f"config.learner_mesh_shapes={learner_mesh_shapes}{shared} (+ config.syncer.num_devices="
        f"{syncer_devices // syncer_shards}{per_shard} on CPU) need {total_needed} {platform} "
        f"devices but only {len(devices)} exist; raise config.devices.num_fake_cpu_devices or "
        f"shrink the meshes")
  slice_list = slices_lib.group_slices(devices, fake_slice_size if cpu_shared else 0)
  if one_job:
    (shape,) = learner_mesh_shapes
    ordered = [d for s in slice_list for d in s.devices]
    placements = [slices_lib.Placement(0, slice_list[0], tuple(ordered[:math.prod(shape)]))]
  else:
    placements = slices_lib.place(
        slice_list, [math.prod(shape) for shape in learner_mesh_shapes],
        generations=[name.split(":")[0] for name in tpu_topologies], sharing=sharing,
        what=[f"config.learner_mesh_shapes[{m}]={shape}"
              for m, shape in enumerate(learner_mesh_shapes)])
  if len(slice_list) > 1 and not one_job:
    for p in placements:
      logging.info("learner %d on %s (%d of its %d x %s)", p.learner, p.slice.name,
                   len(p.devices), len(p.slice.devices), p.slice.kind)
  learner_meshes = [placed_mesh(p, shape) for p, shape in zip(placements, learner_mesh_shapes)]
  syncer_mesh = None
  if syncer_devices:
    if cpu_shared:
      held = {d.id for p in placements for d in p.devices}
      syncer_chunk = [d for d in sorted(devices, key=lambda d: d.id)
                      if d.id not in held][:syncer_devices]
    else:
      cpus = _host_cpus(syncer_devices)
      if syncer_devices > len(cpus):
        raise errors.InputError(
            f"config.syncer.num_devices={syncer_devices // syncer_shards}{per_shard} needs "
            f"{syncer_devices} CPU devices but this host has {len(cpus)}; lower it or raise "
            f"config.devices.num_fake_cpu_devices")
      syncer_chunk = cpus[:syncer_devices]
    syncer_mesh = Mesh(np.array(syncer_chunk), (SYNCER_AXIS,))
  return learner_meshes, syncer_mesh


def shard_meshes(syncer_mesh: Mesh, num_shards: int) -> list[Mesh]:
  """A sharded syncer's mesh divided into one mesh per shard, each over devices of its own."""
  devices = list(syncer_mesh.devices.flat)
  size = len(devices) // num_shards
  return [Mesh(np.array(devices[i * size:(i + 1) * size]), (SYNCER_AXIS,))
          for i in range(num_shards)]


def placed_mesh(placement: slices_lib.Placement, shape: tuple[int, ...]) -> Mesh:
  """A learner's mesh over its placed devices. A whole TPU slice is laid out by its chips'
  physical positions (`mesh_utils.create_device_mesh`, so mesh axes follow the torus); anything
  else (part of a slice, CPU, GPU) keeps the physical order the placement gives."""
  devices = placement.devices
  if placement.whole_slice and getattr(devices[0], "coords", None) is not None:
    try:
      grid = mesh_utils.create_device_mesh(learner_axes(shape), devices=list(devices))
      return Mesh(grid, LEARNER_AXES)
    except (ValueError, NotImplementedError, AssertionError):
      pass  # a layout the physical-mesh rules do not cover: the physical order below
  return learner_mesh(devices, shape)


def platform_devices(platform: str) -> list[jax.Device]:
  """Every device of `platform`. Under Pathways the proxy backend's that report it: JAX files them
  under the backend's name, not their platform's."""
  if platform == "cpu" or not pathways.in_use():
    try:
      return jax.devices(platform)
    except RuntimeError as err:
      raise errors.InputError(
          f"config.devices.platform={platform!r}: no such devices here ({err})") from err
  devices = jax.devices(pathways.PROXY)
  found = [d for d in devices if d.platform == platform]
  if not found:
    raise errors.InputError(
        f"config.devices.platform={platform!r}: the {pathways.PROXY} backend of JAX_PLATFORMS="
        f"{pathways.jax_platforms()!r} has no such devices (its devices are "
        f"{sorted({d.platform for d in devices})})")
  return found


def _host_cpus(syncer_devices: int) -> list[jax.Device]:
  """This host's CPU devices, for the syncer of a TPU or GPU run."""
  try:
    return jax.devices("cpu")
  except RuntimeError as err:  # JAX_PLATFORMS=proxy alone starts no CPU backend
    raise errors.InputError(
        f"config.syncer.num_devices={syncer_devices} needs this host's CPU devices, but JAX "
        f"started none (JAX_PLATFORMS={pathways.jax_platforms()!r}): add cpu to it, as in "
        f"JAX_PLATFORMS={pathways.jax_platforms() or 'tpu'},cpu") from err


def learner_mesh(devices, shape: tuple[int, ...]) -> Mesh:
  """A learner's (data, fsdp, model) mesh over `devices`, in their order: this host's devices or
  the compile-only devices of a TPU topology (runtime/tpu_aot.py)."""
  return Mesh(np.array(devices).reshape(learner_axes(shape)), LEARNER_AXES)
