"""The syncer's merge of one fragment: numba loops over each tensor once, the outer step in XLA.

The reference merge (`GlobalModel(fused=False)`) encodes and decodes every outer gradient in
numpy (a dozen passes, several in float64), takes the screen's norm in another float64 pass, and
merges a stacked copy. Here, per tensor of fragment p (`algorithm/merge_kernels.py` holds the
loops):

1. `prepare` (per offer, screen and decode): Delta_m = anchor - theta_m, its wire (int codes and
   scales, bf16 bits, or fp32: the numpy encoder's, bit for bit) and the sums of squares of the raw
   Delta_m (the robust screen's norm) and of its decoded value (RDA's norm), in one pass over the
   offer, a block of 64 values at a time in L1. An offer that arrives encoded (Ray,
   `Offer.for_the_wire`) is its wire already: an int4/int2 payload is unpacked, bf16 and int8 are
   taken as they are, and the sums of squares are those of its values.
2. `step` (merge and outer step, once the screen has judged every offer): the learners' weights
   (`merge.learner_weights`), RDA's coefficients w_m / ‖Δ_m‖ and radius or the average's, then
   the learners' decoded wires added into the direction in learner order, four learners a pass
   over it, with its sum of squares, then the optax outer step, one jitted program per tensor
   shape that reads Theta_p, the outer state and the direction once and writes the next ones.
3. `broadcast` (delta broadcasts only): encode(Theta_p_new - R_p) and R_p + its decoded value, one
   pass.

The same steps as XLA:CPU programs do not vectorise their reductions over blocks of 64 values and
read each offer twice (block scales, then codes): 3-4x the time it takes to read the offers
(docs/performance.md). The loops run on `threads` worker threads (default 2), each taking the next
(offer, tensor) or tensor, largest first; numba releases the GIL in them, and which thread ran a
tensor changes nothing in its result, so the merge is bit for bit the same with any number.

Theta_p and its outer state are not donated: a merge computes the next Theta_p without changing
the current one, which a checkpoint, an evaluation or a joining learner may be reading meanwhile
(`GlobalModel.install` makes the new one current). int1, whose scale is a float64 mean numpy
computes, goes through numpy's encoder and travels on as fp32.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
import optax

from decoupled_diloco.algorithm import compression as compression_lib
from decoupled_diloco.algorithm import merge as merge_lib
from decoupled_diloco.algorithm import merge_kernels as kernels
from decoupled_diloco.algorithm import outer
from decoupled_diloco.runtime.core import messages

QMAX = compression_lib.QMAX  # integers: numba compiles the loops ten times slower for a float
FORMATS = ("fp32", "bf16") + tuple(QMAX)  # what the loops encode and decode; int1 is numpy's
_UNPACK = {"int4": kernels.unpack_int4, "int2": kernels.unpack_int2}
_PACK = {"int4": kernels.pack_int4, "int2": kernels.pack_int2}


@dataclasses.dataclass(frozen=True)
class PreparedOffer:
  """One offer's outer gradients through the wire, with their norms."""

  wires: dict[str, tuple[np.ndarray, ...]]  # per tensor: int (codes, scales), bf16 bits, fp32
  formats: dict[str, str]  # per tensor, the wire's format (fp32 where numpy encoded it)
  raw_sumsq: float  # Σ Delta_m² over the fragment, float32 per block, float64 over the blocks
  norms: dict[str, float]  # per tensor ‖decode(encode(Delta_m))‖: RDA's lengths
  seconds: float  # wall seconds of this offer's part of `prepare`
  scratch: tuple[np.ndarray, ...] = ()  # the arrays behind `wires`, for `FusedMerge.release`


class _Scratch:
  """Host arrays a merge writes and drops (directions, wires), kept for the next merge of the same
  sizes: a fresh array of megabytes is pages the kernel maps and zeroes on first touch, thousands
  of page faults a merge. It keeps what one merge at its peak used, no more."""

  def __init__(self):
    self._free: dict[tuple[int, str], list[np.ndarray]] = collections.defaultdict(list)
    self._lock = threading.Lock()

  def take(self, n: int, dtype) -> np.ndarray:
    key = (n, np.dtype(dtype).str)
    with self._lock:
      if self._free[key]:
        return self._free[key].pop()
    return _aligned_empty(n, dtype)

  def give(self, arrays) -> None:
    with self._lock:
      for a in arrays:
        self._free[(a.size, a.dtype.str)].append(a)


def _aligned_empty(n: int, dtype) -> np.ndarray:
  """An uninitialised 1-D array starting on 64 bytes: XLA reads such a host array in place (it
  copies one on numpy's 16-byte alignment at every call)."""
  dtype = np.dtype(dtype)
  raw = np.empty(n * dtype.itemsize + 64, np.uint8)
  start = -raw.ctypes.data % 64
  return raw[start:start + n * dtype.itemsize].view(dtype)


def _flat(x) -> np.ndarray:
  """A read-only, C-contiguous 1-D view of x (a copy only if it is not contiguous): every input
  of a loop has the same numba type whether it came from numpy, XLA or the network, so each loop
  compiles once."""
  flat = np.ascontiguousarray(x).reshape(-1).view()
  flat.flags.writeable = False
  return flat


def _num_blocks(n: int, block_size: int) -> int:
  return max(math.ceil(n / block_size), 1)


def _coefficients(w_M: np.ndarray, norms_M: np.ndarray, scale_M: np.ndarray | None,
                  rda: bool) -> tuple[np.ndarray, float, float, bool]:
  """(c_M, mul, div, normalise) in float32 with delta = (Σ_m c_m Δ_m) · mul / div, finishing
  `merge.rda_direction` / `rda_finish` and `average_from_parts`; with `normalise` (RDA) mul is its
  radius, which the caller still divides by the direction's norm.

  One learner alone (`merge.sole_learner`): both rules give its s_m Δ_m, taken as it is (c = s_m,
  mul = div = 1, no normalising), so that the identity outer step gives back its parameters bit
  for bit rather than through a radius and a norm rounded to float32."""
  safe_div = lambda a, b: np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)
  w_M = w_M.astype(np.float32)
  sole = merge_lib.sole_learner(w_M)
  if sole is not None:
    c_M = np.zeros_like(w_M)
    c_M[sole] = 1.0 if scale_M is None else scale_M[sole]
    return c_M, 1.0, 1.0, False
  total = np.float32(np.sum(w_M, dtype=np.float32))
  if rda:
    lengths = norms_M if scale_M is None else norms_M * scale_M
    radius = safe_div(np.float32(np.sum(w_M * lengths, dtype=np.float32)), total)
    return safe_div(w_M, norms_M), float(radius), 1.0, True
  c_M = w_M if scale_M is None else (w_M * scale_M).astype(np.float32)
  return c_M, (1.0 if total != 0 else 0.0), (float(total) if total != 0 else 1.0), False


def _outer_fn(tx: optax.GradientTransformation):
  """The optax outer step with delta = direction · mul / div."""

  def step(theta, opt_state, direction, mul, div):
    return outer.outer_step(tx, theta, opt_state, direction * mul / div)

  return step


class FusedMerge:
  """Runs the loops and the compiled outer steps of the syncer's one device."""

  def __init__(self, *, sharding: jax.sharding.Sharding, tx: optax.GradientTransformation,
               rule: str, weighting: str, outer_grad: str, broadcast_delta: str,
               block_size: int, num_slots: int, scaled: bool, threads: int = 2):
    """`num_slots`: learner slots of a merge (`config.num_learners`); `scaled`: whether offers
    carry a staleness scale (`config.outer.staleness_scaling` other than "none"); `threads`: the
    worker threads that run the loops (at most the host's cores; 1 runs them in the caller)."""
    if threads < 1:
      raise ValueError(f"threads={threads} must be at least 1")
    self._sharding = sharding
    self._tx = tx
    self._rule, self._weighting = rule, weighting
    self._outer_grad = outer_grad
    self._delta_fmt = broadcast_delta if broadcast_delta in FORMATS else None
    self._block_size = block_size
    self._num_slots = num_slots
    self._scaled = scaled
    self._lock = threading.RLock()
    self._programs: dict[tuple[Any, ...], Any] = {}
    self.threads = min(threads, os.cpu_count() or 1)
    self._pool = (concurrent.futures.ThreadPoolExecutor(self.threads,
                                                        thread_name_prefix="fused-merge")
                  if self.threads > 1 else None)
    self._scratch = _Scratch()

  def _map(self, fn, items, size):
    """[fn(item) for item in items], run on the worker threads largest `size(item)` first (a
    longest-first queue balances them), the results in the order of `items`; on the caller's
    thread with one thread, or once `close` has let the workers go."""
    pool = self._pool
    if pool is None or len(items) < 2:
      return [fn(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: -size(items[i]))
    try:
      futures = {i: pool.submit(fn, items[i]) for i in order}
    except RuntimeError:  # closed meanwhile (a merge still running as its syncer stopped)
      return [fn(item) for item in items]
    return [futures[i].result() for i in range(len(items))]

  def close(self) -> None:
    """Lets the worker threads end once they are idle (`Syncer.join`); a merge after it runs on
    the caller's thread."""
    pool, self._pool = self._pool, None
    if pool is not None:
      pool.shutdown(wait=False)

  # ---- set-up ------------------------------------------------------------------------------------

  def _outer_program(self, theta, opt_state):
    key = (theta.shape, jax.tree.structure(opt_state))
    with self._lock:
      program = self._programs.get(key)
      if program is None:
        scalar = jax.ShapeDtypeStruct((), np.float32)
        jitted = jax.jit(_outer_fn(self._tx), in_shardings=self._sharding,
                         out_shardings=self._sharding)
        program = self._programs[key] = jitted.lower(
            theta, opt_state, jax.ShapeDtypeStruct(theta.shape, np.float32), scalar,
            scalar).compile()
      return program

  def compile(self, theta: Mapping[str, np.ndarray], opt_states: Mapping[str, Any],
              embedding_names: Sequence[str]) -> None:
    """Compiles the outer step of every tensor shape of one fragment (`theta`, its outer states)
    and the loops this merge's formats use (numba's on-disk cache makes those quick after the
    first run on a machine), ahead of time."""
    del embedding_names  # one outer program serves both rules
    for name, value in theta.items():
      self._outer_program(value, opt_states[name])
    with self._lock:
      if ("loops",) not in self._programs:
        self._warm_up_loops()
        self._programs[("loops",)] = True

  def _warm_up_loops(self) -> None:
    """Runs each loop this configuration calls once on a few values, with the argument types a
    merge passes, so that no merge waits for numba."""
    b = self._block_size
    values = _flat(np.zeros(2 * b + 1, np.float32))
    offer = messages.Offer(learner=0, fragment=0, step=1, since=0, steps=1, tokens=1,
                           anchor_version=0, values={"w": values}, anchor={"w": values})
    fmt = self._outer_grad if self._outer_grad in FORMATS else "fp32"
    wire = self._prepare_one(offer, "w")[1]  # its scratch is left to the garbage collector
    if self._outer_grad in FORMATS:
      encoded = compression_lib.encode(values, self._outer_grad, b)
      self._prepare_one(dataclasses.replace(offer, encoded={"w": encoded}), "w")
    for skipped in (False, True):  # four learners a pass; one a pass where one is missing
      c_M = np.ones(self._num_slots, np.float32)
      c_M[0] = 0 if skipped else 1
      self._scratch.give((self._combine(fmt, [wire] * self._num_slots, c_M, values.size)[0],))
    if self._delta_fmt is not None:
      self._broadcast_one(values, values)

  # ---- 1. screen and decode ----------------------------------------------------------------------

  def prepare(self, names: Sequence[str], offers: Sequence[messages.Offer]
              ) -> list[PreparedOffer]:
    """Every offer's wire and norms, each (offer, tensor) on the worker threads."""
    started = time.perf_counter()
    tasks = [(offer, name) for offer in offers for name in names]
    done = iter(self._map(lambda task: self._prepare_one(*task), tasks,
                          lambda task: _tensor_size(*task)))
    prepared = []
    for offer in offers:
      wires, formats, norms, raw, scratch = {}, {}, {}, 0.0, []
      for name in names:
        fmt, wire, raw_sq, dec_sq, arrays = next(done)
        wires[name], formats[name] = wire, fmt
        raw += raw_sq
        norms[name] = math.sqrt(dec_sq)
        scratch.extend(arrays)
      prepared.append(PreparedOffer(wires, formats, raw, norms, 0.0, tuple(scratch)))
    seconds = (time.perf_counter() - started) / max(len(offers), 1)
    return [dataclasses.replace(p, seconds=seconds) for p in prepared]

  def release(self, prepared: Sequence[PreparedOffer]) -> None:
    """Takes back the arrays of prepared offers that a merge has used (their wires are read no
    more)."""
    for part in prepared:
      self._scratch.give(part.scratch)

  def _prepare_one(self, offer: messages.Offer, name: str):
    """(format, wire, Σ raw², Σ decoded², the scratch arrays behind the wire) of one tensor of
    one offer."""
    if offer.encoded is not None:
      return self._carried(offer.encoded[name])
    fmt = self._outer_grad
    if fmt not in FORMATS:
      return self._numpy_wire(offer, name)
    values = _flat(np.asarray(offer.values[name], np.float32))  # no copy for float32
    anchor = _flat(np.asarray(offer.anchor[name], np.float32))
    n, sums, take = values.size, np.zeros(2), self._scratch.take
    if fmt == "fp32":
      wire = (take(n, np.float32),)
      kernels.prepare_fp32(values, anchor, wire[0], sums)
    elif fmt == "bf16":
      wire = (take(n, np.uint16),)
      kernels.prepare_bf16(values, anchor, wire[0], sums)
    else:
      k = _num_blocks(n, self._block_size)
      wire = (take(k * self._block_size, np.int8), take(k, np.float32))
      kernels.prepare_int(values, anchor, QMAX[fmt], *wire, sums)
    return fmt, tuple(_flat(w) for w in wire), float(sums[0]), float(sums[1]), wire

  def _carried(self, enc: compression_lib.Encoded):
    """A tensor that crossed a network encoded (`Offer.for_the_wire`): its payload as the wire,
    and the sums of squares of its values (the syncer never saw Delta_m itself, so its raw norm is
    the decoded one). Formats the loops do not decode, or another block size: numpy's decoder."""
    fmt, n = enc.fmt, math.prod(enc.shape)
    if fmt == "bf16" and n:
      bits = _flat(np.asarray(enc.payload[0]).view(np.uint16))
      dec = kernels.bf16_sumsq(bits)
      return fmt, (bits,), dec, dec, ()
    if fmt in QMAX and enc.block_size == self._block_size and n:
      packed, scale_K = (_flat(a) for a in enc.payload)
      scratch = ()
      if fmt == "int8":
        codes = packed.view(np.int8)
      else:
        scratch = (self._scratch.take(_num_blocks(n, self._block_size) * self._block_size,
                                      np.int8),)
        _UNPACK[fmt](packed, n, scratch[0])
        codes = _flat(scratch[0])
      scale_K = _flat(scale_K.astype(np.float32, copy=False))
      dec = kernels.int_sumsq(codes, n, scale_K, self._block_size)
      return fmt, (codes, scale_K), dec, dec, scratch
    decoded = _flat(compression_lib.decode(enc))
    squares = float(np.sum(np.square(decoded, dtype=np.float64)))
    return "fp32", (decoded,), squares, squares, ()

  def _numpy_wire(self, offer: messages.Offer, name: str):
    """The numpy encoder's round trip of one tensor, travelling on as fp32 (int1)."""
    delta = offer.outer_gradient(name)
    decoded = compression_lib.decode(
        compression_lib.encode(delta, self._outer_grad, self._block_size))
    raw = float(np.sum(np.square(delta, dtype=np.float64)))
    dec = float(np.sum(np.square(decoded, dtype=np.float64)))
    return "fp32", (_flat(decoded),), raw, dec, ()

  # ---- 2. merge and outer step -------------------------------------------------------------------

  def step(self, theta_p: Mapping[str, np.ndarray], opt_p: Mapping[str, Any],
           prepared: Mapping[int, PreparedOffer], tokens_M: np.ndarray, steps_M: np.ndarray,
           scale_M: np.ndarray | None, embedding_names: Sequence[str]):
    """(new Theta_p, new outer states, weights per slot) from the prepared offers by slot."""
    w_M = np.asarray(merge_lib.learner_weights(tokens_M, steps_M, self._weighting))
    scale_M = scale_M if self._scaled else None

    def one(name):
      theta = theta_p[name]
      formats = {p.formats[name] for p in prepared.values()}
      fmt = formats.pop() if len(formats) == 1 else "fp32"
      wires, norms = [None] * self._num_slots, np.zeros(self._num_slots, np.float32)
      for slot, offer in prepared.items():
        wires[slot] = (offer.wires[name] if offer.formats[name] == fmt
                       else (self._decoded(offer.wires[name], offer.formats[name], theta.size),))
        norms[slot] = offer.norms[name]
      rda = not (name in embedding_names or self._rule == "average")
      c_M, mul, div, normalise = _coefficients(w_M, norms, scale_M, rda)
      direction, sumsq = self._combine(fmt, wires, c_M, theta.size)
      if normalise:  # radius · φ(direction) (`merge.rda_finish`)
        norm = np.sqrt(np.float32(sumsq))
        mul = float(np.float32(mul) / norm) if norm > 0 else 0.0
      new_theta, new_opt = self._outer_program(theta, opt_p[name])(
          theta, opt_p[name], direction.reshape(theta.shape), np.float32(mul), np.float32(div))
      new_theta, new_opt = np.asarray(new_theta), jax.block_until_ready(new_opt)
      self._scratch.give((direction,))  # the outer step has read it
      return new_theta, new_opt

    names = list(theta_p)
    done = self._map(one, names, lambda name: theta_p[name].size)
    return ({name: d[0] for name, d in zip(names, done)},
            {name: d[1] for name, d in zip(names, done)}, w_M)

  def _combine(self, fmt: str, wires: Sequence[tuple[np.ndarray, ...] | None], c_M: np.ndarray,
               n: int) -> tuple[np.ndarray, float]:
    """(Σ_m c_m decode(wire_m) as a 64-byte aligned float32 array of n values, Σ of its squares);
    a slot without a wire, or with c_m = 0, adds nothing. Every slot is passed, so the loop's
    numba type (a tuple of `num_slots` arrays) is the same in every merge."""
    empty = {"fp32": (np.float32,), "bf16": (np.uint16,),
             **{f: (np.int8, np.float32) for f in QMAX}}[fmt]
    filled = [w if w is not None else tuple(_flat(np.empty(0, t)) for t in empty) for w in wires]
    c_M = np.where([w is not None for w in wires], c_M, 0).astype(np.float32)
    out = self._scratch.take(n, np.float32)
    if fmt in QMAX:
      sumsq = kernels.combine_int(tuple(w[0] for w in filled), tuple(w[1] for w in filled), c_M,
                                  self._block_size, out)
    else:
      sumsq = kernels.combine_values(tuple(w[0] for w in filled), c_M, out)
    return out, float(sumsq)

  def _decoded(self, wire: tuple[np.ndarray, ...], fmt: str, n: int) -> np.ndarray:
    """A wire's float32 values: merges a tensor whose offers came in different formats."""
    if fmt in QMAX:
      codes, scale_K = wire
      decoded = codes[:n].astype(np.float32) * np.repeat(scale_K, self._block_size)[:n]
    elif fmt == "bf16":
      decoded = wire[0].view(ml_dtypes.bfloat16).astype(np.float32)
    else:
      decoded = wire[0]
    return _flat(decoded)

  # ---- 3. the delta broadcast --------------------------------------------------------------------

  def broadcast(self, new_theta: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]):
    """(wire, R_p after it): encode(Theta_p_new - R_p) in the delta format, and R_p + decoded."""
    names = list(new_theta)
    done = self._map(lambda name: self._broadcast_one(new_theta[name], base[name]), names,
                     lambda name: new_theta[name].size)
    return ({n: d[0] for n, d in zip(names, done)}, {n: d[1] for n, d in zip(names, done)})

  def _broadcast_one(self, value: np.ndarray, received: np.ndarray):
    fmt, b, shape = self._delta_fmt, self._block_size, np.shape(value)
    theta, base = _flat(value), _flat(received)
    n = theta.size
    after = _aligned_empty(n, np.float32)
    if fmt in QMAX and n:
      k = _num_blocks(n, b)
      scale_K = np.empty(k, np.float32)
      codes = np.empty(k * b, np.int8) if fmt == "int8" else self._scratch.take(k * b, np.int8)
      kernels.broadcast_int(theta, base, QMAX[fmt], codes, scale_K, after)
      if fmt == "int8":
        packed = codes[:n]
      else:
        packed = np.empty(compression_lib.encoded_nbytes(n, fmt, b) - 4 * k, np.uint8)
        _PACK[fmt](_flat(codes), n, packed)
        self._scratch.give((codes,))
      payload = (packed, scale_K)
    elif fmt == "bf16" and n:
      bits = np.empty(n, np.uint16)
      kernels.broadcast_bf16(theta, base, bits, after)
      payload = (bits.view(ml_dtypes.bfloat16),)
    else:
      delta = theta - base
      after = base + compression_lib.decode(compression_lib.encode(delta, fmt, b)).reshape(-1)
      return compression_lib.encode(delta.reshape(shape), fmt, b), after.reshape(shape)
    return compression_lib.Encoded(fmt, tuple(shape), payload, b), after.reshape(shape)

  @property
  def delta_in_programs(self) -> bool:
    return self._delta_fmt is not None


def _tensor_size(offer: messages.Offer, name: str) -> int:
  """Values in one tensor of an offer, whether it carries them or their encoding."""
  if offer.encoded is not None and name in offer.encoded:
    return math.prod(offer.encoded[name].shape)
  return int(np.size(offer.values[name]))
