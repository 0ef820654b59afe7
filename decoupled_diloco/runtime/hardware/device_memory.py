"""Will the learners fit on their devices? Checked before any state is placed.

Learners that share devices (config.devices.learners_sharing_devices = n) put n times what one
learner holds on each of those devices, and learner 0's devices also hold the global model while it
is evaluated. Past the device's memory the run would fail at some later allocation with a message
naming no field, so `build` asks first, per device, from the shapes alone and the compiled step:

- train states: n x (parameters + optimizer state + step), each device's shards of them;
- publications: n x what a learner's latest publication keeps alive besides its state: a copy of
  the parameters when the step donates its state, else the whole previous state (the step's output
  is a second state);
- offers in flight: n x one copy of the parameters (fragments the syncer took and has not merged
  hold their publication's arrays; at worst one of every fragment);
- step working memory: the compiled step's temporaries + its batch, once per step that can be on
  the devices at once: SLOTS for learners that share them (runtime/core/device_share.py; on an H200,
  four learners of 124M peaked at 45.7 GB against 43.9 GB counted so), one for a learner alone,
  whose steps run one after the other on the device's stream (counted twice, a 201.6M dp run
  that peaks far below the H200's 112.6 GB pool was refused for 171.9 GB);
- eval model: on learner 0's devices, the global model's float32 parameters.

The eval program's own temporaries are not counted (it is compiled later, and runs between steps).
Neither is the build's warm-up, which runs each learner's step once on a second state of zeros
(`assembly.warm_up`): the learners of a group warm up one at a time, so that is one extra state,
which the steady state's publications and offers of n >= 2 learners exceed.
The limit is `memory_stats()["bytes_limit"]` (the allocator's pool: on a GPU 75% of the memory by
default, XLA_PYTHON_CLIENT_MEM_FRACTION), or config.devices.memory_per_device_gb when set. A CPU
device reports none: there the check runs only when memory_per_device_gb is set, and is otherwise
logged as skipped (no program is compiled ahead then).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh

from decoupled_diloco import errors
from decoupled_diloco import settings as settings_lib
from decoupled_diloco.lm import inner
from decoupled_diloco.runtime.core import device_share

GB = 1e9


class DeviceMemoryError(errors.InputError):
  """The learners (and the eval model) do not fit on a device; names the fields to change."""


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of `tree`'s arrays (or ShapeDtypeStructs with shardings): each leaf's
  shard on the first device of its sharding."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(tuple(leaf.shape)) if leaf.sharding is not None \
        else tuple(leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def needs(*, state_bytes: int, params_bytes: int, step_temp_bytes: int, batch_bytes: int,
          donates: bool, learners: int, eval_params_bytes: int) -> dict[str, int]:
  """What one device holds, by part (the module docstring says what each is). `learners`: the
  learners on the device; `eval_params_bytes`: 0 unless the global model is evaluated there."""
  return {
      "train states": learners * state_bytes,
      "publications": learners * (params_bytes if donates else state_bytes),
      "offers in flight": learners * params_bytes,
      "step working memory": min(learners, device_share.SLOTS) * (step_temp_bytes + batch_bytes),
      "eval model": eval_params_bytes,
  }


def check_learner(settings: settings_lib.RunSettings, train_step: inner.TrainStep,
                  abstract: inner.TrainState, batch_size: int, mesh: Mesh, *, learners: int,
                  holds_eval: bool) -> None:
  """Raises DeviceMemoryError when `learners` learners like the one of `train_step` and `abstract`
  (its train state as ShapeDtypeStructs), and the eval model if `holds_eval`, do not fit on a
  device of `mesh`. Compiles the step for that (the learner's first call then finds it compiled);
  where the device reports no memory (a CPU) and config.devices.memory_per_device_gb is 0, logs
  that it did not check and compiles nothing."""
  # One of this process's devices: a learner over several processes cannot ask another's.
  device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
  limit, source = limit_bytes(device, settings.devices.memory_per_device_gb)
  if limit is None:
    # Once a run, not once a learner: the same is true of each.
    logging.log_first_n(logging.INFO, "device memory not checked: %s reports none "
                        "(config.devices.memory_per_device_gb=0)", 1, device.device_kind)
    return
  # As `_compile` and the learner pass it: host arrays, which the step's in_shardings place.
  tokens = jax.ShapeDtypeStruct((batch_size, settings.data.seq_len), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens}
  analysis = train_step.lower(abstract, batch).compile().memory_analysis()
  eval_params = {n: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding)
                 for n, p in abstract.params.items()}
  parts = needs(
      state_bytes=per_device_bytes(abstract),
      params_bytes=per_device_bytes(abstract.params),
      step_temp_bytes=int(getattr(analysis, "temp_size_in_bytes", 0) or 0),
      batch_bytes=per_device_bytes(
          {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=inner.batch_sharding(mesh))
           for k, v in batch.items()}), donates=settings.donates_state,
      learners=learners,
      eval_params_bytes=per_device_bytes(eval_params) if holds_eval else 0)
  check(parts, limit, learners=learners, device=f"{device.device_kind} {device.id}",
        source=source)


def limit_bytes(device: jax.Device, memory_per_device_gb: float) -> tuple[int | None, str]:
  """(bytes of `device` the run may fill, where that figure comes from): config.devices.
  memory_per_device_gb when > 0, else what the device reports (None on a CPU)."""
  if memory_per_device_gb > 0:
    return (int(memory_per_device_gb * GB),
            f"config.devices.memory_per_device_gb={memory_per_device_gb}")
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  return (int(limit), "its allocator's bytes_limit") if limit else (None, "")


def check(parts: dict[str, int], limit: int, *, learners: int, device: str, source: str) -> None:
  """Raises DeviceMemoryError, naming the fields that change the parts, if they exceed `limit`
  (which comes from `source`)."""
  total = sum(parts.values())
  if total <= limit:
    logging.info("device memory: %s holds %s of its %s (%s)", device, _size(total), _size(limit),
                 _spelled(parts))
    return
  raise DeviceMemoryError(
      f"{learners} learner(s) on {device} (config.devices.learners_sharing_devices={learners}) "
      f"need {_size(total)} of its memory ({_spelled(parts)}) but it has {_size(limit)} "
      f"({source}). Put fewer learners on it (config.devices.learners_sharing_devices, "
      f"config.num_learners), shrink the batch (config.data.batch_size) or the model "
      f"(config.model.embed_dim, num_layers, mlp_dim), shard it over more devices "
      f"(config.learner_mesh_shapes), donate the state (config.donate_state='always'), keep "
      f"bfloat16 weights (config.model.param_dtype) or recompute activations (config.model.remat)")


def _size(nbytes: int) -> str:
  return f"{nbytes / GB:.2f} GB" if nbytes >= GB / 10 else f"{nbytes / 1e6:.2f} MB"


def _spelled(parts: dict[str, int]) -> str:
  return ", ".join(f"{name} {_size(value)}" for name, value in parts.items())
