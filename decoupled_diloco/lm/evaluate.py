"""Held-out loss of a set of parameters, on the mesh where the model lives (a learner's)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from decoupled_diloco.lm import inner
from decoupled_diloco.lm import model as model_lib


class Evaluator:
  """Mean cross-entropy in nats per token over fixed held-out batches, on `mesh`.

  Parameters are placed with the learner's own shardings (`model.param_shardings`), so a model that
  is tensor-parallel on its learner is tensor-parallel here too. Batches are split over the mesh's
  data (x fsdp) axes when their size allows, else every data replica evaluates the whole batch: every mode
  then evaluates the very same sequences, whatever its mesh.
  """

  def __init__(self, graphdef, model_cfg: model_lib.ModelConfig, mesh: Mesh,
               batches: Sequence[dict[str, np.ndarray]]):
    if not batches:
      raise ValueError("config.eval_batches: the held-out split yields no batch; lower "
                       "config.data.batch_size or config.data.seq_len, or raise "
                       "config.data.eval_fraction")
    self.mesh = mesh
    self._model_cfg = model_cfg
    self._shardings = model_lib.param_shardings(model_cfg, mesh)
    self._batches = list(batches)
    rows = self._batches[0]["inputs"].shape[0]
    self._eval = inner.make_eval_over_batches(graphdef, mesh, self._shardings,
                                              batch_sharded=rows % inner.batch_shards(mesh) == 0)
    # All batches as one [N, B, L] array: one program evaluates them all.
    self._stacked = {k: np.stack([b[k] for b in self._batches]) for k in self._batches[0]}

  def compile(self) -> None:
    """Compiles the evaluation ahead of time, so the build reports what it costs."""
    params = model_lib.native_shapes(self._model_cfg)
    batches = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self._stacked.items()}
    self._eval = self._eval.lower(params, batches).compile()

  def __call__(self, params: Mapping[str, np.ndarray | jax.Array]) -> float:
    # In the learners' dtype: Theta is float32 on the syncer whatever config.model.param_dtype.
    dtypes = model_lib.native_shapes(self._model_cfg)
    placed = {n: jax.device_put(np.asarray(v, dtypes[n].dtype) if isinstance(v, np.ndarray)
                                else v.astype(dtypes[n].dtype), self._shardings[n])
              for n, v in params.items()}
    nats, tokens = self._eval(placed, self._stacked)
    return float(nats) / int(tokens)
