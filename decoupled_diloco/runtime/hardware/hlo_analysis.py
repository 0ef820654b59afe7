"""What a compiled XLA program does, read from its optimised HLO text (`compiled.as_text()`).

XLA's own `cost_analysis()` counts the body of a while loop once, whatever its trip count: a model
whose blocks run under `lax.scan` (config.model.scan_layers) reports the FLOPs and bytes of one
block. This walks the HLO instead and counts every computation as often as it runs
(runtime/hardware/hlo_text.py): a loop body times its trip count, a fused computation once per call.
From it:

- matmul FLOPs: 2 x output elements x contracted size of every dot and convolution (a TPU
  matmul is a convolution in HLO); what lm/flops.py counts analytically, so the two compare.
- kernels: the FLOPs and HBM bytes of each custom-call kernel kernels.py recognises (the splash
  attention kernels), which XLA's count takes for nothing; the custom calls it cannot count are
  listed, with their calls per program.
- HBM bytes: operands and results of every instruction of a non-fused computation (a fusion's
  inside stays on chip), slices and in-place updates at their size, as HloCostAnalysis counts
  "bytes accessed" (within 6% of it on a loop-free chain of matmuls; on the unrolled train step
  of a small model 0.78 of it, XLA counting some buffers twice that this does not); but only the
  arrays that live in HBM: XLA:TPU keeps buffers in VMEM too (memory space S(1) in their layout),
  and its prefetches into VMEM (copy-start, slice-start) read from HBM only what they copy. Counted
  as HBM traffic, those made the v6e learners of hetero_v6e_v5p look HBM-bound at 2.4x their
  bytes (results/aot_hetero_v6e_v5p.md).
- collectives (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute): how many
  run per call, their bytes, the mesh axes their groups span, and the bytes each chip sends over
  ICI for them with ring algorithms: (n-1)/n of the gathered result, of the scattered operand and
  of the all-to-all buffer, twice that for an all-reduce, the whole buffer for a permute.

No JAX here: the text comes in as a string, the mesh as its axis names and sizes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from decoupled_diloco.runtime.hardware import hlo_text
from decoupled_diloco.runtime.hardware import kernels as kernels_lib

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# Instructions that move no data of their own (views, tuples, control).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "iota", "opt-barrier", "copy-done", "all-gather-done",
         "all-reduce-done", "collective-permute-done", "async-done", "send-done", "recv-done",
         "while", "conditional", "call", "slice-done"}
# Asynchronous copies between HBM and VMEM: what moves is the copied part, read from the source
# and written to the destination. Where the destination sits in the result tuple: a copy-start's
# is (destination, source, context), a slice-start's ((source), destination, context).
_ASYNC_COPIES = {"copy-start": 0, "slice-start": 1}


@dataclasses.dataclass(frozen=True)
class Collective:
  """Collectives of one kind over the same mesh axes, per call of the program."""

  kind: str  # one of COLLECTIVES
  axes: tuple[str, ...]  # the mesh axes its groups span
  group_size: int
  count: int  # executions per call
  bytes: float  # of their buffers (gathered result, scattered operand, reduced or sent buffer)
  ici_bytes_per_chip: float  # sent by each chip over ICI, ring algorithms (see the module doc)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """Calls of one recognised kernel per call of the program (kernels.py)."""

  name: str
  count: int
  flops: float  # per chip, all its calls
  hbm_bytes: float  # likewise


@dataclasses.dataclass(frozen=True)
class HloStats:
  matmul_flops: float  # dots and convolutions, per chip per call, loops by their trip counts
  hbm_bytes: float  # per chip per call, likewise, recognised kernels' included
  collectives: tuple[Collective, ...]
  # While loops whose trip count was not found: counted once (their numbers are lower bounds).
  unknown_trip_counts: int
  kernels: tuple[Kernel, ...] = ()
  # Custom calls whose FLOPs are not known (kernels.label, calls per program): their bytes are
  # their operands and results, their FLOPs missing from `flops`.
  uncounted: tuple[tuple[str, int], ...] = ()

  @property
  def kernel_flops(self) -> float:
    return sum(k.flops for k in self.kernels)

  @property
  def flops(self) -> float:
    """Everything counted: the matmuls and the recognised kernels."""
    return self.matmul_flops + self.kernel_flops

  @property
  def ici_bytes_per_chip(self) -> float:
    return sum(c.ici_bytes_per_chip for c in self.collectives)


def _matmul_flops(ins: hlo_text.Instruction, shapes: dict[str, list[hlo_text.Array]]) -> float:
  if ins.opcode not in ("dot", "convolution") or not ins.arrays or len(ins.operands) < 2:
    return 0.0
  out = math.prod(ins.arrays[0].dims)
  if ins.opcode == "dot":
    lhs = shapes.get(ins.operands[0])
    dims = hlo_text.attribute(ins.attributes, "lhs_contracting_dims")
    if not lhs or dims is None:
      return 0.0
    contracted = math.prod(lhs[0].dims[int(d)] for d in dims.strip("{}").split(",") if d)
    return 2.0 * out * contracted
  lhs, kernel = shapes.get(ins.operands[0]), shapes.get(ins.operands[1])
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attributes)
  if not lhs or not kernel or not labels:
    return 0.0
  lhs_labels, kernel_labels, out_labels = labels.groups()
  window = re.search(r"window=\{([^}]*)\}", ins.attributes)
  fields = dict(re.findall(r"(\w+)=([\dx_]+)", window.group(1))) if window else {}
  features = math.prod(size for size, label in zip(kernel[0].dims, kernel_labels)
                       if label == "i")
  out_positions, taps = 1, 1
  for d in sorted(label for label in kernel_labels if label.isdigit()):
    taps *= _valid_taps(
        in_size=lhs[0].dims[lhs_labels.index(d)], out_size=ins.arrays[0].dims[out_labels.index(d)],
        size=kernel[0].dims[kernel_labels.index(d)], dim=int(d), fields=fields)
    out_positions *= ins.arrays[0].dims[out_labels.index(d)]
  # Multiply-adds: per output element its input features times the window taps that land on
  # real input, summed over the output positions.
  return 2.0 * (out // out_positions) * features * taps


def _valid_taps(*, in_size: int, out_size: int, size: int, dim: int, fields: dict[str, str]
                ) -> int:
  """(output position, window tap) pairs of one spatial dimension whose tap lands on an input
  element, not on padding or a hole of the input's dilation. XLA:TPU writes a batched matmul as a
  convolution whose batch is a spatial dimension (window n, input dilated by n: one tap per
  position), and a matmul's weight gradient as a padded one; counting every tap would double
  them."""
  def value(key: str, default: int) -> int:
    parts = fields.get(key, "").split("x")
    return int(parts[dim].split("_")[0]) if len(parts) > dim and parts[dim] else default

  stride, lhs_dilate, rhs_dilate = value("stride", 1), value("lhs_dilate", 1), value("rhs_dilate", 1)
  pads = fields.get("pad", "").split("x")
  low = int(pads[dim].split("_")[0]) if len(pads) > dim and pads[dim] else 0
  extent = (in_size - 1) * lhs_dilate + 1
  positions = np.arange(out_size)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - low
  return int(np.sum((positions >= 0) & (positions < extent) & (positions % lhs_dilate == 0)))


def _mesh_axes(printed: Sequence[tuple[str, str]], mesh_names: Sequence[str],
               mesh_shape: Sequence[int]) -> dict[str, tuple[str, ...]]:
  """The program's printed mesh axes ("axis_0", ...) as ours. The compiler prints our mesh in
  order, with axes of size 1 added or dropped, an axis of ours split in factors or several of
  ours merged into one: blocks of consecutive axes, ours and printed, of the same size."""
  ours = [(name, size) for name, size in zip(mesh_names, mesh_shape) if size > 1]
  printed = [(name, int(size)) for name, size in printed if int(size) > 1]
  rename: dict[str, tuple[str, ...]] = {}
  i = j = 0
  while i < len(ours) and j < len(printed):
    block_ours, block_printed = [ours[i]], [printed[j]]
    i, j = i + 1, j + 1
    while math.prod(s for _, s in block_ours) != math.prod(s for _, s in block_printed):
      if math.prod(s for _, s in block_ours) < math.prod(s for _, s in block_printed):
        if i == len(ours):
          return {}
        block_ours.append(ours[i])
        i += 1
      else:
        if j == len(printed):
          return {}
        block_printed.append(printed[j])
        j += 1
    for name, _ in block_printed:
      rename[name] = tuple(n for n, _ in block_ours)
  return rename if i == len(ours) and j == len(printed) else {}


def _groups(ins: hlo_text.Instruction, mesh_names: Sequence[str], mesh_shape: Sequence[int]
            ) -> tuple[tuple[str, ...], int]:
  """(mesh axes the op's groups span, group size)."""
  attributes = ins.attributes
  named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
  if named:
    printed = re.findall(r"'(\w+)'=(\d+)", named.group(1))
    chosen = re.findall(r"'(\w+)'", named.group(2))
    sizes = {name: int(size) for name, size in printed}
    rename = _mesh_axes(printed, mesh_names, mesh_shape)
    axes = [n for a in chosen if sizes[a] > 1 for n in rename.get(a, (a,))]
    ordered = tuple(n for n in mesh_names if n in axes) + tuple(
        a for a in dict.fromkeys(axes) if a not in mesh_names)
    return ordered, math.prod(sizes[a] for a in chosen)
  if ins.opcode.startswith("collective-permute"):
    pairs = re.findall(r"\{(\d+),(\d+)\}", hlo_text.attribute(attributes, "source_target_pairs") or "")
    groups = [[int(a), int(b)] for a, b in pairs]
  else:
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if iota:
      count, size = int(iota.group(1)), int(iota.group(2))
      dims = [int(d) for d in iota.group(3).split(",")]
      ids = np.arange(math.prod(dims)).reshape(dims)
      if iota.group(4):
        ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
      groups = ids.reshape(count, size).tolist()
    else:
      explicit = hlo_text.attribute(attributes, "replica_groups") or ""
      groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", explicit)]
  groups = [g for g in groups if g]
  if not groups:  # every device in one group
    return tuple(n for n, s in zip(mesh_names, mesh_shape) if s > 1), math.prod(mesh_shape)
  coords = np.array(np.unravel_index(np.asarray(groups[0]), tuple(mesh_shape))).T
  axes = tuple(n for i, n in enumerate(mesh_names) if len(set(coords[:, i])) > 1)
  size = 2 if ins.opcode.startswith("collective-permute") else len(groups[0])
  return axes, size


def _collective(ins: hlo_text.Instruction) -> str | None:
  for kind in COLLECTIVES:
    if ins.opcode in (kind, kind + "-start"):
      return kind
  return None


def _buffer_bytes(kind: str, ins: hlo_text.Instruction) -> float:
  """The buffer a collective is sized by: gathered result, scattered operand (result x n is
  applied by the caller), reduced, exchanged or sent buffer."""
  arrays = [a for a in ins.arrays if a.dims or kind == "all-reduce"]
  if ins.opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
    arrays = arrays[len(arrays) // 2:] if kind == "all-gather" else arrays[:1]
  return sum(a.nbytes for a in arrays)


def _ici_bytes(kind: str, buffer: float, n: int) -> float:
  if n <= 1:
    return 0.0
  share = (n - 1) / n
  return {"all-gather": buffer * share, "reduce-scatter": buffer * share,
          "all-reduce": 2 * buffer * share, "all-to-all": buffer * share,
          "collective-permute": buffer}[kind]


def _users(instructions: list[hlo_text.Instruction], name: str) -> list[tuple[hlo_text.Instruction, int]]:
  """(user, operand position) of `name` in a computation, looking through bitcasts."""
  found = []
  for ins in instructions:
    for position, operand in enumerate(ins.operands):
      if operand != name:
        continue
      if ins.opcode == "bitcast":
        found += _users(instructions, ins.name)
      else:
        found.append((ins, position))
  return found


def _sliced_read(computations: dict[str, list[hlo_text.Instruction]], computation: str, param: int
                 ) -> float | None:
  """Bytes a fused computation reads of its parameter `param` when it reads it only through
  dynamic slices (nested fusions included) or updates it in place; None when it reads it whole."""
  fused = computations.get(computation, [])
  name = next((ins.name for ins in fused if ins.opcode == "parameter"
               and ins.arguments == str(param)), None)
  if name is None:
    return None
  users = _users(fused, name)
  if not users:  # passed out whole (a bitcast root), or dropped: counted whole, as XLA does
    return None
  total = 0.0
  for user, position in users:
    if user.opcode == "dynamic-slice" and position == 0:
      total += sum(a.nbytes for a in user.arrays)
    elif user.opcode == "dynamic-update-slice" and position == 0:
      continue
    elif user.opcode == "fusion":
      callee = hlo_text.attribute(user.attributes, "calls")
      inner = _sliced_read(computations, callee.lstrip("%"), position) if callee else None
      if inner is None:
        return None
      total += inner
    else:
      return None
  return total


def _fusion_bytes(computations: dict[str, list[hlo_text.Instruction]], computation: str
                  ) -> tuple[dict[int, float], list[float | None]]:
  """What a fusion reads of each parameter and writes of each output, where it is less than the
  whole buffer: a parameter read only through dynamic slices is read a slice at a time, one
  updated in place by a dynamic-update-slice is not read, and an output that is such an update
  writes only the update (as HloCostAnalysis counts them). Parameters not in the dict, and
  outputs of None, count whole."""
  fused = computations.get(computation, [])
  shapes = {ins.name: ins.arrays for ins in fused}
  reads: dict[int, float] = {}
  for ins in fused:
    if ins.opcode == "parameter" and re.fullmatch(r"\d+", ins.arguments):
      read = _sliced_read(computations, computation, int(ins.arguments))
      if read is not None:
        reads[int(ins.arguments)] = read
  by_name = {ins.name: ins for ins in fused}
  root = fused[-1] if fused else None
  outputs = root.operands if root is not None and root.opcode == "tuple" else (
      [root.name] if root is not None else [])
  written: list[float | None] = []
  for name in outputs:
    ins = by_name.get(name)
    while ins is not None and ins.opcode == "bitcast" and ins.operands:
      ins = by_name.get(ins.operands[0])
    if ins is not None and ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
      written.append(sum(a.nbytes for a in shapes.get(ins.operands[1], ())))
    else:
      written.append(None)
  return reads, written


def _moved_bytes(ins: hlo_text.Instruction, shapes: dict[str, list[hlo_text.Array]],
                 fusions: dict[str, tuple[dict[int, float], float | None]]) -> float:
  """HBM bytes one top-level instruction reads and writes (arrays in VMEM move none)."""
  sources = [shapes.get(o, ()) for o in ins.operands]
  operands = [sum(a.hbm_nbytes for a in arrays) for arrays in sources]
  result = sum(a.hbm_nbytes for a in ins.arrays)
  in_hbm = [bool(arrays) and arrays[0].memory_space == 0 for arrays in sources]
  if ins.opcode in _ASYNC_COPIES and len(ins.arrays) > 1 and sources:
    destination = ins.arrays[_ASYNC_COPIES[ins.opcode]]
    return (destination.nbytes if in_hbm[0] else 0.0) + destination.hbm_nbytes
  if ins.opcode == "dynamic-slice":
    read = sum(a.nbytes for a in ins.arrays) if in_hbm and in_hbm[0] else 0.0
    return read + result + sum(operands[1:])
  if ins.opcode == "dynamic-update-slice" and len(operands) > 1:
    update = sum(a.nbytes for a in sources[1])
    return operands[1] + (update if in_hbm[0] else 0.0) + sum(operands[2:])
  if ins.opcode == "fusion":
    callee = hlo_text.attribute(ins.attributes, "calls")
    reads, written = fusions.get(callee.lstrip("%") if callee else "", ({}, []))
    operands = [reads.get(i, b) if in_hbm[i] else b for i, b in enumerate(operands)]
    if len(written) == len(ins.arrays):
      result = sum(a.hbm_nbytes if w is None or a.memory_space else w
                   for a, w in zip(ins.arrays, written))
  return result + sum(operands)


def analyse(text: str, mesh_names: Sequence[str], mesh_shape: Sequence[int]) -> HloStats:
  """Matmul FLOPs, HBM bytes and collectives per chip per call of the program in `text`."""
  computations, entry = hlo_text.computations_of(text)
  times, unknown = hlo_text.multiplicities(computations, entry)
  fused = set()
  for instructions in computations.values():
    for ins in instructions:
      if ins.opcode == "fusion":
        callee = hlo_text.attribute(ins.attributes, "calls")
        if callee:
          fused.add(callee.lstrip("%"))
  fusions = {name: _fusion_bytes(computations, name) for name in fused}
  flops = hbm = 0.0
  found: dict[tuple[str, tuple[str, ...], int], list[float]] = {}
  custom_calls = kernels_lib.Tally()
  for name, instructions in computations.items():
    runs = times.get(name, 0.0)
    if not runs:
      continue
    shapes = {ins.name: ins.arrays for ins in instructions}
    for ins in instructions:
      flops += runs * _matmul_flops(ins, shapes)
      moved = custom_calls.add(ins, shapes, runs) if ins.opcode == "custom-call" else None
      if moved is not None:  # a kernel's own bytes, or none
        hbm += moved
        continue
      if name not in fused and ins.opcode not in _FREE:
        hbm += runs * _moved_bytes(ins, shapes, fusions)
      kind = _collective(ins)
      if kind is None:
        continue
      axes, n = _groups(ins, mesh_names, mesh_shape)
      buffer = _buffer_bytes(kind, ins) * (n if kind == "reduce-scatter" else 1)
      entry_ = found.setdefault((kind, axes, n), [0.0, 0.0, 0.0])
      entry_[0] += runs
      entry_[1] += runs * buffer
      entry_[2] += runs * _ici_bytes(kind, buffer, n)
  collectives = tuple(Collective(kind, axes, n, int(round(c)), b, ici)
                      for (kind, axes, n), (c, b, ici) in sorted(found.items()))
  return HloStats(flops, hbm, collectives, unknown,
                  tuple(Kernel(k, int(round(c)), f, b)
                        for k, (c, f, b) in sorted(custom_calls.kernels.items())),
                  tuple((k, int(round(c))) for k, c in sorted(custom_calls.uncounted.items())))
