"""Splitting one controller's devices into M learner meshes plus a CPU syncer mesh.

Single-controller, Pathways-style: one process sees every device and carves it into disjoint learner
meshes (a TPU slice, a GPU host or a few fake CPU devices each) and a syncer mesh of CPU devices. On a
CPU-only box learners and syncer share the fake host devices; on TPU or GPU the syncer takes the host's
CPU devices. Under Pathways (JAX_PLATFORMS=proxy) the learners' TPU chips are the proxy backend's
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
from jax.sharding import Mesh

from decoupled_diloco import errors
from decoupled_diloco.runtime.core import pathways
from decoupled_diloco.runtime.core import throughput

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
) -> tuple[list[Mesh], Mesh | None]:
  """Partitions the devices into learner meshes (data, fsdp, model) and a syncer mesh (learner,).

  Learners take consecutive devices of `platform` in order, each group of
  `learners_sharing_devices` consecutive learners (of one shape: settings.py checks it) the same
  ones; the syncer takes the CPU devices that follow them (on a CPU-only run) or the first CPU
  devices (on TPU / GPU, where the host CPUs are separate from the accelerators).
  """
  devices = platform_devices(platform)
  sharing = learners_sharing_devices
  needed = sum(math.prod(shape) for shape in learner_mesh_shapes[::sharing])
  cpu_shared = platform == "cpu"
  total_needed = needed + (syncer_devices if cpu_shared else 0)
  if total_needed > len(devices):
    shared = (f" shared by groups of config.devices.learners_sharing_devices={sharing}"
              if sharing > 1 else "")
    raise errors.InputError(
        f"config.learner_mesh_shapes={learner_mesh_shapes}{shared} (+ config.syncer.num_devices="
        f"{syncer_devices} on CPU) need {total_needed} {platform} devices but only {len(devices)} "
        f"exist; raise config.devices.num_fake_cpu_devices or shrink the meshes")
  learner_meshes = []
  start = 0
  for index, shape in enumerate(learner_mesh_shapes):
    count = math.prod(learner_axes(shape))
    learner_meshes.append(learner_mesh(devices[start:start + count], shape))
    if index % sharing == sharing - 1:  # the group's last learner: the next group moves on
      start += count
  syncer_mesh = None
  if syncer_devices:
    if cpu_shared:
      syncer_chunk = devices[start:start + syncer_devices]
    else:
      cpus = _host_cpus(syncer_devices)
      if syncer_devices > len(cpus):
        raise errors.InputError(
            f"config.syncer.num_devices={syncer_devices} but this host has {len(cpus)} CPU "
            f"devices; lower it or raise config.devices.num_fake_cpu_devices")
      syncer_chunk = cpus[:syncer_devices]
    syncer_mesh = Mesh(np.array(syncer_chunk), (SYNCER_AXIS,))
  return learner_meshes, syncer_mesh


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


def check_tpu_topologies(meshes, topologies: tuple[str, ...]) -> None:
  """Each learner's chips are of the generation its config.devices.tpu_topologies entry names."""
  for index, (mesh, name) in enumerate(zip(meshes, topologies)):
    kind = mesh.devices.flat[0].device_kind
    chip = throughput.tpu_chip(kind)
    generation = name.split(":")[0]
    if chip is None or chip.generation != generation:
      raise errors.InputError(f"config.devices.tpu_topologies[{index}]={name!r} but learner "
                              f"{index}'s devices are {kind} chips")
