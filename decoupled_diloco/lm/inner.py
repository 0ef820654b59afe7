"""The inner optimizer of a learner and its jitted train and eval steps.

Each learner runs ordinary data-parallel (+ optional tensor-parallel) AdamW training on its own mesh
(DiLoCo, arXiv 2311.08105, Algorithm 1, inner loop). The steps are compiled with explicit in/out
shardings on that mesh, so a learner's program never touches another learner's devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from decoupled_diloco.lm import model


class TrainState(NamedTuple):
  """What one learner carries from inner step to inner step."""

  params: dict[str, jax.Array]  # Flat, keyed like `model.init_params`.
  opt_state: optax.OptState
  step: jax.Array  # int32 scalar: inner steps taken.


@dataclasses.dataclass(frozen=True)
class InnerConfig:
  """The learners' AdamW and its schedule; `settings.validate` builds it from `config.inner`."""

  learning_rate: float  # peak, after the warmup
  warmup_steps: int
  final_lr_fraction: float  # the cosine ends at learning_rate x this at the last step
  weight_decay: float
  b1: float
  b2: float
  eps: float
  grad_clip_norm: float  # global norm; 0 = no clipping

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.inner.{f.name}={value!r} must be a number")
    if not self.learning_rate > 0:
      raise ValueError(f"config.inner.learning_rate={self.learning_rate} must be > 0")
    if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
      raise ValueError(f"config.inner.warmup_steps={self.warmup_steps!r} must be an integer >= 0")
    if not 0.0 <= self.final_lr_fraction <= 1.0:
      raise ValueError(
          f"config.inner.final_lr_fraction={self.final_lr_fraction} must be in [0, 1]")
    if not self.weight_decay >= 0:
      raise ValueError(f"config.inner.weight_decay={self.weight_decay} must be >= 0")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"config.inner.{name}={getattr(self, name)} must be in [0, 1)")
    if not self.eps > 0:
      raise ValueError(f"config.inner.eps={self.eps} must be > 0")
    if not self.grad_clip_norm >= 0:
      raise ValueError(
          f"config.inner.grad_clip_norm={self.grad_clip_norm} must be >= 0 (0 = off)")


# The most of a run its warmup may take. A short run (a smoke test, --config.num_steps=4) keeps
# the experiment's other settings: its warmup is cut to this share of the run instead of failing
# on a warmup longer than the run, and the cosine still has the rest to decay over. Half: the
# default run (40 of 400 steps) and the studies (40 of 200 or 800) keep their warmup; only a run of
# under 80 steps at warmup 40 changes (one of 41-79 steps was valid before, and warmed up for most
# of its length).
MAX_WARMUP_SHARE = 0.5


def warmup_for_run(warmup_steps: int, total_steps: int) -> int:
  """The warmup a run of `total_steps` uses: `warmup_steps`, at most MAX_WARMUP_SHARE of the run."""
  return min(warmup_steps, int(total_steps * MAX_WARMUP_SHARE))


def _check_total_steps(cfg: InnerConfig, total_steps: int) -> None:
  if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
    raise ValueError(f"total_steps={total_steps!r} must be a positive integer")
  if cfg.warmup_steps >= total_steps:
    raise ValueError(
        f"config.inner.warmup_steps={cfg.warmup_steps!r} must be an integer in "
        f"[0, total_steps={total_steps})"
    )


def make_learning_rate_schedule(cfg: InnerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup 0 -> lr over `warmup_steps`, then cosine to lr * final_lr_fraction at `total_steps`."""
  _check_total_steps(cfg, total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=cfg.learning_rate,
      warmup_steps=cfg.warmup_steps,
      decay_steps=total_steps,  # optax counts the warmup inside decay_steps.
      end_value=cfg.learning_rate * cfg.final_lr_fraction,
  )


def _warmup_cosine(xp: Any, count: Any, peak: Any, warmup: Any, total: Any, end: Any) -> Any:
  """optax's linear_schedule from 0 and cosine_decay_schedule, term for term, in `xp` (numpy on
  the host, jax.numpy inside the step, where the numbers are traced)."""
  rising = -peak * (1 - xp.clip(count, 0, warmup) / xp.maximum(warmup, 1)) + peak
  decay = total - warmup
  cosine = 0.5 * (1 + xp.cos(xp.pi * xp.clip(count - warmup, 0, decay) / decay))
  alpha = xp.where(peak == 0, 0.0, end / peak)
  falling = peak * ((1 - alpha) * cosine + alpha)
  return xp.where(count < warmup, rising, falling)


def learning_rates(cfg: InnerConfig, total_steps: int) -> np.ndarray:
  """The rate of each update 0 .. total_steps - 1, on the host (float64): the same curve as
  `make_learning_rate_schedule`, without a device program per schedule."""
  _check_total_steps(cfg, total_steps)
  return _warmup_cosine(np, np.arange(total_steps, dtype=np.float64), cfg.learning_rate,
                        cfg.warmup_steps, total_steps, cfg.learning_rate * cfg.final_lr_fraction)


def _traced_schedule(values: jax.Array) -> optax.Schedule:
  """The warmup-cosine of `make_learning_rate_schedule` with its numbers [peak, warmup_steps,
  total_steps, end] read from a traced array: one compiled step serves every such schedule."""
  return lambda count: _warmup_cosine(jnp, count.astype(jnp.float32), *values)


def _adamw(cfg: InnerConfig, learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate=learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay)
  if cfg.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
  return adamw


@dataclasses.dataclass(frozen=True)
class InnerOptimizer:
  """AdamW on the warmup-cosine schedule, after global-norm clipping when grad_clip_norm > 0.

  A GradientTransformation (`init`, `update`) whose schedule `make_train_step` passes to the
  compiled step as an argument (`schedule_values`) instead of folding it in as constants: runs that
  differ only in learning rate, warmup, final fraction or number of steps (a study's arms, a
  resumed run given more steps, the tests) share one compiled program. The optimizer state has
  the same structure either way.
  """

  cfg: InnerConfig
  total_steps: int

  def __post_init__(self):
    _check_total_steps(self.cfg, self.total_steps)

  @property
  def _static(self) -> optax.GradientTransformation:
    return _adamw(self.cfg, make_learning_rate_schedule(self.cfg, self.total_steps))

  def init(self, params: Any) -> optax.OptState:
    return self._static.init(params)

  def update(self, updates: Any, state: optax.OptState, params: Any = None) -> Any:
    return self._static.update(updates, state, params)

  @property
  def schedule_values(self) -> np.ndarray:
    """[peak, warmup_steps, total_steps, end], float32: the schedule as the step's argument."""
    cfg = self.cfg
    return np.asarray([cfg.learning_rate, cfg.warmup_steps, self.total_steps,
                       cfg.learning_rate * cfg.final_lr_fraction], np.float32)

  @property
  def program_key(self) -> InnerConfig:
    """What the compiled step depends on: the config without the schedule's numbers."""
    return dataclasses.replace(self.cfg, learning_rate=1.0, warmup_steps=0, final_lr_fraction=0.0)

  def traced(self, schedule_values: jax.Array) -> optax.GradientTransformation:
    """This optimizer inside a traced step, its schedule read from `schedule_values`."""
    return _adamw(self.cfg, _traced_schedule(schedule_values))


def make_inner_optimizer(cfg: InnerConfig, total_steps: int) -> InnerOptimizer:
  """AdamW on the warmup-cosine schedule, after global-norm clipping when grad_clip_norm > 0."""
  return InnerOptimizer(cfg, total_steps)


def _replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _opt_state_shardings(opt_state: Any, mesh: Mesh,
                         param_shardings: dict[str, NamedSharding]) -> Any:
  """Moments shard like their parameters; counters and other scalars are replicated.

  Optax keeps per-parameter statistics (AdamW's mu, nu) as trees with the params' structure, so a
  dict with exactly the parameter names is a parameter-shaped subtree. This needs no handle on the
  transform and so works for any state shaped like the inner optimizer's (restored ones included).
  """
  names = param_shardings.keys()

  def is_param_tree(x: Any) -> bool:
    return isinstance(x, dict) and x.keys() == names

  def sharding_of(x: Any) -> Any:
    return dict(param_shardings) if is_param_tree(x) else _replicated(mesh)

  return jax.tree.map(sharding_of, opt_state, is_leaf=is_param_tree)


def train_state_shardings(state: TrainState, mesh: Mesh,
                          param_shardings: dict[str, NamedSharding]) -> TrainState:
  """A TrainState-shaped tree of NamedShardings; `state` may be concrete or abstract."""
  return TrainState(
      params=dict(param_shardings),
      opt_state=_opt_state_shardings(state.opt_state, mesh, param_shardings),
      step=_replicated(mesh),
  )


def abstract_train_state(params: dict[str, jax.ShapeDtypeStruct], tx: optax.GradientTransformation,
                         mesh: Mesh, param_shardings: dict[str, NamedSharding]) -> TrainState:
  """The TrainState `init_train_state` makes, as ShapeDtypeStructs with their shardings: what it
  holds on each device, and what the step compiles for, before anything is placed."""
  opt_state = jax.eval_shape(tx.init, params)
  opt_shardings = _opt_state_shardings(opt_state, mesh, param_shardings)

  def placed(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return TrainState(
      params={n: placed(p, param_shardings[n]) for n, p in params.items()},
      opt_state=jax.tree.map(placed, opt_state, opt_shardings),
      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=_replicated(mesh)))


def init_train_state(params: dict[str, jax.Array], tx: optax.GradientTransformation,
                     mesh: Mesh, param_shardings: dict[str, NamedSharding]) -> TrainState:
  """Fresh optimizer state, created directly in the parameters' layout on `mesh`."""
  abstract_opt_state = jax.eval_shape(tx.init, params)
  opt_shardings = _opt_state_shardings(abstract_opt_state, mesh, param_shardings)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), _replicated(mesh))
  return TrainState(params=params, opt_state=opt_state, step=step)


def abstract_batch(mesh: Mesh, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """A learner's [B, L] token batch as sharded ShapeDtypeStructs."""
  like = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding(mesh))
  return {"inputs": like, "targets": like}


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[B, L] token batches: batch split over data x fsdp (the "batch" logical rule), length whole."""
  return NamedSharding(mesh, model.logical_to_mesh_spec(("batch", None), mesh))


def batch_shards(mesh: Mesh) -> int:
  """How many ways the batch is split on `mesh`: a batch size must be a multiple of it."""
  return math.prod(mesh.shape[axis] for axis in _as_tuple(batch_sharding(mesh).spec[0]))


def _as_tuple(axes: Any) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _batch_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
  return {"inputs": batch_sharding(mesh), "targets": batch_sharding(mesh)}


def _mean_loss(graphdef: nnx.GraphDef, params: dict[str, jax.Array],
               batch: dict[str, jax.Array], activations: NamedSharding) -> jax.Array:
  logits_BxLxV = model.apply(graphdef, params, batch["inputs"], activations=activations)
  return jnp.mean(model.cross_entropy(logits_BxLxV, batch["targets"]))


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, mesh: Mesh,
                    state_shardings: TrainState, *, donate: bool = False
                    ) -> Callable[[TrainState, dict[str, Any]], tuple[TrainState, dict[str, jax.Array]]]:
  """Jitted (state, batch) -> (new_state, {"loss", "grad_norm"}) on `mesh`.

  loss is the mean next-token cross-entropy in nats; grad_norm is measured before clipping.

  `tx` an `InnerOptimizer`: its schedule is an argument of the program (`TrainStep`), so every
  schedule shares it; any other GradientTransformation is folded in as it is.

  `donate`: the step writes the new state into the buffers of the old one, so a learner holds one
  train state on its devices instead of two; the caller's state is deleted by the call. Whoever
  must keep reading a state after the next step is dispatched (the learner's publication, for the
  syncer's pulls) takes a copy first (`copy_tree`). The returned function says which it is in its
  `donates_state` attribute.
  """

  def train_step(state: TrainState, batch: dict[str, jax.Array], schedule: jax.Array
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
    step_tx = tx.traced(schedule) if isinstance(tx, InnerOptimizer) else tx
    loss, grads = jax.value_and_grad(_mean_loss, argnums=1)(graphdef, state.params, batch,
                                                            activations)
    updates, opt_state = step_tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

  activations = model.residual_sharding(mesh)
  replicated = _replicated(mesh)
  jitted = jax.jit(
      train_step,
      in_shardings=(state_shardings, _batch_shardings(mesh), replicated),
      out_shardings=(state_shardings, {"loss": replicated, "grad_norm": replicated}),
      donate_argnums=(0,) if donate else (),
  )
  values = tx.schedule_values if isinstance(tx, InnerOptimizer) else np.zeros(4, np.float32)
  return TrainStep(jitted, mesh, values, donate)


class TrainStep:
  """A learner's compiled step, called (state, batch) like a jitted function: it hands the
  program its learning-rate schedule, kept on the mesh, as the last argument."""

  def __init__(self, jitted: Any, mesh: Mesh, schedule_values: np.ndarray, donates_state: bool):
    self.jitted = jitted
    self.mesh = mesh
    self.donates_state = donates_state
    self.schedule_values = np.asarray(schedule_values, np.float32)
    # Placed at the first call: a step made to be compiled only, for a mesh of compile-only
    # devices (runtime/tpu_aot.py), never places anything.
    self._schedule = None
    # A mesh over several processes (a learner over several hosts): every process holds the
    # whole batch, and hands the step the rows its devices take.
    self._spans = any(d.process_index != jax.process_index() for d in mesh.devices.flat)

  def __call__(self, state: TrainState, batch: dict[str, Any]
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    if self._schedule is None:
      self._schedule = jax.device_put(self.schedule_values, _replicated(self.mesh))
    return self.jitted(state, self._global(batch), self._schedule)

  def lower(self, state: Any, batch: Any) -> Any:
    schedule = jax.ShapeDtypeStruct(self.schedule_values.shape, jnp.float32,
                                    sharding=_replicated(self.mesh))
    return self.jitted.lower(state, self._global(batch), schedule)

  def _global(self, batch: dict[str, Any]) -> dict[str, Any]:
    if not self._spans:
      return batch
    sharding = batch_sharding(self.mesh)
    return {k: v if isinstance(v, (jax.Array, jax.ShapeDtypeStruct)) else jax.make_array_from_callback(
        np.shape(v), sharding, lambda index, v=v: np.asarray(v)[index]) for k, v in batch.items()}

  def with_schedule(self, schedule_values: np.ndarray) -> TrainStep:
    """The same compiled program, stepping on another schedule."""
    return TrainStep(self.jitted, self.mesh, schedule_values, self.donates_state)

  def _cache_size(self) -> int:
    return self.jitted._cache_size()  # pylint: disable=protected-access


def donates_state(train_step: Callable[..., Any]) -> bool:
  """Whether `train_step` (from `make_train_step`, possibly wrapped) deletes the state it takes."""
  return bool(getattr(train_step, "donates_state", False))


@jax.jit
def copy_tree(tree: Any) -> Any:
  """A copy of every array of `tree` in new buffers, sharded alike: it outlives a donation of the
  original. Queued on the devices like any program, so it reads the state before a step that is
  dispatched after it overwrites it. One batched transfer for the whole tree: a jnp.copy per
  array took 4.9 ms per step for the 38 tensors of tiny_cpu's model on 2 CPU devices, this 1.5 ms
  (tiny test steps take a few ms)."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)):
    return jax.tree.map(jnp.copy, tree)  # inside a traced function: one op per array is free
  return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, tree), may_alias=False)


def make_eval_step(graphdef: nnx.GraphDef, mesh: Mesh,
                   param_shardings: dict[str, NamedSharding], *, batch_sharded: bool = True
                   ) -> Callable[[dict[str, jax.Array], dict[str, Any]], tuple[jax.Array, jax.Array]]:
  """Jitted (params, batch) -> (sum of nats, number of tokens), to be summed over eval batches.

  `batch_sharded=False` replicates the batch over the data axis (for a batch that does not divide
  it); the model axis still splits the model.
  """

  activations = model.residual_sharding(mesh) if batch_sharded else None

  def eval_step(params: dict[str, jax.Array], batch: dict[str, jax.Array]
                ) -> tuple[jax.Array, jax.Array]:
    logits_BxLxV = model.apply(graphdef, params, batch["inputs"], activations=activations,
                               mesh=mesh)
    nats_BxL = model.cross_entropy(logits_BxLxV, batch["targets"])
    return jnp.sum(nats_BxL), jnp.asarray(nats_BxL.size, jnp.int32)

  replicated = _replicated(mesh)
  batch_shardings = (_batch_shardings(mesh) if batch_sharded
                     else {"inputs": replicated, "targets": replicated})
  return jax.jit(
      eval_step,
      in_shardings=(dict(param_shardings), batch_shardings),
      out_shardings=(replicated, replicated),
  )


def make_eval_over_batches(graphdef: nnx.GraphDef, mesh: Mesh,
                           param_shardings: dict[str, NamedSharding], *, batch_sharded: bool = True
                           ) -> Callable[[dict[str, jax.Array], dict[str, Any]],
                                         tuple[jax.Array, jax.Array]]:
  """Jitted (params, batches [N, B, L]) -> (sum of nats, number of tokens) over all N batches.

  One program for the whole evaluation: on devices that a learner keeps busy, it queues behind one
  of the learner's steps instead of one per batch (8 eval batches on a training learner's CPU
  devices took 21 s one by one, ~1 s as one program).
  """

  activations = model.residual_sharding(mesh) if batch_sharded else None

  def eval_all(params: dict[str, jax.Array], batches: dict[str, jax.Array]
               ) -> tuple[jax.Array, jax.Array]:
    def body(total, batch):
      logits_BxLxV = model.apply(graphdef, params, batch["inputs"], activations=activations,
                                 mesh=mesh)
      nats_BxL = model.cross_entropy(logits_BxLxV, batch["targets"])
      return total + jnp.sum(nats_BxL), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), batches)
    return total, jnp.asarray(batches["targets"].size, jnp.int32)

  replicated = _replicated(mesh)
  batch_axes = batch_sharding(mesh).spec[0]
  stacked = NamedSharding(mesh, P(None, batch_axes, None) if batch_sharded else P())
  return jax.jit(
      eval_all,
      in_shardings=(dict(param_shardings), {"inputs": stacked, "targets": stacked}),
      out_shardings=(replicated, replicated),
  )
