r"""Heterogeneous learners and the grace window (docs/studies.md; docs/design.md §4's table).

Paper: 4 learners on TPU v6e + 4 on v5p, steps about 18% apart, 10% extra step noise:

  | setting             | goodput | text avg |
  | K = 8 (wait for all) | 84%     | 54.4     |
  | K = 1               | 100%    | 51.4     |
  | K = 1 + grace       | 100%    | 55.3     |

Here: 8 learners on one fake CPU device each (global batch 64, per-learner batch 8); learners 4-7
sleep 18% of a learner step more per step (`learner_step_delays_s`), every learner sleeps a
uniform extra of mean `noise` x step (`learner_step_noise_s`; uniform [0, 2a) has std a / sqrt(3),
so a = 0.173 step gives std 10% of a step). Arms: quorum K = 8; K = 1 with the grace window shut
(`sync.grace_gamma=0`); K = 1 with the default grace window (gamma 0.5). Every learner makes the same
number of steps in every arm, so the arms take the same wall clock (the slow learners set it; the
table shows it): a learner never waits here, so what K = 8 costs is the fast learners' steps that
the overwrite on receive throws away while a merge waits for the slow ones, which the goodput
(learner-seconds on steps that reached the global model) counts. Figures: goodput and final eval
loss, 2 seeds, mean (min-max).

  python scripts/study_hetero.py                    # ~20 min on 2 cores
"""

import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from absl import flags

from decoupled_diloco import errors

import study_common as sc  # pylint: disable=g-import-not-at-top

_NUM_STEPS, _SEEDS, _FRESH = sc.study_flags()
# Seconds of one learner step with 8 learners sharing this 2-core machine, measured from the
# learners' steps/s in study_learners' M = 8 runs (1.73 steps/s, 2026-11-25).
_STEP_S = flags.DEFINE_float("step_s", 0.58, "A learner step's seconds without delay or noise.")
_SLOWER = flags.DEFINE_float("slower", 0.18, "Learners 4-7 take this much longer per step.")
_NOISE = flags.DEFINE_float("noise_std", 0.10, "Step noise, std as a fraction of a step.")

PAPER = {"K=8": (0.84, 54.4), "K=1, no grace": (1.00, 51.4), "K=1 + grace": (1.00, 55.3)}
M = 8


def arms() -> list[sc.Arm]:
  return [sc.Arm("K=8", {"sync.quorum": 8}),
          sc.Arm("K=1, no grace", {"sync.quorum": 1, "sync.grace_gamma": 0.0}),
          sc.Arm("K=1 + grace", {"sync.quorum": 1})]


def figures(workdir, summary):
  rates = summary["learner_steps_per_s"]
  merges = sc.metrics(workdir, "merge")
  regular = [r for r in merges if not r["final"]]
  return {"final_eval_loss": summary["final_eval_loss"], "goodput": summary["goodput"],
          "wall_seconds": summary["wall_seconds"],
          "fast_steps_per_s": statistics.fmean(rates[:M // 2]),
          "slow_steps_per_s": statistics.fmean(rates[M // 2:]),
          "learners_per_merge": statistics.fmean(len(r["learners"]) for r in regular),
          "grace_waited_s": statistics.fmean(r["grace_waited_s"] for r in regular),
          "quorum_wait_s": statistics.fmean(r["quorum_wait_s"] for r in regular),
          "discarded_progress": statistics.fmean(summary["discarded_progress"])}


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  step = _STEP_S.value
  noise = _NOISE.value * 3 ** 0.5 * step  # uniform [0, 2a): std a / sqrt(3)
  base = {"num_steps": _NUM_STEPS.value, "eval_every": 0, "eval_batches": 16,
          "num_learners": M, "data.batch_size": 64 // M, "learner_mesh_shapes": ((1, 1),),
          "learner_step_delays_s": (0.0,) * (M // 2) + (round(_SLOWER.value * step, 4),) * (M // 2),
          "learner_step_noise_s": round(noise, 4)}
  results = sc.run_study("hetero", arms(), seeds, base=base, fresh=_FRESH.value,
                         figures=figures)
  keys = ["final_eval_loss", "goodput", "wall_seconds", "fast_steps_per_s", "slow_steps_per_s",
          "learners_per_merge", "grace_waited_s", "quorum_wait_s", "discarded_progress"]
  stats = sc.summarize(results, keys)
  rows = []
  for arm in results:
    s = stats[arm]
    goodput, avg = PAPER[arm]
    rows.append([arm, sc.fmt(s["goodput"], 3), sc.fmt(s["final_eval_loss"]),
                 sc.paired(results, arm, "K=1 + grace"), f"{s['final_eval_loss']['spread']:.4f}",
                 f"{s['wall_seconds']['mean']:.0f}",
                 f"{s['slow_steps_per_s']['mean'] / s['fast_steps_per_s']['mean']:.2f}",
                 f"{s['learners_per_merge']['mean']:.2f}", f"{s['quorum_wait_s']['mean']:.3f}",
                 f"{s['grace_waited_s']['mean']:.3f}", f"{goodput:.0%} / {avg}"])
  table = sc.markdown_table(
      ["arm", "goodput (min-max)", "final eval loss (min-max)", "minus K=1 + grace, per seed",
       "seed spread", "wall s", "slow / fast steps/s", "learners per merge", "quorum wait s",
       "grace waited s", "paper goodput / text avg"], rows)
  print(table)
  markdown = (f"# Study: heterogeneous learners and the grace window\n\n"
              f"`python scripts/study_hetero.py --num_steps={_NUM_STEPS.value} "
              f"--seeds={','.join(map(str, seeds))} --step_s={step}`: 8 learners x 1 fake CPU "
              f"device, batch 8 each, learners 4-7 delayed {_SLOWER.value:.0%} of a "
              f"{step} s step, every learner U[0, {2 * noise:.3f}) s of noise per step "
              f"(std {_NOISE.value:.0%} of a step); seeds {seeds}.\n\n{table}\n")
  report = {"num_steps": _NUM_STEPS.value, "seeds": seeds, "step_s": step, "base": base,
            "paper": PAPER, "stats": stats, "runs": results}
  stem = sc.write("hetero", report, markdown)
  _plot(stem, stats)


def _plot(stem, stats):
  plt = sc.pyplot()
  names = list(stats)
  fig, (ours, paper) = plt.subplots(1, 2, figsize=(10, 3.8))
  for arm in names:
    s = stats[arm]
    ours.errorbar(s["goodput"]["mean"], s["final_eval_loss"]["mean"],
                  xerr=sc.yerr([s["goodput"]]), yerr=sc.yerr([s["final_eval_loss"]]),
                  fmt="o", capsize=3, label=arm)
    paper.scatter(PAPER[arm][0], PAPER[arm][1], label=arm)
  ours.set(xlabel="goodput", ylabel="final eval loss (nats/token, lower better)",
           title="this framework, tiny_cpu, 8 learners")
  paper.set(xlabel="goodput", ylabel="text average (higher better)", title="paper")
  ours.legend()
  paper.legend()
  sc.save_figure(fig, stem)


if __name__ == "__main__":
  errors.run_main(main)
