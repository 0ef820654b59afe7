"""The tiny config trained with replicated weights and with fsdp=2: same loss, half the state bytes.

  .venv/bin/python scripts/bench_fsdp.py [--num_steps=200]

One dp learner on 2 fake CPU devices, equal steps, four runs: the replicated layout (data=2), the
same with another seed (the noise yardstick for the loss), fsdp=2 (data=1, fsdp=2), and fsdp=2 with
config.model.remat=full. For each: final eval loss, mean train loss over the last 20 steps, median
step time, per-device bytes of params + optimizer state (from the arrays' shard shapes) and XLA's
compiled memory analysis of the train step on one device (arguments; output bytes aliased to the
donated input; temporaries). Prints and writes `results/fsdp.json`.
"""

import json
import math
import os
import pathlib
import sys
import tempfile

from absl import flags

from decoupled_diloco import errors

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

_NUM_STEPS = flags.DEFINE_integer("num_steps", 200, "Steps of each run.")
_OUT = flags.DEFINE_string("out", "results/fsdp.json", "Where the figures go.")

_RUNS = {
    "replicated": {"learner_mesh_shapes": ((2, 1),)},
    "replicated_seed1": {"learner_mesh_shapes": ((2, 1),), "seed": 1},
    "fsdp2": {"learner_mesh_shapes": ((1, 2, 1),)},
    "fsdp2_remat_full": {"learner_mesh_shapes": ((1, 2, 1),), "model.remat": "full"},
}


def _measure(overrides: dict, num_steps: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from decoupled_diloco import settings as settings_lib  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import train  # pylint: disable=g-import-not-at-top
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top

  config = tiny_cpu.get_config()
  config.workdir = tempfile.mkdtemp(prefix="bench_fsdp_")
  config.mode = "dp"
  config.num_learners = 1
  config.num_steps = num_steps
  config.eval_every = 0
  config.checkpoint.every_steps = 0
  config.devices.num_fake_cpu_devices = 3
  config.update_from_flattened_dict(overrides)
  run = train.build(settings_lib.validate(config))
  learner = run.learners[0]
  like = learner.state_like
  state_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                    for x in jax.tree.leaves(like))
  batch = {k: jax.ShapeDtypeStruct((run.settings.learner_batch_size, run.settings.data.seq_len),
                                   np.int32) for k in ("inputs", "targets")}
  memory = learner._train_step.lower(like, batch).compile().memory_analysis()  # pylint: disable=protected-access
  summary = train.execute(run, progress=False)
  return {
      "learner_mesh_shapes": run.settings.learner_mesh_shapes,
      "remat": run.settings.model.remat,
      "final_eval_loss": summary["final_eval_loss"],
      "train_loss_last20": float(np.mean(learner.losses[-20:])),
      "median_step_s": float(np.median(learner.step_times[5:])),
      "state_bytes_per_device": int(state_bytes),
      "step_argument_bytes_per_device": int(memory.argument_size_in_bytes),
      "step_alias_bytes_per_device": int(memory.alias_size_in_bytes),
      "step_temp_bytes_per_device": int(memory.temp_size_in_bytes),
  }


def main(argv):
  del argv
  results = {"num_steps": _NUM_STEPS.value, "runs": {}}
  for name, overrides in _RUNS.items():
    results["runs"][name] = _measure(overrides, _NUM_STEPS.value)
    print(name, json.dumps(results["runs"][name]), flush=True)
  runs = results["runs"]
  results["loss_noise_between_seeds"] = abs(runs["replicated"]["final_eval_loss"]
                                            - runs["replicated_seed1"]["final_eval_loss"])
  results["fsdp2_minus_replicated_loss"] = (runs["fsdp2"]["final_eval_loss"]
                                            - runs["replicated"]["final_eval_loss"])
  results["fsdp2_state_bytes_ratio"] = (runs["fsdp2"]["state_bytes_per_device"]
                                        / runs["replicated"]["state_bytes_per_device"])
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)
  print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
  errors.run_main(main)
