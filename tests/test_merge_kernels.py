"""algorithm/merge_kernels.py: the merge's loops give numpy's wire formats, bit for bit.

Each loop against `compression.encode` / `decode` on random tensors at random scales, sizes that
are not multiples of a block, every block size the loops meet (64, an odd one, one larger than a
chunk) and exact ties: values at (k + 1/2) steps of their block's scale.
"""

import ml_dtypes
import numpy as np
import pytest

from decoupled_diloco.algorithm import compression
from decoupled_diloco.algorithm import merge_kernels as kernels
from decoupled_diloco.runtime.core import fused_merge

QMAX = fused_merge.QMAX
SHAPES = [((300, 64), 64), ((33, 7), 7), ((5,), 64), ((40, 100), 1100)]


def _tensor(shape, seed):
  """Normal values at a random scale, and exact ties: values at (k + 1/2) steps of their block."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-12, 3)).astype(np.float32)
  flat = x.reshape(-1)
  if flat.size >= 128:
    step = np.float32(2.0 ** -10)  # the block's scale is 7.5 * step / 7 for int4: ties at k + 1/2
    flat[:64] = ((np.arange(64) % 15) - 7 + 0.5).astype(np.float32) * step
  return x


def _flat(x):
  return fused_merge._flat(x)  # pylint: disable=protected-access


def _prepare(values, anchor, fmt, block_size):
  """(wire, sums) of `kernels.prepare_*` as the fused merge calls it."""
  n, sums = values.size, np.zeros(2)
  if fmt == "fp32":
    wire = (np.empty(n, np.float32),)
    kernels.prepare_fp32(_flat(values), _flat(anchor), wire[0], sums)
  elif fmt == "bf16":
    wire = (np.empty(n, np.uint16),)
    kernels.prepare_bf16(_flat(values), _flat(anchor), wire[0], sums)
  else:
    k = -(-n // block_size)
    wire = (np.empty(k * block_size, np.int8), np.empty(k, np.float32))
    kernels.prepare_int(_flat(values), _flat(anchor), QMAX[fmt], *wire, sums)
  return wire, sums


def _codes(enc):
  packed, _ = enc.payload
  n = int(np.prod(enc.shape))
  return {"int8": lambda: packed, "int4": lambda: compression._unpack_int4(packed, n),  # pylint: disable=protected-access
          "int2": lambda: compression._unpack_int2(packed, n)}[enc.fmt]()  # pylint: disable=protected-access


@pytest.mark.parametrize("fmt", fused_merge.FORMATS)
@pytest.mark.parametrize("shape, block_size", SHAPES)
def test_the_screens_wire_is_the_numpy_encoders_bit_for_bit(fmt, shape, block_size):
  anchor = _tensor(shape, seed=1 + block_size)
  values = anchor + _tensor(shape, seed=2) * np.float32(1e-3)
  delta = anchor - values
  wire, (raw, dec) = _prepare(values, anchor, fmt, block_size)
  want = compression.encode(delta, fmt, block_size)
  n = delta.size
  if fmt in QMAX:
    np.testing.assert_array_equal(wire[0][:n], _codes(want))
    np.testing.assert_array_equal(wire[0][n:], 0)  # the last block's padding
    np.testing.assert_array_equal(wire[1], want.payload[1])
  elif fmt == "bf16":
    np.testing.assert_array_equal(wire[0], want.payload[0].view(np.uint16))
  else:
    np.testing.assert_array_equal(wire[0], want.payload[0])
  decoded = compression.decode(want).astype(np.float64)
  np.testing.assert_allclose(raw, np.sum(np.square(delta, dtype=np.float64)), rtol=1e-6)
  np.testing.assert_allclose(dec, np.sum(np.square(decoded)), rtol=1e-6)


def test_a_float32_quotient_that_rounds_onto_a_half_goes_through_float64():
  """x / s = 1.49999995 rounds to 1.5 in float32 (and then to 2); numpy's float64 says 1."""
  x = np.zeros(64, np.float32)
  x[0] = np.float32(0.034280803)  # the block's max: s = float32(x[0] / 127)
  x[1] = np.float32(0.00040489135)
  s = np.float32(np.float64(x[0]) / 127)
  assert np.rint(x[1] / s) == 2 and np.rint(np.float64(x[1]) / np.float64(s)) == 1
  wire, _ = _prepare(np.zeros_like(x), x, "int8", 64)
  np.testing.assert_array_equal(wire[0], compression.encode(x, "int8", 64).payload[0])
  assert wire[0][1] == 1


@pytest.mark.parametrize("fmt", ["bf16", "int4", "int8"])
def test_subnormal_values_are_encoded_as_numpy_encodes_them(fmt):
  """No flush to zero (numba compiles without a fast-math flag that would allow it). Their
  squares underflow float32's sums to 0, as they would any float32 sum: such a tensor (no
  training makes one) merges with a norm of 0, which adds nothing."""
  x = np.full(64, 3e-39, np.float32)
  x[::3] = -1e-40
  wire, _ = _prepare(np.zeros_like(x), x, fmt, 64)
  want = compression.encode(x, fmt, 64)
  if fmt == "bf16":
    np.testing.assert_array_equal(wire[0], want.payload[0].view(np.uint16))
  else:
    np.testing.assert_array_equal(wire[0], _codes(want))
    np.testing.assert_array_equal(wire[1], want.payload[1])


def test_bf16_rounding_is_ml_dtypes_at_the_edges():
  """Ties to even, the largest finite values rounding up to inf, infinities, NaN kept quiet."""
  edges = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.3895314e38, -3.4028235e38, np.inf,
                    -np.inf, np.nan, 0.0, -0.0, 1e-45], np.float32)
  wire, _ = _prepare(np.zeros_like(edges), edges, "bf16", 64)
  want = edges.astype(ml_dtypes.bfloat16).view(np.uint16)
  nan = np.isnan(edges)
  np.testing.assert_array_equal(wire[0][~nan], want[~nan])
  assert np.isnan(wire[0][nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()


def test_a_nan_in_a_block_makes_its_sums_nan():
  """The screen then calls the offer non-finite (`GlobalModel._screen_norm`)."""
  x = _tensor((256,), seed=5)
  x[70] = np.nan
  _, (raw, _) = _prepare(np.zeros_like(x), x, "int4", 64)
  assert np.isnan(raw)


@pytest.mark.parametrize("fmt", list(QMAX))
@pytest.mark.parametrize("shape, block_size", SHAPES)
def test_a_carried_payload_gives_numpys_values_and_sums(fmt, shape, block_size):
  """A Ray offer's encoded Delta_m: unpacked codes and the sums of squares of numpy's decoded
  values."""
  x = _tensor(shape, 3)
  enc = compression.encode(x, fmt, block_size)
  n = x.size
  k = -(-n // block_size)
  codes = np.full(k * block_size, 9, np.int8)
  if fmt == "int8":
    codes[:n] = enc.payload[0]
    codes[n:] = 0
  else:
    getattr(kernels, f"unpack_{fmt}")(_flat(enc.payload[0]), n, codes)
  np.testing.assert_array_equal(codes[:n], _codes(enc))
  np.testing.assert_array_equal(codes[n:], 0)
  dec = kernels.int_sumsq(_flat(codes), n, _flat(enc.payload[1]), block_size)
  want = compression.decode(enc).astype(np.float64)
  np.testing.assert_allclose(dec, np.sum(np.square(want)), rtol=1e-6)
  packed = np.empty_like(enc.payload[0])
  if fmt != "int8":
    getattr(kernels, f"pack_{fmt}")(_flat(codes), n, packed)
    np.testing.assert_array_equal(packed, enc.payload[0])


def test_bf16_sums_of_squares_are_those_of_the_values():
  x = _tensor((1000,), 6)
  bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
  np.testing.assert_allclose(
      kernels.bf16_sumsq(_flat(bits)),
      np.sum(np.square(bits.view(ml_dtypes.bfloat16).astype(np.float64))), rtol=1e-6)


# Coefficients: a group of four with a learner skipped (one pass each); four in one pass; four
# in one pass, a group with a skip, a last learner alone; nobody.
COEFFICIENTS = ([0.3, 0.0, 1.7, 0.9], [0.3, 1.1, 1.7, 0.9],
                [0.3, 1.1, 1.7, 0.9, 0.5, 0.0, 1.2, 0.8, 1.4], [0.0, 0.0])


@pytest.mark.parametrize("fmt", fused_merge.FORMATS)
@pytest.mark.parametrize("shape, block_size", SHAPES)
@pytest.mark.parametrize("coefficients", COEFFICIENTS, ids=lambda c: f"M{len(c)}-{c.count(0.0)}off")
def test_combine_adds_the_learners_in_order_as_float32(fmt, shape, block_size, coefficients):
  """Σ_m c_m decode(wire_m) from 0, one add per learner in learner order
  (`merge._sum_in_order`), a learner with c_m = 0 skipped; the sum of squares of the result."""
  n = int(np.prod(shape))
  c_M = np.array(coefficients, np.float32)
  wires, decoded = [], []
  for m in range(len(c_M)):
    x = _tensor(shape, 10 + m)
    wire, _ = _prepare(np.zeros_like(x), x, fmt, block_size)
    wires.append(tuple(_flat(w) for w in wire))
    decoded.append(compression.decode(compression.encode(x, fmt, block_size)).reshape(-1))
  want = np.zeros(n, np.float32)
  for c, x in zip(c_M, decoded):
    if c != 0:
      want = want + c * x
  out = np.empty(n, np.float32)
  if fmt in QMAX:
    sumsq = kernels.combine_int(tuple(w[0] for w in wires), tuple(w[1] for w in wires), c_M,
                                block_size, out)
  else:
    sumsq = kernels.combine_values(tuple(w[0] for w in wires), c_M, out)
  np.testing.assert_array_equal(out, want)
  np.testing.assert_allclose(sumsq, np.sum(np.square(want, dtype=np.float64)), rtol=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("shape, block_size", SHAPES)
def test_the_delta_broadcast_adds_up_as_the_learners_do(fmt, shape, block_size):
  """encode(Theta_new - R) is numpy's, and R + its decoded value is the learners' float32 sum
  (two roundings: no fused multiply-add)."""
  received = _tensor(shape, seed=3)
  theta = received + _tensor(shape, seed=4) * np.float32(1e-2)
  n = theta.size
  after = np.empty(n, np.float32)
  want = compression.encode(theta - received, fmt, block_size)
  if fmt in QMAX:
    k = -(-n // block_size)
    codes, scales = np.empty(k * block_size, np.int8), np.empty(k, np.float32)
    kernels.broadcast_int(_flat(theta), _flat(received), QMAX[fmt], codes, scales, after)
    np.testing.assert_array_equal(codes[:n], _codes(want))
    np.testing.assert_array_equal(scales, want.payload[1])
  else:
    bits = np.empty(n, np.uint16)
    kernels.broadcast_bf16(_flat(theta), _flat(received), bits, after)
    np.testing.assert_array_equal(bits, want.payload[0].view(np.uint16))
  np.testing.assert_array_equal(after, (received + compression.decode(want)).reshape(-1))
