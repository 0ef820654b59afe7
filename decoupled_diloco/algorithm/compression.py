"""Host-side wire formats for outer gradients and fragment values (docs/design.md §5).

Outer gradients may travel compressed: bf16 by default; int4 was reported nearly lossless, while
the paper reports that 2-bit and 1-bit outer gradients make training collapse. int2 and int1 are
offered anyway, to measure that here (the compression ladder in docs/studies.md), and as formats of
the delta broadcast (`runtime/core/global_model.py`), where the error of one delta is carried by the
next.
``Encoded.payload`` is exactly what would travel; its byte count is what the bandwidth accounting
charges. Shape and format are metadata every side already knows (the fragment layout is fixed), so
they are not counted.

The integer formats cut the flattened tensor into blocks of ``block_size`` consecutive values (the
last block may be short); each block stores one float32 scale s. Decoding always produces float32:
accumulation is done in fp32.

- int8, int4, int2: symmetric absmax scaling, s = max|x| / q_max and q = round(x / s) in
  [-q_max, q_max] (q_max = 127, 7, 1); decoding gives q · s, so each value is off by at most s / 2.
  int2 is therefore ternary, {-1, 0, +1} · max|x|: of its four 2-bit codes one is unused, but 0
  stays exact (a zero block, a sparse tensor) and the largest value of each block decodes to
  itself, as with int8 / int4. Packed four values per byte.
- int1: the sign alone, x -> sign(x) · s with s = mean|x| over the block, the scale that keeps the
  block's L1 mass (signSGD with a per-block magnitude). Every value is off by up to
  max(|x| - s, s); 0 decodes to +s. Packed eight values per byte.

A block of zeros has s = 0 and decodes to zeros exactly in every format.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np

FORMATS = ("fp32", "bf16", "int8", "int4", "int2", "int1")

# Largest magnitude of a quantised value of the absmax formats. Symmetric ranges (no -128 / -8 /
# -2) keep 0 exact and the rounding error the same on both sides.
QMAX = {"int8": 127, "int4": 7, "int2": 1}  # the largest code of each integer format
# Values packed into one byte.
_PER_BYTE = {"int8": 1, "int4": 2, "int2": 4, "int1": 8}


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A tensor in a wire format.

  Attributes:
    fmt: one of ``FORMATS``.
    shape: the original shape.
    payload: the arrays that travel: (values,) for fp32/bf16, (values, float32 scales) for
      the integer formats. int4 / int2 / int1 values are packed 2 / 4 / 8 per uint8.
    block_size: values per scale block (int formats; metadata, like the shape).
  """

  fmt: str
  shape: tuple[int, ...]
  payload: tuple[np.ndarray, ...]
  block_size: int

  @property
  def nbytes(self) -> int:
    """Bytes that travel: the sum of the payload arrays' sizes."""
    return sum(a.nbytes for a in self.payload)


def _check(fmt: str, block_size: int) -> None:
  if fmt not in FORMATS:
    raise ValueError(
        f"compression format {fmt!r} (config.compression.outer_grad / .broadcast) must be one "
        f"of {FORMATS}"
    )
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or (
      block_size < 1
  ):
    raise ValueError(f"config.compression.block_size={block_size!r} must be an integer >= 1")


def encoded_nbytes(num_elements: int, fmt: str, block_size: int) -> int:
  """Bytes on the wire for ``num_elements`` values, computed without encoding anything.

  fp32: 4n; bf16: 2n; int8: n + 4·⌈n/B⌉; int4: ⌈n/2⌉ + 4·⌈n/B⌉; int2: ⌈n/4⌉ + 4·⌈n/B⌉;
  int1: ⌈n/8⌉ + 4·⌈n/B⌉ (B = block_size, 4 bytes per scale).
  """
  _check(fmt, block_size)
  if fmt == "fp32":
    return 4 * num_elements
  if fmt == "bf16":
    return 2 * num_elements
  scales = 4 * math.ceil(num_elements / block_size)
  return math.ceil(num_elements / _PER_BYTE[fmt]) + scales


def _quantize(x_N: np.ndarray, qmax: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Per-block absmax quantisation of a flat array: (q_N as int8, scales_B as float32)."""
  n = x_N.size
  num_blocks = math.ceil(n / block_size)
  padded = np.zeros(num_blocks * block_size, np.float64)
  padded[:n] = x_N
  x_BxK = padded.reshape(num_blocks, block_size)
  scale_B = (np.abs(x_BxK).max(axis=1) / qmax).astype(np.float32)
  # Divide by the float32 scale that travels (not the exact one), in float64, so |x - q·s| <= s/2
  # holds for the decoded value.
  safe_B = np.where(scale_B > 0, scale_B, 1.0).astype(np.float64)
  q_BxK = np.clip(np.rint(x_BxK / safe_B[:, None]), -qmax, qmax)
  return q_BxK.reshape(-1)[:n].astype(np.int8), scale_B


def _sign_quantize(x_N: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
  """int1: (bits_N, 1 where x >= 0, as uint8; scales_B = mean |x| of each block, float32)."""
  n = x_N.size
  num_blocks = math.ceil(n / block_size)
  padded = np.zeros(num_blocks * block_size, np.float64)
  padded[:n] = np.abs(x_N)
  # The mean over the values a block really holds: the last one may be short.
  counts_B = np.full(num_blocks, block_size, np.float64)
  if num_blocks:
    counts_B[-1] = n - (num_blocks - 1) * block_size
  scale_B = (padded.reshape(num_blocks, block_size).sum(axis=1) / counts_B).astype(np.float32)
  return (x_N >= 0).astype(np.uint8), scale_B


def _dequantize(q_N: np.ndarray, scale_B: np.ndarray, block_size: int) -> np.ndarray:
  scale_N = np.repeat(scale_B, block_size)[: q_N.size]
  return q_N.astype(np.float32) * scale_N


def _pack_int2(q_N: np.ndarray) -> np.ndarray:
  """Four values in [-1, 1] per byte, stored with an offset of 1 as 2-bit codes (lowest bits
  first); a count that is not a multiple of 4 is padded with 0 values."""
  codes = (q_N.astype(np.int16) + 1).astype(np.uint8)
  codes = np.append(codes, np.full(-codes.size % 4, 1, np.uint8))
  return codes[0::4] | (codes[1::4] << 2) | (codes[2::4] << 4) | (codes[3::4] << 6)


def _unpack_int2(packed: np.ndarray, n: int) -> np.ndarray:
  codes = np.empty(4 * packed.size, np.uint8)
  for k in range(4):
    codes[k::4] = (packed >> (2 * k)) & 0x03
  return (codes[:n].astype(np.int16) - 1).astype(np.int8)


def _pack_int4(q_N: np.ndarray) -> np.ndarray:
  """Two values in [-7, 7] per byte, stored with an offset of 8 (low nibble first); an odd count is
  padded with a 0 value."""
  nibbles = (q_N.astype(np.int16) + 8).astype(np.uint8)
  if nibbles.size % 2:
    nibbles = np.append(nibbles, np.uint8(8))
  return nibbles[0::2] | (nibbles[1::2] << 4)


def _unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
  nibbles = np.empty(2 * packed.size, np.uint8)
  nibbles[0::2] = packed & 0x0F
  nibbles[1::2] = packed >> 4
  return (nibbles[:n].astype(np.int16) - 8).astype(np.int8)


def encode(x: np.ndarray, fmt: str, block_size: int) -> Encoded:
  """Encode one tensor (any float dtype, any shape including ()) in a wire format."""
  _check(fmt, block_size)
  x = np.asarray(x)
  shape = tuple(x.shape)
  # No copy for float32 input: encoded payloads and decoded values are never written in place.
  x_N = np.asarray(x, np.float32).reshape(-1)
  if fmt == "fp32":
    return Encoded(fmt, shape, (x_N,), block_size)
  if fmt == "bf16":
    return Encoded(fmt, shape, (x_N.astype(ml_dtypes.bfloat16),), block_size)
  if not np.all(np.isfinite(x_N)):
    # An inf would make its block's scale inf and every other value of the block 0 or NaN.
    raise ValueError(f"cannot encode non-finite values as {fmt}")
  if fmt == "int1":
    bits_N, scale_B = _sign_quantize(x_N, block_size)
    return Encoded(fmt, shape, (np.packbits(bits_N, bitorder="little"), scale_B), block_size)
  q_N, scale_B = _quantize(x_N, QMAX[fmt], block_size)
  pack = {"int8": lambda q: q, "int4": _pack_int4, "int2": _pack_int2}[fmt]
  return Encoded(fmt, shape, (pack(q_N), scale_B), block_size)


def decode(enc: Encoded) -> np.ndarray:
  """The float32 tensor an ``Encoded`` stands for."""
  _check(enc.fmt, enc.block_size)
  n = math.prod(enc.shape)
  if enc.fmt in ("fp32", "bf16"):
    x_N = np.asarray(enc.payload[0], np.float32)
  else:
    values, scale_B = enc.payload
    if enc.fmt == "int1":
      bits_N = np.unpackbits(values, count=n, bitorder="little")
      q_N = (2 * bits_N.astype(np.int8) - 1).astype(np.int8)  # 1 -> +1, 0 -> -1
    elif enc.fmt == "int2":
      q_N = _unpack_int2(values, n)
    else:
      q_N = values if enc.fmt == "int8" else _unpack_int4(values, n)
    x_N = _dequantize(q_N, scale_B, enc.block_size)
  return x_N.reshape(enc.shape)


def encode_tree(
    tree: Mapping[str, np.ndarray], fmt: str, block_size: int
) -> dict[str, Encoded]:
  """``encode`` every tensor of a flat dict."""
  return {name: encode(x, fmt, block_size) for name, x in tree.items()}


def decode_tree(encoded: Mapping[str, Encoded]) -> dict[str, np.ndarray]:
  """``decode`` every tensor of a flat dict."""
  return {name: decode(enc) for name, enc in encoded.items()}


def tree_nbytes(encoded: Mapping[str, Encoded]) -> int:
  """Total bytes that travel for an encoded flat dict."""
  return sum(enc.nbytes for enc in encoded.values())
