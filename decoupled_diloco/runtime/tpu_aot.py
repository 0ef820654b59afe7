"""Every program a learner runs, compiled for its real TPU topology on any host, and what it costs.

With libtpu installed (the `tpu` extra), `jax.experimental.topologies` gives the compile-only
devices of a named TPU topology ("v5p:4x4x4") on a host without a TPU, and the TPU compiler
compiles for them. Each distinct learner of an experiment (its topology, mesh shape and batch) gets
its mesh on those devices, and the runtime's own recipe compiles, from abstract shapes (nothing is
placed on a device, so an 8B model compiles on a laptop), with the run's shardings and donation:

- the train step (runtime/assembly.py `compile_train_step`, the program and check a TPU run starts
  with),
- the eval step (lm/evaluate.py; on learner 0's mesh, where the runtime evaluates),
- the publication copy of the parameters (lm/inner.py `copy_tree`, runtime/core/learner.py),
- the apply of a broadcast: the write of one layer of a stacked tensor (lm/model.py `ParamLayout`),
  one program per tensor kind, and the rebase or mix when the merge settings ask for them,
- the sampling step (lm/sampling.py), with the parameters sharded as the learner shards them.

For each: HBM per chip against the chip's (runtime/hardware/memory_fit.py), matmul FLOPs and HBM bytes
counted from the compiled HLO with loops at their trip counts, the FLOPs and bytes of the kernels
XLA does not see into (the splash attention kernels; runtime/hardware/kernels.py) and the custom
calls nothing counts, and the collectives with their bytes and mesh axes
(runtime/hardware/hlo_analysis.py). The train step gets a roofline (runtime/core/throughput.py's
chip figures) and the analytic FLOPs of lm/flops.py beside the compiler's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import receive
from decoupled_diloco.lm import evaluate
from decoupled_diloco.lm import flops as flops_lib
from decoupled_diloco.lm import inner
from decoupled_diloco.lm import model as model_lib
from decoupled_diloco.lm import sampling
from decoupled_diloco.runtime import assembly
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.core import slices as slices_lib
from decoupled_diloco.runtime.core import throughput
from decoupled_diloco.runtime.hardware import hlo_analysis
from decoupled_diloco.runtime.hardware import memory_fit

# The sampling step as scripts/sample.py runs it by default (top_k is compiled in).
_SAMPLE_TOP_K = 40


def topology_devices(name: str, num_slices: int = 1) -> tuple[jax.Device, ...]:
  """The compile-only devices of TPU topology `name` ("v5p:4x4x4", "v6e:8x8", "v5e:1x1"); with
  `num_slices` > 1 those of that many such slices, each device carrying its `slice_index`, as one
  controller sees a multi-slice pod."""
  return _topology_devices(name, num_slices)


@functools.cache
def _topology_devices(name: str, num_slices: int) -> tuple[jax.Device, ...]:
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # libtpu reads these once, when it starts; on a host that is not a TPU VM it has no metadata
  # server to learn them from and prints warnings instead. The topology name is what counts.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  # libtpu takes /tmp/libtpu_lockfile so that one process owns a host's chips; compiling for
  # chips owns none, and two compiles at once (a test suite beside scripts/aot_compile.py) must
  # not abort each other.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  slices = {"num_slices": num_slices} if num_slices > 1 else {}
  try:
    return tuple(topologies.get_topology_desc(topology_name=name, platform="tpu",
                                              **slices).devices)
  except jax.errors.JaxRuntimeError as err:
    if "chips_per_host_bounds" not in str(err):
      raise
  # Fewer chips than one host of the default shape holds (a single chip): one host holds them.
  dims = [int(d) for d in name.split(":")[1].split("x")]
  bounds = tuple(dims + [1] * (3 - len(dims)))
  return tuple(topologies.get_topology_desc(topology_name=name, platform="tpu",
                                            chips_per_host_bounds=bounds, **slices).devices)


@dataclasses.dataclass(frozen=True)
class LearnerTarget:
  """One distinct learner: the learners of the experiment that run the same programs."""

  learners: tuple[int, ...]
  topology: str
  mesh: jax.sharding.Mesh
  # On a multi-slice pod (`multislice_targets`): the slice it was placed on, and its mesh there
  # (`mesh` is what it is compiled on: the same chips of slice 0, see there).
  slice: slices_lib.Slice | None = None
  placed: jax.sharding.Mesh | None = None

  @property
  def index(self) -> int:
    return self.learners[0]

  @property
  def device_kind(self) -> str:
    return self.mesh.devices.flat[0].device_kind


def _topology_names(settings: settings_lib.RunSettings, topology: str | None) -> list[str]:
  names = []
  for index in range(settings.num_learners):
    name = topology or (settings.devices.tpu_topologies[index]
                        if settings.devices.tpu_topologies else "")
    if not name:
      raise ValueError(f"learner {index} names no TPU topology: give --topology or set "
                       f"config.devices.tpu_topologies")
    names.append(name)
  return names


def learner_targets(settings: settings_lib.RunSettings, topology: str | None = None,
                    num_slices: int = 0) -> list[LearnerTarget]:
  """Each distinct learner's mesh on its topology: `topology` for all, else the learner's
  config.devices.tpu_topologies entry. A mesh smaller than its topology takes its first chips.
  `num_slices` > 0: every learner on its own slice of a multi-slice pod (`multislice_targets`)."""
  if num_slices:
    return multislice_targets(settings, topology, num_slices)
  meshes, names = [], []
  for index, (shape, name) in enumerate(zip(settings.learner_mesh_shapes,
                                            _topology_names(settings, topology))):
    devices = topology_devices(name)
    needed = math.prod(shape)
    if needed > len(devices):
      raise ValueError(f"config.learner_mesh_shapes[{index}]={shape} needs {needed} chips but "
                       f"topology {name} has {len(devices)}")
    meshes.append(devices_lib.learner_mesh(devices[:needed], shape))
    names.append(name)
  return [LearnerTarget(tuple(group), names[group[0]], meshes[group[0]])
          for group in assembly.distinct_learners(settings, meshes)]


def multislice_targets(settings: settings_lib.RunSettings, topology: str | None,
                       num_slices: int) -> list[LearnerTarget]:
  """Every learner (every group sharing devices) on the slice the run's own carving gives it
  (runtime/core/slices.py) in a pod of `num_slices` slices of each topology the learners name,
  as one controller sees such a pod: its devices, shuffled as a controller may list them, each
  carrying its slice_index. A layout the pod cannot hold is refused as a run refuses it.

  A learner placed on slice k > 0 is compiled on the chips of slice 0 at the same coordinates:
  the same program on an identical slice. The compile-only pod's compiler refuses any program
  whose devices leave out slice 0 ("INVALID_ARGUMENT: Slice is empty.", libtpu with jax 0.10.2;
  slices 1 and 2 together abort it), which a runtime that runs programs on single slices, as
  Pathways does, never asks of it."""
  names = _topology_names(settings, topology)
  pod = [d for name in dict.fromkeys(names) for d in topology_devices(name, num_slices)]
  random.Random(0).shuffle(pod)
  shapes = settings.learner_mesh_shapes
  placements = slices_lib.place(
      slices_lib.group_slices(pod), [math.prod(shape) for shape in shapes],
      generations=[name.split(":")[0] for name in names],
      sharing=settings.devices.learners_sharing_devices,
      what=[f"config.learner_mesh_shapes[{m}]={shape}" for m, shape in enumerate(shapes)])
  sharing = settings.devices.learners_sharing_devices
  targets = []
  for m in range(0, settings.num_learners, sharing):
    placed = devices_lib.placed_mesh(placements[m], shapes[m])
    targets.append(LearnerTarget(tuple(range(m, m + sharing)), names[m],
                                 _on_first_slice(placed, pod), placements[m].slice, placed))
  return targets


def _on_first_slice(mesh: jax.sharding.Mesh, pod) -> jax.sharding.Mesh:
  """`mesh` with each device replaced by slice 0's chip of its kind at the same position; as it
  is where the mesh lies in slice 0 already, or spans several slices (then no chip is moved)."""
  grid = mesh.devices
  keys = {slices_lib.slice_key(d) for d in grid.flat}
  if len(keys) > 1 or next(iter(keys))[1] == 0:
    return mesh
  kind = grid.flat[0].device_kind
  first = {(tuple(d.coords), getattr(d, "core_on_chip", 0)): d for d in pod
           if slices_lib.slice_key(d) == ("slice", 0, kind)}
  moved = np.vectorize(lambda d: first[(tuple(d.coords), getattr(d, "core_on_chip", 0))],
                       otypes=[object])(grid)
  return jax.sharding.Mesh(moved, mesh.axis_names)


@dataclasses.dataclass
class ProgramReport:
  """One compiled program of a learner."""

  program: str
  fit: memory_fit.Fit
  alongside: str  # what `fit.alongside_bytes` is
  compile_s: float
  hlo: hlo_analysis.HloStats | None = None  # None when the compiler refused the program
  cost_analysis: dict[str, float] = dataclasses.field(default_factory=dict)  # XLA's, loops once
  analytic_flops: float | None = None  # per chip, lm/flops.py (train and eval steps)
  count: int = 1  # programs of this kind (the apply: one per stacked tensor kind)
  error: str = ""  # the compiler's error when it failed other than for lack of HBM
  # Collectives (of hlo.collectives: kind x mesh axes) whose groups join devices of two slices:
  # on a multi-slice pod they would cross the datacenter network. 0 is what a learner must have.
  collectives_across_slices: int = 0
  # The compiler's own sign of the same: transfers it lowered to the datacenter network between
  # slices (`_xla_megascale_transfer_type` in the compiled program).
  megascale_transfers: int = 0


@dataclasses.dataclass
class Roofline:
  """The train step's time if it ran at its chip's peak on its slowest resource."""

  compute_s: float  # compiled matmul and kernel FLOPs / peak FLOP/s
  hbm_s: float  # HBM bytes / HBM bandwidth
  ici_s: float | None  # collective bytes sent / ICI bandwidth (None: no ICI figure)
  tokens_per_step: int
  model_flops_per_chip: float
  kernel_compute_s: float = 0.0  # the part of compute_s that is recognised kernels'
  kernel_hbm_s: float = 0.0  # the part of hbm_s that is theirs
  # lm/flops.py's causal_model_flops_per_token: the masked half of attention not counted.
  causal_model_flops_per_chip: float = 0.0

  @property
  def step_s(self) -> float:
    return max(self.compute_s, self.hbm_s, self.ici_s or 0.0)

  @property
  def bound(self) -> str:
    times = {"compute": self.compute_s, "HBM": self.hbm_s, "ICI": self.ici_s or 0.0}
    return max(times, key=times.get)

  def mfu_ceiling(self, peak: float) -> float:
    return self.model_flops_per_chip / peak / self.step_s

  def causal_mfu_ceiling(self, peak: float) -> float:
    """The same with causal attention's masked half not counted as model FLOPs (MaxText's MFU)."""
    return self.causal_model_flops_per_chip / peak / self.step_s

  @property
  def tokens_per_s(self) -> float:
    return self.tokens_per_step / self.step_s


@dataclasses.dataclass
class LearnerReport:
  target: LearnerTarget
  chip: throughput.TpuChip
  batch_size: int
  seq_len: int
  programs: list[ProgramReport]
  roofline: Roofline | None

  @property
  def chips(self) -> int:
    return self.target.mesh.devices.size

  @property
  def train_step(self) -> ProgramReport:
    return self.programs[0]

  @property
  def worst(self) -> ProgramReport:
    """The program that needs the largest share of HBM while the learner trains (sampling runs
    after training, on its own)."""
    return max((p for p in self.programs if p.program != "sampling_step"),
               key=lambda p: p.fit.share)


def _measure(program: str, lowered: Any, *, alongside_bytes: int, alongside: str,
             usable: int, mesh: jax.sharding.Mesh, analytic_flops: float | None = None,
             count: int = 1) -> ProgramReport:
  started = time.perf_counter()
  try:
    compiled, fit = memory_fit.compile_and_measure(lowered, alongside_bytes=alongside_bytes,
                                                   usable_bytes=usable)
  except jax.errors.JaxRuntimeError as err:
    return _failed(program, err, alongside_bytes, alongside, usable, started, analytic_flops)
  return _report(program, compiled, fit, alongside, time.perf_counter() - started, mesh,
                 analytic_flops, count)


def _failed(program, err, alongside_bytes, alongside, usable, started, analytic_flops=None
            ) -> ProgramReport:
  """A program the compiler could not compile, for another reason than HBM: the learner could
  not run it either."""
  return ProgramReport(program, memory_fit.Fit(None, alongside_bytes, usable), alongside,
                       time.perf_counter() - started, analytic_flops=analytic_flops,
                       error=str(err).strip())


def _report(program, compiled, fit, alongside, seconds, mesh, analytic_flops=None, count=1
            ) -> ProgramReport:
  report = ProgramReport(program, fit, alongside, seconds, analytic_flops=analytic_flops,
                         count=count)
  if compiled is not None:
    text = compiled.as_text()
    report.hlo = hlo_analysis.analyse(text, mesh.axis_names, tuple(mesh.devices.shape))
    report.megascale_transfers = text.count("_xla_megascale_transfer_type=")
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report.cost_analysis = {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}
  return report


def compile_learner(settings: settings_lib.RunSettings, target: LearnerTarget, *,
                    with_eval: bool = True, with_sampling: bool = True) -> LearnerReport:
  """Compiles every program of `target` (see the module docstring) and measures each; the eval
  and sampling steps only `with_eval` / `with_sampling` (a run evaluates and samples on learner
  0's mesh)."""
  mesh, index = target.mesh, target.index
  cfg, seq_len = settings.model, settings.data.seq_len
  chip = throughput.tpu_chip(target.device_kind)
  usable = chip.hbm_usable_bytes
  batch = settings.learner_batch_sizes[index]
  chips = mesh.devices.size
  graphdef = model_lib.graph(cfg)
  shardings = model_lib.param_shardings(cfg, mesh)

  started = time.perf_counter()
  train_flops = flops_lib.train_flops_per_token(cfg, seq_len) * batch * seq_len / chips
  tx = inner.make_inner_optimizer(settings.inner, settings.num_steps)
  like = inner.abstract_train_state(model_lib.native_shapes(cfg), tx, mesh, shardings)
  try:
    compiled, fit, like = assembly.compile_train_step(settings, index, mesh)
    programs = [_report("train_step", compiled, fit, assembly.ALONGSIDE_TRAIN_STEP,
                        time.perf_counter() - started, mesh, train_flops)]
  except jax.errors.JaxRuntimeError as err:
    programs = [_failed("train_step", err, memory_fit.bytes_per_chip(like.params),
                        assembly.ALONGSIDE_TRAIN_STEP, usable, started, train_flops)]
  params_bytes = memory_fit.bytes_per_chip(like.params)
  state_bytes = memory_fit.bytes_per_chip(like)

  if with_eval:  # config.eval_batches held-out batches of data.batch_size, at most
    rows = settings.data.batch_size
    num_batches = settings.eval_batches
    eval_flops = (flops_lib.forward_flops_per_token(cfg, seq_len) * num_batches * rows * seq_len
                  / chips)
    lowered = evaluate.eval_program(graphdef, cfg, mesh, rows).lower(
        *evaluate.eval_args(cfg, num_batches, rows, seq_len))
    programs.append(_measure("eval_step", lowered, alongside_bytes=state_bytes + params_bytes,
                             alongside="the train state and the publication's copy",
                             usable=usable, mesh=mesh, analytic_flops=eval_flops))

  programs.append(_measure(
      "publication_copy", inner.copy_tree.lower(like.params),
      alongside_bytes=state_bytes,
      alongside="the rest of the train state and the previous publication's copy",
      usable=usable, mesh=mesh))

  programs.append(_apply_report(settings, like, shardings, usable, mesh, state_bytes,
                                params_bytes))

  if with_sampling:
    programs.append(_measure(
        "sampling_step", sampling.lower_next_token(cfg, like.params, top_k=_SAMPLE_TOP_K),
        alongside_bytes=0, alongside="nothing (it runs after training)", usable=usable,
        mesh=mesh))

  placed = target.placed if target.placed is not None else mesh
  for program in programs:  # where the learner was placed, not where it was compiled
    if program.hlo is not None:
      program.collectives_across_slices = sum(
          slices_lib.spans_slices(placed.devices, placed.axis_names, c.axes)
          for c in program.hlo.collectives)
  roofline = None
  train_report = programs[0]
  if train_report.hlo is not None:
    hlo = train_report.hlo
    roofline = Roofline(
        compute_s=hlo.flops / chip.peak_flops_per_s,
        hbm_s=hlo.hbm_bytes / chip.hbm_bytes_per_s,
        ici_s=(hlo.ici_bytes_per_chip / chip.ici_bytes_per_s) if chip.ici_bytes_per_s else None,
        tokens_per_step=batch * seq_len,
        model_flops_per_chip=flops_lib.model_flops_per_token(cfg, seq_len) * batch * seq_len
        / chips,
        kernel_compute_s=hlo.kernel_flops / chip.peak_flops_per_s,
        kernel_hbm_s=sum(k.hbm_bytes for k in hlo.kernels) / chip.hbm_bytes_per_s,
        causal_model_flops_per_chip=flops_lib.causal_model_flops_per_token(cfg, seq_len) * batch
        * seq_len / chips)
  return LearnerReport(target, chip, batch, seq_len, programs, roofline)


def _apply_report(settings, like, shardings, usable, mesh, state_bytes, params_bytes
                  ) -> ProgramReport:
  """The apply of a broadcast: per flat tensor the learner places Theta_p on its devices (a
  transfer, no program), rebases or mixes it when the merge settings ask, and writes it into its
  parameters, for a stacked tensor one layer of it (`ParamLayout.set`). One program per tensor
  kind; the report is the one that needs the most HBM, and counts them all."""
  layout = model_lib.param_layout(settings.model)
  flat_shardings = layout.flat_shardings(shardings)
  resident = state_bytes + params_bytes
  lowered = {}  # kind -> (program, bytes of the train state it takes as an argument)
  for name, (native, layer) in layout.where.items():
    if layer is not None and native not in lowered:
      lowered[native] = (layout.lower_set(like.params, name),
                         memory_fit.bytes_per_chip(like.params[native]))
    stored = like.params[native]
    value = jax.ShapeDtypeStruct(stored.shape[1:] if layer is not None else stored.shape,
                                 stored.dtype, sharding=flat_shardings[name])
    for which, program in receive.lower_merge_programs(
        value, keep_in_flight_progress=settings.merge.keep_in_flight_progress,
        alpha=settings.merge.alpha).items():
      lowered.setdefault((which, value.shape, str(value.sharding.spec)), (program, 0))
  alongside = "the train state and the publication's copy"
  if not lowered:  # nothing stacked and overwrite on receive: transfers only
    return ProgramReport("broadcast_apply", memory_fit.Fit(
        memory_fit.ProgramMemory(0, 0, 0, 0, 0), resident, usable), alongside, 0.0, count=0)
  reports = [_measure("broadcast_apply", program, alongside_bytes=resident - taken,
                      alongside=alongside, usable=usable, mesh=mesh)
             for program, taken in lowered.values()]
  worst = max(reports, key=lambda r: r.fit.share)
  worst.count = len(reports)
  worst.compile_s = sum(r.compile_s for r in reports)
  return worst


def resolve_remat(settings: settings_lib.RunSettings, targets: Sequence[LearnerTarget]
                  ) -> tuple[settings_lib.RunSettings, dict[str, list[memory_fit.Fit]]]:
  """config.model.remat='auto' resolved as a TPU run resolves it at start-up, on `targets`."""
  return assembly.resolve_remat(settings, {t.index: t.mesh for t in targets})
