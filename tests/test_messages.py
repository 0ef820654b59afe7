"""What travels between learners and the syncer: an offer that crosses a network carries its
outer gradient in the wire format, and the syncer reads it as it would have computed it."""

import numpy as np
import pytest

from decoupled_diloco.algorithm import compression
from decoupled_diloco.runtime.core import messages


def _offer(delta_by_name):
  """An offer whose Delta_m = anchor - values is `delta_by_name` (anchor 1, values 1 - delta)."""
  anchor = {n: np.ones_like(d, np.float32) for n, d in delta_by_name.items()}
  values = {n: (1.0 - d).astype(np.float32) for n, d in delta_by_name.items()}
  return messages.Offer(learner=1, fragment=2, step=9, since=3, steps=6, tokens=600,
                        anchor_version=4, values=values, anchor=anchor, incarnation=1)


def test_an_offer_for_the_wire_carries_its_encoded_outer_gradient_and_no_values():
  rng = np.random.default_rng(0)
  offer = _offer({"w": rng.normal(size=(8, 16)).astype(np.float32),
                  "b": rng.normal(size=(16,)).astype(np.float32)})
  wire = offer.for_the_wire("bf16", 64)
  assert wire.values == {} and wire.anchor == {}  # no fp32 parameters, no anchor: 4x less
  assert (wire.step, wire.since, wire.tokens, wire.anchor_version) == (9, 3, 600, 4)
  assert wire.nbytes == 2 * (8 * 16 + 16) == compression.tree_nbytes(wire.encoded)
  for name in ("w", "b"):
    expected = compression.decode(compression.encode(offer.outer_gradient(name), "bf16", 64))
    np.testing.assert_array_equal(wire.outer_gradient(name), expected)
    # The merge takes the carried encoding as it is (no second rounding), and a format the
    # syncer wants otherwise is encoded afresh.
    assert wire.wire_outer_gradient(name, "bf16", 64) is wire.encoded[name]
    assert wire.wire_outer_gradient(name, "fp32", 64).fmt == "fp32"


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_outer_gradient_goes_as_fp32_for_the_screen_to_reject(bad):
  """An integer format cannot encode it; fp32 carries it as it is, and the syncer's robust
  screen (runtime/core/global_model.py) rejects the offer as it would have."""
  delta = np.array([0.5, bad, -0.25], np.float32)
  wire = _offer({"w": delta, "b": np.array([0.1], np.float32)}).for_the_wire("int4", 64)
  assert wire.encoded["w"].fmt == "fp32" and wire.encoded["b"].fmt == "int4"
  assert not np.all(np.isfinite(wire.outer_gradient("w")))
