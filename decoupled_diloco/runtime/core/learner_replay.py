"""A learner's state changes, one at a time, in the order an event tape recorded them.

The replay (runtime/records/event_tape.py) runs with no learner thread and no syncer: it makes each
learner's steps, takes and applies itself, as `Learner._train`, `Learner.offer` and `Learner._apply`
make them in a run, so that the replayed states are bit for bit the recorded ones. These functions
work on the learner's own state, as its methods would.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.core import messages

# pylint: disable=protected-access


def step(learner: learner_lib.Learner) -> None:
  """One training step on the next batch, as `_train` makes it."""
  learner._tape.replaying = True
  batch = next(learner._batches)
  learner._took(batch)
  learner._state, _ = learner._train_step(learner._state, batch)
  learner.step += 1
  learner.steps_made += 1
  learner._counter_steps += 1
  learner._counter_tokens += int(batch["targets"].size)
  learner._data_state = learner.data_position()
  if learner.step >= learner._options.num_steps:
    learner._finished = True  # every merge applied from here on is one `_serve` applies


def publication(learner: learner_lib.Learner) -> messages.Publication:
  """The publication of the state now (not published: a take names the one it came from)."""
  return learner._publication(learner._state)


def take(learner: learner_lib.Learner, published: messages.Publication, p: int,
         index: int) -> messages.Offer:
  """The offer of fragment p the syncer took from `published`, the tape's publication `index`."""
  return learner.take_from(published, p, index)


def apply(learner: learner_lib.Learner, broadcast: messages.Broadcast) -> None:
  """A merge the learner applied at its step boundary (algorithm/receive.py)."""
  learner._apply(broadcast)


def corrupt(learner: learner_lib.Learner, corruption: Callable[[jax.Array], jax.Array]) -> None:
  """What a nan fault did to the output of the step just made (runtime/faults/injector.py)."""
  learner._state = learner._state._replace(params=jax.tree.map(corruption, learner._state.params))


def fail(learner: learner_lib.Learner, batches_taken: int) -> None:
  """The incarnation failed here, having taken `batches_taken` batches: its successor's loader
  (the same one) goes on from there."""
  if batches_taken < learner.batches_taken:
    raise ValueError(f"learner {learner.index}: the tape says it failed after taking "
                     f"{batches_taken} batches, the replay took {learner.batches_taken} already")
  while learner.batches_taken < batches_taken:
    next(learner._batches)
    learner.batches_taken += 1


def finish(learner: learner_lib.Learner) -> None:
  """After the tape: the state now is the learner's published one (`params`)."""
  learner._publish(learner._state)
