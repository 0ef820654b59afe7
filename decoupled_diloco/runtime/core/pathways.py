"""Pathways (Cloud TPU's single controller) through pathwaysutils: the proxy backend and lost slices.

Under Pathways (`JAX_PLATFORMS=proxy`, as xpk's `workload create-pathways` starts a job) this one
process reaches the TPU chips of several slices through JAX's IFRT proxy backend, and the threads
runtime carves them into learner meshes as it carves any controller's devices (devices.py).
pathwaysutils (the `pathways` extra) registers that backend with JAX: `initialize` must run before
JAX starts any backend, as MaxText calls it first thing in its main. The proxy's devices report the
platform `tpu` (pathwaysutils' own test devices are made so), but JAX files the backend under
`proxy`, so `jax.devices("tpu")` finds none: devices.py takes the learners' chips from `PROXY`.

A slice that goes down fails the programs that touch it with a `jax.errors.JaxRuntimeError`. Which
errors mean that is pathwaysutils.elastic's call (`is_lost_slice`), and whether a slice is up again
its health check, a small program run on each slice (`slices_active`); the supervisor acts on both
(runtime/control/slice_watch.py). pathwaysutils is imported only here and only when called: a run
without Pathways needs none of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from decoupled_diloco import errors

PROXY = "proxy"  # the JAX backend (and JAX_PLATFORMS entry) of Pathways' IFRT proxy
PLATFORM = "tpu"  # what the proxy's devices report: config.devices.platform under Pathways
INSTALL = "pip install 'decoupled-diloco[pathways]' (or pip install pathwaysutils)"


class PathwaysUnavailable(errors.InputError):
  """JAX_PLATFORMS names the proxy backend, but pathwaysutils is not installed."""


def in_use() -> bool:
  """Whether this process's JAX platforms (JAX_PLATFORMS, read by JAX at import) name the proxy."""
  return PROXY in (jax.config.jax_platforms or "").split(",")


def jax_platforms() -> str:
  """JAX's platforms as the user set them, for messages."""
  return jax.config.jax_platforms or ""


def initialize() -> None:
  """pathwaysutils.initialize(): the proxy backend registered with JAX. Before any backend starts.

  Refused in one line when pathwaysutils is missing: JAX's own error would come later, from the
  first device lookup, as an unknown backend.
  """
  try:
    import pathwaysutils  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise PathwaysUnavailable(
        f"JAX_PLATFORMS={jax_platforms()!r} names Pathways' proxy backend, which needs "
        f"pathwaysutils: {INSTALL}") from err
  pathwaysutils.initialize()


def is_lost_slice(error: BaseException) -> bool:
  """Whether pathwaysutils.elastic reads `error` as a slice that went down (its classification:
  a JaxRuntimeError of the kinds it lists), not a failure of the learner's own."""
  from pathwaysutils.elastic import elastic  # pylint: disable=g-import-not-at-top
  return bool(elastic.is_error_due_to_slice_down(error, log_traceback=False))


def slices_active(devices: Sequence[jax.Device]) -> bool:
  """Whether every slice that `devices` lie on passes pathwaysutils' health check. It runs a
  program on each of those slices and blocks until that has run or failed: call it on a thread
  that nothing else waits for."""
  from pathwaysutils.elastic import elastic  # pylint: disable=g-import-not-at-top
  slices = elastic.get_slice_to_devices(devices)
  return set(slices) <= set(elastic.get_active_slice_indices(slice_to_devices=slices))
