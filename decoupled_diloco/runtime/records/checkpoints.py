"""Whole-job checkpoints and the syncer's own, with orbax (`CheckpointManager`, asynchronous saves).

A job checkpoint is one consistent cut of the run (`JobCut`): every live learner's train state, data
position (the grain iterator's state, its own item), counters and anchors at one of its step
boundaries, the syncer's state at the same moment, and the run's history so far (steps made, faults,
evaluations, the merge tape), so that a resumed run's summary describes the whole run. The syncer
builds the cut (`Syncer.request_cut`, which says how it stays consistent with merges in flight);
this module only writes and reads it.

Saving never stops a learner: the cut references immutable arrays, a background thread copies them
to host memory and hands them to orbax, which writes asynchronously. A syncer-only checkpoint
(`save_syncer`) holds Theta, the outer states, versions and the syncer's bookkeeping; a restarted
syncer starts from the newest one.

Items of a job checkpoint (directory `<checkpoint.dir>/job/<clock>`):
  arrays  learner_<m>/{params, opt, state_step, anchors, counters...} and syncer/{theta, opt}
  data    {m: the grain iterator state of learner m}
  meta    the experiment's fingerprint (its config fields), the cut's bookkeeping, the run's history, and a
          CRC-32 of every array (orbax does not check the bytes it reads back; this module does).

At restore the newest checkpoint that reads back whole is used; a damaged or partial one is skipped,
and the log and `RestoredCheckpoint.skipped` say which and why.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import json
import os
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.lm import model as model_lib

# Fields a resumed run may change: where and how often it writes, what it injects, how long it
# runs, how it reports, how fast it gives up on a silent learner. Every other field must equal the
# checkpoint's (`fingerprint`).
_MAY_CHANGE = ("workdir", "restore", "checkpoint.", "chaos.", "num_steps", "log_every",
               "eval_every", "eval_batches", "stall_timeout_s", "max_restarts", "devices.",
               "syncer.num_workers", "syncer.merge_delay_steps", "learner_step_delays_s", "learner_step_noise_s", "sync.heartbeat_timeout_s",
               "profile_steps", "compilation_cache_dir", "tape", "replay")
# Fields a resumed run may change by an elastic restore (runtime/records/elastic_restore.py): how many
# learners there are and the shape of each one's mesh; with another number of learners, the
# quorum too (it is bounded by it).
ELASTIC = ("num_learners", "learner_mesh_shapes")
_WITH_NUM_LEARNERS = ("sync.quorum",)
_JOB, _SYNCER = "job", "syncer"
_COUNTERS = ("since", "counter_steps", "counter_tokens", "anchor_versions")


class CheckpointError(RuntimeError):
  """No usable checkpoint where one was asked for, or one of another experiment."""


def fingerprint(settings: settings_lib.RunSettings) -> dict[str, str]:
  """The fields that make two runs the same experiment, dotted name -> repr of the value."""
  values = {}
  for name in settings_lib.config_fields():
    if name.startswith(_MAY_CHANGE):
      continue
    node = settings
    for part in name.split("."):
      node = getattr(node, part, None) if node is not None else None
    values[name] = repr(node)
  return values


@dataclasses.dataclass
class LearnerCut:
  """One learner at one of its step boundaries (its latest publication), host or device arrays."""

  index: int
  incarnation: int
  step: int
  params: dict[str, Any]  # native layout
  opt_state: Any  # the optax state pytree
  state_step: Any
  since: np.ndarray
  counter_steps: np.ndarray
  counter_tokens: np.ndarray
  anchor_versions: np.ndarray
  anchors: dict[str, np.ndarray]  # flat names
  data_state: bytes | None  # the grain iterator's get_state() at that boundary


@dataclasses.dataclass
class JobCut:
  """A consistent cut of the job: learners, syncer, and the run's history up to it."""

  clock: int  # steps of the fastest learner: the checkpoint's number
  learners: list[LearnerCut]
  syncer: dict[str, Any] | None  # Syncer.state(): "arrays" and "json" parts; None in dp mode
  history: dict[str, Any]  # JSON: what the summary of a resumed run adds up


@dataclasses.dataclass
class RestoredCheckpoint:
  cut: JobCut
  path: str
  skipped: list[dict[str, Any]]  # newer checkpoints that did not read back, with the reason
  # The fingerprint of the run that wrote it: where an elastic restore reads the learners and
  # meshes it was written with.
  fingerprint: dict[str, str] = dataclasses.field(default_factory=dict)


def syncer_kind(shard: int | None) -> str:
  """Where the syncer's own checkpoints go: `syncer/`, and a sharded syncer's shard i's
  `syncer_shard_<i>/` (each shard is restored from its own)."""
  return _SYNCER if shard is None else f"{_SYNCER}_shard_{shard}"


def _keyed(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
  """Arrays under index keys (tensor names may hold characters orbax paths do not take)."""
  names = list(values)
  return {f"{i:04d}": values[n] for i, n in enumerate(names)}, names


def _unkeyed(arrays: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
  return {n: arrays[f"{i:04d}"] for i, n in enumerate(names)}


def _leaves(tree: Any) -> dict[str, Any]:
  return {f"{i:04d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def _crc(tree: Any) -> dict[str, int]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): zlib.crc32(np.ascontiguousarray(leaf).tobytes())
          for path, leaf in flat}


class Checkpoints:
  """The run's checkpoint directory: job cuts under `job/`, the syncer's own under `syncer/`."""

  def __init__(self, directory: str, keep: int | None, fingerprint_: dict[str, str]):
    # keep: newest checkpoints of each kind kept at a save; None keeps all (a reader's).
    # orbax takes absolute paths only (a relative one fails in its background writer).
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self._fingerprint = fingerprint_
    self._keep = keep
    self._managers: dict[str, ocp.CheckpointManager] = {}
    # One background thread copies a cut to host memory and starts its orbax save, in order.
    self._writer = concurrent.futures.ThreadPoolExecutor(1, "checkpoint-writer")
    self._pending: list[concurrent.futures.Future] = []
    self.saved: list[dict[str, Any]] = []  # one record per checkpoint written

  def _manager(self, kind: str) -> ocp.CheckpointManager:
    if kind not in self._managers:
      self._managers[kind] = ocp.CheckpointManager(
          os.path.join(self.directory, kind),
          options=ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=True,
                                               enable_async_checkpointing=True),
          item_names=("arrays", "data", "meta"))
    return self._managers[kind]

  def steps(self, kind: str = _JOB) -> list[int]:
    """Numbers of the checkpoints of `kind` on disk, oldest first."""
    if not os.path.isdir(os.path.join(self.directory, kind)) and "://" not in self.directory:
      return []
    return sorted(self._manager(kind).all_steps())

  # ---- saving ------------------------------------------------------------------------------------

  def save_job(self, cut: JobCut) -> concurrent.futures.Future:
    """Writes `cut` in the background; the learners go on meanwhile."""
    return self._submit(self._write_job, cut)

  def save_syncer(self, number: int, state: dict[str, Any], shard: int | None = None
                  ) -> concurrent.futures.Future:
    """Writes the syncer's state alone (`Syncer.state()`), numbered `number` (monotonic); shard
    `shard`'s of a sharded syncer under `syncer_shard_<shard>/`."""
    return self._submit(self._write_syncer, number, state, shard)

  def _submit(self, fn, *args) -> concurrent.futures.Future:
    self.raise_if_failed()
    self._pending = [f for f in self._pending if not f.done()]
    future = self._writer.submit(fn, *args)
    self._pending.append(future)
    return future

  def _write_job(self, cut: JobCut) -> None:
    arrays, learners = {}, []
    for learner in cut.learners:
      params, param_names = _keyed(learner.params)
      anchors, anchor_names = _keyed(learner.anchors)
      saved = {"params": params, "opt": _leaves(learner.opt_state),
               "state_step": learner.state_step}
      if anchors:  # none in dp mode (orbax takes no empty subtree)
        saved["anchors"] = anchors
      arrays[f"learner_{learner.index}"] = jax.device_get(saved)
      # The per-fragment counters are a few integers each (none in dp mode): JSON.
      learners.append({"index": learner.index, "incarnation": learner.incarnation,
                       "step": learner.step, "param_names": param_names,
                       "anchor_names": anchor_names,
                       **{k: np.asarray(getattr(learner, k)).tolist() for k in _COUNTERS}})
    syncer_json = None
    if cut.syncer is not None:
      arrays["syncer"] = jax.device_get(cut.syncer["arrays"])
      syncer_json = cut.syncer["json"]
    data = {str(l.index): json.loads(l.data_state) for l in cut.learners
            if l.data_state is not None}
    meta = {"kind": _JOB, "clock": cut.clock, "fingerprint": self._fingerprint,
            "learners": learners, "syncer": syncer_json,
            "history": cut.history, "crc32": _crc(arrays)}
    self._save(_JOB, cut.clock, arrays, data, meta)

  def _write_syncer(self, number: int, state: dict[str, Any], shard: int | None = None) -> None:
    arrays = {"syncer": jax.device_get(state["arrays"])}
    meta = {"kind": _SYNCER, "clock": number, "fingerprint": self._fingerprint,
            "syncer": state["json"], "crc32": _crc(arrays)}
    self._save(syncer_kind(shard), number, arrays, {}, meta)

  def _save(self, kind: str, number: int, arrays, data, meta) -> None:
    manager = self._manager(kind)
    if number in manager.all_steps():
      # A newer cut with the same number (the final one, after a run resumed from the end):
      # it replaces the older.
      manager.wait_until_finished()
      manager.delete(number)
    manager.save(number, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(arrays), data=ocp.args.JsonSave(data),
        meta=ocp.args.JsonSave(meta)))
    self.saved.append({"kind": kind, "number": number,
                       "path": os.path.join(self.directory, kind, str(number))})

  def raise_if_failed(self) -> None:
    """Raises the error of a write that failed (orbax reports an asynchronous write's error at
    the next save, which runs on the writer thread): a run must not train on for hours with
    checkpoints that are not being written."""
    for future in self._pending:
      if future.done() and future.exception() is not None:
        raise RuntimeError(f"writing a checkpoint to {self.directory} failed: "
                           f"{future.exception()!r}") from future.exception()

  def wait(self) -> None:
    """Until every checkpoint asked for is on disk; raises a writer's error."""
    for future in list(self._pending):
      future.result()
    for manager in self._managers.values():
      manager.wait_until_finished()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._writer.shutdown(wait=True)
      for manager in self._managers.values():
        manager.close()

  # ---- restoring ---------------------------------------------------------------------------------

  def check_experiment(self) -> None:
    """Fails if the newest job checkpoint here belongs to another experiment."""
    steps = self.steps(_JOB)
    if not steps:
      return
    meta = self._read_meta(_JOB, steps[-1])
    if meta is None:
      return  # unreadable: restore() skips it and says why
    self._check_fingerprint(meta, os.path.join(self.directory, _JOB, str(steps[-1])))

  def _check_fingerprint(self, meta: dict[str, Any], path: str) -> None:
    theirs = meta.get("fingerprint", {})
    elastic = ELASTIC
    if theirs.get("num_learners") != self._fingerprint.get("num_learners"):
      elastic += _WITH_NUM_LEARNERS
    # A field added since that checkpoint was written: it ran as the field's value before it existed.
    differ = sorted(k for k in set(theirs) | set(self._fingerprint)
                    if theirs.get(k, settings_lib.ADDED_FIELDS.get(k)) != self._fingerprint.get(k)
                    and k not in elastic)
    for k in sorted(set(self._fingerprint) - set(theirs)):
      if k in settings_lib.ADDED_FIELDS:
        logging.info("config.%s is not in %s's fingerprint (written before the field existed): "
                     "read as %s, the value that run ran as", k, path, settings_lib.ADDED_FIELDS[k])
    if differ:
      shown = "; ".join(f"config.{k}={theirs.get(k, '(absent)')} there, "
                        f"{self._fingerprint.get(k, '(absent)')} here" for k in differ[:4])
      more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
      raise CheckpointError(
          f"{path} is a checkpoint of another experiment: {shown}{more}. Use another "
          f"config.workdir or config.checkpoint.dir, or remove that directory to start afresh")

  def _read_meta(self, kind: str, number: int) -> dict[str, Any] | None:
    try:
      return self._manager(kind).restore(
          number, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # pylint: disable=broad-except
      return None

  def restore_job(self, number: int | None = None) -> RestoredCheckpoint | None:
    """The newest job checkpoint that reads back whole (or exactly `number`); None if none."""
    return self._restore(_JOB, number)

  def restore_syncer(self, shard: int | None = None) -> RestoredCheckpoint | None:
    """The newest syncer checkpoint (shard `shard`'s own) that reads back whole; None if none."""
    return self._restore(syncer_kind(shard), None)

  def _restore(self, kind: str, number: int | None) -> RestoredCheckpoint | None:
    candidates = [number] if number is not None else list(reversed(self.steps(kind)))
    skipped = []
    for step in candidates:
      path = os.path.join(self.directory, kind, str(step))
      try:
        cut, written_by = self._read(kind, step, path)
      except CheckpointError:
        raise
      except Exception as err:  # pylint: disable=broad-except
        reason = f"{type(err).__name__}: {err}"
        skipped.append({"number": step, "path": path, "reason": reason[:500]})
        logging.warning("checkpoint %s is damaged or partial (%s): trying the previous one",
                        path, reason[:300])
        continue
      if skipped:
        logging.warning("restoring %s instead of the newer %s", path,
                        ", ".join(s["path"] for s in skipped))
      return RestoredCheckpoint(cut, path, skipped, written_by)
    if skipped:
      raise CheckpointError(f"no {kind} checkpoint in {self.directory} reads back whole: " +
                            "; ".join(f"{s['path']}: {s['reason'][:200]}" for s in skipped))
    return None

  def _read(self, kind: str, number: int, path: str) -> tuple[JobCut, dict[str, str]]:
    restored = self._manager(kind).restore(number, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(), data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore()))
    meta, arrays, data = restored["meta"], restored["arrays"], restored["data"] or {}
    self._check_fingerprint(meta, path)
    if _crc(arrays) != meta["crc32"]:
      bad = sorted(k for k, v in _crc(arrays).items() if meta["crc32"].get(k) != v)
      raise ValueError(f"the bytes of {len(bad)} array(s) do not match their CRC-32 "
                       f"(first: {bad[:3]})")
    learners = []
    for info in meta.get("learners", []):
      saved = arrays[f"learner_{info['index']}"]
      state = data.get(str(info["index"]))
      learners.append(LearnerCut(
          index=info["index"], incarnation=info["incarnation"], step=info["step"],
          params=_unkeyed(saved["params"], info["param_names"]),
          opt_state=[saved["opt"][k] for k in sorted(saved["opt"])],
          state_step=saved["state_step"],
          **{k: np.asarray(info[k], np.int64) for k in _COUNTERS},
          anchors=_unkeyed(saved.get("anchors", {}), info["anchor_names"]),
          data_state=json.dumps(state).encode() if state is not None else None))
    syncer = None
    if meta.get("syncer") is not None:
      syncer = {"arrays": arrays["syncer"], "json": meta["syncer"]}
    return JobCut(meta["clock"], learners, syncer, meta.get("history", {})), meta["fingerprint"]


def locate(restore: str, directory: str) -> tuple[str, int | None]:
  """(checkpoint directory, number or None for the newest) that `config.restore` names.

  A path is either a checkpoint directory (`.../job/<number>`) or a directory of them.
  """
  if restore in ("auto", "latest", "none"):
    return directory, None
  path = restore.rstrip("/")
  base = os.path.basename(path)
  if base.isdigit() and os.path.basename(os.path.dirname(path)) == _JOB:
    return os.path.dirname(os.path.dirname(path)), int(base)
  if os.path.basename(path) == _JOB:
    return os.path.dirname(path), None
  return path, None


# ---- the model alone, outside a run ----------------------------------------------------------------


@dataclasses.dataclass
class SavedModel:
  """The global model of a job checkpoint, for sampling or evaluating outside a run."""

  path: str
  clock: int  # the checkpoint's number: steps of the fastest learner
  fingerprint: dict[str, str]  # the experiment's config fields (see `fingerprint`)
  model_cfg: model_lib.ModelConfig
  params: dict[str, np.ndarray]  # native layout, host arrays
  source: str  # "syncer" (Theta, the global model) | "learner 0" (dp mode: the one model)

  def config_value(self, name: str) -> Any:
    """The value of config field `name` (dotted) in the run that wrote the checkpoint."""
    return ast.literal_eval(self.fingerprint[name])


def read_model(directory: str, number: int | None = None) -> SavedModel:
  """The global model of the newest job checkpoint in `directory` that reads back whole (or of
  checkpoint `number`): the syncer's Theta, or in dp mode the learner's parameters.

  The model's shape comes from the checkpoint's own fingerprint, so no config is needed; a damaged
  checkpoint is skipped as at resume. Raises CheckpointError when there is none.
  """
  directory = directory if "://" in directory else os.path.abspath(directory)
  if "://" not in directory and not os.path.isdir(os.path.join(directory, _JOB)):
    raise CheckpointError(f"{directory} holds no job checkpoint ({_JOB}/ is missing): the run "
                          "wrote none (config.checkpoint.every_steps=0?) or it is elsewhere "
                          "(config.checkpoint.dir)")
  probe = Checkpoints(directory, keep=None, fingerprint_={})
  available = probe.steps(_JOB)
  if number is not None and number not in available:
    probe.close()
    raise CheckpointError(f"{directory} holds no job checkpoint {number}; it holds "
                          f"{', '.join(map(str, available)) or 'none'}")
  numbers = [number] if number is not None else list(reversed(available))
  metas = (probe._read_meta(_JOB, n) for n in numbers)  # pylint: disable=protected-access
  meta = next((m for m in metas if m is not None), None)
  probe.close()
  if meta is None:
    raise CheckpointError(f"no job checkpoint in {directory} has a readable meta item "
                          f"(numbers tried: {numbers})")
  store = Checkpoints(directory, keep=None, fingerprint_=meta["fingerprint"])
  try:
    restored = store.restore_job(number)
  finally:
    store.close()
  if restored is None:
    raise CheckpointError(f"no job checkpoint in {directory}")
  fields = {name[len("model."):]: ast.literal_eval(value)
            for name, value in meta["fingerprint"].items() if name.startswith("model.")}
  model_cfg = model_lib.ModelConfig(**fields)
  cut = restored.cut
  if cut.syncer is not None:
    # A sharded syncer's state holds each shard's under shard_<i> (sharded_syncer.combine_states).
    shards = cut.syncer["json"].get("shards")
    parts = [(cut.syncer["json"], cut.syncer["arrays"])] if shards is None else [
        (values, cut.syncer["arrays"][f"shard_{i}"]) for i, values in enumerate(shards)]
    flat = {}
    for values, arrays in parts:
      names, theta = values["model"]["names"], arrays["theta"]
      flat.update({n: np.asarray(theta[f"{i:04d}"]) for i, n in enumerate(names)})
    params, source = model_lib.param_layout(model_cfg).to_native(flat), "syncer"
  else:
    learner = min(cut.learners, key=lambda l: l.index)
    params = {n: np.asarray(v) for n, v in learner.params.items()}
    source = f"learner {learner.index}"
  return SavedModel(restored.path, cut.clock, meta["fingerprint"], model_cfg, params, source)
