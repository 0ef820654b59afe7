"""Reference config for Cloud TPU: a Gemma-2B-shaped decoder, 8 learners of one v5p-128 slice each.

Start from this on a Pathways / multi-slice TPU deployment: one controller sees all 8 x 64 chips and
carves them into 8 learner meshes of (data=2, fsdp=8, model=4), one per slice (docs/tpu_pods.md;
compiled so on an 8-slice pod in results/aot_gemma_2b_v5p_multislice.md), weights and optimizer
state fully sharded, blocks rematerialised; the syncer runs on host CPUs. Never run on a TPU so far, but
compiled for its v5p:4x4x4 slice by the TPU compiler (scripts/aot_compile.py,
results/aot_gemma_2b_v5p.md): every learner program fits, the train step in 16% of a chip's HBM,
unchanged from the layout checked on fake CPU devices (tests/test_experiments.py,
tests/test_fsdp.py) once the model placed its residual stream like the batch (its first compile
had run out of VMEM). remat=auto would pick dots_saveable (74% of HBM, a roofline step 14% shorter
than full's 423 ms); full is kept for the headroom. Set
`data.source` to ArrayRecord shards of your corpus made by scripts/prepare_data.py with a 256k
tokenizer (the bundled byte corpus here only validates; vocab_size is Gemma's for sizing).
Sync defaults are the paper's main-experiment values (docs/design.md §7): P = H = 24, tau = 2,
K = 1, M = 8.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top


def get_config():
  config = tiny_cpu.get_config()
  config.workdir = "gs://YOUR_BUCKET/decoupled_diloco/gemma_2b_v5p"
  config.num_steps = 100_000
  config.log_every = 100
  config.eval_every = 2_000
  config.eval_batches = 64
  config.devices.platform = "tpu"
  config.devices.num_fake_cpu_devices = 0  # real chips
  config.num_learners = 8
  # v5p-128 = 64 chips: 2-way data x 8-way fsdp x 4-way tensor parallel. fsdp x model splits the
  # weights and AdamW moments (~40 GB in float32 for 2.6B parameters) 32 ways, ~1.3 GB per chip;
  # the batch is split 16 ways (data x fsdp).
  config.learner_mesh_shapes = ((2, 8, 4),)
  config.devices.tpu_topologies = ("v5p:4x4x4",)  # v5p-128: 64 chips in a 4x4x4 torus
  config.syncer.num_devices = 1  # host CPU devices of the controller
  config.sync.grace_cap_s = 5.0
  config.compression.outer_grad = "bf16"
  config.compression.broadcast = "bf16"
  config.inner.learning_rate = 3e-4
  config.inner.warmup_steps = 2_000
  config.inner.weight_decay = 0.1
  config.inner.b2 = 0.95
  config.model.vocab_size = 256_128
  config.model.embed_dim = 2048
  config.model.num_layers = 18
  config.model.num_heads = 8
  config.model.head_dim = 256
  config.model.mlp_dim = 16_384
  config.model.max_seq_len = 8192
  config.model.dtype = "bfloat16"
  config.model.scan_layers = True  # 18 layers: one compiled block, start-up independent of depth
  # 8192-token sequences: keep only each block's input for the backward pass and recompute the
  # rest (~1/3 more compute; MaxText's "full").
  config.model.remat = "full"
  config.data.seq_len = 8192
  config.data.batch_size = 64  # per learner: 8 x 64 x 8192 tokens per step across learners
  return config
