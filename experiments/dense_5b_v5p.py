"""The paper's quality runs (spec, "Quality"): a dense 5B model, 8 learners on v5p slices.

The paper trains a dense 5B model on 1T tokens with M = 8 learners; its layer shapes and slice
sizes are not published. This is a Gemma-style decoder of that size: d = 3072, 22 blocks of 24
heads x 128 and a 16,384-wide GeGLU MLP (189M parameters each), a 256k vocabulary (787M, tied):
4.94B parameters. Each learner is a v5p-128 slice (64 chips, 4x4x4), data=2 x fsdp=8 x model=4 as
in gemma_2b_v5p, and trains on 64 sequences of 8,192 tokens per step (4.2M tokens per step over
the 8 learners). `model.remat = "auto"` lets the TPU compiler's figures pick the cheapest policy
that leaves 10% of HBM free, at start-up and in scripts/aot_compile.py (results/aot_dense_5b_v5p.md
shows what it picks and what each policy needs).
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments import gemma_2b_v5p  # pylint: disable=g-import-not-at-top


def get_config():
  config = gemma_2b_v5p.get_config()
  config.workdir = "gs://YOUR_BUCKET/decoupled_diloco/dense_5b_v5p"
  config.num_learners = 8
  config.learner_mesh_shapes = ((2, 8, 4),)
  config.devices.tpu_topologies = ("v5p:4x4x4",)
  config.model.embed_dim = 3072
  config.model.num_layers = 22
  config.model.num_heads = 24
  config.model.head_dim = 128
  config.model.mlp_dim = 16_384
  config.model.remat = "auto"
  config.data.batch_size = 64
  return config
