"""The syncer's merge loops, compiled by numba: each buffer read once, each result written once.

The fused merge (`runtime/core/fused_merge.py`) calls these per tensor of a fragment. XLA:CPU runs
the same arithmetic at 3-4x the time it takes to read the buffers (its block reductions over 64
values do not vectorise); these loops keep a block of 64 values in L1 while they compute its maximum, its
sums of squares and its codes, and a block of the merged direction while every learner adds to it.

Every kernel gives the numpy encoder's and decoder's values (`compression.py`) bit for bit:

- int formats: the scale is float32(float64(max|x|) / q_max) and a code is round-half-even of the
  float64 quotient x / scale, clipped, as `compression._quantize` computes them;
- bf16: round-to-nearest-even of the float32 bits, NaN kept quiet, as ml_dtypes;
- no fused multiply-add, no reciprocal for a division, no flush of subnormals.

Only sums of squares may run in any order (fast-math's `reassoc`, which lets LLVM keep them in
vector lanes): in float32 over a block or a row, then in float64 over those, within a few float32
roundings of a float64 sum. They live in their own functions (`_sumsq`, `_row_stats`), compiled
with it; every function that writes a value is compiled without it (`_strict`), because numba's
fast-math reaches into the functions a fast-math function inlines.

Wires: an int wire is its codes unpacked (int8, one per value, the last block padded with zeros)
and its float32 scales; a bf16 wire is its bits as uint16; an fp32 wire is the values.

Numba compiles each kernel once per argument types and keeps it in its on-disk cache
(`NUMBA_CACHE_DIR`, else `__pycache__` beside this file where writable).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic
from numba.extending import overload

_SIGN_OFF = np.int32(0x7FFFFFFF)

# `_jit`: sums may run in any order (`reassoc`: XLA's and numpy's sums are not in order either),
# their sign of zero does not matter (`nsz`); `_strict`: neither. Loops index slices or 2-D rows
# from 0: an index numba cannot prove non-negative is wrapped, and LLVM then gathers instead of
# loading.
_jit = numba.njit(nogil=True, boundscheck=False, cache=True, error_model="numpy",
                  fastmath={"reassoc", "nsz"})
_strict = numba.njit(nogil=True, boundscheck=False, cache=True, error_model="numpy")


def num_blocks(size: int, block_size: int) -> int:
  return math.ceil(size / block_size)


@intrinsic
def _as_f32(typingctx, bits):  # pylint: disable=unused-argument
  """The float32 whose bit pattern is `bits` (a uint32), in a register: numba has no scalar
  bitcast, and a round trip through an array view costs a store and a load per value."""
  def codegen(context, builder, signature, args):  # pylint: disable=unused-argument
    return builder.bitcast(args[0], ir.FloatType())
  return types.float32(types.uint32), codegen


@intrinsic
def _as_u32(typingctx, value):  # pylint: disable=unused-argument
  """The bit pattern of a float32, as a uint32 (`_as_f32`'s inverse)."""
  def codegen(context, builder, signature, args):  # pylint: disable=unused-argument
    return builder.bitcast(args[0], ir.IntType(32))
  return types.uint32(types.float32), codegen


@_jit
def _to_bf16(u):
  """bfloat16 bits (uint32) of float32 bits `u`: round to nearest even; a NaN stays a quiet NaN."""
  if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
    return (u >> np.uint32(16)) | np.uint32(0x40)
  return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@_jit
def _sumsq(x):
  s = np.float32(0)
  for i in range(x.size):
    s += x[i] * x[i]
  return s


# ---- offers: Delta = anchor - values through the wire, with both norms -------------------------


_ROWS = 16  # blocks of an int wire computed together (16 x 64 values: 4 KB, in L1)


@_jit
def _row_stats(x2, bits2, r):
  """(Σ x2[r]², max |x2[r]| as its bit pattern), `bits2` the same buffer as int32: a float max
  that keeps NaN does not vectorise, an integer one does (and a NaN's pattern is the largest).
  `reassoc` lets the sum run in lanes; inlined into a strict caller, only its own instructions
  may be regrouped."""
  s = np.float32(0)
  largest = np.int32(0)
  for i in range(x2.shape[1]):
    s += x2[r, i] * x2[r, i]
    largest = max(largest, bits2[r, i] & _SIGN_OFF)
  return s, largest


@_jit
def _codes_sumsq(q2, r):
  """Σ q² over row r of int codes, as a float32: every square and partial sum is an integer
  below 2^24 (64 x 127² at most), exact in any order."""
  s = np.float32(0)
  for i in range(q2.shape[1]):
    c = np.float32(q2[r, i])
    s += c * c
  return s


@_strict
def _codes_f32(d2, rows, scale_R, qmax, q2, y2, o2):
  """The codes of blocks d2[:rows] into q2, with o2 = y2 + q s for the first len(o2) blocks (the
  delta broadcast's R_p); returns whether a quotient lies within 1e-5 of a half (then
  `_codes_f64` does these blocks again). The float32 quotient is within 2^-24 · 127.5 < 1e-5 of
  the exact one, so elsewhere both lie between the same half and integer and round alike; and
  numpy's float64 quotient rounds as the exact one does (it never lands on a half it is not at:
  d / s is a ratio of 24-bit integers, at least 2^-32 from any half it misses)."""
  top = np.float32(qmax)
  near = False
  for r in range(rows):
    scale = scale_R[r]
    safe = scale if scale > 0 else np.float32(1.0)
    for i in range(d2.shape[1]):
      y = d2[r, i] / safe
      q = np.rint(y)
      near |= abs(y - q) > np.float32(0.49999)
      q2[r, i] = np.int8(np.int32(min(max(q, -top), top)))
    if r < o2.shape[0]:
      for i in range(d2.shape[1]):
        o2[r, i] = y2[r, i] + np.float32(q2[r, i]) * scale
  return near


@_strict
def _codes_f64(d2, rows, scale_R, qmax, q2, y2, o2):
  """`_codes_f32` as `compression._quantize` computes it: round-half-even(float64(d) / s)."""
  top = np.float64(qmax)
  for r in range(rows):
    scale = scale_R[r]
    safe = np.float64(scale) if scale > 0 else np.float64(1.0)
    for i in range(d2.shape[1]):
      q2[r, i] = np.int8(np.int32(min(max(np.rint(np.float64(d2[r, i]) / safe), -top), top)))
    if r < o2.shape[0]:
      for i in range(d2.shape[1]):
        o2[r, i] = y2[r, i] + np.float32(q2[r, i]) * scale


@_strict
def _int_rows(d2, bits2, rows, qmax, q2, scale_K, k0, y2, o2):
  """Scales and codes of `rows` blocks of values `d2` (`bits2`: the same buffer as int32), the
  codes into `q2`, the scales into scale_K[k0:]; returns (Σ d², Σ q² s²) over them. The first
  len(o2) rows also get o2 = y2 + q s.

  The scale is float32(float64(max|d|) / q_max) and a code round-half-even(float64(d) / s)
  clipped to [-q_max, q_max], as `compression._quantize` computes them (`_codes_f32`, else
  `_codes_f64`). `qmax` is an integer: numba compiled these loops ten times slower with a float
  one."""
  raw = 0.0
  for r in range(rows):
    sumsq, largest = _row_stats(d2, bits2, r)
    raw += sumsq
    scale_K[k0 + r] = np.float32(np.float64(_as_f32(np.uint32(largest))) / qmax)
  scale_R = scale_K[k0:k0 + rows]
  if _codes_f32(d2, rows, scale_R, qmax, q2, y2, o2):
    # A quotient near a half: these blocks in float64, as numpy divides.
    _codes_f64(d2, rows, scale_R, qmax, q2, y2, o2)
  dec = 0.0
  for r in range(rows):
    # Σ (q s)² = s² Σ q²: the sum of integers is exact.
    dec += np.float64(_codes_sumsq(q2, r) * (scale_R[r] * scale_R[r]))
  return raw, dec


@_strict
def _int_wire(first, second, qmax, q_N, scale_K, received_out, sums):
  """The int wire of d = first - second (`prepare_int`, `broadcast_int`), `_ROWS` blocks at a
  time; `received_out`, if not empty, gets second + q s. Blocks are rows of 2-D views, which
  numba indexes without the negative-index wrap that makes LLVM gather; the last, partial block
  goes through a zero-padded copy, as numpy's encoder pads it."""
  n = second.size
  kk = scale_K.size
  b = q_N.size // kk
  full = n // b
  d2 = np.zeros((_ROWS, b), np.float32)
  bits2 = d2.view(np.int32)
  add_back = received_out.size > 0
  x2, y2 = first[:full * b].reshape(full, b), second[:full * b].reshape(full, b)
  q2 = q_N.reshape(kk, b)
  o2 = (received_out[:full * b] if add_back else received_out[:0]).reshape(-1, b)
  raw = 0.0
  dec = 0.0
  for k0 in range(0, kk, _ROWS):
    rows = min(_ROWS, kk - k0)
    whole = min(rows, full - k0)  # rows of x2 and y2 (the last block may be partial)
    for r in range(whole):
      for i in range(b):
        d2[r, i] = x2[k0 + r, i] - y2[k0 + r, i]
    if whole < rows:
      lo = full * b
      for i in range(b):
        d2[whole, i] = (first[lo + i] - second[lo + i]) if lo + i < n else np.float32(0)
    back = k0 + whole if add_back else k0
    r_sum, d_sum = _int_rows(d2, bits2, rows, qmax, q2[k0:k0 + rows], scale_K, k0,
                             y2[k0:back], o2[k0:back])
    raw += r_sum
    dec += d_sum
    if add_back:
      if whole < rows:
        s = scale_K[full]
        for i in range(n - full * b):
          received_out[full * b + i] = second[full * b + i] + np.float32(q2[full, i]) * s
  sums[0] = raw
  sums[1] = dec


@_strict
def prepare_int(values, anchor, qmax, q_N, scale_K, sums):
  """Codes and scales of Delta (`compression._quantize`), sums[0] = Σ Delta², sums[1] = Σ
  decoded². `q_N` holds num_blocks * block_size codes (the last block's tail padded with 0); the
  block size is len(q_N) / len(scale_K)."""
  _int_wire(anchor, values, qmax, q_N, scale_K, np.empty(0, np.float32), sums)


@_jit
def prepare_bf16(values, anchor, out_N, sums):
  """bfloat16 bits of Delta into `out_N` (uint16); sums[0] = Σ Delta², sums[1] = Σ
  bf16(Delta)²."""
  n = values.size
  raw = 0.0
  dec = 0.0
  for lo in range(0, n, 64):
    m = min(64, n - lo)
    a_, v_, o_ = anchor[lo:lo + m], values[lo:lo + m], out_N[lo:lo + m]
    s_raw = np.float32(0)
    s_dec = np.float32(0)
    for i in range(m):
      d = a_[i] - v_[i]
      h = _to_bf16(_as_u32(d))
      o_[i] = np.uint16(h)
      x = _as_f32(h << np.uint32(16))
      s_raw += d * d
      s_dec += x * x
    raw += s_raw
    dec += s_dec
  sums[0] = raw
  sums[1] = dec


@_jit
def prepare_fp32(values, anchor, out_N, sums):
  """Delta into `out_N`, sums[0] = sums[1] = Σ Delta²."""
  n = values.size
  raw = 0.0
  for lo in range(0, n, 64):
    m = min(64, n - lo)
    a_, v_, o_ = anchor[lo:lo + m], values[lo:lo + m], out_N[lo:lo + m]
    s = np.float32(0)
    for i in range(m):
      d = a_[i] - v_[i]
      o_[i] = d
      s += d * d
    raw += s
  sums[0] = raw
  sums[1] = raw


# ---- carried offers: a payload as it crossed the network ----------------------------------------


@_jit
def unpack_int4(packed, n, q_N):
  """Two codes a byte, offset 8, low nibble first (`compression._pack_int4`), into `q_N`: each
  pair written as one little-endian uint16."""
  half = n // 2
  pairs = q_N[:2 * half].view(np.uint16)
  for j in range(half):
    byte = np.uint32(packed[j])
    low = ((byte & np.uint32(15)) - np.uint32(8)) & np.uint32(255)
    high = ((byte >> np.uint32(4)) - np.uint32(8)) & np.uint32(255)
    pairs[j] = np.uint16(low | (high << np.uint32(8)))
  if n % 2:
    q_N[n - 1] = np.int8((np.int32(packed[half]) & 15) - 8)
  tail = q_N[n:]
  for i in range(tail.size):
    tail[i] = 0


@_jit
def unpack_int2(packed, n, q_N):
  """Four codes a byte, offset 1, lowest bits first (`compression._pack_int2`), into `q_N`."""
  for i in range(n):
    q_N[i] = np.int8(((np.int32(packed[i // 4]) >> (2 * (i % 4))) & 3) - 1)
  tail = q_N[n:]
  for i in range(tail.size):
    tail[i] = 0


@_jit
def int_sumsq(q_N, n, scale_K, block_size):
  """Σ decoded² of an int wire's first n values, as `prepare_int` sums it."""
  dec = 0.0
  for k in range(scale_K.size):
    lo = k * block_size
    q_ = q_N[lo:min(lo + block_size, n)]
    codes = 0
    for i in range(q_.size):
      c = np.int32(q_[i])
      codes += c * c
    s = scale_K[k]
    dec += np.float64(np.float32(codes) * (s * s))
  return dec


@_jit
def bf16_sumsq(u_N):
  """Σ value² of bfloat16 bits, as `prepare_bf16` sums it."""
  n = u_N.size
  dec = 0.0
  for lo in range(0, n, 64):
    u_ = u_N[lo:min(lo + 64, n)]
    s = np.float32(0)
    for i in range(u_.size):
      x = _as_f32(np.uint32(u_[i]) << np.uint32(16))
      s += x * x
    dec += s
  return dec


# ---- the merge: Σ_m c_m decode(wire_m), and its sum of squares ----------------------------------
#
# One add per learner in learner order (`merge._sum_in_order`), from zero: 0 + c_0 x_0 is c_0 x_0,
# and a learner with c_m = 0 (absent, or of weight 0) is skipped, where `_sum_in_order` adds 0 x_m.
# Strict (`reassoc` would make c (q s) into (c q) s); the sums of squares are `_sumsq`'s.
# Four learners are added in one pass over the direction, each element ((((o + a_0) + a_1) + a_2)
# + a_3): the same adds in the same order as one pass per learner, a quarter of the direction's
# loads and stores. The passes go over the whole tensor, a 4 KB chunk at a time, four learners
# after four: with eight learners' streams at once the loop ran at half the speed of two passes
# (measured on Zen 4). A group with an absent learner goes one learner a pass.

_CHUNK = 1024


@_strict
def _quad(c_M, g):
  """Whether learners g..g+3 all exist and all have a coefficient (one pass adds them)."""
  return g + 4 <= c_M.size and c_M[g] != 0 and c_M[g + 1] != 0 and c_M[g + 2] != 0 and (
      c_M[g + 3] != 0)


@_jit
def _sumsq_chunks(x, chunk):
  """Σ x² in float32 over each `chunk` values, in float64 over the chunks."""
  total = 0.0
  for lo in range(0, x.size, chunk):
    total += _sumsq(x[lo:lo + chunk])
  return total


@_strict
def _int_pass4(out_N, b, q0, q1, q2, q3, s0_K, s1_K, s2_K, s3_K, c_4, first, last):
  """out += c_0 (q_0 s_0) + ... + c_3 (q_3 s_3), added in that order, a chunk at a time (from
  zero if `first`); returns Σ out² if `last`, else 0. The four wires are arguments of their own:
  a tuple indexed by a variable made every load of the loop go through memory."""
  n = out_N.size
  rows = max(_CHUNK // b, 1)
  kk = (n + b - 1) // b
  c0, c1, c2, c3 = c_4[0], c_4[1], c_4[2], c_4[3]
  total = 0.0
  for k0 in range(0, kk, rows):
    r = min(rows, kk - k0)
    o_ = out_N[k0 * b:min((k0 + r) * b, n)]
    if first:
      for t in range(o_.size):
        o_[t] = np.float32(0)
    for i in range(r):
      k = k0 + i
      lo = k * b
      m = min(b, n - lo)
      s0, s1, s2, s3 = s0_K[k], s1_K[k], s2_K[k], s3_K[k]
      ob = out_N[lo:lo + m]
      w0, w1, w2, w3 = q0[lo:lo + m], q1[lo:lo + m], q2[lo:lo + m], q3[lo:lo + m]
      for t in range(m):
        ob[t] = (((ob[t] + c0 * (np.float32(w0[t]) * s0)) + c1 * (np.float32(w1[t]) * s1))
                 + c2 * (np.float32(w2[t]) * s2)) + c3 * (np.float32(w3[t]) * s3)
    if last:
      total += _sumsq(o_)
  return total


@_strict
def _int_pass1(out_N, b, q, s_K, c):
  """out += c (q s)."""
  n = out_N.size
  for k in range((n + b - 1) // b):
    lo = k * b
    m = min(b, n - lo)
    s = s_K[k]
    ob, w = out_N[lo:lo + m], q[lo:lo + m]
    for t in range(m):
      ob[t] = ob[t] + c * (np.float32(w[t]) * s)


@_strict
def combine_int(qs, scales, c_M, block_size, out_N):
  """out = Σ_m c_m (q_m s_m) over int wires; returns Σ out²."""
  b = block_size
  chunk = max(_CHUNK // b, 1) * b
  total = 0.0
  first = True
  for g in range(0, c_M.size, 4):  # a pass over the tensor per four learners
    last = g + 4 >= c_M.size
    if _quad(c_M, g):
      total = _int_pass4(out_N, b, qs[g], qs[g + 1], qs[g + 2], qs[g + 3], scales[g],
                         scales[g + 1], scales[g + 2], scales[g + 3], c_M[g:g + 4], first, last)
      first = False
      continue
    if first:
      out_N[:] = np.float32(0)
      first = False
    for j in range(g, min(g + 4, c_M.size)):
      if c_M[j] != 0:
        _int_pass1(out_N, b, qs[j], scales[j], c_M[j])
    if last:
      total = _sumsq_chunks(out_N, chunk)
  return total


def _value(element):
  """An element of a bf16 or fp32 wire as float32 (numba picks the implementation by type,
  `_value_of`; plain Python never calls this)."""
  raise NotImplementedError(element)


@overload(_value, jit_options={"fastmath": False})
def _value_of(element):
  if element == types.uint16:  # bfloat16 bits: float32's high half
    return lambda element: _as_f32(np.uint32(element) << np.uint32(16))
  if element == types.float32:
    return lambda element: element
  return None


@_strict
def _values_pass4(out_N, w0, w1, w2, w3, c_4, first, last):
  """`_int_pass4` over bf16 bits or fp32 values."""
  n = out_N.size
  c0, c1, c2, c3 = c_4[0], c_4[1], c_4[2], c_4[3]
  total = 0.0
  for lo in range(0, n, _CHUNK):
    m = min(_CHUNK, n - lo)
    o_ = out_N[lo:lo + m]
    if first:
      for t in range(m):
        o_[t] = np.float32(0)
    v0, v1, v2, v3 = w0[lo:lo + m], w1[lo:lo + m], w2[lo:lo + m], w3[lo:lo + m]
    for t in range(m):
      o_[t] = (((o_[t] + c0 * _value(v0[t])) + c1 * _value(v1[t])) + c2 * _value(v2[t])
               + c3 * _value(v3[t]))
    if last:
      total += _sumsq(o_)
  return total


@_strict
def _values_pass1(out_N, w, c):
  for t in range(out_N.size):
    out_N[t] = out_N[t] + c * _value(w[t])


@_strict
def combine_values(wires, c_M, out_N):
  """`combine_int` over wires whose values need no scale: bf16 bits (uint16) or fp32."""
  total = 0.0
  first = True
  for g in range(0, c_M.size, 4):
    last = g + 4 >= c_M.size
    if _quad(c_M, g):
      total = _values_pass4(out_N, wires[g], wires[g + 1], wires[g + 2], wires[g + 3],
                            c_M[g:g + 4], first, last)
      first = False
      continue
    if first:
      out_N[:] = np.float32(0)
      first = False
    for j in range(g, min(g + 4, c_M.size)):
      if c_M[j] != 0:
        _values_pass1(out_N, wires[j], c_M[j])
    if last:
      total = _sumsq_chunks(out_N, _CHUNK)
  return total


# ---- the delta broadcast: encode(Theta_new - R), and R + its decoded value ----------------------


@_strict
def broadcast_int(theta, received, qmax, q_N, scale_K, received_out):
  """The int wire of Theta_new - R, and R + q s into `received_out` (two roundings, as the
  learners add them in numpy)."""
  _int_wire(theta, received, qmax, q_N, scale_K, received_out, np.zeros(2))


@_jit
def broadcast_bf16(theta, received, out_N, received_out):
  """bf16 bits of Theta_new - R into `out_N`, and R + their value into `received_out`."""
  n = theta.size
  for lo in range(0, n, 64):
    m = min(64, n - lo)
    t_, r_ = theta[lo:lo + m], received[lo:lo + m]
    o_, ro_ = out_N[lo:lo + m], received_out[lo:lo + m]
    for i in range(m):
      h = _to_bf16(_as_u32(t_[i] - r_[i]))
      o_[i] = np.uint16(h)
      ro_[i] = r_[i] + _as_f32(h << np.uint32(16))


@_jit
def pack_int4(q_N, n, out):
  """`compression._pack_int4` of the first n codes: each pair read as one little-endian uint16
  (low byte the first code), a nibble of each byte offset by 8."""
  half = n // 2
  pairs = q_N[:2 * half].view(np.uint16)
  for j in range(half):
    u = np.uint32(pairs[j])
    out[j] = np.uint8(((u + np.uint32(8)) & np.uint32(15))
                      | ((((u >> np.uint32(8)) + np.uint32(8)) & np.uint32(15)) << np.uint32(4)))
  if n % 2:
    out[half] = np.uint8((np.int32(q_N[n - 1]) + 8) | (8 << 4))


@_jit
def pack_int2(q_N, n, out):
  """`compression._pack_int2` of the first n codes."""
  for j in range(out.size):
    byte = 0
    for t in range(4):
      i = 4 * j + t
      code = (np.int32(q_N[i]) + 1) if i < n else 1
      byte |= code << (2 * t)
    out[j] = np.uint8(byte)
