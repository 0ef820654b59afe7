"""A run as the controller sees it: what `build` made (`Run`), and the transport it runs over.

The controller (runtime/control/controller.py) drives learners and a syncer without knowing where
they live: threads of this process (runtime/transport/threads.py) or processes of their own
(runtime/transport/ray_transport.py). The entry (runtime/train.py) picks the `Transport` and hands
it in; nothing here imports a transport or Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.lm import evaluate
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.runtime.control import job_restart
from decoupled_diloco.runtime.control import supervisor as supervisor_lib
from decoupled_diloco.runtime.control import syncer_keeper as keeper_lib
from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
from decoupled_diloco.runtime.faults import checkpoint_faults
from decoupled_diloco.runtime.faults import injector as injector_lib
from decoupled_diloco.runtime.records import checkpoints as checkpoints_lib


class Transport(Protocol):
  """Where the learners and the syncer run, and how they are started and ended."""

  # Whether the learners are processes of their own: then this process holds the syncer's link
  # and one CPU device for the model's initialisation and the evaluations.
  learners_in_processes: bool

  def compile_learners(self, settings: settings_lib.RunSettings, learner_meshes, graphdef,
                       initial: dict[str, Any], tx, dataset, injector
                       ) -> tuple[list[tuple[Any, Any, Any, Any]], float]:
    """Each learner of this process compiled and placed: (train_step, state, shardings,
    batches) per learner, and the seconds it took. Before anything is written."""

  def start(self, settings: settings_lib.RunSettings) -> None:
    """Once the workdir is written to: what the learners and the syncer need to start."""

  def make_syncer(self, settings: settings_lib.RunSettings, crashed, *, metrics, network,
                  initial: dict[str, Any], syncer_mesh, shard: int | None = None) -> Any:
    """A syncer at the initial Theta, compiled: at start-up (`crashed` None), and again after
    `crashed` crashed. `shard`: shard `shard` of a sharded syncer (config.syncer.num_shards),
    over `syncer_mesh`, its own devices."""

  def start_learners(self, settings: settings_lib.RunSettings, built, *, syncer, port, metrics,
                     layout, fragments, cuts: dict[int, Any], held_back: Sequence[int],
                     step_hook, peer_repairing) -> list[Any]:
    """The learners, each attached to `syncer` (if any) unless held back (a late learner)."""

  def repaired_at(self, devices_back: Callable[[int], float], learners: Sequence[Any]
                  ) -> Callable[[int], float]:
    """When a failed learner can be restarted, given when its devices are back."""

  def lost_slice(self, learners: Sequence[Any]) -> Callable[[int], bool | None]:
    """Whether failed learner m lost a host of its TPU slice (config.ray.tpu_slice; None: not
    known yet): a restart that does not count against config.max_restarts."""

  def finish(self, learners: Sequence[Any], syncer) -> None:
    """After a run that ended well: checks what only the transport can, and ends it."""

  def shut_down(self, learners: Sequence[Any], syncer) -> None:
    """After a failed or interrupted run: ends what the transport started."""


@dataclasses.dataclass
class Run:
  """Everything a run is made of, built and compiled, not yet started."""

  settings: settings_lib.RunSettings
  learners: list[learner_lib.Learner]
  syncer: syncer_lib.Syncer | None
  evaluator: evaluate.Evaluator
  metrics: metrics_lib.MetricsWriter
  fragments: tuple[fragments_lib.Fragment, ...]
  num_params: int
  build_seconds: float
  # Seconds of the build spent compiling (and, for init, running) each kind of program.
  compile_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  injector: injector_lib.FaultInjector | None = None  # config.chaos
  supervisor: supervisor_lib.Supervisor | None = None  # restarts failed learners
  checkpoints: checkpoints_lib.Checkpoints | None = None  # where the run writes its checkpoints
  # The run so far when it resumed from a checkpoint (job_state.empty_history() otherwise).
  history: dict[str, Any] = dataclasses.field(default_factory=dict)
  restored: checkpoints_lib.RestoredCheckpoint | None = None
  # Saves the syncer's state and restarts it after a crash (decoupled mode); its `syncer` is the
  # current one, which `execute` keeps in `syncer`.
  keeper: keeper_lib.SyncerKeeper | None = None
  # Fires config.chaos's corrupt_checkpoint faults (None when it schedules none).
  corrupter: checkpoint_faults.CheckpointCorrupter | None = None
  # time.monotonic() when training started: the origin of fault records and of the goodput window.
  started_at: float | None = None
  # dp mode: restarts the whole job from its newest checkpoint after a failure.
  restarter: job_restart.JobRestarter | None = None
  # The tokenizer's name, bad records skipped by reason, and the eval targets' tokens and UTF-8
  # bytes (for bits per byte).
  data_info: dict[str, Any] = dataclasses.field(default_factory=dict)
  # (start, end), time.monotonic(), of each evaluation: learner steps that overlap one are left
  # out of tokens/s and MFU (runtime/core/throughput.py).
  eval_windows: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  # The global model on the validation split too (config.data.validation_fraction > 0).
  validator: evaluate.Evaluator | None = None
  # time.monotonic() when `build` started: the origin of the first-step times in the summary.
  build_started_at: float | None = None
  # Where the learners and the syncer run (runtime/train.py picks it).
  transport: Transport | None = None


def global_params(run: Run) -> dict[str, Any]:
  """The global model in the native layout: the syncer's Theta, or in dp mode the learner's."""
  if run.syncer is not None:
    return model_lib.param_layout(run.settings.model).to_native(run.syncer.global_params())
  return run.learners[0].params()


def retired(run: Run) -> list[learner_lib.Learner]:
  """The failed incarnations of this run (restarted by the supervisor, or by a dp job restart)."""
  if run.supervisor is not None:
    return run.supervisor.retired
  return run.restarter.retired if run.restarter is not None else []
