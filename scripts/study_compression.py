r"""The compression ladder, both ways (docs/studies.md).

Uplink: the outer gradients in fp32, bf16, int8, int4, int2 and int1 (`compression.outer_grad`;
per-block absmax scales, see algorithm/compression.py), every arm with Theta_p broadcast in bf16.
Paper: int4 nearly lossless (text 55.3 vs 55.4), 2-bit and 1-bit collapse.
Downlink: Theta_p sent as a compressed delta against the version the learner holds
(`compression.broadcast_delta`; the syncer keeps what the learners reconstruct, so the
quantisation error does not pile up; whole values, "keyframes", go in fp32 to a learner not known
to hold the delta's base), with int4 outer gradients.

Bytes are what the runtime counted on the wire per learner step (up + down, merges during
training; the final flush is left out), against one worker of a bf16-gradient data-parallel ring
all-reduce over the same 4 workers (2 x 2 (n-1)/n x N x 2 bytes per step, scripts/bench_bandwidth.py).
Goal: >= 90x less than that DP with eval loss within 0.5% of bf16 both ways.

  python scripts/study_compression.py               # ~40 min on 2 cores (8 arms x 2 seeds)
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


import study_common as sc  # pylint: disable=g-import-not-at-top
from decoupled_diloco import errors
from decoupled_diloco.sim import bandwidth  # pylint: disable=g-import-not-at-top

_NUM_STEPS, _SEEDS, _FRESH = sc.study_flags()

M = 4
REFERENCE = "bf16 / bf16"
PAPER = {"bf16 / bf16": "55.4", "int4 / bf16": "55.3 (nearly lossless)",
         "int2 / bf16": "collapses", "int1 / bf16": "collapses"}


def arms() -> list[sc.Arm]:
  out = [sc.Arm(f"{fmt} / bf16", {"compression.outer_grad": fmt, "compression.broadcast": "bf16"})
         for fmt in ("fp32", "bf16", "int8", "int4", "int2", "int1")]
  # Deltas need exact keyframes: compression.broadcast fp32 (only whole values travel in it).
  for delta in ("int8", "int4"):
    out.append(sc.Arm(f"int4 / delta {delta}", {
        "compression.outer_grad": "int4", "compression.broadcast": "fp32",
        "compression.broadcast_delta": delta}))
  return out


def figures(workdir, summary):
  regular = [r for r in sc.metrics(workdir, "merge") if not r["final"]]
  steps = sum(summary["learner_steps"])
  up = sum(r["bytes_up"] for r in regular) / steps
  down = sum(r["bytes_down"] for r in regular) / steps
  return {"final_eval_loss": summary["final_eval_loss"], "up_bytes_per_step": up,
          "down_bytes_per_step": down, "bytes_per_step": up + down,
          "num_params": summary["num_params"]}


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  base = {"num_steps": _NUM_STEPS.value, "eval_every": 0, "eval_batches": 16}
  results = sc.run_study("compression", arms(), seeds, base=base, fresh=_FRESH.value,
                         figures=figures)
  stats = sc.summarize(results, ["final_eval_loss", "up_bytes_per_step", "down_bytes_per_step",
                                 "bytes_per_step"])
  num_params = next(iter(next(iter(results.values())).values()))["num_params"]
  dp_bf16 = 2 * bandwidth.dp_ring_allreduce_bytes_per_step(num_params, M, 2)
  ref = stats[REFERENCE]["final_eval_loss"]["mean"]
  rows = []
  for arm, s in stats.items():
    rows.append([arm, f"{s['up_bytes_per_step']['mean']:,.0f}",
                 f"{s['down_bytes_per_step']['mean']:,.0f}", f"{s['bytes_per_step']['mean']:,.0f}",
                 f"{dp_bf16 / s['bytes_per_step']['mean']:.1f}", sc.fmt(s["final_eval_loss"]),
                 f"{s['final_eval_loss']['mean'] / ref - 1:+.2%}",
                 f"{s['final_eval_loss']['spread']:.4f}", PAPER.get(arm, "-")])
  table = sc.markdown_table(
      ["outer grad / Theta", "up B/step", "down B/step", "total B/step", "x less than DP bf16",
       "final eval loss (min-max)", f"vs {REFERENCE}", "seed spread", "paper"], rows)
  print(table)
  markdown = (f"# Study: compression ladder\n\n`python scripts/study_compression.py "
              f"--num_steps={_NUM_STEPS.value} --seeds={','.join(map(str, seeds))}`: tiny_cpu "
              f"({num_params:,} parameters, M = {M}, P = H = 24), seeds {seeds}. Bytes per "
              f"learner step, merges during training; a DP worker's bf16 ring all-reduce over "
              f"{M} workers moves {dp_bf16:,.0f} B per step.\n\n{table}\n")
  report = {"num_steps": _NUM_STEPS.value, "seeds": seeds, "num_params": num_params,
            "dp_bf16_bytes_per_step": dp_bf16, "stats": stats, "runs": results}
  stem = sc.write("compression", report, markdown)
  _plot(stem, stats, dp_bf16)


def _plot(stem, stats, dp_bf16):
  plt = sc.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for i, (arm, s) in enumerate(stats.items()):
    loss = s["final_eval_loss"]
    ax.errorbar(dp_bf16 / s["bytes_per_step"]["mean"], loss["mean"],
                yerr=sc.yerr([loss]), fmt="o",
                capsize=3, color=f"C{i}", label=arm)
  ax.axvline(90, color="gray", ls=":", lw=0.8)
  ax.set(xscale="log", xlabel="x fewer bytes per step than a bf16-gradient DP worker",
         ylabel="final eval loss (nats/token)", title="compression ladder")
  ax.legend(fontsize=8)
  sc.save_figure(fig, stem)


if __name__ == "__main__":
  errors.run_main(main)
