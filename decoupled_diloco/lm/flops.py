"""Model FLOPs per trained token, counted from the model config (for tokens/s -> FLOP/s -> MFU).

The usual analytic count (Kaplan et al. 2020, arXiv 2001.08361 §2.1; PaLM, arXiv 2204.02311
appendix B), spelled out for this decoder (model.py):

  flops/token = 6 N_matmul + 12 L s H K

- N_matmul = L (4 d H K + 3 d F) + V d: the weights that multiply activations. Per block the
  q, k, v and o projections (d x H K each) and the gated MLP's gate, up and down (d x F each);
  outside the blocks the unembedding, the tied embedding read as V x d logits. The input lookup
  of that same matrix is a gather (no FLOPs), and the RMSNorm gains are elementwise: neither is
  counted. Each weight costs 2 FLOPs per token forward (a multiply-add) and 4 backward (the
  gradients of its input and of itself): 6 per trained token.
- 12 L s H K: attention's two matmuls, scores Q K^T and the weighted sum of V, each 2 s H K FLOPs
  per token per layer forward, three times that with the backward pass. s is the trained
  sequence length (`data.seq_len`); the causal mask is not discounted (PaLM's convention: XLA
  computes the masked half too).

Softmax, norms, activations, rotary embeddings and the optimizer update are not counted: model
FLOPs are the matmuls the model needs, whatever the implementation, so MFU compares across
runtimes and hardware. No JAX here, so a script that must not start JAX can import it.

What a compiled train step multiplies is more when blocks are rematerialised
(config.model.remat): the backward pass runs the forward matmuls it did not keep again.
`train_flops_per_token` adds them, which is what the TPU compiler's count of a step is compared
with (runtime/tpu_aot.py). It is also less with config.model.attention='splash': the kernel
(lm/splash.py) skips the blocks above the causal diagonal, so a compiled step multiplies half of
attention's s x s matmuls (the model FLOPs above still count them whole).
"""

from __future__ import annotations

from typing import Protocol

# The named scope lm/splash.py puts around its causal kernel: the HLO analysis
# (runtime/hardware/kernels.py) finds it in a kernel's op_name and counts the blocks above the
# diagonal as skipped. Here, with no JAX, so that the analysis need not import the kernel.
CAUSAL_KERNEL_SCOPE = "causal_splash_attention"


class _ModelShape(Protocol):
  """The fields of model.ModelConfig the count reads."""

  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  remat: str
  attention: str


def matmul_params(cfg: _ModelShape) -> int:
  """N_matmul: weights that multiply activations (blocks' projections and the unembedding)."""
  d, hk, f = cfg.embed_dim, cfg.num_heads * cfg.head_dim, cfg.mlp_dim
  return cfg.num_layers * (4 * d * hk + 3 * d * f) + cfg.vocab_size * d


def attention_flops_per_token(cfg: _ModelShape, seq_len: int) -> int:
  """12 L s H K: scores and weighted values, forward and backward."""
  return 12 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim


def model_flops_per_token(cfg: _ModelShape, seq_len: int) -> int:
  """Training FLOPs per token: 6 N_matmul + 12 L s H K (see the module docstring)."""
  return 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)


def causal_model_flops_per_token(cfg: _ModelShape, seq_len: int) -> int:
  """6 N_matmul + 6 L s H K: the model FLOPs without causal attention's masked half, as Megatron-LM
  and MaxText (maxtext_utils.calculate_tflops_training_per_device) count them. A kernel that
  skips that half (splash) can pass 100% of PaLM's count; it cannot pass this one."""
  return 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len) // 2


def block_projection_flops_per_token(cfg: _ModelShape) -> int:
  """The blocks' forward matmuls per token outside attention's s x s ones: projections and MLP."""
  d, hk, f = cfg.embed_dim, cfg.num_heads * cfg.head_dim, cfg.mlp_dim
  return 2 * cfg.num_layers * (4 * d * hk + 3 * d * f)


def computed_attention_flops_per_token(cfg: _ModelShape, seq_len: int) -> int:
  """Attention's matmuls a compiled step runs, forward and backward: 12 L s H K with XLA's
  attention (it multiplies the masked half too), half that with the splash kernel."""
  whole = attention_flops_per_token(cfg, seq_len)
  return whole // 2 if cfg.attention == "splash" else whole


def forward_flops_per_token(cfg: _ModelShape, seq_len: int) -> int:
  """An evaluation's matmuls per token as compiled: 2 N_matmul + 4 L s H K (2 L s H K with the
  splash kernel)."""
  return 2 * matmul_params(cfg) + computed_attention_flops_per_token(cfg, seq_len) // 3


# The forward matmuls a remat policy runs again in the backward pass: "full" and
# "nothing_saveable" keep only a block's input; "dots_with_no_batch_dims_saveable" keeps the
# projections and MLP (dot_generals without batch dimensions) but not attention's scores and
# weighted values (batched over heads); the others keep every matmul output.
_RECOMPUTED = {"full": "blocks", "nothing_saveable": "blocks",
               "dots_with_no_batch_dims_saveable": "attention"}


def train_flops_per_token(cfg: _ModelShape, seq_len: int) -> int:
  """Matmul FLOPs per token of a train step under `cfg.remat` and `cfg.attention`: the model
  FLOPs with attention as compiled (`computed_attention_flops_per_token`), plus the forward
  matmuls rematerialisation repeats."""
  if cfg.remat == "auto":
    raise ValueError("config.model.remat='auto' must be resolved to a policy first")
  attention = computed_attention_flops_per_token(cfg, seq_len)
  recomputed = _RECOMPUTED.get(cfg.remat)
  extra = {None: 0, "blocks": block_projection_flops_per_token(cfg) + attention // 3,
           "attention": attention // 3}[recomputed]
  return 6 * matmul_params(cfg) + attention + extra
