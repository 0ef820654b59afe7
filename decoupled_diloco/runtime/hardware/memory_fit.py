"""Whether a learner's compiled programs fit its chips' HBM: the start-up refusal on a TPU, and
`config.model.remat='auto'`.

The TPU compiler knows the HBM of the chip it compiles for (on a TPU host, or for the compile-only
devices of a topology on any host; runtime/tpu_aot.py): a program larger than the chip fails its
compile with RESOURCE_EXHAUSTED, and one that compiles reports its arguments, outputs, donated
(aliased) outputs, temporaries and code per chip (`compiled.memory_analysis()`). A learner holds
more than its step's own buffers: while a step runs, the publication the syncer pulls from
refers to a device copy of the parameters (runtime/core/learner.py), so that copy counts too. A learner
that cannot fit is refused before its first step, with the numbers, instead of failing in it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from decoupled_diloco import errors
from decoupled_diloco.runtime.core import throughput

# Share of a chip's usable HBM that `remat='auto'` and the AOT report want left free: room for the
# runtime's own buffers and for what the compiled figures leave out (transfers in flight, the
# eval batches, fragmentation).
HBM_MARGIN = 0.10
# config.model.remat='auto' tries these in order, each recomputing more of a block in the backward
# pass than the one before (the compiled FLOPs of every experiment's step rise along it:
# results/aot_*.md); everything_saveable keeps as much as "none" and nothing_saveable as little
# as "full", so neither is tried.
REMAT_ORDER = ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "full")
_GIB = 1024**3


class DoesNotFit(errors.InputError):
  """A learner program needs more HBM per chip than its chip has."""


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """Bytes per chip of one compiled program (`compiled.memory_analysis()`)."""

  argument_bytes: int
  output_bytes: int
  alias_bytes: int  # outputs written into donated arguments: not allocated twice
  temp_bytes: int
  code_bytes: int

  @classmethod
  def of(cls, compiled: Any) -> ProgramMemory:
    stats = compiled.memory_analysis()
    return cls(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
               int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes),
               int(stats.generated_code_size_in_bytes))

  @property
  def peak_bytes(self) -> int:
    """Everything the program holds at once: its arguments, its outputs less those written into
    donated arguments, its temporaries and its code."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.code_bytes)


def usable_hbm_bytes(device: jax.Device) -> int | None:
  """HBM a program may allocate on `device`'s chip (runtime/core/throughput.py's table); None for a
  device that is not a TPU chip of the table."""
  chip = throughput.tpu_chip(device.device_kind)
  return chip.hbm_usable_bytes if chip is not None else None


def bytes_per_chip(tree: Any) -> int:
  """Bytes one chip holds of the arrays (or sharded ShapeDtypeStructs) of `tree`."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * leaf.dtype.itemsize
  return total


def gib(n: float) -> str:
  return f"{n / _GIB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class Fit:
  """One program's HBM per chip against its chip's."""

  memory: ProgramMemory | None  # None: the compiler refused it
  alongside_bytes: int  # held on the chip while it runs, not among its buffers
  usable_bytes: int
  refusal: str = ""  # the compiler's message when it refused
  # Of its arguments, what the caller knows them to be (a train state) and their bytes per chip:
  # named when the compiler refused the program.
  arguments: str = "its arguments"
  arguments_bytes: int = 0

  @property
  def needed_bytes(self) -> int | None:
    return None if self.memory is None else self.memory.peak_bytes + self.alongside_bytes

  @property
  def share(self) -> float:
    """Of the usable HBM, the share the program needs (inf when the compiler refused it)."""
    return math.inf if self.memory is None else self.needed_bytes / self.usable_bytes

  @property
  def fits(self) -> bool:
    return self.share <= 1.0

  @property
  def fits_with_margin(self) -> bool:
    return self.share <= 1.0 - HBM_MARGIN


def compile_and_measure(lowered: Any, *, alongside_bytes: int, usable_bytes: int,
                        arguments: str = "its arguments", arguments_bytes: int = 0
                        ) -> tuple[Any, Fit]:
  """`lowered.compile()` and how it fits; the executable is None when the compiler refused it for
  lack of HBM (any other compile error propagates, out of memory in VMEM included)."""
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as err:
    # Only HBM: the compiler runs out of other memories too (a fusion's scoped VMEM), which no
    # chip with more HBM would change.
    if "RESOURCE_EXHAUSTED" not in str(err) or "HBM" not in str(err):
      raise
    return None, Fit(None, alongside_bytes, usable_bytes, str(err).strip(), arguments,
                     arguments_bytes)
  return compiled, Fit(ProgramMemory.of(compiled), alongside_bytes, usable_bytes,
                       arguments=arguments, arguments_bytes=arguments_bytes)


def describe(fit: Fit, what: str, device_kind: str, alongside: str) -> str:
  """'learner 2's train step needs 20.1 GiB of HBM per chip (...)' with every figure."""
  if fit.memory is None:
    return (f"{what} does not fit a {device_kind} chip ({gib(fit.usable_bytes)} usable): "
            f"{fit.arguments} alone take {gib(fit.arguments_bytes)} per chip, "
            f"{gib(fit.alongside_bytes)} of {alongside} would be there besides, and the TPU "
            f"compiler refused it ({fit.refusal.rstrip('.')})")
  m = fit.memory
  return (f"{what} needs {gib(fit.needed_bytes)} of HBM per chip ({gib(m.argument_bytes)} "
          f"arguments, {gib(m.output_bytes)} outputs of which {gib(m.alias_bytes)} reuse donated "
          f"arguments, {gib(m.temp_bytes)} temporaries, {gib(m.code_bytes)} code, and "
          f"{gib(fit.alongside_bytes)} of {alongside}) of the {gib(fit.usable_bytes)} a "
          f"{device_kind} chip has ({100 * fit.share:.1f}%)")


def refuse_unless_fits(fit: Fit, *, what: str, device_kind: str, alongside: str,
                       fields: str) -> None:
  """Raises DoesNotFit, with the numbers and the config fields that change them, unless `fit`
  fits."""
  if not fit.fits:
    raise DoesNotFit(f"{describe(fit, what, device_kind, alongside)}, so it cannot run: {fields}")


def choose_remat(try_policy: Callable[[str], Sequence[Fit]], current: str = "auto"
                 ) -> tuple[str, dict[str, list[Fit]]]:
  """The first policy of REMAT_ORDER whose programs (`try_policy(policy)`: one Fit per distinct
  learner) all fit with HBM_MARGIN to spare, and the fits of every policy tried. Raises
  DoesNotFit when even "full" does not."""
  tried: dict[str, list[Fit]] = {}
  for policy in REMAT_ORDER:
    tried[policy] = list(try_policy(policy))
    if all(f.fits_with_margin for f in tried[policy]):
      return policy, tried
  worst = max(tried["full"], key=lambda f: f.share)
  raise DoesNotFit(
      f"config.model.remat={current!r}: no policy leaves {100 * HBM_MARGIN:.0f}% of HBM free; "
      f"with 'full' the largest learner step needs "
      f"{'more than the compiler allows' if worst.memory is None else gib(worst.needed_bytes)} "
      f"of {gib(worst.usable_bytes)} per chip. Split the model over more chips "
      f"(config.learner_mesh_shapes) or lower config.data.batch_size")


def describe_tried(tried: dict[str, Sequence[Fit]]) -> str:
  """'none 131%, dots_saveable 97%, full 62%': each policy's most demanding learner."""
  def share(fits):
    worst = max(f.share for f in fits)
    return "more than the compiler allows" if worst == math.inf else f"{100 * worst:.0f}%"
  return ", ".join(f"{policy} {share(fits)}" for policy, fits in tried.items())
