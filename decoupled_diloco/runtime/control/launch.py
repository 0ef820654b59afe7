"""Building a run: the devices partitioned, the learners and the syncer built over a transport and
compiled, resumed from a checkpoint when there is one; nothing started.

Everything the settings make (the dataset, optimizer, fragments, initial parameters, learners,
syncer) comes from the one recipe (runtime/assembly.py); where the learners and the syncer run is
the `Transport`'s (runtime/control/run.py), which the entry (runtime/train.py) picks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from decoupled_diloco import errors
from decoupled_diloco import settings as settings_lib
from decoupled_diloco.lm import data as data_lib
from decoupled_diloco.lm import evaluate
from decoupled_diloco.lm import inner
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.runtime import assembly
from decoupled_diloco.runtime.control import job_restart
from decoupled_diloco.runtime.control import run as run_lib
from decoupled_diloco.runtime.control import shard_keeper
from decoupled_diloco.runtime.control import slice_watch as slice_watch_lib
from decoupled_diloco.runtime.control import supervisor as supervisor_lib
from decoupled_diloco.runtime.control import syncer_keeper as keeper_lib
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.core import learner_state
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core import pathways
from decoupled_diloco.runtime.core.syncer import syncer as syncer_lib
from decoupled_diloco.runtime.faults import checkpoint_faults
from decoupled_diloco.runtime.faults import injector as injector_lib
from decoupled_diloco.runtime.records import checkpoints as checkpoints_lib
from decoupled_diloco.runtime.records import elastic_restore
from decoupled_diloco.runtime.records import event_tape
from decoupled_diloco.runtime.records import job_state
from decoupled_diloco.runtime.records import revision


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


def build_run(settings: settings_lib.RunSettings, transport: run_lib.Transport, *,
              step_hook: Callable[[int, int], None] | None = None,
              with_syncer: bool = True,
              lost_slices: slice_watch_lib.SliceWatch | None = None) -> run_lib.Run:
  """Partitions devices, builds learners and syncer over `transport` and compiles their steps.

  `lost_slices`: which learner failures are lost slices and when those are back; by default
  pathwaysutils' answers under Pathways, and none elsewhere (every failure is the learner's own).
  """
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
  dataset = assembly.load_dataset(settings)
  if transport.learners_in_processes and pathways.in_use():
    raise errors.InputError(
        f"config.runtime={settings.runtime!r} but JAX_PLATFORMS={pathways.jax_platforms()!r} names "
        f"Pathways' proxy backend: under Pathways one controller process runs every learner, "
        f"with config.runtime='threads'")
  # Before anything touches JAX (reading a checkpoint back does): the platforms (under Pathways,
  # pathwaysutils' proxy backend) and the device count are fixed then.
  devices_lib.use_platform(settings.devices.platform)
  devices_lib.request_fake_cpu_devices(settings.devices.num_fake_cpu_devices)
  assembly.use_compilation_cache(settings.compilation_cache_dir)  # before anything compiles
  saver, restored, elastic = _open_checkpoints(settings)
  history = job_state.empty_history(settings.num_learners)
  if restored is not None:
    history.update(restored.cut.history)
    history["resumes"] = list(history["resumes"]) + [
        {"from": restored.path, "clock": restored.cut.clock, "skipped": restored.skipped,
         **({"elastic": elastic.to_json()} if elastic else {})}]
  in_processes = transport.learners_in_processes
  # With learner processes (config.runtime=ray) this process holds the syncer and one CPU device
  # for the model's initialisation and the evaluations; each learner makes its own mesh.
  if in_processes:
    learner_meshes, syncer_mesh = devices_lib.build_meshes(((1, 1),), settings.syncer.num_devices,
                                                           "cpu")
  else:
    learner_meshes, syncer_mesh = devices_lib.build_meshes(
        settings.learner_mesh_shapes, settings.syncer.num_devices, settings.devices.platform,
        settings.devices.learners_sharing_devices,
        fake_slice_size=settings.devices.fake_slice_size,
        tpu_topologies=settings.devices.tpu_topologies, one_job=settings.mode == "dp",
        syncer_shards=settings.syncer.num_shards)
  if settings.devices.platform == "tpu" and not in_processes:
    # Before the model is built: its remat policy is part of its program.
    settings, _ = assembly.resolve_remat(
        settings, {group[0]: learner_meshes[group[0]] for group in
                   assembly.distinct_learners(settings, learner_meshes)})
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
  tx = assembly.inner_optimizer(settings)
  model_cfg = settings.model
  sync = settings.sync if with_syncer else None
  fragments = ()
  if sync is not None:
    fragments = assembly.make_fragments(settings)
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
  graphdef, initial = assembly.initial_params(settings, learner_meshes[0])
  compile_seconds["init_compile_s"] = time.perf_counter() - started
  # The learners of this process (none with learner processes), compiled and placed.
  built, compile_seconds["train_compile_s"] = transport.compile_learners(
      settings, learner_meshes, graphdef, initial, tx, dataset, injector)
  # Only now, with the data read and every learner's step compiled and checked against its
  # device's memory: an input the run cannot use leaves the workdir, and an earlier run's files
  # in it, untouched.
  metrics = metrics_lib.MetricsWriter(
      settings.workdir, resume_at_s=history["wall_seconds"] if restored is not None else None,
      tape=settings.tape and not settings.replay)
  if metrics.taping:
    metrics.tape_event("config", {"format": event_tape.FORMAT,
                                  "config": event_tape.settings_record(settings),
                                  "revision": revision.current()})
  syncer, port = None, None
  transport.start(settings)
  # config.syncer.num_shards > 1: each shard on devices of its own (with learner processes, in a
  # process of its own that makes its own mesh).
  num_shards = settings.syncer.num_shards
  shard_meshes = (devices_lib.shard_meshes(syncer_mesh, num_shards)
                  if num_shards > 1 and not in_processes else [syncer_mesh] * num_shards)

  def make_syncer(crashed=None, shard=None):
    """A syncer (shard `shard` of a sharded one) at the initial Theta, compiled (at start-up,
    and again after `crashed` crashed)."""
    return transport.make_syncer(
        settings, crashed, metrics=metrics, network=network, initial=initial,
        syncer_mesh=syncer_mesh if shard is None else shard_meshes[shard], shard=shard)

  if sync is not None and num_shards > 1:
    syncer, port = shard_keeper.build_shards(lambda shard: make_syncer(shard=shard),
                                             assembly.shard_owners(settings, fragments), network)
  elif sync is not None:
    syncer = make_syncer()
    port = keeper_lib.SyncerPort(syncer, network)
  if syncer is not None:
    compile_seconds["syncer_compile_s"] = syncer.compile_seconds
    if restored is not None:
      syncer.load_state(restored.cut.syncer, with_history=True)
  # Late learners that have not joined yet (in a resumed run: by the checkpoint's faults).
  joined = {f["learner"] for f in history["faults"] if f["fault"] == "join"}
  held_back = tuple(m for m in settings.late_learners if m not in joined)
  learner_cuts = _learner_cuts(restored, history, syncer, layout, held_back,
                               elastic.joining if elastic else ()) if restored else {}
  supervisor_box: list[supervisor_lib.Supervisor | None] = [None]  # built after the learners

  def peer_repairing() -> bool:
    return supervisor_box[0] is not None and supervisor_box[0].repairing

  learners = transport.start_learners(
      settings, built, syncer=syncer, port=port, metrics=metrics, layout=layout,
      fragments=fragments, cuts=learner_cuts, held_back=held_back, step_hook=step_hook,
      peer_repairing=peer_repairing if sync is not None and sync.lock_step else None)
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
  repaired_at = transport.repaired_at(
      injector.repaired_at if injector is not None else lambda _: 0.0, learners)
  if syncer is not None and not sync.lock_step:
    keeping = dict(learners=learners,
                   checkpoints=saver if settings.checkpoint.every_steps else None,
                   every_s=settings.checkpoint.syncer_every_s, metrics=metrics,
                   faults=injector.syncer_faults if injector is not None else ())
    if num_shards > 1:  # a keeper per shard, each restoring its shard alone
      keeper = shard_keeper.ShardedKeeper.for_shards(
          syncer=syncer, port=port, make_syncer=lambda crashed, i: make_syncer(crashed, shard=i),
          **keeping)
    else:
      keeper = keeper_lib.SyncerKeeper(syncer=syncer, port=port, make_syncer=make_syncer,
                                       **keeping)
  if syncer is not None:
    # Lock-step modes restart a failed learner the same way; their barrier waits for it (or, with
    # config.sync.elastic_lock_step, merges without it until it is back: syncer.py).
    current_syncer = (lambda: None if keeper.down else keeper.syncer) if keeper is not None \
        else (lambda: syncer)
    supervisor = supervisor_lib.Supervisor(
        learners, current_syncer, init_opt_state=jax.jit(tx.init), repaired_at=repaired_at,
        max_restarts=settings.max_restarts, metrics=metrics, late_learners=held_back,
        on_join=injector.record_join if injector is not None else None,
        lost_slices=lost_slices or _pathways_slices(settings, learner_meshes),
        lost_slice=transport.lost_slice(learners))
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
      assembly.warm_up(step, state0, settings.learner_batch_size, data.seq_len)
      return injector.wrap_train_step(0, step) if injector is not None else step

    first_data = learners[0].published.data_state  # where the loader starts

    def initial_state() -> learner_state.LearnerSnapshot:
      """Step 0 made again from the seed, as a job restarted with no checkpoint makes it."""
      _, params = assembly.init_params(settings, learner_meshes[0])
      none = np.zeros(0, np.int64)  # dp has no fragments
      return learner_state.LearnerSnapshot(
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
  return run_lib.Run(settings, learners, syncer, evaluator, metrics, fragments,
                     model_lib.num_params(initial), time.perf_counter() - start, compile_seconds,
                     injector, supervisor, saver if settings.checkpoint.every_steps else None,
                     history, restored, keeper, corrupter, restarter=restarter,
                     data_info=data_info, validator=validator, build_started_at=build_started_at,
                     transport=transport)


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


def _pathways_slices(settings: settings_lib.RunSettings, learner_meshes
                     ) -> slice_watch_lib.SliceWatch | None:
  """Under Pathways, lost slices as pathwaysutils classifies and checks them; None elsewhere."""
  if not pathways.in_use():
    return None
  return slice_watch_lib.for_pathways([list(mesh.devices.flat) for mesh in learner_meshes],
                                      settings.devices.slice_poll_s)


def _chain_hooks(*hooks):
  hooks = [h for h in hooks if h is not None]

  def hook(learner: int, step: int) -> None:
    for h in hooks:
      h(learner, step)

  return hook
