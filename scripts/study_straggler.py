r"""One 2x straggler (docs/studies.md): one learner twice as slow. Wall-clock time to reach a fixed
eval loss for decoupled (K = 1 + grace), diloco (lock-step: every round waits for the slowest) and
dp (one synchronous job: every step waits for its slowest host).

The paper's promise: the fast learners are not held back. Here: tiny_cpu, 4 learners on 2 fake
CPU devices each; learner 3 sleeps one learner step more per step (2x slower). dp runs on the same 8
devices with batch 64 and sleeps one dp step more per step (its slowest host sets every step). Every
run evaluates the global model every `eval_every` steps of its fastest learner; the time to a loss
is read off those evaluations (linear between two, `at_s`: seconds since training started). The
target is the lowest loss that every run, with and without the straggler, reaches at an
evaluation during training (evaluations follow the fastest learner's clock and, once it has
finished, the slowest learner still training). Step times are measured by a calibration run of
each mode without a straggler (the first seed's), recorded in the results.

  python scripts/study_straggler.py                 # ~25 min on 2 cores
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from absl import flags

from decoupled_diloco import errors

import study_common as sc  # pylint: disable=g-import-not-at-top

_NUM_STEPS, _SEEDS, _FRESH = sc.study_flags()
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 20, "Steps between evaluations.")

MODES = ("decoupled", "diloco", "dp")
M = 4


def time_to(curve, target: float) -> float:
  """Seconds until the eval loss first reached `target`, linear between evaluations; inf if
  never."""
  prev = None
  for at_s, loss, _ in curve:
    if loss <= target:
      if prev is None or prev[1] == loss:
        return at_s
      (t0, l0), (t1, l1) = prev, (at_s, loss)
      return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    prev = (at_s, loss)
  return float("inf")


def step_seconds(summary) -> float:
  """Median seconds of a learner step of a run (its learners' mean steps/s)."""
  rates = summary["learner_steps_per_s"]
  return len(rates) / sum(rates)


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  base = {"num_steps": _NUM_STEPS.value, "eval_every": _EVAL_EVERY.value, "eval_batches": 8}
  # Calibration: each mode's learner step without a straggler, first seed only.
  calib = sc.run_study("straggler", [sc.Arm(f"{m} calibration", {"mode": m}) for m in MODES],
                       seeds[:1], base=base, fresh=_FRESH.value,
                       figures=lambda w, s: {"step_s": step_seconds(s),
                                             "final_eval_loss": s["final_eval_loss"],
                                             "curve": sc.eval_curve(s)})
  step_s = {m: calib[f"{m} calibration"][seeds[0]]["step_s"] for m in MODES}
  arms = []
  for m in MODES:
    delay = round(step_s[m], 4)
    delays = (delay,) * M if m == "dp" else (0.0,) * (M - 1) + (delay,)
    arms.append(sc.Arm(m, {"mode": m, "learner_step_delays_s": delays}))
  runs = sc.run_study("straggler", arms, seeds, base=base, fresh=_FRESH.value,
                      figures=lambda w, s: {"final_eval_loss": s["final_eval_loss"],
                                            "wall_seconds": s["wall_seconds"],
                                            "train_seconds": s["train_seconds"],
                                            "curve": sc.eval_curve(s)})
  # The loss every run (calibrations too) reaches at an evaluation during training (the final
  # evaluation left out: it follows the flush, not a step).
  target = max(min(loss for _, loss, _ in r["curve"][:-1])
               for results in (runs, calib) for by_seed in results.values()
               for r in by_seed.values())
  for by_seed in runs.values():
    for r in by_seed.values():
      r["seconds_to_target"] = time_to(r["curve"], target)
  for name, by_seed in calib.items():
    for r in by_seed.values():
      r["seconds_to_target"] = time_to(r["curve"], target)
  stats = sc.summarize(runs, ["seconds_to_target", "final_eval_loss", "train_seconds"])
  fastest = min(stats[m]["seconds_to_target"]["mean"] for m in MODES)
  rows = []
  for m in MODES:
    s = stats[m]
    no_straggler = calib[f"{m} calibration"][seeds[0]]["seconds_to_target"]
    rows.append([m, sc.fmt(s["seconds_to_target"], 1),
                 f"{s['seconds_to_target']['mean'] / fastest:.2f}", f"{no_straggler:.1f}",
                 f"{s['seconds_to_target']['mean'] / no_straggler:.2f}",
                 sc.fmt(s["final_eval_loss"]), f"{s['train_seconds']['mean']:.0f}"])
  table = sc.markdown_table(
      ["mode", f"s to eval loss {target:.4f} (min-max)", "vs fastest mode",
       "same, no straggler (seed 0)", "slowdown from the straggler", "final eval loss",
       "train s"], rows)
  print(table)
  markdown = (f"# Study: one 2x straggler\n\n`python scripts/study_straggler.py "
              f"--num_steps={_NUM_STEPS.value} --seeds={','.join(map(str, seeds))}`: tiny_cpu, "
              f"4 learners (dp: one job on the same 8 devices, batch 64); learner 3 (dp: every "
              f"step) delayed by one measured step: "
              f"{', '.join(f'{m} {step_s[m]:.3f} s' for m in MODES)}; seeds {seeds}. Target: the "
              f"lowest eval loss every run reaches at an evaluation during training, "
              f"{target:.4f}.\n\n{table}\n")
  report = {"num_steps": _NUM_STEPS.value, "seeds": seeds, "target_eval_loss": target,
            "step_s": step_s, "stats": stats, "runs": runs, "calibration": calib}
  stem = sc.write("straggler", report, markdown)
  _plot(stem, runs, calib, target, seeds[0])


def _plot(stem, runs, calib, target, seed):
  plt = sc.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, m in enumerate(MODES):
    for label, curve, style in ((f"{m}, 2x straggler", runs[m][seed]["curve"], "-"),
                                (f"{m}, none", calib[f"{m} calibration"][seed]["curve"], ":")):
      ax.plot([c[0] for c in curve], [c[1] for c in curve], style, color=f"C{i}", label=label)
  ax.axhline(target, color="gray", lw=0.8)
  ax.set(xlabel="seconds since training started", ylabel="eval loss (nats/token)",
         title=f"seed {seed}")
  ax.legend(fontsize=8)
  sc.save_figure(fig, stem)


if __name__ == "__main__":
  errors.run_main(main)
