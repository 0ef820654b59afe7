"""What the controller holds of a learner and of the syncer, wherever they run.

A learner is a `Learner` in the command's process (config.runtime=threads) or a handle on a process
of its own (`transport/ray_learner.RemoteLearner`, config.runtime=ray); the syncer likewise a
`Syncer` or a `transport/ray_syncer.RemoteSyncer`. The controller's loop, the supervisor, the syncer
keeper, the checkpoints and the summary read either kind through what these Protocols name, and
nothing else: a member one kind lacks is a member the Protocol lists and the test of this module
(tests/test_handles.py) finds missing, not a `getattr` default somewhere in the controller.

A learner in another process reports how it stands as one `LearnerStatus`, built there at one
instant (`Learner.status`) and kept by its handle, which reads its counters and timestamps from the
latest one it received.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from decoupled_diloco.runtime.core import messages

RECENT = 64  # the step times and losses a status carries: far more than a learner makes per poll


class SyncerGone(RuntimeError):
  """The syncer's process died during a call on it (runtime=ray: killed, or its host lost). The
  caller tries again once the keeper has restored it."""


class GoneWhileRestarting(RuntimeError):
  """A learner's process died again while it was being handed its rejoin (`respawn`): another
  crash or a lost host. The supervisor tries the rejoin again once the process is back."""


@dataclasses.dataclass(frozen=True)
class LearnerStatus:
  """A learner at one instant, as its handle in another process reads it.

  The steps made, discards, counters and data position are those of its latest publication (read
  once: a step made while the status is built counts in all of them or in none); the step times,
  step ends and losses are the last `RECENT` of each with their totals, which the handle appends to
  its own lists."""

  incarnation: int
  step: int
  steps_made: int
  start_step: int
  num_losses: int  # len(losses)
  recent_losses: list[float]
  recent_step_times: list[float]
  recent_step_ends: list[float]
  num_steps_done: int  # len(step_times)
  first_step_done_at: float | None
  train_started_at: float | None
  failed_at: float | None
  error: str | None  # repr of the learner's error
  finished_training: bool
  discarded_fragment_tokens: int
  discarded_fragment_steps: int
  barrier_wait_s: float
  counters: tuple[np.ndarray, np.ndarray, np.ndarray]  # counter_steps, counter_tokens, anchor_versions
  data_state: bytes | None
  offers_made: np.ndarray


@runtime_checkable
class ReceivedModel(Protocol):
  """`Syncer.model` as the controller reads it: Theta as the learners received it."""

  def received(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
    ...


@runtime_checkable
class LearnerHandle(Protocol):
  """A learner as the controller, the supervisor, the keeper, the checkpoints and the summary read
  it (`Learner`, `RemoteLearner`)."""

  index: int
  incarnation: int
  step: int
  start_step: int
  steps_made: int
  losses: list[float]
  step_times: list[float]
  step_ends: list[float]
  first_step_done_at: float | None
  train_started_at: float | None
  failed_at: float | None
  error: BaseException | None
  finished_training: threading.Event
  discarded_fragment_tokens: int
  discarded_fragment_steps: int
  barrier_wait_s: float
  barrier_waits: list[tuple[float, float]]
  batches_taken: int | None  # None: not recorded (a learner process keeps no event tape)
  # config.ray.processes_per_learner > 1: whether its processes ended holding the same copies of
  # every parameter piece; None for a learner of one process or in this process.
  replicas_agree: bool | None

  @property
  def published(self) -> messages.Publication:
    ...

  @property
  def alive(self) -> bool:
    ...

  @property
  def mesh_devices(self) -> Sequence[Any]:
    ...

  @property
  def offers_made(self) -> np.ndarray:
    ...

  @property
  def layout(self) -> Any:
    ...

  @property
  def state_like(self) -> Any:
    ...

  def start(self) -> None:
    ...

  def stop(self) -> None:
    ...

  def release(self) -> None:
    ...

  def join(self, timeout: float | None = None) -> None:
    ...

  def full_publication(self, timeout_s: float) -> messages.Publication | None:
    ...

  def counters(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ...

  def params(self) -> dict[str, Any]:
    ...

  def data_position(self) -> bytes | None:
    ...

  def respawn(self, snapshot: Any) -> LearnerHandle:
    ...

  def tape_respawn(self, **fields) -> None:
    ...


@runtime_checkable
class LearnerProcessHandle(LearnerHandle, Protocol):
  """A learner in processes of its own (config.runtime=ray), as the controller also reads it."""

  pids: list[int]

  def process_up(self) -> bool:
    ...

  def check_replicas(self) -> bool | None:
    ...

  def lost_slice(self) -> bool | None:
    ...

  def kill(self) -> None:
    ...

  def end(self) -> None:
    ...


@runtime_checkable
class SyncerHandle(Protocol):
  """The syncer as the controller, the keeper, the checkpoints and the summary read it (`Syncer`,
  `RemoteSyncer`, and the shards of a sharded one as one: `sharded_syncer.ShardedSyncer`)."""

  model: ReceivedModel
  stats: Any  # syncer.SyncerStats
  tape: list[dict[str, Any]]
  error: BaseException | None
  compile_seconds: float

  @property
  def process_died(self) -> bool:
    """Its process died unplanned (the keeper then restores it); False for one in this process."""
    ...

  @property
  def shard_stats(self) -> list[Any]:
    """Each shard's `stats` (config.syncer.num_shards); one syncer's is one shard's."""
    ...

  def compile(self) -> None:
    ...

  def attach(self, learner: int, link: Any, step: int = 0, incarnation: int = 0,
             anchor_versions: np.ndarray | None = None) -> None:
    ...

  def start(self) -> None:
    ...

  def give_up(self, learner: int) -> None:
    ...

  def catch_up(self) -> None:
    ...

  def post(self, message: Any) -> None:
    ...

  def flush(self, timeout: float | None = None) -> bool:
    ...

  def request_cut(self, timeout_s: float, include_tape: bool = True, hold: str = "") -> Any:
    ...

  def release_cut(self, hold: str) -> None:
    ...

  def request_state(self) -> Any:
    ...

  def load_state(self, state: Any, *, with_history: bool) -> None:
    ...

  def recover(self, state: Any, publications: Any, *, stats: Any, tape: Any) -> dict[str, Any]:
    ...

  def global_params(self) -> dict[str, np.ndarray]:
    ...

  def held_bytes(self) -> int:
    ...

  def steady_state_bytes(self) -> int:
    ...

  def stop(self) -> None:
    ...

  def join(self, timeout: float | None = None) -> None:
    ...

  def kill(self) -> None:
    """A crash (config.chaos's syncer_crash): a SIGKILL of its process, or its thread stopped."""
    ...

