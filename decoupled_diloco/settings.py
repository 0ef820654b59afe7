"""Start-up validation of an experiment config into the one settings tree a run reads.

`validate(config)` checks every field before JAX compiles anything, each error naming the field, its
value and what is allowed, and returns `RunSettings`: frozen and typed, one field per config field
at the same dotted path (`config.merge.alpha` -> `settings.merge.alpha`). Below the entry point
nothing reads the raw `ConfigDict`, so no field can skip validation.

Defaults are written once, in the experiment config (experiments/tiny_cpu.py sets every field, with
a comment; the other experiments start from it). The dataclasses here have no defaults: a field
missing from a config is an error, not a second default, and a field the tree does not know (a
misspelt name) is an error naming the closest known fields.

`validate` also resolves `config.mode`: the lock-step baselines (diloco, streaming) and
data-parallel (dp) run in the same runtime, so their differences are spelled out here, and the tree
holds the values the run uses (in dp mode one learner, no syncer, no sync settings).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import tempfile
import typing
from collections.abc import Sequence

import ml_collections
from absl import logging

from decoupled_diloco.algorithm import compression
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import heartbeat
from decoupled_diloco.algorithm import merge
from decoupled_diloco.algorithm import outer
from decoupled_diloco.algorithm import schedule as schedule_lib
from decoupled_diloco.lm import array_records
from decoupled_diloco.lm import data as data_lib
from decoupled_diloco.lm import documents
from decoupled_diloco.lm import inner
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.lm import splash
from decoupled_diloco.lm import tokenizers
from decoupled_diloco import chaos

MODES = ("decoupled", "diloco", "streaming", "dp")
PLATFORMS = ("cpu", "gpu", "tpu")
DONATE_STATE = ("auto", "always", "never")
RUNTIMES = ("threads", "ray")
# What config.runtime=ray fires: a crash is a SIGKILL of the learner's process (random crashes
# too); the syncer and the checkpoints are in the command's process there, as under threads.
RAY_FAULTS = ("crash", "syncer_crash", "corrupt_checkpoint", "node_loss")
ANCHORS = ("learner", "syncer")
BROADCAST_FORMATS = ("fp32", "bf16")
# config.compression.broadcast_delta: "none" (full broadcasts) or a lossy outer-gradient format.
BROADCAST_DELTA_FORMATS = ("none",) + tuple(f for f in compression.FORMATS if f != "fp32")

# Config fields added since checkpoints and tapes were first written, each with the value a run made
# before it existed ran as: a checkpoint or a tape without the field is read as having it.
ADDED_FIELDS = {"outer.nesterov_delay": "0", "outer.staleness_scaling": "'none'",
                "devices.fake_slice_size": "0", "devices.slice_poll_s": "10.0",
                "ray.learner_resource": "''", "ray.syncer_resource": "''", "ray.tpu_slice": "''",
                "model.splash_block_q": "0", "model.splash_block_kv": "0",
                "syncer.merge_delay_steps": "0",
                "syncer.num_shards": "1", "syncer.merge_threads": "2"}

# Metadata of a settings field that `validate` computes rather than reads: not a config field.
_DERIVED = {"derived": True}
# Set to 1 by scripts/gpu_triage.py only, in the one run that tries cuDNN attention with learners
# sharing a GPU (to record whether it still crashes); every other run keeps the refusal below.
CUDNN_SHARING_TRIAL_ENV = "DECOUPLED_DILOCO_TRIAL_CUDNN_SHARING"


@dataclasses.dataclass(frozen=True)
class DevicesSettings:
  platform: str  # whose devices the learners use: cpu | gpu | tpu
  num_fake_cpu_devices: int  # host devices requested before JAX starts; 0 = the real devices
  # Consecutive learners that train on the same devices (runtime/core/device_share.py), their steps
  # interleaved: learners 0..n-1 share the first learner's devices, n..2n-1 the next ones. 1 = every
  # learner on devices of its own. Resolved to 1 in dp mode (one job over the distinct devices).
  learners_sharing_devices: int
  # Memory of one learner device the run may fill, in GB, checked before anything is placed
  # (runtime/hardware/device_memory.py); 0 = what the device reports (none on CPU: then unchecked).
  memory_per_device_gb: float
  # Per learner, the TPU slice it runs on ("v5p:4x4x4"), one name for all or one per learner as
  # the config gives it; resolved to one per learner, () when none is named (and in dp mode, one
  # job over every learner's chips). A TPU run checks its chips' generation against it;
  # scripts/aot_compile.py compiles each learner for it.
  tpu_topologies: tuple[str, ...]
  # Fake CPU devices grouped by id into emulated slices of this many (runtime/core/slices.py); 0 =
  # none. CPU only: TPU devices carry their slice_index.
  fake_slice_size: int
  # Under Pathways (JAX_PLATFORMS=proxy): seconds between two checks whether a learner's lost
  # slice is back (runtime/control/slice_watch.py). Unused elsewhere.
  slice_poll_s: float


@dataclasses.dataclass(frozen=True)
class RaySettings:
  # config.runtime=ray: "" starts a local Ray inside the command (loopback only); "auto" or an
  # address (host:port, ray://host:port) joins a running cluster.
  address: str
  # Processes (Ray actors, one per host of a multi-host slice or GPU node) per learner: each holds
  # 1/this of the learner's devices, and together they run the learner as one jax.distributed
  # job. 1: a learner is one process.
  processes_per_learner: int
  # A custom Ray resource every learner process asks one unit of ("" = none: any node with a free
  # CPU). Nodes that advertise it (`ray start --resources='{"NAME": 1}'`) are the hosts learners run
  # on; one more such node than processes is the spare a learner restarts on when its host is lost.
  learner_resource: str = ""
  # The same for the syncer's process: the host(s) it runs and restarts on.
  syncer_resource: str = ""
  # "" = off | a TPU generation and topology ("v5p:2x2x2", a v5p-16): each learner is one whole
  # TPU slice of it, claimed through Ray's slice head resource, one process per host
  # (runtime/transport/ray_tpu_slices.py; docs/ray.md).
  tpu_slice: str = ""
  # config.ray.tpu_slice as Ray's TPU tables describe it; None when off.
  slice: TpuSlice | None = dataclasses.field(default=None, metadata=_DERIVED)


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """The TPU slice each learner runs on (config.ray.tpu_slice), in Ray's terms."""

  generation: str  # Ray's spelling: "v5p", "v5litepod", "v6e"
  topology: str  # "2x2x2"
  pod_type: str  # "v5p-16": what `gcloud --accelerator-type` and Ray's head resource call it
  hosts: int  # TPU VMs in the slice: a learner's processes
  chips_per_host: int  # the `TPU` resource Ray advertises on each host, all of it per process

  @property
  def chips(self) -> int:
    return self.hosts * self.chips_per_host

  @property
  def accelerator_type(self) -> str:
    """Ray's accelerator type of the slice's hosts ("TPU-V5P")."""
    return f"TPU-{self.generation.upper()}"

  @property
  def head_resource(self) -> str:
    """The resource Ray advertises on worker 0 of every slice of this pod type only."""
    return f"TPU-{self.pod_type}-head"


@dataclasses.dataclass(frozen=True)
class SyncerSettings:
  num_devices: int  # CPU devices of the syncer mesh (of each shard's); 0 in dp mode (no syncer)
  num_workers: int  # threads that run merges of different fragments at once (in each shard)
  # Each merge holds its worker for this many steps of the fastest learner: a syncer slower than
  # the learners, emulated (runtime/core/syncer/merge_hold.py). 0 = none; 0 in dp mode (no syncer).
  merge_delay_steps: int
  # Shards of the syncer, each owning some fragments (algorithm/shards.py); 1 = not sharded, and
  # in dp mode and a replay (which merges on one global model in the recorded order).
  num_shards: int = 1
  # Threads of one merge (runtime/core/fused_merge.py): its offers and tensors run on them.
  merge_threads: int = 2
  # After a merge, the process's freed C heap goes back to the OS if the syncer last looked this
  # many seconds ago and it holds enough free (runtime/core/host_heap.py); 0 = never.
  heap_trim_every_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class SyncSettings:
  """Effective sync settings after `config.mode` is resolved (docs/design.md §3-§4)."""

  num_fragments: int  # P
  period: int  # H
  overlap: int  # tau
  quorum: int  # K
  # Learners wait for each merge (diloco, streaming); never in decoupled mode. From config.mode.
  lock_step: bool = dataclasses.field(metadata=_DERIVED)
  grace_gamma: float
  grace_cap_s: float
  ema_decay: float
  fragmentation: str
  # A learner silent (no step report) for longer is absent: no quorum, no grace wait, late offers
  # weight 0, until it reports again. Seconds; 0 = auto (algorithm/heartbeat.py). Decoupled only.
  heartbeat_timeout_s: float
  # Lock-step modes: a learner that is down is dropped from the barrier (the round merges the
  # learners present) and taken back when it rejoins; False = every learner waits for it.
  elastic_lock_step: bool

  @property
  def schedule(self) -> schedule_lib.SyncSchedule:
    return schedule_lib.SyncSchedule(self.num_fragments, self.period, self.overlap)


@dataclasses.dataclass(frozen=True)
class MergeSettings:
  rule: str  # rda | average (the embedding is always averaged)
  weighting: str  # merge.WEIGHTINGS
  anchor: str  # learner | syncer: the Theta an outer gradient is taken against
  alpha: float  # on receive theta <- alpha theta + (1 - alpha) Theta; 0 = overwrite
  keep_in_flight_progress: bool  # on receive keep the steps no merge has taken
  # Reject an outer gradient whose norm exceeds this x the median of the fragment's recent accepted
  # norms (one that is not finite always); 0 = no outlier test (algorithm/robust.py).
  max_norm_ratio: float


@dataclasses.dataclass(frozen=True)
class OuterSettings:
  name: str  # outer.OPTIMIZERS
  learning_rate: float
  momentum: float
  nesterov_delay: int  # 0 = off; N >= 2: Delayed Nesterov (momentum once every N merges of p)
  staleness_scaling: str  # merge.STALENESS_SCALINGS: the factor on a stale offer's outer gradient


@dataclasses.dataclass(frozen=True)
class CompressionSettings:
  outer_grad: str  # learner -> syncer wire format, compression.FORMATS
  broadcast: str  # syncer -> learner wire format, fp32 | bf16 (with broadcast_delta: keyframes)
  block_size: int  # values per fp32 scale of the integer formats
  # "none": every merge sends the whole Theta_p; else the format of Theta_p - R_p, the change from
  # what the learners hold (runtime/core/global_model.py, the delta broadcast)
  broadcast_delta: str = "none"


@dataclasses.dataclass(frozen=True)
class DataSettings:
  # Resolved: the bundled corpus when the config says ""; a text file, a directory or glob of
  # .txt / .jsonl / .parquet files, or a directory of ArrayRecord shards (scripts/prepare_data.py).
  source: str
  # Resolved, as `lm.tokenizers.load` takes it: "byte" or a tokenizer file; "" in the config is the
  # data's own (byte for text, meta.json's for ArrayRecord shards).
  tokenizer: str
  text_field: str  # the text of a .jsonl line / .parquet row
  seq_len: int
  batch_size: int  # per learner as configured (dp mode: see RunSettings.learner_batch_size)
  # One per learner as configured, or () = batch_size for all (RunSettings.learner_batch_sizes).
  learner_batch_sizes: tuple[int, ...]
  eval_fraction: float
  # The last fraction of the training text held out as a validation split (0 = none): every
  # evaluation also reports the global model's loss on it, for tuning without the eval split.
  validation_fraction: float


@dataclasses.dataclass(frozen=True)
class ChaosSettings:
  """Faults to inject (`chaos.py` gives the schedule's grammar)."""

  schedule: str
  mtbf_s: float  # random crashes: mean time between failures per learner; 0 = off
  repair_s: float  # their mean repair time
  repair_shape: float  # Weibull shape of the repair times
  seed: int
  node_loss_fraction: float  # the share of random faults that are node losses (runtime=ray)
  faults: tuple[chaos.Fault, ...] = dataclasses.field(metadata=_DERIVED)  # the schedule, parsed
  random_crashes: chaos.RandomCrashes = dataclasses.field(metadata=_DERIVED)

  @property
  def enabled(self) -> bool:
    return bool(self.faults) or self.random_crashes.enabled


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
  """Whole-job checkpoints (orbax) and the syncer's own, more frequent ones (`runtime/records/checkpoints.py`)."""

  every_steps: int  # a consistent cut of the whole job every this many steps of the clock; 0 = none
  dir: str  # resolved: workdir/checkpoints when the config says ""; local or gs://
  keep: int  # newest checkpoints kept of each kind
  syncer_every_s: float  # the syncer's state alone, every this many seconds; 0 = never


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """What a run does: every config field, validated, with the value the run uses."""

  mode: str
  seed: int
  workdir: str
  num_steps: int
  log_every: int
  eval_every: int
  eval_batches: int
  stall_timeout_s: float  # fail when no learner steps (or the flush does not end) for this long
  max_restarts: int  # per learner; a learner that fails once more stays down
  devices: DevicesSettings
  # threads: every learner a thread of this process | ray: every learner a process of its own
  # (runtime/transport/ray_runtime.py).
  runtime: str
  ray: RaySettings
  num_learners: int  # learners that train (1 in dp mode)
  # (data, model) or (data, fsdp, model) per learner, as written in the config.
  learner_mesh_shapes: tuple[tuple[int, ...], ...]
  learner_step_delays_s: tuple[float, ...]  # per learner
  learner_step_noise_s: float  # mean of each learner's uniform extra sleep per step
  late_learners: tuple[int, ...]  # held back at start; each joins at its join@ event
  syncer: SyncerSettings
  sync: SyncSettings | None  # None in dp mode
  merge: MergeSettings
  outer: OuterSettings
  compression: CompressionSettings
  inner: inner.InnerConfig
  model: model_lib.ModelConfig
  data: DataSettings
  chaos: ChaosSettings
  checkpoint: CheckpointSettings
  # auto: resume from the newest checkpoint in checkpoint.dir if there is one | latest: resume, and
  # fail if there is none | none: start afresh (checkpoint.dir must hold none) | a checkpoint path.
  restore: str
  # (first, last) steps (0-based, inclusive) of learner 0 traced by jax.profiler into
  # workdir/profile; None = no trace (the config's ()).
  profile_steps: tuple[int, int] | None
  # Persistent JAX compilation cache, resolved: workdir/jax_cache for the config's "", None for
  # "none" (the run sets none; one JAX's own flags or environment set stands).
  compilation_cache_dir: str | None
  # auto | always | never, as written; `donates_state` is what the run does.
  donate_state: str
  # Write the event tape, workdir/tape.jsonl (runtime/records/event_tape.py): what a replay follows.
  tape: bool
  # "" = train | the workdir of a recorded run: replay its tape instead of racing (exactly, or
  # under other merge / outer / compression settings: a counterfactual replay).
  replay: str
  # Sequences per step of a learner: data.batch_size, times num_learners in dp mode.
  learner_batch_size: int = dataclasses.field(metadata=_DERIVED)
  # Sequences per step of each learner: data.learner_batch_sizes, or learner_batch_size for all.
  learner_batch_sizes: tuple[int, ...] = dataclasses.field(default=(), metadata=_DERIVED)
  # Whether the learners' steps donate the train state: donate_state resolved for the platform.
  donates_state: bool = dataclasses.field(default=False, metadata=_DERIVED)

  def tokens_per_step(self, learner: int) -> int:
    """Tokens in one step of learner `learner`."""
    return self.learner_batch_sizes[learner] * self.data.seq_len

  @property
  def learner_devices(self) -> int:
    """Distinct devices the learners train on (learners that share devices count them once)."""
    return sum(math.prod(shape) for shape in self.learner_mesh_shapes
               ) // self.devices.learners_sharing_devices


def _section_type(hint) -> type | None:
  """The dataclass behind a field's type (`SyncSettings | None` -> SyncSettings), else None."""
  for candidate in (hint, *typing.get_args(hint)):
    if dataclasses.is_dataclass(candidate):
      return candidate
  return None


@functools.cache
def _config_fields() -> dict[str, tuple[str, ...]]:
  """Section (or "" for the top level) -> the config fields in it, read off the settings tree."""
  hints = typing.get_type_hints(RunSettings)
  tree: dict[str, tuple[str, ...]] = {"": ()}
  for field in dataclasses.fields(RunSettings):
    if field.metadata.get("derived"):
      continue
    section = _section_type(hints[field.name])
    if section is None:
      tree[""] += (field.name,)
    else:
      tree[field.name] = tuple(f.name for f in dataclasses.fields(section)
                               if not f.metadata.get("derived"))
  return tree


def config_fields() -> tuple[str, ...]:
  """Every field an experiment config must set, dotted ("sync.quorum")."""
  return tuple(f"{section}.{name}" if section else name
               for section, names in _config_fields().items() for name in names)


# Fields that were renamed: a config that still sets one gets the new name and the reason.
RENAMED = {
    "data.path": ("data.source", "it now takes a text file, a directory or glob of .txt / .jsonl "
                                 "/ .parquet files, or a directory of ArrayRecord shards made by "
                                 "scripts/prepare_data.py"),
}


def unknown_field_error(name: str) -> str:
  """The one-line error for a config field the settings tree does not know."""
  if name in RENAMED:
    new_name, why = RENAMED[name]
    return f"config.{name} was renamed to config.{new_name}: {why}. Set config.{new_name} instead"
  sections = [s for s in _config_fields() if s]
  if name in sections:
    return f"config.{name} must be a section of fields, not a value"
  # A misspelt name is usually the right section with a wrong leaf (sync.qorum) or a right leaf in
  # the wrong section (quorum): score each known field by the better of the two comparisons.
  leaf = name.rsplit(".", 1)[-1]

  def likeness(known: str) -> float:
    return max(difflib.SequenceMatcher(None, name, known).ratio(),
               difflib.SequenceMatcher(None, leaf, known.rsplit(".", 1)[-1]).ratio())

  closest = sorted(config_fields(), key=likeness, reverse=True)[:3]
  return (f"config.{name} is not a config field; the closest known: "
          f"{', '.join('config.' + c for c in closest)} (experiments/tiny_cpu.py sets them all)")


def _given_fields(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  names = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      names += _given_fields(value, f"{prefix}{key}.")
    else:
      names.append(f"{prefix}{key}")
  return names


def _check_fields(config: ml_collections.ConfigDict) -> None:
  """Every given field is known and every known field is given: a typo fails here, named."""
  given = _given_fields(config)
  known = config_fields()
  for name in given:
    if name not in known:
      raise ValueError(unknown_field_error(name))
  for name in known:
    if name not in given:
      raise ValueError(f"config.{name} is missing from the config (experiments/tiny_cpu.py sets "
                       f"every field)")


def _fail(field: str, value, allowed: str):
  raise ValueError(f"config.{field}={value!r} is invalid: {allowed}")


def _get(config, field: str):
  node = config
  for part in field.split("."):
    node = node[part]
  return node


def _check_int(config, field: str, low: int, high: int | None = None, high_name: str = "") -> int:
  """`high_name`: the field the upper bound comes from, named in the error with its value."""
  value = _get(config, field)
  if isinstance(value, bool) or not isinstance(value, int):
    _fail(field, value, "must be an integer")
  if value < low or (high is not None and value > high):
    upper = f"{high_name}={high}" if high_name else f"{high}"
    bound = f"between {low} and {upper}" if high is not None else f">= {low}"
    _fail(field, value, f"must be {bound}")
  return value


def _check_float(config, field, low, high=None, *, high_open=False, low_open=False) -> float:
  value = _get(config, field)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    _fail(field, value, "must be a number")
  value = float(value)
  if value != value:  # NaN passes every comparison below, and then disables what it bounds
    _fail(field, value, "must be a number, not NaN")
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


def _check_bool(config, field: str) -> bool:
  value = _get(config, field)
  if not isinstance(value, bool):
    _fail(field, value, "must be True or False")
  return value


def _section(config, name: str) -> dict:
  """The fields of `config.<name>` as keyword arguments, for a dataclass that checks them."""
  return {field: config[name][field] for field in _config_fields()[name]}


def _workdir(config) -> str:
  workdir = _get(config, "workdir")
  if not isinstance(workdir, str) or not workdir:
    _fail("workdir", workdir, "must be a non-empty directory path")
  _local_dir("workdir", workdir)
  return workdir


def _check_num_shards(num_shards: int, mode: str, sync: SyncSettings | None,
                      chaos_settings: ChaosSettings) -> None:
  """config.syncer.num_shards: a decoupled syncer of at most one shard per fragment."""
  if num_shards > 1 and mode != "decoupled":
    _fail("syncer.num_shards", num_shards, f"must be 1 with config.mode={mode!r}: only the "
          "decoupled syncer is sharded (dp mode has no syncer; a lock-step round is one shard's)")
  if sync is not None and num_shards > sync.num_fragments:
    _fail("syncer.num_shards", num_shards, f"must be between 1 and config.sync.num_fragments="
          f"{sync.num_fragments}: each shard owns at least one fragment")
  chaos.check_shards(chaos_settings.faults, num_shards)


def _replay(config, workdir: str, mode: str, runtime: str, chaos_settings: ChaosSettings,
            late_learners: tuple[int, ...]) -> str:
  """config.replay: "" or the workdir of a recorded run, which holds its tape.jsonl."""
  replay = _get(config, "replay")
  if not isinstance(replay, str):
    _fail("replay", replay, "must be \"\" (train) or the workdir of a recorded run")
  if not replay:
    return ""
  if not os.path.isfile(os.path.join(replay, "tape.jsonl")):
    _fail("replay", replay, "holds no tape.jsonl: replay the workdir of a run made with "
          "config.tape=True")
  if os.path.abspath(replay) == os.path.abspath(workdir):
    _fail("replay", replay, "is config.workdir: a replay writes its own workdir, give it another")
  # What a replay follows so far: a decoupled run of learner threads, without faults.
  if mode != "decoupled":
    _fail("replay", replay, f"replays decoupled runs only (config.mode={mode!r})")
  if runtime != "threads":
    _fail("replay", replay, f"runs with config.runtime=\"threads\" only (not {runtime!r})")
  if chaos_settings.enabled or late_learners:
    _fail("replay", replay, "takes its faults from the tape: set no config.chaos faults")
  return replay


def _mesh_shapes(config, num_learners: int) -> tuple[tuple[int, ...], ...]:
  shapes = _get(config, "learner_mesh_shapes")
  if not isinstance(shapes, (list, tuple)) or len(shapes) not in (1, num_learners):
    _fail("learner_mesh_shapes", shapes,
          f"must hold one (data, model) or (data, fsdp, model) shape for all learners or one per "
          f"learner (num_learners={num_learners})")
  parsed = []
  for shape in shapes:
    if (not isinstance(shape, (list, tuple)) or len(shape) not in (2, 3) or
        not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape)):
      _fail("learner_mesh_shapes", shapes,
            "each entry must be a (data, model) pair or a (data, fsdp, model) triple of ints >= 1")
    parsed.append(tuple(int(v) for v in shape))
  if len(parsed) == 1:
    parsed = parsed * num_learners
  return tuple(parsed)


def _learners_sharing_devices(config, num_learners: int,
                              mesh_shapes: tuple[tuple[int, ...], ...]) -> int:
  """config.devices.learners_sharing_devices: consecutive groups of this many learners share one
  set of devices, so every learner of a group must have the same mesh shape."""
  sharing = _check_int(config, "devices.learners_sharing_devices", 1, num_learners,
                       "config.num_learners")
  if num_learners % sharing:
    _fail("devices.learners_sharing_devices", sharing,
          f"must divide config.num_learners={num_learners}: learners share devices in "
          f"consecutive groups of this many")
  for start in range(0, num_learners, sharing):
    group = mesh_shapes[start:start + sharing]
    if len(set(group)) > 1:
      _fail("devices.learners_sharing_devices", sharing,
            f"learners {start}..{start + sharing - 1} share devices, so they need one mesh "
            f"shape, but config.learner_mesh_shapes gives them {sorted(set(group))}")
  return sharing


# What scripts/aot_compile.py can compile for (a v4 chip is two devices, which this does not model).
TPU_TOPOLOGY_GENERATIONS = ("v5p", "v5e", "v6e")


def _tpu_topologies(config, num_learners: int, mesh_shapes: tuple[tuple[int, ...], ...]
                    ) -> tuple[str, ...]:
  names = _get(config, "devices.tpu_topologies")
  if not isinstance(names, (list, tuple)) or len(names) not in (0, 1, num_learners):
    _fail("devices.tpu_topologies", names,
          f"must be empty, one topology name for all learners or one per learner "
          f"(num_learners={num_learners})")
  names = tuple(names) * (num_learners if len(names) == 1 else 1)
  for index, name in enumerate(names):
    match = re.fullmatch(r"(v5p|v5e|v6e):(\d+)x(\d+)(?:x(\d+))?", name) if isinstance(
        name, str) else None
    if match is None:
      _fail("devices.tpu_topologies", names,
            f"entry {index} must be a topology name like 'v5p:4x4x4' or 'v6e:8x8' "
            f"(generation one of {', '.join(TPU_TOPOLOGY_GENERATIONS)})")
    chips = math.prod(int(d) for d in match.groups()[1:] if d)
    if chips != math.prod(mesh_shapes[index]):
      _fail("devices.tpu_topologies", names,
            f"{name} has {chips} chips but learner {index}'s mesh "
            f"(config.learner_mesh_shapes) has {math.prod(mesh_shapes[index])} devices")
  return names


def _fake_slice_size(config) -> int:
  size = _check_int(config, "devices.fake_slice_size", 0)
  if size and (_get(config, "devices.platform") != "cpu"
               or not _get(config, "devices.num_fake_cpu_devices")):
    _fail("devices.fake_slice_size", size,
          "emulates slices on fake CPU devices only: it needs config.devices.platform='cpu' and "
          "config.devices.num_fake_cpu_devices > 0 (TPU devices carry their own slice_index); "
          "0 = no emulated slices")
  return size


def _step_delays(config, num_learners: int) -> tuple[float, ...]:
  delays = _get(config, "learner_step_delays_s")
  if not isinstance(delays, (list, tuple)) or len(delays) not in (0, num_learners) or any(
      isinstance(d, bool) or not isinstance(d, (int, float)) or d < 0 for d in delays):
    _fail("learner_step_delays_s", delays,
          f"must be empty or hold num_learners={num_learners} numbers >= 0")
  return tuple(float(d) for d in delays) or (0.0,) * num_learners


def _late_learners(config, mode: str, num_learners: int,
                   faults: Sequence[chaos.Fault]) -> tuple[int, ...]:
  late = _get(config, "late_learners")
  if not isinstance(late, (list, tuple)) or any(
      isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < num_learners for m in late):
    _fail("late_learners", late, f"must be a tuple of learner indices in [0, {num_learners})")
  if len(set(late)) != len(late):
    _fail("late_learners", late, "must not repeat a learner")
  if late and len(late) >= num_learners:
    _fail("late_learners", late, f"must leave at least one of num_learners={num_learners} "
                                 "learners training from the start")
  if late and mode != "decoupled":
    _fail("late_learners", late, f"learners join mid-run in config.mode='decoupled' only "
                                 f"(mode={mode!r}): the lock-step modes train a fixed set")
  chaos.check_joins(faults, late)
  return tuple(int(m) for m in late)


def _merge_delay_steps(config, mode: str) -> int:
  """config.syncer.merge_delay_steps: >= 0, and 0 in the lock-step modes."""
  steps = _check_int(config, "syncer.merge_delay_steps", 0)
  if steps and mode in ("diloco", "streaming"):
    # Lock-step learners wait at the barrier for the merge, so the clock a held merge waits for
    # would never move.
    _fail("syncer.merge_delay_steps", steps,
          f"must be 0 with config.mode={mode!r}: its learners wait for every merge, so a merge "
          "held for their next steps would never be released (decoupled mode only)")
  return steps


def _nesterov_delay(config) -> int:
  """config.outer.nesterov_delay: 0 (off) or N >= 2, for the sgd_nesterov outer optimizer only."""
  delay = _check_int(config, "outer.nesterov_delay", 0)
  if delay == 1:
    _fail("outer.nesterov_delay", delay, "must be 0 (off) or >= 2: a delay of 1 is plain Nesterov")
  name = _get(config, "outer.name")
  if delay and name != "sgd_nesterov":
    _fail("outer.nesterov_delay", delay, f"needs config.outer.name='sgd_nesterov' (not {name!r}): "
          "it delays Nesterov momentum; 0 turns it off")
  return delay


def _resolve_sync(config, mode: str, num_learners: int) -> SyncSettings:
  period = _check_int(config, "sync.period", 1)
  num_fragments = _check_int(config, "sync.num_fragments", 1)
  overlap = _check_int(config, "sync.overlap", 0)
  quorum = _check_int(config, "sync.quorum", 1, num_learners, "config.num_learners")
  grace_gamma = _check_float(config, "sync.grace_gamma", 0.0, 1.0, high_open=True)
  grace_cap_s = _check_float(config, "sync.grace_cap_s", 0.0)
  ema_decay = _check_float(config, "sync.ema_decay", 0.0, 1.0, high_open=True)
  fragmentation = _check_choice(config, "sync.fragmentation", fragments_lib.METHODS)
  heartbeat_timeout_s = _get(config, "sync.heartbeat_timeout_s")
  if (isinstance(heartbeat_timeout_s, bool) or not isinstance(heartbeat_timeout_s, (int, float))
      or not heartbeat_timeout_s >= 0):  # NaN fails too
    _fail("sync.heartbeat_timeout_s", heartbeat_timeout_s,
          f"must be a number of seconds >= 0 (0 = auto: {heartbeat.AUTO_MULTIPLE:g} x the "
          f"learner's step-time EMA, at least {heartbeat.AUTO_FLOOR_S:g} s)")
  elastic_lock_step = _check_bool(config, "sync.elastic_lock_step")
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
  return SyncSettings(num_fragments=num_fragments, period=period, overlap=overlap, quorum=quorum,
                      lock_step=lock_step, grace_gamma=grace_gamma, grace_cap_s=grace_cap_s,
                      ema_decay=ema_decay, fragmentation=fragmentation,
                      heartbeat_timeout_s=float(heartbeat_timeout_s),
                      elastic_lock_step=elastic_lock_step)


def _resolve_chaos(config, mode: str, num_learners: int, num_steps: int) -> ChaosSettings:
  schedule = _get(config, "chaos.schedule")
  faults = chaos.parse_schedule(schedule, num_learners)
  chaos.check_within_run(faults, num_steps)
  random_crashes = chaos.RandomCrashes(
      mtbf_s=_check_float(config, "chaos.mtbf_s", 0.0),
      repair_s=_check_float(config, "chaos.repair_s", 0.0),
      repair_shape=_check_float(config, "chaos.repair_shape", 0.0, low_open=True),
      seed=_check_int(config, "chaos.seed", 0),
      node_loss_fraction=_check_float(config, "chaos.node_loss_fraction", 0.0))
  configured_mtbf_s = random_crashes.mtbf_s
  syncer_crashes = [f for f in faults if f.kind == "syncer_crash"]
  if syncer_crashes and mode != "decoupled":
    why = ("dp mode has no syncer" if mode == "dp" else
           "restarting the syncer of a lock-step mode is not built yet")
    _fail("chaos.schedule", schedule, f"event {syncer_crashes[0].source!r}: syncer_crash faults "
                                      f"need config.mode='decoupled' ({why}; mode={mode!r})")
  partitions = [f for f in faults if f.kind == "partition"]
  if partitions and mode != "decoupled":
    _fail("chaos.schedule", schedule, f"event {partitions[0].source!r}: partition faults cut the "
                                      f"link between a learner and the decoupled syncer: they "
                                      f"need config.mode='decoupled' (mode={mode!r})")
  if mode == "dp":
    # dp trains one learner on the devices of all num_learners: a fault on any of them hits that
    # one job, and M learners' devices fail M times as often as one learner's (M independent
    # Poisson processes add up to one of M times the rate). Same schedule, dp's answer.
    faults = tuple(dataclasses.replace(f, learner=0) for f in faults)
    random_crashes = dataclasses.replace(random_crashes,
                                         mtbf_s=random_crashes.mtbf_s / num_learners)
  return ChaosSettings(schedule, configured_mtbf_s, random_crashes.repair_s,
                       random_crashes.repair_shape, random_crashes.seed,
                       random_crashes.node_loss_fraction, faults, random_crashes)


RESTORE_CHOICES = ("auto", "latest", "none")


def _local_dir(field: str, path: str) -> None:
  """Fails unless the local directory `path` exists or can be created (remote paths pass)."""
  if "://" in path:
    return  # a remote path (gs://bucket/...): nothing here can probe it
  # The run creates it after set-up; find out now whether it can. The deepest existing part of the
  # path must be a directory that takes a new entry: os.access is not enough (root may "write" to
  # /proc, which refuses every mkdir), so a probe directory is made there and removed.
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    _fail(field, path, f"{existing} is a file, not a directory")
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".workdir_probe_", dir=existing))
  except OSError as err:
    _fail(field, path, f"cannot create a directory in {existing} ({err.strerror})")


def _resolve_checkpoint(config, workdir: str) -> tuple[CheckpointSettings, str]:
  every_steps = _check_int(config, "checkpoint.every_steps", 0)
  keep = _check_int(config, "checkpoint.keep", 1)
  syncer_every_s = _check_float(config, "checkpoint.syncer_every_s", 0.0)
  directory = _get(config, "checkpoint.dir")
  if not isinstance(directory, str):
    _fail("checkpoint.dir", directory, "must be a path string ('' = workdir/checkpoints)")
  directory = directory or os.path.join(workdir, "checkpoints")
  _local_dir("checkpoint.dir", directory)
  restore = _get(config, "restore")
  if not isinstance(restore, str) or not restore:
    _fail("restore", restore, f"must be one of {', '.join(RESTORE_CHOICES)} or a checkpoint path")
  if restore not in RESTORE_CHOICES and "://" not in restore and not os.path.isdir(restore):
    _fail("restore", restore, f"no such checkpoint directory; use one of "
                              f"{', '.join(RESTORE_CHOICES)} or the path of a checkpoint")
  return CheckpointSettings(every_steps, directory, keep, syncer_every_s), restore


def _resolve_data_source(config) -> tuple[str, str, tokenizers.Tokenizer, int | None]:
  """(source, tokenizer spec, tokenizer, window length of ArrayRecord shards or None).

  Reads a tokenizer file and a dataset's meta.json, both small, so a run with the wrong one fails
  before anything compiles.
  """
  source = _get(config, "data.source")
  if not isinstance(source, str):
    _fail("data.source", source, "must be a path or glob string ('' = the bundled corpus)")
  source = source or data_lib.default_corpus_path()
  text_field = _get(config, "data.text_field")
  if not isinstance(text_field, str) or not text_field:
    _fail("data.text_field", text_field, "must be the name of the text field of a .jsonl line or "
                                         ".parquet column")
  spec = _get(config, "data.tokenizer")
  if not isinstance(spec, str):
    _fail("data.tokenizer", spec, "must be 'byte', a tokenizer file path, or '' (the data's own)")
  dataset_seq_len = None
  if array_records.is_dataset_dir(source):
    meta = array_records.read_meta(source)
    own = array_records.tokenizer_spec(source, meta)
    if spec and _load_tokenizer(spec).fingerprint != meta["tokenizer_fingerprint"]:
      _fail("data.tokenizer", spec, f"is not the tokenizer the ArrayRecord shards of "
                                    f"config.data.source={source!r} were made with ({own}, "
                                    f"meta.json); leave it '' to use that one")
    spec = spec or own
    dataset_seq_len = int(meta["seq_len"])
  else:
    if not documents.is_glob(source) and not os.path.exists(source):
      _fail("data.source", source, "no such file, directory or glob")
    files = documents.text_files(source)
    if len(files) == 1 and os.path.getsize(files[0]) == 0:
      _fail("data.source", source, "the file is empty")
    documents.check_text(source, files)  # /bin/ls would train, on ELF bytes
    spec = spec or "byte"
  return source, spec, _load_tokenizer(spec), dataset_seq_len


def _load_tokenizer(spec: str) -> tokenizers.Tokenizer:
  return tokenizers.load(spec)  # a bad spec is an InputError, a ValueError as every bad field is


def _profile_steps(config, num_steps: int) -> tuple[int, int] | None:
  steps = _get(config, "profile_steps")
  if isinstance(steps, (list, tuple)) and not steps:
    return None
  if (not isinstance(steps, (list, tuple)) or len(steps) != 2 or
      any(isinstance(s, bool) or not isinstance(s, int) for s in steps) or
      not 0 <= steps[0] <= steps[1] < num_steps):
    _fail("profile_steps", steps, f"must be () (no trace) or (first, last) with 0 <= first <= "
                                  f"last < config.num_steps={num_steps}")
  return int(steps[0]), int(steps[1])


def _compilation_cache_dir(config, workdir: str) -> str | None:
  directory = _get(config, "compilation_cache_dir")
  if not isinstance(directory, str):
    _fail("compilation_cache_dir", directory,
          "must be a path string ('' = workdir/jax_cache, 'none' = no persistent cache)")
  if directory == "none":
    return None
  directory = directory or os.path.join(workdir, "jax_cache")
  _local_dir("compilation_cache_dir", directory)
  return directory


def _resolve_runtime(config, mode: str, chaos_settings: ChaosSettings,
                     late_learners: tuple[int, ...], mesh_shapes: tuple[tuple[int, ...], ...],
                     devices: DevicesSettings) -> tuple[str, RaySettings]:
  runtime = _check_choice(config, "runtime", RUNTIMES)
  sharing = devices.learners_sharing_devices
  tpu_slice = _tpu_slice(config, runtime, mesh_shapes, devices)
  processes = _check_int(config, "ray.processes_per_learner", 1)
  if tpu_slice is not None:
    if processes not in (1, tpu_slice.hosts):
      _fail("ray.processes_per_learner", processes,
            f"must be {tpu_slice.hosts} (or 1, the default, which is read as {tpu_slice.hosts}): "
            f"config.ray.tpu_slice={_get(config, 'ray.tpu_slice')!r} is a {tpu_slice.pod_type} "
            f"of {tpu_slice.hosts} hosts, and a learner runs one process per host of its slice")
    processes = tpu_slice.hosts
  if processes > 1:
    if sharing > 1:
      _fail("ray.processes_per_learner", processes,
            f"must be 1 with config.devices.learners_sharing_devices={sharing}: a learner over "
            "several hosts is one jax.distributed job and holds its devices alone")
    if runtime != "ray":
      _fail("ray.processes_per_learner", processes, "must be 1 unless config.runtime='ray' (a "
            "learner thread cannot span processes)")
    for m, shape in enumerate(mesh_shapes):
      if math.prod(shape) % processes:
        _fail("ray.processes_per_learner", processes,
              f"must divide every learner's device count: config.learner_mesh_shapes[{m}]="
              f"{shape} has {math.prod(shape)} devices")
  address = _get(config, "ray.address")
  if not isinstance(address, str):
    _fail("ray.address", address, "must be a string: '' (a local Ray started by the command), "
          "'auto' or a cluster address")
  resources = {field: _ray_resource(config, field, runtime)
               for field in ("ray.learner_resource", "ray.syncer_resource")}
  if tpu_slice is not None and resources["ray.learner_resource"]:
    _fail("ray.learner_resource", resources["ray.learner_resource"],
          f"must be '' with config.ray.tpu_slice={_get(config, 'ray.tpu_slice')!r}: the slice "
          "places the learner processes, on its hosts")
  node_losses = [f for f in chaos_settings.faults if f.kind == chaos.NODE_LOSS]
  if (node_losses or chaos_settings.node_loss_fraction) and (runtime != "ray" or not address):
    field, value = (("chaos.schedule", chaos_settings.schedule) if node_losses else
                    ("chaos.node_loss_fraction", chaos_settings.node_loss_fraction))
    _fail(field, value, "node losses need config.runtime='ray' on a cluster of several Ray nodes "
          "(config.ray.address='auto' or an address): a local Ray is one node, the command's own")
  if runtime == "ray":
    # What the Ray runtime runs so far (docs/ray.md): the rest fails here, named.
    if mode != "decoupled":
      _fail("runtime", runtime, f"runs mode='decoupled' only so far, not config.mode={mode!r}")
    other = sorted({f.kind for f in chaos_settings.faults} - set(RAY_FAULTS))
    if other:
      _fail("chaos.schedule", chaos_settings.schedule,
            f"config.runtime='ray' fires {', '.join(RAY_FAULTS)} faults only so far, not "
            f"{', '.join(other)} (use runtime='threads')")
    if late_learners:
      _fail("runtime", runtime, "does not hold late learners back yet (config.late_learners)")
  return runtime, RaySettings(address=address, processes_per_learner=processes,
                              learner_resource=resources["ray.learner_resource"],
                              syncer_resource=resources["ray.syncer_resource"],
                              tpu_slice=_get(config, "ray.tpu_slice"), slice=tpu_slice)


# Ray spells v5e "v5litepod" (its pod types too: v5litepod-16); the rest as the TPU docs do.
_RAY_TPU_GENERATION = {"v5e": "v5litepod"}


def _tpu_slice(config, runtime: str, mesh_shapes: tuple[tuple[int, ...], ...],
               devices: DevicesSettings) -> TpuSlice | None:
  """config.ray.tpu_slice, sized by Ray's own TPU tables (the ones its slice placement groups
  use), and checked against what each learner must then be: the whole slice, on its own."""
  field, name = "ray.tpu_slice", _get(config, "ray.tpu_slice")
  if name == "":
    return None
  match = re.fullmatch(r"(v\d+[a-z]*):(\d+x\d+(?:x\d+)?)", name) if isinstance(
      name, str) else None
  if match is None:
    _fail(field, name, "must be '' (off) or a TPU generation and topology like 'v5p:2x2x2' (a "
          "v5p-16: 8 chips on 2 hosts) or 'v6e:4x4', as config.devices.tpu_topologies names them "
          "(a pod type alone does not say the topology Ray's slice placement needs)")
  address = _get(config, "ray.address")
  if runtime != "ray" or not address:
    _fail(field, name, "needs config.runtime='ray' on a cluster of TPU VMs (config.ray.address="
          "'auto' or an address): a learner is one slice of several hosts")
  from ray._private.accelerators import tpu as ray_tpu_tables  # pylint: disable=g-import-not-at-top
  from ray.util import tpu as ray_tpu  # pylint: disable=g-import-not-at-top
  generation = _RAY_TPU_GENERATION.get(match[1], match[1])
  topology = match[2]
  if not ray_tpu_tables.TPUAcceleratorManager.is_valid_tpu_accelerator_topology(generation,
                                                                                   topology):
    known = sorted(ray_tpu_tables.VALID_TPU_TOPOLOGY.get(generation, ()),
                   key=lambda t: (math.prod(int(d) for d in t.split("x")), t))
    _fail(field, name, f"is not a TPU slice Ray's slice placement knows: "
          f"{', '.join(known[:6]) + ', ...' if known else 'no such generation'}")
  hosts, per_host = ray_tpu.get_tpu_worker_resources(topology, generation)
  found = TpuSlice(
      generation=generation, topology=topology, hosts=hosts, chips_per_host=int(per_host["TPU"]),
      pod_type=ray_tpu_tables.infer_tpu_pod_type_from_topology(topology, generation))
  for m, shape in enumerate(mesh_shapes):
    if math.prod(shape) != found.chips:
      _fail("learner_mesh_shapes", mesh_shapes,
            f"learner {m}'s mesh {shape} must have {found.chips} devices, the chips of the "
            f"{found.pod_type} each learner is (config.ray.tpu_slice={name!r})")
  if devices.platform not in ("tpu", "cpu"):
    _fail("devices.platform", devices.platform, f"must be 'tpu' with config.ray.tpu_slice="
          f"{name!r} (or 'cpu': each process holds {found.chips_per_host} fake CPU devices, as on "
          "an emulated cluster)")
  if devices.learners_sharing_devices > 1:
    _fail("devices.learners_sharing_devices", devices.learners_sharing_devices,
          f"must be 1 with config.ray.tpu_slice={name!r}: a learner holds its slice alone")
  if any(t != match[0] for t in devices.tpu_topologies):
    _fail("devices.tpu_topologies", devices.tpu_topologies,
          f"must be () or every learner's {match[0]!r}: with config.ray.tpu_slice each learner "
          "is one such slice")
  return found


# Resources Ray itself accounts for: a placement field names a custom one.
_RAY_OWN_RESOURCES = ("CPU", "GPU", "TPU", "memory", "object_store_memory")


def _ray_resource(config, field: str, runtime: str) -> str:
  name = _get(config, field)
  if not isinstance(name, str) or name != name.strip() or name in _RAY_OWN_RESOURCES:
    _fail(field, name, "must be '' or the name of a custom Ray resource that the hosts for this "
          f"role advertise (not one of {', '.join(_RAY_OWN_RESOURCES)})")
  if name and runtime != "ray":
    _fail(field, name, "places Ray actors: it needs config.runtime='ray'")
  return name


def _check_splash_blocks(model_cfg: model_lib.ModelConfig, seq_len: int) -> None:
  """The splash kernel tiles the sequence in whole blocks of 128 (lm/splash.py)."""
  multiple = splash.BLOCK_MULTIPLE
  if seq_len % multiple:
    _fail("data.seq_len", seq_len, f"must be a multiple of {multiple} with "
          "config.model.attention='splash' (the kernel's blocks are multiples of 128)")
  for name in ("splash_block_q", "splash_block_kv"):
    block = getattr(model_cfg, name)
    if block and seq_len % block:
      _fail(f"model.{name}", block, f"must divide config.data.seq_len={seq_len} (or be 0, the "
            "TPU generation's default)")


def validate(config: ml_collections.ConfigDict) -> RunSettings:
  """Checks every field of `config`; returns the settings tree or raises ValueError."""
  _check_fields(config)
  mode = _check_choice(config, "mode", MODES)
  seed = _check_int(config, "seed", 0)
  workdir = _workdir(config)
  num_steps = _check_int(config, "num_steps", 1)
  stall_timeout_s = _check_float(config, "stall_timeout_s", 0.0, low_open=True)
  log_every = _check_int(config, "log_every", 1)
  eval_every = _check_int(config, "eval_every", 0)
  eval_batches = _check_int(config, "eval_batches", 1)
  num_learners = _check_int(config, "num_learners", 1)
  mesh_shapes = _mesh_shapes(config, num_learners)
  devices = DevicesSettings(
      platform=_check_choice(config, "devices.platform", PLATFORMS),
      num_fake_cpu_devices=_check_int(config, "devices.num_fake_cpu_devices", 0),
      learners_sharing_devices=_learners_sharing_devices(config, num_learners, mesh_shapes),
      memory_per_device_gb=_check_float(config, "devices.memory_per_device_gb", 0.0),
      tpu_topologies=_tpu_topologies(config, num_learners, mesh_shapes),
      fake_slice_size=_fake_slice_size(config),
      slice_poll_s=_check_float(config, "devices.slice_poll_s", 0.0, low_open=True))
  delays = _step_delays(config, num_learners)
  step_noise = _check_float(config, "learner_step_noise_s", 0.0)
  syncer = SyncerSettings(num_devices=_check_int(config, "syncer.num_devices", 1),
                          num_workers=_check_int(config, "syncer.num_workers", 1),
                          merge_delay_steps=_merge_delay_steps(config, mode),
                          num_shards=_check_int(config, "syncer.num_shards", 1),
                          merge_threads=_check_int(config, "syncer.merge_threads", 1),
                          heap_trim_every_s=_check_float(config, "syncer.heap_trim_every_s",
                                                         0.0))

  sync = _resolve_sync(config, mode, num_learners)
  chaos_settings = _resolve_chaos(config, mode, num_learners, num_steps)
  _check_num_shards(syncer.num_shards, mode, sync, chaos_settings)
  max_restarts = _check_int(config, "max_restarts", 0)
  late_learners = _late_learners(config, mode, num_learners, chaos_settings.faults)
  checkpoint, restore = _resolve_checkpoint(config, workdir)
  profile_steps = _profile_steps(config, num_steps)
  compilation_cache_dir = _compilation_cache_dir(config, workdir)
  donate_state = _check_choice(config, "donate_state", DONATE_STATE)
  runtime, ray_settings = _resolve_runtime(config, mode, chaos_settings, late_learners,
                                           mesh_shapes, devices)
  tape = _check_bool(config, "tape")
  replay = _replay(config, workdir, mode, runtime, chaos_settings, late_learners)
  if replay and syncer.num_shards > 1:
    # The tape holds each fragment's merges in order, whichever shard made them, and a replay
    # runs them on one global model: the same values, bit for bit.
    logging.info("config.syncer.num_shards=%d: a replay merges on one syncer",
                 syncer.num_shards)
    syncer = dataclasses.replace(syncer, num_shards=1)
  if checkpoint.every_steps == 0 and any(f.kind == "corrupt_checkpoint"
                                         for f in chaos_settings.faults):
    _fail("chaos.schedule", chaos_settings.schedule, "corrupt_checkpoint damages the newest "
          "checkpoint, but config.checkpoint.every_steps=0 writes none")
  merge_settings = MergeSettings(
      rule=_check_choice(config, "merge.rule", merge.MERGE_RULES),
      weighting=_check_choice(config, "merge.weighting", merge.WEIGHTINGS),
      anchor=_check_choice(config, "merge.anchor", ANCHORS),
      alpha=_check_float(config, "merge.alpha", 0.0, 1.0, high_open=True),
      keep_in_flight_progress=_check_bool(config, "merge.keep_in_flight_progress"),
      max_norm_ratio=_check_float(config, "merge.max_norm_ratio", 0.0))
  outer_settings = OuterSettings(
      name=_check_choice(config, "outer.name", outer.OPTIMIZERS),
      learning_rate=_check_float(config, "outer.learning_rate", 0.0, low_open=True),
      momentum=_check_float(config, "outer.momentum", 0.0, 1.0, high_open=True),
      nesterov_delay=_nesterov_delay(config),
      staleness_scaling=_check_choice(config, "outer.staleness_scaling",
                                      merge.STALENESS_SCALINGS))
  compression_settings = CompressionSettings(
      outer_grad=_check_choice(config, "compression.outer_grad", compression.FORMATS),
      broadcast=_check_choice(config, "compression.broadcast", BROADCAST_FORMATS),
      block_size=_check_int(config, "compression.block_size", 1),
      broadcast_delta=_check_choice(config, "compression.broadcast_delta",
                                    BROADCAST_DELTA_FORMATS))
  if compression_settings.broadcast_delta != "none":
    delta = compression_settings.broadcast_delta
    if compression_settings.broadcast != "fp32":
      # A keyframe is the base later deltas add to: a rounded one would leave the learner off
      # R_p for good, where the deltas keep every learner exact.
      _fail("compression.broadcast", compression_settings.broadcast,
            f"must be 'fp32' with config.compression.broadcast_delta={delta!r}: keyframes carry "
            "R_p exactly, the base every later delta adds to")
    if runtime == "ray":
      _fail("compression.broadcast_delta", delta,
            "runs with config.runtime='threads' only so far (use broadcast_delta='none' with "
            "runtime='ray')")
  # The lm's dataclasses check their own fields and name them; the schedule checks the warmup
  # against num_steps.
  inner_cfg = inner.InnerConfig(**_section(config, "inner"))
  warmup_steps = inner.warmup_for_run(inner_cfg.warmup_steps, num_steps)
  if warmup_steps != inner_cfg.warmup_steps:
    logging.info("config.inner.warmup_steps=%d is more than %.0f%% of config.num_steps=%d: "
                 "warming up over %d steps", inner_cfg.warmup_steps,
                 100 * inner.MAX_WARMUP_SHARE, num_steps, warmup_steps)
    inner_cfg = dataclasses.replace(inner_cfg, warmup_steps=warmup_steps)
  inner.make_inner_optimizer(inner_cfg, num_steps)
  data_source, tokenizer_spec, tokenizer, dataset_seq_len = _resolve_data_source(config)
  model_fields = _section(config, "model")
  vocab_size = model_fields["vocab_size"]
  if isinstance(vocab_size, int) and not isinstance(vocab_size, bool):
    if vocab_size == 0:
      model_fields["vocab_size"] = tokenizer.vocab_size  # 0 = the tokenizer's
    elif vocab_size < tokenizer.vocab_size:
      _fail("model.vocab_size", vocab_size,
            f"must be >= the {tokenizer.vocab_size} ids of config.data.tokenizer "
            f"({tokenizer.name}); 0 = the tokenizer's vocabulary size")
  model_cfg = model_lib.ModelConfig(**model_fields)

  if model_cfg.remat == "auto" and (devices.platform != "tpu" or runtime != "threads"):
    _fail("model.remat", "auto", "picks a policy from the TPU compiler's memory figures at "
          "start-up: it needs config.devices.platform='tpu' and config.runtime='threads' "
          f"(not {devices.platform!r}, {runtime!r}); name a policy of "
          f"{list(model_lib.REMAT_POLICIES)}")
  if model_cfg.attention == "cudnn" and devices.platform != "gpu":
    _fail("model.attention", model_cfg.attention,
          "needs config.devices.platform='gpu' (cuDNN flash attention has no CPU or TPU kernel)")
  if model_cfg.attention == "splash" and devices.platform != "tpu":
    _fail("model.attention", model_cfg.attention,
          f"runs on TPU only (config.devices.platform='tpu', not {devices.platform!r}): the Pallas "
          "splash kernel is built for TPU chips; use 'cudnn' on a GPU, 'xla' anywhere")
  if (model_cfg.attention == "cudnn" and devices.learners_sharing_devices > 1 and mode != "dp"
      and os.environ.get(CUDNN_SHARING_TRIAL_ENV) != "1"):
    _fail("model.attention", model_cfg.attention,
          f"cannot run with config.devices.learners_sharing_devices="
          f"{devices.learners_sharing_devices}: learners sharing a GPU that each ran cuDNN "
          "attention killed the process at its first evaluation (an H100, jax 0.11.2, with CUDA "
          "graphs on and off); use 'xla' (dp mode, one job, may use 'cudnn')")

  seq_len = _check_int(config, "data.seq_len", 1)
  batch_size = _check_int(config, "data.batch_size", 1)
  eval_fraction = _check_float(config, "data.eval_fraction", 0.0, 0.5, low_open=True)
  validation_fraction = _check_float(config, "data.validation_fraction", 0.0, 0.5)
  if validation_fraction and dataset_seq_len is not None:
    _fail("data.validation_fraction", validation_fraction,
          f"must be 0 for ArrayRecord shards (config.data.source={data_source!r}): a validation "
          f"split is carved from text sources only")
  if seq_len > model_cfg.max_seq_len:
    _fail("data.seq_len", seq_len, f"must be <= config.model.max_seq_len={model_cfg.max_seq_len}")
  if model_cfg.attention == "splash":
    _check_splash_blocks(model_cfg, seq_len)
  if dataset_seq_len is not None and seq_len != dataset_seq_len:
    _fail("data.seq_len", seq_len, f"must be {dataset_seq_len}, the window length the ArrayRecord "
                                   f"shards of config.data.source={data_source!r} were packed "
                                   f"with (meta.json)")
  learner_batch_size = batch_size
  batch_sizes = _get(config, "data.learner_batch_sizes")
  if not isinstance(batch_sizes, (list, tuple)) or len(batch_sizes) not in (0, num_learners) or any(
      isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
    _fail("data.learner_batch_sizes", batch_sizes,
          f"must be empty or hold num_learners={num_learners} integers >= 1")
  if batch_sizes and mode == "dp":
    _fail("data.learner_batch_sizes", batch_sizes,
          "must be empty in dp mode (one job: its batch is num_learners x data.batch_size)")
  data = DataSettings(source=data_source, tokenizer=tokenizer_spec,
                      text_field=_get(config, "data.text_field"), seq_len=seq_len,
                      batch_size=batch_size, learner_batch_sizes=tuple(batch_sizes),
                      eval_fraction=eval_fraction, validation_fraction=validation_fraction)
  batch_sizes = tuple(batch_sizes) or (batch_size,) * num_learners
  if mode == "dp":
    # One synchronous learner over every learner device, consuming what all M learners would.
    # The first learner's fsdp and model axes; data takes the rest.
    *_, model_axis = mesh_shapes[0]
    fsdp_axis = mesh_shapes[0][1] if len(mesh_shapes[0]) == 3 else 1
    # Learners that share devices count them once: the job spans the distinct devices.
    total = sum(math.prod(shape) for shape in mesh_shapes) // devices.learners_sharing_devices
    data_axis = total // (fsdp_axis * model_axis)
    mesh_shapes = (((data_axis, fsdp_axis, model_axis) if len(mesh_shapes[0]) == 3
                    else (data_axis, model_axis)),)
    learner_batch_size *= num_learners
    batch_sizes = (learner_batch_size,)
    # A synchronous job steps at the pace of its slowest host: the slowest learner's delay.
    delays = (max(delays),)
    num_learners, sync = 1, None
    syncer = dataclasses.replace(syncer, num_devices=0, merge_delay_steps=0)
    devices = dataclasses.replace(devices, learners_sharing_devices=1,
                                  tpu_topologies=())

  for index, shape in enumerate(mesh_shapes):
    # The batch is split over data x fsdp (model.py's "batch" rule).
    batch_shards = math.prod(shape[:-1])
    if batch_sizes[index] % batch_shards:
      field = "data.learner_batch_sizes" if data.learner_batch_sizes else "data.batch_size"
      _fail(field, _get(config, field),
            f"the batch of learner {index} ({batch_sizes[index]} sequences) must divide evenly "
            f"over its data x fsdp axes of {batch_shards} devices (config.learner_mesh_shapes)")
    if len(shape) == 3 and model_cfg.embed_dim % shape[1]:
      _fail("model.embed_dim", model_cfg.embed_dim,
            f"must be divisible by the fsdp axis of learner {index} ({shape[1]}; "
            "config.learner_mesh_shapes): fsdp splits every weight along it")

  if sync is not None:
    # Partitioning needs only shapes: a P above the model's tensor count fails here, not later.
    fragments_lib.partition(model_lib.param_shapes(model_cfg), sync.num_fragments,
                            sync.fragmentation, embedding_names=(model_lib.EMBEDDING_NAME,))

  return RunSettings(
      mode=mode, seed=seed, workdir=workdir, num_steps=num_steps, log_every=log_every,
      eval_every=eval_every, eval_batches=eval_batches, stall_timeout_s=stall_timeout_s,
      max_restarts=max_restarts, devices=devices, runtime=runtime, ray=ray_settings,
      num_learners=num_learners, learner_mesh_shapes=mesh_shapes,
      learner_step_delays_s=delays, learner_step_noise_s=step_noise, late_learners=late_learners, syncer=syncer, sync=sync, merge=merge_settings,
      outer=outer_settings, compression=compression_settings, inner=inner_cfg, model=model_cfg,
      data=data, chaos=chaos_settings, checkpoint=checkpoint, restore=restore,
      profile_steps=profile_steps, compilation_cache_dir=compilation_cache_dir,
      donate_state=donate_state, tape=tape, replay=replay,
      learner_batch_size=learner_batch_size, learner_batch_sizes=batch_sizes,
      donates_state=(donate_state == "always"
                     or (donate_state == "auto" and devices.platform != "cpu")))
