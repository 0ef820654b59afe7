"""Causal attention through the Pallas TPU splash attention kernel (config.model.attention='splash').

XLA's attention writes the s x s scores and probabilities to HBM: at 8,192 tokens the TPU learners
were HBM-bound on them (results/aot_hetero_v6e_v5p.md). The splash kernel
(`jax.experimental.pallas.ops.tpu.splash_attention`, what MaxText runs on TPU) is flash attention:
it streams K and V blocks through VMEM past each block of queries with an online softmax, so only
Q, K, V, the output and one log-sum-exp per row reach HBM, and the blocks above the causal
diagonal are skipped. Its backward pass is one fused kernel (dQ, dK and dV together: 2.5x the
forward's FLOPs, where separate dQ and dKV kernels recompute the scores twice, 3.5x).

A Mosaic kernel runs on one chip and XLA cannot partition it, so it runs under `shard_map` over the
learner's mesh: the batch split as the model's "batch" logical axis places it (data x fsdp), the
heads as "heads" (model), every chip attending over its own sequences and heads in full. On CPU
devices the kernel runs in Pallas' interpret mode (how the tests check it against XLA's attention);
a run refuses splash off TPU (settings.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib
from jax.sharding import Mesh, PartitionSpec as P

from decoupled_diloco.lm import flops as flops_lib

# The kernel's tiles are whole vector registers: block sizes are multiples of 128 lanes.
BLOCK_MULTIPLE = 128
# Default block (queries and keys alike) per chip: MaxText's 512, or the smallest power of two
# above the chip's FLOP/byte balance where that is larger. Each K/V block a query block loads is
# used for 4 x block_q FLOPs per 2 x 2 bytes of its bf16 elements, i.e. block_q FLOP per byte
# (likewise block_kv for the Q and dO blocks of the backward pass): v6e's 918 TFLOP/s over
# 1.64 TB/s is 560 FLOP/byte, so 512-row blocks would leave the kernel waiting on HBM there;
# v5p (166), v5e (240) and v4 (229) are below 512.
DEFAULT_BLOCK = 512
_BLOCK_BY_DEVICE_KIND = {"tpu v6 lite": 1024, "tpu v6e": 1024}
# The kernel's output and log-sum-exp carry this checkpoint name: remat policies that keep
# attention's matmul outputs keep these instead (lm/model.py `remat_block`).
RESIDUALS = "splash_residuals"


def default_block(device_kind: str) -> int:
  """The block size for chips of `device_kind` ("TPU v6 lite") when the config names none."""
  return _BLOCK_BY_DEVICE_KIND.get(device_kind.strip().lower(), DEFAULT_BLOCK)


def fitted_block(wanted: int, seq_len: int) -> int:
  """The largest multiple of 128 that is at most `wanted` and divides `seq_len` (validated to be a
  multiple of 128), so a default block fits any sequence length a run accepts."""
  block = min(wanted, seq_len) // BLOCK_MULTIPLE * BLOCK_MULTIPLE
  while seq_len % block:
    block -= BLOCK_MULTIPLE
  return block


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, seq_len: int, block_q: int, block_kv: int, interpret: bool):
  """The causal kernel for `heads` heads of one sequence, built once per shape (its block mask is
  worked out on the host: 1.3 s at 8,192 tokens in blocks of 512). Its mask arrays are made
  concrete even when the first call comes inside a trace, so that no later trace meets them as
  that trace's values."""
  mask = splash_lib.MultiHeadMask([splash_lib.CausalMask((seq_len, seq_len))] * heads)
  sizes = splash_lib.BlockSizes(
      block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
      block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
      use_fused_bwd_kernel=True)
  with jax.ensure_compile_time_eval():
    return splash_lib.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                      residual_checkpoint_name=RESIDUALS, interpret=interpret)


def _split(mesh: Mesh | None, axes: tuple[str, ...], size: int) -> str | tuple[str, ...] | None:
  """The mesh axes of `axes` present in `mesh`, if they divide `size` (else the dim is whole)."""
  if mesh is None:
    return None
  kept = tuple(a for a in axes if a in mesh.axis_names)
  if not kept or size % math.prod(mesh.shape[a] for a in kept):
    return None
  return kept[0] if len(kept) == 1 else kept


def causal_attention(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array, *,
                     mesh: Mesh | None, batch_axes: tuple[str, ...], head_axes: tuple[str, ...],
                     block_q: int = 0, block_kv: int = 0) -> jax.Array:
  """softmax(Q K^T / sqrt(K) + causal mask) V, as jax.nn.dot_product_attention(is_causal=True).

  `mesh`: the learner's, over whose `batch_axes` and `head_axes` (those of them it has and that
  divide the batch and the heads) the kernel is mapped; None: the arrays are one chip's.
  `block_q` / `block_kv`: 0 = `default_block` of the mesh's chips; fitted to the sequence length.
  """
  batch, seq_len, heads, head_dim = q_BxLxHxK.shape
  device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
  block_q = fitted_block(block_q or default_block(device.device_kind), seq_len)
  block_kv = fitted_block(block_kv or default_block(device.device_kind), seq_len)
  interpret = device.platform == "cpu"
  # The kernel does not scale the scores; scaling Q first is the same product.
  q_BxLxHxK = q_BxLxHxK * jnp.asarray(1.0 / math.sqrt(head_dim), q_BxLxHxK.dtype)

  def local(q_BxHxLxK, k_BxHxLxK, v_BxHxLxK):
    kernel = _kernel(q_BxHxLxK.shape[1], seq_len, block_q, block_kv, interpret)
    # The named scope tells the HLO analysis the kernel skips the masked half (lm/flops.py).
    with jax.named_scope(flops_lib.CAUSAL_KERNEL_SCOPE):
      return jax.vmap(kernel)(q_BxHxLxK, k_BxHxLxK, v_BxHxLxK)

  spec = P(_split(mesh, batch_axes, batch), _split(mesh, head_axes, heads), None, None)
  if mesh is not None:
    local = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                          check_vma=False)
  heads_first = [x.swapaxes(1, 2) for x in (q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)]
  return local(*heads_first).swapaxes(1, 2)
