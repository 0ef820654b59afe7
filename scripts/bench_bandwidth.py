r"""Bytes per inner step between one learner and the syncer vs what DP's ring all-reduce moves.

Runs experiments/tiny_cpu.py (P = 24) with the outer gradients on the wire in bf16 and in int4, counts
the bytes the runtime really sends and receives per learner inner step, and compares them with a
data-parallel worker's ring all-reduce of the same model's gradients (n = num_learners workers;
each sends and receives 2 (n-1)/n N b bytes per step), for fp32 and bf16 gradients, all measured or
computed in this run. Targets: >= 24x (bf16, P = 24), >= 90x (int4).

  python scripts/bench_bandwidth.py
  python scripts/bench_bandwidth.py --num_steps=200 --formats=bf16,int8,int4
"""

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from decoupled_diloco import errors
from decoupled_diloco.runtime.core import devices  # pylint: disable=g-import-not-at-top
from decoupled_diloco.sim import bandwidth
from experiments import tiny_cpu

_FORMATS = flags.DEFINE_list("formats", ["bf16", "int4"], "Outer-gradient wire formats to run.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 96, "Inner steps per learner (a multiple of H).")
_OUT = flags.DEFINE_string("out", "results/bench_bandwidth", "Writes OUT.json and OUT.md.")

# Theta goes back in bf16 for every row: the learners overwrite their fragment with it, and the
# syncer keeps fp32. Integer formats are for outer gradients only (docs/design.md §5).
_BROADCAST = "bf16"


def dp_ring_bytes_per_step(num_params: int, num_workers: int, grad_bytes: int) -> int:
  """Bytes one DP worker sends plus receives per step in a ring all-reduce: twice what it sends."""
  return int(2 * bandwidth.dp_ring_allreduce_bytes_per_step(num_params, num_workers, grad_bytes))


def main(argv):
  del argv
  config = tiny_cpu.get_config()
  devices.request_fake_cpu_devices(config.devices.num_fake_cpu_devices)
  from decoupled_diloco import settings  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import train
  start = time.perf_counter()
  rows = []
  for fmt in _FORMATS.value:
    config.num_steps = _NUM_STEPS.value
    config.eval_every = 0
    config.log_every = 10_000
    config.compression.outer_grad = fmt
    config.compression.broadcast = _BROADCAST
    config.workdir = f"/tmp/bench_bandwidth/{fmt}"
    run = train.build(settings.validate(config))
    summary = train.execute(run, progress=False)
    steps = sum(summary["learner_steps"])
    n, params = summary["num_learners"], summary["num_params"]
    # Steady state: the merges during training, not the full-model flush after the last step.
    in_training = [d for d in run.syncer.tape if not d["final"]]
    up = sum(d["bytes_up"] for d in in_training) / steps
    down = sum(d["bytes_down"] for d in in_training) / steps
    per_step = up + down
    row = {
        "outer_grad": fmt, "broadcast": _BROADCAST, "num_params": params,
        "num_fragments": summary["num_fragments"], "num_learners": n,
        "bytes_per_learner_step": per_step,
        "up_per_learner_step": up,
        "down_per_learner_step": down,
        "mean_learners_per_merge": sum(len(d["learners"]) for d in in_training) / len(in_training),
        "model_full_participation": bandwidth.bytes_per_inner_step(
            params, summary["num_fragments"], fmt, _BROADCAST, config.compression.block_size),
        "dp_fp32_bytes_per_step": dp_ring_bytes_per_step(params, n, 4),
        "dp_bf16_bytes_per_step": dp_ring_bytes_per_step(params, n, 2),
        "merges": summary["merges"], "final_eval_loss": summary["final_eval_loss"],
    }
    row["reduction_vs_dp_fp32"] = row["dp_fp32_bytes_per_step"] / per_step
    row["reduction_vs_dp_bf16"] = row["dp_bf16_bytes_per_step"] / per_step
    rows.append(row)
    print(f"{fmt}: {per_step:,.0f} B per learner step; DP ring fp32 "
          f"{row['dp_fp32_bytes_per_step']:,} B -> {row['reduction_vs_dp_fp32']:.1f}x, bf16 "
          f"{row['dp_bf16_bytes_per_step']:,} B -> {row['reduction_vs_dp_bf16']:.1f}x", flush=True)
  seconds = time.perf_counter() - start
  lines = ["| outer grad / Theta | bytes per learner step (up + down) | DP fp32 ring | x less | "
           "DP bf16 ring | x less |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['outer_grad']} / {r['broadcast']} | {r['bytes_per_learner_step']:,.0f} "
                 f"({r['up_per_learner_step']:,.0f} + {r['down_per_learner_step']:,.0f}) | "
                 f"{r['dp_fp32_bytes_per_step']:,} | {r['reduction_vs_dp_fp32']:.1f} | "
                 f"{r['dp_bf16_bytes_per_step']:,} | {r['reduction_vs_dp_bf16']:.1f} |")
  participation = ", ".join(f"{r['mean_learners_per_merge']:.2f}" for r in rows)
  model = ", ".join(f"{r['model_full_participation']:,.0f}" for r in rows)
  lines.append(f"\n{rows[0]['num_params']:,} parameters, P = {rows[0]['num_fragments']}, "
               f"M = {rows[0]['num_learners']} learners (DP: as many workers), K = 1: a learner "
               f"left out of a round sends nothing for it (mean learners per merge: "
               f"{participation}). Merges during training only; the final full-model flush is "
               f"left out. sim.bandwidth's model with every learner in every round: {model} B per "
               f"learner step. {seconds:.0f} s.")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w", encoding="utf-8") as f:
    json.dump({"rows": rows, "seconds": seconds, "targets": {"bf16": 24, "int4": 90}}, f, indent=2)
  with open(_OUT.value + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  errors.run_main(main)
