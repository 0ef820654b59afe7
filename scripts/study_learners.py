r"""Number of learners (docs/studies.md): M at equal total tokens (paper at 1.2M chips, text
average: M = 2 54.4, M = 4 55.0, M = 8 55.4; higher is better).

The paper splits the same chips M ways, so each learner gets 1/M of the global batch and every
learner makes the same number of steps. Here: the 8 fake CPU devices of tiny_cpu split into M
learners of 8/M devices each, per-learner batch 64/M sequences, the same steps for every arm, so
every arm trains the same tokens on the same devices; dp (one learner, batch 64) is the reference.
Figure: final eval loss of the global model (nats/token; lower is better), 2 seeds, mean (min-max).

  python scripts/study_learners.py                  # ~20 min on 2 cores
  python scripts/study_learners.py --num_steps=100 --seeds=0
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


from decoupled_diloco import errors

import study_common as sc  # pylint: disable=g-import-not-at-top

_NUM_STEPS, _SEEDS, _FRESH = sc.study_flags()

GLOBAL_BATCH = 64  # sequences per step over all learners (tiny_cpu: 4 learners x 16)
DEVICES = 8
PAPER = {"M=2": 54.4, "M=4": 55.0, "M=8": 55.4}  # text average at 1.2M chips (docs/design.md §7)


def arms() -> list[sc.Arm]:
  out = [sc.Arm("dp", {"mode": "dp", "num_learners": 4, "data.batch_size": GLOBAL_BATCH // 4,
                       "learner_mesh_shapes": ((2, 1),)})]
  for m in (2, 4, 8):
    out.append(sc.Arm(f"M={m}", {
        "num_learners": m, "data.batch_size": GLOBAL_BATCH // m,
        "learner_mesh_shapes": ((DEVICES // m, 1),)}))
  return out


def figures(workdir, summary):
  del workdir
  return {"final_eval_loss": summary["final_eval_loss"], "tokens": summary["tokens_trained"],
          "wall_seconds": summary["wall_seconds"], "merges": summary.get("merges", 0),
          "bytes_learner_syncer": summary.get("bytes_learner_syncer", 0)}


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  base = {"num_steps": _NUM_STEPS.value, "eval_every": 0, "eval_batches": 16}
  results = sc.run_study("learners", arms(), seeds, base=base, fresh=_FRESH.value,
                         figures=figures)
  stats = sc.summarize(results, ["final_eval_loss", "wall_seconds"])
  dp = stats["dp"]["final_eval_loss"]["mean"]
  rows = []
  for arm in results:
    loss = stats[arm]["final_eval_loss"]
    tokens = {r["tokens"] for r in results[arm].values()}
    rows.append([arm, sc.fmt(loss), f"{loss['mean'] / dp - 1:+.2%}", sc.paired(results, arm, "dp"),
                 f"{loss['spread']:.4f}", f"{tokens.pop():,}", str(PAPER.get(arm, "-"))])
  table = sc.markdown_table(
      ["arm", "final eval loss, nats/token (min-max)", "vs dp", "minus dp, per seed", "seed spread",
       "tokens", "paper text avg (higher better)"], rows)
  print(table)
  markdown = (f"# Study: number of learners at equal total tokens\n\n"
              f"`python scripts/study_learners.py --num_steps={_NUM_STEPS.value} "
              f"--seeds={','.join(map(str, seeds))}`: tiny_cpu, {_NUM_STEPS.value} steps, global "
              f"batch {GLOBAL_BATCH} sequences split over M learners on {DEVICES} fake CPU "
              f"devices; seeds {seeds}.\n\n{table}\n")
  report = {"num_steps": _NUM_STEPS.value, "seeds": seeds, "global_batch": GLOBAL_BATCH,
            "paper_text_avg": PAPER, "stats": stats, "runs": results}
  stem = sc.write("learners", report, markdown)
  _plot(stem, stats)


def _plot(stem, stats):
  plt = sc.pyplot()
  fig, (ours, paper) = plt.subplots(1, 2, figsize=(9, 3.5))
  names = [a for a in stats if a != "dp"]
  ms = [int(a.split("=")[1]) for a in names]
  loss = [stats[a]["final_eval_loss"] for a in names]
  ours.errorbar(ms, [s["mean"] for s in loss],
                yerr=sc.yerr(loss),
                marker="o", capsize=3, label="decoupled")
  ours.axhline(stats["dp"]["final_eval_loss"]["mean"], color="gray", ls="--", label="dp")
  ours.set(xscale="log", xlabel="learners M",
           ylabel="final eval loss (nats/token)", title="this framework, tiny_cpu")
  ours.legend()
  paper.plot(ms, [PAPER[a] for a in names], marker="s", color="C1")
  paper.set(xscale="log", xlabel="learners M",
            ylabel="text average (higher better)", title="paper, 1.2M chips")
  for ax in (ours, paper):
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
  sc.save_figure(fig, stem)


if __name__ == "__main__":
  errors.run_main(main)
