"""Text from a trained model: autoregressive sampling with temperature and top-k.

The model is causal, so the logits at position i depend only on tokens 0..i: the context lives in a
buffer of `max_seq_len` tokens padded on the right, and one jitted program (compiled once, whatever
the prompt's length) reads the logits at the last real position and draws the next token. Past
`max_seq_len` the context slides: the oldest token drops off. No KV cache: a full forward pass per
token is what a model of this framework's CPU sizes affords, and it keeps the program one
`model.apply`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from decoupled_diloco.lm import model as model_lib


def check_options(*, num_tokens: int, temperature: float, top_k: int, vocab_size: int) -> None:
  """Raises ValueError naming the option that is out of range."""
  if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
    raise ValueError(f"num_tokens={num_tokens!r} must be a positive integer")
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
      or not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= vocab_size:
    raise ValueError(f"top_k={top_k!r} must be an integer in [0, {vocab_size}] (0 = no limit)")


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "mesh"))
def _next_token(graphdef, params, context_L, length, key, temperature, *, top_k: int,
                mesh: Mesh | None = None):
  """The token after context_L[:length]: greedy when temperature is 0, else drawn from the
  softmax of logits / temperature, over the top_k logits when top_k > 0. `mesh`: the one the
  parameters are sharded over (the splash kernel is mapped over it)."""
  logits_V = model_lib.apply(graphdef, params, context_L[None], mesh=mesh)[0, length - 1]
  if top_k:
    kth = jax.lax.top_k(logits_V, top_k)[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  greedy = jnp.argmax(logits_V)
  drawn = jax.random.categorical(key, logits_V / jnp.maximum(temperature, 1e-6))
  return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def lower_next_token(model_cfg: model_lib.ModelConfig, params: Mapping[str, Any], *, top_k: int
                     ) -> Any:
  """`generate`'s one program lowered for `params` (arrays or sharded ShapeDtypeStructs): to
  compile it ahead of time, for the chips of a TPU topology (runtime/tpu_aot.py)."""
  context_L = jax.ShapeDtypeStruct((model_cfg.max_seq_len,), jnp.int32)
  key = jax.eval_shape(jax.random.key, 0)
  return _next_token.lower(model_lib.graph(model_cfg), dict(params), context_L, 1, key, 1.0,
                           top_k=top_k, mesh=_mesh_of(params))


def _mesh_of(params: Mapping[str, Any]) -> Mesh | None:
  """The mesh the parameters are sharded over, None when they are not (one device's)."""
  sharding = getattr(next(iter(params.values())), "sharding", None)
  return sharding.mesh if isinstance(sharding, NamedSharding) else None


def generate(model_cfg: model_lib.ModelConfig, params: Mapping[str, Any], prompt: Sequence[int],
             *, num_tokens: int, temperature: float = 1.0, top_k: int = 0, seed: int = 0
             ) -> list[int]:
  """`num_tokens` new token ids after `prompt` (ids), from the native `params` of `model_cfg`.

  temperature 0 is greedy (argmax, no randomness); top_k 0 keeps the whole vocabulary. The same
  seed gives the same text.
  """
  check_options(num_tokens=num_tokens, temperature=temperature, top_k=top_k,
                vocab_size=model_cfg.vocab_size)
  prompt = [int(t) for t in prompt]
  if not prompt:
    raise ValueError("the prompt encodes to no token: give at least one character")
  bad = [t for t in prompt if not 0 <= t < model_cfg.vocab_size]
  if bad:
    raise ValueError(f"prompt ids {bad[:5]} are outside the model's vocabulary "
                     f"[0, {model_cfg.vocab_size})")
  graphdef = model_lib.graph(model_cfg)
  params = {n: jnp.asarray(v) for n, v in params.items()}
  window = model_cfg.max_seq_len
  tokens = list(prompt)
  key = jax.random.key(seed)
  for _ in range(num_tokens):
    context = tokens[-window:]
    context_L = np.zeros(window, np.int32)
    context_L[:len(context)] = context
    key, draw = jax.random.split(key)
    tokens.append(int(_next_token(graphdef, params, context_L, len(context), draw,
                                  float(temperature), top_k=top_k, mesh=_mesh_of(params))))
  return tokens[len(prompt):]
