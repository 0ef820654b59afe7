"""Tests of decoupled_diloco.lm.inner: the AdamW schedule, sharded train state and jitted steps."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from conftest import default_settings
from decoupled_diloco.lm import inner, model

TINY = default_settings("model", embed_dim=32, num_layers=2, num_heads=2, head_dim=16, mlp_dim=64,
                        max_seq_len=16)
TOTAL_STEPS = 100


def _inner_config(**overrides) -> inner.InnerConfig:
  fields = dict(learning_rate=1e-2, warmup_steps=5, final_lr_fraction=0.1, weight_decay=0.01,
                b1=0.9, b2=0.95, eps=1e-8, grad_clip_norm=1.0)
  fields.update(overrides)
  return default_settings("inner", **fields)


def _mesh(data: int, tensor: int) -> Mesh:
  devices = np.array(jax.devices()[: data * tensor]).reshape(data, tensor)
  return Mesh(devices, ("data", "model"))


def _batch(seed: int, batch: int = 4, length: int = 16) -> dict[str, np.ndarray]:
  # A learnable pattern: each target is the input plus one (mod 256).
  inputs = np.random.default_rng(seed).integers(0, 256, (batch, length)).astype(np.int32)
  return {"inputs": inputs, "targets": (inputs + 1) % 256}


@functools.lru_cache(maxsize=None)
def _setup(data: int, tensor: int, scan_layers: bool = False):
  """(graphdef, shardings, fresh state, jitted step) on a data x tensor mesh, compiled once.

  Sharing is safe: states are immutable and the step does not donate its input.
  """
  mesh = _mesh(data, tensor)
  cfg = dataclasses.replace(TINY, scan_layers=scan_layers)
  graphdef, params = model.init_params(cfg, mesh, seed=0)
  shardings = model.param_shardings(cfg, mesh)
  tx = inner.make_inner_optimizer(_inner_config(), TOTAL_STEPS)
  state = inner.init_train_state(params, tx, mesh, shardings)
  state_shardings = inner.train_state_shardings(state, mesh, shardings)
  step_fn = inner.make_train_step(graphdef, tx, mesh, state_shardings)
  return graphdef, shardings, state, step_fn


def test_schedule_warms_up_from_zero_then_decays_to_final_fraction():
  cfg = _inner_config(learning_rate=3e-3, warmup_steps=10, final_lr_fraction=0.1)
  schedule = inner.make_learning_rate_schedule(cfg, total_steps=110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(1.5e-3)
  assert float(schedule(10)) == pytest.approx(3e-3)
  # Halfway through the cosine, the lr is midway between peak and floor.
  assert float(schedule(60)) == pytest.approx((3e-3 + 3e-4) / 2, rel=1e-4)
  assert float(schedule(110)) == pytest.approx(3e-4)


def test_the_host_and_the_compiled_step_follow_optax_s_schedule():
  """inner.learning_rates (the robust merge's yardstick) and the schedule the compiled step reads
  from its argument are optax's warmup-cosine, with or without a warmup."""
  for cfg, total in ((_inner_config(learning_rate=3e-3, warmup_steps=10), 110),
                     (_inner_config(warmup_steps=0, final_lr_fraction=0.0), 7)):
    expected = np.asarray(inner.make_learning_rate_schedule(cfg, total)(np.arange(total + 2)))
    np.testing.assert_allclose(inner.learning_rates(cfg, total), expected[:total], rtol=1e-6,
                               atol=1e-12)
    values = jnp.asarray(inner.make_inner_optimizer(cfg, total).schedule_values)
    traced = jax.jit(lambda count, v: inner._traced_schedule(v)(count))(  # pylint: disable=protected-access
        jnp.arange(total + 2), values)
    np.testing.assert_allclose(traced, expected, rtol=1e-5, atol=1e-12)


def test_runs_that_differ_only_in_their_schedule_share_one_program_and_step_on_their_own():
  """The schedule is an argument of the compiled step, not constants in it: another learning
  rate, warmup, final fraction or number of steps gives the same program (one compilation for a
  study's arms, a resumed run given more steps, the tests), and each step moves the parameters
  by its own rate: a step at twice the rate moves them twice as far (AdamW's update is the rate
  times a direction the rate does not change)."""
  graphdef, _, state, compiled = _setup(1, 1)  # its schedule: _inner_config(), TOTAL_STEPS
  params = state.params
  configs = [(_inner_config(warmup_steps=0, learning_rate=1e-3), 50),
             (_inner_config(warmup_steps=0, learning_rate=2e-3, final_lr_fraction=0.5), 400)]
  mesh = _mesh(1, 1)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  programs, moved = [compiled.lower(state, _batch(0)).as_text()], []
  for cfg, total in configs:
    tx = inner.make_inner_optimizer(cfg, total)
    step = inner.make_train_step(graphdef, tx, mesh, state_shardings)
    programs.append(step.lower(state, _batch(0)).as_text())
    # As assembly.learner_parts does: the program compiled once, on this run's schedule.
    new_state, _ = compiled.with_schedule(tx.schedule_values)(state, _batch(0))
    moved.append({n: np.asarray(new_state.params[n]) - np.asarray(params[n]) for n in params})
  assert programs[0] == programs[1] == programs[2]
  name = model.EMBEDDING_NAME
  np.testing.assert_allclose(moved[1][name], 2 * moved[0][name], rtol=1e-4, atol=1e-9)
  assert np.abs(moved[0][name]).max() > 0


def test_first_step_moves_nothing_because_warmup_starts_at_zero():
  # Weight decay is scaled by the same zero lr, so it moves nothing either.
  _, _, state, step_fn = _setup(1, 1)
  new_state, _ = step_fn(state, _batch(0))
  for name in state.params:
    np.testing.assert_array_equal(state.params[name], new_state.params[name])


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_loss_decreases_on_a_repeated_batch(scan_layers):
  _, _, state, step_fn = _setup(2, 1, scan_layers)
  batch = _batch(0)
  losses = []
  for _ in range(30):
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics["loss"]))
  assert int(state.step) == 30
  # Starts near the uniform ln(256) = 5.55 nats; 30 AdamW steps memorise most of the batch.
  assert losses[0] > 4.0
  assert losses[-1] < losses[0] - 2.0
  assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("data, tensor", [(2, 1), (1, 2)])
def test_step_keeps_param_and_moment_shardings(data, tensor, scan_layers):
  _, shardings, state, step_fn = _setup(data, tensor, scan_layers)
  new_state, metrics = step_fn(state, _batch(0))
  for name, sharding in shardings.items():
    assert new_state.params[name].sharding == sharding, name
  clip_state, (adam_state, *_rest) = new_state.opt_state
  del clip_state
  assert adam_state.mu.keys() == shardings.keys()
  for name, sharding in shardings.items():
    assert adam_state.mu[name].sharding == sharding, name
    assert adam_state.nu[name].sharding == sharding, name
  assert adam_state.count.sharding.is_fully_replicated
  assert new_state.step.dtype == jnp.int32 and int(new_state.step) == 1
  assert metrics["loss"].shape == () and metrics["grad_norm"].shape == ()
  if tensor == 2:
    assert new_state.params[model.EMBEDDING_NAME].sharding.spec == P("model", None)


def test_old_state_stays_readable_after_a_step():
  # The runtime keeps old param arrays as consistent snapshots, so the step must not donate them.
  _, _, state, step_fn = _setup(2, 1)
  step_fn(state, _batch(0))
  assert not any(p.is_deleted() for p in state.params.values())
  _ = np.asarray(state.params[model.EMBEDDING_NAME])


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_two_device_data_parallel_matches_one_device(scan_layers):
  _, _, state_2, step_2 = _setup(2, 1, scan_layers)
  _, _, state_1, step_1 = _setup(1, 1, scan_layers)
  for seed in range(4):
    batch = _batch(seed)
    state_2, metrics_2 = step_2(state_2, batch)
    state_1, metrics_1 = step_1(state_1, batch)
    assert float(metrics_2["loss"]) == pytest.approx(float(metrics_1["loss"]), abs=1e-5)
    assert float(metrics_2["grad_norm"]) == pytest.approx(float(metrics_1["grad_norm"]), rel=1e-4)
  for name in state_1.params:
    np.testing.assert_allclose(state_2.params[name], state_1.params[name], atol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_eval_step_sums_nats_and_counts_tokens(scan_layers):
  graphdef, shardings, state, step_fn = _setup(2, 1, scan_layers)
  eval_fn = inner.make_eval_step(graphdef, _mesh(2, 1), shardings)
  batch = _batch(3)
  sum_nats, num_tokens = eval_fn(state.params, batch)
  assert int(num_tokens) == 4 * 16
  # The train step reports the loss of the parameters it was given.
  _, metrics = step_fn(state, batch)
  assert float(sum_nats) / int(num_tokens) == pytest.approx(float(metrics["loss"]), rel=1e-5)


def _train_step_program(num_layers: int, scan_layers: bool) -> str:
  """StableHLO text of the whole train step (forward, backward, AdamW): a deterministic stand-in
  for its compile time."""
  mesh = _mesh(1, 1)
  cfg = dataclasses.replace(TINY, num_layers=num_layers, scan_layers=scan_layers)
  shardings = model.param_shardings(cfg, mesh)
  tx = inner.make_inner_optimizer(_inner_config(), TOTAL_STEPS)
  params = model.native_shapes(cfg)
  state = inner.TrainState(params, jax.eval_shape(tx.init, params),
                           jax.ShapeDtypeStruct((), jnp.int32))
  step = inner.make_train_step(model.graph(cfg), tx, mesh,
                               inner.train_state_shardings(state, mesh, shardings))
  batch = {k: jax.ShapeDtypeStruct((4, 16), jnp.int32) for k in ("inputs", "targets")}
  return step.lower(state, batch).as_text()


@pytest.mark.parametrize("scan_layers, bounds", [(True, (1.0, 1.02)), (False, (3.0, 5.0))])
def test_stacked_train_step_does_not_grow_with_depth(scan_layers, bounds):
  """With stacked layers the optimizer too updates one array per tensor kind."""
  shallow, deep = (_train_step_program(n, scan_layers) for n in (4, 16))
  low, high = bounds
  assert low <= len(deep) / len(shallow) <= high, (len(shallow), len(deep))


def test_batch_sharding_splits_batch_over_data():
  assert inner.batch_sharding(_mesh(2, 1)).spec == P("data", None)


@pytest.mark.parametrize("field, value", [
    ("learning_rate", 0.0), ("warmup_steps", 100), ("warmup_steps", -1), ("b1", 1.0),
    ("b2", -0.1), ("eps", 0.0), ("weight_decay", -1.0), ("grad_clip_norm", -1.0),
    ("final_lr_fraction", 1.5),
])
def test_optimizer_errors_name_the_field(field, value):
  with pytest.raises(ValueError, match=rf"config\.inner\.{field}="):
    inner.make_inner_optimizer(_inner_config(**{field: value}), TOTAL_STEPS)


def test_clipping_is_chained_only_when_grad_clip_norm_is_positive():
  params = {"w": jnp.ones((3,))}
  plain = inner.make_inner_optimizer(_inner_config(grad_clip_norm=0.0), TOTAL_STEPS).init(params)
  clipped = inner.make_inner_optimizer(_inner_config(grad_clip_norm=1.0), TOTAL_STEPS).init(params)
  # Plain AdamW state starts with ScaleByAdamState; the chain puts the clip state in front.
  assert plain[0].mu.keys() == {"w"}
  assert clipped[1][0].mu.keys() == {"w"}


def test_evaluation_over_stacked_batches_sums_like_batch_by_batch():
  graphdef, shardings, state, _ = _setup(2, 1)
  mesh = _mesh(2, 1)
  batches = [_batch(seed) for seed in range(3)]
  one_by_one = inner.make_eval_step(graphdef, mesh, shardings)
  nats = sum(float(one_by_one(state.params, b)[0]) for b in batches)
  stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
  total, tokens = inner.make_eval_over_batches(graphdef, mesh, shardings)(state.params, stacked)
  assert int(tokens) == 3 * 4 * 16
  assert float(total) == pytest.approx(nats, rel=1e-5)
