"""Cross-datacenter bandwidth and wall-clock time of DP vs Decoupled DiLoCo, beside the paper's claims.

  .venv/bin/python scripts/bandwidth_table.py
  .venv/bin/python scripts/bandwidth_table.py --num_params=5e9 --step_s=0.5 --datacenters=2,8

Prints Markdown tables (required bandwidth and reduction factor; which assumptions reproduce the
paper's 60-242x and 198 -> 0.84 Gbit/s; DP step time at 2-5 Gbit/s WAN) and writes
results/bandwidth_table.json. Every formula is in decoupled_diloco/sim/bandwidth.py.
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags  # pylint: disable=g-import-not-at-top

from decoupled_diloco import errors
from decoupled_diloco.sim import bandwidth as bw
from decoupled_diloco.sim import published

FLAGS = flags.FLAGS
flags.DEFINE_float("num_params", 12e9, "Parameters N (the paper's WAN run: 12B).")
flags.DEFINE_float("step_s", 1.0, "Inner step (compute) time t, seconds.")
flags.DEFINE_list("datacenters", ["4", "8"], "Datacenter counts D (one learner per datacenter).")
flags.DEFINE_integer("num_fragments", 24, "P.")
flags.DEFINE_integer("sync_period", 24, "H.")
flags.DEFINE_integer("overlap", 2, "τ: steps a fragment's sync may take.")
flags.DEFINE_integer("block_size", bw.DEFAULT_BLOCK_SIZE, "Values per fp32 scale (int8 / int4).")
flags.DEFINE_string("grad_format", "bf16", "DP gradient all-reduce format.")
flags.DEFINE_list("outer_formats", ["bf16", "int8", "int4"], "Decoupled wire formats (both ways).")
flags.DEFINE_list("wan_gbits", ["2", "3", "5"], "WAN bandwidths per datacenter, Gbit/s.")
flags.DEFINE_integer("wallclock_datacenters", 4, "D of the wall-clock comparison (4 US regions).")
flags.DEFINE_string("out_dir", "results", "Where bandwidth_table.json goes ('' = nowhere).")


def _ddl_gbits(fmt, **overrides):
  kw = dict(num_params=FLAGS.num_params, num_fragments=FLAGS.num_fragments, step_s=FLAGS.step_s,
            outer_grad_format=fmt, broadcast_format=fmt, block_size=FLAGS.block_size,
            sync_period=FLAGS.sync_period, overlap=FLAGS.overlap)
  kw.update(overrides)
  return bw.decoupled_wan_gbits(**kw)


def bandwidth_rows(datacenters):
  rows = []
  for d in datacenters:
    dp = bw.dp_wan_gbits(FLAGS.num_params, d, FLAGS.step_s, FLAGS.grad_format)
    for fmt in FLAGS.outer_formats:
      ddl = _ddl_gbits(fmt)
      rows.append({"datacenters": d, "outer_format": fmt, "dp_gbits": dp, "decoupled_gbits": ddl,
                   "reduction": dp / ddl})
  return rows


def assumption_rows(d):
  """Our reduction factor at D datacenters under alternative assumptions, bf16 -> int4."""
  h, b = FLAGS.sync_period, FLAGS.block_size
  sets = [
      ("ours: hierarchical ring, bf16 DP gradients, one fragment per step", 1.0, 1.0, b),
      ("DP all-reduces fp32 gradients", 2.0, 1.0, b),
      ("DP: one flat ring over all chips (link load 2·N·b, not 2·(D-1)/D·N·b)",
       d / (d - 1), 1.0, b),
      ("Decoupled link sized to move one fragment in τ steps (τ fragments in flight ignored)",
       1.0, float(FLAGS.overlap), b),
      ("int4 without block scales (4.0 bits, not 4 + 32/B)", 1.0, 1.0, 1 << 30),
  ]
  rows = []
  for name, dp_factor, ddl_factor, block in sets:
    ratios = {}
    for fmt in ("bf16", "int4"):
      dp = bw.dp_ring_allreduce_bytes_per_step(1.0, d, 1.0) * bw.bits_per_value(FLAGS.grad_format)
      ddl = bw.bits_per_value(fmt, block) / h
      ratios[fmt] = dp * dp_factor * ddl_factor / ddl
    rows.append({"assumption": name, "bf16": ratios["bf16"], "int4": ratios["int4"]})
  return rows


def implied_by_paper():
  """What our formulas say about the paper's 198 Gbit/s (DP) and 0.84 Gbit/s (Decoupled), D = 8."""
  d = 8
  dp_per_param = bw.dp_wan_gbits(1.0, d, 1.0, FLAGS.grad_format)  # Gbit/s per (param / s)
  params_per_s = published.DP_GBITS_8_DATACENTERS / dp_per_param
  ours = {fmt: bw.decoupled_wan_gbits(params_per_s, FLAGS.num_fragments, 1.0, fmt, fmt,
                                      FLAGS.block_size, FLAGS.sync_period, FLAGS.overlap)
          for fmt in ("bf16", "int8", "int4")}
  bits = published.DECOUPLED_GBITS_8_DATACENTERS * 1e9 * FLAGS.sync_period / params_per_s
  return {"dp_params_per_second": params_per_s, "decoupled_gbits_ours": ours,
          "paper_decoupled_gbits": published.DECOUPLED_GBITS_8_DATACENTERS,
          "paper_bits_per_value_implied": bits}


def wallclock_rows():
  d, rows = FLAGS.wallclock_datacenters, []
  for w in (float(x) for x in FLAGS.wan_gbits):
    dp_t = bw.dp_step_s(FLAGS.num_params, d, FLAGS.step_s, w, FLAGS.grad_format)
    dp_int8_t = bw.dp_step_s(FLAGS.num_params, d, FLAGS.step_s, w, "int8")
    row = {"wan_gbits": w, "dp_step_s": dp_t, "dp_int8_step_s": dp_int8_t}
    for fmt in FLAGS.outer_formats:
      t = bw.decoupled_step_s(FLAGS.num_params, FLAGS.num_fragments, FLAGS.step_s, w, fmt, fmt,
                              FLAGS.block_size, FLAGS.sync_period, FLAGS.overlap)
      row[f"decoupled_{fmt}_step_s"] = t
      row[f"speedup_{fmt}"] = dp_t / t
      row[f"speedup_{fmt}_vs_dp_int8"] = dp_int8_t / t
    rows.append(row)
  return rows


def main(argv):
  del argv
  datacenters = [int(d) for d in FLAGS.datacenters]
  n_b = FLAGS.num_params / 1e9
  lo, hi = published.BANDWIDTH_REDUCTION_RANGE

  rows = bandwidth_rows(datacenters)
  print(f"Required WAN bandwidth per datacenter, each direction: N = {n_b:g}B, t = {FLAGS.step_s:g} s,"
        f" P = {FLAGS.num_fragments}, H = {FLAGS.sync_period}, τ = {FLAGS.overlap}, "
        f"DP gradients {FLAGS.grad_format}, block {FLAGS.block_size}.")
  print("| D | Decoupled format | DP Gbit/s | Decoupled Gbit/s | reduction | paper |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['datacenters']} | {r['outer_format']} | {r['dp_gbits']:.1f} | "
          f"{r['decoupled_gbits']:.2f} | {r['reduction']:.0f}x | {lo}-{hi}x |")

  d_ref = max(datacenters)
  assumptions = assumption_rows(d_ref)
  paper_ratio = published.DP_GBITS_8_DATACENTERS / published.DECOUPLED_GBITS_8_DATACENTERS
  print(f"\nReduction factor at D = {d_ref} under other assumptions (paper: {lo}x ... {hi}x, "
        f"198 -> 0.84 Gbit/s = {paper_ratio:.0f}x):")
  print("| assumption | bf16 | int4 |")
  print("|---|---|---|")
  for r in assumptions:
    print(f"| {r['assumption']} | {r['bf16']:.0f}x | {r['int4']:.0f}x |")

  implied = implied_by_paper()
  print(f"\nDP needs {published.DP_GBITS_8_DATACENTERS:g} Gbit/s across 8 datacenters in our model "
        f"when "
        f"N/t = {implied['dp_params_per_second'] / 1e9:.2f}B parameters/s ({FLAGS.grad_format} "
        f"gradients; e.g. a 7B model at 1 s/step, or the 12B one at "
        f"{12e9 / implied['dp_params_per_second']:.1f} s/step). At that N/t our Decoupled needs "
        + ", ".join(f"{v:.2f} Gbit/s ({k})" for k, v in implied["decoupled_gbits_ours"].items())
        + f"; the paper's {implied['paper_decoupled_gbits']} Gbit/s implies "
        f"{implied['paper_bits_per_value_implied']:.2f} bits a value at H = {FLAGS.sync_period}.")

  wall = wallclock_rows()
  print(f"\nWall-clock per step, {n_b:g}B across {FLAGS.wallclock_datacenters} datacenters, compute "
        f"{FLAGS.step_s:g} s/step (paper: Decoupled more than "
        f"{published.WALL_CLOCK_SPEEDUP_AT_LEAST:g}x faster at 2-5 Gbit/s):")
  head = "| WAN Gbit/s | DP s/step | DP-int8 s/step | " + " | ".join(
      f"Decoupled {f} s/step (speed-up vs DP, vs DP-int8)" for f in FLAGS.outer_formats) + " |"
  print(head)
  print("|---" * (3 + len(FLAGS.outer_formats)) + "|")
  for r in wall:
    cells = [f"{r[f'decoupled_{f}_step_s']:.2f} ({r[f'speedup_{f}']:.0f}x, "
             f"{r[f'speedup_{f}_vs_dp_int8']:.0f}x)" for f in FLAGS.outer_formats]
    print(f"| {r['wan_gbits']:g} | {r['dp_step_s']:.1f} | {r['dp_int8_step_s']:.1f} | "
          + " | ".join(cells) + " |")

  if FLAGS.out_dir:
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = {
        "settings": {"num_params": FLAGS.num_params, "step_s": FLAGS.step_s,
                     "num_fragments": FLAGS.num_fragments, "sync_period": FLAGS.sync_period,
                     "overlap": FLAGS.overlap, "block_size": FLAGS.block_size,
                     "grad_format": FLAGS.grad_format, "wallclock_datacenters":
                     FLAGS.wallclock_datacenters},
        "bandwidth": rows,
        "assumptions_at_datacenters": d_ref,
        "assumptions": assumptions,
        "implied_by_paper": implied,
        "wallclock": wall,
        "paper": {"reduction_range": list(published.BANDWIDTH_REDUCTION_RANGE),
                  "dp_gbits_8_datacenters": published.DP_GBITS_8_DATACENTERS,
                  "decoupled_gbits_8_datacenters": published.DECOUPLED_GBITS_8_DATACENTERS,
                  "wan_gbits": list(published.WAN_GBITS_RANGE),
                  "speedup_at_least": published.WALL_CLOCK_SPEEDUP_AT_LEAST},
    }
    (out / "bandwidth_table.json").write_text(json.dumps(table, indent=1) + "\n")
    print(f"\nWrote {out / 'bandwidth_table.json'}")


if __name__ == "__main__":
  errors.run_main(main)
