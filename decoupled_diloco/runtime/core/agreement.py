"""A learner over several processes: how they stay one learner.

A learner over several processes (`ProcessGroup`, one per host: runtime/transport/ray_runtime.py) is
the same `Learner` in every process, in lock-step, since every step is one program over all of them.
At every step boundary they agree on what changes their state: the leader, process 0, proposes the
takes the syncer made of its publications since the last boundary, the broadcasts it holds, a
capture of the whole state (`capture`), a stop and a release, and every process does exactly that,
in that order (`Agreement.boundary`). A pull does not wait for a boundary: the leader answers it from
its latest publication (`Learner.offer`), as a learner of one process does, and the others give
their pieces of the same publication (`offer_of`), which each process keeps among its last few.

A process copies to the host only the pieces of an array it holds (`local_shards`); `assemble` puts
the pieces of all processes together.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from decoupled_diloco.runtime.core import messages


_MAX_AGREED = 32  # broadcasts one boundary of a multi-process learner applies at most
# Publications a process of a multi-process learner other than the leader keeps at most. Each
# boundary drops those older than the leader's latest (later pulls take from it or newer ones),
# which leaves the few made since: at most a boundary's worth.
_RECENT_PUBLICATIONS = 16
_ARRIVAL_TIMEOUT_S = 120.0  # how long a process waits for a broadcast its leader applies
# How long a process other than the leader keeps a publication the leader took a fragment from,
# for the syncer's call for its pieces of it (which waits that long for them itself:
# ray_plumbing.CALL_TIMEOUT_S); given pieces are not kept.
_PIECE_WAIT_S = 120.0
_SERVED = 256  # pieces given before their take was agreed, remembered at most


class ProcessGroup(Protocol):
  """The processes of a learner that spans several hosts (runtime/transport/ray_runtime.py): each runs this
  same learner on its part of the learner's mesh, in lock-step, since every step is one program over
  all of them. What may differ between them (which broadcasts and pulls have reached each, a stop
  asked of the leader) is agreed at every step boundary: the leader, process 0, proposes, and all
  of them apply the leader's proposal."""

  leader: bool

  def agree(self, proposal: dict[str, Any] | None) -> dict[str, Any]:
    """All processes call this at the same boundary; each gets the leader's `proposal`."""
    ...


@dataclasses.dataclass(frozen=True)
class HostShards:
  """One process's host copy of its part of an array: the pieces it holds (one copy of each),
  as (slices, values). `assemble` puts the parts of all processes together."""

  shape: tuple[int, ...]
  dtype: Any
  pieces: tuple[tuple[tuple[tuple[int, int], ...], np.ndarray], ...]


def local_shards(tree: Any) -> Any:
  """`tree` with each jax.Array replaced by this process's `HostShards` of it."""
  def one(x):
    if not isinstance(x, jax.Array):
      return x
    pieces = []
    for shard in x.addressable_shards:
      if shard.replica_id != 0:
        continue  # another device (perhaps of another process) gives this piece
      bounds = tuple(sl.indices(n)[:2] for sl, n in zip(shard.index, x.shape))
      pieces.append((bounds, np.asarray(shard.data)))
    return HostShards(tuple(x.shape), x.dtype, tuple(pieces))
  return jax.tree.map(one, tree)


def assemble(parts: Sequence[Any]) -> Any:
  """The host arrays whose `HostShards` the processes of a learner gave (`local_shards`)."""
  def one(*leaves):
    first = leaves[0]
    if not isinstance(first, HostShards):
      return first
    out = np.empty(first.shape, first.dtype)
    filled = 0
    for leaf in leaves:
      for bounds, values in leaf.pieces:
        out[tuple(slice(a, b) for a, b in bounds)] = values
        filled += values.size
    if filled != out.size:
      raise ValueError(f"the processes' pieces cover {filled} of {out.size} values of an array "
                       f"of shape {first.shape}")
    return out
  return jax.tree.map(one, *parts, is_leaf=lambda x: isinstance(x, HostShards))


def host_array(x: Any) -> np.ndarray:
  """A host copy of the whole of `x`; of an array spread over several processes, gathered from all
  of them (a collective: every process of the learner calls it at the same point)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _broadcast_key(broadcast: messages.Broadcast) -> tuple[int, int, int]:
  base = -1 if broadcast.base_version is None else int(broadcast.base_version)
  return (int(broadcast.fragment), int(broadcast.version), base)


class Agreement:
  """What one process of a multi-process learner keeps for the agreement, and the agreement itself.

  It belongs to its `Learner` (runtime/core/learner.py), whose step loop calls `boundary` at every
  step boundary, and works on that learner's state as the learner's own code would: under its lock,
  with its inbox, its takes and its apply.
  """

  def __init__(self, learner: Any, group: ProcessGroup):
    self._learner = learner
    self.group = group
    # The broadcasts taken from the inbox and not yet applied, the leader's takes since the last
    # boundary (p, step, publication; under the learner's lock), each process's last publications
    # ((step, index) -> publication) and captures of the whole state (boundary -> publication of
    # host shards), and the stop and release agreed.
    self._arrived: list[messages.Broadcast] = []
    self.takes: list[tuple[int, int, int]] = []
    self._recent: dict[tuple[int, int], messages.Publication] = {}
    self._captures: dict[int, messages.Publication] = {}
    # Pieces (p, step, publication) the syncer has yet to ask this process for, of takes agreed
    # (-> until when they are kept), and those it asked for before their take was agreed.
    self._owed: dict[tuple[int, int, int], float] = {}
    self._served: list[tuple[int, int, int]] = []
    self.boundaries = 0  # step boundaries this learner's processes have agreed on so far
    self._agreed = threading.Condition()
    self.stop = False
    self.release = False

  # ---- called from other threads -------------------------------------------------------------

  def offer_of(self, p: int, step: int, publication: int, timeout_s: float
               ) -> messages.Offer | None:
    """See `Learner.offer_of`."""
    key = (int(step), int(publication))
    deadline = time.monotonic() + timeout_s
    with self._agreed:
      while key not in self._recent:
        left = deadline - time.monotonic()
        if (left <= 0 or self._learner.error is not None or
            (self._recent and min(self._recent) > key)):
          return None
        self._agreed.wait(min(left, 0.5))
      published = self._recent[key]
      piece = (int(p), *key)
      if self._owed.pop(piece, None) is None:
        self._served = [*self._served, piece][-_SERVED:]
    return dataclasses.replace(self._learner._offer_from(published, p), publication=key[1])  # pylint: disable=protected-access

  def capture(self, timeout_s: float, *, after: int = -1, boundary: int | None = None
              ) -> tuple[int, messages.Publication] | None:
    """See `Learner.capture`."""
    if boundary is None:
      self._learner.want_full_state(timeout_s)
    deadline = time.monotonic() + timeout_s
    with self._agreed:
      while True:
        if boundary is not None and boundary in self._captures:
          return boundary, self._captures[boundary]
        if boundary is None:
          newer = [b for b in self._captures if b > after]
          if newer:
            return max(newer), self._captures[max(newer)]
        left = deadline - time.monotonic()
        if left <= 0 or self._learner.error is not None or (
            boundary is not None and self._captures and min(self._captures) > boundary):
          return None
        self._agreed.wait(min(left, 0.5))

  # ---- the learner's own thread ---------------------------------------------------------------

  def keep_recent(self, published: messages.Publication) -> None:
    """A process other than the leader keeps its publications from the leader's latest one on (as
    of the last boundary), for the pulls the leader answers from its own (`offer_of`)."""
    if self.group.leader:
      return
    with self._agreed:
      self._recent[(published.step, published.index)] = published
      while len(self._recent) > _RECENT_PUBLICATIONS:  # a bound; boundaries drop them sooner
        del self._recent[min(self._recent)]
      self._agreed.notify_all()

  def boundary(self) -> int:
    """Agrees on this boundary and does what was agreed; returns how many broadcasts it applied.

    The leader proposes the takes it made since the last boundary, the broadcasts it has, whether
    to capture the whole state, a stop and a release; every process then does exactly that, in
    that order, so that all keep the same state and run the same programs.
    """
    # pylint: disable=protected-access
    learner = self._learner
    self._take_inbox()
    proposal = None
    if self.group.leader:
      with learner._lock:
        takes, self.takes = self.takes, []
      # Later takes come from this publication or a newer one: the others keep no older ones.
      keep_from = [learner._published.step, learner._published.index]
      proposal = {"take": takes, "keep_from": keep_from,
                  "apply": [_broadcast_key(b) for b in self._arrived[:_MAX_AGREED]],
                  "capture": bool(time.monotonic() < learner._full_until),
                  "stop": learner._stop.is_set(), "release": learner._release.is_set()}
    agreed = self.group.agree(proposal)
    if not self.group.leader:
      # The leader recorded its takes when it made them; the others record them now, before the
      # broadcasts that may name them.
      for p, step, publication in agreed["take"]:
        published = self._recent.get((step, publication))
        if published is None:
          raise RuntimeError(f"learner {learner.index}: the leader took fragment {p} from "
                             f"publication {(step, publication)}, which this process no longer "
                             "holds")
        learner.take_from(published, p, publication)
      with self._agreed:
        now = time.monotonic()
        for p, step, publication in agreed["take"]:
          piece = (p, step, publication)
          if piece in self._served:
            self._served.remove(piece)
          else:
            self._owed[piece] = now + _PIECE_WAIT_S
        self._owed = {k: until for k, until in self._owed.items() if until > now}
        # Older than the leader's latest: later takes come from it or newer ones. Kept still:
        # those whose pieces the syncer has yet to ask for.
        owed = {(step, publication) for _, step, publication in self._owed}
        for key in [k for k in self._recent if k < tuple(agreed["keep_from"]) and k not in owed]:
          del self._recent[key]
    for key in agreed["apply"]:
      learner._apply(self._arrived_broadcast(tuple(key)))
    capture = None
    if agreed["capture"]:
      state = learner._state
      capture = dataclasses.replace(
          learner._publication(state, publishable=False), params=local_shards(dict(state.params)),
          opt_state=local_shards(state.opt_state), state_step=local_shards(state.step))
    with self._agreed:
      self.boundaries += 1
      if capture is not None:
        self._captures[self.boundaries] = capture
        while len(self._captures) > 3:
          del self._captures[min(self._captures)]
      self.stop = self.stop or agreed["stop"]
      self.release = self.release or agreed["release"]
      self._agreed.notify_all()
    # Bounded: a broadcast the leader never proposes is one it had applied or skipped already.
    versions = learner._anchor_versions
    self._arrived = [b for b in self._arrived if b.version > versions[b.fragment]]
    return len(agreed["apply"])

  def _take_inbox(self) -> None:
    while True:
      try:
        self._arrived.append(self._learner._inbox.get_nowait())  # pylint: disable=protected-access
      except queue.Empty:
        return

  def _arrived_broadcast(self, key: tuple[int, int, int]) -> messages.Broadcast:
    """The broadcast the leader named (sent to every process of the learner at once)."""
    deadline = time.monotonic() + _ARRIVAL_TIMEOUT_S
    while True:
      for i, broadcast in enumerate(self._arrived):
        if _broadcast_key(broadcast) == key:
          return self._arrived.pop(i)
      if time.monotonic() > deadline:
        raise RuntimeError(f"learner {self._learner.index}: the broadcast (fragment, version, "
                           f"base) = {key} its leader applied never reached this process")
      try:
        self._arrived.append(self._learner._inbox.get(timeout=0.05))  # pylint: disable=protected-access
      except queue.Empty:
        pass
