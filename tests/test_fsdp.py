"""Learners bigger than a chip: the fsdp mesh axis, remat, bf16 weights and a donated train state.

The per-device bytes come from XLA's compiled memory analysis of the train step on fake CPU devices
(XLA:CPU reports the argument sizes of one device's program).
"""

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from conftest import default_settings, tiny_settings
from decoupled_diloco import settings
from decoupled_diloco.lm import inner, model
from decoupled_diloco.runtime.core import devices
from decoupled_diloco.runtime import train
from experiments import tiny_cpu

# One block: the properties here are per block, and every compile counts on a 2-core CI box.
TINY = default_settings("model", embed_dim=64, num_layers=1, num_heads=2, head_dim=16, mlp_dim=128,
                        max_seq_len=16)
BATCH = {k: jax.ShapeDtypeStruct((4, 16), jnp.int32) for k in ("inputs", "targets")}


def _mesh(data: int, fsdp: int, tensor: int = 1) -> Mesh:
  shape = (data, fsdp, tensor)
  return Mesh(np.array(jax.devices()[:np.prod(shape)]).reshape(shape), devices.LEARNER_AXES)


def _tx():
  return inner.make_inner_optimizer(default_settings("inner"), 100)


def _abstract_state(cfg, mesh):
  shardings = model.param_shardings(cfg, mesh)
  params = {n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[n])
            for n, s in model.native_shapes(cfg).items()}
  state = inner.TrainState(params, jax.eval_shape(_tx().init, params),
                           jax.ShapeDtypeStruct((), jnp.int32))
  return state, inner.train_state_shardings(state, mesh, shardings)


@functools.lru_cache(maxsize=None)
def _memory(fsdp: int, donate: bool = False):
  mesh = _mesh(1, fsdp)
  state, state_shardings = _abstract_state(TINY, mesh)
  step = inner.make_train_step(model.graph(TINY), _tx(), mesh, state_shardings, donate=donate)
  return step.lower(state, BATCH).compile().memory_analysis()


def _state_bytes_per_device(fsdp: int) -> int:
  """Bytes of params + AdamW state on one device, from the shardings' shard shapes."""
  state, shardings = _abstract_state(TINY, _mesh(1, fsdp))
  return sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
             for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)))


def test_per_device_params_and_optimizer_state_fall_as_the_fsdp_axis_grows():
  batch_bytes = 2 * 4 * 16 * 4  # inputs + targets, int32, split over fsdp like the state
  args = {f: _memory(f).argument_size_in_bytes for f in (1, 2, 4)}
  # Everything but a few scalars (step, AdamW's count) is split f ways.
  for f in (2, 4):
    assert args[f] == pytest.approx(args[1] / f, rel=0.002), args
  whole = _state_bytes_per_device(1)
  assert args[1] == pytest.approx(whole + batch_bytes, rel=0.001)
  assert _state_bytes_per_device(4) == pytest.approx(whole / 4, rel=0.002)


def test_fsdp_shards_every_weight_and_its_moments_along_embed_and_the_batch_over_data_x_fsdp():
  mesh = _mesh(2, 2)
  shardings = model.param_shardings(TINY, mesh)
  assert shardings[model.EMBEDDING_NAME].spec == P("model", "fsdp")
  assert shardings["layers/0/attn/q_proj/kernel"].spec == P("fsdp", "model", None)
  assert shardings["layers/0/mlp/down_proj/kernel"].spec == P("model", "fsdp")
  assert shardings["final_norm/scale"].spec == P("fsdp")
  assert inner.batch_sharding(mesh).spec == P(("data", "fsdp"), None)
  assert inner.batch_shards(mesh) == 4
  # A mesh without the fsdp axis leaves that split out.
  two_axes = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "model"))
  assert model.param_shardings(TINY, two_axes)["final_norm/scale"].spec == P(None)


def _one_step(cfg, mesh):
  graphdef, params = model.init_params(cfg, mesh, seed=0)
  shardings = model.param_shardings(cfg, mesh)
  tx = _tx()
  state = inner.init_train_state(params, tx, mesh, shardings)
  step = inner.make_train_step(graphdef, tx, mesh, inner.train_state_shardings(state, mesh, shardings))
  inputs = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
  new_state, metrics = step(state, {"inputs": inputs, "targets": (inputs + 1) % 256})
  return jax.device_get(new_state.params), float(metrics["loss"]), float(metrics["grad_norm"])


@pytest.mark.slow  # 6 s: scripts/bench_fsdp.py shows the same over 200 steps (results/fsdp.json)
def test_a_step_under_fsdp_equals_the_replicated_step():
  params_1, loss_1, norm_1 = _one_step(TINY, _mesh(1, 1))
  params_4, loss_4, norm_4 = _one_step(TINY, _mesh(1, 4))
  assert loss_4 == pytest.approx(loss_1, rel=1e-5) and norm_4 == pytest.approx(norm_1, rel=1e-4)
  for name, value in params_1.items():
    np.testing.assert_allclose(params_4[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


@functools.lru_cache(maxsize=None)
def _params(scan_layers: bool):
  # remat changes the program, never the parameters: one initialisation per layout.
  return model.init_params(dataclasses.replace(TINY, scan_layers=scan_layers), _mesh(1, 1), 0)[1]


def _loss_and_grads(cfg):
  graphdef, params = model.graph(cfg), _params(cfg.scan_layers)
  inputs = np.random.default_rng(1).integers(0, 256, (2, 16)).astype(np.int32)

  def loss(params):
    return jnp.mean(model.cross_entropy(model.apply(graphdef, params, inputs), (inputs + 1) % 256))

  return jax.jit(jax.value_and_grad(loss))(params), jax.make_jaxpr(jax.grad(loss))(params)


@pytest.mark.parametrize("remat, scan_layers", [("full", False), ("dots_saveable", True)])
def test_remat_recomputes_blocks_and_leaves_loss_and_gradients_unchanged(remat, scan_layers):
  (loss, grads), _ = _loss_and_grads(dataclasses.replace(TINY, scan_layers=scan_layers))
  cfg = dataclasses.replace(TINY, scan_layers=scan_layers, remat=remat)
  (loss_r, grads_r), jaxpr = _loss_and_grads(cfg)
  assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)
  assert float(loss_r) == pytest.approx(float(loss), rel=1e-6)
  for name, g in grads.items():
    np.testing.assert_allclose(grads_r[name], g, rtol=1e-5, atol=1e-7, err_msg=name)


def test_without_remat_nothing_is_recomputed():
  _, jaxpr = _loss_and_grads(TINY)
  assert "checkpoint" not in str(jaxpr) and "remat" not in str(jaxpr)


def test_bfloat16_weights_give_bfloat16_params_and_moments():
  cfg = dataclasses.replace(TINY, param_dtype="bfloat16")
  mesh = _mesh(1, 2)
  _, params = model.init_params(cfg, mesh, seed=0)
  assert {v.dtype for v in params.values()} == {jnp.dtype(jnp.bfloat16)}
  state = inner.init_train_state(params, _tx(), mesh, model.param_shardings(cfg, mesh))
  _, (adam, *_) = state.opt_state
  assert {v.dtype for v in adam.mu.values()} == {jnp.dtype(jnp.bfloat16)}


def test_a_donated_step_aliases_the_state_instead_of_holding_two():
  kept, donated = _memory(2), _memory(2, donate=True)
  assert kept.alias_size_in_bytes == 0
  state_bytes = _state_bytes_per_device(2)
  assert donated.alias_size_in_bytes == pytest.approx(state_bytes, rel=0.01)


# Slow, so that the default suite stays under 10 min (8 s; donation's pulls stay under
# test_runtime's busy-syncer test).
@pytest.mark.slow
def test_pulls_and_checkpoint_state_survive_the_donating_fsdp_learner(tmp_path):
  """A learner on a (1, 2, 1) mesh donates its state every step; what it published stays readable
  two steps later, and its optimizer state comes when asked for."""
  seen = {}

  def ask_full_state(learner):
    seen["full"] = learner.full_publication(timeout_s=30.0)

  def hook(index, step):
    learner = run.learners[index]
    if index == 0 and step == 3:
      seen["published"], seen["flat"] = learner.published, learner.flat_params()
    if index == 0 and step == 5:  # asked from another thread, as a checkpoint or a rejoin asks
      seen["asker"] = threading.Thread(target=ask_full_state, args=(learner,))
      seen["asker"].start()

  run = train.build(tiny_settings(tmp_path, num_learners=2, num_steps=8,
                                  learner_mesh_shapes=((1, 2, 1),), model__remat="full",
                                  model__param_dtype="bfloat16", donate_state="always"),
                    step_hook=hook)
  assert run.learners[0]._donates
  summary = train.execute(run, progress=False)
  seen["asker"].join()
  assert summary["learner_errors"] == [None, None] and summary["merges"] > 0
  for learner in run.learners:
    # Float32 merges were applied in bfloat16: no second program for another dtype.
    assert {v.dtype for v in learner.params().values()} == {np.dtype(jnp.bfloat16)}
    assert learner._train_step._cache_size() == 1
  published = seen["published"]
  assert published.opt_state is None  # not asked for: only the parameters are copied
  for value in list(published.params.values()) + list(seen["flat"].values()):
    assert np.all(np.isfinite(np.asarray(value, np.float32)))
  full = seen["full"]
  assert full is not None and full.step >= 5
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(full.opt_state))


def _config(**fields):
  config = tiny_cpu.get_config()
  config.update_from_flattened_dict(fields)
  return config


@pytest.mark.parametrize("fields, message", [
    ({"learner_mesh_shapes": ((2, 1, 1, 1),)}, r"config\.learner_mesh_shapes=.*\(data, fsdp, model\)"),
    ({"learner_mesh_shapes": ((1, 3, 1),)}, r"config\.data\.batch_size=16 .*data x fsdp"),
    ({"learner_mesh_shapes": ((1, 16, 1),), "data.batch_size": 32, "model.embed_dim": 40},
     r"config\.model\.embed_dim=40 .*fsdp"),
    ({"model.remat": "some"}, r"config\.model\.remat='some' must be one of .*dots_saveable"),
    ({"model.param_dtype": "float16"}, r"config\.model\.param_dtype='float16'"),
])
def test_bad_fsdp_fields_are_clear_errors(fields, message):
  with pytest.raises(ValueError, match=message):
    settings.validate(_config(**fields))


def test_triples_and_pairs_build_three_axis_meshes_and_dp_keeps_the_fsdp_axis():
  run = settings.validate(_config(**{"learner_mesh_shapes": ((1, 2, 1),), "mode": "dp"}))
  assert run.learner_mesh_shapes == ((4, 2, 1),)
  meshes, _ = devices.build_meshes(((2, 1), (1, 2, 1)), 0, "cpu")
  assert [dict(m.shape) for m in meshes] == [{"data": 2, "fsdp": 1, "model": 1},
                                             {"data": 1, "fsdp": 2, "model": 1}]
