"""The single-controller runtime: M learner threads on their own meshes plus a syncer thread.

`train_and_evaluate(settings)` partitions the devices, builds and compiles the learners and the
syncer, runs them, prints progress, evaluates the global model (the syncer's Theta; the learner's own
parameters in dp mode) and writes `workdir/summary.json`. It only moves data and calls the pure
pieces (fragments, merge, outer, schedule) through the learner and syncer.

It takes the `RunSettings` that `settings.validate` returned at the entry point, never the raw
config: no field can skip validation, and a misspelt field cannot silently read as a default.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import resource
import secrets
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental.compilation_cache import compilation_cache

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import outer
from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.lm import data as data_lib
from decoupled_diloco.lm import evaluate
from decoupled_diloco.lm import flops as flops_lib
from decoupled_diloco.lm import inner
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.lm import tokenizers
from decoupled_diloco.runtime.faults import checkpoint_faults
from decoupled_diloco.runtime.records import checkpoints as checkpoints_lib
from decoupled_diloco.runtime.hardware import device_memory
from decoupled_diloco.runtime.core import device_share
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.records import elastic_restore
from decoupled_diloco.runtime.records import event_tape
from decoupled_diloco.runtime.records import goodput as goodput_lib
from decoupled_diloco.runtime.faults import injector as injector_lib
from decoupled_diloco.runtime.control import job_restart
from decoupled_diloco.runtime.records import job_state
from decoupled_diloco.runtime.core import learner as learner_lib
from decoupled_diloco.runtime.control import live_bar
from decoupled_diloco.runtime.hardware import memory_fit
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.transport import ray_runtime
from decoupled_diloco.runtime.transport import ray_syncer
from decoupled_diloco.runtime.control import supervisor as supervisor_lib
from decoupled_diloco.runtime.core import syncer as syncer_lib
from decoupled_diloco.runtime.control import syncer_keeper as keeper_lib
from decoupled_diloco.runtime.core import throughput as throughput_lib


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


class Interrupted(Exception):
  """The run was stopped by SIGTERM or Ctrl-C after writing a checkpoint (or with none to write)."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.signum = signum


def _open_checkpoints(settings: settings_lib.RunSettings
                      ) -> tuple[checkpoints_lib.Checkpoints, checkpoints_lib.RestoredCheckpoint | None,
                                 elastic_restore.Change | None]:
  """The run's checkpoint directory, the checkpoint it resumes from (config.restore), and what
  the restore changes in learners and meshes (runtime/records/elastic_restore.py).

  Reads before anything compiles, so a missing or foreign checkpoint fails at once.
  """
  ck = settings.checkpoint
  fingerprint = checkpoints_lib.fingerprint(settings)
  target = checkpoints_lib.Checkpoints(ck.dir, ck.keep, fingerprint)
  source_dir, number = checkpoints_lib.locate(settings.restore, ck.dir)
  source = checkpoints_lib.Checkpoints(source_dir, ck.keep, fingerprint)
  if source.directory == target.directory:
    source = target
  if settings.restore == "none":
    if target.steps():
      raise checkpoints_lib.CheckpointError(
          f"config.restore='none' but {ck.dir} holds checkpoints {target.steps()}: a fresh run "
          f"would mix with them. Use another config.workdir or config.checkpoint.dir, remove "
          f"them, or resume (config.restore=auto)")
    return target, None, None
  if settings.restore == "auto" and not source.steps():
    return target, None, None
  restored = source.restore_job(number)
  if restored is None:
    raise checkpoints_lib.CheckpointError(
        f"config.restore={settings.restore!r}: no checkpoint in {source_dir}")
  logging.info("resuming from %s (clock %d)", restored.path, restored.cut.clock)
  elastic = elastic_restore.change(restored, settings)
  if elastic:
    # One batch size for all learners: data.learner_batch_sizes, per learner, is in the
    # fingerprint and cannot change with their number.
    elastic_restore.adapt(restored, elastic, settings.learner_batch_size * settings.data.seq_len)
    logging.info(elastic.describe(peer=max(restored.cut.learners, key=lambda c: c.step).index
                                  if restored.cut.learners else None))
  return target, restored, elastic


def build(settings: settings_lib.RunSettings, *,
          step_hook: Callable[[int, int], None] | None = None,
          with_syncer: bool = True) -> Run:
  """Partitions devices, builds learners and syncer and compiles their steps."""
  start = time.perf_counter()
  build_started_at = time.monotonic()
  if settings.replay:
    # A replay keeps earlier states for the takes that name them: none may be donated (donation
    # changes where a state lives, not its values).
    settings = dataclasses.replace(settings, donates_state=False)
    # A tape this run cannot replay is refused before anything compiles.
    event_tape.check_replayable(event_tape.load(settings.replay),
                                event_tape.settings_record(settings))
  # Before anything is written (the workdir, a cache, a checkpoint): a source with no text or too
  # little of it is the user's to fix and leaves nothing behind.
  data = settings.data
  dataset = data_lib.load_dataset(
      data.source, tokenizer=tokenizers.load(data.tokenizer), text_field=data.text_field,
      seq_len=data.seq_len, eval_fraction=data.eval_fraction,
      validation_fraction=data.validation_fraction,
      min_train_windows=settings.num_learners * max(settings.learner_batch_sizes),
      min_eval_windows=data.batch_size)
  # Before anything touches JAX (reading a checkpoint back does): the platforms and the device
  # count are fixed then.
  devices_lib.use_platform(settings.devices.platform)
  devices_lib.request_fake_cpu_devices(settings.devices.num_fake_cpu_devices)
  _use_compilation_cache(settings.compilation_cache_dir)  # before anything compiles
  saver, restored, elastic = _open_checkpoints(settings)
  history = job_state.empty_history(settings.num_learners)
  if restored is not None:
    history.update(restored.cut.history)
    history["resumes"] = list(history["resumes"]) + [
        {"from": restored.path, "clock": restored.cut.clock, "skipped": restored.skipped,
         **({"elastic": elastic.to_json()} if elastic else {})}]
  in_processes = settings.runtime == "ray"
  # With learner processes (config.runtime=ray) this process holds the syncer and one CPU device
  # for the model's initialisation and the evaluations; each learner makes its own mesh.
  learner_meshes, syncer_mesh = devices_lib.build_meshes(
      ((1, 1),) if in_processes else settings.learner_mesh_shapes, settings.syncer.num_devices,
      "cpu" if in_processes else settings.devices.platform,
      1 if in_processes else settings.devices.learners_sharing_devices)
  if settings.devices.platform == "tpu" and not in_processes:
    if settings.devices.tpu_topologies:
      devices_lib.check_tpu_topologies(learner_meshes, settings.devices.tpu_topologies)
    # Before the model is built: its remat policy is part of its program.
    settings, _ = resolve_remat(settings, {group[0]: learner_meshes[group[0]] for group in
                                           distinct_learners(settings, learner_meshes)})
  if settings.replay and restored is not None:
    raise event_tape.TapeError(f"config.replay={settings.replay!r}: config.workdir={settings.workdir!r} "
                     "holds a checkpoint; a replay starts from the recording's start, in a fresh "
                     "workdir")
  eval_batches = data_lib.make_eval_batches(
      dataset.eval, seq_len=data.seq_len, batch_size=data.batch_size,
      max_batches=settings.eval_batches)
  data_info = {"tokenizer": dataset.tokenizer.name, "records_skipped": dataset.skipped,
               "eval_tokens": sum(b["targets"].size for b in eval_batches),
               "eval_bytes": data_lib.eval_bytes(eval_batches, dataset.tokenizer)}
  tx = inner.make_inner_optimizer(settings.inner, settings.num_steps)
  model_cfg = settings.model
  sync = settings.sync if with_syncer else None
  fragments = ()
  if sync is not None:
    fragments = fragments_lib.partition(
        model_lib.param_shapes(model_cfg), sync.num_fragments, sync.fragmentation,
        embedding_names=(model_lib.EMBEDDING_NAME,))
  layout = model_lib.param_layout(model_cfg)
  injector = None
  if settings.chaos.enabled:
    injector = injector_lib.FaultInjector(
        settings.chaos.faults, settings.chaos.random_crashes, settings.num_learners,
        on_fault=lambda record: metrics.write("fault", record))
    step_hook = _chain_hooks(step_hook, injector.step_hook)
  # Learner <-> syncer links go through it: a partition fault cuts them (runtime/core/network.py).
  network = injector.network if injector is not None else None
  compile_seconds = {"init_compile_s": 0.0, "train_compile_s": 0.0, "eval_compile_s": 0.0,
                     "syncer_compile_s": 0.0}
  # The initial parameters, made once: every learner is placed from them, and the syncer's Theta
  # starts at them (with learner processes, the only model this process makes).
  started = time.perf_counter()
  graphdef, params = model_lib.init_params(model_cfg, learner_meshes[0], settings.seed)
  initial = {n: np.asarray(v) for n, v in jax.device_get(params).items()}
  compile_seconds["init_compile_s"] = time.perf_counter() - started
  built = []
  if not in_processes:
    # Each learner's step compiles for its own mesh, side by side on hosts with cores to spare
    # (XLA releases the GIL while it compiles; see compile_workers).
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(compile_workers(len(learner_meshes)),
                                               thread_name_prefix="compile") as pool:
      parts = list(pool.map(
          lambda index: learner_parts(settings, index, learner_meshes[index], graphdef, initial,
                                      tx, dataset),
          range(len(learner_meshes))))
    compile_seconds["train_compile_s"] = time.perf_counter() - started
    for index, (train_step, state, shardings, batches, _) in enumerate(parts):
      if injector is not None:
        train_step = injector.wrap_train_step(index, train_step)  # nan faults corrupt its output
      built.append((train_step, state, shardings, batches))
  # Only now, with the data read and every learner's step compiled and checked against its
  # device's memory: an input the run cannot use leaves the workdir, and an earlier run's files
  # in it, untouched.
  metrics = metrics_lib.MetricsWriter(
      settings.workdir, resume_at_s=history["wall_seconds"] if restored is not None else None,
      tape=settings.tape and not settings.replay)
  if metrics.taping:
    metrics.tape_event("config", {"format": event_tape.FORMAT,
                                  "config": event_tape.settings_record(settings)})
  syncer, port = None, None

  secret = secrets.token_bytes(32)  # runtime=ray: this job's MAC key (runtime/transport/ray_runtime.py)
  if in_processes:
    ray_runtime.start_ray(settings.ray.address,
                          settings.num_learners * settings.ray.processes_per_learner)

  def make_syncer():
    """A syncer at the initial Theta, compiled (at start-up, and again after a crash): in this
    process, or (runtime=ray) a process of its own, which after a crash Ray has restarted."""
    if in_processes:
      return ray_syncer.start_syncer(settings, secret, metrics) if syncer is None \
          else ray_syncer.restarted(syncer)
    return make_local_syncer(settings, metrics=metrics, network=network, initial=initial,
                             syncer_mesh=syncer_mesh)

  if sync is not None:
    syncer = make_syncer()
    port = keeper_lib.SyncerPort(syncer, network)
    compile_seconds["syncer_compile_s"] = syncer.compile_seconds
    if restored is not None:
      syncer.load_state(restored.cut.syncer, with_history=True)
  # Late learners that have not joined yet (in a resumed run: by the checkpoint's faults).
  joined = {f["learner"] for f in history["faults"] if f["fault"] == "join"}
  held_back = tuple(m for m in settings.late_learners if m not in joined)
  learner_cuts = _learner_cuts(restored, history, syncer, layout, held_back,
                               elastic.joining if elastic else ()) if restored else {}
  learners = []
  supervisor_box: list[supervisor_lib.Supervisor | None] = [None]  # built after the learners

  def peer_repairing() -> bool:
    return supervisor_box[0] is not None and supervisor_box[0].repairing

  if in_processes:
    learners = ray_runtime.start_learners(settings, secret=secret, port=port, metrics=metrics,
                                          layout=layout, cuts=learner_cuts, step_hook=step_hook)
    for learner in learners:
      cut = learner_cuts.get(learner.index)
      syncer.attach(learner.index, learner, step=learner.step, incarnation=learner.incarnation,
                    anchor_versions=learner.counters().anchor_versions if cut else None)
  # Learners on the same devices take turns on them (runtime/core/device_share.py).
  turns = device_share.turns_for(len(built), settings.devices.learners_sharing_devices)
  for index, (train_step, state, shardings, batches) in enumerate(built):
    options = learner_options(settings, index)
    cut = learner_cuts.get(index)
    learner = learner_lib.Learner(
        index, train_step=train_step, state=state, param_shardings=shardings, batches=batches,
        fragments=fragments, syncer=port, metrics=metrics, step_hook=step_hook, layout=layout,
        options=options,
        snapshot=job_state.learner_snapshot(cut, state) if cut is not None else None,
        incarnation=cut.incarnation if cut is not None else 0,
        peer_repairing=peer_repairing if sync is not None and sync.lock_step else None,
        turns=turns[index])
    learners.append(learner)
    if syncer is not None and index not in held_back:
      syncer.attach(index, learner, step=learner.step, incarnation=learner.incarnation,
                    anchor_versions=learner.counters().anchor_versions if cut else None)
  # The global model is evaluated where the model lives: on learner 0's mesh, sharded the way that
  # learner shards it (in dp mode, the whole learner mesh). Never on the host CPU, where a model
  # sharded over many chips would not fit. Evaluations during training borrow learner 0's devices.
  evaluator = evaluate.Evaluator(graphdef, model_cfg, learner_meshes[0], eval_batches)
  started = time.perf_counter()
  evaluator.compile()
  validator = None
  if dataset.validation is not None:  # the same program on other batches of the same shape
    validator = evaluate.Evaluator(graphdef, model_cfg, learner_meshes[0], data_lib.make_eval_batches(
        dataset.validation, seq_len=data.seq_len, batch_size=data.batch_size,
        max_batches=settings.eval_batches))
    validator.compile()
  compile_seconds["eval_compile_s"] = time.perf_counter() - started
  supervisor, keeper, restarter = None, None, None
  repaired_at = injector.repaired_at if injector is not None else lambda _: 0.0
  if in_processes:
    # A learner process is repaired once its devices are back (config.chaos's down_s) and Ray has
    # restarted it (runtime/transport/ray_runtime.py).
    devices_back = repaired_at
    repaired_at = lambda m: devices_back(m) if learners[m].process_up() else math.inf  # noqa: E731
  if syncer is not None and not sync.lock_step:
    keeper = keeper_lib.SyncerKeeper(
        syncer=syncer, port=port, make_syncer=make_syncer, learners=learners,
        checkpoints=saver if settings.checkpoint.every_steps else None,
        every_s=settings.checkpoint.syncer_every_s,
        faults=injector.syncer_faults if injector is not None else (), metrics=metrics)
  if syncer is not None:
    # Lock-step modes restart a failed learner the same way; their barrier waits for it (or, with
    # config.sync.elastic_lock_step, merges without it until it is back: syncer.py).
    current_syncer = (lambda: None if keeper.down else keeper.syncer) if keeper is not None \
        else (lambda: syncer)
    supervisor = supervisor_lib.Supervisor(
        learners, current_syncer, init_opt_state=jax.jit(tx.init), repaired_at=repaired_at,
        max_restarts=settings.max_restarts, metrics=metrics, late_learners=held_back,
        on_join=injector.record_join if injector is not None else None)
    supervisor.restarts = list(history["restarts"])
    supervisor.start_steps = list(history["start_steps"])
    supervisor_box[0] = supervisor
  else:
    _, state0, shardings0, _ = built[0]

    def compile_step():
      """The dp step compiled again, as a restarted job compiles it (a new jit object)."""
      step = inner.make_train_step(
          graphdef, tx, learner_meshes[0],
          inner.train_state_shardings(state0, learner_meshes[0], shardings0), donate=settings.donates_state)
      _compile(step, state0, settings.learner_batch_size, data.seq_len)
      return injector.wrap_train_step(0, step) if injector is not None else step

    first_data = learners[0].published.data_state  # where the loader starts

    def initial_state() -> learner_lib.LearnerSnapshot:
      """Step 0 made again from the seed, as a job restarted with no checkpoint makes it."""
      _, params = model_lib.init_params(model_cfg, learner_meshes[0], settings.seed)
      none = np.zeros(0, np.int64)  # dp has no fragments
      return learner_lib.LearnerSnapshot(
          step=0, train_state=inner.init_train_state(params, tx, learner_meshes[0], shardings0),
          data_state=first_data, counter_steps=none, counter_tokens=none, since=none, anchors={},
          anchor_versions=none)

    restarter = job_restart.JobRestarter(
        learners, checkpoints=saver if settings.checkpoint.every_steps else None,
        resumed_from=restored, compile_step=compile_step, initial_state=initial_state,
        repaired_at=repaired_at,
        max_restarts=settings.max_restarts, metrics=metrics)
  if injector is not None and restored is not None:
    injector.resume(history["train_seconds"], history["faults"], [l.step for l in learners])
  corrupter = None
  if injector is not None and injector.checkpoint_faults:
    corrupter = checkpoint_faults.CheckpointCorrupter(
        injector.checkpoint_faults, saver if settings.checkpoint.every_steps else None, metrics)
  return Run(settings, learners, syncer, evaluator, metrics, fragments,
             model_lib.num_params(initial), time.perf_counter() - start, compile_seconds,
             injector, supervisor, saver if settings.checkpoint.every_steps else None,
             history, restored, keeper, corrupter, restarter=restarter, data_info=data_info,
             validator=validator, build_started_at=build_started_at)


def make_local_syncer(settings: settings_lib.RunSettings, *, metrics, network=None,
                      initial: dict[str, np.ndarray] | None = None, syncer_mesh=None
                      ) -> syncer_lib.Syncer:
  """A syncer at the initial Theta, compiled, in this process: the controller's (runtime=threads)
  or the syncer process's own (runtime=ray, which passes neither `initial` nor `syncer_mesh`:
  it makes its mesh of this process's CPU devices and the initial parameters from the seed)."""
  model_cfg, sync = settings.model, settings.sync
  if initial is None or syncer_mesh is None:
    (init_mesh,), syncer_mesh = devices_lib.build_meshes(
        ((1, 1),), settings.syncer.num_devices, "cpu")
    _, params = model_lib.init_params(model_cfg, init_mesh, settings.seed)
    initial = {n: np.asarray(v) for n, v in jax.device_get(params).items()}
  fragments = fragments_lib.partition(
      model_lib.param_shapes(model_cfg), sync.num_fragments, sync.fragmentation,
      embedding_names=(model_lib.EMBEDDING_NAME,))
  layout = model_lib.param_layout(model_cfg)
  made = syncer_lib.Syncer(
      sync=sync, fragments=fragments, mesh=syncer_mesh,
      # Theta and the outer state are float32 whatever config.model.param_dtype.
      initial_params={n: np.asarray(v, np.float32) for n, v in layout.to_flat(initial).items()},
      outer_tx=outer.make_outer_optimizer(settings.outer.name, settings.outer.learning_rate,
                                          settings.outer.momentum),
      merge=settings.merge, compression=settings.compression,
      num_learners=settings.num_learners, num_workers=settings.syncer.num_workers,
      metrics=metrics, network=network,
      # The robust merge judges outer-gradient norms per unit of the learners' learning rate.
      inner_learning_rates=inner.learning_rates(settings.inner, settings.num_steps),
      learners_sharing_devices=settings.devices.learners_sharing_devices)
  made.compile()
  return made


def compile_workers(num_learners: int, cpu_count: int | None = None) -> int:
  """How many learners' steps `build` compiles at once: one per two host cores.

  Each compile in flight holds XLA's working memory: on a 2-core CPU the default run's peak RSS
  was 0.93 GB compiling one at a time, 1.19 GB two and 1.66 GB four at once, for builds of 13.8,
  12.6 and 13.6 s (XLA's own compile already keeps both cores busy; 2026-11-25, 30 steps, cold
  compilation cache).
  """
  cpu_count = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
  return max(1, min(num_learners, cpu_count // 2))


# The learners' jitted train steps of this process, by everything their program depends on: a run
# built again in the same process with the same model, optimizer and mesh, whatever its schedule (a
# resumed or restarted job, a benchmark's arms, the tests) takes the step with its compiled
# program instead of tracing it and loading it from the compilation cache again. Bounded: each
# holds its executables.
_TRAIN_STEPS: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()
_TRAIN_STEPS_LOCK = threading.Lock()
_MAX_TRAIN_STEPS = 16
# A lock per jitted program: learners that share devices (and so the program) compile it once.
_COMPILING: "weakref.WeakKeyDictionary[Any, threading.Lock]" = weakref.WeakKeyDictionary()


def learner_step(settings: settings_lib.RunSettings, mesh, graphdef, tx, state_like
                 ) -> inner.TrainStep:
  """The jitted train step of a learner on `mesh` whose state is shaped and sharded like
  `state_like` (arrays or sharded ShapeDtypeStructs), on `tx`'s schedule: one made before for the
  same program if this process has it (`_TRAIN_STEPS`)."""
  shardings = model_lib.param_shardings(settings.model, mesh)
  state_shardings = inner.train_state_shardings(state_like, mesh, shardings)
  leaves, treedef = jax.tree.flatten(state_shardings)
  # `tx` is made from settings.inner and num_steps alone (make_inner_optimizer); its schedule is
  # an argument of the program, so the program does not depend on it.
  key = (graphdef, settings.model, tx.program_key, mesh, treedef, tuple(leaves),
         settings.donates_state)
  with _TRAIN_STEPS_LOCK:
    train_step = _TRAIN_STEPS.pop(key, None)
    if train_step is None:
      train_step = inner.make_train_step(graphdef, tx, mesh, state_shardings,
                                         donate=settings.donates_state)
    _TRAIN_STEPS[key] = train_step  # the newest last; the oldest goes first
    while len(_TRAIN_STEPS) > _MAX_TRAIN_STEPS:
      _TRAIN_STEPS.popitem(last=False)
  return train_step.with_schedule(tx.schedule_values)


# What a learner holds on its chips while its step runs, besides the step's own buffers.
ALONGSIDE_TRAIN_STEP = "the publication's copy of the parameters"


def compile_train_step(settings: settings_lib.RunSettings, index: int, mesh
                       ) -> tuple[Any, memory_fit.Fit, inner.TrainState]:
  """Learner `index`'s train step compiled ahead of time for `mesh` (a TPU slice, or the
  compile-only devices of a TPU topology: runtime/hardware/tpu_aot.py) from abstract shapes, with the
  run's shardings and donation; how its HBM per chip fits the chip (the executable is None when
  the compiler refused it for lack of HBM); and the abstract train state."""
  device = mesh.devices.flat[0]
  usable = memory_fit.usable_hbm_bytes(device)
  if usable is None:
    raise ValueError(f"learner {index}'s devices are {device.device_kind}, not TPU chips of "
                     f"runtime/core/throughput.py's table: their HBM is not known")
  tx = inner.make_inner_optimizer(settings.inner, settings.num_steps)
  like = inner.abstract_train_state(model_lib.native_shapes(settings.model), tx, mesh,
                                    model_lib.param_shardings(settings.model, mesh))
  step = learner_step(settings, mesh, model_lib.graph(settings.model), tx, like)
  batch = inner.abstract_batch(mesh, settings.learner_batch_sizes[index], settings.data.seq_len)
  # While the step runs, the learner's publication refers to a device copy of the parameters.
  compiled, fit = memory_fit.compile_and_measure(
      step.lower(like, batch), alongside_bytes=memory_fit.bytes_per_chip(like.params),
      usable_bytes=usable, arguments="its train state and batch",
      arguments_bytes=memory_fit.bytes_per_chip((like, batch)))
  return compiled, fit, like


def check_learner_fits(settings: settings_lib.RunSettings, index: int, mesh) -> memory_fit.Fit:
  """Refuses (memory_fit.DoesNotFit, with every figure and the fields that change them) a learner
  whose compiled train step does not fit its TPU chips' HBM: before anything is placed on them,
  instead of failing in its first step."""
  _, fit, _ = compile_train_step(settings, index, mesh)
  batch_field = (f"config.data.learner_batch_sizes[{index}]={settings.learner_batch_sizes[index]}"
                 if settings.data.learner_batch_sizes else
                 f"config.data.batch_size={settings.data.batch_size}")
  memory_fit.refuse_unless_fits(
      fit, what=f"learner {index}'s train step", device_kind=mesh.devices.flat[0].device_kind,
      alongside=ALONGSIDE_TRAIN_STEP,
      fields=f"give it more chips or split them otherwise (config.learner_mesh_shapes[{index}]="
             f"{settings.learner_mesh_shapes[index]}), rematerialise more of each block "
             f"(config.model.remat={settings.model.remat!r}; 'auto' picks the cheapest policy "
             f"that fits) or lower {batch_field}")
  return fit


def distinct_learners(settings: settings_lib.RunSettings, meshes) -> list[list[int]]:
  """The learners grouped by the programs they run: same chip kind, mesh shape and batch."""
  groups: dict[Any, list[int]] = {}
  for index, mesh in enumerate(meshes):
    key = (mesh.devices.flat[0].device_kind, mesh.devices.shape,
           settings.learner_batch_sizes[index])
    groups.setdefault(key, []).append(index)
  return list(groups.values())


def resolve_remat(settings: settings_lib.RunSettings, meshes: dict[int, Any]
                  ) -> tuple[settings_lib.RunSettings, dict[str, list[memory_fit.Fit]]]:
  """config.model.remat='auto' made the cheapest policy whose train steps, compiled for the TPU
  meshes of `meshes` (learner index -> mesh, one per distinct learner), all fit with
  memory_fit.HBM_MARGIN to spare (memory_fit.choose_remat), and the fit of every policy tried.
  Any other value stands."""
  if settings.model.remat != "auto":
    return settings, {}

  def with_policy(policy: str) -> settings_lib.RunSettings:
    return dataclasses.replace(settings, model=dataclasses.replace(settings.model, remat=policy))

  def fits(policy: str) -> list[memory_fit.Fit]:
    return [compile_train_step(with_policy(policy), index, mesh)[1]
            for index, mesh in meshes.items()]

  policy, tried = memory_fit.choose_remat(fits)
  logging.info("config.model.remat='auto' picked %s; of the usable HBM per chip the largest "
               "learner step needs %s", policy, memory_fit.describe_tried(tried))
  return with_policy(policy), tried


def learner_parts(settings: settings_lib.RunSettings, index: int, mesh, graphdef, initial, tx,
                  dataset: data_lib.Dataset, *, own_process: bool = False):
  """Learner `index`'s compiled step, initial state on `mesh`, parameter shardings and batches,
  and the seconds its step took to compile. The same in every runtime: a learner thread of this
  process, or a learner process of its own (`runtime/transport/ray_runtime.py`, `own_process`: its devices
  hold only this learner, as far as this process can tell).

  Before any state is placed: on TPU chips, a learner whose step does not fit their HBM is refused
  (`check_learner_fits`); on any device that reports its memory, the step is compiled from shapes
  and the needs of every learner on the devices are checked against it (runtime/hardware/device_memory.py)."""
  on_tpu = memory_fit.usable_hbm_bytes(mesh.devices.flat[0]) is not None
  if on_tpu:
    check_learner_fits(settings, index, mesh)
  shardings = model_lib.param_shardings(settings.model, mesh)
  abstract = inner.abstract_train_state(
      {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in initial.items()}, tx, mesh, shardings)
  train_step = learner_step(settings, mesh, graphdef, tx, abstract)
  with _TRAIN_STEPS_LOCK:
    # Learners that share devices share the program too: one compiles it, the others wait.
    compiling = _COMPILING.setdefault(train_step.jitted, threading.Lock())
  started = time.perf_counter()
  batch_size = settings.learner_batch_sizes[index]
  sharing = 1 if own_process else settings.devices.learners_sharing_devices
  with compiling:
    if not (on_tpu and sharing == 1):  # a lone learner on TPU chips: check_learner_fits did it
      device_memory.check_learner(settings, train_step, abstract, batch_size, mesh,
                                  learners=sharing, holds_eval=not own_process and index < sharing)
    # Every learner starts from the same parameters (the same seed gives the same values on any
    # mesh): placed from the host instead of compiling the initialiser once per mesh.
    params = {n: jax.device_put(v, shardings[n]) for n, v in initial.items()}
    state = inner.init_train_state(params, tx, mesh, shardings)
    _compile(train_step, state, batch_size, settings.data.seq_len)
  seconds = time.perf_counter() - started
  loader = data_lib.make_train_loader(
      dataset.train, seq_len=settings.data.seq_len, batch_size=batch_size,
      shard_index=index, num_shards=settings.num_learners, seed=settings.seed)
  return train_step, state, shardings, iter(loader), seconds


def learner_options(settings: settings_lib.RunSettings, index: int) -> learner_lib.LearnerOptions:
  sync = settings.sync
  return learner_lib.LearnerOptions(
      num_steps=settings.num_steps,
      lock_step=bool(sync and sync.lock_step),
      schedule=sync.schedule if sync else None,
      alpha=settings.merge.alpha,
      keep_in_flight_progress=settings.merge.keep_in_flight_progress,
      step_delay_s=settings.learner_step_delays_s[index],
      step_noise_s=settings.learner_step_noise_s,
      noise_seed=(settings.seed, index),
      log_every=settings.log_every,
      wait_timeout_s=settings.stall_timeout_s,
      profile_steps=settings.profile_steps if index == 0 else None,
      profile_dir=os.path.join(settings.workdir, "profile"),
  )


def _learner_cuts(restored: checkpoints_lib.RestoredCheckpoint, history: dict[str, Any],
                  syncer: syncer_lib.Syncer | None, layout: model_lib.ParamLayout,
                  held_back: tuple[int, ...], joining: tuple[int, ...] = ()
                  ) -> dict[int, checkpoints_lib.LearnerCut]:
  """Each learner's state in the checkpoint; one absent from it (it had failed and was waiting
  for its repair when the cut was taken) rejoins from a peer's state and the syncer's Theta. A
  late learner that had not joined yet (`held_back`) still joins at its join second. `joining`:
  learners the checkpoint's run did not have (an elastic restore), which start the same way."""
  cuts = {c.index: c for c in restored.cut.learners}
  absent = [m for m in range(len(history["steps_made"])) if m not in cuts and m not in held_back]
  if absent and (syncer is None or not cuts):
    raise checkpoints_lib.CheckpointError(
        f"{restored.path} holds no state of learner(s) {absent} and no peer to rejoin from")
  for m in absent:
    peer = max(cuts.values(), key=lambda c: c.step)
    theta, versions = syncer.model.received()
    data_state = history.get("absent_data", {}).get(str(m))
    incarnation = history["incarnations"][m] + 1
    cuts[m] = job_state.rejoin_cut(m, incarnation, peer, layout.to_native(theta), theta, versions,
                                   data_state.encode() if data_state else None)
    history["incarnations"][m], history["start_steps"][m] = incarnation, peer.step
    if m not in joining:
      logging.info("learner %d was down at the checkpoint: it rejoins from learner %d's state at "
                   "step %d and the syncer's Theta", m, peer.index, peer.step)
  return cuts


def _use_compilation_cache(directory: str | None) -> None:
  """Compiled programs go to (and come from) `directory`; None leaves JAX's settings alone.

  The cache is process-global, and JAX opens it once, at the first compile after its directory
  is set: a run in a process that used another directory before (tests) resets it. Every program
  is cached, not only those that compiled for over a second (JAX's default): a learner's step
  on a small model compiles in less, and a restart pays for all of them together.
  """
  if directory is None:
    return
  if jax.config.jax_compilation_cache_dir != directory:
    compilation_cache.set_cache_dir(directory)
    compilation_cache.reset_cache()
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _chain_hooks(*hooks):
  hooks = [h for h in hooks if h is not None]

  def hook(learner: int, step: int) -> None:
    for h in hooks:
      h(learner, step)

  return hook


def _compile(train_step, state, batch_size: int, seq_len: int) -> None:
  """Runs the step once on a throw-away batch so the learner starts with a compiled step whose
  first execution is behind it too (a first step several times longer than the next ones would
  read as a missed heartbeat). A donating step takes a state of zeros shaped like `state` (which
  may itself have been donated already: a dp job restarted compiles its step again): at build
  only, two states are on the devices at once."""
  zeros = np.zeros((batch_size, seq_len), np.int32)
  if inner.donates_state(train_step):
    # Placed with the very sharding objects of `state`, so the call files the same cache entry;
    # only the metadata of `state` is read.
    state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), state)
  _, step_metrics = train_step(state, {"inputs": zeros, "targets": zeros})
  jax.block_until_ready(step_metrics)


def global_params(run: Run) -> dict[str, Any]:
  """The global model in the native layout: the syncer's Theta, or in dp mode the learner's."""
  if run.syncer is not None:
    return model_lib.param_layout(run.settings.model).to_native(run.syncer.global_params())
  return run.learners[0].params()


def execute(run: Run, *, progress: bool = True) -> dict[str, Any]:
  """Runs a built run to the end; returns (and writes) the summary.

  Any failure of the syncer, a stall of every learner for `config.stall_timeout_s`, or a Ctrl-C
  stops every learner and the syncer before the error propagates: no thread trains on alone.
  SIGTERM or a first Ctrl-C (from the main thread's handlers) writes a checkpoint first and
  raises `Interrupted`; a second one exits at once.
  """
  settings, learners, syncer = run.settings, run.learners, run.syncer
  start = time.perf_counter()
  evals: list[dict[str, Any]] = list(run.history["evals"])
  saver = _Checkpointer(run, evals, start)
  stop = _StopSignal()
  try:
    stop.install()
    if syncer is not None:
      syncer.start()
    started = time.monotonic()  # the origin of the fault and failure records' seconds
    run.started_at = started
    saver.train_started = time.perf_counter()
    if run.injector is not None:
      run.injector.start(started)
    if run.supervisor is not None:
      run.supervisor.start(started)
    if run.restarter is not None:
      run.restarter.start(started)
    if run.keeper is not None:
      run.keeper.start(started, run.history["train_seconds"], run.history["faults"])
    if run.corrupter is not None:
      run.corrupter.start(started, run.history["train_seconds"], run.history["faults"])
    for learner in learners:
      if run.supervisor is None or not run.supervisor.holds_back(learner.index):
        learner.start()
    bar = live_bar.LiveBar(settings.num_steps) if progress else None
    try:
      _train_until_done(run, evals, progress, saver, stop, bar)
    finally:
      if bar is not None:
        bar.close()
    if stop.signum is not None:
      _stop_with_checkpoint(run, saver, stop.signum)
    if run.injector is not None:
      run.injector.stop()
    if run.supervisor is not None:
      run.supervisor.stop()
      _check_supervisor(run.supervisor)
    train_seconds = time.perf_counter() - saver.train_started
    syncer = run.syncer  # the current one (a crashed syncer was replaced)
    if syncer is not None:
      # Merge what every learner did since its last sync, so the global model holds all the work.
      if not syncer.flush(timeout=run.settings.stall_timeout_s):
        raise RuntimeError(f"the final flush did not finish within config.stall_timeout_s="
                           f"{run.settings.stall_timeout_s} s")
    # The final checkpoint: a run resumed from it has nothing left to train.
    saver.save_now(timeout_s=run.settings.stall_timeout_s, train_seconds=train_seconds)
    for learner in learners:
      learner.release()
    for learner in learners:
      learner.join()
    if syncer is not None:
      syncer.stop()
      syncer.join()
      _check_syncer(syncer)
    if settings.runtime == "ray":
      for learner in learners:
        learner.check_replicas()  # a learner over several processes: are they still one?
      ray_runtime.shutdown(list(learners) + [syncer])
    saver.close()
  except BaseException:
    _shut_down(run)
    saver.close(raise_errors=False)
    raise
  finally:
    stop.uninstall()
  final = _evaluate(run, max(l.step for l in learners), final=True)
  evals.append(final)
  train_seconds += run.history["train_seconds"]
  wall_seconds = time.perf_counter() - start + run.history["wall_seconds"]
  summary = _summary(run, evals, train_seconds, wall_seconds)
  summary.update(_params_hashes(run))
  summary.update(goodput_lib.summary(goodput_lib.whole_run(
      run, started_at=run.started_at, ended_at=time.monotonic(), final=True)))
  run.metrics.flush()
  with open(os.path.join(settings.workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  if progress:
    logging.info("done: final eval loss %.4f nats/token (%.4f bits/byte), %.1f s, summary in %s",
                 final["eval_loss"], final["eval_bits_per_byte"], summary["wall_seconds"],
                 os.path.join(settings.workdir, "summary.json"))
    logging.info("goodput %.1f%% (learner-seconds on steps that reached the global model), uptime "
                 "%.1f%% (wall time with a learner training); per learner in time_buckets",
                 100 * summary["goodput"], 100 * summary["uptime"])
  run.metrics.close()
  return summary


# A second signal this soon after the first is the same one, not a user pressing Ctrl-C again:
# `timeout`, Slurm and a terminal signal the whole process group, so a run under a wrapper gets
# two SIGINTs a few ms apart (2 ms measured under `timeout`, 2026-11-26). A person pressing Ctrl-C
# twice on purpose takes longer than this.
SAME_SIGNAL_WINDOW_S = 1.0


class _StopSignal:
  """SIGTERM / SIGINT handlers of the main thread: the first asks for a checkpoint and a clean
  stop, a second one more than SAME_SIGNAL_WINDOW_S later exits at once. Elsewhere (a run started
  from another thread) it does nothing: signals reach only the main thread."""

  def __init__(self, clock: Callable[[], float] = time.monotonic,
               exit_now: Callable[[int], None] = os._exit):  # pylint: disable=protected-access
    self.signum: int | None = None
    self._first_at: float | None = None
    self._clock = clock
    self._exit_now = exit_now
    self._previous: dict[int, Any] = {}

  def install(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      return
    for signum in (signal.SIGTERM, signal.SIGINT):
      self._previous[signum] = signal.signal(signum, self._handle)

  def uninstall(self) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def _handle(self, signum: int, frame) -> None:
    del frame
    now = self._clock()
    if self.signum is not None:
      if now - self._first_at < SAME_SIGNAL_WINDOW_S:
        return  # the process group's copy of the first signal
      logging.error("%s again: exiting at once, without a checkpoint",
                    signal.Signals(signum).name)
      logging.flush()
      self._exit_now(128 + signum)
      return
    self.signum, self._first_at = signum, now
    logging.warning("%s: writing a checkpoint, then stopping (send it again after %g s to exit "
                    "at once)", signal.Signals(signum).name, SAME_SIGNAL_WINDOW_S)


def _stop_with_checkpoint(run: Run, saver: "_Checkpointer", signum: int) -> None:
  name = signal.Signals(signum).name
  if run.checkpoints is None:
    raise Interrupted(signum, f"stopped by {name} at step {max(l.step for l in run.learners)}; "
                              "no checkpoint written (config.checkpoint.every_steps=0)")
  path = saver.save_now(timeout_s=run.settings.stall_timeout_s,
                        train_seconds=time.perf_counter() - saver.train_started)
  saver.close()
  if path is None:
    raise Interrupted(signum, f"stopped by {name}; no consistent checkpoint could be taken, the "
                              f"newest on disk is in {run.checkpoints.directory}")
  raise Interrupted(signum, f"stopped by {name}; checkpoint written to {path}: run the same "
                            "command again to resume (config.restore=auto)")


class _Checkpointer:
  """Takes the job's checkpoints: every config.checkpoint.every_steps of the clock, the final
  one, and one on a stop signal. A cut is asked of the syncer (dp mode: the learner's latest
  publication is one) and written in the background while the learners train."""

  def __init__(self, run: Run, evals: list[dict[str, Any]], started: float):
    self._run = run
    self._evals = evals
    self._started = started
    self.train_started = started
    every = run.settings.checkpoint.every_steps
    clock = max((l.step for l in run.learners), default=0)
    self._next = (clock // every + 1) * every if every else None
    self._pending: concurrent.futures.Future | None = None  # a cut asked for, not yet taken
    self._pending_due = 0  # the clock it was due at
    self._asked: Any = None  # the syncer it was asked of

  def tick(self, clock: int) -> None:
    """From the controller's loop: asks for a cut when one is due, writes it when it comes."""
    run = self._run
    if run.checkpoints is None:
      return
    run.checkpoints.raise_if_failed()
    if self._pending is not None:
      future = self._pending
      if future.done():
        self._pending = None
        self._write(future.result())
      elif self._drop_orphan():
        self._next = self._pending_due  # asked again once the new syncer is up
      return
    if clock < self._next or clock >= run.settings.num_steps:
      return  # the final checkpoint is taken after the flush
    if run.supervisor is not None and run.supervisor.pending:
      return  # a learner is down: the cut waits until it is back
    if run.restarter is not None and run.restarter.pending:
      return  # the dp job is down
    if run.keeper is not None and run.keeper.down:
      return  # and until the syncer is
    due, self._next = self._next, self._next + run.settings.checkpoint.every_steps
    self._pending, self._pending_due = self._ask(timeout_s=self._cut_timeout(), min_step=due), due

  def _drop_orphan(self) -> bool:
    """Drops the pending cut if it was asked of a syncer that crashed since (asked just before
    its crash, it is never answered), so that the new one is asked; returns whether it did."""
    if self._asked is self._run.syncer:
      return False
    logging.warning("the checkpoint cut due at step %d was asked of the syncer that crashed; "
                    "asking its successor", self._pending_due)
    self._pending = None
    return True

  def save_now(self, timeout_s: float, train_seconds: float) -> str | None:
    """Takes a cut now and starts writing it; returns its path (None: no checkpoint)."""
    run = self._run
    if run.checkpoints is None:
      return None
    if self._pending is not None and not self._drop_orphan():
      self._pending.result(timeout=timeout_s)  # superseded below
      self._pending = None
    cut = self._ask(timeout_s=timeout_s).result(timeout=timeout_s + 5)
    return self._write(cut, train_seconds=train_seconds)

  def _cut_timeout(self) -> float:
    times = [np.mean(l.step_times[-10:]) for l in self._run.learners if l.step_times]
    return max(5.0, 10.0 * max(times, default=0.0))

  def _ask(self, timeout_s: float, min_step: int = 0) -> concurrent.futures.Future:
    """A cut, as a future; dp mode: of step `min_step` or later (the clock it was due at; a
    learner's publication runs one step behind its clock)."""
    run = self._run
    self._asked = run.syncer
    if run.syncer is not None:
      return run.syncer.request_cut(timeout_s)
    future: concurrent.futures.Future = concurrent.futures.Future()
    if run.restarter is not None and run.restarter.pending:
      future.set_result(None)  # the dp job is down: its state is lost, there is nothing to cut
      return future
    learner = run.learners[0]  # dp: a publication is a consistent state by itself
    published = learner.full_publication(timeout_s, min_step)  # holding the optimizer state
    future.set_result(None if published is None else syncer_lib.SyncerCut(
        None, {0: published}, {0: learner.incarnation}, learner.step))
    return future

  def _write(self, cut: syncer_lib.SyncerCut | None, train_seconds: float | None = None
             ) -> str | None:
    run = self._run
    if cut is None:
      return None
    if not cut.publications:
      # Every learner was down at the cut: no state to resume from (the syncer's alone is not a
      # job). The next cut is tried at the next interval.
      logging.warning("checkpoint skipped: no learner was up at the cut")
      return None
    if train_seconds is None:
      train_seconds = time.perf_counter() - self.train_started
    learners = [job_state.learner_cut(m, cut.incarnations[m], pub)
                for m, pub in sorted(cut.publications.items())]
    # Numbered by the fastest learner's step: it only grows, and the final one is num_steps (the
    # syncer's clock runs ahead of every learner once the fastest has finished).
    clock = max(c.step for c in learners)
    job = checkpoints_lib.JobCut(clock, learners, cut.state,
                                 self._history(cut, train_seconds))
    run.checkpoints.save_job(job)
    path = os.path.join(run.checkpoints.directory, "job", str(clock))
    run.metrics.write("checkpoint", {"clock": clock, "path": path,
                                     "learners": sorted(cut.publications)})
    logging.info("checkpoint of step %d: %s (written in the background)", clock, path)
    return path

  def _history(self, cut: syncer_lib.SyncerCut, train_seconds: float) -> dict[str, Any]:
    """The run so far, as of the cut: what a run resumed from it adds its own to."""
    run, base = self._run, self._run.history
    supervisor = run.supervisor
    retired = _retired(run)
    steps_made, discarded_steps, discarded_tokens, absent_data = [], [], [], {}
    for m, current in enumerate(run.learners):
      this_run = [l for l in retired if l.index == m]
      made = sum(l.steps_made for l in this_run)
      if m in cut.publications and current not in retired:
        made += cut.publications[m].step - current.start_step
        this_run.append(current)
      else:
        absent_data[str(m)] = (current.data_position() or b"").decode()
      steps_made.append(base["steps_made"][m] + made)
      discarded_steps.append(base["discarded_fragment_steps"][m] +
                             sum(l.discarded_fragment_steps for l in this_run))
      discarded_tokens.append(base["discarded_fragment_tokens"][m] +
                              sum(l.discarded_fragment_tokens for l in this_run))
    faults = [dict(f) for f in run.injector.records] if run.injector is not None else []
    faults += [dict(f) for f in run.keeper.fault_records] if run.keeper is not None else []
    faults += [dict(f) for f in run.corrupter.records] if run.corrupter is not None else []
    failures = supervisor.summary_records() if supervisor is not None else []
    failures += run.restarter.summary_records() if run.restarter is not None else []
    barrier_wait = base.get("barrier_wait_seconds", [0.0] * len(run.learners))
    return {
        "barrier_wait_seconds": [barrier_wait[m] + sum(
            l.barrier_wait_s for l in run.learners + retired if l.index == m)
            for m in range(len(run.learners))],
        "steps_made": steps_made,
        "discarded_fragment_steps": discarded_steps,
        "discarded_fragment_tokens": discarded_tokens,
        "incarnations": [l.incarnation for l in run.learners],
        "start_steps": list(supervisor.start_steps) if supervisor else list(base["start_steps"]),
        "restarts": list(supervisor.restarts) if supervisor else list(base["restarts"]),
        "evals": list(self._evals),
        "faults": list(base["faults"]) + faults,
        "failures": list(base["failures"]) + failures,
        "train_seconds": base["train_seconds"] + train_seconds,
        "wall_seconds": base["wall_seconds"] + time.perf_counter() - self._started,
        "resumes": list(base["resumes"]),
        "dropped_learners": list(base.get("dropped_learners", ())),
        "absent_data": absent_data,
        "time_accounting": goodput_lib.whole_run(
            run, started_at=run.started_at, ended_at=time.monotonic(), final=False).to_json(),
    }

  def close(self, raise_errors: bool = True) -> None:
    run = self._run
    if run.checkpoints is None:
      return
    try:
      run.checkpoints.close()
    except Exception:  # pylint: disable=broad-except
      if raise_errors:
        raise
      logging.exception("writing a checkpoint failed")


def _train_until_done(run: Run, evals: list[dict[str, Any]], progress: bool,
                      saver: _Checkpointer, stop: _StopSignal,
                      bar: live_bar.LiveBar | None = None) -> None:
  """Watches the learners until every one has made its last step (or failed), or a stop signal."""
  settings, learners, syncer = run.settings, run.learners, run.syncer
  stall_timeout = settings.stall_timeout_s
  clock = max(l.step for l in learners)
  next_log = (clock // settings.log_every + 1) * settings.log_every
  next_eval = (clock // settings.eval_every + 1) * settings.eval_every if settings.eval_every \
      else None
  tail_log = tail_eval = None  # the boundaries once the fastest learner is done (see below)
  last_steps, last_change = -1, time.monotonic()
  supervisor, keeper, restarter = run.supervisor, run.keeper, run.restarter
  lock_step = settings.sync is not None and settings.sync.lock_step
  while not all(l.finished_training.is_set() for l in learners) or (
      supervisor is not None and supervisor.pending) or (keeper is not None and keeper.down) or (
      restarter is not None and restarter.pending):
    time.sleep(0.05)
    if stop.signum is not None:
      return
    if restarter is not None:
      restarter.tick()
    if keeper is not None:
      keeper.tick()
      run.syncer = syncer = keeper.syncer
    if run.corrupter is not None:
      run.corrupter.tick()
    if keeper is None or not (keeper.down or syncer.process_died):
      _check_syncer(syncer)  # (a syncer process that died is the keeper's to restore)
    _check_supervisor(supervisor)
    steps = sum(l.steps_made for l in learners)
    if steps != last_steps:
      last_steps, last_change = steps, time.monotonic()
    elif supervisor is not None and supervisor.pending and not any(l.alive for l in learners):
      last_change = time.monotonic()  # every learner is down, waiting for a repair: no stall
    elif lock_step and supervisor is not None and supervisor.repairing:
      last_change = time.monotonic()  # the barrier waits for a learner being repaired: no stall
    elif restarter is not None and restarter.pending:
      last_change = time.monotonic()  # the dp job is down, waiting for its repair: no stall
    elif time.monotonic() - last_change > stall_timeout:
      raise RuntimeError(
          f"no learner made a step for {stall_timeout} s (config.stall_timeout_s); learner "
          f"steps {[l.step for l in learners]}")
    clock = max(l.step for l in learners)
    if bar is not None:
      bar.show(clock)
    if clock < settings.num_steps:
      if progress and clock >= next_log:
        _log_progress(run, clock, evals)
        next_log += settings.log_every
      if next_eval is not None and clock >= next_eval:
        evals.append(_evaluate(run, clock))
        next_eval += settings.eval_every
    else:
      # The fastest learner is done and others still train (a straggler, a learner that rejoined
      # behind): progress lines and evaluations go on by the step of the slowest one still
      # training, on the same boundaries, instead of stopping until the run ends.
      training = [l.step for l in learners if not l.finished_training.is_set()]
      tail = min(training) if training else settings.num_steps
      if tail_log is None:
        tail_log = (tail // settings.log_every + 1) * settings.log_every
        tail_eval = ((tail // settings.eval_every + 1) * settings.eval_every
                     if settings.eval_every else None)
      if progress and tail >= tail_log and tail < settings.num_steps:
        _log_progress(run, clock, evals)
        tail_log = (tail // settings.log_every + 1) * settings.log_every
      if tail_eval is not None and tail >= tail_eval and tail < settings.num_steps:
        evals.append(_evaluate(run, clock))
        tail_eval = (tail // settings.eval_every + 1) * settings.eval_every
    saver.tick(clock)


def _check_supervisor(supervisor: supervisor_lib.Supervisor | None) -> None:
  if supervisor is not None and supervisor.error is not None:
    raise RuntimeError(f"restarting a failed learner failed: {supervisor.error!r}"
                       ) from supervisor.error


def _check_syncer(syncer: syncer_lib.Syncer | None) -> None:
  if syncer is not None and syncer.error is not None:
    raise RuntimeError(f"the syncer failed: {syncer.error!r}") from syncer.error


def _shut_down(run: Run) -> None:
  """Stops every thread of a failed or interrupted run and closes its files."""
  if run.injector is not None:
    run.injector.stop()
  if run.supervisor is not None:
    run.supervisor.halt()
  for learner in run.learners:
    learner.stop()
  if run.syncer is not None:
    run.syncer.stop()
  for learner in run.learners:
    learner.join(timeout=30)
  if run.syncer is not None:
    run.syncer.join(timeout=30)
  if run.settings.runtime == "ray":
    ray_runtime.shutdown(list(run.learners) + [run.syncer])
  run.metrics.close()


def train_and_evaluate(settings: settings_lib.RunSettings) -> dict[str, Any]:
  run = build(settings)
  logging.info("built %d learner(s), %d parameters, %d fragment(s) in %.1f s", len(run.learners),
               run.num_params, len(run.fragments), run.build_seconds)
  return replay(run) if settings.replay else execute(run)


def _params_hashes(run: Run) -> dict[str, Any]:
  """`params_sha256` of the global model; with the tape on, every learner's final parameters too
  (what a replay must reproduce bit for bit)."""
  hashes: dict[str, Any] = {"params_sha256": tape_lib.params_sha256(global_params(run))}
  if run.settings.tape and run.settings.runtime == "threads":
    hashes["learner_params_sha256"] = [tape_lib.params_sha256(l.params()) for l in run.learners]
  return hashes


def replay(run: Run, *, progress: bool = True) -> dict[str, Any]:
  """Replays the tape of config.replay on a built run (runtime/records/event_tape.py), evaluates the
  global model and writes the replay's summary, which says what changed against the recording."""
  settings = run.settings
  tape = event_tape.load(settings.replay)
  now = event_tape.settings_record(settings)
  counterfactual = event_tape.counterfactual(tape.config, now)
  for field in counterfactual:
    logging.info("counterfactual replay: config.%s=%s (recorded: %s)", field["field"],
                 field["replayed"], field["recorded"])
  try:
    outcome = event_tape.replay(run, tape, now)
    final = _evaluate(run, settings.num_steps, final=True)
  except BaseException:
    run.metrics.close()
    raise
  summary: dict[str, Any] = {
      "mode": settings.mode, "num_learners": settings.num_learners,
      "replay_of": settings.replay, "replay_exact": outcome.exact,
      # Fields set otherwise than in the recording: those the replay recomputed with, and those
      # that change nothing it computes.
      "replay_changed_fields": outcome.changed["counterfactual"],
      "replay_ignored_fields": outcome.changed["ignored"],
      # The counterfactual fields with their values: field, recorded, replayed (reprs).
      "replay_counterfactual": counterfactual,
      "final_eval_loss": final["eval_loss"],
      "final_validation_loss": final.get("validation_loss"),
      "final_eval_bits_per_byte": final["eval_bits_per_byte"],
      "learner_steps": outcome.steps, "merges": outcome.merges, "replay_rounds": outcome.rounds,
      "replay_takes": outcome.takes, "replay_applies": outcome.applies,
      "replay_respawns": outcome.respawns,
      "replay_seconds": outcome.seconds, "build_seconds": run.build_seconds,
      **_params_hashes(run),
  }
  recorded_path = os.path.join(settings.replay, "summary.json")
  if os.path.exists(recorded_path):
    with open(recorded_path, encoding="utf-8") as f:
      recorded = json.load(f)
    summary["recorded_params_sha256"] = recorded.get("params_sha256")
    summary["params_equal_to_recording"] = summary["params_sha256"] == recorded.get(
        "params_sha256")
    summary["recorded_final_eval_loss"] = recorded.get("final_eval_loss")
  run.metrics.flush()
  with open(os.path.join(settings.workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  run.metrics.close()
  if progress:
    what = "exact replay" if outcome.exact else (
        "counterfactual replay (" + ", ".join(f"config.{n}" for n in
                                              outcome.changed["counterfactual"]) + " changed)")
    logging.info("%s of %s: %d merges, final eval loss %.4f nats/token (recorded %s), "
                 "params_sha256 %s%s; summary in %s", what, settings.replay, outcome.merges,
                 final["eval_loss"], summary.get("recorded_final_eval_loss"),
                 summary["params_sha256"][:16],
                 "" if "params_equal_to_recording" not in summary else
                 (", equal to the recording's" if summary["params_equal_to_recording"]
                  else ", NOT equal to the recording's"),
                 os.path.join(settings.workdir, "summary.json"))
  return summary


def _evaluate(run: Run, clock: int, final: bool = False) -> dict[str, Any]:
  started, started_at = time.perf_counter(), time.monotonic()
  params = global_params(run)
  loss = run.evaluator(params)
  bpb = _bits_per_byte(run, loss)
  run.eval_windows.append((started_at, time.monotonic()))
  # at_s: when the evaluated Theta was read, in seconds since this process's training started
  # (time-to-loss figures; a resumed run counts from its own start).
  # step: the fastest learner's; slowest_step: the slowest learner's (they differ by a straggler's
  # lag, and after the fastest learner is done, `step` stays at num_steps while the others train).
  record = {"step": clock, "slowest_step": min(l.step for l in run.learners),
            "eval_loss": loss, "eval_bits_per_byte": bpb, "final": final,
            "seconds": time.perf_counter() - started,
            "at_s": started_at - run.started_at if run.started_at is not None else 0.0}
  if run.validator is not None:
    record["validation_loss"] = run.validator(params)
  run.metrics.write("eval", record, step=clock,
                    scalars={"eval/loss": loss, "eval/bits_per_byte": bpb})
  logging.info("eval at step %d: global model %.4f nats/token, %.4f bits/byte%s", clock, loss,
               bpb, " (final)" if final else "")
  return record


def _bits_per_byte(run: Run, loss: float) -> float:
  """Nats per eval token as bits per byte of the text those tokens cover: comparable across
  tokenizers (for bytes it is loss / ln 2)."""
  info = run.data_info
  return float(loss * info["eval_tokens"] / (max(info["eval_bytes"], 1) * np.log(2)))


def _log_progress(run: Run, clock: int, evals: list[dict[str, Any]]) -> None:
  losses = " ".join(f"{l.losses[-1]:.3f}" if l.losses else "-" for l in run.learners)
  settings = run.settings
  rates = " ".join(
      f"{settings.tokens_per_step(l.index) / np.mean(l.step_times[-settings.log_every:]) / 1e3:.1f}k"
      if l.step_times else "-" for l in run.learners)
  line = f"step {clock}/{settings.num_steps} | loss {losses} | tokens/s {rates}"
  if clock >= settings.num_steps:
    training = [l for l in run.learners if not l.finished_training.is_set()]
    if training:  # the fastest is done: who the run still waits for
      line += " | still training: " + ", ".join(
          f"learner {l.index} at step {l.step}" for l in training)
  recent = _throughput(run, run.learners, last=settings.log_every)
  if recent.tokens_per_s_per_device is not None:
    line += f" | tok/s/dev {recent.tokens_per_s_per_device:,.0f}"
  if recent.mfu is not None:
    line += f" | mfu {100 * recent.mfu:.1f}%"
  if run.syncer is not None:
    stats = run.syncer.stats
    line += (f" | merges {stats.merges} | MB to/from syncer "
             f"{(stats.bytes_up + stats.bytes_down) / 1e6:.2f}")
  if evals:
    line += f" | eval {evals[-1]['eval_loss']:.3f}"
  logging.info(line)


def _throughput(run: Run, learners, last: int | None = None) -> throughput_lib.Throughput:
  """Of the learners' steps (each one's `last` ones; all by default), those that overlapped no
  evaluation: tokens over step seconds x devices, and MFU (runtime/core/throughput.py)."""
  settings = run.settings
  tokens = device_seconds = 0.0
  sharing = settings.devices.learners_sharing_devices
  groups: dict[int, list[Any]] = {}  # learners (every incarnation) by the devices they share
  for learner in learners:
    groups.setdefault(learner.index // sharing, []).append(learner)
  for group in groups.values():
    steps = []
    for learner in group:
      # A learner thread may append a step between the two reads: pair them from the start.
      done = min(len(learner.step_ends), len(learner.step_times))
      first = max(done - last, 0) if last is not None else 0
      steps.append((learner.step_ends[first:done], learner.step_times[first:done]))
    if sharing > 1:
      # Their steps took turns on these devices: count each second of them once.
      counts, seconds = throughput_lib.shared_steps_outside(steps, run.eval_windows)
    else:
      outside = [throughput_lib.steps_outside(ends, times, run.eval_windows)
                 for ends, times in steps]
      counts, seconds = [c for c, _ in outside], sum(s for _, s in outside)
    tokens += sum(c * settings.tokens_per_step(l.index) for c, l in zip(counts, group))
    device_seconds += seconds * len(group[0].mesh_devices)
  return throughput_lib.throughput(
      tokens, device_seconds, flops_lib.model_flops_per_token(settings.model, settings.data.seq_len),
      throughput_lib.peak_flops_per_s(_device_kind(run)))


def _device_kind(run: Run) -> str:
  return run.learners[0].mesh_devices[0].device_kind


def _summary(run: Run, evals, train_seconds: float, wall_seconds: float) -> dict[str, Any]:
  """The whole run's summary: a resumed run adds what it did to the checkpoint's history."""
  learners, syncer, history = run.learners, run.syncer, run.history
  tokens_per_step = [run.settings.tokens_per_step(m) for m in range(len(learners))]
  stats = syncer.stats if syncer is not None else syncer_lib.SyncerStats()
  tape = syncer.tape if syncer is not None else []
  final_steps = [l.step for l in learners]
  num_fragments = max(len(run.fragments), 1)
  supervisor = run.supervisor
  retired = _retired(run)
  incarnations = learners + retired  # every learner that ever trained
  steps_made = [history["steps_made"][m] + sum(l.steps_made for l in incarnations if l.index == m)
                for m in range(len(learners))]
  summary = {
      "mode": run.settings.mode,
      "num_learners": run.settings.num_learners,
      "num_params": run.num_params,
      "num_fragments": len(run.fragments),
      # Learners an elastic restore dropped count with the steps they made before it.
      "tokens_trained": int(np.dot(steps_made, tokens_per_step))
                        + sum(d["tokens"] for d in history.get("dropped_learners", ())),
      "final_eval_loss": evals[-1]["eval_loss"],  # nats per token
      # On the validation split (config.data.validation_fraction; None without one).
      "final_validation_loss": evals[-1].get("validation_loss"),
      "final_eval_bits_per_byte": evals[-1]["eval_bits_per_byte"],
      "tokenizer": run.data_info["tokenizer"],
      # Bad records left out of the data (empty, missing text field, invalid UTF-8, bad JSON): at
      # load time for text, when scripts/prepare_data.py packed it for ArrayRecord shards.
      "data_records_skipped": sum(run.data_info["records_skipped"].values()),
      "data_records_skipped_by_reason": run.data_info["records_skipped"],
      "eval_history": evals,
      "eval_seconds": sum(e["seconds"] for e in evals),
      "bytes_learner_syncer": stats.bytes_up + stats.bytes_down,
      "bytes_learner_to_syncer": stats.bytes_up,
      "bytes_syncer_to_learners": stats.bytes_down,
      "bytes_syncer_allreduce": stats.bytes_allreduce,
      # compression.broadcast_delta: broadcasts that went out whole (Theta_p, not a delta).
      "broadcast_keyframes": stats.keyframes,
      "wall_seconds": wall_seconds,
      "train_seconds": train_seconds,
      "build_seconds": run.build_seconds,
      **{k: round(v, 3) for k, v in run.compile_seconds.items()},
      # Seconds from the start of the build to the first step of the first / the last learner
      # (learners sharing devices make their first steps one after another); None: no step.
      **_first_steps(run, incarnations),
      "learner_steps": final_steps,
      "learner_steps_per_s": [len(l.step_times) / max(sum(l.step_times), 1e-9) for l in learners],
      "learner_errors": [None if l.error is None else repr(l.error) for l in learners],
      # config.ray.processes_per_learner > 1: whether each learner's processes ended holding the
      # same copies of every parameter piece (None: a learner of one process).
      "learner_replicas_agree": [l.replicas_agree for l in learners],
      "merges": stats.merges,
      "merges_due": stats.merges_due,
      "merges_before_flush": stats.merges - stats.final_merges,
      "final_merges": stats.final_merges,
      "late_offers": stats.late_offers,
      "stale_answers": stats.stale_answers,
      "rounds_without_quorum": stats.rounds_without_quorum,
      "empty_rounds": stats.empty_rounds,
      "due_while_in_flight": stats.due_while_in_flight,
      # From the merge tape, not assumed: steps no merge took in, and steps merged twice.
      "unmerged_steps_at_end": tape_lib.unmerged_steps_at_end(
          tape, final_steps, num_fragments, [l.incarnation for l in learners],
          supervisor.start_steps if supervisor is not None else None)
                               if syncer is not None else [0] * len(learners),
      "double_merged_offers": tape_lib.double_merged_offers(tape),
      # Share of each learner's fragment-steps that the paper's overwrite on receive discarded.
      "discarded_progress": [
          (history["discarded_fragment_steps"][m] +
           sum(l.discarded_fragment_steps for l in incarnations if l.index == m))
          / max(steps_made[m] * num_fragments, 1) for m in range(len(learners))],
      # Checkpoints: the ones this run wrote, and every resume of the run with what it skipped.
      "checkpoints_written": [c for c in run.checkpoints.saved if c["kind"] == "job"]
                             if run.checkpoints is not None else [],
      "resumes": history["resumes"],
      # Per learner, seconds at lock-step barriers (waiting for merges, slower peers, and peers
      # being repaired); 0 in decoupled and dp modes, which have no barrier.
      "barrier_wait_seconds": [round(
          history.get("barrier_wait_seconds", [0.0] * len(learners))[m] +
          sum(l.barrier_wait_s for l in incarnations if l.index == m), 3)
          for m in range(len(learners))],
      "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      "device_peak_bytes": _device_peak_bytes(run),
      # Throughput of this process's learner steps, every incarnation's, outside evaluations
      # (runtime/core/throughput.py says which time counts); mfu is null where the chip's peak is
      # not known (CPU).
      "device_kind": _device_kind(run),
      "model_flops_per_token": flops_lib.model_flops_per_token(run.settings.model,
                                                               run.settings.data.seq_len),
      "peak_flops_per_s_per_device": throughput_lib.peak_flops_per_s(_device_kind(run)),
      **dataclasses.asdict(_throughput(run, incarnations)),
  }
  if syncer is not None:
    summary.update(_fault_summary(run, tape, incarnations, steps_made, tokens_per_step))
    summary["syncer_held_bytes"] = syncer.held_bytes()
    summary["syncer_peak_held_bytes"] = stats.peak_held_bytes
    summary["syncer_steady_state_bytes"] = syncer.steady_state_bytes()
  else:
    summary.update(_job_restart_summary(run, tokens_per_step[0]))
  return summary


def _first_steps(run: Run, incarnations) -> dict[str, float | None]:
  firsts = [l.first_step_done_at - run.build_started_at for l in incarnations
            if l.incarnation == 0 and l.first_step_done_at is not None
            and run.build_started_at is not None]
  return {"first_step_s": round(min(firsts), 3) if firsts else None,
          "last_first_step_s": round(max(firsts), 3) if firsts else None}


def _retired(run: Run) -> list[learner_lib.Learner]:
  """The failed incarnations of this run (restarted by the supervisor, or by a dp job restart)."""
  if run.supervisor is not None:
    return run.supervisor.retired
  return run.restarter.retired if run.restarter is not None else []


def _job_restart_summary(run: Run, tokens_per_step: int) -> dict[str, Any]:
  """dp mode: every failure stopped the job, which restarted from its newest checkpoint. The
  steps made after that checkpoint are lost: trained (in `tokens_trained`) but not in the model,
  so tokens_trained = tokens in the final model + tokens_lost_at_restarts."""
  history = run.history
  failures = [dict(f) for f in history["failures"]] + (
      run.restarter.summary_records() if run.restarter is not None else [])
  faults = [dict(f) for f in history["faults"]] + (
      [dict(f) for f in run.injector.records] if run.injector is not None else [])
  for fault in faults:
    if fault["fault"] == "crash":
      stopped = [r for r in failures if r["step"] == fault["step"] and "LearnerFailure" in r["error"]]
      fault.update({k: v for k, v in (stopped[0] if stopped else {}).items()
                    if k not in ("learner", "step", "error")})
  lost = sum(r.get("steps_lost", 0) for r in failures)
  return {
      "faults": faults,
      "failures": failures,
      "job_restarts": sum(1 for r in failures if r.get("restarted")),
      "steps_lost_at_restarts": int(lost),
      "tokens_lost_at_restarts": int(lost * tokens_per_step),
  }


def _fault_summary(run: Run, tape, incarnations, steps_made,
                   tokens_per_step: Sequence[int]) -> dict[str, Any]:
  """Faults, restarts and where every token went (spec §6)."""
  supervisor, stats = run.supervisor, run.syncer.stats
  history = run.history
  failures = [dict(f) for f in history["failures"]] + (
      supervisor.summary_records() if supervisor is not None else [])
  lost = 0
  for failure in failures:
    failure["lost_fragment_tokens"] = sum(failure.pop("counter_tokens")) - (
        tape_lib.merged_after_failure(tape, failure["learner"], failure["incarnation"],
                                      failure.pop("anchor_versions")))
    lost += failure["lost_fragment_tokens"]
  faults = [dict(f) for f in history["faults"]] + (
      [dict(f) for f in run.injector.records] if run.injector is not None else []) + (
      [dict(f) for f in run.keeper.fault_records] if run.keeper is not None else []) + (
      [dict(f) for f in run.corrupter.records] if run.corrupter is not None else [])
  for fault in faults:
    if fault["fault"] == "crash":
      healed = [r for r in failures if r["learner"] == fault["learner"]
                and r["step"] == fault["step"]]
      fault.update({k: v for k, v in (healed[0] if healed else {}).items()
                    if k not in ("learner", "step", "error")})
  num_fragments = max(len(run.fragments), 1)
  # Learners an elastic restore dropped (runtime/records/elastic_restore.py): what they made before it,
  # the share the overwrite discarded, and what they held unmerged, lost with them.
  dropped = history.get("dropped_learners", ())
  # Every token a learner trained on reaches each fragment of Theta through a merge, or is
  # discarded by an overwrite on receive, lost with a failed learner, or still unmerged at the end:
  # made = merged + discarded + lost + unmerged, per fragment, summed (tests check the equality).
  accounting = {
      "made": int((np.dot(steps_made, tokens_per_step) + sum(d["tokens"] for d in dropped))
                  * num_fragments),
      "merged": int(sum(sum(r["tokens"]) for r in tape_lib.installed(tape))),
      "discarded": int(sum(history["discarded_fragment_tokens"]) +
                       sum(l.discarded_fragment_tokens for l in incarnations) +
                       sum(d["discarded_fragment_tokens"] for d in dropped)),
      "lost_at_failures": int(lost + sum(d["unmerged_fragment_tokens"] for d in dropped)),
      "unmerged_at_end": int(sum(l.counters().tokens.sum() for l in run.learners
                                 if l not in incarnations[len(run.learners):])),
  }
  return {
      "faults": faults,
      "failures": failures,
      "rejoins": sum(1 for r in failures if r.get("restarted")),
      "joins": sum(1 for f in faults if f["fault"] == "join"),  # late learners admitted
      # Syncer crashes and what each restart restored (from its checkpoint, from the learners).
      "syncer_restarts": len(run.keeper.records) if run.keeper is not None else 0,
      "posts_lost_while_syncer_down": (sum(r["posts_lost"] for r in run.keeper.records)
                                       if run.keeper is not None else 0),
      "rejected_offers": dict(stats.rejected_offers),
      "fragment_token_accounting": accounting,
      # Heartbeats: learners found silent past config.sync.heartbeat_timeout_s, and taken back.
      "heartbeat_absences": stats.absences,
      "heartbeat_returns": stats.returns,
      # Posts of and broadcasts to a learner cut off by a partition fault (lost, not delayed).
      "partition_messages_lost": sum(f.get("messages_lost", 0) for f in faults
                                     if f["fault"] == "partition"),
  }


def _device_peak_bytes(run: Run) -> int | None:
  """Largest peak of bytes in use over the learners' devices (None where the platform does not
  report it, as on CPU)."""
  peaks = []
  for learner in run.learners:
    for device in learner.mesh_devices:
      stats = device.memory_stats()
      if stats and "peak_bytes_in_use" in stats:
        peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None
