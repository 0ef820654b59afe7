"""Tests for algorithm.merge: learner weights, weighted average and RDA (docs/design.md §5)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco.algorithm import merge

# The hand-worked case used throughout: two learners, one 2-vector tensor.
#   Δ1 = [3, 4], ‖Δ1‖ = 5, φ(Δ1) = [0.6, 0.8];  Δ2 = [0, 2], ‖Δ2‖ = 2, φ(Δ2) = [0, 1];  w = (1, 3).
DELTA1 = [3.0, 4.0]
DELTA2 = [0.0, 2.0]
W = [1.0, 3.0]
# Weighted average: (1·[3, 4] + 3·[0, 2]) / 4 = [3, 10] / 4.
AVERAGE = np.array([0.75, 2.5])
# RDA: radius (1·5 + 3·2) / 4 = 2.75; direction sum 1·[0.6, 0.8] + 3·[0, 1] = [0.6, 3.8], whose norm
# is √(0.36 + 14.44) = √14.8; so Δ = 2.75 · [0.6, 3.8] / √14.8 ≈ [0.42890, 2.71634].
RDA = 2.75 * np.array([0.6, 3.8]) / np.sqrt(14.8)


def _stack(*rows):
  return jnp.asarray(np.array(rows, np.float32))


def test_weighted_average_by_hand():
  np.testing.assert_allclose(merge.weighted_average(_stack(DELTA1, DELTA2), W), AVERAGE, rtol=1e-6)


def test_rda_by_hand():
  got = merge.rda(_stack(DELTA1, DELTA2), W)
  np.testing.assert_allclose(got, RDA, rtol=1e-6)
  # Its length is the weighted mean of the learners' lengths, not the length of their mean
  # (‖[0.75, 2.5]‖ ≈ 2.61).
  assert np.linalg.norm(got) == pytest.approx(2.75, rel=1e-6)


def test_rda_norms_are_per_tensor_not_per_row():
  # Δ1 = [[3, 0], [0, 4]]: ‖Δ1‖ = 5 over the whole tensor, φ1 = [[0.6, 0], [0, 0.8]].
  # Δ2 = [[0, 2], [0, 0]]: ‖Δ2‖ = 2, φ2 = [[0, 1], [0, 0]]. w = (1, 1).
  # radius = (5 + 2) / 2 = 3.5; φ1 + φ2 = [[0.6, 1], [0, 0.8]], norm √(0.36 + 1 + 0.64) = √2.
  # (Per row, row 0 would instead get radius (3 + 2) / 2 = 2.5 in direction [1, 1] / √2.)
  delta_MxN = _stack([[3.0, 0.0], [0.0, 4.0]], [[0.0, 2.0], [0.0, 0.0]])
  expected = 3.5 * np.array([[0.6, 1.0], [0.0, 0.8]]) / np.sqrt(2.0)
  np.testing.assert_allclose(merge.rda(delta_MxN, [1.0, 1.0]), expected, rtol=1e-6)


def test_rda_with_three_learners_by_hand():
  # Δ = [2, 0], [0, 3], [0, 0] (norms 2, 3, 0; φ = [1, 0], [0, 1], 0) with w = (2, 1, 1):
  # radius = (2·2 + 1·3 + 1·0) / 4 = 7/4; direction ∝ 2·[1, 0] + 1·[0, 1] = [2, 1], norm √5.
  delta_MxN = _stack([2.0, 0.0], [0.0, 3.0], [0.0, 0.0])
  expected = 1.75 * np.array([2.0, 1.0]) / np.sqrt(5.0)
  np.testing.assert_allclose(merge.rda(delta_MxN, [2.0, 1.0, 1.0]), expected, rtol=1e-6)


def test_a_single_learner_is_its_own_merge():
  delta = np.array([[1.0, -2.0, 0.5]], np.float32)
  np.testing.assert_allclose(merge.rda(delta, [7.0]), delta[0], rtol=1e-6)
  np.testing.assert_allclose(merge.weighted_average(delta, [7.0]), delta[0], rtol=1e-6)


@pytest.mark.parametrize("merge_fn", [merge.rda, merge.weighted_average])
def test_one_learner_of_positive_weight_is_its_merge_bit_for_bit(merge_fn):
  """The identity outer step hands a lone learner's parameters back only if its Δ comes out of
  the merge unrounded: a radius, a norm and a division in float32 each move some values by an ulp
  (what made the one-learner identity run part from dp). Others of weight 0 change nothing."""
  rng = np.random.default_rng(0)
  delta_MxN = rng.standard_normal((3, 4096)).astype(np.float32) * np.float32(1e-3)
  for weights in ([0.0, 37.0, 0.0], [123.0, 0.0, 0.0]):
    alone = int(np.flatnonzero(weights)[0])
    assert merge.sole_learner(weights) == alone
    np.testing.assert_array_equal(merge_fn(delta_MxN, weights), delta_MxN[alone])
    np.testing.assert_array_equal(jax.jit(merge_fn)(delta_MxN, np.float32(weights)),
                                  delta_MxN[alone])
  assert merge.sole_learner([1.0, 2.0, 0.0]) is None and merge.sole_learner([0.0] * 3) is None
  # Two learners merge as before: the general rule, not either Δ.
  both = merge_fn(delta_MxN, [1.0, 2.0, 0.0])
  assert not np.array_equal(both, delta_MxN[0]) and not np.array_equal(both, delta_MxN[1])


def test_zero_norm_delta_counts_in_the_radius_but_has_no_direction():
  # Δ1 = [3, 4], Δ2 = 0, w = (1, 1): radius (5 + 0) / 2 = 2.5 along φ(Δ1) = [0.6, 0.8] -> [1.5, 2].
  got = merge.rda(_stack(DELTA1, [0.0, 0.0]), [1.0, 1.0])
  np.testing.assert_allclose(got, [1.5, 2.0], rtol=1e-6)


@pytest.mark.parametrize(
    "merge_fn, expected", [(merge.rda, RDA), (merge.weighted_average, AVERAGE)]
)
def test_a_learner_of_weight_zero_changes_nothing(merge_fn, expected):
  absent = [1e6, -1e6]  # whatever an absent learner holds, even garbage, weight 0 ignores it
  got = merge_fn(_stack(DELTA1, absent, DELTA2), [1.0, 0.0, 3.0])
  np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("merge_fn", [merge.rda, merge.weighted_average])
def test_all_weights_zero_gives_a_zero_update(merge_fn):
  got = merge_fn(_stack(DELTA1, DELTA2), [0.0, 0.0])
  assert np.all(np.isfinite(got))
  np.testing.assert_array_equal(got, [0.0, 0.0])


@pytest.mark.parametrize("merge_fn", [merge.rda, merge.weighted_average])
def test_all_deltas_zero_gives_a_zero_update(merge_fn):
  got = merge_fn(jnp.zeros((3, 4, 5)), [1.0, 2.0, 3.0])
  np.testing.assert_array_equal(got, np.zeros((4, 5)))


def test_gradients_stay_finite_at_zero():
  # jnp.where on both sides of every division: no NaN even where a norm or the weight sum is 0.
  def loss(delta_MxN, w_M):
    return jnp.sum(merge.rda(delta_MxN, w_M)) + jnp.sum(merge.weighted_average(delta_MxN, w_M))

  for w in ([1.0, 1.0], [0.0, 0.0]):
    grads = jax.grad(loss, argnums=(0, 1))(jnp.zeros((2, 3)), jnp.asarray(w))
    assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("num_learners", [1, 2, 4, 8, 16])
def test_rda_norm_is_invariant_to_num_learners(num_learners):
  # Random directions in 4096 dimensions are nearly orthogonal (cosines ~ 1/64), like the outer
  # gradients of different learners. All have norm 2: RDA keeps norm 2 for every M, while the plain
  # mean shrinks like 2/√M.
  rng = np.random.default_rng(num_learners)
  delta_MxN = rng.standard_normal((num_learners, 4096)).astype(np.float32)
  delta_MxN *= 2.0 / np.linalg.norm(delta_MxN, axis=1, keepdims=True)
  w_M = np.ones(num_learners, np.float32)
  assert np.linalg.norm(merge.rda(delta_MxN, w_M)) == pytest.approx(2.0, rel=1e-5)
  mean_norm = np.linalg.norm(merge.weighted_average(delta_MxN, w_M))
  assert mean_norm == pytest.approx(2.0 / np.sqrt(num_learners), rel=0.1)


def test_rda_from_summed_terms_equals_rda_of_the_stack():
  # RDA as an all-reduce: each learner sends its terms, the sum finishes the merge.
  rng = np.random.default_rng(0)
  stacked = {
      "layers/0/kernel": rng.standard_normal((3, 4, 5)).astype(np.float32),
      "layers/0/bias": rng.standard_normal((3, 5)).astype(np.float32),
  }
  stacked["layers/0/bias"][1] = 0.0  # a zero-norm tensor on one learner
  w_M = np.array([2.0, 0.5, 0.0], np.float32)  # and an absent learner
  terms = [
      merge.rda_terms({name: x[m] for name, x in stacked.items()}, w_M[m]) for m in range(3)
  ]
  got = merge.rda_from_terms(functools.reduce(merge.add_rda_terms, terms))
  expected = merge.rda(stacked, w_M)
  for name in stacked:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-7)


def test_rda_terms_of_one_learner_by_hand():
  # w = 3, Δ = [3, 4]: w‖Δ‖ = 15, w φ(Δ) = [1.8, 2.4].
  terms = merge.rda_terms({"t": jnp.asarray(DELTA1)}, 3.0)
  assert float(terms.w_norm["t"]) == pytest.approx(15.0)
  np.testing.assert_allclose(terms.w_phi["t"], [1.8, 2.4], rtol=1e-6)
  assert float(terms.w) == 3.0


def test_rda_from_terms_with_no_weight_is_zero():
  zero = merge.rda_terms({"t": jnp.asarray(DELTA1)}, 0.0)
  np.testing.assert_array_equal(merge.rda_from_terms(zero)["t"], [0.0, 0.0])


def test_learner_weights_are_tokens_squared_over_steps():
  tokens = [100, 200, 50, 0]
  steps = [4, 2, 0, 3]  # learner 2 never stepped, learner 3 saw no tokens
  # 100²/4 = 2500; 200²/2 = 20000 (twice the tokens, at 100 per step instead of 25: 8x); 0; 0.
  np.testing.assert_allclose(merge.learner_weights(tokens, steps, "tokens_sq_over_steps"),
                             [2500.0, 20000.0, 0.0, 0.0])
  np.testing.assert_allclose(merge.learner_weights(tokens, steps, "tokens"), [100, 200, 0, 0])
  np.testing.assert_allclose(merge.learner_weights(tokens, steps, "uniform"), [1, 1, 0, 1])


def test_learner_weights_are_float32_and_finite_for_large_counts():
  # 2^30 tokens over one step: the weight 2^60 fits float32 even though it is formed without
  # squaring first.
  w = merge.learner_weights([2**30], [1], "tokens_sq_over_steps")
  assert w.dtype == jnp.float32
  assert float(w[0]) == pytest.approx(2.0**60, rel=1e-6)


def test_merge_fragment_averages_the_embedding_and_uses_rda_elsewhere():
  deltas = {
      "embedder/embedding": _stack(DELTA1, DELTA2),
      "layers/0/mlp/kernel": _stack(DELTA1, DELTA2),
  }
  merged = merge.merge_fragment(deltas, W, "rda", average_names={"embedder/embedding"})
  np.testing.assert_allclose(merged["embedder/embedding"], AVERAGE, rtol=1e-6)
  np.testing.assert_allclose(merged["layers/0/mlp/kernel"], RDA, rtol=1e-6)

  averaged = merge.merge_fragment(deltas, W, rule="average")
  np.testing.assert_allclose(averaged["layers/0/mlp/kernel"], AVERAGE, rtol=1e-6)


def test_merge_works_under_jit_and_in_float32():
  deltas = {
      "embedder/embedding": _stack(DELTA1, DELTA2).astype(jnp.bfloat16),
      "layers/0/mlp/kernel": _stack(DELTA1, DELTA2).astype(jnp.bfloat16),
  }
  merge_jit = jax.jit(lambda d, w: merge.merge_fragment(
      d, w, "rda", average_names=frozenset({"embedder/embedding"})))
  merged = merge_jit(deltas, jnp.asarray(W))
  assert all(x.dtype == jnp.float32 for x in merged.values())
  # [3, 4] and [0, 2] are exact in bfloat16, so the hand values hold.
  np.testing.assert_allclose(merged["embedder/embedding"], AVERAGE, rtol=1e-6)
  np.testing.assert_allclose(merged["layers/0/mlp/kernel"], RDA, rtol=1e-6)


def test_outer_gradient_is_anchor_minus_local_in_float32():
  anchor = {"a": jnp.asarray([1.0, 2.0], jnp.bfloat16)}
  local = {"a": jnp.asarray([0.5, 3.0], jnp.float32)}
  delta = merge.outer_gradient(anchor, local)
  assert delta["a"].dtype == jnp.float32
  np.testing.assert_allclose(delta["a"], [0.5, -1.0])


def test_unknown_rules_name_the_config_field():
  with pytest.raises(ValueError, match=r"config\.merge\.rule='median'.*'rda', 'average'"):
    merge.merge_fragment({}, [1.0], rule="median")
  with pytest.raises(ValueError, match=r"config\.merge\.weighting='steps'.*tokens_sq_over_steps"):
    merge.learner_weights([1], [1], rule="steps")


def test_rda_sums_over_learners_without_reducing_the_learner_axis():
  """So that merges keep up: XLA:CPU reduces the major (learner) axis of an [M, ...] tensor
  with a stride of a whole tensor per element, 5-16 s for 2-4 learners' 2M-value tensors against
  10-80 ms for one add per learner. The merge program must hold no such reduction."""
  x_MxN = np.zeros((4, 64, 32), np.float32)
  hlo = jax.jit(lambda x, w: merge.rda({"t": x}, w)["t"]).lower(
      x_MxN, np.ones(4, np.float32)).compile().as_text()
  for line in hlo.splitlines():
    if " reduce(" in line and "dimensions={0}" in line:
      assert "f32[64,32]" not in line.split("=")[1].split("reduce(")[0], line


@pytest.mark.parametrize("rule, by_numpy", [
    ("none", lambda s: np.ones_like(s)),
    ("inverse", lambda s: 1.0 / (1.0 + s)),
    ("inverse_sqrt", lambda s: (1.0 + s) ** -0.5),
])
def test_staleness_scale_matches_its_rule(rule, by_numpy):
  staleness = np.asarray([0, 1, 2, 3, 7, 40], np.float32)
  got = merge.staleness_scale(staleness, rule)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, by_numpy(staleness.astype(np.float64)), rtol=1e-6)


def test_a_fresh_offer_keeps_its_full_step_and_one_anchored_ahead_counts_as_fresh():
  for rule in merge.STALENESS_SCALINGS:
    np.testing.assert_array_equal(merge.staleness_scale([0, -2], rule), [1.0, 1.0])


def test_staleness_scaling_shortens_the_rda_radius_but_not_the_direction():
  rng = np.random.default_rng(0)
  delta = rng.standard_normal((2, 5)).astype(np.float32)
  w = np.asarray([1.0, 3.0], np.float32)
  scale = np.asarray(merge.staleness_scale([0, 3], "inverse"))
  plain, scaled = merge.rda(delta, w), merge.rda(delta * scale[:, None], w)
  # Radius: Σ w s ‖Δ‖ / Σ w; the direction is unchanged by positive factors.
  norms = np.linalg.norm(delta, axis=1)
  np.testing.assert_allclose(np.linalg.norm(scaled), np.sum(w * scale * norms) / np.sum(w),
                             rtol=1e-5)
  np.testing.assert_allclose(scaled / np.linalg.norm(scaled), plain / np.linalg.norm(plain),
                             rtol=1e-5, atol=1e-6)


def test_unknown_staleness_scaling_names_the_config_field():
  with pytest.raises(ValueError, match=r"config\.outer\.staleness_scaling='linear'"):
    merge.staleness_scale([0], "linear")
