"""A learner over several processes (config.ray.processes_per_learner): its processes agree at
every step boundary on what changes their state, so they stay the same learner whatever reaches
each of them when.

Here the two "processes" are two learner threads of this process on the same devices, whose
agreement is a barrier and the leader's proposal (under Ray it is the learner's own
jax.distributed job, tests/test_ray_runtime.py). The pieces a process gives of an array and
their assembly are checked on a mesh of two devices.
"""

import dataclasses
import json
import threading
import time

import jax
import numpy as np
import pytest

from conftest import tiny_settings
from conftest import wait_until
from decoupled_diloco.algorithm import compression
from decoupled_diloco.lm import inner
from decoupled_diloco.runtime import train
from decoupled_diloco.runtime.core import agreement as agreement_lib
from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.core import messages

P = 1


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  run = train.build(tiny_settings(tmp_path_factory.mktemp("group"), num_learners=1,
                                  learner_mesh_shapes=((1, 2),)))
  yield run
  run.metrics.close()


class _Agreement:
  """Two threads' `learner.ProcessGroup`: both wait at a barrier, then read the leader's
  proposal (as json, as it travels between processes)."""

  def __init__(self, shared: dict, leader: bool):
    self.leader, self._shared = leader, shared

  def agree(self, proposal):
    if self.leader:
      self._shared["proposal"] = json.dumps(proposal)
    self._shared["posted"].wait(timeout=60)
    agreed = json.loads(self._shared["proposal"])
    self._shared["read"].wait(timeout=60)  # the leader's next proposal waits for this read
    return agreed


class _Posted:
  def __init__(self):
    self.messages = []

  def post(self, message):
    self.messages.append(message)


def _pair(run, batches, *, agreed: bool, num_steps: int = 20):
  """A leader and a follower of one learner (or, not agreed, two independent copies of it)."""
  base = run.learners[0]
  shared = {"posted": threading.Barrier(2), "read": threading.Barrier(2)}
  options = dataclasses.replace(base._options, num_steps=num_steps, step_delay_s=0.02,
                                step_noise_s=0.0)
  return [learner_lib.Learner(
      0, train_step=base._train_step, state=inner.copy_tree(base._state),
      param_shardings=base._shardings, batches=iter(list(batches)), fragments=run.fragments,
      syncer=_Posted() if leader else None, options=options, layout=base.layout,
      group=_Agreement(shared, leader) if agreed else None) for leader in (True, False)]


def _broadcast(run, offer: messages.Offer, version: int, shift: float) -> messages.Broadcast:
  """A merge of `offer` alone: Theta_p = its values + shift."""
  theta = {n: np.asarray(v, np.float32) + shift for n, v in offer.values.items()}
  return messages.Broadcast(P, version, compression.encode_tree(theta, "fp32", 64),
                            {0: offer.step})


def _pull(pair) -> list:
  """The leader answers from its latest publication; the follower gives the same publication's
  fragment (and records the take at the next boundary). Independent copies answer each alone."""
  leader, follower = pair
  offer = leader.offer(P, 0)
  if leader._group is not None:
    return [offer, follower.offer_of(P, offer.step, offer.publication, 30.0)]
  return [offer, follower.offer(P, 0)]


def _drive(run, pair):
  """Two pulls and merges while the pair trains. Each broadcast reaches the leader at once and
  the follower later, as a slow link would: 0.3 s later for an agreed pair (whose follower waits
  for a broadcast its leader applies), three of its own steps later for independent copies (so
  that they apply it at other steps however fast the host runs them)."""
  leader, follower = pair
  for learner in pair:
    learner.start()
  answers, links = [], []
  for version, at_step in ((1, 4), (2, 9)):
    while leader.step < at_step:
      time.sleep(0.005)
    answers.append(_pull(pair))
    broadcast = _broadcast(run, answers[-1][0], version, shift=0.125 * version)
    leader.deliver(broadcast)
    if leader._group is not None:
      link = threading.Timer(0.3, follower.deliver, args=(broadcast,))
    else:
      due = min(leader.step + 3, follower._options.num_steps)
      link = threading.Thread(target=lambda broadcast=broadcast, due=due: (
          wait_until(lambda: follower.step >= due), follower.deliver(broadcast)))
    link.start()
    links.append(link)
  for learner in pair:
    assert learner.finished_training.wait(60)
  for link in links:
    link.join(60)  # the follower's last broadcast has arrived
  leader.release()
  follower.release()  # the agreed release is the leader's; an independent copy needs its own
  for learner in pair:
    learner.join(60)
  return answers


def test_the_processes_of_a_learner_agree_on_every_pull_and_merge_and_end_identical(built):
  batches = [next(built.learners[0]._batches) for _ in range(24)]
  pair = _pair(built, batches, agreed=True)
  answers = _drive(built, pair)
  leader, follower = pair
  assert leader.error is None and follower.error is None
  for a, b in answers:
    assert isinstance(a, messages.Offer) and isinstance(b, messages.Offer)
    assert (a.step, a.steps, a.tokens) == (b.step, b.steps, b.tokens)
    for name in a.values:
      np.testing.assert_array_equal(np.asarray(a.values[name]), np.asarray(b.values[name]))
  assert leader.step == follower.step == 20
  assert list(leader.counters().anchor_versions) == list(follower.counters().anchor_versions)
  assert leader.counters().anchor_versions[P] == 2
  assert leader.discarded_fragment_steps == follower.discarded_fragment_steps > 0
  ours, theirs = jax.device_get(leader._state.params), jax.device_get(follower._state.params)
  for name in ours:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_without_the_agreement_the_same_pair_ends_apart(built):
  """The check above can fail: two copies that apply each broadcast when it reaches them (here
  ten steps apart) end with other parameters."""
  batches = [next(built.learners[0]._batches) for _ in range(24)]
  pair = _pair(built, batches, agreed=False)
  _drive(built, pair)
  ours, theirs = (jax.device_get(l._state.params) for l in pair)
  assert any(not np.array_equal(ours[n], theirs[n]) for n in ours)


def test_a_stop_asked_of_the_leader_stops_every_process_at_the_same_step(built):
  batches = [next(built.learners[0]._batches) for _ in range(24)]
  pair = _pair(built, batches, agreed=True)
  leader, follower = pair
  for learner in pair:
    learner.start()
  while leader.step < 5:
    time.sleep(0.005)
  leader.stop()
  for learner in pair:
    learner.join(60)
  assert not leader.alive and not follower.alive
  assert leader.error is None and follower.error is None
  assert leader.step == follower.step < 20


def test_a_process_gives_its_pieces_of_an_array_and_the_pieces_make_the_whole(built):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  value = np.arange(24, dtype=np.float32).reshape(3, 8)
  tree = {"a": jax.device_put(value, sharded), "b": jax.device_put(value, replicated), "c": 3}
  pieces = agreement_lib.local_shards(tree)
  assert len(pieces["a"].pieces) == 2 and len(pieces["b"].pieces) == 1  # one copy of each
  whole = agreement_lib.assemble([pieces])
  np.testing.assert_array_equal(whole["a"], value)
  np.testing.assert_array_equal(whole["b"], value)
  assert whole["c"] == 3
  # Two processes, each with one half: the halves make the whole; one half alone does not.
  halves = [dataclasses.replace(pieces["a"], pieces=(piece,)) for piece in pieces["a"].pieces]
  np.testing.assert_array_equal(agreement_lib.assemble([{"a": h} for h in halves])["a"], value)
  with pytest.raises(ValueError, match="cover 12 of 24"):
    agreement_lib.assemble([{"a": halves[0]}])


def test_a_process_keeps_a_taken_publication_until_it_has_given_its_pieces(built):
  """The leader answers a pull from its latest publication at once; the syncer asks the other
  processes for their pieces of it only once that answer has landed, which on a loaded host can be
  several step boundaries later, after the leader has published newer ones. The others keep a
  publication the leader took from until they have given their pieces of it (before, the first
  boundary after a newer publication dropped it, and the pull came back unreachable)."""
  batches = [next(built.learners[0]._batches) for _ in range(24)]
  leader, follower = _pair(built, batches, agreed=True)
  for learner in (leader, follower):
    learner.start()
  while leader.step < 4:
    time.sleep(0.005)
  offer = leader.offer(P, 0)
  boundary = follower._agreement.boundaries  # pylint: disable=protected-access
  assert wait_until(lambda: follower._agreement.boundaries >= boundary + 4)  # pylint: disable=protected-access
  assert follower.step > offer.step + 2  # newer publications were made since
  piece = follower.offer_of(P, offer.step, offer.publication, 5.0)
  # Once given, it is not kept for that fragment any more: the next boundaries drop it.
  assert wait_until(lambda: follower._agreement.boundaries >= boundary + 7)  # pylint: disable=protected-access
  again = follower.offer_of(P, offer.step, offer.publication, 0.5)
  leader.stop()
  leader.release()
  for learner in (leader, follower):
    learner.join(60)
  assert leader.error is None and follower.error is None
  assert isinstance(piece, messages.Offer) and piece.step == offer.step
  for name in offer.values:
    np.testing.assert_array_equal(np.asarray(offer.values[name]), np.asarray(piece.values[name]))
  assert again is None
