"""What a checkpoint of the running job holds, and how learners start again from one.

`job_cut` turns the syncer's consistent cut (`Syncer.request_cut`; in dp mode the one learner's
latest publication, consistent by itself) into a `checkpoints.JobCut`, adding the run's history so
far: steps made and fragment-steps discarded per learner over every incarnation, faults, failures,
evaluations and seconds. A resumed run adds its own to that history, so its summary describes the
whole run (`tokens_trained` equals the uninterrupted run's: the steps made after the cut and
before the stop are not counted, the resumed run makes them again).

`learner_snapshot` rebuilds a learner's state from a cut. A learner absent from the cut (it had
failed and was waiting for its repair) starts as a rejoining learner does (docs/design.md §6): a
peer's train state, the syncer's Theta with its versions, counters at 0, and its own data position.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from decoupled_diloco.lm import inner
from decoupled_diloco.runtime.core import learner_state
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.records import checkpoints


def learner_cut(index: int, incarnation: int, publication: messages.Publication,
                ) -> checkpoints.LearnerCut:
  return checkpoints.LearnerCut(
      index=index, incarnation=incarnation, step=publication.step,
      params=dict(publication.params), opt_state=publication.opt_state,
      state_step=publication.state_step, since=publication.since,
      counter_steps=publication.counter_steps, counter_tokens=publication.counter_tokens,
      anchor_versions=publication.anchor_versions, anchors=dict(publication.anchors),
      data_state=publication.data_state)


def learner_snapshot(cut: checkpoints.LearnerCut, like: inner.TrainState
                     ) -> learner_state.LearnerSnapshot:
  """The snapshot a learner object restores from (host arrays; `like` gives the optimizer
  state's structure)."""
  opt_state = cut.opt_state
  if isinstance(opt_state, list):  # read back from disk: the leaves in order
    opt_state = jax.tree.unflatten(jax.tree.structure(like.opt_state), opt_state)
  return learner_state.LearnerSnapshot(
      step=int(cut.step),
      train_state=inner.TrainState(params=dict(cut.params), opt_state=opt_state,
                                   step=np.asarray(cut.state_step)),
      data_state=cut.data_state,
      counter_steps=np.asarray(cut.counter_steps, np.int64).copy(),
      counter_tokens=np.asarray(cut.counter_tokens, np.int64).copy(),
      since=np.asarray(cut.since, np.int64).copy(),
      anchors={n: np.asarray(v, np.float32) for n, v in cut.anchors.items()},
      anchor_versions=np.asarray(cut.anchor_versions, np.int64).copy())


def rejoin_cut(index: int, incarnation: int, peer: checkpoints.LearnerCut,
               theta_native: dict[str, np.ndarray], theta_flat: dict[str, np.ndarray],
               versions: np.ndarray, data_state: bytes | None) -> checkpoints.LearnerCut:
  """A learner absent from a cut, started as a rejoining one: the peer's optimizer state and
  step, Theta as parameters and anchors, counters at 0."""
  num_fragments = len(versions)
  return checkpoints.LearnerCut(
      index=index, incarnation=incarnation, step=peer.step, params=dict(theta_native),
      opt_state=peer.opt_state, state_step=peer.state_step,
      since=np.full(num_fragments, peer.step, np.int64),
      counter_steps=np.zeros(num_fragments, np.int64),
      counter_tokens=np.zeros(num_fragments, np.int64),
      anchor_versions=np.asarray(versions, np.int64), anchors=dict(theta_flat),
      data_state=data_state)


def empty_history(num_learners: int) -> dict[str, Any]:
  """The history of a run that starts afresh."""
  zeros = [0] * num_learners
  return {"steps_made": list(zeros), "discarded_fragment_steps": list(zeros),
          "discarded_fragment_tokens": list(zeros), "incarnations": list(zeros),
          "start_steps": list(zeros), "restarts": list(zeros), "evals": [], "faults": [],
          "failures": [], "train_seconds": 0.0, "wall_seconds": 0.0, "resumes": []}
