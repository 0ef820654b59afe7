"""Tests for algorithm.compression: wire formats of outer gradients (docs/design.md §5)."""

import math

import ml_dtypes
import numpy as np
import pytest

from decoupled_diloco.algorithm import compression as comp


def _random(shape, seed=0, scale=1.0):
  # Magnitudes over several decades, as in real outer gradients.
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape)) * scale
  return x.astype(np.float32)


def _block_scales(x, qmax, block_size):
  """Expected scale of each block, computed directly: max |x| over the block / q_max."""
  flat = x.reshape(-1).astype(np.float64)
  return np.array(
      [np.abs(flat[i : i + block_size]).max() / qmax for i in range(0, flat.size, block_size)]
  )


def test_fp32_round_trip_is_exact():
  x = _random((7, 13))
  y = comp.decode(comp.encode(x, "fp32", 64))
  assert y.dtype == np.float32 and y.shape == x.shape
  np.testing.assert_array_equal(y, x)


def test_bf16_relative_error_is_at_most_2_to_the_minus_8():
  # bfloat16 keeps 8 significant bits: round to nearest is within half an ulp, 2^-8 relative.
  x = _random((1000,), seed=1)
  y = comp.decode(comp.encode(x, "bf16", 64))
  assert y.dtype == np.float32
  assert np.all(np.abs(y - x) <= 2.0**-8 * np.abs(x))
  assert not np.array_equal(y, x)  # it did round


@pytest.mark.parametrize("fmt, qmax", [("int8", 127), ("int4", 7), ("int2", 1)])
@pytest.mark.parametrize("block_size", [1, 7, 64, 1000])
def test_int_error_is_at_most_half_a_step_of_each_block(fmt, qmax, block_size):
  x = _random((10, 101), seed=2)
  enc = comp.encode(x, fmt, block_size)
  y = comp.decode(enc)
  assert y.dtype == np.float32 and y.shape == x.shape
  scale_B = _block_scales(x, qmax, block_size)
  # The scales travel as float32.
  np.testing.assert_allclose(enc.payload[1], scale_B, rtol=1e-6)
  scale_N = np.repeat(scale_B, block_size)[: x.size].reshape(x.shape)
  # Half a quantisation step, plus float32 rounding of the decoded product.
  err = np.abs(y.astype(np.float64) - x)
  assert np.all(err <= scale_N / 2 * (1 + 1e-6) + 1e-6 * np.abs(x))


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
def test_int_keeps_the_largest_value_of_each_block(fmt):
  # The absmax of a block is q_max · scale: it decodes to itself up to float32 rounding.
  x = _random((256,), seed=3)
  y = comp.decode(comp.encode(x, fmt, 64))
  for i in range(0, 256, 64):
    j = i + np.argmax(np.abs(x[i : i + 64]))
    assert y[j] == pytest.approx(x[j], rel=1e-6)


@pytest.mark.parametrize("fmt", comp.FORMATS)
@pytest.mark.parametrize("shape", [(), (1,), (3, 5, 7), (65,), (0,)])
def test_zeros_round_trip_to_zeros_exactly(fmt, shape):
  x = np.zeros(shape, np.float32)
  y = comp.decode(comp.encode(x, fmt, 64))
  assert y.shape == shape and y.dtype == np.float32
  np.testing.assert_array_equal(y, x)


def test_a_zero_block_stays_zero_next_to_a_large_block():
  x = np.concatenate([np.zeros(64), np.full(64, 1e4)]).astype(np.float32)
  y = comp.decode(comp.encode(x, "int4", 64))
  np.testing.assert_array_equal(y[:64], 0.0)
  np.testing.assert_allclose(y[64:], 1e4, rtol=1e-6)


@pytest.mark.parametrize(
    "num_elements, fmt, block_size, expected",
    [
        (1000, "fp32", 64, 4000),  # 4 bytes a value
        (1000, "bf16", 64, 2000),  # 2 bytes a value
        (1000, "int8", 64, 1064),  # 1000 values + ⌈1000/64⌉ = 16 scales · 4 bytes
        (1000, "int4", 64, 564),  # 500 bytes of packed pairs + 16 scales · 4 bytes
        (1001, "int4", 64, 565),  # an odd count pads half a byte: 501 + 64
        (1, "int4", 64, 5),  # a scalar: 1 byte + 1 scale
        (7, "int8", 2, 23),  # 7 + ⌈7/2⌉ = 4 scales · 4 bytes
        (0, "int4", 64, 0),
        (1000, "int2", 64, 314),  # 250 bytes of packed quads + 16 scales · 4 bytes
        (1001, "int2", 64, 315),  # 1001 values need 251 bytes
        (1000, "int1", 64, 189),  # 125 bytes of packed bits + 16 scales · 4 bytes
        (1001, "int1", 64, 190),  # 1001 bits need 126 bytes
        (9, "int1", 4, 14),  # 2 bytes of bits + 3 scales
        (1, "int2", 64, 5),
        (0, "int1", 64, 0),
    ],
)
def test_nbytes_by_hand(num_elements, fmt, block_size, expected):
  assert comp.encoded_nbytes(num_elements, fmt, block_size) == expected
  enc = comp.encode(_random((num_elements,)), fmt, block_size)
  assert enc.nbytes == expected


@pytest.mark.parametrize("fmt", comp.FORMATS)
@pytest.mark.parametrize("shape", [(), (1,), (2,), (3, 5, 7), (63,), (64,), (129,), (4, 64)])
@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_nbytes_matches_the_analytic_count(fmt, shape, block_size):
  enc = comp.encode(_random(shape, seed=4), fmt, block_size)
  assert enc.nbytes == comp.encoded_nbytes(math.prod(shape), fmt, block_size)
  assert enc.nbytes == sum(a.nbytes for a in enc.payload)


@pytest.mark.parametrize("fmt", comp.FORMATS)
@pytest.mark.parametrize("shape", [(), (3, 5, 7), (1, 1, 1)])
def test_odd_sizes_and_scalars_keep_their_shape(fmt, shape):
  x = _random(shape, seed=5)
  y = comp.decode(comp.encode(x, fmt, 4))
  assert y.shape == shape
  # Every format keeps the sign of the largest value; all but int1 (which keeps the block's mean
  # magnitude instead) its value too.
  j = np.unravel_index(np.argmax(np.abs(x)), shape) if shape else ()
  assert np.sign(y[j]) == np.sign(x[j])
  if fmt != "int1":
    assert y[j] == pytest.approx(x[j], rel=2.0**-8)


def test_int4_packs_two_offset_values_per_byte():
  # x = [7, -7, 0] in one block: scale 1, q = [7, -7, 0], stored +8 as nibbles [15, 1, 8] plus a
  # padding 8; low nibble first: bytes [15 | 1 << 4, 8 | 8 << 4] = [31, 136].
  enc = comp.encode(np.array([7.0, -7.0, 0.0], np.float32), "int4", 64)
  np.testing.assert_array_equal(enc.payload[0], np.array([31, 136], np.uint8))
  np.testing.assert_array_equal(enc.payload[1], np.array([1.0], np.float32))
  np.testing.assert_array_equal(comp.decode(enc), [7.0, -7.0, 0.0])


def test_int2_packs_four_ternary_codes_per_byte():
  # x = [2, -2, 0, 0.9, -1.1] in one block: scale 2, q = [1, -1, 0, 0, -1] (0.45 and -0.55 round
  # to 0 and -1), stored +1 as codes [2, 0, 1, 1, 0] plus 3 padding 1s; lowest bits first:
  # bytes [2 | 0 << 2 | 1 << 4 | 1 << 6, 0 | 1 << 2 | 1 << 4 | 1 << 6] = [82, 84].
  enc = comp.encode(np.array([2.0, -2.0, 0.0, 0.9, -1.1], np.float32), "int2", 64)
  np.testing.assert_array_equal(enc.payload[0], np.array([82, 84], np.uint8))
  np.testing.assert_array_equal(enc.payload[1], np.array([2.0], np.float32))
  np.testing.assert_array_equal(comp.decode(enc), [2.0, -2.0, 0.0, 0.0, -2.0])


def test_int2_is_ternary():
  y = comp.decode(comp.encode(_random((1000,), seed=9), "int2", 64))
  for i in range(0, 1000, 64):
    assert len(set(np.abs(y[i : i + 64]).tolist()) - {0.0}) == 1  # {-s, 0, +s}
  assert np.count_nonzero(y == 0) > 0


def test_int1_packs_eight_sign_bits_per_byte_lowest_first():
  # Nine values, one block: bits (x >= 0; 0 counts as +) [1, 0, 1, 1, 0, 0, 0, 1 | 0] -> bytes
  # [1 + 4 + 8 + 128, 0] = [141, 0]; scale = mean |x| = 18.5 / 9.
  x = np.array([1.0, -2.0, 3.0, 0.0, -4.0, -1.0, -2.0, 5.0, -0.5], np.float32)
  enc = comp.encode(x, "int1", 64)
  np.testing.assert_array_equal(enc.payload[0], np.array([141, 0], np.uint8))
  assert enc.payload[1].tolist() == [pytest.approx(18.5 / 9)]
  s = np.float32(18.5 / 9)
  np.testing.assert_array_equal(comp.decode(enc), np.where(x >= 0, s, -s))


@pytest.mark.parametrize("block_size", [1, 7, 64, 1000])
def test_int1_keeps_every_sign_and_each_blocks_l1_mass(block_size):
  x = _random((10, 101), seed=10)
  y = comp.decode(comp.encode(x, "int1", block_size)).reshape(-1)
  flat = x.reshape(-1)
  assert np.all(np.sign(y[flat != 0]) == np.sign(flat[flat != 0]))
  for i in range(0, flat.size, block_size):
    block, decoded = flat[i : i + block_size], y[i : i + block_size]
    # One magnitude per block, and the block's sum of |x| kept (float32 rounding of the mean).
    assert len(set(np.abs(decoded).tolist())) == 1
    assert np.abs(decoded).sum() == pytest.approx(np.abs(block.astype(np.float64)).sum(),
                                                  rel=1e-5)


def test_int1_of_a_constant_magnitude_block_is_exact():
  x = np.array([0.25, -0.25, -0.25, 0.25, 0.25], np.float32)
  np.testing.assert_array_equal(comp.decode(comp.encode(x, "int1", 3)), x)


@pytest.mark.parametrize("fmt", ["int2", "int1"])
@pytest.mark.parametrize("n", [1, 3, 5, 7, 8, 9, 15, 17, 63, 65])
def test_low_bit_packing_round_trips_odd_sizes(fmt, n):
  # Values that each format represents exactly: packing and unpacking must give them back for
  # every count, whatever the padding of the last byte.
  rng = np.random.default_rng(n)
  if fmt == "int2":
    x = rng.integers(-1, 2, n).astype(np.float32) * 0.5
    x[0] = 0.5  # the block's absmax is the scale
  else:
    x = np.where(rng.integers(0, 2, n) > 0, 0.5, -0.5).astype(np.float32)
  enc = comp.encode(x, fmt, 64)
  assert enc.payload[0].size == math.ceil(n / (4 if fmt == "int2" else 8))
  np.testing.assert_array_equal(comp.decode(enc), x)


def test_int8_values_stay_in_the_symmetric_range():
  enc = comp.encode(_random((1000,), seed=6), "int8", 64)
  assert enc.payload[0].dtype == np.int8
  assert enc.payload[0].min() >= -127 and enc.payload[0].max() <= 127


def test_tree_round_trip():
  tree = {"layers/0/kernel": _random((4, 8), seed=7), "final_norm/scale": _random((8,), seed=8)}
  encoded = comp.encode_tree(tree, "bf16", 64)
  assert comp.tree_nbytes(encoded) == 2 * (32 + 8)
  decoded = comp.decode_tree(encoded)
  assert set(decoded) == set(tree)
  for name, x in tree.items():
    np.testing.assert_allclose(decoded[name], x, rtol=2.0**-8)


def test_bf16_input_is_accepted():
  x = np.array([1.5, -2.0], ml_dtypes.bfloat16)
  np.testing.assert_array_equal(comp.decode(comp.encode(x, "fp32", 64)), [1.5, -2.0])
  # int8: scale 2/127; 1.5 / scale = 95.25 rounds to 95, which decodes to 190/127.
  np.testing.assert_allclose(comp.decode(comp.encode(x, "int8", 64)), [190 / 127, -2.0],
                             rtol=1e-6)


def test_non_finite_values_are_refused_by_int_formats():
  with pytest.raises(ValueError, match="non-finite"):
    comp.encode(np.array([1.0, np.inf], np.float32), "int4", 64)


def test_bad_settings_name_the_config_field():
  with pytest.raises(ValueError, match=r"'int3'.*config\.compression\.outer_grad.*'int4'"):
    comp.encode(np.zeros(3), "int3", 64)
  with pytest.raises(ValueError, match=r"'fp32', 'bf16', 'int8', 'int4', 'int2', 'int1'"):
    comp.encoded_nbytes(3, "fp8", 64)
  for block_size in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match=r"config\.compression\.block_size"):
      comp.encode(np.zeros(3), "int8", block_size)
