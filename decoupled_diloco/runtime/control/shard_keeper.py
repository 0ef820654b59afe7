"""A sharded syncer (config.syncer.num_shards > 1) built, fed and kept going shard by shard.

The controller sees one syncer (`core/sharded_syncer.ShardedSyncer`) and one keeper
(`ShardedKeeper`), read as it reads the unsharded ones. Under them each shard has what one syncer has:

- its own port (`syncer_keeper.SyncerPort`): the learners' posts reach every shard through
  `ShardedPort` (an offer only its fragment's owner), and a post to a shard that is down is lost
  and counted there, while the other shards hear it;
- its own keeper (`syncer_keeper.SyncerKeeper(shard=i)`): shard i's checkpoints every
  config.checkpoint.syncer_every_s under `syncer_shard_<i>/`, the `syncer_crash` faults that name
  it (or no shard: every shard), and its restart from its own newest checkpoint and the learners'
  anchors of its fragments. A lost shard is restored while the others keep merging; the
  supervisor's rejoins and the job's checkpoints wait while any shard is down, as they wait for a
  syncer that is down.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

from decoupled_diloco import chaos
from decoupled_diloco.runtime.control import syncer_keeper as keeper_lib
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import network as network_lib
from decoupled_diloco.runtime.core.syncer import sharded as sharded_syncer


def build_shards(make_shard: Callable[[int], Any], owner: Sequence[int],
                 network: network_lib.Network | None
                 ) -> tuple[sharded_syncer.ShardedSyncer, "ShardedPort"]:
  """Every shard made (`make_shard(i)`, side by side: each compiles its merge programs, or starts
  its process), as one syncer, and the learners' port to them."""
  num_shards = max(owner) + 1
  with concurrent.futures.ThreadPoolExecutor(num_shards, "make-shard") as pool:
    shards = list(pool.map(make_shard, range(num_shards)))
  return (sharded_syncer.ShardedSyncer(shards, owner),
          ShardedPort([keeper_lib.SyncerPort(shard) for shard in shards], owner, network))


class ShardedPort:
  """What the learners post to: every shard's port (a `SyncerPort` each, which drops what is sent
  while its shard is down). A post of a learner cut off by a partition (`network`) is lost before
  it leaves, once."""

  def __init__(self, ports: Sequence[keeper_lib.SyncerPort], owner: Sequence[int],
               network: network_lib.Network | None = None):
    self.ports = list(ports)
    self._owner = tuple(owner)
    self._network = network

  def post(self, message: Any) -> None:
    if self._network is not None and self._network.lost(getattr(message, "learner", None)):
      return
    if isinstance(message, messages.Offer):  # (the lock-step modes' pushed offers)
      self.ports[self._owner[message.fragment]].post(message)
      return
    for port in self.ports:
      port.post(message)

  @property
  def dropped(self) -> int:
    return sum(port.dropped for port in self.ports)


class ShardedKeeper:
  """One `SyncerKeeper` per shard, as the controller reads one keeper."""

  def __init__(self, keepers: Sequence[keeper_lib.SyncerKeeper], owner: Sequence[int],
               view: sharded_syncer.ShardedSyncer | None = None):
    """`view`: the keepers' shards as one syncer, as the run was built with it."""
    self.keepers = list(keepers)
    self._owner = tuple(owner)
    self._view = view

  @classmethod
  def for_shards(cls, *, syncer: sharded_syncer.ShardedSyncer, port: ShardedPort,
                 make_syncer: Callable[[Any, int], Any], faults: Sequence[chaos.Fault],
                 **keeper_args) -> "ShardedKeeper":
    """A keeper per shard of `syncer`: shard i's port, its restart (`make_syncer(crashed, i)`),
    and the syncer faults that name it or no shard."""
    return cls([keeper_lib.SyncerKeeper(
        syncer=shard, port=port.ports[i],
        make_syncer=lambda crashed, i=i: make_syncer(crashed, i),
        faults=[f for f in faults if f.shard is None or f.shard == i], shard=i, **keeper_args)
        for i, shard in enumerate(syncer.shards)], syncer.owner, view=syncer)

  @property
  def syncer(self) -> sharded_syncer.ShardedSyncer:
    """The shards now (a crashed one until it is back) as one syncer: a new one once a shard
    was replaced, so that what was asked of the old one (a checkpoint's cut) is asked again."""
    shards = [keeper.syncer for keeper in self.keepers]
    if self._view is None or any(a is not b for a, b in zip(self._view.shards, shards)):
      self._view = sharded_syncer.ShardedSyncer(shards, self._owner)
    return self._view

  @property
  def down(self) -> bool:
    return any(keeper.down for keeper in self.keepers)

  @property
  def records(self) -> list[dict[str, Any]]:
    """Each shard's restarts, in the order they came back."""
    return sorted((r for keeper in self.keepers for r in keeper.records),
                  key=lambda r: r["back_at_s"])

  @property
  def fault_records(self) -> list[dict[str, Any]]:
    return sorted((r for keeper in self.keepers for r in keeper.fault_records),
                  key=lambda r: r["at_s"])

  def start(self, started_at: float, elapsed_before_s: float = 0.0,
            fired: Sequence[dict[str, Any]] = ()) -> None:
    for keeper in self.keepers:
      keeper.start(started_at, elapsed_before_s, fired)

  def tick(self) -> None:
    for keeper in self.keepers:
      keeper.tick()
