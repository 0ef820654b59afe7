"""Tokens/s per device, achieved FLOP/s and MFU of the learners, from their step times.

MFU = model FLOPs per token (lm/flops.py) x tokens/s per device / the chip's dense bf16 peak.
The time is *learner step time*: each learner's seconds from one completed step to the next, on
its own thread (lm step, publishing, applying merges, an emulated step delay). The compile is not
in it (build compiles every step on a throw-away batch before training starts), and steps that
overlapped an evaluation of the global model are left out (an evaluation borrows learner 0's
devices; on CPU every fake device shares the same cores). Barrier waits of the lock-step modes
are in it: they are what those modes cost.

No JAX here: the device kind comes in as a string (`jax.Device.device_kind`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# Dense (no sparsity) bf16 peak FLOP/s per chip, by `device_kind` as JAX reports it. Exact names
# first (a TPU v5p reports "TPU v5", a prefix of v5e's "TPU v5 lite"); then GPU substrings, the
# more specific before the less.
_TPU_PEAKS = {
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16 per chip.
    "tpu v5": 459e12, "tpu v5p": 459e12,
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16 per chip (Trillium).
    "tpu v6 lite": 918e12, "tpu v6e": 918e12,
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16 per chip.
    "tpu v5 lite": 197e12, "tpu v5e": 197e12,
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16 per chip.
    "tpu v4": 275e12,
}
_GPU_PEAKS = (
    # https://www.nvidia.com/en-us/data-center/h100/ (datasheet): BF16 Tensor Core 1,979 TFLOP/s
    # SXM, 1,671 NVL, 1,513 PCIe, each "with sparsity": half of it dense.
    ("h100 pcie", 1513e12 / 2), ("h100 nvl", 1671e12 / 2), ("h100", 1979e12 / 2),
    # https://www.nvidia.com/en-us/data-center/h200/ (datasheet): BF16 Tensor Core 1,979 TFLOP/s
    # SXM, 1,671 NVL, "with sparsity": half of it dense.
    ("h200 nvl", 1671e12 / 2), ("h200", 1979e12 / 2),
    # https://www.nvidia.com/en-us/data-center/a100/ (datasheet): BF16 Tensor Core 312 TFLOP/s
    # dense (624 with sparsity), SXM and PCIe alike.
    ("a100", 312e12),
)


def peak_flops_per_s(device_kind: str) -> float | None:
  """Dense bf16 peak FLOP/s of one chip of this kind; None for CPU or a kind not in the table."""
  kind = device_kind.strip().lower()
  if kind in _TPU_PEAKS:
    return _TPU_PEAKS[kind]
  return next((peak for name, peak in _GPU_PEAKS if name in kind), None)


@dataclasses.dataclass(frozen=True)
class Throughput:
  tokens_per_s_per_device: float | None  # None: no step timed
  achieved_flops_per_s_per_device: float | None
  mfu: float | None  # None where the peak is unknown (CPU)


def throughput(tokens: float, device_seconds: float, flops_per_token: float,
               peak: float | None) -> Throughput:
  """From `tokens` trained in `device_seconds` (step seconds x devices, summed over learners)."""
  if tokens <= 0 or device_seconds <= 0:
    return Throughput(None, None, None)
  per_device = tokens / device_seconds
  achieved = per_device * flops_per_token
  return Throughput(per_device, achieved, achieved / peak if peak else None)


def steps_outside(step_ends: Sequence[float], step_times: Sequence[float],
                  windows: Sequence[tuple[float, float]]) -> tuple[int, float]:
  """(count, seconds) of the steps, each (end - time, end], that overlap none of `windows`."""
  count, seconds = 0, 0.0
  for end, duration in zip(step_ends, step_times):
    start = end - duration
    if any(start < w_end and w_start < end for w_start, w_end in windows):
      continue
    count += 1
    seconds += duration
  return count, seconds


def shared_steps_outside(learners: Sequence[tuple[Sequence[float], Sequence[float]]],
                         windows: Sequence[tuple[float, float]]) -> tuple[list[int], float]:
  """Of learners that share devices, each given as (step_ends, step_times): per learner the count
  of its steps that overlap none of `windows`, and the seconds their devices were stepping, the
  union of those steps' intervals.

  A learner that shares its devices with n - 1 others measures a step as one turn of all of them
  (runtime/device_share.py): summed over the n learners, their step seconds count the devices'
  time n times over, and tokens per device-second would read n times too low. The union counts
  each second once, whoever's steps filled it, and stays right while some of them are down.
  """
  counts, intervals = [], []
  for step_ends, step_times in learners:
    count = 0
    for end, duration in zip(step_ends, step_times):
      start = end - duration
      if any(start < w_end and w_start < end for w_start, w_end in windows):
        continue
      count += 1
      intervals.append((start, end))
    counts.append(count)
  seconds, reach = 0.0, None
  for start, end in sorted(intervals):
    if reach is None or start > reach:
      seconds += end - start
      reach = end
    elif end > reach:
      seconds += end - reach
      reach = end
  return counts, seconds
