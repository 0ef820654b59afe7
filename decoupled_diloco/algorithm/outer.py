"""The outer optimizer: Θ_p ← OuterOpt(Θ_p, Δ) per fragment (docs/design.md §5).

The merged outer gradient Δ = anchor - θ_local is fed to an ordinary optax transformation as if it
were a gradient. With SGD at learning rate 1 and no momentum this gives Θ - Δ = θ_local: the
learner's parameters are adopted as they are. DiLoCo (arXiv 2311.08105) uses SGD with Nesterov
momentum, lr 0.7, momentum 0.9; Decoupled DiLoCo keeps that optimizer and did not publish its
values. The defaults (experiments/tiny_cpu.py) keep SGD-Nesterov at lr 0.7 but with momentum 0.3:
0.9 overshoots at this framework's scale (docs/design.md §5).

The caller keeps one optimizer state per fragment (``tx.init`` on each fragment's dict), so a
fragment's momentum only ever sees that fragment's updates, whatever order the fragments are synced
in.

Asynchrony: Asynchronous Local-SGD (Liu et al. 2024, arXiv 2401.09135) finds that Nesterov momentum
on the global parameters is what stale outer gradients hurt, and folds them into the momentum only
once every N server updates (`delayed_nesterov`, ``config.outer.nesterov_delay``); off by default.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = ("sgd_nesterov", "sgd", "adam")


class DelayedNesterovState(NamedTuple):
  """The state of `delayed_nesterov` on one fragment's tensors."""

  count: jax.Array  # outer steps taken (int32)
  momentum: Any  # m, changed only on every N-th step
  accumulated: Any  # the sum of the outer gradients since m last changed


def delayed_nesterov(momentum: float, delay: int) -> optax.GradientTransformation:
  """Delayed Nesterov momentum (DN): Algorithm 3 of Asynchronous Local-SGD (Liu et al. 2024,
  arXiv 2401.09135) with its momentum activation c = 0 (the paper's default), before the learning
  rate. For the t-th outer gradient g_t (t = 1, 2, ...), with μ = ``momentum`` and N = ``delay``:

    A ← A + g_t
    t mod N = 0:   m ← μ m + A / N;   d_t = g_t / N + μ m;   A ← 0
    otherwise:     m unchanged;       d_t = g_t / N

  and the caller's learning rate makes the step Θ ← Θ - lr · d_t. Between momentum updates the
  stale outer gradients are applied plainly (each at 1/N); over N steps the total equals one
  Nesterov step on their average, so momentum accelerates a direction averaged over N updates
  rather than every stale one. N = 1 is optax's Nesterov SGD (m ← g + μ m; d = g + μ m).

  Args:
    momentum: μ, ``config.outer.momentum``.
    delay: N, ``config.outer.nesterov_delay`` (>= 1).
  """
  if delay < 1:
    raise ValueError(f"config.outer.nesterov_delay={delay!r} must be >= 1 here")

  def init_fn(params):
    return DelayedNesterovState(
        count=jnp.zeros([], jnp.int32),
        momentum=jax.tree.map(jnp.zeros_like, params),
        accumulated=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    folds = count % delay == 0  # this step's momentum update (a traced scalar under jit)
    accumulated = jax.tree.map(jnp.add, state.accumulated, updates)
    new_momentum = jax.tree.map(
        lambda m, a: jnp.where(folds, momentum * m + a / delay, m), state.momentum, accumulated)
    directions = jax.tree.map(
        lambda g, m: g / delay + jnp.where(folds, momentum * m, jnp.zeros_like(m)),
        updates, new_momentum)
    accumulated = jax.tree.map(lambda a: jnp.where(folds, jnp.zeros_like(a), a), accumulated)
    return directions, DelayedNesterovState(count, new_momentum, accumulated)

  return optax.GradientTransformation(init_fn, update_fn)


def make_outer_optimizer(
    name: str,
    learning_rate: float | optax.Schedule,
    momentum: float,
    nesterov_delay: int = 0,
) -> optax.GradientTransformation:
  """The outer optimizer as an optax transformation.

  - ``sgd_nesterov``: m ← Δ + μ m;  Θ ← Θ - lr (Δ + μ m)   (optax.sgd with nesterov=True); with
    ``nesterov_delay`` N >= 2, `delayed_nesterov` then the learning rate instead.
  - ``sgd``: m ← Δ + μ m;  Θ ← Θ - lr m   (heavy-ball; μ = 0 is plain SGD).
  - ``adam``: optax.adam with b1 = μ (the momentum plays the role of the first-moment decay).

  Args:
    name: ``config.outer.name``, one of ``OPTIMIZERS``.
    learning_rate: ``config.outer.learning_rate``, > 0, or an optax schedule of the outer step
      count.
    momentum: ``config.outer.momentum``, in [0, 1).
    nesterov_delay: ``config.outer.nesterov_delay``: 0 (off) or N >= 2, with ``sgd_nesterov``
      only.
  """
  if name not in OPTIMIZERS:
    raise ValueError(f"config.outer.name={name!r} must be one of {OPTIMIZERS}")
  if not callable(learning_rate) and not learning_rate > 0:
    raise ValueError(
        f"config.outer.learning_rate={learning_rate!r} must be > 0 (or an optax schedule)"
    )
  if not 0 <= momentum < 1:
    raise ValueError(f"config.outer.momentum={momentum!r} must be in [0, 1)")
  if isinstance(nesterov_delay, bool) or not isinstance(nesterov_delay, int) or not (
      nesterov_delay == 0 or nesterov_delay >= 2):
    raise ValueError(f"config.outer.nesterov_delay={nesterov_delay!r} must be 0 (off) or an "
                     "integer >= 2 (1 would be plain Nesterov)")
  if nesterov_delay and name != "sgd_nesterov":
    raise ValueError(f"config.outer.nesterov_delay={nesterov_delay!r} needs "
                     f"config.outer.name='sgd_nesterov' (not {name!r}); 0 turns it off")
  if nesterov_delay:
    return optax.chain(delayed_nesterov(momentum, nesterov_delay),
                       optax.scale_by_learning_rate(learning_rate))
  if name == "sgd_nesterov":
    return optax.sgd(learning_rate, momentum=momentum, nesterov=True)
  if name == "sgd":
    # optax.sgd skips the momentum trace entirely when momentum is None: no state to carry.
    return optax.sgd(learning_rate, momentum=momentum or None)
  return optax.adam(learning_rate, b1=momentum)


def outer_step(
    tx: optax.GradientTransformation, theta: Any, opt_state: Any, delta: Any
) -> tuple[Any, Any]:
  """One outer step on a fragment: updates, s ← tx.update(Δ, s, Θ);  Θ ← Θ + updates.

  Pure and jittable; returns the new (Θ, s).
  """
  updates, opt_state = tx.update(delta, opt_state, theta)
  return optax.apply_updates(theta, updates), opt_state
