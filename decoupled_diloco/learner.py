"""One learner: an ordinary data-parallel training job on its own mesh, run in its own thread.

Between two inner steps a learner (1) applies the merged fragments that arrived, (2) answers the
syncer's pulls with references to its current fragment values, whose copy to host RAM runs
asynchronously, and (3) posts step metadata. All three are non-blocking: in the decoupled mode a
learner never waits for the syncer or a peer (spec §2). Only the lock-step baselines (diloco,
streaming) wait, by design, for each merge to come back tau steps after it started.

The learner keeps, per fragment p, the counters c_steps / c_tokens since it last received p and the
host copy of that received Theta_p (its anchor, spec §5). `snapshot()` captures everything needed to
start it again from the same point, which the chaos and rejoin work builds on.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from decoupled_diloco import compression
from decoupled_diloco import fragments as fragments_lib
from decoupled_diloco import inner
from decoupled_diloco import messages
from decoupled_diloco import schedule as schedule_lib
from decoupled_diloco import metrics as metrics_lib


class SyncerLink(Protocol):
  """The one call a learner makes on the syncer: a non-blocking post."""

  def post(self, message: Any) -> None:
    ...


@dataclasses.dataclass
class LearnerSnapshot:
  """Host copy of a learner's whole state at a step boundary; restarts it where it stopped."""

  step: int
  train_state: inner.TrainState  # numpy leaves
  data_state: Any  # the grain iterator's get_state()
  counter_steps: np.ndarray  # [P]
  counter_tokens: np.ndarray  # [P]
  anchors: dict[str, np.ndarray]
  anchor_versions: np.ndarray  # [P]


@dataclasses.dataclass(frozen=True)
class LearnerOptions:
  num_steps: int
  lock_step: bool = False
  schedule: schedule_lib.SyncSchedule | None = None  # lock-step modes offer on their own schedule
  alpha: float = 0.0  # theta <- alpha*theta + (1-alpha)*Theta on receive; 0 = overwrite
  # On receiving a merge that took in this learner's offer, keep the steps made since that offer:
  # theta <- Theta + (theta_now - theta_offered), counters keep those steps. False = the paper's
  # plain overwrite, which discards them.
  keep_in_flight_progress: bool = False
  step_delay_s: float = 0.0  # emulated slower hardware
  log_every: int = 25
  wait_timeout_s: float = 600.0  # lock-step only: give up waiting for a merge after this long


class Learner:
  """Trains on its own mesh in a thread; talks to the syncer only through non-blocking queues."""

  def __init__(
      self,
      index: int,
      *,
      train_step: Callable[[inner.TrainState, dict], tuple[inner.TrainState, dict]],
      state: inner.TrainState,
      param_shardings: dict[str, jax.sharding.Sharding],
      batches: Iterator[dict[str, np.ndarray]],
      fragments: Sequence[fragments_lib.Fragment],
      options: LearnerOptions,
      syncer: SyncerLink | None = None,
      metrics: metrics_lib.MetricsWriter | None = None,
      snapshot: LearnerSnapshot | None = None,
      step_hook: Callable[[int, int], None] | None = None,
  ):
    self.index = index
    self._train_step = train_step
    self._shardings = param_shardings
    self._batches = batches
    self._fragments = tuple(fragments)
    self._options = options
    self._syncer = syncer
    self._metrics = metrics
    self._step_hook = step_hook  # called as hook(learner, step) before each step; tests inject faults
    num_fragments = len(self._fragments)
    if snapshot is None:
      self.step = 0
      self._state = state
      self._counter_steps = np.zeros(num_fragments, np.int64)
      self._counter_tokens = np.zeros(num_fragments, np.int64)
      host = jax.device_get(state.params)
      self._anchors = {name: np.asarray(v, np.float32) for name, v in host.items()}
      self._anchor_versions = np.zeros(num_fragments, np.int64)
    else:
      self._restore(snapshot, state)
    self._offers_made = np.zeros(num_fragments, np.int64)
    # fragment -> (step, values, c_steps, c_tokens) of the last offer, for keep_in_flight_progress
    self._last_offers: dict[int, tuple[int, dict[str, jax.Array], int, int]] = {}
    self._pulls: queue.SimpleQueue[int] = queue.SimpleQueue()
    self._inbox: queue.SimpleQueue[messages.Broadcast] = queue.SimpleQueue()
    self._stop = threading.Event()
    self._release = threading.Event()  # after num_steps: keep serving the syncer until released
    self.finished_training = threading.Event()
    self.error: BaseException | None = None
    self.losses: list[float] = []
    self.step_times: list[float] = []
    self._tokens_per_step = 0
    self._thread = threading.Thread(target=self._run, name=f"learner-{index}", daemon=True)

  # ---- called from other threads -------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  def request(self, fragment: int) -> None:
    """The syncer pulls fragment p: answered at the next step boundary."""
    self._pulls.put(fragment)

  def deliver(self, broadcast: messages.Broadcast) -> None:
    """A merged Theta_p arrives: applied at the next step boundary."""
    self._inbox.put(broadcast)

  def stop(self) -> None:
    """Stops at the next step boundary (a crash or a planned stop: nothing else waits for it)."""
    self._stop.set()
    self._release.set()

  def release(self) -> None:
    """Ends the serving phase after num_steps (the final flush is over)."""
    self._release.set()

  def join(self, timeout: float | None = None) -> None:
    self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None

  def params(self) -> dict[str, jax.Array]:
    """References to the current parameters (for evaluation; never blocks the learner)."""
    return dict(self._state.params)

  def snapshot(self) -> LearnerSnapshot:
    """Host copy of the whole state. Call only while the learner's thread is not running."""
    if self._thread.is_alive():
      raise RuntimeError(f"learner {self.index}: snapshot() needs the learner stopped first")
    return LearnerSnapshot(
        step=self.step,
        train_state=jax.device_get(self._state),
        data_state=self._batches.get_state() if hasattr(self._batches, "get_state") else None,
        counter_steps=self._counter_steps.copy(),
        counter_tokens=self._counter_tokens.copy(),
        anchors=dict(self._anchors),
        anchor_versions=self._anchor_versions.copy(),
    )

  # ---- the learner's own thread ---------------------------------------------------------------

  def _restore(self, snapshot: LearnerSnapshot, like: inner.TrainState) -> None:
    shardings = jax.tree.map(lambda x: x.sharding, like)
    self._state = jax.device_put(snapshot.train_state, shardings)
    if snapshot.data_state is not None:
      self._batches.set_state(snapshot.data_state)
    self.step = snapshot.step
    self._counter_steps = snapshot.counter_steps.copy()
    self._counter_tokens = snapshot.counter_tokens.copy()
    self._anchors = dict(snapshot.anchors)
    self._anchor_versions = snapshot.anchor_versions.copy()

  def _run(self) -> None:
    error = None
    try:
      self._train()
      self.finished_training.set()
      while not self._release.is_set():
        # After the last step the learner still answers pulls and takes merges (the final flush).
        self._serve()
        self._release.wait(0.005)
      self._serve()
    except BaseException as err:  # pylint: disable=broad-except
      # A failed learner just stops contributing (spec §6): report it, never raise into others.
      error = f"{type(err).__name__}: {err}"
      self.error = err
      logging.error("learner %d failed at step %d: %s", self.index, self.step, error)
    finally:
      self.finished_training.set()
      if self._syncer is not None:
        self._syncer.post(messages.LearnerExit(self.index, self.step, error))

  def _train(self) -> None:
    opts = self._options
    in_flight = None  # metrics of the last dispatched step, read after the next one is dispatched
    last_done = time.perf_counter()
    while self.step < opts.num_steps and not self._stop.is_set():
      if self._step_hook is not None:
        self._step_hook(self.index, self.step)
      self._apply_arrived()
      current = self._state  # the state after step self.step (its step may still be running)
      batch = next(self._batches)
      self._tokens_per_step = int(batch["targets"].size)
      self._state, step_metrics = self._train_step(current, batch)
      # Reading the previous step's loss after dispatching this one keeps the devices busy
      # (nanodo's pattern); a step's time is the time between two completed steps.
      if in_flight is not None:
        last_done = self._finish_step(in_flight, self.step, last_done)
      # `current` is complete now: pulls get it, so their copies to host RAM land at once and
      # the counters still describe it.
      self._answer_pulls(current)
      self.step += 1
      self._counter_steps += 1
      self._counter_tokens += self._tokens_per_step
      in_flight = step_metrics
      if opts.step_delay_s:
        time.sleep(opts.step_delay_s)
      if opts.lock_step:
        self._offer_due_fragments()
        self._wait_for_due_merges()
    if in_flight is not None:
      self._finish_step(in_flight, self.step, last_done)

  def _finish_step(self, step_metrics: dict, step: int, last_done: float) -> float:
    """Waits for `step` to complete, records it and posts its metadata; returns its end time."""
    loss = float(step_metrics["loss"])
    now = time.perf_counter()
    step_time = now - last_done
    self.losses.append(loss)
    self.step_times.append(step_time)
    if self._syncer is not None:
      self._syncer.post(messages.StepReport(self.index, step, step_time, self._tokens_per_step))
    every = self._options.log_every
    if self._metrics is not None and (step % every == 0 or step == 1):
      tokens_per_s = self._tokens_per_step / float(np.mean(self.step_times[-every:]))
      self._metrics.write(
          "learner", {"learner": self.index, "step": step, "loss": loss,
                      "tokens_per_s": tokens_per_s},
          step=step, scalars={f"learner_{self.index}/loss": loss,
                              f"learner_{self.index}/tokens_per_s": tokens_per_s})
    return now

  def _serve(self) -> None:
    """Apply arrived merges, then answer pulls: both between steps, neither blocks."""
    self._apply_arrived()
    self._answer_pulls(self._state)

  def _apply_arrived(self) -> None:
    while True:
      try:
        self._apply(self._inbox.get_nowait())
      except queue.Empty:
        return

  def _answer_pulls(self, state: inner.TrainState) -> None:
    while True:
      try:
        fragment = self._pulls.get_nowait()
      except queue.Empty:
        return
      self._offer(fragment, state)

  def _offer(self, p: int, state: inner.TrainState | None = None) -> None:
    frag = self._fragments[p]
    params = (state or self._state).params
    values = {name: params[name] for name in frag.names}
    for array in values.values():
      array.copy_to_host_async()
    self._offers_made[p] += 1
    self._last_offers[p] = (self.step, values, int(self._counter_steps[p]),
                            int(self._counter_tokens[p]))
    self._syncer.post(messages.Offer(
        learner=self.index, fragment=p, step=self.step,
        steps=int(self._counter_steps[p]), tokens=int(self._counter_tokens[p]),
        anchor_version=int(self._anchor_versions[p]), values=values,
        anchor={name: self._anchors[name] for name in frag.names}))

  def _apply(self, broadcast: messages.Broadcast) -> None:
    p = broadcast.fragment
    if broadcast.version <= self._anchor_versions[p]:
      return  # broadcasts apply monotonically: an older Theta_p never overwrites a newer one
    params = dict(self._state.params)
    alpha = self._options.alpha
    offered = self._last_offers.get(p)
    rebase = (self._options.keep_in_flight_progress and offered is not None
              and broadcast.merged_offers.get(self.index) == offered[0])
    for name, encoded in broadcast.values.items():
      theta_global = compression.decode(encoded)
      self._anchors[name] = theta_global
      merged = jax.device_put(theta_global, self._shardings[name])
      if rebase:
        merged = _rebase(merged, params[name], offered[1][name])
      if alpha:
        merged = _mix(params[name], merged, alpha)
      params[name] = merged
    self._state = self._state._replace(params=params)
    self._anchor_versions[p] = broadcast.version
    if rebase:
      # The steps since the offer are still in theta and not yet in any merge.
      self._counter_steps[p] -= offered[2]
      self._counter_tokens[p] -= offered[3]
    else:
      self._counter_steps[p] = 0
      self._counter_tokens[p] = 0

  # ---- lock-step baselines ----------------------------------------------------------------------

  def _offer_due_fragments(self) -> None:
    for p in self._options.schedule.due_fragments(self.step):
      self._offer(p)

  def _wait_for_due_merges(self) -> None:
    """diloco / streaming: before step t+1, every fragment whose sync started at t - tau is back."""
    schedule = self._options.schedule
    start = self.step - schedule.overlap
    if start < 1:
      return
    needed = [p for p in schedule.due_fragments(start)]
    deadline = time.monotonic() + self._options.wait_timeout_s
    for p in needed:
      while self._anchor_versions[p] < self._offers_made[p]:
        if self._stop.is_set():
          return
        try:
          self._apply(self._inbox.get(timeout=0.05))
        except queue.Empty:
          if time.monotonic() > deadline:
            raise TimeoutError(
                f"learner {self.index}: merge of fragment {p} did not come back within "
                f"{self._options.wait_timeout_s}s (lock-step mode)") from None
        self._serve()


@jax.jit
def _mix_impl(local, merged, alpha):
  return alpha * local + (1.0 - alpha) * merged


@jax.jit
def _rebase(merged, now, offered):
  """Theta + (theta_now - theta_offered): the merge, plus what the learner did since its offer."""
  return merged + (now - offered)


def _mix(local, merged, alpha: float):
  """Streaming DiLoCo's theta <- alpha*theta_local + (1-alpha)*Theta, on the learner's devices."""
  return _mix_impl(local, merged, jnp.float32(alpha))
