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
