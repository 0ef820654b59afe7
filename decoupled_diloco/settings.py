"""Start-up validation of an experiment config and the effective settings a run uses.

Every field is checked here, before JAX compiles anything, and every error names the field, its value
and what is allowed. `validate` also resolves `config.mode` into the effective sync settings: the
lock-step baselines (diloco, streaming) and data-parallel (dp) run in the same runtime, so their
differences are spelled out in one place.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import ml_collections

from decoupled_diloco.algorithm import compression
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import merge
from decoupled_diloco.algorithm import outer
from decoupled_diloco.algorithm import schedule as schedule_lib
from decoupled_diloco.lm import data as data_lib
from decoupled_diloco.lm import inner
from decoupled_diloco.lm import model as model_lib

MODES = ("decoupled", "diloco", "streaming", "dp")
PLATFORMS = ("cpu", "gpu", "tpu")
ANCHORS = ("learner", "syncer")
BROADCAST_FORMATS = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class SyncSettings:
  """Effective sync settings after `config.mode` is resolved (spec §3-§4)."""

  num_fragments: int  # P
  period: int  # H
  overlap: int  # tau
  quorum: int  # K
  lock_step: bool  # learners wait for each merge (diloco, streaming); never in decoupled mode
  grace_gamma: float
  grace_cap_s: float
  ema_decay: float
  fragmentation: str

  @property
  def schedule(self) -> schedule_lib.SyncSchedule:
    return schedule_lib.SyncSchedule(self.num_fragments, self.period, self.overlap)


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """What a run does, derived from a validated config."""

  mode: str
  num_learners: int  # learners that train (1 in dp mode)
  learner_mesh_shapes: tuple[tuple[int, int], ...]  # (data, model) per learner
  learner_batch_size: int  # sequences per step of each learner
  learner_step_delays_s: tuple[float, ...]  # per learner
  syncer_devices: int  # 0 in dp mode: no syncer
  syncer_workers: int  # threads that run merges of different fragments at once
  sync: SyncSettings | None  # None in dp mode
  model: model_lib.ModelConfig
  data_path: str
  stall_timeout_s: float  # fail when no learner steps (or the flush does not end) for this long

  @property
  def learner_devices(self) -> int:
    return sum(d * m for d, m in self.learner_mesh_shapes)


def _fail(field: str, value, allowed: str):
  raise ValueError(f"config.{field}={value!r} is invalid: {allowed}")


def _check_int(config, field: str, low: int, high: int | None = None) -> int:
  value = _get(config, field)
  if isinstance(value, bool) or not isinstance(value, int):
    _fail(field, value, "must be an integer")
  if value < low or (high is not None and value > high):
    bound = f"between {low} and {high}" if high is not None else f">= {low}"
    _fail(field, value, f"must be {bound}")
  return value


def _check_float(config, field, low, high=None, *, high_open=False, low_open=False):
  value = _get(config, field)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    _fail(field, value, "must be a number")
  value = float(value)
  bad_low = value <= low if low_open else value < low
  bad_high = high is not None and (value >= high if high_open else value > high)
  if bad_low or bad_high:
    left = "(" if low_open else "["
    right = ")" if high_open else "]"
    _fail(field, value, f"must be in {left}{low}, {high if high is not None else 'inf'}{right}")
  return value


def _check_choice(config, field: str, allowed: Sequence[str]) -> str:
  value = _get(config, field)
  if value not in allowed:
    _fail(field, value, f"must be one of {', '.join(allowed)}")
  return value


def _get(config, field: str):
  node = config
  for part in field.split("."):
    if part not in node:
      raise ValueError(f"config.{field} is missing from the config")
    node = node[part]
  return node


def _mesh_shapes(config, num_learners: int) -> tuple[tuple[int, int], ...]:
  shapes = _get(config, "learner_mesh_shapes")
  if not isinstance(shapes, (list, tuple)) or len(shapes) not in (1, num_learners):
    _fail("learner_mesh_shapes", shapes,
          f"must hold one (data, model) pair for all learners or one per learner "
          f"(num_learners={num_learners})")
  parsed = []
  for shape in shapes:
    if (not isinstance(shape, (list, tuple)) or len(shape) != 2 or
        not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape)):
      _fail("learner_mesh_shapes", shapes, "each entry must be a (data, model) pair of ints >= 1")
    parsed.append((int(shape[0]), int(shape[1])))
  if len(parsed) == 1:
    parsed = parsed * num_learners
  return tuple(parsed)


def _resolve_sync(config, mode: str, num_learners: int) -> SyncSettings:
  period = _check_int(config, "sync.period", 1)
  num_fragments = _check_int(config, "sync.num_fragments", 1)
  overlap = _check_int(config, "sync.overlap", 0)
  quorum = _check_int(config, "sync.quorum", 1, num_learners)
  grace_gamma = _check_float(config, "sync.grace_gamma", 0.0, 1.0, high_open=True)
  grace_cap_s = _check_float(config, "sync.grace_cap_s", 0.0)
  ema_decay = _check_float(config, "sync.ema_decay", 0.0, 1.0, high_open=True)
  fragmentation = _check_choice(config, "sync.fragmentation", fragments_lib.METHODS)
  lock_step = False
  if mode == "diloco":
    # DiLoCo: every H steps all learners stop, the whole model is merged, then training resumes.
    num_fragments, overlap, quorum, lock_step = 1, 0, num_learners, True
    grace_gamma = 0.0
  elif mode == "streaming":
    # Streaming DiLoCo: staggered fragments, results applied tau steps later, all learners wait.
    quorum, lock_step, grace_gamma = num_learners, True, 0.0
  # The schedule validates P, H and tau against each other and names the fields.
  schedule_lib.SyncSchedule(num_fragments, period, overlap)
  return SyncSettings(num_fragments, period, overlap, quorum, lock_step, grace_gamma, grace_cap_s,
                      ema_decay, fragmentation)


def validate(config: ml_collections.ConfigDict) -> RunSettings:
  """Checks every field of `config`; returns the effective settings or raises ValueError."""
  mode = _check_choice(config, "mode", MODES)
  _check_int(config, "seed", 0)
  if not isinstance(_get(config, "workdir"), str) or not config.workdir:
    _fail("workdir", config.workdir, "must be a non-empty directory path")
  num_steps = _check_int(config, "num_steps", 1)
  stall_timeout_s = _check_float(config, "stall_timeout_s", 0.0, low_open=True)
  _check_int(config, "log_every", 1)
  _check_int(config, "eval_every", 0)
  _check_int(config, "eval_batches", 1)
  _check_choice(config, "devices.platform", PLATFORMS)
  _check_int(config, "devices.num_fake_cpu_devices", 0)

  num_learners = _check_int(config, "num_learners", 1)
  mesh_shapes = _mesh_shapes(config, num_learners)
  delays = _get(config, "learner_step_delays_s")
  if not isinstance(delays, (list, tuple)) or len(delays) not in (0, num_learners) or any(
      isinstance(d, bool) or not isinstance(d, (int, float)) or d < 0 for d in delays):
    _fail("learner_step_delays_s", delays,
          f"must be empty or hold num_learners={num_learners} numbers >= 0")
  delays = tuple(float(d) for d in delays) or (0.0,) * num_learners
  syncer_devices = _check_int(config, "syncer.num_devices", 1)
  syncer_workers = _check_int(config, "syncer.num_workers", 1)

  sync = _resolve_sync(config, mode, num_learners)
  _check_choice(config, "merge.rule", merge.MERGE_RULES)
  _check_choice(config, "merge.weighting", merge.WEIGHTINGS)
  _check_choice(config, "merge.anchor", ANCHORS)
  _check_float(config, "merge.alpha", 0.0, 1.0, high_open=True)
  if not isinstance(_get(config, "merge.keep_in_flight_progress"), bool):
    _fail("merge.keep_in_flight_progress", config.merge.keep_in_flight_progress,
          "must be True or False")
  # The factories check their own fields and name them.
  outer.make_outer_optimizer(config.outer.name, config.outer.learning_rate, config.outer.momentum)
  _check_choice(config, "compression.outer_grad", compression.FORMATS)
  _check_choice(config, "compression.broadcast", BROADCAST_FORMATS)
  _check_int(config, "compression.block_size", 1)
  inner.make_inner_optimizer(config.inner, num_steps)
  model_cfg = model_lib.ModelConfig.from_config(config.model)

  if model_cfg.attention == "cudnn" and _get(config, "devices.platform") != "gpu":
    _fail("model.attention", model_cfg.attention,
          "needs config.devices.platform='gpu' (cuDNN flash attention has no CPU or TPU kernel)")

  seq_len = _check_int(config, "data.seq_len", 1)
  batch_size = _check_int(config, "data.batch_size", 1)
  _check_float(config, "data.eval_fraction", 0.0, 0.5, low_open=True)
  if seq_len > model_cfg.max_seq_len:
    _fail("data.seq_len", seq_len, f"must be <= config.model.max_seq_len={model_cfg.max_seq_len}")
  if model_cfg.vocab_size < 256:
    _fail("model.vocab_size", model_cfg.vocab_size, "must be >= 256 for byte-level tokens")
  path = _get(config, "data.path")
  if not isinstance(path, str):
    _fail("data.path", path, "must be a path string ('' = the bundled corpus)")
  path = path or data_lib.default_corpus_path()
  if not os.path.isfile(path):
    _fail("data.path", path, "no such file")
  if os.path.getsize(path) == 0:
    _fail("data.path", path, "the file is empty")

  if mode == "dp":
    # One synchronous learner over every learner device, consuming what all M learners would.
    model_axis = mesh_shapes[0][1]
    total = sum(d * m for d, m in mesh_shapes)
    mesh_shapes = ((total // model_axis, model_axis),)
    batch_size *= num_learners
    delays = (0.0,)
    num_learners, syncer_devices, sync = 1, 0, None

  for index, (data_axis, _) in enumerate(mesh_shapes):
    if batch_size % data_axis:
      _fail("data.batch_size", config.data.batch_size,
            f"the batch of learner {index} ({batch_size} sequences) must divide evenly over its "
            f"data axis of {data_axis} devices (config.learner_mesh_shapes)")

  if sync is not None:
    # Partitioning needs only shapes: a P larger than the model's tensor count fails here, not later.
    fragments_lib.partition(model_lib.param_shapes(model_cfg), sync.num_fragments,
                            sync.fragmentation, embedding_names=(model_lib.EMBEDDING_NAME,))

  return RunSettings(
      mode=mode,
      num_learners=num_learners,
      learner_mesh_shapes=mesh_shapes,
      learner_batch_size=batch_size,
      learner_step_delays_s=delays,
      syncer_devices=syncer_devices,
      syncer_workers=syncer_workers,
      sync=sync,
      model=model_cfg,
      data_path=path,
      stall_timeout_s=stall_timeout_s,
  )
