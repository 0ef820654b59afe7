"""The wire formats of `compression.py` as jnp code, bit for bit: what the syncer's fused merge runs.

`compression.encode` / `decode` are numpy: each call makes a dozen passes over a tensor, several in
float64, which cost the syncer 0.9 s of a 1.07 s merge at M = 8 with int4 outer gradients (issue
41). These are the same formats inside one jitted program, so XLA:CPU fuses a tensor's wire round
trip with the merge's norms: the payload arrays (`payload`) are exactly the numpy encoder's, and a
decoded value (`decode_blocks`) exactly the numpy decoder's. `tests/test_compression_xla.py` holds
them together on random tensors, odd sizes, every block size and exact ties.

Two things keep the numpy arithmetic without float64:

- the scale s = max|x| / q_max divides by an array of q_max per block that the caller passes in
  (`divisors`): XLA rewrites a division by a constant or by a broadcast scalar into a
  multiplication by its reciprocal, which rounds differently (seen: one program divided, another
  multiplied, depending on what else it fused). For q_max in (1, 7, 127), float32(max|x| / q_max)
  is what numpy gets through float64: the quotient's binary expansion repeats with a short period,
  so it never lies within 2^-53 of a float32 rounding boundary and the double rounding changes
  nothing;
- q = round-half-even(x / s) is the float64 quotient's rounding in numpy. The float32 quotient can
  round onto the other side of a half (about one value in 2^21 at int4), so `quantize` takes
  float32's rounding as a guess q0 and corrects it with the exact remainder x - q0 * s, computed
  exactly by splitting s into a 12-bit high part and the rest (each product with |q0| <= 127 is
  exact in float32, and so is each difference: see `quantize`).

XLA:CPU flushes subnormal floats to zero, numpy does not: where a block's largest value is below
2^-100 (`TINY`; an outer gradient or a Theta_p change that small does not occur in training, but a
test can make one) the products above could lose bits, so `payload` reports whether every block
is clear of it and the caller encodes such a tensor with numpy instead.

int1's scale is a float64 mean of each block in numpy, which float32 does not reproduce: it stays
numpy-only (`FORMATS` lists what is here).

The block maxima are an integer max of the values' bit patterns over a (K, B/16, 16) view: XLA:CPU
vectorises that 16 lanes at a time, where its float row maximum over a block of 64 ran 2.5-3.5x
slower than reading the tensor (the float max must propagate NaN; for |x| the bit patterns order
as the values do, and a NaN's pattern is the largest, so a NaN block still gets a NaN scale).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from decoupled_diloco.algorithm import compression

FORMATS = ("fp32", "bf16", "int8", "int4", "int2")
QMAX = {"int8": 127, "int4": 7, "int2": 1}  # compression._QMAX
_LANES = 16  # float32 values of one AVX-512 register: the vectorised axis of block reductions
_SIGN_OFF = np.int32(0x7FFFFFFF)
_HIGH_12_BITS = np.int32(-4096)  # 0xFFFFF000: sign, exponent and the mantissa's 12 high bits
# 2^-100 as float32 bits (biased exponent 27): below it a block may meet subnormals (see above).
TINY_BITS = np.int32(27 << 23)


def num_blocks(size: int, block_size: int) -> int:
  return math.ceil(size / block_size)


def blocks(x, block_size: int):
  """A tensor flattened into [K, block_size] float32 blocks, the last one padded with zeros (as
  numpy's encoder pads: a zero changes neither a block's max nor its sum of squares)."""
  x_N = jnp.ravel(x).astype(jnp.float32)
  k = num_blocks(x_N.size, block_size)
  pad = k * block_size - x_N.size
  if pad:
    x_N = jnp.concatenate([x_N, jnp.zeros(pad, jnp.float32)])
  return x_N.reshape(k, block_size)


def _lanes(x_KxB):
  """[K, B] as [K, B/16, 16] when B allows it: reductions over axis 1 then run 16 lanes wide."""
  k, b = x_KxB.shape
  return x_KxB.reshape(k, b // _LANES, _LANES) if b % _LANES == 0 else x_KxB[:, :, None]


def block_absmax_and_sumsq(x_KxB):
  """Per block: (max |x|, sum of x^2 in float32), in one pass over x."""
  bits, sumsq = block_max_and_sumsq(lax.bitcast_convert_type(x_KxB, jnp.int32) & _SIGN_OFF, x_KxB)
  return lax.bitcast_convert_type(bits, jnp.float32), sumsq


def block_max_and_sumsq(ints_KxB, x_KxB):
  """Per block: (max of non-negative int32s, sum of x^2 in float32), in one pass over both."""
  operands = (_lanes(ints_KxB), _lanes(jnp.square(x_KxB)))

  def max_and_add(a, b):
    return jnp.maximum(a[0], b[0]), a[1] + b[1]

  zeros = (np.int32(0), np.float32(0))
  ints, sumsq = lax.reduce(operands, zeros, max_and_add, (1,))
  return lax.reduce((ints, sumsq), zeros, max_and_add, (1,))


def block_sums(x_KxB):
  """Per block, the sum of its values (over the same 16-lane view as `block_absmax_and_sumsq`)."""
  return jnp.sum(jnp.sum(_lanes(x_KxB), axis=1), axis=1)


def clear_of_subnormals(absmax_K):
  """True when no block's largest |value| is in (0, 2^-100): the exact-arithmetic range here."""
  bits = lax.bitcast_convert_type(absmax_K, jnp.int32)
  return jnp.logical_not(jnp.any((bits > 0) & (bits < TINY_BITS)))


def divisors(fmt: str, size: int, block_size: int) -> np.ndarray:
  """q_max per block of a tensor of `size` values, the program argument `block_scales` divides by."""
  return np.full(num_blocks(size, block_size), QMAX[fmt], np.float32)


def block_scales(absmax_K, qmax_K):
  """s = max|x| / q_max per block; `qmax_K` an argument of the program (`divisors`)."""
  return absmax_K / qmax_K


def quantize(x_KxB, scale_K, qmax: int):
  """round-half-even(x / s) per value, clipped to [-q_max, q_max], as int8: numpy's float64 result.

  q0 = rint(x * (1 / s)) in float32 is within one of it, and off only where x / s lies within a
  few float32 roundings of a half. The remainder r = x - q0 s decides exactly: with s = s_hi +
  s_lo (s_hi the 12 high mantissa bits), q0 s_hi and q0 s_lo are exact (at most 7 + 12 bits),
  x - q0 s_hi is exact (its operands are within about one s of each other, so at most 24
  significant bits), and so is the last difference (a fused multiply-add changes none of them).
  Then |2r| > s, or |2r| = s at an odd q0, moves q0 one step towards x. The per-block values are
  computed once per block, the rest is about a dozen vector operations per value.
  """
  safe_K = jnp.where(scale_K > 0, scale_K, 1.0)  # a zero block: x = 0, q = 0
  high_K = lax.bitcast_convert_type(
      lax.bitcast_convert_type(safe_K, jnp.int32) & _HIGH_12_BITS, jnp.float32)
  s, s_hi, s_lo = safe_K[:, None], high_K[:, None], (safe_K - high_K)[:, None]
  q0 = jnp.rint(x_KxB * (1.0 / safe_K)[:, None])
  two_r = 2.0 * ((x_KxB - q0 * s_hi) - q0 * s_lo)
  half = 0.5 * q0
  odd = jnp.rint(half) != half
  off = jnp.abs(two_r)
  q = jnp.where((off > s) | ((off == s) & odd), q0 + jnp.where(two_r > 0, 1.0, -1.0), q0)
  return jnp.clip(q, -qmax, qmax).astype(jnp.int8)


def decode_blocks(q_KxB, scale_K):
  """The float32 values of int blocks: q * s, as `compression.decode` computes them."""
  return q_KxB.astype(jnp.float32) * scale_K[:, None]


def rounded_apart(x, zero):
  """x, kept out of a fused multiply-add with whatever adds it next: `zero` is an int32 0 passed
  into the program. XLA:CPU contracts a multiply followed by an add into one fused multiply-add
  when it optimises (not at --xla_backend_optimization_level=0, the tests' setting): one
  rounding where numpy's q * s, then + R, rounds twice. An xor of the product's bits with a
  value the compiler cannot see is zero keeps the two roundings."""
  bits = lax.bitcast_convert_type(x, jnp.int32) ^ zero
  return lax.bitcast_convert_type(bits, jnp.float32)


def round_bf16(x):
  """x through bfloat16 and back, in float32 (round half to even, as ml_dtypes), on the bits: XLA
  may drop a float32 -> bfloat16 -> float32 convert pair as excess precision."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
  return lax.bitcast_convert_type(bits, jnp.float32)


def pack(q_N, fmt: str):
  """The packed bytes of `compression._pack_int4` / `_pack_int2` (int8: q itself)."""
  if fmt == "int8":
    return q_N
  per_byte, offset = (2, 8) if fmt == "int4" else (4, 1)
  codes = (q_N.astype(jnp.int32) + offset).astype(jnp.uint8)
  pad = -codes.size % per_byte
  if pad:
    codes = jnp.concatenate([codes, jnp.full(pad, offset, jnp.uint8)])
  codes = codes.reshape(-1, per_byte)
  bits = 8 // per_byte
  packed = codes[:, 0]
  for k in range(1, per_byte):
    packed = packed | (codes[:, k] << (bits * k))
  return packed


def unpack(packed, fmt: str, n: int):
  """The n int8 codes `pack` packed (int8: the codes themselves), as `compression.decode` reads
  them: low bits first, the offset taken off."""
  if fmt == "int8":
    return packed.astype(jnp.int8)
  per_byte, offset = (2, 8) if fmt == "int4" else (4, 1)
  bits = 8 // per_byte
  mask = np.uint8((1 << bits) - 1)
  codes = jnp.stack([(packed >> np.uint8(bits * k)) & mask for k in range(per_byte)], axis=-1)
  return (codes.reshape(-1)[:n].astype(jnp.int32) - offset).astype(jnp.int8)


def payload(x, fmt: str, block_size: int, qmax_K=None):
  """`compression.encode(x, fmt, block_size).payload` and the decoded float32 values beside it:
  (payload arrays, decoded, exact). `qmax_K`: the int formats' `divisors`, a program argument.
  `exact` is False where subnormals may make the result differ from numpy's (encode it there)."""
  x32 = jnp.asarray(x, jnp.float32)
  if fmt == "fp32":
    return (jnp.ravel(x32),), x32, jnp.bool_(True)
  if fmt == "bf16":
    wire = jnp.ravel(x32).astype(jnp.bfloat16)
    absmax, _ = block_absmax_and_sumsq(x32.reshape(-1, 1))  # every value is its own block
    return (wire,), wire.astype(jnp.float32).reshape(x32.shape), clear_of_subnormals(absmax)
  if fmt not in QMAX:
    raise ValueError(f"format {fmt!r} has no jnp encoder; these do: {FORMATS}")
  n = x32.size
  x_KxB = blocks(x32, block_size)
  absmax_K, _ = block_absmax_and_sumsq(x_KxB)
  scale_K = block_scales(absmax_K, qmax_K)
  q_KxB = quantize(x_KxB, scale_K, QMAX[fmt])
  decoded = decode_blocks(q_KxB, scale_K).reshape(-1)[:n].reshape(x32.shape)
  return (pack(q_KxB.reshape(-1)[:n], fmt), scale_K), decoded, clear_of_subnormals(absmax_K)


def encoded(arrays, fmt: str, shape, block_size: int) -> compression.Encoded:
  """`payload`'s arrays, fetched to the host, as the `Encoded` the numpy encoder makes."""
  host = tuple(np.asarray(a) for a in arrays)
  return compression.Encoded(fmt, tuple(shape), host, block_size)
