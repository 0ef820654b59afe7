"""Held-out loss of a set of parameters, on the mesh where the model lives (a learner's)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from decoupled_diloco.lm import inner
from decoupled_diloco.lm import model as model_lib


def eval_program(graphdef, model_cfg: model_lib.ModelConfig, mesh: Mesh, rows: int) -> Any:
  """The jitted evaluation of [N, rows, L] batches on `mesh`, the parameters sharded as a learner
  shards them; the batch split over data (x fsdp) when `rows` allows it, else replicated."""
  return inner.make_eval_over_batches(graphdef, mesh, model_lib.param_shardings(model_cfg, mesh),
                                      batch_sharded=rows % inner.batch_shards(mesh) == 0)


def eval_args(model_cfg: model_lib.ModelConfig, num_batches: int, rows: int, seq_len: int,
              dtype: Any = np.int32
              ) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, jax.ShapeDtypeStruct]]:
  """Shapes of `eval_program`'s arguments: the native parameters and the stacked batches."""
  batch = jax.ShapeDtypeStruct((num_batches, rows, seq_len), dtype)
  return model_lib.native_shapes(model_cfg), {"inputs": batch, "targets": batch}


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
    self._eval = eval_program(graphdef, model_cfg, mesh, self._batches[0]["inputs"].shape[0])
    # All batches as one [N, B, L] array: one program evaluates them all.
    self._stacked = {k: np.stack([b[k] for b in self._batches]) for k in self._batches[0]}

  def compile(self) -> None:
    """Compiles the evaluation ahead of time, so the build reports what it costs."""
    inputs = self._stacked["inputs"]
    self._eval = self._eval.lower(*eval_args(self._model_cfg, *inputs.shape,
                                             dtype=inputs.dtype)).compile()

  def __call__(self, params: Mapping[str, np.ndarray | jax.Array]) -> float:
    # In the learners' dtype: Theta is float32 on the syncer whatever config.model.param_dtype.
    dtypes = model_lib.native_shapes(self._model_cfg)
    placed = {n: jax.device_put(np.asarray(v, dtypes[n].dtype) if isinstance(v, np.ndarray)
                                else v.astype(dtypes[n].dtype), self._shardings[n])
              for n, v in params.items()}
    nats, tokens = self._eval(placed, self._stacked)
    return float(nats) / int(tokens)
