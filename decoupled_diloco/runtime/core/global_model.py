"""The global model Theta as the syncer keeps it: fragments, versions, outer states, the merge.

Theta is split into the P fragments; each has a version (how many merges it has had), one optax
outer-optimizer state, and, with `anchor="syncer"` only, the earlier versions a live learner may
still be anchored at. `merge(p, offers)` computes the next Theta_p from the learners' offers
(weights, RDA or weighted average, outer step, wire encoding) without changing anything;
`install(p, result)` makes it current. Before a merge, `screen(p, offers)` judges each offer's outer
gradient (finite? an outlier against the norms this fragment accepted lately? `algorithm/robust.py`)
so that a rejected offer never reaches the merge. The syncer runs merges of different fragments in
worker threads and installs them on its own thread; nothing here starts a thread or waits.

With `config.outer.staleness_scaling` other than "none", `merge` first scales each offer's outer
gradient by `merge.staleness_scale` of its staleness: the versions of Theta_p installed since the
one the offer is anchored at (`Offer.anchor_version` against the version the merge steps from).

On a syncer of one device with `anchor="learner"` (the default) the screen and the merge run as
`fused_merge.FusedMerge`'s loops: each offer's wire and norms in one pass, in the screen, then the
weights and RDA's direction in one pass over the wires and the optax outer step in one program per
tensor, and the delta broadcast's encoding in one pass. Otherwise (a syncer mesh of several devices, `anchor="syncer"`, or `fused=False`, the
reference the fused merge is tested against) each tensor's merge is one jitted program over the
syncer mesh: the learners' outer gradients, encoded and decoded by numpy, are stacked on a leading
axis sharded over the syncer devices, and the sums that RDA and the weighted average need become
one all-reduce. Programs are compiled per tensor shape either way, so their number does not grow
with the model's depth. The math is `merge` and `outer`; this module only calls it.

The delta broadcast (`config.compression.broadcast_delta` other than "none"): the syncer keeps, per
fragment, R_p, the value every up-to-date learner holds as its anchor, and a merge broadcasts
encode(Theta_p_new - R_p) with `base_version` = the version of R_p; then R_p += decode(delta). A
learner anchored at that version adds the same decoded delta to the same R_p in float32, so it holds
the new R_p bit for bit, and the quantisation error of one delta is carried by the next instead of
piling up: |R_p - Theta_p| stays within one step of the format. A learner that does not hold the
base version gets a keyframe (`keyframe`, R_p itself in the `broadcast` format, fp32) instead; so
does everyone after the syncer restored its state (`require_keyframes`), since R_p is not
checkpointed: a restored Theta_p is not what the learners hold.

A shard of a sharded syncer (`owned`: the fragments it owns, `algorithm/shards.py`) holds Theta_p,
the outer state and the rest of its own fragments only; fragments stay numbered 0..P-1, and the
others are empty here (no tensors, version 0), never merged, broadcast or checkpointed by it.

Memory (`steady_state_bytes`): 4 bytes per parameter for Theta plus 4 per parameter per outer
optimizer slot (1 for SGD with momentum, 2 for Adam or Delayed Nesterov, 0 for plain SGD), plus the
optimizer's scalar leaves, plus, with the delta broadcast only, 4 per parameter for R_p, plus, with
anchor="syncer" only, the kept versions, plus `robust.WINDOW` norms per fragment.
Nothing grows with the number of steps. A fused merge in progress adds every screened offer's wire
(int codes 1 byte per parameter plus a scale per block, bf16 2, fp32 4) until its merge is done,
and the next Theta_p and momentum; the wires' and the directions' arrays are kept for the next
merge (`fused_merge._Scratch`: no page faults on fresh arrays), so the syncer holds at most what
its largest merge needed at once; the reference merge adds one tensor's stacked outer gradients
(learners x tensor size, fp32), and its screen one tensor's outer gradient at a time.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.algorithm import compression as compression_lib
from decoupled_diloco.algorithm import fragments as fragments_lib
from decoupled_diloco.algorithm import merge as merge_lib
from decoupled_diloco.algorithm import outer
from decoupled_diloco.algorithm import robust
from decoupled_diloco.runtime.core import devices as devices_lib
from decoupled_diloco.runtime.core import fused_merge
from decoupled_diloco.runtime.core import messages

_FLOAT_BYTES = 4


@dataclasses.dataclass
class MergeResult:
  """The next Theta_p, computed but not installed."""

  fragment: int
  theta: dict[str, np.ndarray]
  opt_state: dict[str, Any]
  # Theta_p in the broadcast format, or with the delta broadcast Theta_p - R_p in its format
  wire: dict[str, compression_lib.Encoded]
  weights: np.ndarray  # per learner slot
  bytes_up: int  # encoded outer gradients, as they would travel
  encode_s: float
  merge_s: float
  wire_s: float
  base_version: int | None = None  # the version of R_p a delta `wire` adds to; None: full value
  received: dict[str, np.ndarray] | None = None  # delta broadcast: R_p after this merge


@dataclasses.dataclass(frozen=True)
class Rejection:
  """An offer a merge must not take in, and why (`robust.REASONS`)."""

  offer: messages.Offer
  reason: str
  norm: float  # ||Delta_m|| per step the offer covers (`screen`)
  median: float | None  # of the fragment's recent accepted norms; None: no outlier test yet


@dataclasses.dataclass(frozen=True)
class Screening:
  """The offers of one round, split into those a merge may take in and those it must not."""

  fragment: int
  accepted: tuple[messages.Offer, ...]
  norms: tuple[float, ...]  # ||Delta_m|| / steps of each accepted offer (`screen`)
  rejected: tuple[Rejection, ...]
  window: robust.NormWindow  # the fragment's yardstick after this round (`keep_screening`)
  # The fused merge: each accepted offer's wire round trip, for `merge` to take up (else None)
  prepared: tuple[fused_merge.PreparedOffer, ...] | None = None


def outer_state_slots(tx: optax.GradientTransformation) -> int:
  """Floats per parameter in the outer optimizer's state (1 for momentum, 2 for Adam, 0 for SGD)."""
  size = 1024
  state = jax.eval_shape(tx.init, jax.ShapeDtypeStruct((size,), np.float32))
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state)) // size


def steady_state_bytes(num_params: int, num_tensors: int, tx: optax.GradientTransformation,
                       delta_broadcast: bool = False) -> int:
  """Bytes of Theta and the outer state, with one optimizer state per tensor, and R_p with the
  delta broadcast (see the module docstring): what the syncer holds between rounds with
  anchor="learner"."""
  scalars = jax.eval_shape(tx.init, jax.ShapeDtypeStruct((1,), np.float32))
  scalar_bytes = sum(leaf.dtype.itemsize for leaf in jax.tree.leaves(scalars) if leaf.shape == ())
  copies = 1 + outer_state_slots(tx) + int(delta_broadcast)
  return _FLOAT_BYTES * num_params * copies + num_tensors * scalar_bytes


def _nbytes(tree: Any) -> int:
  return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(tree))


class GlobalModel:
  """Theta_p, its version and outer state for every fragment; merges that advance them."""

  def __init__(self, *, fragments: Sequence[fragments_lib.Fragment],
               initial_params: Mapping[str, np.ndarray], mesh: Mesh,
               outer_tx: optax.GradientTransformation, merge: settings_lib.MergeSettings,
               compression: settings_lib.CompressionSettings, num_learners: int,
               inner_learning_rates: Sequence[float] | np.ndarray | None = None,
               staleness_scaling: str = "none", fused: bool = True,
               owned: Sequence[int] | None = None, merge_threads: int = 2):
    """`owned`: the fragments this model holds (a shard's, `algorithm/shards.py`); None: all of
    them. `inner_learning_rates[t]`: the learners' inner rate of update t (the robust merge judges
    norms per unit of it); None judges them per step. `staleness_scaling`:
    `config.outer.staleness_scaling` (`merge.STALENESS_SCALINGS`). `fused=False` keeps the
    per-tensor programs over numpy-encoded outer gradients (see the module docstring).
    `merge_threads`: the fused merge's worker threads (`fused_merge.FusedMerge`)."""
    self.fragments = tuple(fragments)
    self.owned = tuple(range(len(self.fragments))) if owned is None else tuple(sorted(owned))
    self.mesh = mesh
    self._merge = merge
    self._compression = compression
    self._tx = outer_tx
    if staleness_scaling not in merge_lib.STALENESS_SCALINGS:
      raise ValueError(f"config.outer.staleness_scaling={staleness_scaling!r} must be one of "
                       f"{merge_lib.STALENESS_SCALINGS}")
    self._staleness_scaling = staleness_scaling
    shards = mesh.devices.size
    self._padded_learners = -(-num_learners // shards) * shards
    self._replicated = NamedSharding(mesh, PartitionSpec())
    self._by_learner = NamedSharding(mesh, PartitionSpec(devices_lib.SYNCER_AXIS))
    self._lock = threading.Lock()  # params() is read from other threads than install()
    # A fragment another shard owns holds no tensor here (an empty dict): every loop over the
    # fragments' tensors below passes over it.
    self._theta = [{n: np.asarray(initial_params[n], np.float32) for n in f.names}
                   if f.index in self.owned else {} for f in self.fragments]
    self._versions = [0] * len(self.fragments)
    # The delta broadcast: R_p per fragment (what the learners hold; the initial Theta_p at version
    # 0, which every learner starts from), and whether its next broadcast must be a keyframe.
    self._delta = compression.broadcast_delta != "none"
    self._received = [dict(theta) for theta in self._theta] if self._delta else None
    self._keyframe_due = [False] * len(self.fragments)
    self._keep_history = merge.anchor == "syncer"
    self._history = [{0: dict(theta)} if self._keep_history and p in self.owned else {}
                     for p, theta in enumerate(self._theta)]
    self._opt_states = [{n: jax.device_put(self._tx.init(v), self._replicated)
                         for n, v in theta.items()} for theta in self._theta]
    self._num_learners = num_learners
    self._norm_windows = [robust.NormWindow() for _ in self.fragments]
    self._step_scale = robust.StepScale(inner_learning_rates)
    self._merge_fns = {average: self._build_merge_fn(average) for average in (False, True)}
    self._programs: dict[tuple[tuple[int, ...], bool], Any] = {}
    self._fused = None
    if fused and shards == 1 and merge.anchor == "learner":
      self._fused = fused_merge.FusedMerge(
          sharding=self._replicated, tx=outer_tx, rule=merge.rule, weighting=merge.weighting,
          outer_grad=compression.outer_grad, broadcast_delta=compression.broadcast_delta,
          block_size=compression.block_size, num_slots=self._padded_learners,
          scaled=staleness_scaling != "none", threads=merge_threads)

  def close(self) -> None:
    """Lets the fused merge's worker threads end (the syncer stopped); the model stays readable,
    and a merge after it runs on the caller's thread."""
    if self._fused is not None:
      self._fused.close()

  # ---- set-up ------------------------------------------------------------------------------------

  def _build_merge_fn(self, average: bool):
    rule, weighting, tx = self._merge.rule, self._merge.weighting, self._tx

    def merge_and_step(theta, opt_state, deltas_M, tokens_M, steps_M):
      weights_M = merge_lib.learner_weights(tokens_M, steps_M, weighting)
      names = frozenset({"t"}) if average else frozenset()
      delta = merge_lib.merge_fragment({"t": deltas_M}, weights_M, average_names=names, rule=rule)
      theta, opt_state = outer.outer_step(tx, theta, opt_state, delta["t"])
      return theta, opt_state, weights_M

    by_learner = self._by_learner
    return jax.jit(merge_and_step,
                   in_shardings=(self._replicated, self._replicated, by_learner, by_learner,
                                 by_learner),
                   out_shardings=(self._replicated, self._replicated, self._replicated))

  def _program_key(self, fragment: fragments_lib.Fragment, name: str):
    return self._theta[fragment.index][name].shape, name in fragment.embedding_names

  def compile(self) -> float:
    """Compiles one merge program per tensor shape ahead of time; returns the seconds it took."""
    start = time.perf_counter()
    owned = [self.fragments[p] for p in self.owned]
    if self._fused is not None:
      for fragment in owned:
        self._fused.compile(self._theta[fragment.index], self._opt_states[fragment.index],
                            fragment.embedding_names)
      return time.perf_counter() - start
    for fragment in owned:
      for name in fragment.names:
        key = self._program_key(fragment, name)
        if key in self._programs:
          continue
        theta = self._theta[fragment.index][name]
        deltas = np.zeros((self._padded_learners,) + theta.shape, np.float32)
        counters = np.zeros(self._padded_learners, np.float32)
        self._programs[key] = self._merge_fns[key[1]].lower(
            theta, self._opt_states[fragment.index][name], deltas, counters, counters).compile()
    return time.perf_counter() - start

  def program(self, p: int, name: str):
    """The compiled merge program of one tensor (for inspection)."""
    return self._programs[self._program_key(self.fragments[p], name)]

  # ---- reading ---------------------------------------------------------------------------------

  def params(self) -> dict[str, np.ndarray]:
    """Theta (all fragments); the arrays are never written after they are installed."""
    with self._lock:
      return {n: v for theta in self._theta for n, v in theta.items()}

  def fragment_params(self, p: int) -> dict[str, np.ndarray]:
    with self._lock:
      return dict(self._theta[p])

  def offer_wire_bytes(self, p: int) -> int:
    """Bytes of one learner's outer gradient of fragment p in the wire format."""
    fmt = self._compression
    return sum(compression_lib.encoded_nbytes(n, fmt.outer_grad, fmt.block_size)
               for n in self.fragments[p].sizes)

  def version(self, p: int) -> int:
    return self._versions[p]

  @property
  def versions(self) -> tuple[int, ...]:
    return tuple(self._versions)

  @property
  def kept_versions(self) -> list[list[int]]:
    """Per fragment, the versions kept for anchor="syncer" (empty otherwise)."""
    return [sorted(h) for h in self._history]

  def held_bytes(self) -> int:
    """Bytes of the arrays held now: Theta, R_p (delta broadcast; counted in full even while a
    fragment never merged shares Theta_p's arrays), the outer states, the kept versions."""
    with self._lock:
      theta = sum(_nbytes(t) for t in self._theta)
      received = _nbytes(self._received) if self._delta else 0
    return (theta + received + sum(_nbytes(h) for h in self._history)
            + sum(_nbytes(s) for s in self._opt_states))

  def steady_state_bytes(self) -> int:
    """What `held_bytes()` must equal between rounds with anchor="learner"."""
    num_params = sum(v.size for theta in self._theta for v in theta.values())
    num_tensors = sum(len(theta) for theta in self._theta)
    return steady_state_bytes(num_params, num_tensors, self._tx, self._delta)

  def received_fragment(self, p: int) -> dict[str, np.ndarray]:
    """What an up-to-date learner holds of fragment p: R_p with the delta broadcast, else Theta_p
    (which it received through the broadcast format)."""
    with self._lock:
      return dict(self._received[p] if self._delta else self._theta[p])

  # ---- merging ---------------------------------------------------------------------------------

  def screen(self, p: int, offers: Sequence[messages.Offer]) -> Screening:
    """Judges each offer's outer gradient Delta_m = anchor - theta_m (the robust merge).

    The learner's own Delta_m, whatever `merge.anchor`: a learner is judged by what it did, not by
    how far Theta_p moved since its anchor. And per unit of the inner learning rate over the steps
    the offer covers (`robust.StepScale`): an honest offer that waited 11 steps for a merge of p (a
    learner that rejoined behind its peers, or one the last rounds missed) moves about 11x as far
    as the 1-step offers the window holds, one made after the warmup 10-20x as far as one made
    early in it; by its raw norm it would be an outlier, rejected in every round, the flush's
    included, and its steps never merged (seen in a chaos soak). A diverged or corrupted state is
    orders of magnitude off, per unit of learning rate too. Reads the fragment's window of accepted norms and changes nothing, so like
    `merge` it runs at most once at a time per fragment, and the caller keeps its outcome
    (`keep_screening`) before the next screen of that fragment.
    """
    names = self.fragments[p].names
    prepared = None
    if self._fused is not None:
      prepared = self._fused.prepare(names, offers)
      norms = [self._screen_norm(names, offer, math.sqrt(part.raw_sumsq))
               for offer, part in zip(offers, prepared)]
    else:
      norms = [self._screen_norm(names, offer) for offer in offers]
    verdicts, window = robust.judge_round([o.learner for o in offers], norms,
                                          self._norm_windows[p], self._merge.max_norm_ratio,
                                          self._num_learners)
    accepted = [v.reason is None for v in verdicts]
    return Screening(
        fragment=p,
        accepted=tuple(o for o, ok in zip(offers, accepted) if ok),
        norms=tuple(v.norm for v in verdicts if v.reason is None),
        rejected=tuple(Rejection(o, v.reason, v.norm, v.median)
                       for o, v in zip(offers, verdicts) if v.reason is not None),
        window=window,
        prepared=None if prepared is None else tuple(
            part for part, ok in zip(prepared, accepted) if ok))

  def _screen_norm(self, names: Sequence[str], offer: messages.Offer,
                   norm: float | None = None) -> float:
    """||Delta_m|| per unit of learning rate. `norm`: the fused merge's, from float32 sums of
    squares per block; where those overflowed (a value past 1e19) or met a NaN, the float64 norm
    decides, so that a huge but finite offer is an outlier, as `robust.fragment_norm` says, not a
    non-finite one."""
    if norm is None or not math.isfinite(norm):
      norm = robust.fragment_norm(offer.outer_gradient(name) for name in names)
    return norm / self._step_scale(offer.step, offer.steps)

  def keep_screening(self, screening: Screening) -> None:
    """Makes a screen's outcome the yardstick of the fragment's next screen, whether or not a merge
    followed (every offer rejected: none did)."""
    self._norm_windows[screening.fragment] = screening.window

  def merge(self, p: int, offers: Sequence[messages.Offer],
            prepared: Sequence[fused_merge.PreparedOffer] | None = None) -> MergeResult:
    """The next Theta_p from `offers`, computed but not installed.

    Reads Theta_p, its outer state and its kept versions, so the caller runs at most one merge of
    a fragment at a time and installs it before starting the next. `prepared`: the fused merge's
    round trip of these offers, as `screen` made it (`Screening.prepared`); None makes it here.
    """
    if self._fused is not None:
      return self._fused_merge(p, offers, prepared)
    wire_formats, fragment = self._compression, self.fragments[p]
    tokens = np.zeros(self._padded_learners, np.float32)
    steps = np.zeros(self._padded_learners, np.float32)
    for offer in offers:
      tokens[offer.learner], steps[offer.learner] = offer.tokens, offer.steps
    theta_p, opt_p = self._theta[p], self._opt_states[p]
    scales = self._staleness_scales(p, offers)
    new_theta, new_opt = {}, {}
    bytes_up, encode_s, merge_s = 0, 0.0, 0.0
    weights = None
    for name in fragment.names:
      t0 = time.monotonic()
      stacked = np.zeros((self._padded_learners,) + theta_p[name].shape, np.float32)
      for offer in offers:
        encoded = offer.wire_outer_gradient(name, wire_formats.outer_grad,
                                            wire_formats.block_size)
        bytes_up += encoded.nbytes
        stacked[offer.learner] = compression_lib.decode(encoded)
        if self._merge.anchor == "syncer":
          # Delta = Theta_now - theta_m = (anchor_m - theta_m) + (Theta_now - anchor_m).
          stacked[offer.learner] += theta_p[name] - self._kept(p, offer.anchor_version, name)
        if scales is not None:
          stacked[offer.learner] *= scales[offer.learner]
      t1 = time.monotonic()
      program = self._programs[self._program_key(fragment, name)]
      theta, new_opt[name], weights = program(theta_p[name], opt_p[name], stacked, tokens, steps)
      new_theta[name] = np.asarray(theta)
      encode_s, merge_s = encode_s + (t1 - t0), merge_s + (time.monotonic() - t1)
    t2 = time.monotonic()
    wire, base_version, received = self._broadcast_of(p, new_theta)
    return MergeResult(p, new_theta, new_opt, wire, np.asarray(weights), bytes_up, encode_s,
                       merge_s, time.monotonic() - t2, base_version, received)

  def _fused_merge(self, p: int, offers: Sequence[messages.Offer],
                   prepared: Sequence[fused_merge.PreparedOffer] | None) -> MergeResult:
    fragment = self.fragments[p]
    if prepared is None:
      prepared = self._fused.prepare(fragment.names, offers)
    tokens = np.zeros(self._padded_learners, np.float32)
    steps = np.zeros(self._padded_learners, np.float32)
    for offer in offers:
      tokens[offer.learner], steps[offer.learner] = offer.tokens, offer.steps
    scales = self._staleness_scales(p, offers)
    scale_M = None
    if scales is not None:
      scale_M = np.ones(self._padded_learners, np.float32)
      for learner, scale in scales.items():
        scale_M[learner] = scale
    started = time.monotonic()
    new_theta, new_opt, weights = self._fused.step(
        self._theta[p], self._opt_states[p], {o.learner: part for o, part in zip(offers, prepared)},
        tokens, steps, scale_M, fragment.embedding_names)
    self._fused.release(prepared)
    merge_s = time.monotonic() - started
    bytes_up = len(offers) * sum(
        compression_lib.encoded_nbytes(v.size, self._compression.outer_grad,
                                       self._compression.block_size)
        for v in self._theta[p].values())
    started = time.monotonic()
    wire, base_version, received = self._broadcast_of(p, new_theta)
    return MergeResult(p, new_theta, new_opt, wire, weights, bytes_up,
                       sum(part.seconds for part in prepared), merge_s,
                       time.monotonic() - started, base_version, received)

  def _staleness_scales(self, p: int, offers: Sequence[messages.Offer]
                        ) -> dict[int, np.float32] | None:
    """Per learner, the factor on its outer gradient (`merge.staleness_scale`) for a merge of p
    now, from how far Theta_p's version is past the offer's anchor; None with the scaling off,
    so that the default merge's arithmetic is what it always was."""
    if self._staleness_scaling == "none":
      return None
    staleness = [self._versions[p] - offer.anchor_version for offer in offers]
    scales = np.asarray(merge_lib.staleness_scale(staleness, self._staleness_scaling))
    return {offer.learner: scales[i] for i, offer in enumerate(offers)}

  def _broadcast_of(self, p: int, new_theta: Mapping[str, np.ndarray]
                    ) -> tuple[dict[str, compression_lib.Encoded], int | None,
                               dict[str, np.ndarray] | None]:
    """(wire, base_version, the new R_p) of the next Theta_p: the full value in the broadcast
    format, or with the delta broadcast encode(Theta_p_new - R_p) against R_p's version (a
    keyframe, the full value, while `require_keyframes` holds for p)."""
    formats = self._compression
    if not self._delta or self._keyframe_due[p]:
      wire = compression_lib.encode_tree(new_theta, formats.broadcast, formats.block_size)
      return wire, None, compression_lib.decode_tree(wire) if self._delta else None
    base = self._received[p]
    if self._fused is not None and self._fused.delta_in_programs:
      wire, received = self._fused.broadcast(new_theta, base)
      return wire, self._versions[p], received
    wire = compression_lib.encode_tree({n: v - base[n] for n, v in new_theta.items()},
                                       formats.broadcast_delta, formats.block_size)
    # The learners' sum, in the same float32 arithmetic: R_p stays what they hold, bit for bit.
    received = {n: base[n] + compression_lib.decode(enc) for n, enc in wire.items()}
    return wire, self._versions[p], received

  def keyframe(self, result: MergeResult) -> dict[str, compression_lib.Encoded]:
    """A merge's new value in full, in the broadcast format: what a learner that does not hold the
    base version of a delta is sent instead (and what a replay applies)."""
    if result.base_version is None:
      return result.wire
    return compression_lib.encode_tree(result.received, self._compression.broadcast,
                                       self._compression.block_size)

  def require_keyframes(self) -> None:
    """The next broadcast of every fragment is a keyframe (delta broadcast): after the syncer
    restored a state, R_p may not be what the learners hold."""
    self._keyframe_due = [True] * len(self.fragments)

  def unchanged(self, p: int) -> MergeResult:
    """A merge that keeps Theta_p and its outer state: in lock-step modes a round whose every offer
    was rejected still broadcasts (the learners wait for a new version), and each learner then
    drops its rejected progress for Theta_p."""
    started_at = time.monotonic()
    with self._lock:
      theta = dict(self._theta[p])
    wire, base_version, received = self._broadcast_of(p, theta)
    return MergeResult(p, theta, dict(self._opt_states[p]), wire,
                       np.zeros(self._num_learners, np.float32), 0, 0.0, 0.0,
                       time.monotonic() - started_at, base_version, received)

  def _kept(self, p: int, version: int, name: str) -> np.ndarray:
    try:
      return self._history[p][version][name]
    except KeyError:
      raise RuntimeError(
          f"an offer of fragment {p} is anchored at version {version}, which is no longer kept "
          f"(kept: {sorted(self._history[p])}); this is a bug in the syncer's history pruning"
      ) from None

  def wire(self, p: int) -> tuple[int, dict[str, compression_lib.Encoded]]:
    """(version, Theta_p in the broadcast format): what a learner joining now must receive. With
    the delta broadcast, R_p instead (a keyframe): what the learners up to date hold."""
    with self._lock:
      version = self._versions[p]
      theta = self._received[p] if self._delta else self._theta[p]
    return version, compression_lib.encode_tree(theta, self._compression.broadcast,
                                                self._compression.block_size)

  def received(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Theta as the learners received it (through the broadcast format) and its versions.

    Each fragment is read with its version under the lock; fragments may be read a merge apart,
    which a joining learner's `_Attach` makes good (the syncer sends it whatever is newer). A
    shard's: its own fragments' tensors, and version 0 of the others.
    """
    thetas, versions = [], np.zeros(len(self.fragments), np.int64)
    for p in self.owned:
      versions[p], wire = self.wire(p)
      thetas.append(compression_lib.decode_tree(wire))
    return {name: value for theta in thetas for name, value in theta.items()}, versions

  def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, JSON values) of Theta, the outer states and the versions, for a checkpoint.

    Call it on the thread that installs merges: it reads every fragment at one instant.
    """
    with self._lock:
      theta = [dict(t) for t in self._theta]
      versions = list(self._versions)
    opt = [dict(o) for o in self._opt_states]
    pairs = [(p, n) for p, t in enumerate(theta) for n in t]
    names = [n for _, n in pairs]
    arrays = {
        "theta": {f"{i:04d}": theta[p][n] for i, (p, n) in enumerate(pairs)},
        "opt": {f"{i:04d}": {f"{j:04d}": leaf for j, leaf in enumerate(jax.tree.leaves(opt[p][n]))}
                for i, (p, n) in enumerate(pairs)},
    }
    # The robust merge's yardsticks: a restarted syncer judges offers as the lost one would have.
    windows = [{"norms": list(w.norms), "outliers": sorted(w.outliers)} for w in self._norm_windows]
    # Norms per unit of learning rate; checkpoints written before they were ("norm_windows", per
    # step) are not comparable and are not read: those windows refill from the next offers.
    return arrays, {"names": names, "versions": versions, "norm_windows_per_lr": windows}

  def load_state(self, arrays: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """Makes a checkpoint's Theta, outer states and versions current (before any merge runs)."""
    names = list(values["names"])
    expected = [n for t in self._theta for n in t]
    if names != expected:
      raise ValueError(f"the checkpoint's global model has tensors {names[:3]}..., this run's "
                       f"{expected[:3]}...: not the same model")
    by_name = {n: i for i, n in enumerate(names)}
    with self._lock:
      for p, theta in enumerate(self._theta):
        for n in theta:
          saved = np.asarray(arrays["theta"][f"{by_name[n]:04d}"], np.float32)
          if saved.shape != theta[n].shape:
            raise ValueError(f"the checkpoint's {n} has shape {saved.shape}, this model's "
                             f"{theta[n].shape}")
          theta[n] = saved
          treedef = jax.tree.structure(self._opt_states[p][n])
          leaves = arrays["opt"][f"{by_name[n]:04d}"]
          self._opt_states[p][n] = jax.device_put(
              jax.tree.unflatten(treedef, [leaves[k] for k in sorted(leaves)]), self._replicated)
        self._versions[p] = int(values["versions"][p])
        if self._delta:
          self._received[p] = dict(theta)
        if self._keep_history and p in self.owned:
          self._history[p] = {self._versions[p]: dict(theta)}
    self.require_keyframes()  # R_p is not in the checkpoint
    for p, window in enumerate(values.get("norm_windows_per_lr", ())):
      self._norm_windows[p] = dataclasses.replace(
          self._norm_windows[p], norms=tuple(float(n) for n in window["norms"]),
          outliers=frozenset(int(m) for m in window["outliers"]))

  def take_newer(self, p: int, version: int, theta: Mapping[str, np.ndarray]) -> bool:
    """Adopts `theta` as Theta_p at `version` if that is newer than the current one (a restarted
    syncer taking a live learner's anchor); the outer state stays. Returns whether it did."""
    with self._lock:
      if version <= self._versions[p]:
        return False
      self._theta[p] = {n: np.asarray(theta[n], np.float32) for n in self._theta[p]}
      self._versions[p] = int(version)
      if self._delta:
        self._received[p] = dict(self._theta[p])  # the learner's anchor: R_p at `version`
      if self._keep_history:
        self._history[p] = {version: dict(self._theta[p])}
    return True

  def install(self, result: MergeResult, anchored: Iterable[int] = ()) -> int:
    """Makes a merge current; returns Theta_p's new version.

    `anchored`: the versions of fragment p that live learners or offers in flight may still be
    anchored at. With anchor="syncer" the versions older than all of them are dropped.
    """
    p = result.fragment
    with self._lock:
      self._theta[p] = result.theta
      self._versions[p] += 1
      version = self._versions[p]
      if self._delta:
        self._received[p] = result.received
        self._keyframe_due[p] = False
    self._opt_states[p] = result.opt_state
    if self._keep_history:
      history = self._history[p]
      # What the learners received.
      history[version] = (result.received if self._delta
                          else compression_lib.decode_tree(result.wire))
      oldest = min(anchored, default=version)
      for old in [v for v in history if v < oldest]:
        del history[old]
    return version
