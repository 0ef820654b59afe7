"""The fused merge (runtime/core/fused_merge.py) against the reference merge it replaced.

The reference is `GlobalModel(fused=False)`: per-tensor programs over a stacked copy of the outer
gradients, encoded and decoded by numpy, the merge before issue 41. Both get the same fixed offers:
three of four learners, unequal tokens and steps (unequal weights), an embedding fragment (the
weighted average) and one of RDA, tensors whose sizes are not multiples of a block. "Within float32
rounding" is measured per tensor as max |fused - reference| / max |reference| <= 1e-6.
"""

import dataclasses
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import default_settings
from decoupled_diloco.algorithm import compression
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import outer
from decoupled_diloco.runtime.core import global_model as global_model_lib
from decoupled_diloco.runtime.core import messages

SHAPES = {"embedder/embedding": (40, 16), "w": (64, 24), "v": (7, 9), "s": (33,)}
LEARNERS = 4
OFFERING = (0, 2, 3)  # learner 1 is absent: a slot of weight 0
REL_TOL = 1e-6


def _model(fused, outer_grad="bf16", broadcast_delta="none", staleness_scaling="none",
           merge_threads=2, outer_tx=("sgd_nesterov", 0.7, 0.3)):
  shapes = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in SHAPES.items()}
  fragments = fragments_lib.partition(shapes, 2, "balanced",
                                      embedding_names=("embedder/embedding",))
  rng = np.random.default_rng(0)
  initial = {n: rng.standard_normal(s).astype(np.float32) * 0.02 for n, s in SHAPES.items()}
  model = global_model_lib.GlobalModel(
      fragments=fragments, initial_params=initial,
      mesh=Mesh(np.array(jax.devices()[:1]), ("learner",)),
      outer_tx=outer.make_outer_optimizer(*outer_tx),
      merge=default_settings("merge"),
      compression=default_settings("compression", outer_grad=outer_grad,
                                   broadcast_delta=broadcast_delta),
      num_learners=LEARNERS, staleness_scaling=staleness_scaling, fused=fused,
      merge_threads=merge_threads)
  model.compile()
  return model


def _offers(model, p, round_, anchor):
  """The same offers for every model: seeded by fragment and round, anchored at `anchor`."""
  rng = np.random.default_rng(100 * p + round_)
  offers = []
  for m in OFFERING:
    values = {n: anchor[n] + rng.standard_normal(anchor[n].shape).astype(np.float32)
              * np.float32(1e-3 * (m + 1)) for n in model.fragments[p].names}
    steps = 6 + 3 * m
    offers.append(messages.Offer(
        learner=m, fragment=p, step=24 * (round_ + 1), since=24 * (round_ + 1) - steps,
        steps=steps, tokens=100 * steps * (m + 1), anchor_version=round_, values=values,
        anchor={n: anchor[n] for n in model.fragments[p].names}))
  return tuple(offers)


def _relative(a, b):
  scale = np.max(np.abs(b))
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / (scale if scale > 0 else 1.0))


def _merge_both(fused, reference, rounds=2):
  """Merges every fragment `rounds` times in both models; offers anchored at the reference's
  received value, so both see the same bytes. Yields (p, fused result, reference result,
  fused screening, reference screening, the fused model's R_p before the merge)."""
  for round_ in range(rounds):
    for p in range(len(reference.fragments)):
      anchor = reference.received_fragment(p)
      own = fused.received_fragment(p)
      results = []
      for model in (fused, reference):
        offers = _offers(model, p, round_, anchor)
        screening = model.screen(p, offers)
        model.keep_screening(screening)
        results.append((model.merge(p, screening.accepted, screening.prepared), screening))
        model.install(results[-1][0])
      yield p, results[0][0], results[1][0], results[0][1], results[1][1], own


@pytest.mark.parametrize("outer_grad, broadcast_delta", [
    ("fp32", "none"), ("bf16", "none"), ("int8", "none"), ("int4", "none"), ("int2", "none"),
    ("int1", "none"), ("int4", "int4"),
])
def test_fused_merge_equals_the_reference_within_float32_rounding(outer_grad, broadcast_delta):
  fused = _model(True, outer_grad, broadcast_delta)
  reference = _model(False, outer_grad, broadcast_delta)
  merged = 0
  for p, got, want, got_screen, want_screen, before in _merge_both(fused, reference):
    np.testing.assert_array_equal(got.weights, want.weights)  # the same function, bit for bit
    assert got.bytes_up == want.bytes_up
    np.testing.assert_allclose(got_screen.norms, want_screen.norms, rtol=REL_TOL)
    for name in want.theta:
      assert _relative(got.theta[name], want.theta[name]) <= REL_TOL, (p, name)
      for a, b in zip(jax.tree.leaves(got.opt_state[name]), jax.tree.leaves(want.opt_state[name])):
        assert _relative(a, b) <= REL_TOL, (p, name, "momentum")
      if broadcast_delta != "none":
        # The delta the fused merge sent is numpy's encoding of its own new Theta_p, bit for bit.
        expected = compression.encode(got.theta[name] - before[name], broadcast_delta,
                                      got.wire[name].block_size)
        for x, y in zip(got.wire[name].payload, expected.payload):
          np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(got.received[name],
                                      before[name] + compression.decode(expected))
    merged += 1
  assert merged == 4


@pytest.mark.parametrize("fused", [True, False])
def test_the_identity_outer_step_hands_one_learners_offer_back_as_the_merge_saw_it(fused):
  """SGD at lr 1 without momentum, one learner offering (the others absent): Theta_p becomes
  A - (A - theta_offered) in float32, bit for bit, in both the RDA fragment and the embedding's
  (the weighted average); the learner's rebase (algorithm/receive.py) then leaves it exactly as it
  is. Before one learner's Delta was taken as it is, RDA's radius and norm moved some values by an
  ulp."""
  model = _model(fused, "fp32", outer_tx=("sgd", 1.0, 0.0))
  rng = np.random.default_rng(7)
  for p in range(len(model.fragments)):
    anchor = model.received_fragment(p)
    values = {n: anchor[n] + rng.standard_normal(anchor[n].shape).astype(np.float32)
              * np.float32(1e-3) for n in model.fragments[p].names}
    offer = messages.Offer(learner=2, fragment=p, step=24, since=0, steps=24, tokens=2400,
                           anchor_version=0, values=values,
                           anchor={n: anchor[n] for n in model.fragments[p].names})
    screening = model.screen(p, (offer,))
    model.keep_screening(screening)
    result = model.merge(p, screening.accepted, screening.prepared)
    for name, value in values.items():
      np.testing.assert_array_equal(result.theta[name], anchor[name] - (anchor[name] - value),
                                    err_msg=f"{name} (fused={fused})")


def test_the_fused_merge_is_the_same_bit_for_bit_on_one_thread_and_on_two():
  one = _model(True, "int4", "int4", merge_threads=1)
  two = _model(True, "int4", "int4", merge_threads=2)
  for p, got, want, got_screen, want_screen, _ in _merge_both(two, one):
    assert got_screen.norms == want_screen.norms
    for name in want.theta:
      np.testing.assert_array_equal(got.theta[name], want.theta[name])
      np.testing.assert_array_equal(got.received[name], want.received[name])
      for a, b in zip(jax.tree.leaves(got.opt_state[name]), jax.tree.leaves(want.opt_state[name])):
        np.testing.assert_array_equal(a, b)


def test_a_closed_fused_merge_lets_its_threads_go_and_merges_on_bit_for_bit():
  """`GlobalModel.close` (a syncer's join) ends the merge's worker threads; a merge still coming
  (one that was running as its syncer stopped) runs on the caller's thread, the same values."""
  closed = _model(True, "int4", "int4", merge_threads=2)
  open_ = _model(True, "int4", "int4", merge_threads=2)
  merges = _merge_both(closed, open_, rounds=2)
  for _ in range(len(open_.fragments)):  # round 0 on the worker threads
    next(merges)
  threads = list(closed._fused._pool._threads)  # pylint: disable=protected-access
  assert len(threads) == 2 and all(t.is_alive() for t in threads)
  closed.close()
  deadline = time.monotonic() + 10
  while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(t.is_alive() for t in threads)
  for _, got, want, _, _, _ in merges:  # round 1 on the caller's thread
    for name in want.theta:
      np.testing.assert_array_equal(got.theta[name], want.theta[name])
      np.testing.assert_array_equal(got.received[name], want.received[name])


def test_staleness_scaling_in_the_fused_merge_equals_the_reference():
  fused = _model(True, "int8", staleness_scaling="inverse")
  reference = _model(False, "int8", staleness_scaling="inverse")
  for model in (fused, reference):  # two versions of fragment 0 since version 0: staleness 2
    for _ in range(2):
      model.install(model.unchanged(0))
  for _, got, want, _, _, _ in _merge_both(fused, reference, rounds=1):
    for name in want.theta:
      assert _relative(got.theta[name], want.theta[name]) <= REL_TOL


def test_the_fused_screen_rejects_what_the_reference_rejects():
  """A NaN offer, one past float32's squares (1e20: finite, an outlier) and honest ones."""
  verdicts = []
  for fused in (True, False):
    model = _model(fused, "int4")
    anchor = model.received_fragment(1)
    honest = _offers(model, 1, 0, anchor)
    for _ in range(3):  # the robust merge's window fills up with honest norms
      model.keep_screening(model.screen(1, honest))
    bad = []
    for m, scale in ((0, np.nan), (2, 1e20)):
      offer = honest[OFFERING.index(m)]
      bad.append(dataclasses.replace(offer, values={
          n: v + np.float32(scale) for n, v in offer.values.items()}))
    screening = model.screen(1, (bad[0], honest[2], bad[1]))
    verdicts.append(([o.learner for o in screening.accepted],
                     [(r.offer.learner, r.reason, r.norm) for r in screening.rejected]))
  (got_accepted, got_rejected), (want_accepted, want_rejected) = verdicts
  assert got_accepted == want_accepted == [3]
  assert [r[:2] for r in got_rejected] == [r[:2] for r in want_rejected] == [
      (0, "nonfinite"), (2, "outlier")]
  np.testing.assert_allclose(got_rejected[1][2], want_rejected[1][2], rtol=REL_TOL)


@pytest.mark.parametrize("outer_grad", ["bf16", "int8", "int4"])
def test_an_offer_carried_in_the_wire_format_merges_as_the_reference_merges_its_values(outer_grad):
  """A learner in another process sends Delta_m encoded (`Offer.for_the_wire`): the fused merge
  takes its decoded values as they came and lands where the reference merge of the learner's own
  values lands (which rounds them through the same encoder once)."""
  fused = _model(True, outer_grad)
  reference = _model(False, outer_grad)
  for p in range(len(reference.fragments)):
    anchor = reference.received_fragment(p)
    offers = _offers(reference, p, 0, anchor)
    block_size = default_settings("compression").block_size
    carried = tuple(o.for_the_wire(outer_grad, block_size) for o in offers)
    got_screen, want_screen = fused.screen(p, carried), reference.screen(p, offers)
    assert len(got_screen.accepted) == len(want_screen.accepted) == len(OFFERING)
    # The screen's norm of a carried offer is that of its decoded values (the syncer never saw
    # the raw ones): within the format's rounding of the raw norm.
    np.testing.assert_allclose(got_screen.norms, want_screen.norms,
                               rtol={"bf16": 1e-3, "int8": 1e-2, "int4": 0.1}[outer_grad])
    got = fused.merge(p, got_screen.accepted, got_screen.prepared)
    want = reference.merge(p, want_screen.accepted, want_screen.prepared)
    assert got.bytes_up == want.bytes_up
    for name in want.theta:
      assert _relative(got.theta[name], want.theta[name]) <= REL_TOL, (p, name)
