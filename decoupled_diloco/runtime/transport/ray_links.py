"""The syncer's links into learner processes (config.runtime=ray): its pulls and broadcasts as
signed actor calls, the answers through Ray's object store.

A pull (`ActorLearnerLink.offer`) never blocks the syncer: until the answer has landed it holds a
`messages.PendingAnswer` (`PendingRay`) among the round's copying offers, exactly where a threaded
learner's copy to host RAM would be. A learner over several processes answers in parts: its leader
at once from its latest publication, the others with their pieces of that same publication, put
together where the answer lands (`PendingGroup`); a full state (a cut, a peer's rejoin) is captured
by all of them at one boundary and put together likewise (`gather_published`). Broadcasts are
fire-and-forget calls to every process of the learner.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from decoupled_diloco.runtime.core import agreement as agreement_lib
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.transport import ray_plumbing as plumbing


class PendingRay(messages.PendingAnswer):
  """An actor call's answer to a pull, on its way through the object store."""

  def __init__(self, ref):
    self._ref = ref

  @property
  def in_host_memory(self) -> bool:
    import ray  # pylint: disable=g-import-not-at-top
    ready, _ = ray.wait([self._ref], timeout=0, fetch_local=True)
    return bool(ready)

  def result(self) -> messages.Offer | messages.Answer:
    import ray  # pylint: disable=g-import-not-at-top
    try:
      return ray.get(self._ref, timeout=plumbing.CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      return messages.Answer.UNREACHABLE  # the process died or refused: ask again later


class PendingGroup(messages.PendingAnswer):
  """A multi-process learner's answer to a pull, on its way: the leader's answer, then the other
  processes' pieces of the same publication, put together."""

  def __init__(self, actors, p: int, merged_through: int, incarnation: int, sign_call):
    """`sign_call(method, detail)`: a call's MAC."""
    self._actors, self._p, self._incarnation, self._sign = actors, p, incarnation, sign_call
    self._leader = actors[0].offer_part.remote(p, merged_through, incarnation,
                                               sign_call("offer", f"{p}"))
    self._pieces = None  # refs of the other processes' pieces, once the leader has answered
    self._answer = None

  def _leader_answered(self) -> bool:
    """Whether the leader has answered (then the others are asked for their pieces)."""
    import ray  # pylint: disable=g-import-not-at-top
    if self._answer is not None:
      return True
    ready, _ = ray.wait([self._leader], timeout=0, fetch_local=True)
    if not ready:
      return False
    self._take_leader(timeout=0)
    return True

  def _take_leader(self, timeout: float) -> None:
    import ray  # pylint: disable=g-import-not-at-top
    try:
      self._answer = ray.get(self._leader, timeout=timeout)
    except Exception:  # pylint: disable=broad-except
      self._answer = messages.Answer.UNREACHABLE
    if isinstance(self._answer, messages.Offer):
      step, publication = self._answer.step, self._answer.publication
      mac = self._sign("offer_piece", f"{self._p}:{step}:{publication}")
      self._pieces = [a.offer_piece.remote(self._p, step, publication, self._incarnation, mac)
                      for a in self._actors[1:]]

  @property
  def in_host_memory(self) -> bool:
    import ray  # pylint: disable=g-import-not-at-top
    if not self._leader_answered():
      return False
    if self._pieces is None:
      return True  # STALE, NOTHING or unreachable: nothing more to fetch
    ready, _ = ray.wait(self._pieces, num_returns=len(self._pieces), timeout=0, fetch_local=True)
    return len(ready) == len(self._pieces)

  def result(self) -> messages.Offer | messages.Answer:
    import ray  # pylint: disable=g-import-not-at-top
    if self._answer is None:
      self._take_leader(timeout=plumbing.CALL_TIMEOUT_S)
    first = self._answer
    if not isinstance(first, messages.Offer):
      return first
    try:
      pieces = ray.get(self._pieces, timeout=plumbing.CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      pieces = [None]
    if any(piece is None for piece in pieces):
      # Another process lost the publication or died. The leader recorded the take; a merge
      # without this offer treats its steps as not merged, as after any lost answer.
      return messages.Answer.UNREACHABLE
    values = agreement_lib.assemble([first.values, *pieces])
    return dataclasses.replace(first, values={n: np.asarray(v, np.float32)
                                              for n, v in values.items()})

def gather_published(actors, full: bool, timeout_s: float, sign_call
                     ) -> messages.Publication | None:
  """A multi-process learner's publication: the leader's, with the whole state put together from
  every process's capture of the same boundary when there is one (`full`: asked for). None if a
  full one could not be had within `timeout_s`. `sign_call(method)` gives a call's incarnation
  and MAC."""
  import ray  # pylint: disable=g-import-not-at-top
  boundary, published = ray.get(actors[0].group_published.remote(
      full, timeout_s, *sign_call("published")), timeout=timeout_s + plumbing.CALL_TIMEOUT_S)
  if boundary is None:
    return published
  parts = [published] + ray.get(
      [a.capture_part.remote(boundary, timeout_s, *sign_call("published")) for a in actors[1:]],
      timeout=timeout_s + plumbing.CALL_TIMEOUT_S)
  if any(part is None for part in parts):
    return None if full else dataclasses.replace(published, params={}, opt_state=None,
                                                 state_step=None)
  return dataclasses.replace(
      published, params=agreement_lib.assemble([part.params for part in parts]),
      opt_state=agreement_lib.assemble([part.opt_state for part in parts]),
      state_step=agreement_lib.assemble([part.state_step for part in parts]))

class ActorLearnerLink:
  """The syncer's `LearnerLink` to a learner process (used in the syncer's process): signed actor
  calls, answers through the object store."""

  def __init__(self, actor, index: int, incarnation: int, secret: bytes, num_fragments: int):
    """`actor`: the learner's actor, or the list of its processes' actors (leader first)."""
    self._actors = list(actor) if isinstance(actor, (list, tuple)) else [actor]
    self._actor, self._index, self._incarnation, self._secret = (
        self._actors[0], index, incarnation, secret)
    self._num_fragments = num_fragments

  def _mac(self, method: str, detail: str = "") -> str:
    return plumbing.sign(self._secret, method, self._index, self._incarnation, detail)

  def offer(self, p: int, merged_through: int) -> messages.PendingAnswer:
    if len(self._actors) > 1:
      return PendingGroup(self._actors, p, merged_through, self._incarnation, self._mac)
    return PendingRay(self._actor.offer.remote(p, merged_through, self._incarnation,
                                               self._mac("offer", f"{p}")))

  def deliver(self, broadcast: messages.Broadcast) -> None:
    mac = self._mac("deliver", f"{broadcast.fragment}:{broadcast.version}")
    for actor in self._actors:  # every process of the learner; its leader says when to apply it
      actor.deliver.remote(broadcast, self._incarnation, mac)

  def want_full_state(self, seconds: float) -> None:
    self._actor.want_full_state.remote(seconds, self._incarnation, self._mac("want_full_state"))

  @property
  def training(self) -> bool:
    """Whether the learner's latest publication is of a learner still training: one flag, not
    the publication's arrays. True while its process is down (its exit says otherwise)."""
    import ray  # pylint: disable=g-import-not-at-top
    try:
      return ray.get(self._actor.training.remote(self._incarnation, self._mac("training")),
                     timeout=plumbing.CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      return True

  @property
  def published(self) -> messages.Publication:
    """The learner's latest publication; while its process is down or restarting (a checkpoint's
    cut may ask meanwhile), a stand-in with no state and no Theta_p version, which no cut takes."""
    import ray  # pylint: disable=g-import-not-at-top
    try:
      if len(self._actors) > 1:
        return gather_published(self._actors, False, 0.0,
                                lambda method: (self._incarnation, self._mac(method)))
      return ray.get(self._actor.published.remote(False, 0.0, self._incarnation,
                                                  self._mac("published")),
                     timeout=plumbing.CALL_TIMEOUT_S)
    except Exception:  # pylint: disable=broad-except
      none = np.zeros(self._num_fragments, np.int64)
      return messages.Publication(
          step=-1, params={}, since=none, counter_steps=none, counter_tokens=none,
          anchor_versions=np.full(self._num_fragments, -1, np.int64), anchors={}, training=True)
