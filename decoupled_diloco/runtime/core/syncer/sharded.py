"""The syncer sharded M ways (config.syncer.num_shards > 1), as the controller sees it: one syncer.

The paper's syncer is "a central, CPU-only process, sharded M ways" (docs/design.md §2). Each shard
is a whole `Syncer` over the fragments it owns (`algorithm/shards.py`: balanced by bytes), with
their Theta_p, outer states, rounds, merges and checkpoint: a `Syncer` thread on CPU devices of its
own (config.runtime=threads) or a `RemoteSyncer`, a process of its own (config.runtime=ray). Every
shard hears every learner's reports (its clock, heartbeats and anchors are its own), pulls from the
learners the fragments it owns as they fall due, and broadcasts them; the shards never talk to each
other, since a merge of fragment p touches fragment p's buffers alone.

`ShardedSyncer` is the `SyncerHandle` over them that the controller, the supervisor, the
checkpoints and the summary read as they read one syncer:

- calls fan out to every shard (attach, start, give_up, flush, stop); a learner's pushed `Offer`
  (the lock-step modes) goes to its fragment's owner;
- what is read is put together: Theta and its versions from each fragment's owner, the merge
  tape (each fragment's merges stay in order: they are all one shard's), the counters summed,
  except the heartbeat counters (`absences`, `returns`, `stale_messages`), which every shard
  counts for the same learner, taken at their largest;
- a job checkpoint's cut (`request_cut`) is one instant of the whole syncer: each shard takes its
  cut and then holds it (opens no round, so its versions stay those of its cut) until every
  shard has taken its own; the last shard's publications then hold every shard's versions, and
  are the cut's. The state is each shard's under `shard_<i>` (`combine_states`).

A lost shard is the keeper's to restore (`runtime/control/shard_keeper.py`), from its own
checkpoint and the learners' anchors of its fragments, while the other shards merge on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core.syncer import rounds as syncer_rounds
from decoupled_diloco.runtime.core.syncer import state as syncer_state

# Counters every shard keeps for the same learner events (it hears every report): the whole
# syncer saw each once.
_PER_LEARNER_COUNTERS = ("absences", "returns", "stale_messages")
# How much longer than a shard's own cut timeout the whole cut waits for every shard's answer.
_CUT_MARGIN_S = 4.0


def combined_stats(stats: Sequence[syncer_rounds.SyncerStats]) -> syncer_rounds.SyncerStats:
  """One syncer's counters from its shards': summed, the per-learner ones at their largest."""
  fields = {}
  for field in dataclasses.fields(syncer_rounds.SyncerStats):
    values = [getattr(s, field.name) for s in stats]
    if field.name == "rejected_offers":
      fields[field.name] = {k: sum(v.get(k, 0) for v in values) for k in values[0]}
    elif field.name in _PER_LEARNER_COUNTERS:
      fields[field.name] = max(values)
    else:
      fields[field.name] = sum(values)
  return syncer_rounds.SyncerStats(**fields)


def combine_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """The whole syncer's state (a job checkpoint's) from its shards' `Syncer.state()`s."""
  return {"arrays": {f"shard_{i}": s["arrays"] for i, s in enumerate(states)},
          "json": {"shards": [s["json"] for s in states]}}


def split_state(state: Mapping[str, Any], num_shards: int) -> list[dict[str, Any]]:
  """Each shard's state in the whole syncer's (`combine_states`)."""
  shards = state["json"].get("shards")
  if shards is None or len(shards) != num_shards:
    have = "1 (not sharded)" if shards is None else len(shards)
    raise ValueError(f"the checkpoint's syncer has {have} shard(s), this run's "
                     f"config.syncer.num_shards={num_shards}")
  return [{"arrays": state["arrays"][f"shard_{i}"], "json": shards[i]}
          for i in range(num_shards)]


class _ShardedModel:
  """`Syncer.model` as the controller reads it: Theta as the learners received it, each fragment
  from the shard that owns it."""

  def __init__(self, owner: "ShardedSyncer"):
    self._owner = owner

  def received(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
    theta, versions = {}, np.zeros(len(self._owner.owner), np.int64)
    for i, shard in enumerate(self._owner.shards):
      shard_theta, shard_versions = shard.model.received()
      theta.update(shard_theta)  # (a shard's holds its own fragments' tensors only)
      for p in self._owner.owned(i):
        versions[p] = shard_versions[p]
    return theta, versions


class ShardedSyncer:
  """The shards of a sharded syncer as one `SyncerHandle` (runtime/core/handles.py)."""

  def __init__(self, shards: Sequence[Any], owner: Sequence[int]):
    """`shards[i]`: shard i's handle (a `Syncer` or `RemoteSyncer`); `owner[p]`: the shard that
    owns fragment p."""
    self.shards = list(shards)
    self.owner = tuple(owner)
    self.model = _ShardedModel(self)

  def owned(self, shard: int) -> tuple[int, ...]:
    return tuple(p for p, s in enumerate(self.owner) if s == shard)

  # ---- what the controller reads ----------------------------------------------------------------

  @property
  def stats(self) -> syncer_rounds.SyncerStats:
    return combined_stats(self.shard_stats)

  @property
  def shard_stats(self) -> list[syncer_rounds.SyncerStats]:
    return [shard.stats for shard in self.shards]

  @property
  def tape(self) -> list[dict[str, Any]]:
    """Every shard's merges; a fragment's are all its owner's, in their order."""
    return [record for shard in self.shards for record in shard.tape]

  @property
  def error(self) -> BaseException | None:
    return next((s.error for s in self.shards if s.error is not None), None)

  @property
  def compile_seconds(self) -> float:
    return sum(shard.compile_seconds for shard in self.shards)

  @property
  def process_died(self) -> bool:
    return any(shard.process_died for shard in self.shards)

  def global_params(self) -> dict[str, np.ndarray]:
    params = {}
    for shard in self.shards:
      params.update(shard.global_params())
    return params

  def held_bytes(self) -> int:
    return sum(shard.held_bytes() for shard in self.shards)

  def steady_state_bytes(self) -> int:
    return sum(shard.steady_state_bytes() for shard in self.shards)

  # ---- what the controller calls ----------------------------------------------------------------

  def compile(self) -> None:
    for shard in self.shards:
      shard.compile()

  def attach(self, learner: int, link: Any, step: int = 0, incarnation: int = 0,
             anchor_versions: np.ndarray | None = None) -> None:
    for shard in self.shards:  # each pulls its own fragments from it and broadcasts them
      shard.attach(learner, link, step=step, incarnation=incarnation,
                   anchor_versions=anchor_versions)

  def start(self) -> None:
    for shard in self.shards:
      shard.start()

  def give_up(self, learner: int) -> None:
    for shard in self.shards:
      shard.give_up(learner)

  def catch_up(self) -> None:
    for shard in self.shards:
      shard.catch_up()

  def post(self, message: Any) -> None:
    """A learner's message: an offer to its fragment's owner, anything else to every shard."""
    if isinstance(message, messages.Offer):
      self.shards[self.owner[message.fragment]].post(message)
      return
    for shard in self.shards:
      shard.post(message)

  def flush(self, timeout: float | None = None) -> bool:
    """Every shard's final rounds, side by side; False if one did not finish within `timeout`."""
    with concurrent.futures.ThreadPoolExecutor(len(self.shards), "flush-shard") as pool:
      return all(list(pool.map(lambda shard: shard.flush(timeout), self.shards)))

  def request_cut(self, timeout_s: float, include_tape: bool = True, hold: str = ""
                  ) -> concurrent.futures.Future:
    """A consistent cut of the whole syncer and the live learners (see the module docstring), or
    None: a shard found no consistent instant, or the shards' instants did not meet."""
    del hold  # the whole syncer's cut is the only one asked of it
    # This request's token: a late release of an earlier one never ends this one's hold.
    token = uuid.uuid4().hex
    asked = [shard.request_cut(timeout_s, include_tape, hold=token) for shard in self.shards]
    future: concurrent.futures.Future = concurrent.futures.Future()

    def combine() -> None:
      cut = None
      try:
        done, _ = concurrent.futures.wait(asked, timeout=timeout_s + _CUT_MARGIN_S)
        cuts = [f.result() if f in done else None for f in asked]
        if all(c is not None for c in cuts):
          cut = self._combined_cut(cuts)
      except Exception:  # pylint: disable=broad-except
        logging.exception("syncer: putting the shards' cuts together failed")
      finally:
        for shard in self.shards:
          shard.release_cut(token)
        future.set_result(cut)

    threading.Thread(target=combine, name="sharded-cut", daemon=True).start()
    return future

  def _combined_cut(self, cuts: Sequence[syncer_state.SyncerCut]
                    ) -> syncer_state.SyncerCut | None:
    """The shards' cuts as one, if one shard's publications hold every shard's versions (the
    last shard's do: the others held theirs meanwhile)."""
    versions = np.zeros(len(self.owner), np.int64)
    for p, shard in enumerate(self.owner):
      versions[p] = cuts[shard].state["json"]["model"]["versions"][p]
    for cut in reversed(cuts):
      if all(np.array_equal(pub.anchor_versions, versions) and pub.opt_state is not None
             for pub in cut.publications.values()):
        return syncer_state.SyncerCut(combine_states([c.state for c in cuts]), cut.publications,
                                      cut.incarnations, max(c.clock for c in cuts))
    logging.warning("syncer: the shards' cuts do not meet at one instant; the checkpoint is "
                    "tried again later")
    return None

  def release_cut(self, hold: str) -> None:
    for shard in self.shards:
      shard.release_cut(hold)

  def request_state(self) -> concurrent.futures.Future:
    """Every shard's state, as the whole syncer's (None if a shard gave none)."""
    asked = [shard.request_state() for shard in self.shards]
    future: concurrent.futures.Future = concurrent.futures.Future()

    def combine() -> None:
      states = [f.result() for f in asked]
      future.set_result(None if any(s is None for s in states) else combine_states(states))

    threading.Thread(target=combine, name="sharded-state", daemon=True).start()
    return future

  def load_state(self, state: Any, *, with_history: bool) -> None:
    for shard, part in zip(self.shards, split_state(state, len(self.shards))):
      shard.load_state(part, with_history=with_history)

  def recover(self, state: Any, publications: Any, *, stats: Any, tape: Any) -> dict[str, Any]:
    raise NotImplementedError("a sharded syncer is restored shard by shard, each from its own "
                              "checkpoint (runtime/control/shard_keeper.py)")

  def stop(self) -> None:
    for shard in self.shards:
      shard.stop()

  def join(self, timeout: float | None = None) -> None:
    for shard in self.shards:
      shard.join(timeout)

  def kill(self) -> None:
    """Every shard crashes (config.chaos's syncer_crash names one shard, or all)."""
    for shard in self.shards:
      shard.kill()

  def end(self) -> None:
    """Ends every shard's process (config.runtime=ray)."""
    for shard in self.shards:
      shard.end()
