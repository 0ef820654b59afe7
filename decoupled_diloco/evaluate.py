"""Held-out loss of a set of parameters, on the mesh where those parameters live (or are copied to)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from decoupled_diloco import inner
from decoupled_diloco import model as model_lib


class Evaluator:
  """Mean cross-entropy in nats per token over fixed held-out batches."""

  def __init__(self, graphdef, model_cfg: model_lib.ModelConfig, mesh: Mesh,
               batches: Sequence[dict[str, np.ndarray]]):
    if not batches:
      raise ValueError("config.eval_batches: the held-out split yields no batch; lower "
                       "config.data.batch_size or config.data.seq_len, or raise "
                       "config.data.eval_fraction")
    self._shardings = model_lib.param_shardings(model_cfg, mesh)
    self._step = inner.make_eval_step(graphdef, mesh, self._shardings)
    self._batches = list(batches)

  def __call__(self, params: Mapping[str, np.ndarray | jax.Array]) -> float:
    placed = {n: jax.device_put(v, self._shardings[n]) for n, v in params.items()}
    total_nats, total_tokens = 0.0, 0
    for batch in self._batches:
      nats, tokens = self._step(placed, batch)
      total_nats += float(nats)
      total_tokens += int(tokens)
    return total_nats / total_tokens
