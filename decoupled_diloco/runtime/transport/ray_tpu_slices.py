"""Each learner one whole TPU slice (config.ray.tpu_slice), placed by Ray's own TPU API.

Ray advertises on every TPU VM `TPU: <chips>`, the slice's name as a resource on each of its hosts
(`<slice>: 1`), `TPU-<pod type>-head` on worker 0 only, and labels: `ray.io/tpu-slice-name`,
`ray.io/tpu-worker-id`, `ray.io/tpu-topology`, `ray.io/tpu-pod-type`. A learner here:

- claims a slice by its head resource (Ray's `reserve_tpu_slice`, which `slice_placement_group`
  calls itself): a placement group of one `TPU-<pod type>-head` bundle on a worker 0, held for as
  long as the learner stays there, so no other claim (this job's other learners, another job using
  Ray's API) takes that slice;
- places one process per host there with `slice_placement_group`: bundle i on TPU worker i (the
  worker-id label), each `{CPU: 1, TPU: <the host's chips>, <slice>: 1}`, so process 0, the
  coordinator of the learner's jax.distributed job, is the slice's worker 0;
- leaves a slice that lost a host whole (`SliceHome.move`): its processes end, the slice is given
  back, and the learner claims an intact one (a spare, or the same one once its host is back).

Why a learner must be its own job: a VM provisioned for a multislice job carries `MEGASCALE_*`
settings, and with them `jax.distributed.initialize()` (libtpu, on TPU) joins every slice into ONE
synchronous job that fails as a unit, the very coupling Decoupled DiLoCo removes. Ray workers
inherit the raylet's environment, so each learner process clears them itself before its JAX
starts (`clear_megascale`), and the command never puts them in a runtime_env
(`without_megascale`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from decoupled_diloco import settings as settings_lib

MEGASCALE_PREFIX = "MEGASCALE_"
# Ray's node labels on a TPU VM (ray._raylet's RAY_NODE_TPU_* keys).
SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
ACCELERATOR_LABEL = "ray.io/accelerator-type"


class NoFreeSlice(RuntimeError):
  """No intact slice of the learner's pod type could be claimed in time: try again later."""


def without_megascale(env: Mapping[str, str]) -> dict[str, str]:
  """`env` less every MEGASCALE_* setting: what may go into a learner's runtime_env."""
  return {k: v for k, v in env.items() if not k.startswith(MEGASCALE_PREFIX)}


def clear_megascale(environ: dict[str, str] | Any = os.environ) -> list[str]:
  """Removes every MEGASCALE_* setting from `environ` (this process's, inherited from the raylet);
  returns the names removed. Called by a learner process before its JAX starts a backend."""
  names = sorted(k for k in environ if k.startswith(MEGASCALE_PREFIX))
  for name in names:
    del environ[name]
  return names


def not_on_tpu_hosts() -> dict[str, str]:
  """A Ray label selector for the syncer (CPU only): any node that is no TPU VM, so that it never
  takes a CPU a learner's bundle on a spare slice needs, nor a host's cores from its learner."""
  from ray._private.accelerators import tpu as ray_tpu_tables  # pylint: disable=g-import-not-at-top
  kinds = ",".join(f"TPU-{kind.upper()}" for kind in ray_tpu_tables.VALID_TPU_TYPES)
  return {ACCELERATOR_LABEL: f"!in({kinds})"}


def intact(shape: settings_lib.TpuSlice, name: str) -> bool:
  """Whether every host of slice `name` (worker ids 0 .. hosts-1) is alive in Ray's node table."""
  from ray.util import tpu as ray_tpu  # pylint: disable=g-import-not-at-top
  hosts = ray_tpu.get_tpu_nodes_for_slice(name)
  workers = {n.get("Labels", {}).get(WORKER_ID_LABEL) for n in hosts}
  return workers >= {str(i) for i in range(shape.hosts)}


def free_slice_seen(shape: settings_lib.TpuSlice) -> bool:
  """Whether Ray sees a slice of `shape` with every host up and all of its chips free (Ray's
  view of free resources lags a claim by a moment: `claim` decides)."""
  from ray.util import tpu as ray_tpu  # pylint: disable=g-import-not-at-top
  return ray_tpu.get_num_ready_tpu_slices(shape.topology, shape.accelerator_type) > 0


def nodes_alive(node_ids) -> bool:
  """Whether every Ray node in `node_ids` is alive (a host the GCS declared dead is lost)."""
  import ray  # pylint: disable=g-import-not-at-top
  alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
  return set(node_ids) <= alive


@dataclasses.dataclass
class Slice:
  """A claimed slice: its head reservation and the placement group of its hosts."""

  shape: settings_lib.TpuSlice
  name: str
  head: Any  # the placement group on `shape.head_resource` (the claim)
  hosts: Any  # ray.util.tpu.SlicePlacementGroup: bundle i on worker i

  def strategy(self, i: int):
    """Where process i goes: bundle i, on the slice's worker i."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # pylint: disable=g-import-not-at-top
    return PlacementGroupSchedulingStrategy(self.hosts.slice_placement_groups[0],
                                            placement_group_bundle_index=i)

  def resources(self) -> dict[str, float]:
    """What each process asks for beyond its CPU: all of its host's chips, and the slice's
    resource, which pins it to this slice's hosts."""
    return {"TPU": self.shape.chips_per_host, self.name: 1}

  def release(self) -> None:
    from ray.util import remove_placement_group  # pylint: disable=g-import-not-at-top
    self.hosts.shutdown()
    remove_placement_group(self.head)


def claim(shape: settings_lib.TpuSlice, timeout_s: float) -> Slice:
  """Claims an intact slice of `shape` and places a bundle on each of its hosts.

  Ray's `reserve_tpu_slice` takes any free head of the pod type: one on a slice that lost another
  host would leave the bundles unplaceable, so such a head is held while looking further (Ray
  then offers another) and given back once an intact slice is claimed. Raises NoFreeSlice when no
  intact slice is free within `timeout_s` per try."""
  import ray  # pylint: disable=g-import-not-at-top
  from ray.util import remove_placement_group  # pylint: disable=g-import-not-at-top
  from ray.util import tpu as ray_tpu  # pylint: disable=g-import-not-at-top
  from ray._private.accelerators import tpu as ray_tpu_tables  # pylint: disable=g-import-not-at-top
  broken = []
  try:
    while True:
      try:
        name, head = ray_tpu_tables.reserve_tpu_slice(shape.topology, shape.accelerator_type,
                                                      timeout_s=timeout_s)
      except TimeoutError as err:
        raise NoFreeSlice(f"no free {shape.pod_type} slice with every host up (config.ray."
                          f"tpu_slice): {shape.head_resource} not claimed in {timeout_s:.0f} s"
                          ) from err
      if intact(shape, name):
        break
      broken.append(head)
    hosts = ray_tpu.slice_placement_group(
        shape.topology, shape.generation, pg_per_slice=True,
        resources_per_bundle={"CPU": 1, "TPU": shape.chips_per_host, name: 1},
        bundle_label_selector=[{SLICE_NAME_LABEL: name, WORKER_ID_LABEL: str(i)}
                               for i in range(shape.hosts)])
    claimed = Slice(shape, name, head, hosts)
    ready, _ = ray.wait([hosts.slice_placement_groups[0].ready()], timeout=timeout_s)
    if not ready:
      claimed.release()
      raise NoFreeSlice(f"slice {name}: its {shape.hosts} hosts were not placed in "
                        f"{timeout_s:.0f} s")
    return claimed
  finally:
    for head in broken:
      remove_placement_group(head)


class SliceHome:
  """The slice a learner runs on and its processes there, across its incarnations.

  `spawn(slice, cut)` starts the learner's processes on a claimed slice (leader first, process i
  on worker i), from `cut` (a resumed run's checkpoint cut) or None (a rejoin restores them).
  Only the command's start-up, then its supervisor thread, moves a learner."""

  def __init__(self, shape: settings_lib.TpuSlice, spawn: Callable[[Slice, Any], list],
               timeout_s: float):
    self.shape, self._spawn, self._timeout_s = shape, spawn, timeout_s
    self.slice: Slice | None = None
    self.actors: list = []

  def move(self, cut=None) -> list:
    """Ends the processes on the current slice (if any), gives the slice back, claims an intact
    one and starts the learner's processes there (from `cut`); returns them. Raises NoFreeSlice
    with the learner on no slice at all: the next call claims again."""
    self.release()
    self.slice = claim(self.shape, self._timeout_s)
    self.actors = self._spawn(self.slice, cut)
    return self.actors

  def intact(self) -> bool:
    return self.slice is not None and intact(self.shape, self.slice.name)

  def release(self) -> None:
    """Its processes end, and the slice goes back to the cluster (the run is over, or a move)."""
    import ray  # pylint: disable=g-import-not-at-top
    for actor in self.actors:
      ray.kill(actor, no_restart=True)
    self.actors = []
    if self.slice is not None:
      self.slice.release()
      self.slice = None
