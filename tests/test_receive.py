"""The receive rule (algorithm/receive.py) on small arrays, against values worked out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco.algorithm import receive

_ON = jax.sharding.SingleDeviceSharding(jax.devices()[0])
THETA = np.array([1.0, 2.0, 4.0], np.float32)  # Θ_p as merged
NOW = jnp.array([5.0, 6.0, 7.0], jnp.float32)  # the learner's θ_p when Θ_p arrives
OFFERED = np.array([4.0, 4.0, 4.0], np.float32)  # its θ_p in the offer the merge took


def test_overwrite_replaces_the_fragment_with_theta():
  got = receive.receive(THETA, NOW, alpha=0.0, sharding=_ON)
  np.testing.assert_array_equal(got, [1.0, 2.0, 4.0])


def test_keep_in_flight_progress_adds_the_steps_since_the_offer():
  got = receive.receive(THETA, NOW, alpha=0.0, sharding=_ON, offered=OFFERED)
  np.testing.assert_array_equal(got, [2.0, 4.0, 7.0])  # Θ + (θ_now - θ_offered) = Θ + [1, 2, 3]


def test_overwrite_and_keep_differ_on_the_same_arrival():
  overwritten = receive.receive(THETA, NOW, alpha=0.0, sharding=_ON)
  kept = receive.receive(THETA, NOW, alpha=0.0, sharding=_ON, offered=OFFERED)
  assert not np.array_equal(overwritten, kept)
  np.testing.assert_array_equal(np.asarray(kept) - np.asarray(overwritten), [1.0, 2.0, 3.0])


def test_keep_against_an_older_anchor_rebases_theta_onto_the_offers_anchor():
  anchor, offer_anchor = np.array([1.0, 1.0, 1.0], np.float32), np.zeros(3, np.float32)
  got = receive.receive(THETA, NOW, alpha=0.0, sharding=_ON, offered=OFFERED,
                        anchors=(anchor, offer_anchor))
  # (Θ - A + A_o) + (θ_now - θ_offered) = [0, 1, 3] + [1, 2, 3]
  np.testing.assert_array_equal(got, [1.0, 3.0, 6.0])


def test_a_merge_that_hands_the_offer_back_leaves_the_learner_exactly_where_it_is():
  """The identity outer step gives Θ = A_o - (A_o - θ_offered) in float32 (the syncer's outer
  gradient, rounded, taken back off the anchor), which is not θ_offered where the step from A_o is
  large against the value (a weight near zero). Kept progress is then θ_now + (Θ - that), exactly
  θ_now: the learner goes on as if no merge had come (as dp). Θ + (θ_now - θ_offered) would round
  twice on every value."""
  rng = np.random.default_rng(1)
  anchor = rng.standard_normal(8192).astype(np.float32) * np.float32(1e-3)
  # Weights the steps since A_o brought near zero: a step of 1e-3 to a value of 1e-5.
  offered = rng.standard_normal(8192).astype(np.float32) * np.float32(1e-5)
  now = jnp.asarray(offered + rng.standard_normal(8192).astype(np.float32) * np.float32(1e-4))
  theta = anchor - (anchor - offered)  # SGD at lr 1 on Δ = A_o - θ_offered
  assert not np.array_equal(theta, offered)  # the case that matters is in the data
  for gather in (None, lambda x: np.asarray(jax.device_get(x))):
    got = receive.receive(theta, now, alpha=0.0, sharding=_ON, offered=offered,
                          offer_anchor=anchor, gather=gather)
    np.testing.assert_array_equal(got, now)
  # Without the offer's anchor the values where Θ != θ_offered move.
  moved = receive.receive(theta, now, alpha=0.0, sharding=_ON, offered=offered)
  assert not np.array_equal(moved, now)


def test_alpha_mixes_the_local_value_into_the_received_one():
  got = receive.receive(THETA, NOW, alpha=0.25, sharding=_ON)
  np.testing.assert_array_equal(got, [2.0, 3.0, 4.75])  # 0.25·θ_now + 0.75·Θ
  kept = receive.receive(THETA, NOW, alpha=0.5, sharding=_ON, offered=OFFERED)
  np.testing.assert_array_equal(kept, [3.5, 5.0, 7.0])  # 0.5·θ_now + 0.5·[2, 4, 7]


def test_keep_on_the_host_gives_the_devices_values():
  on_devices = receive.receive(THETA, NOW, alpha=0.0, sharding=_ON, offered=OFFERED)
  on_host = receive.receive(THETA, NOW, alpha=0.0, sharding=_ON, offered=OFFERED,
                            gather=lambda x: np.asarray(jax.device_get(x)))
  np.testing.assert_array_equal(on_host, on_devices)


@pytest.mark.parametrize("offered", [None, OFFERED])
def test_bfloat16_weights_stay_bfloat16(offered):
  now = NOW.astype(jnp.bfloat16)
  got = receive.receive(THETA, now, alpha=0.0, sharding=_ON, offered=offered)
  assert got.dtype == jnp.bfloat16


def test_overwrite_lowers_no_program_and_each_option_its_own():
  like = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=_ON)
  assert receive.lower_merge_programs(like, keep_in_flight_progress=False, alpha=0.0) == {}
  assert set(receive.lower_merge_programs(like, keep_in_flight_progress=True,
                                          alpha=0.5)) == {"rebase", "mix"}
