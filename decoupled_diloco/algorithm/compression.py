"""Host-side wire formats for outer gradients and fragment values (spec §5).

Outer gradients may travel compressed: bf16 by default; int4 was reported nearly lossless, while
2-bit and 1-bit collapse, so those are not offered. ``Encoded.payload`` is exactly what would
travel; its byte count is what the bandwidth accounting charges. Shape and format are metadata every
side already knows (the fragment layout is fixed), so they are not counted.

Integer formats use symmetric per-block absmax scaling: the flattened tensor is cut into blocks of
``block_size`` consecutive values (the last block may be short), each block stores one float32 scale
s = max|x| / q_max and the values q = round(x / s) in [-q_max, q_max]; decoding gives q · s, so each
value is off by at most s / 2. A block of zeros has s = 0 and decodes to zeros exactly. Decoding
always produces float32: accumulation is done in fp32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np

FORMATS = ("fp32", "bf16", "int8", "int4")

# Largest magnitude of a quantised value. Symmetric ranges (no -128 / -8) keep 0 exact and the
# rounding error the same on both sides.
_QMAX = {"int8": 127, "int4": 7}


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A tensor in a wire format.

  Attributes:
    fmt: one of ``FORMATS``.
    shape: the original shape.
    payload: the arrays that travel: (values,) for fp32/bf16, (values, float32 scales) for
      int8/int4. int4 values are packed two per uint8.
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

  fp32: 4n; bf16: 2n; int8: n + 4·⌈n/B⌉; int4: ⌈n/2⌉ + 4·⌈n/B⌉ (B = block_size, 4 bytes per scale).
  """
  _check(fmt, block_size)
  if fmt == "fp32":
    return 4 * num_elements
  if fmt == "bf16":
    return 2 * num_elements
  scales = 4 * math.ceil(num_elements / block_size)
  if fmt == "int8":
    return num_elements + scales
  return math.ceil(num_elements / 2) + scales


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


def _dequantize(q_N: np.ndarray, scale_B: np.ndarray, block_size: int) -> np.ndarray:
  scale_N = np.repeat(scale_B, block_size)[: q_N.size]
  return q_N.astype(np.float32) * scale_N


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
  q_N, scale_B = _quantize(x_N, _QMAX[fmt], block_size)
  values = q_N if fmt == "int8" else _pack_int4(q_N)
  return Encoded(fmt, shape, (values, scale_B), block_size)


def decode(enc: Encoded) -> np.ndarray:
  """The float32 tensor an ``Encoded`` stands for."""
  _check(enc.fmt, enc.block_size)
  n = math.prod(enc.shape)
  if enc.fmt in ("fp32", "bf16"):
    x_N = np.asarray(enc.payload[0], np.float32)
  else:
    values, scale_B = enc.payload
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
