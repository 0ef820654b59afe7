r"""The merge rule and the merge weights (docs/studies.md).

A. Rule, at M = 8 (paper, text average: plain weighted average 54.1, RDA + embedding average 55.4):
   `merge.rule=average` against the default `rda` (the embedding is averaged either way). Same
   setup as study_learners' M = 8 arm (8 learners x 1 fake CPU device, batch 8 each), whose runs
   it shares.
B. Weights, which the paper does not ablate: 4 learners of batch sizes 8, 8, 16 and 32 sequences
   (`data.learner_batch_sizes`), merged with `merge.weighting` = uniform, tokens, or
   tokens^2/steps (the paper's "quantity x quality"; per learner and fragment the weights are then
   in the ratio 1:1:1:1, 1:1:2:4 and 1:1:4:16).

Figure: final eval loss of the global model, 2 seeds, mean (min-max).

  python scripts/study_merge_rule.py                # ~20 min on 2 cores
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


from decoupled_diloco import errors

import study_common as sc  # pylint: disable=g-import-not-at-top

_NUM_STEPS, _SEEDS, _FRESH = sc.study_flags()

PAPER = {"rda": 55.4, "average": 54.1}
BATCH_SIZES = (8, 8, 16, 32)
WEIGHTINGS = ("uniform", "tokens", "tokens_sq_over_steps")
# study_learners' M = 8 arm, the same overrides, so the two studies share its runs.
M8 = {"num_learners": 8, "data.batch_size": 8, "learner_mesh_shapes": ((1, 1),)}


def figures(workdir, summary):
  del workdir
  return {"final_eval_loss": summary["final_eval_loss"], "tokens": summary["tokens_trained"],
          "wall_seconds": summary["wall_seconds"], "merges": summary["merges"]}


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  base = {"num_steps": _NUM_STEPS.value, "eval_every": 0, "eval_batches": 16}
  rules = sc.run_study("merge_rule", [sc.Arm("rda", dict(M8)),
                                      sc.Arm("average", {**M8, "merge.rule": "average"})],
                       seeds, base=base, fresh=_FRESH.value, figures=figures)
  weights = sc.run_study(
      "merge_rule", [sc.Arm(w, {"merge.weighting": w, "data.learner_batch_sizes": BATCH_SIZES})
                     for w in WEIGHTINGS], seeds, base=base, fresh=_FRESH.value, figures=figures)
  keys = ["final_eval_loss"]
  rule_stats, weight_stats = sc.summarize(rules, keys), sc.summarize(weights, keys)
  rda = rule_stats["rda"]["final_eval_loss"]["mean"]
  rule_table = sc.markdown_table(
      ["rule (M = 8)", "final eval loss (min-max)", "vs rda", "minus rda, per seed", "seed spread",
       "paper text avg (higher better)"],
      [[r, sc.fmt(s["final_eval_loss"]), f"{s['final_eval_loss']['mean'] / rda - 1:+.2%}",
        sc.paired(rules, r, "rda"), f"{s['final_eval_loss']['spread']:.4f}", str(PAPER[r])]
       for r, s in rule_stats.items()])
  default = weight_stats["tokens_sq_over_steps"]["final_eval_loss"]["mean"]
  weight_table = sc.markdown_table(
      ["weighting (batches 8/8/16/32)", "final eval loss (min-max)", "vs tokens^2/steps",
       "minus tokens^2/steps, per seed", "seed spread"],
      [[w, sc.fmt(s["final_eval_loss"]), f"{s['final_eval_loss']['mean'] / default - 1:+.2%}",
        sc.paired(weights, w, "tokens_sq_over_steps"), f"{s['final_eval_loss']['spread']:.4f}"]
       for w, s in weight_stats.items()])
  print(rule_table)
  print(weight_table)
  markdown = (f"# Study: merge rule and merge weights\n\n`python scripts/study_merge_rule.py "
              f"--num_steps={_NUM_STEPS.value} --seeds={','.join(map(str, seeds))}`; seeds "
              f"{seeds}.\n\nA. Rule, 8 learners x 1 fake CPU device, batch 8 each:\n\n"
              f"{rule_table}\n\nB. Weights, 4 learners x 2 fake CPU devices, batches "
              f"{'/'.join(map(str, BATCH_SIZES))}:\n\n{weight_table}\n")
  report = {"num_steps": _NUM_STEPS.value, "seeds": seeds, "paper_text_avg": PAPER,
            "batch_sizes": BATCH_SIZES, "rule_stats": rule_stats, "weight_stats": weight_stats,
            "rule_runs": rules, "weight_runs": weights}
  stem = sc.write("merge_rule", report, markdown)
  _plot(stem, rule_stats, weight_stats)


def _plot(stem, rule_stats, weight_stats):
  plt = sc.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
  for ax, stats, title in ((axes[0], rule_stats, "rule, M = 8"),
                           (axes[1], weight_stats, "weights, batches 8/8/16/32")):
    names = list(stats)
    s = [stats[n]["final_eval_loss"] for n in names]
    ax.errorbar(range(len(names)), [x["mean"] for x in s],
                yerr=sc.yerr(s),
                fmt="o", capsize=3)
    ax.set(xticks=range(len(names)), xticklabels=names, ylabel="final eval loss (nats/token)",
           title=title)
  sc.save_figure(fig, stem)


if __name__ == "__main__":
  errors.run_main(main)
