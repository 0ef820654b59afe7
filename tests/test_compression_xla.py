"""algorithm/compression_xla.py: the wire formats inside XLA are numpy's, bit for bit.

The programs are compiled here with XLA's full optimisation, as runs compile them: the suite's
--xla_backend_optimization_level=0 (tests/conftest.py) would not fuse a multiply into an add,
which is where float32 results of XLA:CPU and numpy part.
"""

import jax
import numpy as np
import pytest

from decoupled_diloco.algorithm import compression
from decoupled_diloco.algorithm import compression_xla as xla_codec
from decoupled_diloco.runtime.core import fused_merge

RUN_OPTIONS = {"xla_backend_optimization_level": 3}


def _compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile(compiler_options=RUN_OPTIONS)(*args)


def _divisors(fmt, x, block_size):
  return (xla_codec.divisors(fmt, x.size, block_size),) if fmt in xla_codec.QMAX else ()


def _tensor(shape, seed):
  """Normal values at a random scale, and exact ties: values at (k + 1/2) steps of their block."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-12, 3)).astype(np.float32)
  flat = x.reshape(-1)
  if flat.size >= 128:
    step = np.float32(2.0 ** -10)  # the block's scale is 7.5 * step / 7 for int4: ties at k + 1/2
    flat[:64] = ((np.arange(64) % 15) - 7 + 0.5).astype(np.float32) * step
  return x


@pytest.mark.parametrize("fmt", xla_codec.FORMATS)
@pytest.mark.parametrize("shape, block_size", [((300, 64), 64), ((33, 7), 7), ((), 64)])
def test_payload_is_the_numpy_encoders_bit_for_bit(fmt, shape, block_size):
  x = _tensor(shape, seed=len(fmt) + block_size)
  arrays, decoded, exact = _compiled(
      lambda x, *q: xla_codec.payload(x, fmt, block_size, *q), x, *_divisors(fmt, x, block_size))
  assert bool(exact)
  want = compression.encode(x, fmt, block_size)
  got = xla_codec.encoded(arrays, fmt, x.shape, block_size)
  for a, b in zip(got.payload, want.payload, strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(decoded), compression.decode(want))


def test_a_float32_quotient_that_rounds_onto_a_half_is_corrected():
  """x / s = 1.49999995 rounds to 1.5 in float32 (and then to 2); numpy's float64 says 1."""
  x = np.zeros(64, np.float32)
  x[0] = np.float32(0.034280803)  # the block's max: s = float32(x[0] / 127)
  x[1] = np.float32(0.00040489135)
  s = np.float32(np.float64(x[0]) / 127)
  assert np.rint(x[1] / s) == 2 and np.rint(np.float64(x[1]) / np.float64(s)) == 1
  arrays, _, _ = _compiled(lambda x, q: xla_codec.payload(x, "int8", 64, q), x,
                           xla_codec.divisors("int8", 64, 64))
  np.testing.assert_array_equal(arrays[0], compression.encode(x, "int8", 64).payload[0])
  assert arrays[0][1] == 1


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_values_near_subnormals_are_left_to_numpy(fmt):
  x = np.full(64, 3e-39, np.float32)  # XLA:CPU flushes these to zero
  _, _, exact = _compiled(lambda x, *q: xla_codec.payload(x, fmt, 64, *q), x,
                          *_divisors(fmt, x, 64))
  assert not bool(exact)


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_the_fused_screen_sends_the_numpy_encoders_wire(fmt):
  anchor = _tensor((256, 64), seed=1)
  values = anchor + _tensor((256, 64), seed=2) * np.float32(1e-3)
  wire, raw_sq, _, exact = _compiled(fused_merge._prepare_fn(fmt, 64), values, anchor,
                                     *_divisors(fmt, anchor, 64))
  assert bool(exact)
  delta = anchor - values
  want = compression.encode(delta, fmt, 64)
  if fmt in xla_codec.QMAX:
    np.testing.assert_array_equal(xla_codec.encoded(
        (xla_codec.pack(np.asarray(wire[0]).reshape(-1), fmt), wire[1]), fmt, delta.shape,
        64).payload[0], want.payload[0])
    np.testing.assert_array_equal(wire[1], want.payload[1])
  else:
    np.testing.assert_array_equal(np.asarray(wire[0]).reshape(-1).view(np.uint16),
                                  want.payload[0].view(np.uint16))
  np.testing.assert_allclose(np.sum(np.asarray(raw_sq, np.float64)),
                             np.sum(np.square(delta, dtype=np.float64)), rtol=1e-6)


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_the_delta_broadcast_adds_up_as_the_learners_do(fmt):
  """R_p + decode(delta), float32 as numpy adds it on the learners: no fused multiply-add."""
  received = _tensor((256, 64), seed=3)
  theta = received + _tensor((256, 64), seed=4) * np.float32(1e-2)
  divisors = _divisors(fmt, theta, 64)
  wire = _compiled(fused_merge._prepare_fn(fmt, 64), received, theta, *divisors)[0]
  arrays, new_received = _compiled(fused_merge._finish_broadcast_fn(fmt, theta.shape), wire,
                                   received, np.int32(0))
  sent = xla_codec.encoded(arrays, fmt, theta.shape, 64)
  np.testing.assert_array_equal(sent.payload[0].view(np.uint8),
                                compression.encode(theta - received, fmt, 64).payload[0].view(
                                    np.uint8))
  np.testing.assert_array_equal(new_received, received + compression.decode(sent))


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
@pytest.mark.parametrize("shape", [(300, 64), (33, 7)])
def test_a_carried_payload_unwires_to_what_numpy_decodes(fmt, shape):
  """A Ray offer's encoded Delta_m enters the fused merge as its codes and scales (`_unwire_fn`):
  they decode to numpy's values, bit for bit, with numpy's sums of squares."""
  x = _tensor(shape, 3)
  enc = compression.encode(x, fmt, 64)
  (q_KxB, scale_K), dec_sq, exact = _compiled(fused_merge._unwire_fn(fmt, shape, 64),
                                              *enc.payload)
  decoded = np.asarray(xla_codec.decode_blocks(q_KxB, scale_K)).reshape(-1)[:x.size]
  want = compression.decode(enc).reshape(-1)
  assert bool(exact)
  np.testing.assert_array_equal(decoded, want)
  np.testing.assert_allclose(np.sum(np.asarray(dec_sq, np.float64)),
                             np.sum(np.square(want, dtype=np.float64)), rtol=1e-6)
