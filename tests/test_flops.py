"""Model FLOPs per token (lm/flops.py), by hand and against XLA's count of the compiled train
step."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import default_settings
from decoupled_diloco.lm import flops, inner, model


def test_flops_per_token_matches_a_hand_count_of_a_tiny_model():
  cfg = default_settings("model", vocab_size=256, embed_dim=8, num_layers=2, num_heads=2,
                         head_dim=4, mlp_dim=16)
  # Per block: q, k, v, o are 8 x (2 x 4) = 64 weights each, gate, up, down 8 x 16 = 128 each:
  # 4 x 64 + 3 x 128 = 640; two blocks 1280; the unembedding 256 x 8 = 2048. 3328 weights.
  assert flops.matmul_params(cfg) == 3328
  # 6 x 3328 = 19968, plus attention 12 x 2 layers x 10 positions x 8 (heads x head_dim) = 1920.
  assert flops.model_flops_per_token(cfg, seq_len=10) == 19968 + 1920
  # The norm gains and the embedding lookup are not matmuls: fewer than all parameters.
  params = model.param_shapes(cfg)
  all_params = sum(int(np.prod(s.shape)) for s in params.values())
  assert all_params - flops.matmul_params(cfg) == 5 * 8  # two norms per block, one final


def test_the_splash_kernel_halves_attention_in_what_a_step_computes_not_in_model_flops():
  cfg = default_settings("model", vocab_size=256, embed_dim=8, num_layers=2, num_heads=2,
                         head_dim=4, mlp_dim=16)
  splash = dataclasses.replace(cfg, attention="splash")
  # Attention is 1920 per token at 10 positions (the hand count above); the kernel skips the
  # blocks above the causal diagonal: 960. Model FLOPs (MFU) count it whole, PaLM's convention;
  # MaxText's count does not.
  assert flops.model_flops_per_token(splash, 10) == flops.model_flops_per_token(cfg, 10) == 21888
  assert flops.causal_model_flops_per_token(cfg, 10) == 19968 + 960
  assert flops.train_flops_per_token(cfg, 10) == 19968 + 1920
  assert flops.train_flops_per_token(splash, 10) == 19968 + 960
  # remat=full runs the blocks' forward matmuls again: projections and MLP 2 x 1280, attention's
  # forward a third of its count.
  full = dataclasses.replace(splash, remat="full")
  assert flops.train_flops_per_token(full, 10) == 19968 + 960 + 2560 + 320
  assert flops.forward_flops_per_token(splash, 10) == 2 * 3328 + 320


def test_flops_per_token_is_within_5_percent_of_xla_cost_analysis_of_the_train_step():
  """XLA counts every op of the lowered step (softmax, norms, AdamW); the matmuls dominate once
  the model is not minute, so the analytic count must land within a few percent of it. Shapes
  only: nothing is initialised or compiled."""
  cfg = default_settings("model", embed_dim=128, num_layers=2, num_heads=4, head_dim=32,
                         mlp_dim=512, max_seq_len=64)
  batch, seq_len = 8, 64
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  params = model.native_shapes(cfg)
  shardings = model.param_shardings(cfg, mesh)
  tx = inner.make_inner_optimizer(default_settings("inner"), 100)
  state = inner.TrainState(params=params, opt_state=jax.eval_shape(tx.init, params),
                           step=jax.ShapeDtypeStruct((), np.int32))
  step = inner.make_train_step(model.graph(cfg), tx, mesh,
                               inner.train_state_shardings(state, mesh, shardings))
  tokens = jax.ShapeDtypeStruct((batch, seq_len), np.int32)
  cost = step.lower(state, {"inputs": tokens, "targets": tokens}).cost_analysis()
  xla_per_token = cost["flops"] / (batch * seq_len)
  analytic = flops.model_flops_per_token(cfg, seq_len)
  assert analytic == pytest.approx(xla_per_token, rel=0.05), (analytic, xla_per_token)
