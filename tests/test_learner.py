"""A learner's side of a sync, on hand-set values: what it offers, and what a merge does to it.

One tiny run is built per module; each test makes a fresh learner from its compiled pieces and sets
fragment values, counters and anchors by hand, so every expected number is written out.
"""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import tiny_settings
from decoupled_diloco.algorithm import compression
from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime import train

P = 1  # the fragment the tests sync


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  run = train.build(tiny_settings(tmp_path_factory.mktemp("learner"), num_learners=1,
                                  learner_mesh_shapes=((2, 1),)))
  yield run
  run.metrics.close()


class _Posted:
  def __init__(self):
    self.messages = []

  def post(self, message):
    self.messages.append(message)


def _learner(run, **options):
  base = run.learners[0]
  return learner_lib.Learner(
      0, train_step=base._train_step, state=base._state, param_shardings=base._shardings,
      batches=base._batches, fragments=run.fragments, syncer=_Posted(),
      options=dataclasses.replace(base._options, **options))


def _names(run):
  return run.fragments[P].names


def _set(learner, run, value, *, step, steps, anchor=None):
  """The fragment's values all `value`, `steps` unmerged steps (100 tokens each) ending at `step`."""
  params = dict(learner._state.params)
  for name in _names(run):
    params[name] = jax.device_put(np.full(params[name].shape, value, np.float32),
                                  learner._shardings[name])
    if anchor is not None:
      learner._anchors[name] = np.full(params[name].shape, anchor, np.float32)
  learner._state = learner._state._replace(params=params)
  learner.step = step
  learner._counter_steps[P], learner._counter_tokens[P] = steps, 100 * steps
  learner._publish(learner._state)


def _broadcast(run, value, version, merged_offers):
  shapes = {n: v.shape for n, v in run.syncer.model.fragment_params(P).items()}
  theta = {n: np.full(shapes[n], value, np.float32) for n in _names(run)}
  return messages.Broadcast(P, version, compression.encode_tree(theta, "fp32", 64), merged_offers)


def _values(learner, run):
  params = jax.device_get(learner._state.params)
  return {n: params[n] for n in _names(run)}


def _assert_all(values, expected):
  for name, value in values.items():
    np.testing.assert_allclose(value, expected, rtol=0, atol=1e-6, err_msg=name)


def test_offer_is_the_published_fragment_with_its_counters_and_is_remembered(built):
  learner = _learner(built)
  _set(learner, built, 1.0, step=5, steps=5, anchor=0.5)
  offer = learner.offer(P, 0)
  assert isinstance(offer, messages.Offer)
  assert (offer.step, offer.since, offer.steps, offer.tokens, offer.anchor_version) == (5, 0, 5, 500, 0)
  assert sorted(offer.values) == sorted(_names(built))
  _assert_all({n: np.asarray(v) for n, v in offer.values.items()}, 1.0)
  _assert_all(offer.anchor, 0.5)
  assert learner._ledger.taken[P] is offer


def test_offer_holding_steps_a_merge_took_is_stale_and_one_without_steps_is_nothing(built):
  learner = _learner(built)
  _set(learner, built, 1.0, step=5, steps=5)
  # A merge took this learner's steps up to 3; its broadcast has not been applied here yet.
  assert learner.offer(P, 3) is messages.Answer.STALE
  _set(learner, built, 1.0, step=5, steps=0)
  assert learner.offer(P, 0) is messages.Answer.NOTHING
  assert P not in learner._ledger.taken


def test_broadcasts_apply_monotonically(built):
  learner = _learner(built)
  _set(learner, built, 1.0, step=5, steps=5)
  learner._apply(_broadcast(built, 0.25, 2, {}))
  learner._apply(_broadcast(built, 0.75, 1, {}))  # older: ignored
  _assert_all(_values(learner, built), 0.25)
  assert learner._anchor_versions[P] == 2


def _offered_then_two_more_steps(run, **options):
  """Offer at step 5 (values 1.0, anchor 0.5), then two steps later the values are 3.0."""
  learner = _learner(run, **options)
  _set(learner, run, 1.0, step=5, steps=5, anchor=0.5)
  assert isinstance(learner.offer(P, 0), messages.Offer)
  _set(learner, run, 3.0, step=7, steps=7)
  return learner


def test_overwrite_drops_the_steps_made_after_the_merged_offer(built):
  learner = _offered_then_two_more_steps(built)
  learner._apply(_broadcast(built, 0.25, 1, {0: 5}))
  _assert_all(_values(learner, built), 0.25)
  assert (learner._counter_steps[P], learner._counter_tokens[P], learner._since[P]) == (0, 0, 7)
  assert learner.discarded_fragment_steps == 2
  assert P not in learner._ledger.taken


def test_keep_in_flight_progress_keeps_the_steps_made_after_the_merged_offer(built):
  learner = _offered_then_two_more_steps(built, keep_in_flight_progress=True)
  learner._apply(_broadcast(built, 0.25, 1, {0: 5}))
  _assert_all(_values(learner, built), 0.25 + (3.0 - 1.0))
  assert (learner._counter_steps[P], learner._counter_tokens[P], learner._since[P]) == (2, 200, 5)
  assert learner.discarded_fragment_steps == 0
  # Its next offer holds only those two steps, anchored at the merge it holds now.
  learner._publish(learner._state)
  offer = learner.offer(P, 5)
  assert (offer.since, offer.steps, offer.anchor_version) == (5, 2, 1)


def test_keep_in_flight_progress_keeps_every_step_when_the_merge_left_this_learner_out(built):
  learner = _offered_then_two_more_steps(built, keep_in_flight_progress=True)
  learner._apply(_broadcast(built, 0.25, 1, {3: 9}))
  _assert_all(_values(learner, built), 0.25 + (3.0 - 0.5))
  assert (learner._counter_steps[P], learner._since[P]) == (7, 0)
  assert learner._ledger.taken[P].step == 5  # still waiting for its own merge


def test_offer_anchored_behind_is_rebased_against_its_own_anchor(built):
  """Taken at anchor v0; a merge without this learner (v1) is applied; then v2 merges the offer.
  The learner keeps exactly its progress minus the offered progress: 3.5 - 0.5 = 3.0."""
  learner = _offered_then_two_more_steps(built, keep_in_flight_progress=True)
  learner._apply(_broadcast(built, 0.75, 1, {}))  # theta = 0.75 + (3.0 - 0.5) = 3.25
  _assert_all(_values(learner, built), 3.25)
  _set(learner, built, 4.25, step=8, steps=8)  # one more step: +1.0
  learner._apply(_broadcast(built, 2.0, 2, {0: 5}))
  _assert_all(_values(learner, built), 2.0 + 3.0)
  assert (learner._counter_steps[P], learner._since[P]) == (3, 5)


def test_a_finished_learner_keeps_its_unmerged_steps_even_under_overwrite(built):
  learner = _offered_then_two_more_steps(built)
  learner._finished = True
  learner._apply(_broadcast(built, 0.25, 1, {0: 5}))
  _assert_all(_values(learner, built), 0.25 + (3.0 - 1.0))
  assert learner._counter_steps[P] == 2
  assert learner.discarded_fragment_steps == 0


def test_a_merge_of_steps_an_overwrite_already_dropped_keeps_the_newer_steps(built):
  """Offer at 5 taken; a merge without this learner overwrites at step 7; then the merge of the
  offer arrives: the steps after 7 were never offered, so a keeping learner keeps them all. (The
  syncer took the offer before the overwrite was applied, or a round rejected it and the next one
  took it again from the same publication.)"""
  learner = _offered_then_two_more_steps(built)
  learner._apply(_broadcast(built, 0.75, 1, {}))  # overwrite at step 7: since = 7
  assert learner.discarded_fragment_steps == 7
  learner._finished = True
  _set(learner, built, 1.75, step=8, steps=1, anchor=None)  # one step after the overwrite
  learner._apply(_broadcast(built, 2.0, 2, {0: 5}))
  _assert_all(_values(learner, built), 2.0 + (1.75 - 0.75))
  assert (learner._counter_steps[P], learner._since[P]) == (1, 7)
  # Steps 1-5 reached Theta_p through that merge after all: only 6 and 7 stay discarded (the
  # summary's token accounting would otherwise count steps 1-5 as both merged and discarded).
  assert (learner.discarded_fragment_steps, learner.discarded_fragment_tokens) == (2, 200)


def test_a_learner_remembers_one_taken_offer_per_fragment(built):
  """Memory stays bounded: an offer left out of its round is replaced by the next one taken."""
  learner = _learner(built, keep_in_flight_progress=True)
  _set(learner, built, 1.0, step=5, steps=5, anchor=0.5)
  learner.offer(P, 0)  # its round closes without it (late)
  _set(learner, built, 2.0, step=7, steps=7)
  second = learner.offer(P, 0)
  assert learner._ledger.taken == {P: second}
  learner._apply(_broadcast(built, 0.25, 1, {0: 7}))
  _assert_all(_values(learner, built), 0.25)  # every step was in the merged offer
  assert learner._counter_steps[P] == 0 and learner._ledger.taken == {}


def test_steps_an_overwrite_dropped_are_not_discarded_once_a_merge_takes_them_in(built):
  """Offer at 5 taken; a merge without this learner overwrites at 7 (7 steps discarded); a newer
  offer is taken; then the merge of the first offer arrives: its 5 steps reached Theta after all,
  so they are merged, not discarded (every step is merged, discarded or unmerged, exactly once)."""
  learner = _offered_then_two_more_steps(built)
  learner._apply(_broadcast(built, 0.75, 1, {}))  # overwrite at step 7: since = 7
  assert learner.discarded_fragment_steps == 7
  _set(learner, built, 1.75, step=8, steps=1)
  newer = learner.offer(P, 0)
  assert (newer.since, newer.step) == (7, 8)  # replaces the first offer in the ledger
  learner._apply(_broadcast(built, 2.0, 2, {0: 5}))
  # 7 - 5, and this overwrite drops step 8, which the newer offer holds.
  assert learner.discarded_fragment_steps == 7 - 5 + 1
  assert learner.discarded_fragment_tokens == 100 * (7 - 5 + 1)
  learner._apply(_broadcast(built, 2.5, 3, {0: 8}))  # ... and merges it after all
  assert learner.discarded_fragment_steps == 2 and learner._counter_steps[P] == 0


def _delta(run, value, version, base_version):
  shapes = {n: v.shape for n, v in run.syncer.model.fragment_params(P).items()}
  delta = {n: np.full(shapes[n], value, np.float32) for n in _names(run)}
  return messages.Broadcast(P, version, compression.encode_tree(delta, "int4", 64), {},
                            base_version=base_version)


def test_a_delta_broadcast_adds_to_the_anchor_of_its_base_version_and_is_ignored_otherwise(built):
  learner = _learner(built)
  _set(learner, built, 1.0, step=5, steps=5, anchor=0.5)
  delta = _delta(built, 0.3, 1, base_version=0)
  learner._apply(delta)
  # The anchor plus the decoded delta, in float32: what the syncer adds to its R_p too.
  expected = {n: np.float32(0.5) + compression.decode(delta.values[n]) for n in _names(built)}
  for name, value in _values(learner, built).items():
    np.testing.assert_array_equal(value, expected[name])
    np.testing.assert_array_equal(learner._anchors[name], expected[name])
  assert learner._anchor_versions[P] == 1 and learner.ignored_deltas == 0
  # A delta against version 2, which this learner never received: applying it would give a wrong
  # Theta_p. It is ignored; the keyframe that follows is applied.
  learner._apply(_delta(built, 0.3, 3, base_version=2))
  assert learner._anchor_versions[P] == 1 and learner.ignored_deltas == 1
  for name, value in _values(learner, built).items():
    np.testing.assert_array_equal(value, expected[name])
  learner._apply(_broadcast(built, 2.0, 3, {}))
  _assert_all(_values(learner, built), 2.0)
  assert learner._anchor_versions[P] == 3
