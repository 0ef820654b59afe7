"""Heterogeneous hardware (docs/design.md §4): 4 learners on v6e-64 + 4 on v5p-64 slices.

The paper's quorum / grace experiment: learners on two TPU generations step about 18% apart, the
syncer merges with K = 1 and an adaptive grace window so that no learner waits. One controller sees
all chips; the first four learners get v6e slices (64 chips each, data=2 x fsdp=8 x model=4), the
last four v5p slices (32 chips each, data=1 x fsdp=8 x model=4): the run matches each learner to a
slice of the generation its tpu_topologies entry names, whatever order the devices come in
(runtime/core/slices.py; results/aot_hetero_v6e_v5p_multislice.md places them on a 4 + 4 slice
pod). Compiled for both slices by the TPU compiler (scripts/aot_compile.py,
results/aot_hetero_v6e_v5p.md), unchanged: the train step needs 27% of a v6e chip's HBM and 19% of
a v5p's; by the roofline the v6e learners step in 0.27 s and the v5p ones in 0.44 s, both HBM-bound
by attention at 8,192 tokens (the paper's were 18% apart). With --config.model.attention=splash
(results/aot_hetero_v6e_v5p_splash.md) both are compute-bound, at 0.10 and 0.39 s.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments import gemma_2b_v5p  # pylint: disable=g-import-not-at-top


def get_config():
  config = gemma_2b_v5p.get_config()
  config.workdir = "gs://YOUR_BUCKET/decoupled_diloco/hetero_v6e_v5p"
  config.num_learners = 8
  # (data, fsdp, model): v6e chips hold 32 GB, so the weights are fully sharded on both kinds.
  config.learner_mesh_shapes = ((2, 8, 4),) * 4 + ((1, 8, 4),) * 4
  # v6e-64 is an 8x8 slice; v5p-64 counts TensorCores: 32 chips, 2x4x4.
  config.devices.tpu_topologies = ("v6e:8x8",) * 4 + ("v5p:2x4x4",) * 4
  config.data.batch_size = 32  # per learner; divides both data axes
  config.sync.quorum = 1
  config.sync.grace_gamma = 0.5
  return config
