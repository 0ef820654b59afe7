"""Tests of decoupled_diloco.lm.model: shapes, causality, sharding rules, flat names, config errors,
scanned vs unrolled blocks, and start-up programs that do not grow with depth."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from conftest import default_settings
from decoupled_diloco.lm import model

TINY = default_settings("model", embed_dim=32, num_layers=2, num_heads=2, head_dim=16, mlp_dim=64,
                        max_seq_len=16)


def _mesh(data: int, tensor: int) -> Mesh:
  devices = np.array(jax.devices()[: data * tensor]).reshape(data, tensor)
  return Mesh(devices, ("data", "model"))


@pytest.fixture(scope="module", params=[False, True], ids=["unrolled", "scanned"])
def cfg(request):
  """TINY with its blocks unrolled or under lax.scan: the forward-pass tests run on both."""
  return dataclasses.replace(TINY, scan_layers=request.param)


@pytest.fixture(scope="module")
def replicated_init(cfg):
  return model.init_params(cfg, _mesh(2, 1), seed=0)


@pytest.fixture(scope="module")
def tensor_parallel_init(cfg):
  return model.init_params(cfg, _mesh(1, 2), seed=0)


def _logits(graphdef, params, tokens_BxL):
  return jax.jit(lambda p, t: model.apply(graphdef, p, t))(params, tokens_BxL)


def _tokens(batch, length, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (batch, length)), jnp.int32)


def test_logits_are_float32_batch_by_length_by_vocab(replicated_init):
  graphdef, params = replicated_init
  logits_BxLxV = _logits(graphdef, params, _tokens(2, 8))
  assert logits_BxLxV.shape == (2, 8, 256)
  assert logits_BxLxV.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits_BxLxV)).all()


def test_bfloat16_activations_still_give_float32_logits(cfg, replicated_init):
  graphdef, params = replicated_init
  graphdef_bf16, params_bf16 = model.init_params(
      dataclasses.replace(cfg, dtype="bfloat16"), _mesh(1, 1), seed=0)
  assert all(p.dtype == jnp.float32 for p in params_bf16.values())
  logits_bf16 = _logits(graphdef_bf16, params_bf16, _tokens(2, 8))
  logits_f32 = _logits(graphdef, params, _tokens(2, 8))
  assert logits_bf16.dtype == jnp.float32
  # Same weights, lower-precision arithmetic: close but not identical.
  np.testing.assert_allclose(logits_bf16, logits_f32, atol=0.25)


def test_changing_token_t_leaves_earlier_logits_unchanged(replicated_init):
  graphdef, params = replicated_init
  tokens_BxL = _tokens(2, 12)
  t = 5
  changed_BxL = tokens_BxL.at[:, t].set((tokens_BxL[:, t] + 1) % 256)
  before, after = _logits(graphdef, params, tokens_BxL), _logits(graphdef, params, changed_BxL)
  np.testing.assert_array_equal(before[:, :t], after[:, :t])
  # ... while position t and later do see the change.
  assert np.abs(np.asarray(before[:, t:] - after[:, t:])).max(axis=-1).min() > 0


def test_rope_attention_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(0)
  q_1x1x1xK = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  k_1x1x1xK = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

  def score(q_pos, k_pos):
    q = model.apply_rope(q_1x1x1xK, jnp.array([q_pos]), 10_000.0)
    k = model.apply_rope(k_1x1x1xK, jnp.array([k_pos]), 10_000.0)
    return float(jnp.sum(q * k))

  assert score(7, 3) == pytest.approx(score(11, 7), rel=1e-5)
  assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)
  # A rotation keeps norms.
  rotated = model.apply_rope(q_1x1x1xK, jnp.array([9]), 10_000.0)
  assert float(jnp.linalg.norm(rotated)) == pytest.approx(float(jnp.linalg.norm(q_1x1x1xK)), 1e-5)


def _flat(cfg, params):
  """Every flat (per-layer) tensor of native `params`, read through the layout."""
  layout = model.param_layout(cfg)
  return {name: layout.get(params, name) for name in model.param_shapes(cfg)}


def _spec(array):
  """The array's PartitionSpec with one entry per dimension (trailing Nones made explicit)."""
  spec = tuple(array.sharding.spec)
  return spec + (None,) * (array.ndim - len(spec))


def test_model_mesh_splits_vocab_heads_and_mlp(cfg, tensor_parallel_init):
  _, native = tensor_parallel_init
  params = _flat(cfg, native)
  embedding = params[model.EMBEDDING_NAME]
  assert embedding.sharding.spec == P("model", None)
  # Vocab 256 over 2 model shards: each device holds 128 rows of the embedding.
  assert {s.data.shape for s in embedding.addressable_shards} == {(128, 32)}
  assert _spec(params["layers/0/attn/q_proj/kernel"]) == (None, "model", None)
  assert _spec(params["layers/0/attn/o_proj/kernel"]) == ("model", None, None)
  assert _spec(params["layers/1/mlp/gate_proj/kernel"]) == (None, "model")
  assert _spec(params["layers/1/mlp/down_proj/kernel"]) == ("model", None)
  assert params["final_norm/scale"].sharding.is_fully_replicated
  shardings = model.param_shardings(cfg, _mesh(1, 2))
  assert all(native[name].sharding == s for name, s in shardings.items())


def test_data_mesh_replicates_every_parameter(replicated_init):
  _, params = replicated_init
  for name, value in params.items():
    assert value.sharding.is_fully_replicated, name
    assert len(value.sharding.device_set) == 2, name


def test_same_seed_gives_identical_params_on_any_mesh(replicated_init, tensor_parallel_init):
  _, on_data_mesh = replicated_init
  _, on_model_mesh = tensor_parallel_init
  assert on_data_mesh.keys() == on_model_mesh.keys()
  for name in on_data_mesh:
    np.testing.assert_array_equal(on_data_mesh[name], on_model_mesh[name], err_msg=name)
  _, other_seed = model.init_params(TINY, _mesh(1, 1), seed=1)
  assert not np.array_equal(on_data_mesh[model.EMBEDDING_NAME], other_seed[model.EMBEDDING_NAME])


def test_tensor_parallel_logits_match_replicated(replicated_init, tensor_parallel_init):
  tokens_BxL = _tokens(2, 8)
  np.testing.assert_allclose(
      _logits(*replicated_init, tokens_BxL), _logits(*tensor_parallel_init, tokens_BxL),
      rtol=1e-5, atol=1e-5,
  )


def test_flat_names_are_module_paths(cfg, replicated_init):
  _, native = replicated_init
  params = _flat(cfg, native)
  assert model.EMBEDDING_NAME in params
  assert "final_norm/scale" in params
  assert any(name.startswith("layers/0/") for name in params)
  for name in params:
    if "layers" in name:
      assert re.fullmatch(r"layers/\d+/.+", name), name
  layers = {int(name.split("/")[1]) for name in params if name.startswith("layers/")}
  assert layers == set(range(TINY.num_layers))
  shapes = model.param_shapes(TINY)
  assert shapes.keys() == params.keys()
  assert all(shapes[n].shape == params[n].shape for n in params)
  # Native names: one per layer tensor, or one stacked tensor per kind ("layers/attn/...").
  assert model.param_shardings(cfg, _mesh(2, 1)).keys() == native.keys()
  assert {n: v.shape for n, v in model.native_shapes(cfg).items()} == {
      n: v.shape for n, v in native.items()}
  if cfg.scan_layers:
    assert native["layers/attn/q_proj/kernel"].shape == (cfg.num_layers,) + shapes[
        "layers/0/attn/q_proj/kernel"].shape


def _expected_count(v, d, layers, heads, head_dim, mlp):
  # Embedding (tied, counted once) + per layer q, k, v, o, gate, up, down, 2 norms + final norm.
  attention = 4 * d * heads * head_dim
  gated_mlp = 3 * d * mlp
  return v * d + layers * (attention + gated_mlp + 2 * d) + d


def test_parameter_counts_of_two_configs_by_hand():
  wide = dataclasses.replace(TINY, embed_dim=128, num_layers=4, num_heads=4, head_dim=32,
                             mlp_dim=512)
  assert model.num_params(model.param_shapes(wide)) == _expected_count(256, 128, 4, 4, 32, 512)
  assert model.num_params(model.param_shapes(wide)) == 1_082_496
  small = dataclasses.replace(TINY, embed_dim=64, num_layers=4, num_heads=4, head_dim=16,
                              mlp_dim=192)
  assert model.num_params(model.param_shapes(small)) == _expected_count(256, 64, 4, 4, 16, 192)
  assert abs(model.num_params(model.param_shapes(small)) - 230_000) < 1_000


def test_head_width_may_differ_from_embed_dim():
  mc = dataclasses.replace(TINY, embed_dim=48, num_heads=2, head_dim=16, dtype="bfloat16")
  assert (mc.embed_dim, mc.num_heads * mc.head_dim, mc.dtype) == (48, 32, "bfloat16")
  assert model.param_shapes(mc)["layers/0/attn/q_proj/kernel"].shape == (48, 2, 16)


@pytest.mark.parametrize("field, value", [
    ("num_heads", 0), ("embed_dim", -1), ("head_dim", 15), ("dtype", "float16"),
    ("rope_base", 0.5), ("mlp_activation", "relu"), ("num_layers", 2.0),
    ("scan_layers", 1), ("attention", "flash"),
])
def test_bad_fields_name_the_config_field(field, value):
  with pytest.raises(ValueError, match=rf"config\.model\.{field}="):
    dataclasses.replace(TINY, **{field: value})


@pytest.mark.parametrize("fields, named", [
    (dict(dtype="float32"), r"config\.model\.dtype='float32'"),
    (dict(dtype="bfloat16", head_dim=12), r"config\.model\.head_dim=12"),
])
def test_cudnn_attention_rejects_what_flash_attention_cannot_run(fields, named):
  with pytest.raises(ValueError, match=named):
    dataclasses.replace(TINY, attention="cudnn", **fields)


def test_attention_implementation_reaches_dot_product_attention(monkeypatch):
  implementations = []
  original = jax.nn.dot_product_attention

  def spy(*args, implementation, **kwargs):
    implementations.append(implementation)
    # cuDNN has no CPU kernel: run XLA's, having recorded what was asked for.
    return original(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  cudnn = dataclasses.replace(TINY, attention="cudnn", dtype="bfloat16")
  graphdef, params = model.init_params(cudnn, _mesh(1, 1), seed=0)
  model.apply(graphdef, params, _tokens(1, 8))
  assert implementations and set(implementations) == {"cudnn"}


@pytest.mark.parametrize("fields, named", [
    (dict(splash_block_q=100), r"config\.model\.splash_block_q=100 must be 0 .* multiple of 128"),
    (dict(splash_block_kv=-128), r"config\.model\.splash_block_kv=-128"),
    (dict(attention="splash", max_seq_len=200), r"config\.model\.max_seq_len=200 .* multiple of 128"),
])
def test_splash_fields_name_what_the_kernel_cannot_tile(fields, named):
  with pytest.raises(ValueError, match=named):
    dataclasses.replace(TINY, **{"max_seq_len": 128, **fields})


@pytest.mark.parametrize("scan_layers, remat", [
    (True, "dots_saveable"),
    pytest.param(False, "full", marks=pytest.mark.slow),  # 7 s more on 2 cores
])
def test_splash_model_gives_xla_s_loss_and_gradients_under_remat(scan_layers, remat):
  """The whole model with the splash kernel (Pallas interpret mode on CPU devices), its blocks
  scanned or unrolled and rematerialised, against XLA's attention: the same loss and gradients
  on a (data, fsdp, model) mesh, the kernel mapped over data x fsdp and model."""
  xla = dataclasses.replace(TINY, max_seq_len=128, scan_layers=scan_layers, remat=remat)
  with_splash = dataclasses.replace(xla, attention="splash")
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2), ("data", "fsdp", "model"))
  shardings = model.param_shardings(xla, mesh)
  rng = np.random.default_rng(0)  # placed, not initialised: no initialiser to compile
  params = {name: jax.device_put(0.2 * rng.standard_normal(shape.shape, np.float32),
                                 shardings[name])
            for name, shape in model.native_shapes(xla).items()}
  tokens_BxL = _tokens(2, 129)

  def loss(graphdef, params):
    logits_BxLxV = model.apply(graphdef, params, tokens_BxL[:, :-1],
                               activations=model.residual_sharding(mesh))
    return jnp.mean(model.cross_entropy(logits_BxLxV, tokens_BxL[:, 1:]))

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
  want_loss, want_grads = grad_fn(model.graph(xla), params)
  got_loss, got_grads = grad_fn(model.graph(with_splash), params)
  # Measured: the same loss, gradients within 5e-8 of XLA's (the largest are 0.09).
  assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
  for name, grad in got_grads.items():
    np.testing.assert_allclose(grad, want_grads[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_heads_not_divisible_by_model_axis_is_an_error_naming_the_field():
  odd_heads = dataclasses.replace(TINY, num_heads=3)
  with pytest.raises(ValueError, match=r"config\.model\.num_heads=3"):
    model.param_shardings(odd_heads, _mesh(1, 2))


def test_sequence_longer_than_max_seq_len_is_an_error(replicated_init):
  graphdef, params = replicated_init
  with pytest.raises(ValueError, match=r"config\.model\.max_seq_len=16"):
    model.apply(graphdef, params, _tokens(1, 17))


def test_cross_entropy_of_uniform_logits_is_log_vocab():
  nats_BxL = model.cross_entropy(jnp.zeros((2, 3, 256)), jnp.array([[0, 5, 255], [1, 2, 3]]))
  assert nats_BxL.shape == (2, 3) and nats_BxL.dtype == jnp.float32
  np.testing.assert_allclose(nats_BxL, math.log(256), rtol=1e-6)
  # A confident correct prediction costs ~0 nats, a confident wrong one ~the logit gap.
  confident = jnp.zeros((1, 1, 256)).at[0, 0, 7].set(30.0)
  assert float(model.cross_entropy(confident, jnp.array([[7]]))[0, 0]) < 1e-6
  assert float(model.cross_entropy(confident, jnp.array([[8]]))[0, 0]) == pytest.approx(30.0, 1e-4)


def test_num_params_counts_scalars():
  assert model.num_params({"a": jnp.zeros((2, 3)), "b": jnp.zeros((4,))}) == 10


# ----------------------------------------------------------------------------------------------
# Scanned blocks and start-up programs.


def _loss(graphdef, params, tokens_BxL):
  logits_BxLxV = model.apply(graphdef, params, tokens_BxL[:, :-1])
  return jnp.mean(model.cross_entropy(logits_BxLxV, tokens_BxL[:, 1:]))


def test_scanned_blocks_give_the_unrolled_logits_and_gradients():
  # Three layers on a data x model mesh: the scan runs more than twice and its weights are split.
  three = dataclasses.replace(TINY, num_layers=3)
  mesh = _mesh(2, 2)
  stacked = dataclasses.replace(three, scan_layers=True)
  layout = model.param_layout(stacked)
  unrolled_graphdef, params = model.init_params(three, mesh, seed=0)
  scanned_graphdef, scanned_params = model.init_params(stacked, mesh, seed=0)
  scanned_flat = layout.to_flat(jax.device_get(scanned_params))
  for name in params:  # The initial values do not depend on the layout.
    np.testing.assert_array_equal(params[name], scanned_flat[name], err_msg=name)
  tokens_BxL = _tokens(4, 13)
  np.testing.assert_allclose(
      _logits(scanned_graphdef, scanned_params, tokens_BxL),
      _logits(unrolled_graphdef, params, tokens_BxL), rtol=1e-5, atol=1e-5)
  grad_fn = jax.jit(jax.value_and_grad(_loss, argnums=1), static_argnums=0)
  scanned_loss, scanned_grads = grad_fn(scanned_graphdef, scanned_params, tokens_BxL)
  unrolled_loss, unrolled_grads = grad_fn(unrolled_graphdef, params, tokens_BxL)
  assert float(scanned_loss) == pytest.approx(float(unrolled_loss), rel=1e-6)
  assert scanned_grads.keys() == scanned_params.keys()
  for name, grad in scanned_grads.items():
    # Gradients come out split like their (stacked) parameters: the scan gathered no weight.
    assert grad.sharding.is_equivalent_to(scanned_params[name].sharding, grad.ndim), name
  scanned_grads = layout.to_flat(jax.device_get(scanned_grads))
  for name in params:
    np.testing.assert_allclose(scanned_grads[name], unrolled_grads[name], rtol=1e-5, atol=1e-5,
                               err_msg=name)


def test_layout_reads_and_writes_one_layer_of_a_stacked_tensor():
  stacked = dataclasses.replace(TINY, num_layers=3, scan_layers=True)
  layout = model.param_layout(stacked)
  _, params = model.init_params(stacked, _mesh(1, 2), seed=0)
  name = "layers/1/mlp/gate_proj/kernel"
  value = layout.get(params, name)
  assert value.shape == model.param_shapes(stacked)[name].shape
  assert value.sharding.spec == P(None, "model")
  written = layout.set(params, {name: value + 1.0})
  before, after = (layout.to_flat(jax.device_get(p)) for p in (params, written))
  for flat in before:
    expected = before[flat] + 1.0 if flat == name else before[flat]
    np.testing.assert_array_equal(after[flat], expected, err_msg=flat)
  np.testing.assert_array_equal(layout.to_native(before)["layers/mlp/gate_proj/kernel"],
                                jax.device_get(params["layers/mlp/gate_proj/kernel"]))


def _forward_and_gradient_program(cfg):
  """StableHLO text of the loss and its gradient w.r.t. every flat parameter: a deterministic
  stand-in for its compile time."""
  tokens = jax.ShapeDtypeStruct((2, cfg.max_seq_len + 1), jnp.int32)
  grad_fn = jax.jit(jax.value_and_grad(functools.partial(_loss, model.graph(cfg)), argnums=0))
  return grad_fn.lower(model.native_shapes(cfg), tokens).as_text()


@pytest.mark.parametrize("scan_layers, bounds", [(True, (1.0, 1.02)), (False, (3.0, 5.0))])
def test_scanned_gradient_program_does_not_grow_with_depth(scan_layers, bounds):
  # Stacked, only the layer count in the shapes changes; unrolled, ~35 KB of text per layer.
  shallow, deep = (_forward_and_gradient_program(
      dataclasses.replace(TINY, num_layers=n, scan_layers=scan_layers)) for n in (4, 16))
  low, high = bounds
  assert low <= len(deep) / len(shallow) <= high, (len(shallow), len(deep))


def _initialiser_programs(cfg):
  """StableHLO text of every program `init_params` compiles for `cfg`."""
  # pylint: disable-next=protected-access
  init_outside_blocks, init_block = model._initialisers(cfg, _mesh(1, 1))
  key = jax.random.key(0)
  return init_outside_blocks.lower(key).as_text() + init_block.lower(key, 0).as_text()


def _whole_model_initialiser_program(cfg):
  """For contrast, the initialiser `init_params` replaced: every block in one program."""
  def init(key):
    with nnx.use_eager_sharding(False):
      return nnx.state(model.Transformer(cfg, rngs=nnx.Rngs(key)))
  return jax.jit(init).lower(jax.random.key(0)).as_text()


def test_initialiser_programs_do_not_grow_with_depth():
  shallow, deep = (_initialiser_programs(dataclasses.replace(TINY, num_layers=n)) for n in (4, 16))
  assert len(deep) <= 1.05 * len(shallow), (len(shallow), len(deep))
  # The measure does catch an initialiser that unrolls the blocks (~2x: JAX shares the
  # initialiser functions between blocks, the draws are still per block).
  unrolled_shallow, unrolled_deep = (
      _whole_model_initialiser_program(dataclasses.replace(TINY, num_layers=n)) for n in (4, 16))
  assert len(unrolled_deep) > 1.5 * len(unrolled_shallow)


def test_two_seeds_and_all_layers_reuse_one_compiled_initialiser():
  cfg = dataclasses.replace(TINY, num_layers=3, embed_dim=48)  # Fresh: no other test compiles it.
  mesh = _mesh(2, 1)
  _, seed_0 = model.init_params(cfg, mesh, seed=0)
  _, seed_1 = model.init_params(cfg, mesh, seed=1)
  for name in seed_0:
    if not name.endswith("norm/scale"):  # Norm scales start at zero whatever the seed.
      assert not np.array_equal(seed_0[name], seed_1[name]), name
  # Different layers draw different values from the same program.
  assert not np.array_equal(seed_0["layers/0/mlp/up_proj/kernel"],
                            seed_0["layers/2/mlp/up_proj/kernel"])
  # The key and the layer index are arguments: one program each serves both seeds and all layers.
  for initialiser in model._initialisers(cfg, mesh):  # pylint: disable=protected-access
    assert initialiser._cache_size() == 1  # pylint: disable=protected-access
