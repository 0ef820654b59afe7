"""Which devices each learner gets: every learner inside one slice.

A learner's data-parallel all-reduce runs every step; inside a slice it crosses the chips' own
interconnect (ICI), between two slices the datacenter network, the one link Decoupled DiLoCo exists
to keep off the step. So a learner's mesh is placed inside one slice:

- a TPU slice where the devices carry `slice_index` (several slices under one controller, Pathways
  or a multi-slice topology);
- a host (`process_index`) where the platform has none (GPU, CPU);
- on fake CPU devices, runs of `fake_slice_size` devices by id (config.devices.fake_slice_size), so
  tests and laptops emulate slices.

A learner as large as a slice takes a whole one; smaller ones share a slice (sub-slice meshes), as do
the learners of a group that share devices (config.devices.learners_sharing_devices). A learner
that names a TPU generation (config.devices.tpu_topologies) gets a slice of that generation: a
heterogeneous run (v6e + v5p) is matched by `device_kind`.

Pure: device-like objects in (`id`, `process_index`, `device_kind`, optionally `slice_index`,
`coords`, `core_on_chip`), device lists out, and the same answer whatever order the devices come in.
A layout that cannot be placed raises `errors.InputError` in one line naming the learner, the slices
and what is missing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from decoupled_diloco import errors
from decoupled_diloco.runtime.core import throughput

# Slices a refusal lists before it says how many more there are: one line stays readable.
_LISTED_SLICES = 8


@dataclasses.dataclass(frozen=True)
class Slice:
  """Devices that share one interconnect: a TPU slice, or a host where there are no slices."""

  index: int  # slice_index (or process_index, or the fake slice's number)
  kind: str  # device_kind of every device in it
  devices: tuple[Any, ...]  # in physical order: by chip coordinates and core where known, else id
  is_host: bool = False  # grouped by process_index: the platform has no slices

  @property
  def name(self) -> str:
    return f"{'host' if self.is_host else 'slice'} {self.index}"


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one learner runs: its slice and its devices in it, in physical order."""

  learner: int
  slice: Slice
  devices: tuple[Any, ...]

  @property
  def whole_slice(self) -> bool:
    return len(self.devices) == len(self.slice.devices)


def _physical_order(device) -> tuple:
  coords = getattr(device, "coords", None)
  if coords is None:
    return (device.id,)
  # z, y, x: consecutive devices are neighbours along x, as TPU topologies number their chips.
  return (*reversed(tuple(coords)), getattr(device, "core_on_chip", 0), device.id)


def group_slices(devices: Sequence[Any], fake_slice_size: int = 0) -> list[Slice]:
  """The slices of `devices`, ordered by index then kind, each in physical order."""
  devices = sorted(devices, key=lambda d: d.id)
  groups: dict[tuple[int, str], list[Any]] = {}
  is_host = False
  for position, device in enumerate(devices):
    if fake_slice_size:
      index = position // fake_slice_size
    else:
      key = slice_key(device)
      index, is_host = key[-2], key[0] == "host"
    groups.setdefault((int(index), device.device_kind), []).append(device)
  return [Slice(index, kind, tuple(sorted(members, key=_physical_order)), is_host)
          for (index, kind), members in sorted(groups.items())]


def generation_of(kind: str) -> str | None:
  """The TPU generation ("v5p") of a `device_kind`, None for anything else."""
  chip = throughput.tpu_chip(kind)
  return chip.generation if chip is not None else None


def place(slices: Sequence[Slice], sizes: Sequence[int], *, generations: Sequence[str] = (),
          sharing: int = 1, what: Sequence[str] = ()) -> list[Placement]:
  """One `Placement` per learner: learner m needs `sizes[m]` devices in one slice, of TPU
  generation `generations[m]` when given ("" or none: any kind).

  Consecutive groups of `sharing` learners (one size) share one set of devices. Groups are placed
  first-fit, those that name a generation first, then larger before smaller, ties by learner index:
  equal learners on equal slices take them in order (learner m on slice m). `what[m]` names the
  config entry behind learner m's size, for a refusal.
  """
  wanted = list(generations) or [""] * len(sizes)
  groups = [tuple(range(start, min(start + sharing, len(sizes))))
            for start in range(0, len(sizes), sharing)]
  order = sorted(groups, key=lambda g: (not wanted[g[0]], -sizes[g[0]], g[0]))
  free = {id(s): len(s.devices) for s in slices}
  holders: dict[int, list[int]] = {id(s): [] for s in slices}
  placements: dict[int, Placement] = {}
  for group in order:
    first = group[0]
    size, generation = sizes[first], wanted[first]
    fitting = [s for s in slices if not generation or generation_of(s.kind) == generation]
    chosen = next((s for s in fitting if free[id(s)] >= size), None)
    if chosen is None:
      raise errors.InputError(_refusal(first, group, size, generation, slices, fitting, free,
                                       holders, what))
    start = len(chosen.devices) - free[id(chosen)]
    free[id(chosen)] -= size
    holders[id(chosen)].extend(group)
    for m in group:
      placements[m] = Placement(m, chosen, chosen.devices[start:start + size])
  return [placements[m] for m in range(len(sizes))]


def _refusal(first, group, size, generation, slices, fitting, free, holders, what) -> str:
  learners = (f"learners {group[0]}..{group[-1]} (sharing devices)" if len(group) > 1
              else f"learner {first}")
  source = f" ({what[first]})" if what else ""
  kind = f"{generation} " if generation else ""
  if not fitting:
    missing = f"no slice here has {generation} chips"
  elif size > max(len(s.devices) for s in fitting):
    missing = (f"the largest {kind}slice has {max(len(s.devices) for s in fitting)}: shrink the "
               "mesh or use larger slices")
  else:
    missing = ("every slice that could hold it is taken: add a slice, or shrink the meshes so "
               "that learners share one")
  listed = [_describe(s, free[id(s)], holders[id(s)]) for s in slices[:_LISTED_SLICES]]
  if len(slices) > _LISTED_SLICES:
    listed.append(f"and {len(slices) - _LISTED_SLICES} more")
  return (f"{learners} needs {size} {kind}devices in one slice{source}, but {missing}; "
          f"slices here: {'; '.join(listed) or 'none'}")


def _describe(s: Slice, free: int, holders: list[int]) -> str:
  taken = f", {len(s.devices) - free} taken by learner(s) {','.join(map(str, holders))}" if (
      holders) else ""
  return f"{s.name}: {len(s.devices)} x {s.kind}{taken}"


def slice_key(device) -> tuple:
  """What tells one slice from another: ("slice", slice_index, device_kind), or ("host",
  process_index, device_kind) for a device of no slice. A TPU device (it has chip coordinates)
  that carries no slice_index is of the one slice there is (a single-slice topology)."""
  index = getattr(device, "slice_index", None)
  if index is None and getattr(device, "coords", None) is not None:
    index = 0
  if index is None:
    return ("host", device.process_index, device.device_kind)
  return ("slice", index, device.device_kind)


def spans_slices(grid: np.ndarray, axis_names: Sequence[str], axes: Sequence[str]) -> bool:
  """Whether a collective over the mesh `axes` of the device `grid` (named by `axis_names`)
  joins devices of two slices: some group, the devices that differ along `axes` only, holds
  two slice keys. An axis the mesh does not name (a compiler's axis not mapped back) counts as
  every axis."""
  keys = np.vectorize(slice_key, otypes=[object])(grid)
  if any(a not in axis_names for a in axes):
    return len(set(keys.flat)) > 1
  moved = np.moveaxis(keys, [axis_names.index(a) for a in axes],
                      list(range(grid.ndim - len(axes), grid.ndim)))
  groups = moved.reshape(-1, math.prod(grid.shape[axis_names.index(a)] for a in axes) or 1)
  return any(len(set(group)) > 1 for group in groups)
