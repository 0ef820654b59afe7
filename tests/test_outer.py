"""Tests for decoupled_diloco.algorithm.outer: Θ_p ← OuterOpt(Θ_p, Δ) (docs/design.md §5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco.algorithm import merge, outer


def _run(tx, theta, deltas):
  state = tx.init(theta)
  for delta in deltas:
    theta, state = outer.outer_step(tx, theta, state, delta)
  return theta


def test_sgd_lr_one_without_momentum_adopts_the_learner_params():
  # Δ = Θ - θ_local used as a gradient: Θ - 1·Δ = θ_local.
  theta = {"w": jnp.asarray([1.0, -2.0, 3.0]), "b": jnp.asarray(0.5)}
  local = {"w": jnp.asarray([1.5, -2.25, 0.0]), "b": jnp.asarray(-1.0)}
  delta = merge.outer_gradient(theta, local)
  # The same through the merge of a single learner (any weight).
  delta = merge.merge_fragment({k: v[None] for k, v in delta.items()}, jnp.asarray([4.0]), "rda")
  tx = outer.make_outer_optimizer("sgd", learning_rate=1.0, momentum=0.0)
  new_theta = _run(tx, theta, [delta])
  for name in theta:
    np.testing.assert_allclose(new_theta[name], local[name], rtol=1e-6)


def test_nesterov_momentum_over_two_steps_by_hand():
  # lr 0.7, μ 0.9, Θ0 = [1, -2], Δ1 = [0.5, 1], Δ2 = [-1, 0.25].
  # Nesterov SGD: m ← Δ + μ m;  Θ ← Θ - lr (Δ + μ m).
  # Step 1: m1 = [0.5, 1]; Δ1 + 0.9 m1 = [0.95, 1.9]; Θ1 = [1 - 0.665, -2 - 1.33] = [0.335, -3.33].
  # Step 2: m2 = [-1 + 0.45, 0.25 + 0.9] = [-0.55, 1.15];
  #         Δ2 + 0.9 m2 = [-1 - 0.495, 0.25 + 1.035] = [-1.495, 1.285];
  #         Θ2 = [0.335 + 1.0465, -3.33 - 0.8995] = [1.3815, -4.2295].
  tx = outer.make_outer_optimizer("sgd_nesterov", learning_rate=0.7, momentum=0.9)
  theta = {"w": jnp.asarray([1.0, -2.0])}
  deltas = [{"w": jnp.asarray([0.5, 1.0])}, {"w": jnp.asarray([-1.0, 0.25])}]
  state = tx.init(theta)
  theta, state = outer.outer_step(tx, theta, state, deltas[0])
  np.testing.assert_allclose(theta["w"], [0.335, -3.33], rtol=1e-6)
  theta, state = outer.outer_step(tx, theta, state, deltas[1])
  np.testing.assert_allclose(theta["w"], [1.3815, -4.2295], rtol=1e-6)


def test_diloco_nesterov_07_09_by_hand():
  # One step from Θ = 0 with Δ = 1: Θ1 = -0.7 · (1 + 0.9 · 1) = -1.33.
  tx = outer.make_outer_optimizer("sgd_nesterov", learning_rate=0.7, momentum=0.9)
  np.testing.assert_allclose(_run(tx, jnp.zeros(2), [jnp.ones(2)]), [-1.33, -1.33], rtol=1e-6)


def test_heavy_ball_sgd_by_hand():
  # lr 0.1, μ 0.5, Θ0 = 1, Δ = 1 twice: m1 = 1, Θ1 = 1 - 0.1 = 0.9;
  # m2 = 1 + 0.5 · 1 = 1.5, Θ2 = 0.9 - 0.15 = 0.75.
  tx = outer.make_outer_optimizer("sgd", learning_rate=0.1, momentum=0.5)
  np.testing.assert_allclose(_run(tx, jnp.asarray(1.0), [jnp.asarray(1.0)] * 2), 0.75, rtol=1e-6)


def test_adam_first_step_moves_each_parameter_by_the_learning_rate():
  # Bias-corrected Adam's first update is lr · Δ / (|Δ| + eps) ≈ lr · sign(Δ).
  tx = outer.make_outer_optimizer("adam", learning_rate=0.1, momentum=0.9)
  got = _run(tx, jnp.zeros(3), [jnp.asarray([2.0, -3.0, 0.5])])
  np.testing.assert_allclose(got, [-0.1, 0.1, -0.1], rtol=1e-5)


def test_outer_step_is_jittable():
  tx = outer.make_outer_optimizer("sgd_nesterov", learning_rate=0.7, momentum=0.9)
  theta = {"w": jnp.asarray([1.0, -2.0])}
  delta = {"w": jnp.asarray([0.5, 1.0])}
  step = jax.jit(lambda th, s, d: outer.outer_step(tx, th, s, d))
  got, _ = step(theta, tx.init(theta), delta)
  # Θ1 = Θ0 - 0.7 · 1.9 · Δ = [1 - 0.665, -2 - 1.33].
  np.testing.assert_allclose(got["w"], [0.335, -3.33], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"name": "lion"}, r"config\.outer\.name='lion'.*sgd_nesterov"),
        ({"learning_rate": 0.0}, r"config\.outer\.learning_rate=0\.0"),
        ({"learning_rate": -1.0}, r"config\.outer\.learning_rate=-1\.0"),
        ({"momentum": 1.0}, r"config\.outer\.momentum=1\.0.*\[0, 1\)"),
        ({"momentum": -0.1}, r"config\.outer\.momentum=-0\.1"),
    ],
)
def test_bad_settings_name_the_config_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    outer.make_outer_optimizer(**{"name": "sgd_nesterov", "learning_rate": 0.7, "momentum": 0.9,
                                  **kwargs})


def _delayed_nesterov_by_numpy(theta, deltas, lr, mu, n):
  """Algorithm 3 of arXiv 2401.09135 (momentum activation c = 0), written out in numpy."""
  theta = np.asarray(theta, np.float64)
  m, acc = np.zeros_like(theta), np.zeros_like(theta)
  for t, g in enumerate(deltas, 1):
    g = np.asarray(g, np.float64)
    acc = acc + g
    if t % n == 0:
      m = mu * m + acc / n
      theta = theta - lr * (g / n + mu * m)
      acc = np.zeros_like(acc)
    else:
      theta = theta - lr * g / n
  return theta


def _deltas(count, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(3).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_delayed_nesterov_matches_the_papers_algorithm_over_several_steps(n):
  deltas = _deltas(11)
  tx = outer.make_outer_optimizer("sgd_nesterov", 0.7, 0.9, nesterov_delay=n)
  theta = {"w": jnp.asarray([1.0, -2.0, 0.5])}
  state = tx.init(theta)
  for t, delta in enumerate(deltas, 1):
    theta, state = outer.outer_step(tx, theta, state, {"w": jnp.asarray(delta)})
    np.testing.assert_allclose(
        theta["w"], _delayed_nesterov_by_numpy([1.0, -2.0, 0.5], deltas[:t], 0.7, 0.9, n),
        rtol=1e-5, atol=1e-6)
  assert int(state[0].count) == len(deltas)


def test_delayed_nesterov_touches_the_momentum_only_every_nth_step():
  # A buffer updated every step (plain Nesterov on g / N, or m ← μ m + g / N each step) would
  # already differ after the second step; Delayed Nesterov leaves m at 0 until step N.
  n, deltas = 4, _deltas(9, seed=1)
  tx = outer.make_outer_optimizer("sgd_nesterov", 0.7, 0.9, nesterov_delay=n)
  theta = {"w": jnp.zeros(3)}
  state = tx.init(theta)
  every_step = np.zeros(3)
  for t, delta in enumerate(deltas, 1):
    theta, state = outer.outer_step(tx, theta, state, {"w": jnp.asarray(delta)})
    every_step = 0.9 * every_step + delta / n
    momentum = np.asarray(state[0].momentum["w"])
    if t < n:
      np.testing.assert_array_equal(momentum, 0.0)
    if t > 1:
      assert not np.allclose(momentum, every_step, rtol=1e-3)
  expected = _delayed_nesterov_by_numpy(np.zeros(3), deltas, 0.7, 0.9, n)
  np.testing.assert_allclose(theta["w"], expected, rtol=1e-5, atol=1e-6)
  # ... and the outer steps are not plain Nesterov's either.
  plain = _run(outer.make_outer_optimizer("sgd_nesterov", 0.7, 0.9), jnp.zeros(3),
               [jnp.asarray(d) for d in deltas])
  assert not np.allclose(plain, expected, rtol=1e-3)


def test_delayed_nesterov_over_n_steps_is_one_nesterov_step_on_their_average():
  n, deltas = 3, _deltas(3, seed=2)
  tx = outer.make_outer_optimizer("sgd_nesterov", 0.7, 0.9, nesterov_delay=n)
  got = _run(tx, jnp.zeros(3), [jnp.asarray(d) for d in deltas])
  nesterov = outer.make_outer_optimizer("sgd_nesterov", 0.7, 0.9)
  once = _run(nesterov, jnp.zeros(3), [jnp.asarray(np.mean(deltas, axis=0))])
  np.testing.assert_allclose(got, once, rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_is_jittable():
  tx = outer.make_outer_optimizer("sgd_nesterov", 0.7, 0.9, nesterov_delay=2)
  step = jax.jit(lambda th, s, d: outer.outer_step(tx, th, s, d))
  theta, state = jnp.zeros(3), tx.init(jnp.zeros(3))
  for delta in _deltas(4, seed=3):
    theta, state = step(theta, state, jnp.asarray(delta))
  np.testing.assert_allclose(
      theta, _delayed_nesterov_by_numpy(np.zeros(3), _deltas(4, seed=3), 0.7, 0.9, 2),
      rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"nesterov_delay": 1}, r"config\.outer\.nesterov_delay=1 must be 0 \(off\) or"),
        ({"nesterov_delay": -2}, r"config\.outer\.nesterov_delay=-2"),
        ({"nesterov_delay": 4, "name": "adam"},
         r"config\.outer\.nesterov_delay=4 needs config\.outer\.name='sgd_nesterov'"),
    ],
)
def test_bad_nesterov_delay_names_the_config_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    outer.make_outer_optimizer(**{"name": "sgd_nesterov", "learning_rate": 0.7, "momentum": 0.9,
                                  **kwargs})
