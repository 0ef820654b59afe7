"""Goodput vs cluster size for DP, elastic DP and Decoupled DiLoCo, ours beside the paper's Table 1.

  .venv/bin/python scripts/simulate_goodput.py                      # the paper's grid, 5 seeds
  .venv/bin/python scripts/simulate_goodput.py --chips=50000 --mtbi_years=0.5 --learners=4

Prints the grid (ours, paper, difference), uptime, a badput breakdown and the seed-to-seed spread;
writes results/goodput_table.json and results/goodput_vs_chips.png. The paper's numbers are only
printed and plotted beside ours: the simulator never reads them.
"""

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np

from decoupled_diloco import errors
from decoupled_diloco.sim import accounting, goodput, published
from decoupled_diloco.sim.cluster import ClusterParams

_DEFAULTS = ClusterParams()
FLAGS = flags.FLAGS
flags.DEFINE_float("mtbi_years", _DEFAULTS.mtbi_years, "Per-chip mean time between interruptions.")
flags.DEFINE_list("chips", [str(n) for n in published.CHIPS], "Cluster sizes N (chips).")
flags.DEFINE_list("learners", [str(m) for m in published.LEARNER_COUNTS],
                  "Learner counts M of the decoupled systems.")
flags.DEFINE_float("horizon_days", 14.0, "Simulated (measured) days per system, size and seed.")
flags.DEFINE_integer("seed", 0, "First seed.")
flags.DEFINE_integer("num_seeds", 5, "Seeds seed..seed+num_seeds-1; the table is their mean.")
flags.DEFINE_integer("slice_chips", _DEFAULTS.slice_chips, "Chips per slice.")
flags.DEFINE_float("weibull_shape", _DEFAULTS.weibull_shape, "Shape of all random durations.")
flags.DEFINE_float("repair_s", _DEFAULTS.repair_s, "Mean repair time of a failed slice (s).")
flags.DEFINE_float("reconfig_s", _DEFAULTS.reconfig_s, "Mean elastic re-configuration pause (s).")
flags.DEFINE_float("restart_s", _DEFAULTS.restart_s, "Mean restart of a non-elastic job (s).")
flags.DEFINE_float("step_s", _DEFAULTS.step_s, "Step time = checkpoint interval (s).")
flags.DEFINE_float("rejoin_discount", 0.0, "Share of a rejoining learner's stale steps not counted.")
flags.DEFINE_integer("rejoin_stale_steps", 24, "Stale steps after each pause of a learner.")
flags.DEFINE_integer("sync_period_steps", 0,
                     "H: a crashed learner also loses each fragment's unmerged progress (H/2 steps "
                     "once it ran H); 0 = only the step in flight, the paper's model.")
flags.DEFINE_float("receive_lag_steps", 0.0,
                   "d: the overwrite on receive drops d of every H steps (needs "
                   "--sync_period_steps); scripts/bench_sim_to_real.py measured 1.0.")
flags.DEFINE_string("out_dir", "results", "Where the JSON table and the plot go ('' = nowhere).")


def _fmt_chips(n: int) -> str:
  return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def _paper_row(key: str, chips: list, mtbi_years: float) -> list:
  """The paper's goodput (%) at each of `chips`, None where it has no such point."""
  if mtbi_years != published.MTBI_YEARS or key not in published.GOODPUT:
    return [None] * len(chips)
  by_chips = dict(zip(published.CHIPS, published.GOODPUT[key]))
  return [by_chips.get(n) for n in chips]


def _markdown_grid(keys, chips, ours, paper, spread) -> str:
  head = "| system | " + " | ".join(_fmt_chips(n) for n in chips) + " |"
  lines = [head, "|---" * (len(chips) + 1) + "|"]
  for key in keys:
    cells = []
    for g, p, s in zip(ours[key], paper[key], spread[key]):
      cell = f"{g:.1f} ±{s / 2:.1f}"
      if p is not None:
        cell += f" ({p}, {g - p:+.1f})"
      cells.append(cell)
    lines.append(f"| {key} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _plot(path: pathlib.Path, keys, chips, ours, paper) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7.5, 5))
  for i, key in enumerate(keys):
    color = f"C{i}"
    ax.plot(chips, ours[key], "-", color=color, label=f"{key} (ours)")
    points = [(n, p) for n, p in zip(chips, paper[key]) if p is not None]
    if points:
      ax.plot(*zip(*points), "o", color=color, markerfacecolor="none", markersize=8)
  ax.plot([], [], "ko", markerfacecolor="none", label="paper (Table 1)")
  ax.set_xscale("log")
  ax.set_xticks(chips)
  ax.set_xticklabels([_fmt_chips(n) for n in chips])
  ax.minorticks_off()
  ax.set_xlabel("chips")
  ax.set_ylabel("goodput (%)")
  ax.set_ylim(0, 100)
  ax.grid(alpha=0.3)
  unit = "year" if FLAGS.mtbi_years == 1 else "years"
  ax.set_title(f"Goodput vs chips, chip MTBI = {FLAGS.mtbi_years:g} {unit}; circles: the paper")
  ax.legend(fontsize=8, loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  chips = [int(float(n)) for n in FLAGS.chips]
  learners = [int(m) for m in FLAGS.learners]
  params = ClusterParams(
      mtbi_years=FLAGS.mtbi_years, slice_chips=FLAGS.slice_chips,
      weibull_shape=FLAGS.weibull_shape, repair_s=FLAGS.repair_s, reconfig_s=FLAGS.reconfig_s,
      restart_s=FLAGS.restart_s, step_s=FLAGS.step_s)
  options = goodput.DecoupledOptions(rejoin_stale_steps=FLAGS.rejoin_stale_steps,
                                     rejoin_discount=FLAGS.rejoin_discount,
                                     sync_period_steps=FLAGS.sync_period_steps,
                                     receive_lag_steps=FLAGS.receive_lag_steps)
  seeds = list(range(FLAGS.seed, FLAGS.seed + FLAGS.num_seeds))

  grids, seconds = [], []
  for seed in seeds:
    start = time.perf_counter()
    grids.append(goodput.simulate_grid(chips, learners, params, horizon_days=FLAGS.horizon_days,
                                       seed=seed, decoupled=options))
    seconds.append(time.perf_counter() - start)
  keys = list(grids[0])

  def per_cell(field):
    # [seed, chips] array of a result field, in %.
    return {k: 100 * np.array([[getattr(r, field) for r in g[k]] for g in grids]) for k in keys}

  good, up = per_cell("goodput"), per_cell("uptime")
  ours = {k: good[k].mean(0) for k in keys}
  uptime = {k: up[k].mean(0) for k in keys}
  spread = {k: good[k].max(0) - good[k].min(0) for k in keys}
  paper = {k: _paper_row(k, chips, FLAGS.mtbi_years) for k in keys}
  badput = {k: {b: [round(100 * float(np.mean([g[k][i].badput[b] for g in grids])), 2)
                    for i in range(len(chips))] for b in accounting.BUCKETS} for k in keys}
  errors = [abs(g - p) for k in keys for g, p in zip(ours[k], paper[k]) if p is not None]

  print(f"Goodput (%), mean of {len(seeds)} seeds ± half the seed-to-seed range, "
        f"(paper, ours - paper). {FLAGS.horizon_days:g} simulated days per cell.")
  print(_markdown_grid(keys, chips, ours, paper, spread))
  print("\nUptime (%): share of time the system as a whole advances.")
  print("| system | " + " | ".join(_fmt_chips(n) for n in chips) + " |")
  print("|---" * (len(chips) + 1) + "|")
  for k in keys:
    print(f"| {k} | " + " | ".join(f"{u:.2f}" for u in uptime[k]) + " |")
  print(f"\nBadput (% of allocated chip-time) at {_fmt_chips(chips[-1])} chips:")
  print("| system | " + " | ".join(accounting.BUCKETS) + " |")
  print("|---" * (len(accounting.BUCKETS) + 1) + "|")
  for k in keys:
    print(f"| {k} | " + " | ".join(f"{badput[k][b][-1]:.2f}" for b in accounting.BUCKETS) + " |")
  if errors:
    print(f"\nMax |ours - paper| = {max(errors):.2f} points over {len(errors)} cells; "
          f"{sum(e <= 3.0 for e in errors)}/{len(errors)} within 3 points.")
  print(f"Largest seed-to-seed range of a cell: {max(s.max() for s in spread.values()):.2f} points.")
  print(f"One grid: {np.mean(seconds):.1f} s (min {min(seconds):.1f} s); all seeds: "
        f"{sum(seconds):.1f} s.")
  print(f"Parameters: {params.as_dict()}")

  if FLAGS.out_dir:
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = {
        "chips": chips,
        "goodput": {k: [round(float(v), 2) for v in ours[k]] for k in keys},
        "uptime": {k: [round(float(v), 2) for v in uptime[k]] for k in keys},
        "paper": paper,
        "params": params.as_dict(),
        "seconds": round(float(np.mean(seconds)), 2),
        "seconds_all_seeds": round(float(sum(seconds)), 2),
        "seeds": seeds,
        "horizon_days": FLAGS.horizon_days,
        "seed_range": {k: [round(float(v), 2) for v in spread[k]] for k in keys},
        "badput": badput,
        "badput_ml_goodput_types": {b: list(t) for b, t in accounting.ML_GOODPUT_BADPUT_TYPES.items()},
        "decoupled_options": {"rejoin_stale_steps": options.rejoin_stale_steps,
                              "rejoin_discount": options.rejoin_discount,
                              "sync_period_steps": options.sync_period_steps,
                              "receive_lag_steps": options.receive_lag_steps},
    }
    (out / "goodput_table.json").write_text(json.dumps(table, indent=1) + "\n")
    _plot(out / "goodput_vs_chips.png", keys, chips, ours, paper)
    print(f"Wrote {out / 'goodput_table.json'} and {out / 'goodput_vs_chips.png'}")


if __name__ == "__main__":
  errors.run_main(main)
