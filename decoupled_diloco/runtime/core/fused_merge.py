"""The syncer's merge of one fragment as a few jitted programs per tensor shape, no host round trip.

Issue 41 measured the merge before this one (`GlobalModel(fused=False)`, still the reference) at
3-15x a plain numpy pass over the same buffers: numpy encoded and decoded every outer gradient (a
dozen passes, several in float64), the screen took a float64 norm in another pass, and the merge
program read a stacked copy. Here, per tensor of fragment p:

1. `prepare` (per offer, screen and decode): Delta_m = anchor - theta_m, its wire round trip
   (`algorithm/compression_xla.py`, the numpy encoder's values bit for bit) and the sums of squares
   of the raw Delta_m (the robust screen's norm) and of the decoded one (RDA's norm), in two passes
   over the offer: one for the block scales and sums, one for the values. What it keeps is the wire
   itself (int8 codes and scales, bf16, or fp32), not a float32 copy.
2. `step` (merge and outer step, once the screen has judged every offer): the weights and RDA's
   direction or the weighted average from the decoded wires and their norms (`merge.rda_direction`,
   `average_from_parts`), then RDA's normalisation and the optax outer step, two programs; absent
   learners' slots hold zeros of weight 0, so one pair per shape serves any set of learners.
3. `broadcast` (delta broadcasts only): encode(Theta_p_new - R_p) and R_p + its decoded value.

Programs are compiled per (tensor shape, format) on the syncer's device, ahead of time by
`compile` and cached: their number does not grow with the model's depth.

XLA:CPU runs each of these programs on one thread, compute-bound at about a third of what numpy
reads in a second (issue 41). The programs of different tensors and offers are independent, and a
call releases the GIL while XLA runs it: `threads` (default 2) worker threads each take the next
(offer, tensor) or tensor, largest first, and run its programs to the end. Which thread ran a
program changes nothing in its result, so the merge is bit for bit the same with any number.

Theta_p and its outer state are not donated: a merge computes the next Theta_p without changing
the current one, which a checkpoint, an evaluation or a joining learner may be reading meanwhile
(`GlobalModel.install` makes the new one current). Formats without a jnp encoder (int1), and
tensors `compression_xla` flags near subnormals, go through numpy's encoder and travel on as fp32.
An offer that arrives encoded (Ray, `Offer.for_the_wire`) skips step 1's encoding: its bf16 or int
payload is unpacked into the same wire by `_unwire_fn`, with the sums of squares of its values.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from decoupled_diloco.algorithm import compression as compression_lib
from decoupled_diloco.algorithm import compression_xla as xla_codec
from decoupled_diloco.algorithm import merge as merge_lib
from decoupled_diloco.algorithm import outer
from decoupled_diloco.runtime.core import messages

# The block layout of the sums of squares for formats without blocks of their own (fp32, bf16).
_SUM_BLOCK = 64
_ZERO = np.int32(0)  # `compression_xla.rounded_apart`'s argument


@dataclasses.dataclass(frozen=True)
class PreparedOffer:
  """One offer's outer gradients through the wire, on the syncer's device, with their norms."""

  wires: dict[str, tuple[Any, ...]]  # per tensor, what `step` decodes (`_decode`)
  formats: dict[str, str]  # per tensor, the wire's format (fp32 where numpy encoded it)
  raw_sumsq: float  # Σ Delta_m² over the fragment, float32 per block, float64 over the blocks
  norms: dict[str, float]  # per tensor ‖decode(encode(Delta_m))‖: RDA's lengths
  seconds: float  # wall seconds of this offer's part of `prepare`


def _sum_blocks(sq_K) -> float:
  return float(np.sum(np.asarray(sq_K, np.float64)))


def _prepare_fn(fmt: str, block_size: int):
  """Delta = anchor - values, its wire and sums of squares (see the module docstring, step 1)."""

  def prepare(values, anchor, *qmax_K):
    delta = anchor.astype(jnp.float32) - values.astype(jnp.float32)  # Offer.outer_gradient
    if fmt == "fp32":
      _, raw_sq = xla_codec.block_absmax_and_sumsq(xla_codec.blocks(delta, _SUM_BLOCK))
      return (delta,), raw_sq, raw_sq, jnp.bool_(True)
    if fmt == "bf16":
      x_KxB = xla_codec.blocks(delta, _SUM_BLOCK)
      raw_sq, dec_sq, tiny = _bf16_sums(x_KxB)
      return (delta.astype(jnp.bfloat16),), raw_sq, dec_sq, tiny == 0
    x_KxB = xla_codec.blocks(delta, block_size)
    absmax_K, raw_sq = xla_codec.block_absmax_and_sumsq(x_KxB)
    scale_K = xla_codec.block_scales(absmax_K, *qmax_K)
    q_KxB = xla_codec.quantize(x_KxB, scale_K, xla_codec.QMAX[fmt])
    # The decoded sums of squares come from `_decoded_sumsq_fn`, a program of their own: in this
    # one XLA fuses the quantisation into that reduction too and computes it twice.
    return (q_KxB, scale_K), raw_sq, None, xla_codec.clear_of_subnormals(absmax_K)

  return prepare


def _tensor_size(offer: messages.Offer, name: str) -> int:
  """Values in one tensor of an offer, whether it carries them or their encoding."""
  if offer.encoded is not None and name in offer.encoded:
    return math.prod(offer.encoded[name].shape)
  return int(np.size(offer.values[name]))


def _decoded_sumsq_fn():
  """Per block, Σ (q s)² = s² Σ q² of an int wire (exact integer sums of the codes)."""

  def decoded_sumsq(q_KxB, scale_K):
    # Exact in float32: a block's sum of squares of codes is at most 64 * 127^2 < 2^24.
    return jnp.square(scale_K) * xla_codec.block_sums(jnp.square(q_KxB.astype(jnp.float32)))

  return decoded_sumsq


def _unwire_fn(fmt: str, shape, block_size: int):
  """A carried offer's payload (`compression.encode`'s arrays) as the wire `_prepare_fn` makes
  (int codes in [K, block_size] blocks, or bf16 in the tensor's shape), with the sums of squares
  per block of its decoded values and whether every block is clear of subnormals (XLA:CPU
  flushes them, numpy's decoder does not)."""
  n = math.prod(shape)

  def unwire(*payload):
    if fmt == "bf16":
      wire_N = payload[0]
      # float32 bits are bfloat16's followed by 16 zeros: a shift, not XLA's slower convert.
      high = lax.bitcast_convert_type(wire_N, jnp.uint16).astype(jnp.uint32) << np.uint32(16)
      x_KxB = xla_codec.blocks(lax.bitcast_convert_type(high, jnp.float32), _SUM_BLOCK)
      bits = lax.bitcast_convert_type(x_KxB, jnp.int32) & np.int32(0x7FFFFFFF)
      subnormal = jnp.where(bits < np.int32(1 << 23), bits, 0)  # its bits, else 0
      largest, dec_sq = xla_codec.block_max_and_sumsq(subnormal, x_KxB)
      return (wire_N.reshape(shape),), dec_sq, jnp.max(largest) == 0
    packed, scale_K = payload
    k = scale_K.shape[0]
    q_N = xla_codec.unpack(packed, fmt, n)
    q_KxB = jnp.pad(q_N, (0, k * block_size - n)).reshape(k, block_size)
    dec_sq = _decoded_sumsq_fn()(q_KxB, scale_K)
    # A block whose scale is below 2^-100 goes through numpy: its q s may be subnormal.
    return (q_KxB, scale_K), dec_sq, xla_codec.clear_of_subnormals(scale_K)

  return unwire


def _bf16_sums(x_KxB):
  """Per block: Σ x², Σ bf16(x)², and how many values lie in (0, 2^-126) (XLA:CPU flushes those,
  ml_dtypes keeps them: such a tensor is encoded by numpy)."""
  bits = lax.bitcast_convert_type(x_KxB, jnp.int32) & np.int32(0x7FFFFFFF)
  tiny = ((bits > 0) & (bits < np.int32(1 << 23))).astype(jnp.int32)
  operands = (jnp.square(x_KxB), jnp.square(xla_codec.round_bf16(x_KxB)), tiny)
  zeros = (np.float32(0), np.float32(0), np.int32(0))
  add = lambda a, b: tuple(u + v for u, v in zip(a, b))
  k, b = x_KxB.shape
  shaped = tuple(o.reshape(k, b // 16, 16) for o in operands)
  sums = lax.reduce(lax.reduce(shaped, zeros, add, (1,)), zeros, add, (1,))
  return sums[0], sums[1], jnp.sum(sums[2])


def _layout(fmt: str, shape, block_size: int):
  """The shape the merge step computes a tensor in: its int wires' blocks where they cover it
  exactly (Theta and the momentum are viewed alike, at no cost), else its own. One shape for
  every operand spares XLA an index computation per value."""
  n = math.prod(shape)
  if fmt in xla_codec.QMAX and n % block_size == 0:
    return (n // block_size, block_size)
  return tuple(shape)


def _decode(wire, fmt: str, shape):
  """A wire's float32 values in `shape` (`_layout`'s or the tensor's own)."""
  if fmt in xla_codec.QMAX:
    q_KxB, scale_K = wire
    decoded = xla_codec.decode_blocks(q_KxB, scale_K)
    if decoded.shape == tuple(shape):
      return decoded
    return decoded.reshape(-1)[:math.prod(shape)].reshape(shape)
  return wire[0].astype(jnp.float32).reshape(shape)


def _combine_fn(rule: str, weighting: str, fmt: str, layout, average: bool, scaled: bool):
  """The weights and the merged direction of one tensor (module docstring, step 2): RDA's
  Σ (w / ‖Δ‖) Δ and its radius, or the weighted average itself (radius 0, unused)."""

  def combine(wires, tokens_M, steps_M, norms_M, scale_M):
    w_M = merge_lib.learner_weights(tokens_M, steps_M, weighting)
    x_M = [_decode(wire, fmt, layout) for wire in wires]
    scale_M = scale_M if scaled else None
    if average or rule == "average":
      return merge_lib.average_from_parts(x_M, w_M, scale_M), jnp.float32(0), w_M
    direction, radius = merge_lib.rda_direction(x_M, w_M, norms_M, scale_M)
    return direction, radius, w_M

  return combine


def _outer_fn(tx: optax.GradientTransformation, rda: bool):
  """RDA's last normalisation and the optax outer step, in the direction's layout. A program of
  its own: fused with `_combine_fn`, XLA would decode every learner twice (for the norm of the
  direction, then for the step)."""

  def step(theta, opt_state, direction, radius):
    as_layout = lambda a: a.reshape(direction.shape) if a.shape == theta.shape else a
    delta = merge_lib.rda_finish(direction, radius) if rda else direction
    new_theta, new_state = outer.outer_step(tx, theta.reshape(direction.shape),
                                            jax.tree.map(as_layout, opt_state), delta)
    back = lambda a: a.reshape(theta.shape) if a.shape == direction.shape else a
    return new_theta.reshape(theta.shape), jax.tree.map(back, new_state)

  return step


def _finish_broadcast_fn(fmt: str, shape):
  """The delta's payload as it travels and R + its decoded value (module docstring, step 3),
  from its wire as `_prepare_fn` made it with Theta_new in the anchor's place and R in the
  values': Delta = Theta_new - R."""

  def finish(wire, received, zero):
    # R + decoded exactly as the learners add them in numpy (two roundings, no fused add).
    decoded = xla_codec.rounded_apart(_decode(wire, fmt, shape), zero)
    if fmt in xla_codec.QMAX:
      q_KxB, scale_K = wire
      arrays = (xla_codec.pack(q_KxB.reshape(-1)[:math.prod(shape)], fmt), scale_K)
    else:
      arrays = (jnp.ravel(wire[0]),)
    return arrays, received + decoded

  return finish


class FusedMerge:
  """Compiles, caches and runs the three programs on the syncer's one device."""

  def __init__(self, *, sharding: jax.sharding.Sharding, tx: optax.GradientTransformation,
               rule: str, weighting: str, outer_grad: str, broadcast_delta: str,
               block_size: int, num_slots: int, scaled: bool, threads: int = 2):
    """`num_slots`: learner slots of a merge (`config.num_learners`); `scaled`: whether offers
    carry a staleness scale (`config.outer.staleness_scaling` other than "none"); `threads`: the
    worker threads that run the programs (at most the host's cores; 1 runs them in the caller)."""
    if threads < 1:
      raise ValueError(f"threads={threads} must be at least 1")
    self._sharding = sharding
    self._tx = tx
    self._rule, self._weighting = rule, weighting
    self._outer_grad = outer_grad
    self._fmt = outer_grad if outer_grad in xla_codec.FORMATS else None
    self._delta_fmt = broadcast_delta if broadcast_delta in xla_codec.FORMATS else None
    self._block_size = block_size
    self._num_slots = num_slots
    self._scaled = scaled
    self._lock = threading.RLock()
    self._programs: dict[tuple[Any, ...], Any] = {}
    self._zero_wires: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    self.threads = min(threads, os.cpu_count() or 1)
    self._pool = (concurrent.futures.ThreadPoolExecutor(self.threads,
                                                        thread_name_prefix="fused-merge")
                  if self.threads > 1 else None)

  def _map(self, fn, items, size):
    """[fn(item) for item in items], run on the worker threads largest `size(item)` first (a
    longest-first queue balances them), the results in the order of `items`."""
    if self._pool is None or len(items) < 2:
      return [fn(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: -size(items[i]))
    futures = {i: self._pool.submit(fn, items[i]) for i in order}
    return [futures[i].result() for i in range(len(items))]

  # ---- programs ----------------------------------------------------------------------------------

  def _compiled(self, key, build, *example):
    with self._lock:
      program = self._programs.get(key)
      if program is None:
        jitted = jax.jit(build(), in_shardings=self._sharding, out_shardings=self._sharding)
        program = self._programs[key] = jitted.lower(*example).compile()
      return program

  def _wire_format(self, fmt: str | None) -> str:
    return fmt or "fp32"  # numpy-encoded wires travel on decoded, as fp32

  def _divisors(self, fmt: str, shape) -> tuple[Any, ...]:
    """The int formats' q_max per block (`compression_xla.divisors`) on the device; () else."""
    if fmt not in xla_codec.QMAX:
      return ()
    key = ("divisors", fmt, shape)
    with self._lock:
      if key not in self._zero_wires:
        divisors = xla_codec.divisors(fmt, math.prod(shape), self._block_size)
        self._zero_wires[key] = (jax.device_put(divisors, self._sharding),)
      return self._zero_wires[key]

  def _prepare_program(self, shape, fmt: str):
    example = jax.ShapeDtypeStruct(shape, np.float32)
    return self._compiled(("prepare", shape, fmt), lambda: _prepare_fn(fmt, self._block_size),
                          example, example, *self._divisors(fmt, shape))

  def _decoded_sumsq_program(self, shape):
    k = xla_codec.num_blocks(math.prod(shape), self._block_size)
    return self._compiled(("decoded_sumsq", k), _decoded_sumsq_fn,
                          jax.ShapeDtypeStruct((k, self._block_size), np.int8),
                          jax.ShapeDtypeStruct((k,), np.float32))

  def _zero_wire(self, shape, fmt: str):
    key = (shape, fmt)
    with self._lock:
      return self._zero_wire_locked(key, shape, fmt)

  def _zero_wire_locked(self, key, shape, fmt: str):
    if key not in self._zero_wires:
      if fmt in xla_codec.QMAX:
        k = xla_codec.num_blocks(math.prod(shape), self._block_size)
        zeros = (np.zeros((k, self._block_size), np.int8), np.zeros(k, np.float32))
      else:
        zeros = (np.zeros(shape, jnp.bfloat16 if fmt == "bf16" else np.float32),)
      self._zero_wires[key] = tuple(jax.device_put(z, self._sharding) for z in zeros)
    return self._zero_wires[key]

  def _step_programs(self, theta, opt_state, fmt: str, average: bool):
    """(combine, outer) of one tensor (`_combine_fn`, `_outer_fn`)."""
    shape = theta.shape
    layout = _layout(fmt, shape, self._block_size)
    rda = not (average or self._rule == "average")
    wires = (self._zero_wire(shape, fmt),) * self._num_slots
    counters = jax.ShapeDtypeStruct((self._num_slots,), np.float32)
    combine = self._compiled(
        ("combine", shape, fmt, rda),
        lambda: _combine_fn(self._rule, self._weighting, fmt, layout, not rda, self._scaled),
        wires, counters, counters, counters, counters)
    direction = jax.ShapeDtypeStruct(layout, np.float32)
    outer_step = self._compiled(("outer", shape, layout, rda), lambda: _outer_fn(self._tx, rda),
                                theta, opt_state, direction,
                                jax.ShapeDtypeStruct((), np.float32))
    return combine, outer_step

  def _broadcast_programs(self, shape):
    """(encode, finish): the delta's wire (a `prepare` program), then its payload and R. Kept
    per shape: finding them anew traces `_prepare_fn` (`jax.eval_shape`), a few milliseconds a
    tensor, which was most of the delta broadcast's time."""
    key = ("broadcast", shape)
    with self._lock:
      if key not in self._programs:
        self._programs[key] = self._new_broadcast_programs(shape)
      return self._programs[key]

  def _new_broadcast_programs(self, shape):
    fmt = self._delta_fmt
    encode = self._prepare_program(shape, fmt)
    example = jax.ShapeDtypeStruct(shape, np.float32)
    wire = jax.eval_shape(_prepare_fn(fmt, self._block_size), example, example,
                          *self._divisors(fmt, shape))[0]
    finish = self._compiled(("finish_broadcast", shape, fmt),
                            lambda: _finish_broadcast_fn(fmt, shape), wire, example, _ZERO)
    return encode, finish

  def compile(self, theta: Mapping[str, np.ndarray], opt_states: Mapping[str, Any],
              embedding_names: Sequence[str]) -> None:
    """Compiles every program one fragment (`theta`, its outer states) needs, ahead of time."""
    for name, value in theta.items():
      if self._fmt is not None:
        self._prepare_program(value.shape, self._fmt)
      if self._fmt in xla_codec.QMAX:
        self._decoded_sumsq_program(value.shape)
      self._step_programs(value, opt_states[name], self._wire_format(self._fmt),
                          name in embedding_names)
      if self._delta_fmt is not None:
        self._broadcast_programs(value.shape)

  # ---- 1. screen and decode ----------------------------------------------------------------------

  def prepare(self, names: Sequence[str], offers: Sequence[messages.Offer]
              ) -> list[PreparedOffer]:
    """Every offer's wire round trip and norms, each (offer, tensor) on the worker threads."""
    started = time.perf_counter()
    tasks = [(offer, name) for offer in offers for name in names]
    done = iter(self._map(lambda task: self._prepare_one(*task), tasks,
                          lambda task: _tensor_size(*task)))
    prepared = []
    for offer in offers:
      wires, formats, norms, raw = {}, {}, {}, 0.0
      for name in names:
        fmt, wire, raw_sq, dec_sq = next(done)
        wires[name], formats[name] = wire, fmt
        raw += raw_sq
        norms[name] = math.sqrt(dec_sq)
      prepared.append(PreparedOffer(wires, formats, raw, norms, 0.0))
    seconds = (time.perf_counter() - started) / max(len(offers), 1)
    return [dataclasses.replace(p, seconds=seconds) for p in prepared]

  def _prepare_one(self, offer: messages.Offer, name: str):
    """(format, wire, Σ raw², Σ decoded²) of one tensor of one offer, its programs run to the end."""
    fmt, wire, raw_sq, dec_sq, exact = self._dispatch_prepare(offer, name)
    if not bool(exact):
      fmt, wire, raw_sq, dec_sq = (("fp32",) + self._carried_wire(offer, name)
                                   if offer.encoded is not None else self._numpy_wire(offer, name))
    jax.block_until_ready(wire)
    return fmt, wire, _sum_blocks(raw_sq), _sum_blocks(dec_sq)

  def _dispatch_prepare(self, offer: messages.Offer, name: str):
    if self._fmt is None:
      return ("fp32",) + self._numpy_wire(offer, name)[1:] + (True,)
    if offer.encoded is not None:
      return self._dispatch_carried(offer.encoded[name])
    anchor = offer.anchor[name]
    values = np.asarray(offer.values[name], np.float32)  # no copy for a float32 host array
    program = self._prepare_program(values.shape, self._fmt)
    wire, raw_sq, dec_sq, exact = program(values, np.asarray(anchor, np.float32),
                                          *self._divisors(self._fmt, values.shape))
    if dec_sq is None:
      dec_sq = self._decoded_sumsq_program(values.shape)(*wire)
    return (self._fmt, wire, raw_sq, dec_sq, exact)

  def _dispatch_carried(self, enc: compression_lib.Encoded):
    """A carried tensor's payload through `_unwire_fn` (formats with a jnp decoder, the
    merge's block size); else numpy's decoder (`_carried_wire`)."""
    fmt, shape = enc.fmt, tuple(enc.shape)
    if (fmt not in ("bf16",) + tuple(xla_codec.QMAX) or enc.block_size != self._block_size
        or not shape):
      return ("fp32",) + self._carried_wire_of(enc) + (True,)
    payload = tuple(np.asarray(a) for a in enc.payload)
    program = self._compiled(("unwire", shape, fmt),
                             lambda: _unwire_fn(fmt, shape, self._block_size),
                             *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in payload))
    wire, dec_sq, exact = program(*payload)
    return (fmt, wire, dec_sq, dec_sq, exact)

  def _carried_wire_of(self, enc: compression_lib.Encoded):
    """(wire, Σ raw², Σ decoded²) of a carried tensor through numpy's decoder, as fp32."""
    decoded = compression_lib.decode(enc)
    squares = np.square(decoded, dtype=np.float64).reshape(-1)
    return (decoded,), squares, squares

  def _carried_wire(self, offer: messages.Offer, name: str):
    """An offer that crossed a network carries Delta_m encoded already (`Offer.for_the_wire`):
    numpy's decoder, its values travelling on as fp32, where `_unwire_fn` cannot take it. Its
    raw norm is the decoded one: the syncer never saw another."""
    return self._carried_wire_of(offer.encoded[name])

  def _numpy_wire(self, offer: messages.Offer, name: str):
    """The numpy encoder's round trip of one tensor, travelling on as fp32 (int1, subnormals)."""
    delta = offer.outer_gradient(name)
    decoded = compression_lib.decode(
        compression_lib.encode(delta, self._outer_grad, self._block_size))
    raw = np.square(delta, dtype=np.float64).reshape(-1)
    dec = np.square(decoded, dtype=np.float64).reshape(-1)
    return "fp32", (decoded,), raw, dec

  # ---- 2. merge and outer step -------------------------------------------------------------------

  def step(self, theta_p: Mapping[str, np.ndarray], opt_p: Mapping[str, Any],
           prepared: Mapping[int, PreparedOffer], tokens_M: np.ndarray, steps_M: np.ndarray,
           scale_M: np.ndarray | None, embedding_names: Sequence[str]):
    """(new Theta_p, new outer states, weights per slot) from the prepared offers by slot."""
    scales = scale_M if scale_M is not None else np.ones(self._num_slots, np.float32)

    def one(name):
      theta = theta_p[name]
      formats = {p.formats[name] for p in prepared.values()}
      fmt = formats.pop() if len(formats) == 1 else "fp32"
      wires, norms = [], np.zeros(self._num_slots, np.float32)
      for slot in range(self._num_slots):
        offer = prepared.get(slot)
        if offer is None:
          wires.append(self._zero_wire(theta.shape, fmt))
          continue
        wires.append(offer.wires[name] if offer.formats[name] == fmt
                     else self._as_fp32(offer, name, theta.shape))
        norms[slot] = offer.norms[name]
      combine, outer_step = self._step_programs(theta, opt_p[name], fmt,
                                                name in embedding_names)
      direction, radius, weights = combine(tuple(wires), tokens_M, steps_M, norms, scales)
      new_theta, new_opt = outer_step(theta, opt_p[name], direction, radius)
      return np.asarray(new_theta), jax.block_until_ready(new_opt), weights

    names = list(theta_p)
    done = self._map(one, names, lambda name: theta_p[name].size)
    new_theta = {name: d[0] for name, d in zip(names, done)}
    new_opt = {name: d[1] for name, d in zip(names, done)}
    return new_theta, new_opt, np.asarray(done[-1][2] if done else None)

  def _as_fp32(self, offer: PreparedOffer, name: str, shape):
    """A prepared wire decoded to fp32: merges a tensor whose offers were encoded differently."""
    return (jnp.asarray(_decode(offer.wires[name], offer.formats[name], shape)),)

  # ---- 3. the delta broadcast --------------------------------------------------------------------

  def broadcast(self, new_theta: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]):
    """(wire, R_p after it): encode(Theta_p_new - R_p) in the delta format, and R_p + decoded."""
    fmt = self._delta_fmt

    def one(name):
      value = new_theta[name]
      encode, finish = self._broadcast_programs(value.shape)
      delta_wire, _, _, exact = encode(base[name], value, *self._divisors(fmt, value.shape))
      arrays, received = finish(delta_wire, base[name], _ZERO)
      if bool(exact):
        return (xla_codec.encoded(arrays, fmt, value.shape, self._block_size),
                np.asarray(received))
      wire = compression_lib.encode(value - base[name], fmt, self._block_size)
      return wire, base[name] + compression_lib.decode(wire)

    names = list(new_theta)
    done = self._map(one, names, lambda name: new_theta[name].size)
    return ({n: d[0] for n, d in zip(names, done)}, {n: d[1] for n, d in zip(names, done)})

  @property
  def delta_in_programs(self) -> bool:
    return self._delta_fmt is not None
