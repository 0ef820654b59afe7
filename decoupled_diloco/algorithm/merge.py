"""Merge the learners' outer gradients of one fragment into one update (docs/design.md §5).

All functions are pure ``jnp`` code over pytrees, jittable, and work on a STACKED learner axis: the
outer gradients of M learners for one fragment are ``{name: array[M, ...]}`` and their weights
``w_M``. A learner that is absent from a round simply has weight 0 and changes nothing.

Everything is computed in float32 whatever the input dtype (docs/design.md §5: "Everything is
accumulated in float32"). Norms are taken over a whole tensor, not per row. Divisions by a weight
sum or a norm that may be 0 go through ``jnp.where`` on both sides, so neither the value nor its
gradient ever becomes NaN under jit.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

WEIGHTINGS = ("tokens_sq_over_steps", "tokens", "uniform")
MERGE_RULES = ("rda", "average")
# config.outer.staleness_scaling: the factor on a stale learner's outer gradient (`staleness_scale`).
STALENESS_SCALINGS = ("none", "inverse", "inverse_sqrt")

PyTree = Any


def learner_weights(tokens_M, steps_M, rule: str) -> jax.Array:
  """Per-learner merge weight from the counters accumulated since the fragment was last received.

  ``tokens_sq_over_steps`` (the paper's "quantity x quality"):
    w_m = c_tokens[m] * (c_tokens[m] / c_steps[m]) = c_tokens[m]^2 / c_steps[m],
  i.e. the tokens seen, times the tokens per step (a learner with a larger batch takes better
  steps).
  ``tokens``: w_m = c_tokens[m]. ``uniform``: w_m = 1.

  Every rule gives 0 to a learner with no steps (it has nothing to contribute) and the token rules
  also to one with no tokens.
  """
  if rule not in WEIGHTINGS:
    raise ValueError(f"config.merge.weighting={rule!r} must be one of {WEIGHTINGS}")
  tokens_M = jnp.asarray(tokens_M, jnp.float32)
  steps_M = jnp.asarray(steps_M, jnp.float32)
  stepped_M = steps_M > 0
  if rule == "uniform":
    return stepped_M.astype(jnp.float32)
  valid_M = stepped_M & (tokens_M > 0)
  if rule == "tokens":
    return jnp.where(valid_M, tokens_M, 0.0)
  # tokens * (tokens / steps) rather than tokens**2 / steps: same value, but the square of a large
  # token count is never formed.
  safe_steps_M = jnp.where(valid_M, steps_M, 1.0)
  return jnp.where(valid_M, tokens_M * (tokens_M / safe_steps_M), 0.0)


def staleness_scale(staleness_M, rule: str) -> jax.Array:
  """Per-learner factor on the outer gradient Δ_m, from its staleness s_m: how many versions of
  Θ_p were installed after the one the learner's offer is anchored at (0: anchored at the Θ_p the
  merge steps from).

    ``inverse``:       (1 + s_m)^-1     Staleness-aware async SGD (Zhang et al. 2016,
                                        arXiv 1511.05950): lr / τ, with τ = 1 + s counted from 1
                                        so that a fresh offer keeps its full step.
    ``inverse_sqrt``:  (1 + s_m)^-1/2   FedAsync's polynomial staleness function (Xie et al. 2019,
                                        arXiv 1903.03934) (1 + s)^-a with a = 1/2: a gentler one.
    ``none``:          1.

  Scaling Δ_m by the factor is each stale offer taking a shorter outer step, as in those papers'
  per-gradient learning rates: under RDA it shortens the merged length (the weighted mean of the
  lengths) and leaves the directions alone; under the weighted average it does both. The merge
  weights w_m stay what the counters say.
  """
  if rule not in STALENESS_SCALINGS:
    raise ValueError(
        f"config.outer.staleness_scaling={rule!r} must be one of {STALENESS_SCALINGS}")
  # An offer anchored ahead of Θ_p (a syncer that restored an older state) counts as fresh.
  staleness_M = jnp.maximum(jnp.asarray(staleness_M, jnp.float32), 0.0)
  if rule == "inverse":
    return 1.0 / (1.0 + staleness_M)
  if rule == "inverse_sqrt":
    return 1.0 / jnp.sqrt(1.0 + staleness_M)
  return jnp.ones_like(staleness_M)


def outer_gradient(anchor: PyTree, local: PyTree) -> PyTree:
  """Δ = anchor - θ_local, leaf by leaf, in float32.

  The anchor is the global value the learner started from (docs/design.md §5); Δ points from where
  the learner ended back to where it began, so it is used as a *gradient* by the outer optimizer.
  """
  return jax.tree.map(
      lambda a, x: jnp.asarray(a, jnp.float32) - jnp.asarray(x, jnp.float32), anchor, local
  )


def _safe_div(num, den):
  """num / den, and 0 where den == 0 (no NaN in the value or its gradient)."""
  nonzero = den != 0
  return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


def _norm(x) -> jax.Array:
  """Euclidean norm over the whole array, with a finite gradient at 0."""
  sq = jnp.sum(jnp.square(x))
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def _norms_M(x_MxN) -> jax.Array:
  """Per-learner norms over everything but the leading learner axis."""
  return jax.vmap(_norm)(x_MxN)


def _unit(x):
  """φ(x) = x / ‖x‖, with φ(0) = 0."""
  return _safe_div(x, _norm(x))


def _weighted_sum(w_M, x_MxN):
  # An explicit multiply-and-add rather than a tensordot: on TPU a float32 matmul may run at bf16
  # precision by default, and these sums are the very values the outer step is applied with. One
  # add per learner (M is static and small) rather than jnp.sum(axis=0): XLA:CPU reduces a major
  # axis with a stride of the whole tensor per element, measured 5-16 s for 2-4 learners' 2M-value
  # tensors against 10-80 ms this way, so that merges keep up with the learners.
  total = w_M[0] * x_MxN[0]
  for m in range(1, x_MxN.shape[0]):
    total = total + w_M[m] * x_MxN[m]
  return total


def _stacked_f32(delta_MxN: PyTree, w_M) -> tuple[PyTree, jax.Array]:
  return (
      jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), delta_MxN),
      jnp.asarray(w_M, jnp.float32),
  )


def sole_learner(w_M) -> int | None:
  """The one learner with a positive weight, if exactly one has (host values).

  Both rules then give that learner's Δ_m itself (RDA: radius ‖Δ_m‖ times φ(Δ_m); the average:
  w_m Δ_m / w_m), and the merges take it as it is: in float32 the radius, the norm and the
  division would each round, so that even the identity outer step (SGD, lr 1) would not give the
  learner's parameters back bit for bit.
  """
  positive = np.flatnonzero(np.asarray(w_M) > 0)
  return int(positive[0]) if positive.size == 1 else None


def _or_the_sole_learner(x_MxN, w_M, merged):
  """`merged`, or the one learner's Δ_m when only it has a positive weight (`sole_learner`),
  under jit: Σ_m [w_m > 0] Δ_m adds one value and zeros, exactly."""
  alone = (w_M > 0).astype(jnp.float32)
  return jnp.where(jnp.sum(alone) == 1, _weighted_sum(alone, x_MxN), merged)


def weighted_average(delta_MxN: PyTree, w_M) -> PyTree:
  """Δ = Σ_m w_m Δ_m / Σ_m w_m over the leading learner axis of every leaf; 0 when Σ w = 0.

  Used for the token-embedding fragment (docs/design.md §5), and as the "plain averaging" baseline.
  """
  delta_MxN, w_M = _stacked_f32(delta_MxN, w_M)
  w_sum = jnp.sum(w_M)
  return jax.tree.map(
      lambda x: _or_the_sole_learner(x, w_M, _safe_div(_weighted_sum(w_M, x), w_sum)), delta_MxN)


def _rda_leaf(x_MxN, w_M):
  w_sum = jnp.sum(w_M)
  radius = _safe_div(jnp.sum(w_M * _norms_M(x_MxN)), w_sum)
  direction = _safe_div(_weighted_sum(w_M, jax.vmap(_unit)(x_MxN)), w_sum)
  return _or_the_sole_learner(x_MxN, w_M, radius * _unit(direction))


def rda(delta_MxN: PyTree, w_M) -> PyTree:
  """Radial-Directional Averaging, per tensor (docs/design.md §5):

    Δ = (Σ_m w_m ‖Δ_m‖ / Σ_m w_m) · φ(Σ_m w_m φ(Δ_m) / Σ_m w_m),   φ(x) = x / ‖x‖, φ(0) = 0.

  The length is the weighted mean of the learners' lengths and the direction is the normalised
  weighted mean of their directions. Outer gradients of different learners are nearly orthogonal, so
  a plain mean shrinks like 1/√M and the outer learning rate would need retuning whenever M changes;
  RDA keeps the merged norm independent of M. All weights 0 gives a zero update.
  """
  delta_MxN, w_M = _stacked_f32(delta_MxN, w_M)
  return jax.tree.map(lambda x: _rda_leaf(x, w_M), delta_MxN)


class RdaTerms(NamedTuple):
  """One learner's additive contribution to RDA.

  Summed over the learners, the terms finish with ``rda_from_terms``: RDA is an all-reduce (or a
  running sum on the syncer) of these terms, so the syncer never needs all M outer gradients at
  once.

  Attributes:
    w_norm: w · ‖Δ‖ per tensor (a pytree of scalars).
    w_phi: w · φ(Δ) per tensor (a pytree shaped like Δ).
    w: the learner's weight (a scalar).
  """

  w_norm: PyTree
  w_phi: PyTree
  w: jax.Array


def rda_terms(delta_N: PyTree, w) -> RdaTerms:
  """The terms (w‖Δ‖, w φ(Δ), w) of ONE learner with outer gradient ``delta_N`` and weight ``w``."""
  w = jnp.asarray(w, jnp.float32)
  delta_N = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), delta_N)
  return RdaTerms(
      w_norm=jax.tree.map(lambda x: w * _norm(x), delta_N),
      w_phi=jax.tree.map(lambda x: w * _unit(x), delta_N),
      w=w,
  )


def add_rda_terms(a: RdaTerms, b: RdaTerms) -> RdaTerms:
  """Sum of two learners' (or partial sums of) RDA terms."""
  return jax.tree.map(jnp.add, a, b)


def rda_from_terms(sum_terms: RdaTerms) -> PyTree:
  """Finish RDA from terms summed over the learners:

    Δ = (Σ w‖Δ‖ / Σ w) · φ(Σ w φ(Δ)).

  φ(Σ w φ / Σ w) = φ(Σ w φ) because dividing by a positive scalar does not change a direction.
  """
  w_sum = jnp.asarray(sum_terms.w, jnp.float32)
  return jax.tree.map(
      lambda w_norm, w_phi: _safe_div(w_norm, w_sum) * _unit(w_phi),
      sum_terms.w_norm,
      sum_terms.w_phi,
  )


def merge_fragment(
    deltas: Mapping[str, Any],
    w_M,
    rule: str,
    average_names: Collection[str] = frozenset(),
) -> dict[str, jax.Array]:
  """Merge one fragment's stacked outer gradients ``{name: array[M, ...]}`` into ``{name: Δ}``.

  ``rule`` (``config.merge.rule``) is ``"rda"`` or ``"average"``. Names in ``average_names`` (the
  token embedding) always use the weighted average: the paper merges the embedding fragment by
  weighted average and all others by RDA (docs/design.md §5).
  """
  if rule not in MERGE_RULES:
    raise ValueError(f"config.merge.rule={rule!r} must be one of {MERGE_RULES}")
  merged = {}
  for name, delta_MxN in deltas.items():
    if rule == "average" or name in average_names:
      merged[name] = weighted_average(delta_MxN, w_M)
    else:
      merged[name] = rda(delta_MxN, w_M)
  return merged


# ---- The same rules from per-learner parts: the syncer's fused merge ------------------------------
#
# The syncer decodes each learner's outer gradient and takes its norm in one pass over the offer
# (runtime/core/fused_merge.py), so the rules below take the norms as given instead of reducing a
# stacked [M, ...] tensor again. They equal `rda` / `weighted_average` up to float32 rounding
# (tests/test_fused_merge.py): φ(Σ w φ(Δ_m) / Σ w) = φ(Σ (w / ‖Δ_m‖) Δ_m), since neither a
# positive factor nor the order of the divisions changes a direction.


def sum_of_squares(x) -> jax.Array:
  """Σ x², float32. Over a [R, C, 16] view where the size allows it: XLA:CPU then adds 16 lanes at
  a time, where a plain sum over a whole tensor to a scalar ran several times slower than reading
  it (a float sum may not be reordered, so it is not vectorised)."""
  x = jnp.asarray(x, jnp.float32)
  if x.size % 64:
    return jnp.sum(jnp.square(x))
  lanes = jnp.sum(jnp.square(x).reshape(-1, 4, 16), axis=1)
  return jnp.sum(jnp.sum(lanes, axis=1))


def _sum_in_order(c_M, x_M):
  """Σ_m c_m x_m, one add per learner in learner order (see `_weighted_sum`)."""
  total = c_M[0] * x_M[0]
  for m in range(1, len(x_M)):
    total = total + c_M[m] * x_M[m]
  return total


def rda_direction(x_M, w_M, norms_M, scale_M=None) -> tuple[jax.Array, jax.Array]:
  """RDA's two parts before the last normalisation: (Σ_m (w_m / ‖Δ_m‖) Δ_m, the radius
  Σ_m w_m s_m ‖Δ_m‖ / Σ_m w_m). `rda_from_norms` finishes them."""
  w_M = jnp.asarray(w_M, jnp.float32)
  norms_M = jnp.asarray(norms_M, jnp.float32)
  lengths_M = norms_M if scale_M is None else norms_M * jnp.asarray(scale_M, jnp.float32)
  radius = _safe_div(jnp.sum(w_M * lengths_M), jnp.sum(w_M))
  return _sum_in_order(_safe_div(w_M, norms_M), x_M), radius


def rda_finish(direction, radius) -> jax.Array:
  """radius · φ(direction)."""
  return direction * _safe_div(radius, _sqrt0(sum_of_squares(direction)))


def rda_from_norms(x_M, w_M, norms_M, scale_M=None) -> jax.Array:
  """RDA of one tensor (`rda`) from the learners' outer gradients ``x_M`` (a sequence of arrays)
  and their norms ‖Δ_m‖, with each Δ_m optionally scaled by ``scale_M`` (`staleness_scale`):

    Δ = (Σ_m w_m s_m ‖Δ_m‖ / Σ_m w_m) · φ(Σ_m (w_m / ‖Δ_m‖) Δ_m).

  A scale shortens the learner's length and leaves its direction alone, as scaling Δ_m before
  `rda` does. A learner with ‖Δ_m‖ = 0 or w_m = 0 adds nothing.
  """
  return rda_finish(*rda_direction(x_M, w_M, norms_M, scale_M))


def average_from_parts(x_M, w_M, scale_M=None) -> jax.Array:
  """`weighted_average` of one tensor from the learners' outer gradients ``x_M`` (a sequence),
  each optionally scaled by ``scale_M``: Δ = Σ_m w_m s_m Δ_m / Σ_m w_m."""
  w_M = jnp.asarray(w_M, jnp.float32)
  c_M = w_M if scale_M is None else w_M * jnp.asarray(scale_M, jnp.float32)
  return _safe_div(_sum_in_order(c_M, x_M), jnp.sum(w_M))


def _sqrt0(sq):
  """√sq with a finite gradient at 0 (as `_norm`)."""
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)
