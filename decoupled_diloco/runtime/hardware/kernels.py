"""Custom-call kernels of a compiled program, which XLA's own counts do not see into: the FLOPs and
HBM bytes of those the HLO analysis (hlo_analysis.py) recognises, and which custom calls it cannot
count.

A Pallas (Mosaic) kernel is one `custom-call` instruction to XLA, and XLA's cost_analysis gives it
no FLOPs: a causal splash attention of 8 x 8 x 8,192 x 128 with its backward pass reported 33
MFLOP. A roofline from those figures would call a splash step nearly free.

Recognised: the splash attention kernels of lm/splash.py, by the name Pallas gives them
(`splash_{mha,mqa}_{fwd,dq,dkv}...`, in the instruction's op_name). For B x H sequences-heads of
Sq queries and Skv keys of width D (the query operand's shape), whose block mask makes the kernel
visit v of its (Sq / block_q) x (Skv / block_kv) blocks (all; for a causal mask those that reach
the diagonal, about half), per call:

- FLOPs: 4 B H Sq Skv D x v / blocks in the forward kernel (Q K^T and P V); the fused backward
  2.5x that (Q K^T again, dP, dV, dQ, dK), a separate dkv kernel 2x and dq kernel 1.5x.
- HBM bytes: every operand and result once (Q, K, V, O or dO, dQ, dK, dV, the log-sum-exp and the
  kernel's small scratch outputs), plus what its grid reads again: the forward and dq kernels load
  the K and V blocks once per block of queries, the dkv kernel the Q and dO blocks once per block
  of keys (the log-sum-exp rows re-read with them are 1/16 of those and left out). Operands and
  results the compiler placed in VMEM (memory space 1) move no HBM bytes.

The block sizes come from the kernel's metadata in the HLO (splash's `xprof_metadata`); without
them a kernel counts as one block (no re-reads: a lower bound). The mask is causal when the op_name
carries lm/flops.py's CAUSAL_KERNEL_SCOPE (lm/splash.py puts it there); any other mask is counted
as full, an upper bound. Other custom calls are XLA's own bookkeeping (no FLOPs, bytes as operands
and results) or, when unknown, listed as uncounted: never silently zero. No JAX here.
"""

from __future__ import annotations

import dataclasses
import math
import re

from decoupled_diloco.lm import flops as flops_lib
from decoupled_diloco.runtime.hardware import hlo_text

# XLA:TPU's own custom calls that do no matmul, as met in the shipped experiments' programs
# (libtpu 0.0.42.1): a bitcast joining the pieces of an async slice, the index bookkeeping of a
# gather (the embedding lookup), an uninitialised buffer's allocation. Their bytes count as any instruction's; their matmul FLOPs are
# none (elementwise work is counted nowhere, lm/flops.py). Add one here only once it is known.
NO_FLOPS = frozenset({"ConcatBitcast", "AssumeGatherIndicesInBound",
                      "GatherScatterIndicesBitpacked", "AllocateBuffer"})
# Of those, the ones that move no bytes either: an uninitialised buffer is neither read nor written.
MOVES_NOTHING = frozenset({"AllocateBuffer"})
# FLOPs of each splash kernel per 4 B H Sq Skv D of visited blocks.
_SPLASH_FACTOR = {"fwd": 1.0, "dq": 1.5, "dkv": 2.0, "dkv_fused": 2.5}
_SPLASH_NAME = re.compile(r"\bsplash_(mha|mqa)_(fwd|dq|dkv)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Tally:
  """The custom calls of one program, as the HLO walk meets them (`add`)."""

  kernels: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # calls, FLOPs, bytes
  uncounted: dict[str, float] = dataclasses.field(default_factory=dict)  # label -> calls

  def add(self, ins: hlo_text.Instruction, shapes: dict[str, list[hlo_text.Array]], runs: float
          ) -> float | None:
    """Records custom call `ins`, run `runs` times; its HBM bytes when this counts them (a
    recognised kernel's, or none), None when they are its operands' and results' as anyone's."""
    kernel = splash_cost(ins, shapes)
    if kernel is not None:
      calls, flops, moved = self.kernels.get(kernel.name, (0.0, 0.0, 0.0))
      self.kernels[kernel.name] = [calls + runs, flops + runs * kernel.flops,
                                   moved + runs * kernel.hbm_bytes]
      return runs * kernel.hbm_bytes
    if target(ins) in MOVES_NOTHING:
      return 0.0
    if target(ins) not in NO_FLOPS:
      self.uncounted[label(ins)] = self.uncounted.get(label(ins), 0.0) + runs
    return None


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """One call of a recognised kernel."""

  name: str  # "splash_mha_fwd", "splash_mha_dkv_fused", ...
  flops: float
  hbm_bytes: float


def target(ins: hlo_text.Instruction) -> str:
  """A custom call's target ("tpu_custom_call", "ConcatBitcast")."""
  found = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
  return found.group(1) if found else ""


def label(ins: hlo_text.Instruction) -> str:
  """What to call an uncounted custom call in a report: its kernel's name where Pallas gave one
  (the op_name's last part but one: ".../my_kernel/pallas_call"), else its target."""
  op_name = _OP_NAME.search(ins.attributes)
  parts = op_name.group(1).split("/") if op_name else []
  if len(parts) > 1 and parts[-1] == "pallas_call":
    return parts[-2]
  return target(ins) or ins.name


def splash_cost(ins: hlo_text.Instruction, shapes: dict[str, list[hlo_text.Array]]
                ) -> KernelCost | None:
  """The cost of one call of a splash attention kernel, None if `ins` is not one."""
  op_name = _OP_NAME.search(ins.attributes)
  where = op_name.group(1) if op_name else ins.name
  kind = _SPLASH_NAME.search(where) or _SPLASH_NAME.search(ins.name)
  if ins.opcode != "custom-call" or kind is None:
    return None
  operands = [(shapes.get(o) or [None])[0] for o in ins.operands]
  tensors = [a for a in operands if a is not None and len(a.dims) >= 3
             and a.dtype.startswith(("bf", "f"))]
  if len(tensors) < 2:
    return None
  q, k = tensors[0], tensors[1]
  *lead, seq_q, width = q.dims
  seq_kv = k.dims[-2]
  phase = kind.group(2)
  if phase == "dkv" and any(len(a.dims) == len(q.dims) + 1 for a in ins.arrays):
    phase = "dkv_fused"  # its dQ comes out once per block of keys, summed after the kernel
  blocks = _block_sizes(ins.attributes, phase)
  block_q, block_kv = (blocks or (seq_q, seq_kv))
  causal = flops_lib.CAUSAL_KERNEL_SCOPE in where
  visited = _visited_blocks(seq_q, seq_kv, block_q, block_kv, causal)
  rows, cols = seq_q // block_q, seq_kv // block_kv
  flops = (_SPLASH_FACTOR[phase] * 4 * math.prod(lead) * seq_q * seq_kv * width
           * visited / (rows * cols))
  once = (sum(a.hbm_nbytes for a in operands if a is not None)
          + sum(a.hbm_nbytes for a in ins.arrays))
  if phase == "fwd" or phase == "dq":  # K and V blocks again for every row of query blocks
    again = (visited / cols - 1) * 2 * k.hbm_nbytes
  else:  # Q and dO blocks again for every column of key blocks
    again = (visited / rows - 1) * 2 * q.hbm_nbytes
  return KernelCost(f"splash_{kind.group(1)}_{phase}", flops, once + again)


def _block_sizes(attributes: str, phase: str) -> tuple[int, int] | None:
  """(block_q, block_kv) of the kernel's phase, from splash's metadata in the HLO."""
  keys = {"fwd": ("block_q", "block_kv"), "dq": ("block_q_dq", "block_kv_dq")}.get(
      phase, ("block_q_dkv", "block_kv_dkv"))
  sizes = [re.search(rf'\\?"{key}\\?": (\d+)', attributes) for key in keys]
  return tuple(int(s.group(1)) for s in sizes) if all(sizes) else None


def _visited_blocks(seq_q: int, seq_kv: int, block_q: int, block_kv: int, causal: bool) -> int:
  """Blocks of the (query block, key block) grid the kernel computes: all of them, or for a
  causal mask (query i sees keys <= i) those holding a key at or before the block's last query."""
  rows, cols = seq_q // block_q, seq_kv // block_kv
  if not causal:
    return rows * cols
  return sum(min(cols, ((i + 1) * block_q - 1) // block_kv + 1) for i in range(rows))
