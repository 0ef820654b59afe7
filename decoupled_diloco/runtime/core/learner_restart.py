"""Where a learner starts: at step 0, or again where another stopped (a host snapshot's restore).

A snapshot (`LearnerSnapshot`, runtime/core/learner_state.py) is taken of a stopped learner, for a
checkpoint or a peer's rejoin; the next incarnation (`Learner.respawn`), a rejoiner or a resumed run
places it on its own mesh. These functions work on the learner's own state, as its methods would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from decoupled_diloco.lm import inner
from decoupled_diloco.runtime.core.agreement import host_array
from decoupled_diloco.runtime.core.learner_state import LearnerSnapshot

# pylint: disable=protected-access


def fresh(learner: Any, state: inner.TrainState) -> None:
  """`learner` starts at step 0 from `state`: nothing to merge yet, its anchors that state's
  parameters (Theta_p at version 0)."""
  num_fragments = len(learner._fragments)
  learner._state = state
  learner._counter_steps = np.zeros(num_fragments, np.int64)
  learner._counter_tokens = np.zeros(num_fragments, np.int64)
  learner._since = np.zeros(num_fragments, np.int64)
  host = learner._layout.to_flat(jax.tree.map(host_array, state.params))
  learner._anchors = {name: np.asarray(v, np.float32) for name, v in host.items()}
  learner._anchor_versions = np.zeros(num_fragments, np.int64)


def snapshot(learner: Any) -> LearnerSnapshot:
  """Host copy of the whole state of `learner`, whose thread is not running."""
  if learner._thread.is_alive():
    raise RuntimeError(f"learner {learner.index}: snapshot() needs the learner stopped first")
  return LearnerSnapshot(
      step=learner.step,
      train_state=jax.device_get(learner._state),
      data_state=learner._batches.get_state() if hasattr(learner._batches, "get_state") else None,
      counter_steps=learner._counter_steps.copy(),
      counter_tokens=learner._counter_tokens.copy(),
      since=learner._since.copy(),
      anchors=dict(learner._anchors),
      anchor_versions=learner._anchor_versions.copy(),
  )


def restore(learner: Any, snapshot: LearnerSnapshot, like: inner.TrainState) -> None:
  """Places `snapshot`'s state (with the shardings of `like`), counters and anchors on `learner`,
  and its loader where the snapshot's data stood; its step is the snapshot's."""
  shardings = jax.tree.map(lambda x: x.sharding, like)
  # In the state's own dtypes: a rejoiner's parameters are Theta, float32 whatever param_dtype.
  host = jax.tree.map(lambda x, l: np.asarray(x, l.dtype), snapshot.train_state, like)
  learner._state = jax.device_put(host, shardings)
  if snapshot.data_state is not None:
    learner._batches.set_state(snapshot.data_state)
  learner._counter_steps = snapshot.counter_steps.copy()
  learner._counter_tokens = snapshot.counter_tokens.copy()
  learner._since = snapshot.since.copy()
  learner._anchors = dict(snapshot.anchors)
  learner._anchor_versions = snapshot.anchor_versions.copy()


def respawn(learner: Any, snapshot: LearnerSnapshot, train_step: Callable | None) -> Any:
  """The next incarnation of the failed `learner` (a `Learner`), from `snapshot`; not started."""
  if learner.alive:
    raise RuntimeError(f"learner {learner.index}: respawn() needs the failed learner stopped")
  return type(learner)(
      learner.index, train_step=train_step or learner._train_step, state=learner._like,
      param_shardings=learner._shardings, batches=learner._batches, fragments=learner._fragments,
      options=learner._options, syncer=learner._syncer, metrics=learner._metrics,
      snapshot=snapshot, step_hook=learner._step_hook, layout=learner._layout,
      incarnation=learner.incarnation + 1, peer_repairing=learner._peer_repairing,
      turns=learner._turns)
