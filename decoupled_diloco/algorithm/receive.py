"""What a learner does with its fragment p when the merged Θ_p arrives (docs/design.md §5).

- overwrite (the paper, α = 0): θ_p ← Θ_p. The steps the learner made since the offer the merge
  took are dropped.
- keep in-flight progress: θ_p ← θ_now + (Θ_p − θ_offered), so no step is lost. Progress is relative
  to an anchor, and the offer's anchor A_o may be older than the learner's anchor A now (a merge
  without this learner was received since): then θ_p ← θ_now + ((Θ_p − A + A_o) − θ_offered). When
  no offer of its steps is in the merge, θ_offered is the anchor A itself: all of them are kept.
- Streaming DiLoCo's mix (arXiv 2501.18512), after either: θ_p ← α·θ_now + (1 − α)·θ_p.

Θ_p is float32; bfloat16 weights (config.model.param_dtype) stay bfloat16. Which rule applies, and
what happens to the step counters, is the learner's bookkeeping (runtime/core/learner.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _as_merged(offered, anchor):
  """θ_offered as the merge saw it: A_o − Δ with Δ = A_o − θ_offered rounded to float32, as the
  syncer computes the outer gradient. An outer step that hands the offer back (the identity: SGD
  at lr 1, one learner) gives exactly this, and not always θ_offered itself (where the step from
  A_o is not small against the value, e.g. a weight crossing zero)."""
  offered = jnp.asarray(offered, jnp.float32)
  if anchor is None:
    return offered
  # The barrier keeps a compiler from folding A - (A - x) into x, which is not the same in float32.
  return anchor - jax.lax.optimization_barrier(anchor - offered)


@jax.jit
def _rebase(merged, now, offered, anchor):
  """θ_now + (Θ − θ_offered): what the learner holds, moved by what the merge changed in its offer.

  The same as Θ + (θ_now − θ_offered) in reals, and better in float32: the rounding falls on the
  merge's (small) correction rather than on the whole value, and a merge that gave the offer back
  unchanged (the identity outer step) leaves θ_now exactly as it is."""
  return now + (merged - _as_merged(offered, anchor))


@jax.jit
def _mix(local, merged, alpha):
  return alpha * local + (1.0 - alpha) * merged


def receive(theta: np.ndarray, now: jax.Array, *, alpha: float, sharding: jax.sharding.Sharding,
            offered: Any = None, offer_anchor: np.ndarray | None = None,
            anchors: tuple[np.ndarray, np.ndarray] | None = None,
            gather: Callable[[Any], np.ndarray] | None = None) -> jax.Array:
  """The new value of one flat tensor of fragment p, placed on `sharding` in `now`'s dtype.

  theta: Θ_p's tensor (float32, on the host); now: the learner's tensor θ_now.
  offered: None overwrites; else keeps in-flight progress against θ_offered (the offer's tensor,
    or the anchor A when no offer of this learner is in the merge).
  offer_anchor: the offer's anchor A_o, when `offered` is the offer's tensor: θ_offered is then
    taken as the merge saw it (`_as_merged`).
  anchors: (A, A_o), the anchor now and the offer's, when they differ (see the module docstring).
  alpha: Streaming DiLoCo's mix; 0 = none.
  gather: copies an array to the host. Given (after the last step: the state is complete and the
    devices idle), the keep is computed on the host in float32, which compiles nothing; a device
    program would be compiled once per tensor shape and learner, for a handful of uses.
  """
  if anchors is not None:
    theta = theta - anchors[0] + anchors[1]
  if offered is None:
    merged = jax.device_put(theta, sharding)
  elif gather is not None:
    now_host = np.asarray(gather(now), np.float32)
    seen = np.asarray(gather(offered), np.float32)
    if offer_anchor is not None:
      seen = offer_anchor - (offer_anchor - seen)
    merged = jax.device_put(now_host + (theta - seen), sharding)
  else:
    merged = _rebase(jax.device_put(theta, sharding), now, jax.device_put(offered, sharding),
                     None if offer_anchor is None else jax.device_put(offer_anchor, sharding))
  if alpha:
    merged = _mix(now, merged, jnp.float32(alpha))
  return merged.astype(now.dtype) if merged.dtype != now.dtype else merged


def lower_merge_programs(like: jax.ShapeDtypeStruct, *, keep_in_flight_progress: bool,
                         alpha: float) -> dict[str, Any]:
  """The programs `receive` runs on the devices for one flat tensor placed like `like`, lowered:
  the rebase that keeps in-flight progress (config.merge.keep_in_flight_progress) and Streaming
  DiLoCo's mix (config.merge.alpha). Overwrite runs neither. For ahead-of-time compiles
  (runtime/tpu_aot.py)."""
  theta = jax.ShapeDtypeStruct(like.shape, jnp.float32, sharding=like.sharding)
  programs = {}
  if keep_in_flight_progress:
    programs["rebase"] = _rebase.lower(theta, like, theta, theta)
  if alpha:
    programs["mix"] = _mix.lower(like, theta, jnp.float32(alpha))
  return programs
