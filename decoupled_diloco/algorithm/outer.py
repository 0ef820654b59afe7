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
"""

from __future__ import annotations

from typing import Any

import optax

OPTIMIZERS = ("sgd_nesterov", "sgd", "adam")


def make_outer_optimizer(
    name: str,
    learning_rate: float | optax.Schedule,
    momentum: float,
) -> optax.GradientTransformation:
  """The outer optimizer as an optax transformation.

  - ``sgd_nesterov``: m ← Δ + μ m;  Θ ← Θ - lr (Δ + μ m)   (optax.sgd with nesterov=True).
  - ``sgd``: m ← Δ + μ m;  Θ ← Θ - lr m   (heavy-ball; μ = 0 is plain SGD).
  - ``adam``: optax.adam with b1 = μ (the momentum plays the role of the first-moment decay).

  Args:
    name: ``config.outer.name``, one of ``OPTIMIZERS``.
    learning_rate: ``config.outer.learning_rate``, > 0, or an optax schedule of the outer step
      count.
    momentum: ``config.outer.momentum``, in [0, 1).
  """
  if name not in OPTIMIZERS:
    raise ValueError(f"config.outer.name={name!r} must be one of {OPTIMIZERS}")
  if not callable(learning_rate) and not learning_rate > 0:
    raise ValueError(
        f"config.outer.learning_rate={learning_rate!r} must be > 0 (or an optax schedule)"
    )
  if not 0 <= momentum < 1:
    raise ValueError(f"config.outer.momentum={momentum!r} must be in [0, 1)")
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
