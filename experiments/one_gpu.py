"""Four learners on one accelerator: Decoupled DiLoCo for a researcher with a single GPU.

M = 4 learners share the one device (config.devices.learners_sharing_devices = 4): each has its own
state, thread and step, and their steps take turns on the device (runtime/core/device_share.py); the
syncer runs on the host's CPUs. `--config.mode=dp` is the baseline on the same device at the same
tokens: one job whose batch is the four learners' together.

  python -m decoupled_diloco.main --config=experiments/one_gpu.py          # one GPU, ~124M
  python -m decoupled_diloco.main --config=experiments/one_gpu.py --config.mode=dp
  python -m decoupled_diloco.main --config=experiments/one_gpu.py:cpu      # the shape scaled down
  python scripts/bench_one_device.py                                       # both, compared

The model is a 124.1M-parameter byte-level decoder at sequence length 1024 (d = 768, 12 layers of
12 heads x 64, GeGLU MLP 3456), bfloat16 activations and float32 weights as the other accelerator
configs: per learner ~2.5 GB of state, publication and offers in flight, 10 GB for four, far inside
an 80 GB GPU (the run checks it against the device's memory before placing anything). dp's one
job of batch 32 with XLA's attention needs 67.6 GB: on an 80 GB H100, of which JAX takes 75% by
default (63.8 GB), `--config.mode=dp` is refused with those figures; `--config.model.attention=cudnn`
(measured: 35.9 GB, 310k tokens/s) or XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 (not tried) runs it. The
four learners stay on XLA's attention: with cuDNN's, learners sharing the GPU crashed the process
(the run refuses that pairing). The bundled
corpus (1.1 MB) is a few epochs at this size: point `--config.data.source` at shards of a real
corpus (scripts/prepare_data.py) for a quality comparison beyond that.

`:cpu` keeps the layout (four learners and dp on one device) with experiments/tiny_cpu.py's model
on one fake CPU device, for tests and for measuring what sharing costs on a CPU.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top

SIZES = ("gpu", "cpu")


def get_config(size: str = "gpu"):
  if size not in SIZES:
    raise ValueError(f"experiments/one_gpu.py:{size}: the size must be one of {', '.join(SIZES)}")
  config = tiny_cpu.get_config()
  config.workdir = f"workdir/one_gpu_{size}"
  config.num_learners = 4
  config.learner_mesh_shapes = ((1, 1),)
  config.devices.learners_sharing_devices = 4  # all four on the one device
  if size == "cpu":
    # One fake CPU device for the four learners (dp: for its one job), one for the syncer.
    config.devices.num_fake_cpu_devices = 2
    config.num_steps = 200
    config.eval_every = 50
    return config
  config.devices.platform = "gpu"
  config.devices.num_fake_cpu_devices = 0
  config.num_steps = 300
  config.log_every = 25
  config.eval_every = 100
  config.eval_batches = 4
  config.checkpoint.every_steps = 0  # a benchmark's run: no checkpoint writes in its time
  # The host has cores to spare: merges of different fragments run at once.
  config.syncer.num_workers = 4
  config.inner.learning_rate = 1e-3
  config.inner.warmup_steps = 30
  config.inner.weight_decay = 0.1
  config.inner.b2 = 0.95
  config.model.embed_dim = 768
  config.model.num_layers = 12
  config.model.num_heads = 12
  config.model.head_dim = 64
  config.model.mlp_dim = 3456
  config.model.max_seq_len = 1024
  config.model.dtype = "bfloat16"
  config.model.scan_layers = True  # one compiled block: start-up independent of depth
  config.data.seq_len = 1024
  config.data.batch_size = 8  # per learner; dp: 4 x 8
  return config
