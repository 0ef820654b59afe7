"""A Gemma-style decoder-only transformer, exposed as a flat dict of named tensors.

Architecture (Gemma, arXiv 2403.08295): tied token embedding scaled by sqrt(d) on input, pre-RMSNorm
blocks with rotary position embeddings, causal multi-head attention, a gated MLP (GeGLU by default,
SwiGLU as an option), a final RMSNorm and logits through the same embedding matrix.

Start-up should not grow with depth. The initialiser compiles one block's initialiser and calls it
once per layer. With `scan_layers` each kind of block tensor is stored stacked on a leading layer
axis (the *native* layout, as MaxText does): the forward pass scans one block over the stack, and
the optimizer updates one stacked array per kind, so the train step is traced and compiled once
whatever `num_layers`.

Decoupled DiLoCo's syncer overwrites *fragments* (sets of whole tensors) by name, so the model is not
handed around as an `nnx.Module` but as `(graphdef, params)` with `params: dict[str, jax.Array]` keyed
by '/'-joined module paths. The *flat* names, one per layer tensor ("embedder/embedding",
"layers/0/attn/q_proj/kernel", "final_norm/scale"), are what fragments and the syncer see whatever
the layout; `ParamLayout` reads and writes one flat tensor of native parameters (a stacked layer
tensor "layers/attn/q_proj/kernel" holds "layers/<i>/attn/q_proj/kernel" at index i). `apply`
re-assembles the module inside the traced function, so it stays pure and jittable.

Every parameter carries logical axis names (`nnx.with_partitioning`); `LOGICAL_AXIS_RULES` maps them to
the ("data", "fsdp", "model") mesh of one learner. "data" replicates the weights (plain data
parallelism); "fsdp" splits every weight and its optimizer state along the embedding axis while the
batch is split over data x fsdp (fully sharded data parallelism, ZeRO-3: XLA gathers a weight where a
matmul needs it and reduce-scatters its gradient); "model" splits vocab, heads and MLP hidden units
(Megatron-style tensor parallelism). A mesh without one of those axes (fsdp or model of size 1 need
not be named) simply leaves that split out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from decoupled_diloco.lm import splash

# Logical axis -> mesh axis (or axes). The mesh of a learner has axes ("data", "fsdp", "model").
# Every weight has an embed axis, so splitting it over "fsdp" shards all of them (norm scales
# included) and, through `inner._opt_state_shardings`, their AdamW moments.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("embed", "fsdp"),
    ("kv", None),
    ("batch", ("data", "fsdp")),
)

# Flat name of the token embedding; the syncer merges it with a plain weighted average, not RDA.
EMBEDDING_NAME = "embedder/embedding"
# Flat names of block i's tensors start with f"{_LAYERS}{i}/" (the Transformer.layers attribute).
_LAYERS = "layers/"

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# config.model.remat: "none" keeps every activation for the backward pass; "full" keeps only each
# block's input and recomputes the rest; the others are jax.checkpoint_policies of that name (what a
# block keeps: "dots_saveable" its matmul outputs, "dots_with_no_batch_dims_saveable" those without
# a batch dimension: the projections and the MLP, whose einsums contract D or F with no batch
# dimension in dot_general's sense, but not attention's scores and weighted values, batched over
# heads; the TPU compiler's FLOPs of such a step add exactly attention's forward matmuls:
# results/aot_dense_5b_v5p.md).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "nothing_saveable", "everything_saveable")
# "auto": the runtime picks the cheapest policy whose compiled TPU step fits the chip's HBM, at
# start-up (runtime/hardware/memory_fit.py); a model is always built with the policy it picked.
REMAT_CHOICES = REMAT_POLICIES + ("auto",)
_ACTIVATIONS = {"gelu": jax.nn.gelu, "silu": jax.nn.silu}
# `implementation=` of jax.nn.dot_product_attention: "xla" runs anywhere; "cudnn" is cuDNN flash
# attention on NVIDIA GPUs. With JAX 0.10.2 (cuDNN >= 8.9.4) flash attention takes float16/bfloat16
# only and head_dim a multiple of 8, at most 128 (256 from Hopper on); it no longer needs the
# sequence length to be a multiple of 64 (cuDNN 8.9.0-8.9.3 did). It has no CPU kernel, so the
# runtime config must also ask for GPU devices. "splash" is the Pallas TPU flash attention kernel
# (lm/splash.py), mapped over the learner's mesh; TPU chips only (Pallas interpret mode on CPU).
_ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "splash")

# Which config field sets the size of a sharded logical axis, for error messages.
_AXIS_FIELD = {"vocab": "vocab_size", "mlp": "mlp_dim", "heads": "num_heads",
               "embed": "embed_dim"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the transformer; `settings.validate` builds it from `config.model`."""

  vocab_size: int  # 256 for byte-level tokens.
  embed_dim: int  # Residual stream width d.
  num_layers: int
  num_heads: int
  # Independent of embed_dim, as in Gemma (7B: d=3072, 16 heads x 256).
  head_dim: int
  mlp_dim: int  # Hidden width of the gated MLP.
  max_seq_len: int  # Longest sequence `__call__` accepts.
  dtype: str  # Activation dtype.
  # Parameter dtype (and so AdamW's moments and the gradients): "float32", or "bfloat16" to halve
  # a learner's weights. The syncer keeps Theta and its outer state in float32 whatever this is.
  param_dtype: str
  rope_base: float  # Rotary embedding wavelength base.
  # "gelu": GeGLU as in Gemma; "silu": SwiGLU as in LLaMA.
  mlp_activation: str
  # Store each kind of block tensor stacked on a leading layer axis and run the blocks under
  # lax.scan: the train and eval steps are traced and compiled once whatever num_layers (MaxText's
  # scan_layers). False unrolls the blocks over one tensor per layer: for tiny CPU models the
  # unrolled step runs ~20% faster (XLA:CPU writes the activations saved for the backward pass
  # into stacked buffers); deep models need it on, it bounds their start-up.
  scan_layers: bool
  attention: str  # "xla" | "cudnn" (flash attention, NVIDIA GPUs) | "splash" (TPU; see above).
  # The splash kernel's query and key block sizes (multiples of 128, dividing the sequence
  # length); 0 = lm/splash.py's default for the learner's TPU generation.
  splash_block_q: int
  splash_block_kv: int
  # Rematerialisation of each block in the backward pass: one of REMAT_POLICIES (see there).
  remat: str

  def __post_init__(self):
    for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "head_dim",
                 "mlp_dim", "max_seq_len"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.model.{name}={value!r} must be a positive integer")
    if self.head_dim % 2:
      raise ValueError(
          f"config.model.head_dim={self.head_dim} must be even: rotary embeddings rotate pairs"
      )
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(
            f"config.model.{name}={getattr(self, name)!r} must be one of {sorted(_DTYPES)}")
    if self.remat not in REMAT_CHOICES:
      raise ValueError(f"config.model.remat={self.remat!r} must be one of {list(REMAT_CHOICES)}")
    if (isinstance(self.rope_base, bool) or not isinstance(self.rope_base, (int, float))
        or not self.rope_base > 1.0):
      raise ValueError(f"config.model.rope_base={self.rope_base!r} must be a number > 1")
    if self.mlp_activation not in _ACTIVATIONS:
      raise ValueError(
          f"config.model.mlp_activation={self.mlp_activation!r} must be one of "
          f"{sorted(_ACTIVATIONS)}"
      )
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"config.model.scan_layers={self.scan_layers!r} must be True or False")
    if self.attention not in _ATTENTION_IMPLEMENTATIONS:
      raise ValueError(
          f"config.model.attention={self.attention!r} must be one of "
          f"{list(_ATTENTION_IMPLEMENTATIONS)}"
      )
    for name in ("splash_block_q", "splash_block_kv"):
      value = getattr(self, name)
      if (isinstance(value, bool) or not isinstance(value, int) or value < 0
          or value % splash.BLOCK_MULTIPLE):
        raise ValueError(f"config.model.{name}={value!r} must be 0 (the TPU generation's default) "
                         f"or a positive multiple of {splash.BLOCK_MULTIPLE}")
    if self.attention == "cudnn":
      # Caught here rather than as a NotImplementedError from inside the first GPU compile.
      if self.dtype != "bfloat16":
        raise ValueError(
            f"config.model.dtype={self.dtype!r} must be 'bfloat16' with "
            "config.model.attention='cudnn': cuDNN flash attention takes 16-bit inputs only"
        )
      if self.head_dim % 8 or self.head_dim > 256:
        raise ValueError(
            f"config.model.head_dim={self.head_dim} must be a multiple of 8 and at most 256 "
            "(128 before Hopper) with config.model.attention='cudnn'"
        )
    if self.attention == "splash" and self.max_seq_len % splash.BLOCK_MULTIPLE:
      # Sampling attends over max_seq_len tokens, in whole blocks of 128.
      raise ValueError(
          f"config.model.max_seq_len={self.max_seq_len} must be a multiple of "
          f"{splash.BLOCK_MULTIPLE} with config.model.attention='splash'")

  @property
  def activation_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]


# ----------------------------------------------------------------------------------------------
# Modules.


def _partitioned(init: Any, axes: tuple[str | None, ...]) -> Any:
  return nnx.with_partitioning(init, axes)


class Embedder(nnx.Module):
  """Token embedding shared by the input lookup and the output logits (weight tying)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    # std 1/sqrt(d), so that after the sqrt(d) input scaling the embeddings have unit RMS.
    init = nnx.initializers.normal(stddev=1.0 / math.sqrt(cfg.embed_dim))
    self.embedding = nnx.Param(
        _partitioned(init, ("vocab", "embed"))(
            rngs.params(), (cfg.vocab_size, cfg.embed_dim), cfg.weight_dtype
        )
    )
    self.embed_dim = cfg.embed_dim
    self.dtype = cfg.activation_dtype

  def encode(self, tokens_BxL: jax.Array) -> jax.Array:
    x_BxLxD = jnp.take(self.embedding[...], tokens_BxL, axis=0).astype(self.dtype)
    # Gemma multiplies by sqrt(d) so that the tied matrix can serve both ends at unit scale.
    return x_BxLxD * jnp.asarray(math.sqrt(self.embed_dim), self.dtype)

  def decode(self, x_BxLxD: jax.Array) -> jax.Array:
    embedding_VxD = self.embedding[...].astype(self.dtype)
    return jnp.einsum(
        "BLD,VD->BLV", x_BxLxD, embedding_VxD, preferred_element_type=jnp.float32
    )


class RMSNorm(nnx.Module):
  """Gemma's RMSNorm: x / rms(x) * (1 + scale), with scale initialised to zero.

  The (1 + scale) form makes weight decay pull the gain towards 1, not towards 0.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.scale = nnx.Param(
        _partitioned(nnx.initializers.zeros_init(), ("embed",))(
            rngs.params(), (cfg.embed_dim,), cfg.weight_dtype
        )
    )
    self.eps = 1e-6

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    # Statistics in float32 even for bfloat16 activations.
    x32_BxLxD = x_BxLxD.astype(jnp.float32)
    ms_BxLx1 = jnp.mean(jnp.square(x32_BxLxD), axis=-1, keepdims=True)
    normed_BxLxD = x32_BxLxD * jax.lax.rsqrt(ms_BxLx1 + self.eps)
    return (normed_BxLxD * (1.0 + self.scale[...])).astype(x_BxLxD.dtype)


def _projection(eqn: str, shape: tuple[int, ...], axes: tuple[str | None, ...],
                in_axis: int | tuple[int, ...], out_axis: int | tuple[int, ...],
                cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Einsum:
  """A bias-free einsum projection with a fan-in scaled init and logical axis names."""
  init = nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
  )
  return nnx.Einsum(
      eqn, shape, bias_shape=None, dtype=cfg.activation_dtype, param_dtype=cfg.weight_dtype,
      kernel_init=_partitioned(init, axes), rngs=rngs,
  )


def apply_rope(x_BxLxHxK: jax.Array, positions_L: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding (Su et al., arXiv 2104.09864), half-split layout as in Gemma.

  Pair (x[i], x[i + K/2]) is rotated by the angle position * base^(-2i/K).
  """
  head_dim = x_BxLxHxK.shape[-1]
  fraction_K2 = 2.0 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  inv_freq_K2 = base ** -fraction_K2
  angle_LxK2 = positions_L.astype(jnp.float32)[:, None] * inv_freq_K2[None, :]
  sin_1xLx1xK2 = jnp.sin(angle_LxK2)[None, :, None, :]
  cos_1xLx1xK2 = jnp.cos(angle_LxK2)[None, :, None, :]
  x1_BxLxHxK2, x2_BxLxHxK2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  rotated_BxLxHxK = jnp.concatenate(
      [x1_BxLxHxK2 * cos_1xLx1xK2 - x2_BxLxHxK2 * sin_1xLx1xK2,
       x2_BxLxHxK2 * cos_1xLx1xK2 + x1_BxLxHxK2 * sin_1xLx1xK2],
      axis=-1,
  )
  return rotated_BxLxHxK.astype(x_BxLxHxK.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention with rotary embeddings on queries and keys."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, k = cfg.embed_dim, cfg.num_heads, cfg.head_dim
    in_axes = ("embed", "heads", "kv")
    self.q_proj = _projection("BLD,DHK->BLHK", (d, h, k), in_axes, 0, (1, 2), cfg, rngs)
    self.k_proj = _projection("BLD,DHK->BLHK", (d, h, k), in_axes, 0, (1, 2), cfg, rngs)
    self.v_proj = _projection("BLD,DHK->BLHK", (d, h, k), in_axes, 0, (1, 2), cfg, rngs)
    self.o_proj = _projection(
        "BLHK,HKD->BLD", (h, k, d), ("heads", "kv", "embed"), (0, 1), 2, cfg, rngs
    )
    self.rope_base = cfg.rope_base
    self.implementation = cfg.attention
    self.splash_blocks = (cfg.splash_block_q, cfg.splash_block_kv)

  def __call__(self, x_BxLxD: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """`mesh`: the learner's, over which the splash kernel is mapped (`apply`)."""
    positions_L = jnp.arange(x_BxLxD.shape[1])
    q_BxLxHxK = apply_rope(self.q_proj(x_BxLxD), positions_L, self.rope_base)
    k_BxLxHxK = apply_rope(self.k_proj(x_BxLxD), positions_L, self.rope_base)
    v_BxLxHxK = self.v_proj(x_BxLxD)
    if self.implementation == "splash":
      out_BxLxHxK = splash.causal_attention(
          q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, mesh=mesh, batch_axes=_mesh_axes("batch"),
          head_axes=_mesh_axes("heads"), block_q=self.splash_blocks[0],
          block_kv=self.splash_blocks[1])
      return self.o_proj(out_BxLxHxK)
    # Scale 1/sqrt(head_dim) (the default); the XLA implementation does its softmax in float32.
    out_BxLxHxK = jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True, implementation=self.implementation
    )
    return self.o_proj(out_BxLxHxK)


class GatedMLP(nnx.Module):
  """down(act(gate(x)) * up(x)) (Shazeer, arXiv 2002.05202)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    self.gate_proj = _projection("BLD,DF->BLF", (d, f), ("embed", "mlp"), 0, 1, cfg, rngs)
    self.up_proj = _projection("BLD,DF->BLF", (d, f), ("embed", "mlp"), 0, 1, cfg, rngs)
    self.down_proj = _projection("BLF,FD->BLD", (f, d), ("mlp", "embed"), 0, 1, cfg, rngs)
    self.activation = _ACTIVATIONS[cfg.mlp_activation]

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    hidden_BxLxF = self.activation(self.gate_proj(x_BxLxD)) * self.up_proj(x_BxLxD)
    return self.down_proj(hidden_BxLxF)


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.pre_attn_norm = RMSNorm(cfg, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.pre_mlp_norm = RMSNorm(cfg, rngs=rngs)
    self.mlp = GatedMLP(cfg, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    x_BxLxD = x_BxLxD + self.attn(self.pre_attn_norm(x_BxLxD), mesh)
    return x_BxLxD + self.mlp(self.pre_mlp_norm(x_BxLxD))


class Transformer(nnx.Module):
  """Decoder-only language model: tokens_BxL -> float32 logits_BxLxV."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.embedder = Embedder(cfg, rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg, rngs=rngs)
    self.max_seq_len = cfg.max_seq_len
    self.remat = cfg.remat  # static: part of the graphdef, so `apply` reads it there

  def __call__(self, tokens_BxL: jax.Array,
               constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
               mesh: Mesh | None = None) -> jax.Array:
    return self.forward(tokens_BxL, lambda x: self._run_blocks(x, constrain, mesh), constrain)

  def _run_blocks(self, x_BxLxD: jax.Array, constrain: Callable[[jax.Array], jax.Array],
                  mesh: Mesh | None) -> jax.Array:
    for block in self.layers:
      if self.remat == "none":
        x_BxLxD = block(x_BxLxD, mesh)
      else:
        block_graph, block_state = nnx.split(block)
        x_BxLxD = remat_block(block_graph, self.remat, mesh)(block_state, x_BxLxD)
      x_BxLxD = constrain(x_BxLxD)
    return x_BxLxD

  def forward(self, tokens_BxL: jax.Array, run_blocks: Callable[[jax.Array], jax.Array],
              constrain: Callable[[jax.Array], jax.Array] = lambda x: x) -> jax.Array:
    """Embedding, `run_blocks`, final norm, logits: the blocks may come from elsewhere (a scan).
    `constrain` places the residual stream (see `apply`)."""
    if tokens_BxL.ndim != 2:
      raise ValueError(f"tokens must be [batch, length], got shape {tokens_BxL.shape}")
    if tokens_BxL.shape[1] > self.max_seq_len:
      raise ValueError(
          f"sequence length {tokens_BxL.shape[1]} exceeds "
          f"config.model.max_seq_len={self.max_seq_len}"
      )
    x_BxLxD = constrain(self.embedder.encode(tokens_BxL))
    x_BxLxD = run_blocks(x_BxLxD)
    return self.embedder.decode(self.final_norm(x_BxLxD))


def remat_block(block_graph: nnx.GraphDef, remat: str, mesh: Mesh | None = None
                ) -> Callable[[nnx.State, jax.Array], jax.Array]:
  """(block state, x) -> block(x), under `remat` (one of REMAT_POLICIES) for the backward pass.

  A pure function of the block's state, so that jax.checkpoint sees the weights as inputs (saved,
  never recomputed) and the same wrapper serves an unrolled loop and a scan body. `mesh`: where
  the splash kernel is mapped (`apply`).
  """
  def run(block_state: nnx.State, x_BxLxD: jax.Array) -> jax.Array:
    return nnx.merge(block_graph, block_state)(x_BxLxD, mesh)

  if remat == "none":
    return run
  if remat == "auto":
    raise ValueError("config.model.remat='auto' is resolved at start-up (runtime/assembly.py "
                     "resolve_remat): build the model with the policy it picked")
  return jax.checkpoint(run, policy=_checkpoint_policy(remat))


def _checkpoint_policy(remat: str) -> Callable[..., bool] | None:
  """jax.checkpoint's policy for `remat`. A splash kernel is no matmul to the dots policies, so
  the one that keeps attention's matmul outputs (dots_saveable) keeps the kernel's output and
  log-sum-exp instead (B x H x s x (K + 1): what its backward pass reads); without them it would
  run the kernel's forward pass again."""
  if remat == "full":
    return None
  policy = getattr(jax.checkpoint_policies, remat)
  if remat == "dots_saveable":
    return jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(splash.RESIDUALS))
  return policy


def _mesh_axes(logical: str) -> tuple[str, ...]:
  """The mesh axes `LOGICAL_AXIS_RULES` map the logical axis `logical` to."""
  target = dict(LOGICAL_AXIS_RULES)[logical]
  return () if target is None else (target,) if isinstance(target, str) else tuple(target)


@dataclasses.dataclass(frozen=True)
class StackedGraph:
  """The graph of a model whose block tensors are stacked: the model without its blocks, and one
  block (`apply` scans it over the layer axis)."""

  shell: nnx.GraphDef
  block: nnx.GraphDef


# ----------------------------------------------------------------------------------------------
# The flat-dict view of the parameters.


def _name(path: tuple[Any, ...]) -> str:
  return "/".join(str(part) for part in path)


def _path(name: str) -> tuple[str | int, ...]:
  # nnx.List children are addressed by int; module attribute names are never all digits.
  return tuple(int(part) if part.isdigit() else part for part in name.split("/"))


def _flatten(state: nnx.State) -> dict[str, Any]:
  return {_name(path): variable.get_value() for path, variable in nnx.to_flat_state(state)}


def _build(cfg: ModelConfig, seed: int) -> Transformer:
  # Eager sharding would place each Variable on a global (thread-local) mesh at creation; learners
  # run in threads on different meshes, so placement is left to jit's out_shardings instead.
  with nnx.use_eager_sharding(False):
    return Transformer(cfg, rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=32)
def _abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, tuple[tuple[str, Any, tuple], ...]]:
  """(graphdef, ((name, ShapeDtypeStruct, logical axes), ...)) without allocating parameters."""
  abstract_model = nnx.eval_shape(lambda: _build(cfg, 0))
  graphdef, state = nnx.split(abstract_model)
  entries = []
  for path, variable in nnx.to_flat_state(state):
    if not isinstance(variable, nnx.Param):
      raise TypeError(f"{_name(path)} is a {type(variable).__name__}; the model must hold "
                      "only nnx.Param state to be exchanged as a flat dict")
    value = variable.get_value()
    axes = variable.get_metadata().get("out_sharding") or (None,) * len(value.shape)
    entries.append((_name(path), jax.ShapeDtypeStruct(value.shape, value.dtype), tuple(axes)))
  return graphdef, tuple(entries)


def logical_to_mesh_spec(axes: tuple[str | None, ...], mesh: Mesh | None = None) -> P:
  """Maps logical axis names to a PartitionSpec with `LOGICAL_AXIS_RULES`.

  With `mesh`, rules naming mesh axes it lacks drop them (a ("data", "model") mesh shards nothing
  over "fsdp"), and a dimension mapped to no remaining axis is whole.
  """
  rules = dict(LOGICAL_AXIS_RULES)
  spec = []
  for axis in axes:
    target = rules.get(axis) if axis is not None else None
    if mesh is not None and target is not None:
      kept = tuple(a for a in ((target,) if isinstance(target, str) else target)
                   if a in mesh.axis_names)
      target = None if not kept else kept[0] if len(kept) == 1 else kept
    spec.append(target)
  return P(*spec)


def _mesh_size(mesh: Mesh, target: str | tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in ((target,) if isinstance(target, str) else target))


def _is_layer(name: str) -> bool:
  return name.startswith(_LAYERS)


def _layer_rest(name: str) -> str:
  """"layers/3/attn/q_proj/kernel" -> "attn/q_proj/kernel"."""
  return name[len(_LAYERS):].split("/", 1)[1]


@functools.lru_cache(maxsize=32)
def _native(cfg: ModelConfig) -> tuple[tuple[str, Any, tuple], ...]:
  """(native name, ShapeDtypeStruct, logical axes) of every native parameter."""
  if not cfg.scan_layers:
    return _abstract(cfg)[1]
  entries, first = [], f"{_LAYERS}0/"
  for name, shape, axes in _abstract(cfg)[1]:
    if not _is_layer(name):
      entries.append((name, shape, axes))
    elif name.startswith(first):
      stacked = jax.ShapeDtypeStruct((cfg.num_layers,) + shape.shape, shape.dtype)
      entries.append((_LAYERS + _layer_rest(name), stacked, ("layers",) + tuple(axes)))
  return tuple(entries)


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict[str, NamedSharding]:
  """NamedSharding of every native parameter on `mesh`, from its logical axes (the layer axis of
  a stacked tensor is never split); keys as `init_params`."""
  shardings = {}
  for name, shape, axes in _native(cfg):
    spec = logical_to_mesh_spec(axes, mesh)
    for size, axis, mesh_axis in zip(shape.shape, axes, spec):
      if mesh_axis is not None and size % _mesh_size(mesh, mesh_axis):
        raise ValueError(
            f"config.model.{_AXIS_FIELD.get(axis, axis)}={size} must be divisible by the "
            f"'{mesh_axis}' mesh axis of size {_mesh_size(mesh, mesh_axis)} (parameter {name})"
        )
    shardings[name] = NamedSharding(mesh, spec)
  return shardings


def param_shapes(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """Shapes and dtypes of every flat parameter (one per layer tensor), without allocating any.

  These are what fragments partition and the syncer merges, whatever the native layout.
  """
  return {name: shape for name, shape, _ in _abstract(cfg)[1]}


def native_shapes(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """Shapes of the native parameters, as `init_params` returns and the train state holds them."""
  return {name: shape for name, shape, _ in _native(cfg)}


@jax.jit
def _layer_of(stacked: jax.Array, layer: jax.Array) -> jax.Array:
  return jax.lax.dynamic_index_in_dim(stacked, layer, axis=0, keepdims=False)


@jax.jit
def _with_layer(stacked: jax.Array, value: jax.Array, layer: jax.Array) -> jax.Array:
  return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), layer, axis=0)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """Where each flat tensor sits in the native parameters.

  `where[flat name] = (native name, layer)`, layer None for a tensor stored whole. Reading or
  writing one layer of a stacked tensor is a jitted dynamic slice whose index is an argument: one
  program per tensor kind, whatever the depth. Writes return new arrays (never in place): a
  learner's published parameters stay valid while its state moves on.
  """

  where: dict[str, tuple[str, int | None]]
  num_layers: int

  @property
  def stacked(self) -> bool:
    return any(layer is not None for _, layer in self.where.values())

  def get(self, params: dict[str, Any], name: str) -> jax.Array:
    native, layer = self.where[name]
    return params[native] if layer is None else _layer_of(params[native], layer)

  def set(self, params: dict[str, Any], updates: dict[str, jax.Array]) -> dict[str, Any]:
    """`params` with the flat tensors of `updates` replaced (a new dict)."""
    new = dict(params)
    for name, value in updates.items():
      native, layer = self.where[name]
      new[native] = value if layer is None else _with_layer(new[native], value, layer)
    return new

  def warm_up(self, params: dict[str, Any]) -> None:
    """Compiles and runs once, on the devices of `params`, the programs `get` and `set` run on a
    stacked tensor: one of each per tensor kind. Without it they compile at first use: the reads
    when the syncer takes a fragment's first offer, on the syncer's thread, which then opens and
    closes no round; the writes when a learner applies a fragment's first merge. Measured on 2
    cores (issue 44): four learners sharing a fake CPU device, stacked layers, 14 ms steps, saw
    all 24 first rounds land 1.2 s late while the learners ran on about 100 steps, and the
    overwrites of those merges dropped 33-83 steps each."""
    for native in sorted({native for native, layer in self.where.values() if layer is not None}):
      stacked = params[native]
      sharding = NamedSharding(stacked.sharding.mesh, P(*stacked.sharding.spec[1:]))
      # Placed as a merged Theta_p arrives (algorithm/receive.py): the cache entry `set` will hit.
      value = jax.device_put(np.zeros(stacked.shape[1:], stacked.dtype), sharding)
      jax.block_until_ready((_layer_of(stacked, 0), _with_layer(stacked, value, 0)))

  def lower_set(self, params: dict[str, Any], name: str) -> Any:
    """The program `set` runs to write flat tensor `name` of a stacked native tensor, lowered for
    `params` (arrays or sharded ShapeDtypeStructs): the value comes placed like one layer."""
    native, _ = self.where[name]
    stacked = params[native]
    sharding = NamedSharding(stacked.sharding.mesh, P(*stacked.sharding.spec[1:]))
    value = jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype, sharding=sharding)
    return _with_layer.lower(stacked, value, 0)

  def to_flat(self, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host native parameters as flat ones (views, no copy)."""
    return {name: params[native] if layer is None else params[native][layer]
            for name, (native, layer) in self.where.items()}

  def to_native(self, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host flat parameters in the native layout (stacked tensors are copied together)."""
    native: dict[str, Any] = {}
    for name, (target, layer) in self.where.items():
      if layer is None:
        native[target] = flat[name]
      else:
        native.setdefault(target, [None] * self.num_layers)[layer] = flat[name]
    return {n: np.stack(v) if isinstance(v, list) else v for n, v in native.items()}

  def flat_shardings(self, shardings: dict[str, NamedSharding]) -> dict[str, NamedSharding]:
    """The sharding of each flat tensor, from the native ones (a stacked tensor's, less its layer
    axis)."""
    out = {}
    for name, (native, layer) in self.where.items():
      sharding = shardings[native]
      out[name] = sharding if layer is None else NamedSharding(sharding.mesh,
                                                               P(*sharding.spec[1:]))
    return out


@functools.lru_cache(maxsize=32)
def param_layout(cfg: ModelConfig) -> ParamLayout:
  """The flat tensors' places in the native parameters of `cfg`."""
  where = {}
  for name in param_shapes(cfg):
    if cfg.scan_layers and _is_layer(name):
      layer = int(name[len(_LAYERS):].split("/", 1)[0])
      where[name] = (_LAYERS + _layer_rest(name), layer)
    else:
      where[name] = (name, None)
  return ParamLayout(where, cfg.num_layers)


def _init_outside_blocks(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
  """The parameters outside the blocks (embedding, final norm), drawn from `key`."""
  # Built as a one-block model whose block is dropped (XLA prunes it), so that this keeps up with
  # Transformer.__init__ without restating it.
  with nnx.use_eager_sharding(False):
    shell = Transformer(dataclasses.replace(cfg, num_layers=1), rngs=nnx.Rngs(key))
  return {name: value for name, value in _flatten(nnx.state(shell)).items()
          if not name.startswith(_LAYERS)}


def _init_block(cfg: ModelConfig, key: jax.Array, layer: jax.Array) -> dict[str, jax.Array]:
  """One block's parameters, keyed by their names within the block ("attn/q_proj/kernel")."""
  with nnx.use_eager_sharding(False):
    block = Block(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, layer)))
  return _flatten(nnx.state(block))


@functools.lru_cache(maxsize=32)
def _initialisers(cfg: ModelConfig, mesh: Mesh) -> tuple[Callable[..., dict[str, jax.Array]], ...]:
  """Jitted (key -> outside-block params, (key, layer) -> block params) of `cfg` on `mesh`.

  Keys and the layer index are arguments, so one compiled pair serves every seed and every layer.
  A vmap over the layers, split into per-layer outputs, would not do: XLA fuses the random draws
  into each per-layer slice, and the compile grew with depth again (CPU: 5 s at 4 layers, 10 s
  at 16).
  """
  shardings = param_layout(cfg).flat_shardings(param_shardings(cfg, mesh))
  first_block = f"{_LAYERS}0/"
  outside = {n: s for n, s in shardings.items() if not n.startswith(_LAYERS)}
  block = {n.removeprefix(first_block): s for n, s in shardings.items()
           if n.startswith(first_block)}
  return (jax.jit(functools.partial(_init_outside_blocks, cfg), out_shardings=outside),
          jax.jit(functools.partial(_init_block, cfg), out_shardings=block))


def init_params(cfg: ModelConfig, mesh: Mesh, seed: int
                ) -> tuple[nnx.GraphDef | StackedGraph, dict[str, jax.Array]]:
  """Initialises the parameters directly in their sharded native layout on `mesh`.

  Values depend only on `seed`, not on the mesh or the layout: JAX's partitionable threefry draws
  the same numbers whichever way the output is sharded, so every learner can start from identical
  weights. The key is an argument of the compiled initialisers, never a constant folded into them:
  at 200M parameters on an H100 the old whole-model initialiser, seed folded in, took 99-122 s to
  compile.
  """
  init_outside_blocks, init_block = _initialisers(cfg, mesh)
  outside_key, blocks_key = jax.random.split(jax.random.key(seed))
  params = init_outside_blocks(outside_key)
  layout = param_layout(cfg)
  if layout.stacked:
    shardings = param_shardings(cfg, mesh)
    for name, shape in native_shapes(cfg).items():
      if _is_layer(name):
        params[name] = jax.jit(functools.partial(jnp.zeros, shape.shape, shape.dtype),
                               out_shardings=shardings[name])()
  for layer in range(cfg.num_layers):
    block = init_block(blocks_key, layer)
    updates = {f"{_LAYERS}{layer}/{name}": value for name, value in block.items()}
    params = layout.set(params, updates) if layout.stacked else {**params, **updates}
  return graph(cfg), {name: params[name] for name in native_shapes(cfg)}


@functools.lru_cache(maxsize=32)
def graph(cfg: ModelConfig) -> nnx.GraphDef | StackedGraph:
  """What `apply` needs besides the parameters: the model's graphdef, or for stacked blocks the
  model without blocks and one block."""
  if not cfg.scan_layers:
    return _abstract(cfg)[0]
  def without_blocks() -> Transformer:
    model = _build(dataclasses.replace(cfg, num_layers=1), 0)
    model.layers = nnx.List([])
    return model

  shell = nnx.eval_shape(without_blocks)
  def one_block() -> Block:
    with nnx.use_eager_sharding(False):
      return Block(cfg, rngs=nnx.Rngs(0))

  block = nnx.eval_shape(one_block)
  return StackedGraph(nnx.split(shell)[0], nnx.split(block)[0])


def _state(params: dict[str, Any]) -> nnx.State:
  return nnx.from_flat_state({_path(name): value for name, value in params.items()})


def residual_sharding(mesh: Mesh) -> NamedSharding:
  """The residual stream [B, L, D] of a learner on `mesh`: split like its batch ("batch" rule:
  data x fsdp), whole along the sequence and the embedding.

  Without it the SPMD partitioner may follow the weights instead: the embedding table is split
  along "embed" over fsdp, and XLA:TPU then kept the activations split along D and the batch whole
  over fsdp (gemma_2b_v5p's attention held 32 sequences per chip instead of 4, and its compile
  failed: runtime/tpu_aot.py)."""
  return NamedSharding(mesh, logical_to_mesh_spec(("batch", None, None), mesh))


def apply(graphdef: nnx.GraphDef | StackedGraph, params: dict[str, jax.Array],
          tokens_BxL: jax.Array, *, activations: NamedSharding | None = None,
          mesh: Mesh | None = None) -> jax.Array:
  """Pure forward pass: float32 logits_BxLxV for `tokens_BxL` under the native `params`.

  `activations`: where the residual stream lives between blocks (`residual_sharding`), inside a
  jitted step on that sharding's mesh; None leaves it to the compiler. `mesh`: the mesh the step
  runs on, over which the splash kernel is mapped (default: `activations`' mesh; None: one
  chip's arrays).
  """
  if activations is None:
    constrain = lambda x: x  # noqa: E731
  else:
    constrain = lambda x: jax.lax.with_sharding_constraint(x, activations)  # noqa: E731
    mesh = mesh or activations.mesh
  if not isinstance(graphdef, StackedGraph):
    return nnx.merge(graphdef, _state(params))(tokens_BxL, constrain, mesh)
  shell = nnx.merge(graphdef.shell, _state({n: v for n, v in params.items() if not _is_layer(n)}))
  stacked = _state({n[len(_LAYERS):]: v for n, v in params.items() if _is_layer(n)})

  block = remat_block(graphdef.block, shell.remat, mesh)

  def run_blocks(x_BxLxD: jax.Array) -> jax.Array:
    def body(x_BxLxD, block_state):
      return constrain(block(block_state, x_BxLxD)), None

    x_BxLxD, _ = jax.lax.scan(body, x_BxLxD, stacked)
    return x_BxLxD

  return shell.forward(tokens_BxL, run_blocks, constrain)


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Per-token negative log-likelihood in nats, float32 [B, L]."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits_BxLxV.astype(jnp.float32), targets_BxL
  )


def num_params(params: dict[str, Any]) -> int:
  """Total number of scalars in `params` (arrays or ShapeDtypeStructs)."""
  return sum(math.prod(p.shape) for p in params.values())
