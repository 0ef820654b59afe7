"""Cross-datacenter bandwidth and wall-clock: DP vs Decoupled DiLoCo (docs/design.md §7).

Notation: N parameters, t = inner step time (s), D datacenters, P fragments, H sync period (steps),
τ overlap (steps a fragment's sync may take), b bits per value on the wire.

Wire formats (the same byte counts as the runtime's `compression.encoded_nbytes`):
    fp32: 4 bytes, bf16: 2 bytes a value;
    int8: 1 byte a value + one fp32 scale per block of B values: n + 4·⌈n/B⌉ bytes;
    int4: two values packed per byte + one fp32 scale per block: ⌈n/2⌉ + 4·⌈n/B⌉ bytes;
    int2, int1: four, eight values per byte + the scales: ⌈n/4⌉, ⌈n/8⌉ + 4·⌈n/B⌉ bytes.
So b = 32, 16, 8 + 32/B, 4 + 32/B, 2 + 32/B and 1 + 32/B bits a value (8.5, 4.5, 2.5, 1.5 at
B = 64).

DP: every step all-reduces the gradients. Hierarchically (reduce inside each datacenter over its fast
network, then one ring across the D datacenters) each datacenter sends, and receives,
    2·(D − 1)/D · N · b_grad   per step,
and the step cannot finish before it has. Over a WAN link of W bit/s per datacenter the step takes
    t_DP(W) = t + 2·(D − 1)/D · N · b_grad / W          (communication not hidden behind compute).
Bandwidth that keeps the step at t: W_DP = 2·(D − 1)/D · N · b_grad / t.

Decoupled DiLoCo: each fragment (N/P values) is synced every H steps, staggered, so each learner
sends N/H outer-gradient values to the syncer and receives N/H values of Θ per step on average;
a fragment's transfer may take up to τ steps. The learner's link must carry the steady flow and
deliver a fragment within τ steps:
    W_DDL = max( N·b/(H·t),  (N/P)·b/(τ·t) )   per direction, b = max(b_outer_grad, b_broadcast).
With the paper's P = H = 24 and τ = 2 the first term binds: one fragment per step. The learner
never waits for the syncer; on a slower link the syncs fall behind, so we count the step as
stretched to the transfer time, t_DDL(W) = max(t, N·b/(H·W), (N/P)·b/(τ·W)) (pessimistic).

Reduction factor (same t, per datacenter link, P·τ ≥ H):
    W_DP / W_DDL = 2·(D − 1)/D · H · b_grad / b_outer.
"""

import math

FORMATS = ("fp32", "bf16", "int8", "int4", "int2", "int1")
SCALE_BYTES = 4  # one float32 scale per block of integer values
_BITS = {"int8": 8, "int4": 4, "int2": 2, "int1": 1}
DEFAULT_BLOCK_SIZE = 64


def _check_format(fmt: str, block_size: int, field: str = "format") -> None:
  if fmt not in FORMATS:
    raise ValueError(f"{field}={fmt!r} must be one of {FORMATS}")
  if not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"block_size={block_size!r} must be an integer >= 1")


def encoded_bytes(num_values: int, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
  """Bytes of `num_values` values in wire format `fmt` (see the module docstring)."""
  _check_format(fmt, block_size)
  if num_values < 0:
    raise ValueError(f"num_values={num_values} must be >= 0")
  if fmt == "fp32":
    return 4 * num_values
  if fmt == "bf16":
    return 2 * num_values
  scales = SCALE_BYTES * math.ceil(num_values / block_size)
  return math.ceil(num_values * _BITS[fmt] / 8) + scales


def bits_per_value(fmt: str, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
  """Asymptotic wire bits a value: 32, 16, then 8, 4, 2, 1 + 32/B for the integer formats."""
  _check_format(fmt, block_size)
  if fmt in _BITS:
    return _BITS[fmt] + 32.0 / block_size
  return {"fp32": 32.0, "bf16": 16.0}[fmt]


def _fragment_sizes(num_params: int, num_fragments: int) -> list:
  # Balanced split: sizes differ by at most one value (the runtime's greedy bins are within 4/3).
  base, extra = divmod(num_params, num_fragments)
  return [base + 1] * extra + [base] * (num_fragments - extra)


def bytes_per_inner_step(
    num_params: int,
    num_fragments: int,
    outer_grad_format: str = "bf16",
    broadcast_format: str = "bf16",
    block_size: int = DEFAULT_BLOCK_SIZE,
    sync_period: int | None = None,
) -> float:
  """Bytes one learner sends + receives to/from the syncer per inner step, on average.

  Each fragment p of n_p values is synced every H steps: the learner sends its outer gradient
  (`outer_grad_format`) and receives the merged Θ_p (`broadcast_format`), so per step
      bytes = (1/H) · Σ_p [ enc(n_p, outer_grad_format) + enc(n_p, broadcast_format) ],
  which with H = P (the paper's default, `sync_period=None`) is one fragment each way per step:
  ≈ (N/P) · (b_up + b_down) / 8. Fragments are split as evenly as possible and each is encoded as
  one stream of blocks (a runtime that encodes tensor by tensor adds at most one partial block of
  scales, 4 bytes, per tensor).
  """
  _check_format(outer_grad_format, block_size, "outer_grad_format")
  _check_format(broadcast_format, block_size, "broadcast_format")
  if not 1 <= num_fragments <= num_params:
    raise ValueError(f"num_fragments={num_fragments} must be between 1 and num_params={num_params}")
  period = num_fragments if sync_period is None else sync_period
  if period < 1:
    raise ValueError(f"sync_period={sync_period} must be >= 1")
  total = sum(encoded_bytes(n, outer_grad_format, block_size) + encoded_bytes(n, broadcast_format,
                                                                              block_size)
              for n in _fragment_sizes(num_params, num_fragments))
  return total / period


def dp_ring_allreduce_bytes_per_step(num_params: float, num_workers: int, grad_bytes: float) -> float:
  """Bytes each worker sends per step in a ring all-reduce: 2·(n − 1)/n · N · b.

  Reduce-scatter then all-gather, each moving (n − 1)/n of the gradient through every worker; it
  receives as much as it sends. One worker (n = 1) sends nothing.
  """
  if num_workers < 1:
    raise ValueError(f"num_workers={num_workers} must be >= 1")
  return 2.0 * (num_workers - 1) / num_workers * num_params * grad_bytes


def dp_wan_gbits(num_params: float, num_datacenters: int, step_s: float,
                 grad_format: str = "bf16") -> float:
  """W_DP = 2·(D − 1)/D · N · b_grad / t in Gbit/s per datacenter (each direction)."""
  values = dp_ring_allreduce_bytes_per_step(num_params, num_datacenters, 1.0)
  return values * bits_per_value(grad_format) / step_s / 1e9


def decoupled_wan_gbits(num_params: float, num_fragments: int, step_s: float,
                        outer_grad_format: str = "bf16", broadcast_format: str = "bf16",
                        block_size: int = DEFAULT_BLOCK_SIZE, sync_period: int | None = None,
                        overlap: int = 2) -> float:
  """W_DDL = max(N·b/(H·t), (N/P)·b/(τ·t)) in Gbit/s per learner link (each direction)."""
  if overlap < 1:
    raise ValueError(f"overlap={overlap} (τ) must be >= 1: a transfer needs at least one step")
  period = num_fragments if sync_period is None else sync_period
  b = max(bits_per_value(outer_grad_format, block_size), bits_per_value(broadcast_format, block_size))
  return max(num_params * b / (period * step_s),
             num_params / num_fragments * b / (overlap * step_s)) / 1e9


def dp_step_s(num_params: float, num_datacenters: int, step_s: float, wan_gbits: float,
              grad_format: str = "bf16") -> float:
  """t_DP(W) = t + 2·(D − 1)/D · N · b_grad / W: the all-reduce is not hidden behind compute."""
  return step_s + dp_wan_gbits(num_params, num_datacenters, 1.0, grad_format) / wan_gbits


def decoupled_step_s(num_params: float, num_fragments: int, step_s: float, wan_gbits: float,
                     outer_grad_format: str = "bf16", broadcast_format: str = "bf16",
                     block_size: int = DEFAULT_BLOCK_SIZE, sync_period: int | None = None,
                     overlap: int = 2) -> float:
  """t_DDL(W) = max(t, time to move the per-step flow, a fragment within τ steps) over W Gbit/s."""
  needed = decoupled_wan_gbits(num_params, num_fragments, 1.0, outer_grad_format,
                               broadcast_format, block_size, sync_period, overlap)
  return max(step_s, needed / wan_gbits)
