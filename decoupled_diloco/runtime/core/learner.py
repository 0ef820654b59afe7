"""One learner: an ordinary data-parallel training job on its own mesh, run in its own thread.

Between two inner steps a learner (1) applies the merged fragments that arrived, (2) dispatches the
next step, (3) once the previous step has completed, *publishes* that completed state and posts the
step's metadata. None of this waits for the syncer: in the decoupled mode a learner never waits for
the syncer or a peer (docs/design.md §2). The syncer takes a fragment from the latest publication
whenever it wants one (`offer`, called on the syncer's thread), so a pull never waits for the
learner's next step boundary. Only the lock-step baselines (diloco, streaming) wait, by design,
for each merge to come back tau steps after it started.

The learner keeps, per fragment p, the counters c_steps / c_tokens of its steps not yet merged, the
step `since` where those steps start, and the host copy of the Theta_p it last received (its anchor,
docs/design.md §5). It also remembers every offer the syncer took (runtime/core/learner_ledger.py),
so that a broadcast, which names the offer it merged, tells it exactly which of its steps are now in
Theta_p: overwritten or kept (runtime/core/learner_receive.py).

A step whose loss is not finite (a diverged or corrupted learner) fails the learner with
`NonFiniteLoss` before the state after that step is published: from then on it is a failed learner
like any other, and the supervisor restarts it from a healthy peer and Theta. The state it had
published before (already holding NaNs, if its parameters went bad in the update before) may still be
offered; the syncer's robust merge rejects it.

`snapshot()` captures everything needed to start it again from the same point.

A learner over several processes (`group`, one per host: runtime/transport/ray_runtime.py) is this same
learner in every process, in lock-step; at every step boundary its processes agree on what changes
their state (runtime/core/agreement.py).

Memory beyond a data-parallel learner: the host copies of its anchors (4 bytes per parameter), and
on its devices the fragments of the offers the syncer took and has not merged yet (the last one per
fragment; in the steady state the tau-or-so fragments in flight, at worst one copy of the
parameters), and the publication's copy of the parameters.

Donation (`inner.make_train_step(donate=True)`): the step writes the new state over the one it
takes, so the state a publication refers to would be gone once the next step is dispatched. While
it steps, the learner therefore publishes a device copy, made before that dispatch, of what the
syncer's pulls read: the parameters (one copy, against the whole second train state a step without
donation holds). The optimizer state is copied only while someone asked for it
(`want_full_state`: a checkpoint's cut, a peer's rejoin); between those requests a publication's
`opt_state` is None. Once its step loop has ended (after the last step, or stopped) nothing is
donated any more and a publication refers to the state itself.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from absl import logging

from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.lm import inner
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.runtime.core import agreement as agreement_lib
from decoupled_diloco.runtime.core import device_share
from decoupled_diloco.runtime.core import learner_receive
from decoupled_diloco.runtime.core import learner_restart
from decoupled_diloco.runtime.core import learner_status
from decoupled_diloco.runtime.core import lock_step
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core import profiling
from decoupled_diloco.runtime.core.agreement import ProcessGroup
from decoupled_diloco.runtime.core.learner_ledger import TakeLedger
from decoupled_diloco.runtime.core.learner_state import Counters
from decoupled_diloco.runtime.core.learner_state import LearnerOptions
from decoupled_diloco.runtime.core.learner_state import LearnerSnapshot
from decoupled_diloco.runtime.core.learner_state import SyncerLink
from decoupled_diloco.runtime.core.learner_tape import LearnerTape


_DONE_REPEAT_S = 1.0  # a finished learner says so again this often while it serves the flush


class NonFiniteLoss(RuntimeError):
  """A learner's step gave a loss that is NaN or inf: its state has diverged or is corrupted."""


class Learner:
  """Trains on its own mesh in a thread; talks to the syncer only through non-blocking calls."""

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
      layout: model_lib.ParamLayout | None = None,
      incarnation: int = 0,
      peer_repairing: Callable[[], bool] | None = None,
      group: ProcessGroup | None = None,
      turns: device_share.DeviceTurns | None = None,
  ):
    self.index = index
    # Learners that share this one's devices: its steps take turns with theirs.
    self._turns = turns
    # A learner over several processes: every change of its state is agreed at a step boundary.
    self._group = group
    self._agreement = agreement_lib.Agreement(self, group) if group is not None else None
    # 0 for the learner the run started; one more for each restart after a failure
    # (docs/design.md §6).
    self.incarnation = incarnation
    # Shapes and shardings of the train state, not its arrays: a respawn places its state alike.
    self._like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    self._train_step = train_step
    self._donates = inner.donates_state(train_step)
    # Until its step loop ends, a state may be donated by a later dispatch: publications copy it.
    # From the start: a restored learner's first publication already has steps to offer.
    self._stepping = True
    self._full_until = 0.0  # time.monotonic() until which publications carry the optimizer state
    self._copied: tuple[inner.TrainState, inner.TrainState] | None = None  # (state, its copy)
    self._shardings = param_shardings  # of the native parameters
    # Fragments and merges name flat tensors (one per layer tensor); the layout finds them in the
    # native parameters, which may stack the layers.
    self._layout = layout or model_lib.ParamLayout({n: (n, None) for n in param_shardings}, 0)
    self._flat_shardings = self._layout.flat_shardings(param_shardings)
    self._batches = batches
    self._fragments = tuple(fragments)
    self._options = options
    self._syncer = syncer
    self._metrics = metrics
    self._step_hook = step_hook  # called as hook(learner, step) before each step; tests inject faults
    # Lock-step only: whether a failed peer is waiting for its repair. The barrier then waits for
    # it by design, so that wait is not a stall (`lock_step.wait_for_due_merges`).
    self._peer_repairing = peer_repairing
    self.step = 0 if snapshot is None else snapshot.step  # 0, or where the snapshot stopped
    # Its state, and per fragment its counters, since, anchors and their versions.
    if snapshot is None:
      learner_restart.fresh(self, state)
    else:
      learner_restart.restore(self, snapshot, state)
    # Lock-step: offers pushed per fragment. Every merge of a lock-step round takes one offer of
    # every learner, so a restored learner has pushed as many as the versions it holds.
    self._offers_made = self._anchor_versions.copy()
    if snapshot is not None and snapshot.offers_made is not None:
      self._offers_made = np.maximum(self._offers_made, snapshot.offers_made)
    self.start_step = self.step  # where this learner object started (0, a checkpoint, a rejoin)
    # Guards the ledger, written by the syncer's thread in offer(), and the tape.
    self._lock = threading.Lock()
    self._ledger = TakeLedger(index)  # the offers taken, until merged; the discarded steps
    self._tape = LearnerTape(metrics, index, incarnation)
    self._inbox: queue.SimpleQueue[messages.Broadcast] = queue.SimpleQueue()
    self._news = threading.Event()  # the leader has something to propose
    self._finished = False  # made its last step: from then on merges keep unmerged steps
    self._stop = threading.Event()
    self._release = threading.Event()  # after num_steps: keep serving the syncer until released
    self.finished_training = threading.Event()
    self.error: BaseException | None = None
    self.losses: list[float] = []
    self.step_times: list[float] = []
    self.first_step_done_at: float | None = None  # time.monotonic() when its first step completed
    # time.monotonic() when its first step started, when each step completed, and when it failed:
    # the goodput accounting's timestamps (`runtime/records/goodput.py`).
    self.train_started_at: float | None = None
    self.step_ends: list[float] = []
    self.failed_at: float | None = None
    self.steps_made = 0  # by this incarnation
    self.batches_taken = 0  # from the loader, by this incarnation (one more than its steps when a
    # step failed after the next one was dispatched)
    # Lock-step: seconds this incarnation spent at barriers, waiting for merges to come back (the
    # sync itself, slower peers, and peers that are down and being repaired).
    self.barrier_wait_s = 0.0
    self.barrier_waits: list[tuple[float, float]] = []  # (start, end), monotonic: goodput's idle
    # Delta broadcasts against a version this learner did not hold, not applied (a keyframe follows).
    self.ignored_deltas = 0
    self._data_state = self.data_position()  # the loader's position after step self.step
    self._trace = (profiling.StepTrace(*options.profile_steps, options.profile_dir)
                   if options.profile_steps else None)
    self._published: messages.Publication = self._publication(self._state)
    if self._agreement is not None:
      self._agreement.keep_recent(self._published)
    self._thread = threading.Thread(target=self._run, name=f"learner-{index}", daemon=True)

  # ---- called from other threads -------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  def offer(self, p: int, merged_through: int) -> messages.Offer | messages.Answer:
    """The syncer takes fragment p from the latest publication (called on the syncer's thread).

    `merged_through` is the last step of this learner that a merge of p has taken in. A publication
    whose unmerged steps start before it still holds those merged steps (their broadcast has not
    been applied yet): it is STALE, and the syncer asks again after the learner's next publication.
    """
    published = self._published
    if published.since[p] < merged_through:
      return messages.Answer.STALE
    if published.counter_steps[p] == 0:
      return messages.Answer.NOTHING
    offer = self._offer_from(published, p)
    with self._lock:
      self._record_taken(offer)
      if self._agreement is not None:
        self._agreement.takes.append((int(p), int(offer.step), int(offer.publication)))
    return offer

  def deliver(self, broadcast: messages.Broadcast) -> None:
    """A merged Theta_p arrives: applied at the next step boundary."""
    self._inbox.put(broadcast)
    self._news.set()

  def want_full_state(self, seconds: float) -> None:
    """For the next `seconds`, publications carry the optimizer state and step too (a copy, with
    donation); the publications already made are unchanged."""
    self._full_until = max(self._full_until, time.monotonic() + seconds)
    self._news.set()

  def full_publication(self, timeout_s: float, min_step: int = 0
                       ) -> messages.Publication | None:
    """The latest publication once it carries the optimizer state (asking for it) and is of step
    `min_step` or later, or None if none is within `timeout_s` (a learner that died meanwhile)."""
    self.want_full_state(timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
      published = self._published
      if published.opt_state is not None and published.step >= min_step:
        return published
      if time.monotonic() > deadline or self.error is not None:
        return None
      time.sleep(0.005)

  def stop(self) -> None:
    """Stops at the next step boundary (a crash or a planned stop: nothing else waits for it)."""
    self._stop.set()
    self._release.set()
    self._news.set()

  def release(self) -> None:
    """Ends the serving phase after num_steps (the final flush is over)."""
    self._release.set()
    self._news.set()

  # ---- a learner over several processes: called from other threads ----------------------------

  def offer_of(self, p: int, step: int, publication: int, timeout_s: float
               ) -> messages.Offer | None:
    """Another process than the leader: fragment p of its publication (step, publication), which
    the leader's `offer` just took from its own (this process makes it soon, if it has not yet).
    Not recorded as taken here: the leader's next proposal says so. None if this process has no
    such publication (any more) within `timeout_s`."""
    return self._agreement.offer_of(p, step, publication, timeout_s)

  def capture(self, timeout_s: float, *, after: int = -1, boundary: int | None = None
              ) -> tuple[int, messages.Publication] | None:
    """(boundary, this process's capture of the whole state there): the one of `boundary`, or the
    first made after boundary `after` (asking for it). None if none within `timeout_s`."""
    return self._agreement.capture(timeout_s, after=after, boundary=boundary)

  def wants_full_state(self) -> bool:
    """Whether someone asked for the whole state lately (`want_full_state`)."""
    return bool(time.monotonic() < self._full_until)

  @property
  def boundaries(self) -> int:
    """Step boundaries this learner's processes have agreed on so far."""
    return 0 if self._agreement is None else self._agreement.boundaries

  def join(self, timeout: float | None = None) -> None:
    if self._thread.ident is not None:  # a late learner that never joined has nothing to end
      self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None

  @property
  def mesh_devices(self) -> list[jax.Device]:
    """The devices this learner trains on."""
    return sorted({d for s in self._shardings.values() for d in s.device_set}, key=lambda d: d.id)

  def counters(self) -> Counters:
    """Host-side counters (no device state): readable after a failure, from any thread."""
    return Counters(self._counter_steps.copy(), self._counter_tokens.copy(),
                    self._anchor_versions.copy())

  # One copy of its state in this process: no replicas to disagree (`handles.LearnerHandle`).
  replicas_agree: bool | None = None

  def status(self):
    """How this learner stands, for its handle in another process (`handles.LearnerStatus`;
    runtime/core/learner_status.py)."""
    return learner_status.status(self)

  @property
  def published(self) -> messages.Publication:
    return self._published

  @property
  def training(self) -> bool:
    """Whether its latest publication is of a learner still training (the syncer's attach)."""
    return self._published.training

  def params(self) -> dict[str, jax.Array]:
    """The latest published parameters, native layout (for evaluation; never blocks the learner)."""
    return dict(self._published.params)

  def flat_params(self) -> dict[str, jax.Array]:
    """The latest published parameters, one array per flat tensor."""
    params = self._published.params
    return {name: self._layout.get(params, name) for name in self._layout.where}

  def respawn(self, snapshot: LearnerSnapshot, train_step: Callable | None = None) -> "Learner":
    """The next incarnation of this learner after a failure: same index, mesh, compiled step and
    data loader (whose position the host kept unless `snapshot` gives one), its state from
    `snapshot`. `train_step`: a step compiled again (a dp job restart rebuilds it). Not started."""
    return learner_restart.respawn(self, snapshot, train_step)

  @property
  def discarded_fragment_steps(self) -> int:
    """Fragment-steps an overwrite on receive dropped: the compute the paper's overwrite drops."""
    return self._ledger.discarded_steps

  @property
  def discarded_fragment_tokens(self) -> int:
    """Tokens of those discarded fragment-steps."""
    return self._ledger.discarded_tokens

  @property
  def offers_made(self) -> np.ndarray:
    """Lock-step: per fragment, the rounds this learner has offered to (its barriers)."""
    return self._offers_made.copy()

  @property
  def state_like(self) -> inner.TrainState:
    """Shapes, dtypes and shardings of the train state (the structure a checkpoint restores)."""
    return self._like

  @property
  def layout(self) -> model_lib.ParamLayout:
    return self._layout

  @property
  def state_bytes(self) -> int:
    """Bytes of the train state on the devices (parameters, optimizer state, step)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(self._like))

  def snapshot(self) -> LearnerSnapshot:
    """Host copy of the whole state. Call only while the learner's thread is not running."""
    return learner_restart.snapshot(self)

  # ---- the learner's own thread ---------------------------------------------------------------

  def _run(self) -> None:
    error = None
    try:
      self._train()
      if not self._stopping():
        self._finished = True
        self._publish(self._state)
        if self._syncer is not None:
          self._syncer.post(self._training_done())
      self.finished_training.set()
      said_done_at = time.monotonic()
      while not self._released():
        # After the last step the learner still serves offers and takes merges (the final flush).
        held = self._anchor_versions.copy()
        self._serve(timeout=0.02)
        if self._syncer is not None and self._finished and (
            time.monotonic() - said_done_at >= _DONE_REPEAT_S
            or not np.array_equal(held, self._anchor_versions)):
          # Its heartbeat while it has no step to report: a TrainingDone lost on the way (a
          # partition) would leave the syncer's flush waiting for steps that never come. And its
          # report of the merges it applied, as a step report would say them.
          said_done_at = time.monotonic()
          self._syncer.post(self._training_done())
      self._serve(timeout=0.0)
    except BaseException as err:  # pylint: disable=broad-except
      # A failed learner just stops contributing (docs/design.md §6): report it, never raise into
      # others.
      error = f"{type(err).__name__}: {err}"
      self.failed_at = time.monotonic()
      self.error = err
      logging.error("learner %d failed at step %d: %s", self.index, self.step, error)
    finally:
      if self._trace is not None:
        self._trace.close()  # stopped or failed inside the window
      self.finished_training.set()
      if self._syncer is not None:
        self._syncer.post(messages.LearnerExit(self.index, self.step, error, self.incarnation))

  def _training_done(self) -> messages.TrainingDone:
    return messages.TrainingDone(self.index, self.step, self.incarnation,
                                 anchor_versions=self._anchor_versions.copy())

  def _train(self) -> None:
    opts = self._options
    in_flight = None  # (step, tokens, metrics) of the last dispatched step
    noise = np.random.default_rng((*opts.noise_seed, self.incarnation, self.step))
    if opts.lock_step:
      # A rejoined learner starts at the barrier its peers wait at (snapshot.offers_made): it
      # waits for that round's merge too, then all go on from the same Theta.
      lock_step.wait_for_due_merges(self)
    last_done = time.perf_counter()
    self.train_started_at = time.monotonic()
    while self.step < opts.num_steps and not self._stopping():
      if self._step_hook is not None:
        self._step_hook(self.index, self.step)
      if self._trace is not None:
        self._trace.before_step(self.step)
      self._boundary()
      if self._agreement is not None and self._agreement.stop:
        break  # a multi-process learner's leader was asked to stop: all stop here
      current = self._state  # after step self.step, merges applied (its step may still run)
      batch = next(self._batches)
      self._took(batch)
      tokens = int(batch["targets"].size)
      self._publishable(current)  # with donation: the copy to publish, before `current` is gone
      if self._turns is not None:
        # Completed, with the merges that arrived applied: the syncer may take it while this
        # learner waits for its turn (an offer refused as stale, for a merge not yet applied,
        # is good again at once, not a turn later).
        self._publish(current)
      self._state, step_metrics = self._step_in_turn(current, batch)
      # The previous step's loss is read after this one is dispatched, which keeps the devices
      # busy (nanodo's pattern); a step's time is the time between two completed steps. Once it
      # has completed, `current` is a completed state: publish it with the counters that
      # describe it.
      if in_flight is not None:
        last_done = self._complete(in_flight, last_done, current)
      elif self._turns is None:
        self._publish(current)
      self.step += 1
      self.steps_made += 1
      self._counter_steps += 1
      self._counter_tokens += tokens
      # Where the data stands after the new step; until here publications of `current` (one step
      # behind) went out with the position before this step's batch.
      self._data_state = self.data_position()
      in_flight = (self.step, tokens, step_metrics)
      if self._turns is not None:
        # A step taken in turn has completed already (`_step_in_turn`): published now, not after
        # the next turn, the syncer's takes are a step fresher and the report a turn earlier.
        # Four learners sharing a device with 8-token steps took every offer two batches behind
        # the learner, where learners on devices of their own took them one to two (issue 44).
        last_done = self._complete(in_flight, last_done, self._state)
        in_flight = None
      if self._trace is not None:
        self._trace.after_step(self.step, self._state)
      if opts.step_delay_s or opts.step_noise_s:
        # Slower hardware: the step's own time, then the delay. Slept while the step was still
        # running, a delay shorter than the step would hide behind it and slow nothing.
        jax.block_until_ready(step_metrics)
        time.sleep(opts.step_delay_s + opts.step_noise_s * 2 * noise.random())
      if opts.lock_step:
        lock_step.push_due_offers(self)
        lock_step.wait_for_due_merges(self)
    self._stepping = False  # the last state is never donated: publications refer to it
    if in_flight is not None:
      self._complete(in_flight, last_done, self._state)

  def _step_in_turn(self, state: inner.TrainState, batch: dict[str, np.ndarray]):
    """Dispatches the step; on devices shared with other learners, in this learner's turn, which
    it hands on once the step has left the devices (runtime/core/device_share.py)."""
    if self._turns is None:
      return self._train_step(state, batch)
    self._turns.enter(self.index)
    try:
      new_state, step_metrics = self._train_step(state, batch)
      jax.block_until_ready(step_metrics)
    finally:
      self._turns.leave(self.index)
    return new_state, step_metrics

  def _complete(self, in_flight, last_done: float, state: inner.TrainState) -> float:
    """Waits for a dispatched step, records it, publishes `state` and reports; returns its end."""
    step, tokens, step_metrics = in_flight
    loss = float(step_metrics["loss"])
    if not math.isfinite(loss):
      # Before publishing: the state after this step came from the bad one, and nobody may take it.
      raise NonFiniteLoss(f"learner {self.index} (incarnation {self.incarnation}): the loss of "
                          f"step {step} is {loss}")
    now = time.perf_counter()
    step_time = now - last_done
    self.losses.append(loss)
    self.step_times.append(step_time)
    self.step_ends.append(time.monotonic())
    if self.first_step_done_at is None:
      self.first_step_done_at = time.monotonic()
    published = self._publish(state)
    if self._syncer is not None:
      self._syncer.post(messages.StepReport(self.index, step, step_time, tokens,
                                            published.anchor_versions, self.incarnation))
    every = self._options.log_every
    if self._metrics is not None and (step % every == 0 or step == 1):
      tokens_per_s = tokens / float(np.mean(self.step_times[-every:]))
      self._metrics.write(
          "learner", {"learner": self.index, "step": step, "loss": loss,
                      "tokens_per_s": tokens_per_s},
          step=step, scalars={f"learner_{self.index}/loss": loss,
                              f"learner_{self.index}/tokens_per_s": tokens_per_s})
    return now

  def _publishable(self, state: inner.TrainState) -> inner.TrainState:
    """What a publication of `state` may refer to: `state` itself, or while a donating step loop
    runs, device copies of its parameters (and of the rest, while a full state is wanted), made
    once per state. Call it before the dispatch that donates `state`."""
    if not (self._donates and self._stepping):
      return state
    if self._copied is not None and self._copied[0] is state:
      return self._copied[1]
    if time.monotonic() < self._full_until:
      copy = inner.copy_tree(state)
    else:
      copy = inner.TrainState(params=inner.copy_tree(state.params), opt_state=None, step=None)
    self._copied = (state, copy)
    return copy

  def _publication(self, state: inner.TrainState, publishable: bool = True
                   ) -> messages.Publication:
    """A publication of `state`; `publishable=False` refers to `state` itself, without the copies
    that a donated state needs (a capture copies it to the host at once)."""
    if publishable:
      state = self._publishable(state)
    previous = getattr(self, "_published", None)
    index = previous.index + 1 if previous is not None and previous.step == self.step else 0
    return messages.Publication(
        index=index, step=self.step, params=dict(state.params), since=self._since.copy(),
        counter_steps=self._counter_steps.copy(), counter_tokens=self._counter_tokens.copy(),
        anchor_versions=self._anchor_versions.copy(), anchors=dict(self._anchors),
        training=not self._finished, opt_state=state.opt_state, state_step=state.step,
        data_state=self._data_state, steps_made=self.steps_made,
        discarded_fragment_steps=self.discarded_fragment_steps,
        discarded_fragment_tokens=self.discarded_fragment_tokens)

  def data_position(self) -> bytes | None:
    """The data loader's position now (host state: readable after a failure)."""
    return self._batches.get_state() if hasattr(self._batches, "get_state") else None

  def _publish(self, state: inner.TrainState) -> messages.Publication:
    self._published = self._publication(state)
    if self._agreement is not None:
      self._agreement.keep_recent(self._published)
    return self._published

  def take_from(self, published: messages.Publication, p: int, publication: int
                ) -> messages.Offer:
    """The offer of fragment p from `published` (its `publication` index), recorded as taken: a
    take another process of this learner made (agreed), or one a tape recorded (replayed)."""
    offer = dataclasses.replace(self._offer_from(published, p), publication=publication)
    with self._lock:
      self._record_taken(offer)
    return offer

  def _offer_from(self, published: messages.Publication, p: int) -> messages.Offer:
    names = self._fragments[p].names
    values = {name: self._layout.get(published.params, name) for name in names}
    for array in values.values():
      if hasattr(array, "copy_to_host_async"):
        array.copy_to_host_async()  # the pull: runs while the learner computes
    return messages.Offer(
        learner=self.index, fragment=p, step=published.step, since=int(published.since[p]),
        steps=int(published.counter_steps[p]), tokens=int(published.counter_tokens[p]),
        anchor_version=int(published.anchor_versions[p]), values=values,
        anchor={name: published.anchors[name] for name in names}, incarnation=self.incarnation,
        publication=published.index)

  def _stopping(self) -> bool:
    return self._agreement.stop if self._agreement is not None else self._stop.is_set()

  def _released(self) -> bool:
    return self._agreement.release if self._agreement is not None else self._release.is_set()

  def _boundary(self) -> int:
    """Applies the merges that arrived; a learner over several processes agrees on them first
    (runtime/core/agreement.py) and returns how many broadcasts it took."""
    if self._agreement is None:
      self._apply_arrived()
      return 0
    return self._agreement.boundary()

  def _serve(self, timeout: float) -> None:
    """Applies the merges that arrived (waiting up to `timeout` for one), then publishes."""
    if self._group is not None:
      if self._group.leader and timeout > 0:
        self._news.wait(timeout)  # the others wait for it in the agreement
      self._news.clear()
      if self._boundary():
        self._publish(self._state)
      return
    try:
      broadcast = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
    except queue.Empty:
      if self._published.opt_state is None and time.monotonic() < self._full_until:
        # Waiting at a lock-step barrier: the state is complete, and someone needs all of it.
        self._copied = None
        self._publish(self._state)
      return
    self._apply(broadcast)
    self._apply_arrived()
    self._publish(self._state)

  def _apply_arrived(self) -> None:
    while True:
      try:
        self._apply(self._inbox.get_nowait())
      except queue.Empty:
        return

  def _apply(self, broadcast: messages.Broadcast) -> None:
    """A merged Theta_p, applied to the state (runtime/core/learner_receive.py)."""
    learner_receive.apply(self, broadcast)

  def _record_taken(self, offer: messages.Offer) -> None:
    """Under the lock: the syncer took `offer`."""
    self._tape.event("take", fragment=offer.fragment, step=offer.step,
                     publication=offer.publication, batches=self.batches_taken,
                     data_crc=self._tape.data_crc)
    self._ledger.record(offer)

  def _took(self, batch: dict[str, np.ndarray]) -> None:
    """A batch taken from the loader: counted, and folded into the CRC of this incarnation's
    batches, which its takes put on the event tape (a replay on other data stops at once)."""
    crc = self._tape.crc_with(batch)
    with self._lock:  # a take reads both
      self.batches_taken += 1
      self._tape.data_crc = crc

  @property
  def data_crc(self) -> int:
    return self._tape.data_crc

  def tape_respawn(self, **fields) -> None:
    """The supervisor made this incarnation: the first event on the tape of its."""
    with self._lock:
      self._tape.event("respawn", **fields)
