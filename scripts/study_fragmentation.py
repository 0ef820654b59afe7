r"""Fragmentation (docs/studies.md): how the parameters are cut into fragments
(config.sync.fragmentation): balanced (the paper's default), round_robin and layer_strided
(Streaming DiLoCo's per-layer split).

The fragment that travels sets a step's bytes, so the figure is the peak bytes between the learners
and the syncer in one step (every merge that fell due at that step: offers up, Theta_p down to
every live learner), beside the static peak-to-ideal ratio of the split (largest fragment over
total / P) and the final eval loss. layer_strided needs P <= the number of layers, so every arm
runs P = num_layers = 4 (H = 24 as by default: one fragment falls due every 6 steps).

  python scripts/study_fragmentation.py             # ~15 min on 2 cores
"""

import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


from decoupled_diloco import errors

import study_common as sc  # pylint: disable=g-import-not-at-top

_NUM_STEPS, _SEEDS, _FRESH = sc.study_flags()

METHODS = ("balanced", "round_robin", "layer_strided")
NUM_FRAGMENTS = 4


def peak_bytes_per_step(workdir) -> tuple[int, float]:
  """(max, mean) over training steps of the bytes every merge due at that step moved (the final
  flush is left out: it moves every fragment at once, whatever the split)."""
  per_step = collections.Counter()
  for record in sc.metrics(workdir, "merge"):
    if not record["final"]:
      per_step[record["clock"]] += record["bytes_up"] + record["bytes_down"]
  values = list(per_step.values())
  return max(values), sum(values) / len(values)


def split_ratio(method: str) -> tuple[float, list[int]]:
  """Peak-to-ideal and the fragment sizes in bytes of tiny_cpu's parameters cut by `method`."""
  from decoupled_diloco.algorithm import fragments  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.lm import model  # pylint: disable=g-import-not-at-top
  from decoupled_diloco import settings  # pylint: disable=g-import-not-at-top
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top
  cfg = settings.validate(tiny_cpu.get_config()).model
  frags = fragments.partition(model.param_shapes(cfg), NUM_FRAGMENTS, method,
                              embedding_names=(model.EMBEDDING_NAME,))
  return fragments.peak_to_ideal(frags), [f.nbytes for f in frags]


def figures(workdir, summary):
  peak, mean = peak_bytes_per_step(workdir)
  return {"final_eval_loss": summary["final_eval_loss"], "peak_bytes_per_step": peak,
          "mean_bytes_per_step_with_a_merge": mean,
          "bytes_learner_syncer": summary["bytes_learner_syncer"], "merges": summary["merges"]}


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  base = {"num_steps": _NUM_STEPS.value, "eval_every": 0, "eval_batches": 16,
          "sync.num_fragments": NUM_FRAGMENTS}
  arms = [sc.Arm(m, {"sync.fragmentation": m}) for m in METHODS]
  results = sc.run_study("fragmentation", arms, seeds, base=base, fresh=_FRESH.value,
                         figures=figures)
  stats = sc.summarize(results, ["final_eval_loss", "peak_bytes_per_step",
                                 "mean_bytes_per_step_with_a_merge", "bytes_learner_syncer"])
  splits = {m: split_ratio(m) for m in METHODS}
  rows = []
  for m in METHODS:
    s = stats[m]
    ratio, sizes = splits[m]
    rows.append([m, f"{ratio:.2f}", " / ".join(f"{b / 1e3:.0f}" for b in sizes),
                 f"{s['peak_bytes_per_step']['mean'] / 1e6:.2f}",
                 f"{s['mean_bytes_per_step_with_a_merge']['mean'] / 1e6:.2f}",
                 sc.fmt(s["final_eval_loss"]), sc.paired(results, m, "balanced"),
                 f"{s['final_eval_loss']['spread']:.4f}"])
  table = sc.markdown_table(
      ["fragmentation", "peak / ideal", "fragments (kB)", "peak MB in one step",
       "mean MB in a step with a merge", "final eval loss (min-max)", "minus balanced, per seed",
       "seed spread"], rows)
  print(table)
  markdown = (f"# Study: fragmentation\n\n`python scripts/study_fragmentation.py "
              f"--num_steps={_NUM_STEPS.value} --seeds={','.join(map(str, seeds))}`: tiny_cpu "
              f"(4 learners), P = {NUM_FRAGMENTS}, H = 24, seeds {seeds}.\n\n{table}\n")
  report = {"num_steps": _NUM_STEPS.value, "seeds": seeds, "num_fragments": NUM_FRAGMENTS,
            "splits": {m: {"peak_to_ideal": r, "fragment_bytes": b} for m, (r, b) in
                       splits.items()}, "stats": stats, "runs": results}
  stem = sc.write("fragmentation", report, markdown)
  _plot(stem, stats, splits)


def _plot(stem, stats, splits):
  plt = sc.pyplot()
  fig, (sizes, loss) = plt.subplots(1, 2, figsize=(9, 3.5))
  for i, m in enumerate(METHODS):
    sizes.bar([i + 0.2 * k - 0.3 for k in range(NUM_FRAGMENTS)],
              [b / 1e3 for b in splits[m][1]], width=0.18, color=f"C{i}")
  sizes.set(xticks=range(len(METHODS)), xticklabels=METHODS, ylabel="fragment size (kB)",
            title="fragment sizes (one bar each)")
  losses = [stats[m]["final_eval_loss"] for m in METHODS]
  loss.errorbar(range(len(METHODS)), [s["mean"] for s in losses], yerr=sc.yerr(losses),
                fmt="o", capsize=3)
  loss.set(xticks=range(len(METHODS)), xticklabels=METHODS, ylabel="final eval loss (nats/token)",
           title="global model, seeds min-max")
  sc.save_figure(fig, stem)


if __name__ == "__main__":
  errors.run_main(main)
